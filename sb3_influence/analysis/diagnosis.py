"""
Diagnosis of learning (the paper's Sec. 4.1): which records of a round hurt the return, and why.

The records with the most negative influence on ``f_return`` tend to carry wrong advantage estimates (sign
flips, large errors). :func:`top_bottom_records` lists the extremes of a snapshot with their advantages; on a
tabular environment (FrozenLake) :func:`tabular_true_advantages` solves the current policy's values exactly and
:func:`advantage_correlation` gives the Spearman correlation between influence and ``Ā·Â`` (true x estimated
advantage; the paper reports -0.67 on FrozenLake at round 5). :class:`DiagnosisCallback` does it during training.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.vec_env import VecEnv

from sb3_influence.analysis._callbacks import AnalysisCallback
from sb3_influence.common.snapshots import as_snapshot
from sb3_influence.common.snapshots.reader import SCALAR_COLUMNS

if TYPE_CHECKING:
    import pandas as pd

    from sb3_influence.influence_ppo import InfluencePPO


def top_bottom_records(snapshot: Any, target: str | None = None, k: int = 10) -> "pd.DataFrame":
    """
    The ``k`` most helpful and ``k`` most harmful records of one round, with their advantage estimates.

    :param snapshot: A snapshot path, ``load_snapshot`` result or dict of arrays.
    :param target: The target whose influence ranks the records (default ``"return"``, else the only one).
    :param k: Records per group.
    :return: DataFrame with columns ``group`` (``"top"``/``"bottom"``), ``rank`` (1 = most extreme), ``step``,
        ``env``, ``record_id``, ``influence``, ``obs``, ``action`` and every per-record field of the snapshot.
    """
    import pandas as pd

    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive int (records per group), got {k!r}")
    snapshot = as_snapshot(snapshot)
    scores = snapshot.scores(target)  # record-id order: record_id = env * n_steps + step
    n_steps, _ = snapshot.layout
    order = np.argsort(scores, kind="stable")
    k = min(int(k), scores.size)
    columns = {name: snapshot.flat(name) for name in (*SCALAR_COLUMNS, "obs", "action") if name in snapshot.arrays}
    rows = []
    for group, record_ids in (("top", order[::-1][:k]), ("bottom", order[:k])):
        for rank, record_id in enumerate(record_ids, start=1):
            env, step = divmod(int(record_id), n_steps)
            row: dict[str, Any] = {
                "group": group,
                "rank": rank,
                "step": step,
                "env": env,
                "record_id": int(record_id),
                "influence": float(scores[record_id]),
            }
            for name, values in columns.items():
                value = np.asarray(values[record_id])
                row[name] = value.item() if value.size == 1 else value
            rows.append(row)
    return pd.DataFrame(rows)


@dataclass
class TabularValues:
    """
    Exact values of a policy on a tabular MDP.

    :ivar policy: ``π(a|s)``, shape ``(n_states, n_actions)``.
    :ivar v: ``V^π(s)``, shape ``(n_states,)``.
    :ivar q: ``Q^π(s, a) = Σ p (r + gamma V(s') (1 - done))``, shape ``(n_states, n_actions)``.
    :ivar advantage: ``A^π = Q^π - V^π``, shape ``(n_states, n_actions)``.
    """

    policy: np.ndarray
    v: np.ndarray
    q: np.ndarray
    advantage: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.advantage = self.q - self.v[:, None]


def _unwrapped_env(model: "InfluencePPO", env: Any) -> Any:
    if env is None:
        env = model.get_env()
        if env is None:
            raise ValueError("env: the model has no environment; pass the tabular env (e.g. FrozenLake) as `env`")
    if isinstance(env, VecEnv):
        envs = getattr(env, "envs", None)
        if not envs:
            raise ValueError("env: cannot reach the transition table of a SubprocVecEnv; pass a plain gym env as `env`")
        env = envs[0]
    unwrapped = getattr(env, "unwrapped", env)
    if not hasattr(unwrapped, "P"):
        raise ValueError(
            f"env: {type(unwrapped).__name__} has no transition table `P` (env.unwrapped.P[s][a] = [(p, s', r, done)]); "
            "true advantages need a tabular env such as FrozenLake-v1"
        )
    return unwrapped


def policy_probabilities(model: "InfluencePPO", n_states: int) -> np.ndarray:
    """
    ``π_θ(a|s)`` of a policy with a ``Discrete`` observation and action space, for every state.

    :param model: The model (its current parameters are used).
    :param n_states: Number of states.
    :return: Array of shape ``(n_states, n_actions)``.
    """
    if not isinstance(model.observation_space, spaces.Discrete) or not isinstance(model.action_space, spaces.Discrete):
        raise ValueError(
            "policy_probabilities needs Discrete observation and action spaces (a tabular env such as FrozenLake), "
            f"got {model.observation_space} and {model.action_space}"
        )
    policy = model.policy
    was_training = policy.training
    policy.set_training_mode(False)
    try:
        obs, _ = policy.obs_to_tensor(np.arange(n_states))
        with th.no_grad():
            probs = policy.get_distribution(obs).distribution.probs  # type: ignore[union-attr]
    finally:
        policy.set_training_mode(was_training)
    probs = probs.cpu().numpy().astype(np.float64)
    # Renormalise in float64 so that V = Σ_a π Q holds to machine precision
    return probs / probs.sum(axis=1, keepdims=True)


def tabular_true_advantages(model: "InfluencePPO", env: Any = None, gamma: float | None = None) -> TabularValues:
    """
    Exact ``V^π``, ``Q^π`` and ``A^π`` of the model's *current* policy by policy evaluation on ``env.unwrapped.P``
    (solves the linear system ``(I - gamma P_π) V = R_π``; transitions flagged done contribute no future value).

    :param model: The model at the parameters to evaluate (θ(k) inside a round).
    :param env: A tabular gym env (or a ``DummyVecEnv`` around one); default: the model's env.
    :param gamma: Discount factor; default: ``model.gamma``.
    :return: The values, see :class:`TabularValues`.
    """
    unwrapped = _unwrapped_env(model, env)
    gamma = float(model.gamma if gamma is None else gamma)
    if not 0.0 <= gamma < 1.0:
        raise ValueError(f"gamma must be in [0, 1) for the linear solve to be well posed, got {gamma}")
    table = unwrapped.P
    n_states = len(table)
    n_actions = len(table[0])
    if not isinstance(model.action_space, spaces.Discrete) or int(model.action_space.n) != n_actions:
        raise ValueError(
            f"env: its transition table has {n_actions} actions but the model's action space is {model.action_space}"
        )
    reward = np.zeros((n_states, n_actions))  # expected immediate reward
    transition = np.zeros((n_states, n_actions, n_states))  # undiscounted, done-masked transition probabilities
    for s in range(n_states):
        for a in range(n_actions):
            for prob, next_state, r, done in table[s][a]:
                reward[s, a] += prob * r
                if not done:
                    transition[s, a, next_state] += prob
    pi = policy_probabilities(model, n_states)
    r_pi = (pi * reward).sum(1)
    p_pi = np.einsum("sa,sat->st", pi, transition)
    v = np.linalg.solve(np.eye(n_states) - gamma * p_pi, r_pi)
    q = reward + gamma * transition @ v
    return TabularValues(policy=pi, v=v, q=q)


def monte_carlo_returns(rewards: np.ndarray, episode_starts: np.ndarray, gamma: float) -> np.ndarray:
    """
    Discounted return-to-go of every record inside the buffer, ``G_t = r_t + gamma G_{t+1}`` within an episode.

    Each env's column is one stream of records; an episode ends where the next record starts a new one. The
    episode cut by the buffer's end is summed up to the last record, without bootstrapping (Monte Carlo). One
    value of the critic does enter: where an episode was cut by a time limit, SB3 adds ``gamma · V(last obs)`` to
    that record's stored reward (``collect_rollouts``), and the buffer's rewards are used as stored.

    :param rewards: Rewards, shape ``(n_steps, n_envs)`` (a 1-D array is one env).
    :param episode_starts: Whether each record is the first of an episode, same shape.
    :param gamma: Discount factor in ``[0, 1]``.
    :return: ``G``, float64, same shape as ``rewards``.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    starts = np.asarray(episode_starts).astype(bool)
    if rewards.shape != starts.shape or rewards.ndim not in (1, 2):
        raise ValueError(
            f"rewards and episode_starts must have the same shape (n_steps, n_envs), got {rewards.shape} and {starts.shape}"
        )
    if not 0.0 <= float(gamma) <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    column = rewards.ndim == 1
    rewards, starts = (rewards[:, None], starts[:, None]) if column else (rewards, starts)
    returns = np.zeros_like(rewards)
    following = np.zeros(rewards.shape[1])
    for step in range(rewards.shape[0] - 1, -1, -1):
        continues = 1.0 - starts[step + 1] if step + 1 < rewards.shape[0] else np.zeros(rewards.shape[1])
        following = rewards[step] + float(gamma) * continues * following
        returns[step] = following
    return returns[:, 0] if column else returns


def _record_keys(values: np.ndarray, n_records: int) -> np.ndarray:
    """One integer per record: equal iff the records' values are equal bit for bit."""
    flat = np.ascontiguousarray(np.asarray(values).reshape(n_records, -1))
    rows = flat.view(np.dtype((np.void, flat.dtype.itemsize * flat.shape[1]))).reshape(n_records)
    return np.unique(rows, return_inverse=True)[1].reshape(n_records)


def _state_action_keys(
    observations: np.ndarray | dict[str, np.ndarray], actions: np.ndarray, layout: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Integer keys of each record's state and of its (state, action) pair, shape ``layout`` = (n_steps, n_envs)."""
    n_records = int(np.prod(layout))
    parts = list(observations.values()) if isinstance(observations, dict) else [observations]
    for name, part in (*(("observations", p) for p in parts), ("actions", actions)):
        if np.shape(part)[:2] != tuple(layout):
            raise ValueError(f"{name} must start with the buffer's layout {tuple(layout)}, got shape {np.shape(part)}")
    state = np.zeros(n_records, dtype=np.int64)
    for part in parts:
        state = _record_keys(np.stack([state, _record_keys(part, n_records)], axis=1), n_records)
    pair = _record_keys(np.stack([state, _record_keys(actions, n_records)], axis=1), n_records)
    return state.reshape(layout), pair.reshape(layout)


def monte_carlo_advantages(
    observations: np.ndarray | dict[str, np.ndarray],
    actions: np.ndarray,
    rewards: np.ndarray,
    episode_starts: np.ndarray,
    gamma: float,
) -> np.ndarray:
    """
    The paper's in-buffer Monte-Carlo advantage ``Ā(s, a) = Q̄(s, a) - V̄(s)`` (App. B.4): ``Q̄`` averages the
    return-to-go :func:`monte_carlo_returns` over every record of the round with the same state and action,
    ``V̄`` over every record with the same state (every-visit Monte Carlo; the critic enters only through SB3's
    time-limit bootstrap in the stored rewards, see :func:`monte_carlo_returns`).

    States and actions are matched exactly (bit for bit), so it is informative where states repeat inside a
    round (tabular or grid worlds); with continuous observations every state is seen once and ``Ā = 0``.

    :param observations: Observations, shape ``(n_steps, n_envs, ...)`` (a dict of such arrays for Dict spaces).
    :param actions: Actions, shape ``(n_steps, n_envs, ...)``.
    :param rewards: Rewards, shape ``(n_steps, n_envs)``.
    :param episode_starts: Episode-start flags, shape ``(n_steps, n_envs)``.
    :param gamma: Discount factor.
    :return: ``Ā`` per record, float64, shape ``(n_steps, n_envs)``.
    """
    returns = monte_carlo_returns(rewards, episode_starts, gamma)
    if returns.ndim != 2:
        raise ValueError(f"rewards must have shape (n_steps, n_envs), got {returns.shape}")
    state, pair = _state_action_keys(observations, actions, returns.shape)
    flat_returns = returns.reshape(-1)

    def group_mean(keys: np.ndarray) -> np.ndarray:
        keys = keys.reshape(-1)
        sums = np.bincount(keys, weights=flat_returns)
        return (sums / np.bincount(keys))[keys]

    return (group_mean(pair) - group_mean(state)).reshape(returns.shape)


def advantage_correlation(
    influence: np.ndarray, true_advantage: np.ndarray, estimated_advantage: np.ndarray
) -> tuple[float, float]:
    """
    Spearman correlation between the influence of records and ``Ā·Â``, their true advantage times the
    estimated one (the paper's Sec. 4.1).

    :param influence: Influence scores, any shape.
    :param true_advantage: ``Ā`` of the same records, same shape.
    :param estimated_advantage: ``Â`` of the same records (raw GAE), same shape.
    :return: ``(rho, p_value)``; ``nan`` when either side is constant.
    """
    from scipy.stats import spearmanr

    influence = np.asarray(influence, dtype=np.float64).reshape(-1)
    product = (np.asarray(true_advantage, dtype=np.float64) * np.asarray(estimated_advantage, dtype=np.float64)).reshape(-1)
    if influence.shape != product.shape:
        raise ValueError(
            f"influence has {influence.size} records but true_advantage x estimated_advantage has {product.size}; "
            "pass arrays of the same records"
        )
    if influence.size < 2 or np.ptp(influence) == 0 or np.ptp(product) == 0:
        return float("nan"), float("nan")
    result = spearmanr(influence, product)
    return float(result.statistic), float(result.pvalue)


TRUE_ADVANTAGES = ("exact", "monte_carlo")


def _check_choices(estimated: str, true_advantage: str) -> None:
    if estimated not in ("advantage", "training_advantage"):
        raise ValueError(f"estimated must be 'advantage' or 'training_advantage', got {estimated!r}")
    if true_advantage not in TRUE_ADVANTAGES:
        raise ValueError(
            f"true_advantage must be 'exact' (policy evaluation on env.unwrapped.P) or 'monte_carlo' (the paper's "
            f"in-buffer estimate, App. B.4), got {true_advantage!r}"
        )


def snapshot_diagnosis(snapshot: Any, target: str | None = None, gamma: float | None = None) -> dict[str, Any]:
    """
    The diagnosis of one saved round from its snapshot alone, with the in-buffer Monte-Carlo ``Ā``
    (:func:`monte_carlo_advantages`): what the report shows when the round's states repeat.

    :param snapshot: A snapshot path, ``load_snapshot`` result or dict of arrays (needs ``obs``, ``action``,
        ``reward``, ``episode_start``, ``advantage`` and the target's influence).
    :param target: Target name (default ``"return"``, else the only one).
    :param gamma: Discount factor; default: the run's ``gamma`` from the snapshot's metadata.
    :return: Dict with ``round``, ``spearman`` (influence vs ``Ā·Â``), ``revisited`` (share of records whose state
        is taken with at least two different actions in the round: below ~0.3 the estimate says little),
        ``sign_flips`` (share of records with ``Ā·Â < 0``) and ``sign_flips_bottom`` (the same among the 5 % most
        harmful records).
    """
    snapshot = as_snapshot(snapshot)
    if gamma is None:
        gamma = snapshot.metadata.get("config", {}).get("gamma")
        if gamma is None:
            raise ValueError("gamma: the snapshot's metadata has no config.gamma; pass the run's discount factor as `gamma`")
    obs_keys = sorted(key for key in snapshot.arrays if key == "obs" or key.startswith("obs/"))
    missing = [name for name in ("action", "reward", "episode_start", "advantage") if name not in snapshot.arrays]
    if not obs_keys or missing:
        raise ValueError(
            f"snapshot {snapshot.path or '(arrays)'} lacks {([] if obs_keys else ['obs']) + missing}: "
            "was it written by AttributionCallback?"
        )
    arrays = snapshot.arrays
    observations = {key: arrays[key] for key in obs_keys}
    scores = snapshot.scores(target)
    per_step = monte_carlo_advantages(observations, arrays["action"], arrays["reward"], arrays["episode_start"], gamma)
    advantage_mc = per_step.swapaxes(0, 1).reshape(-1)  # record-id order, as snapshot.flat
    estimate = snapshot.flat("advantage").astype(np.float64)
    state, pair = _state_action_keys(observations, arrays["action"], per_step.shape)
    # Records whose state the round also visits with another action
    distinct_pairs = np.unique(np.stack([state.reshape(-1), pair.reshape(-1)], axis=1), axis=0)
    actions_per_state = np.bincount(distinct_pairs[:, 0], minlength=int(state.max()) + 1)
    n_records = scores.size
    flips = advantage_mc * estimate < 0
    bottom = np.argsort(scores, kind="stable")[: max(1, n_records // 20)]
    rho, _ = advantage_correlation(scores, advantage_mc, estimate)
    return {
        "round": snapshot.round,
        "spearman": rho,
        "revisited": float((actions_per_state[state.reshape(-1)] >= 2).mean()),
        "sign_flips": float(flips.mean()),
        "sign_flips_bottom": float(flips[bottom].mean()),
    }


def diagnose_tabular(
    model: "InfluencePPO",
    env: Any = None,
    target: Any = "return",
    estimated: str = "advantage",
    true_advantage: str = "exact",
) -> dict[str, Any]:
    """
    Diagnose the model's current round on a tabular env: influence of every record, its exact advantage
    under the current policy, and the Spearman correlation of influence with ``Ā·Â``.

    Call it when the rollout buffer holds round k and the parameters are still θ(k), i.e. from a callback's
    ``_on_rollout_end`` (see :class:`DiagnosisCallback`).

    :param model: The model.
    :param env: The tabular env (default: the model's env).
    :param target: Target of the influence (default ``"return"``).
    :param estimated: ``"advantage"`` (raw GAE, default) or ``"training_advantage"`` (as normalised for the update).
    :param true_advantage: How ``Ā`` is obtained: ``"exact"`` (:func:`tabular_true_advantages`, needs the
        transition table) or ``"monte_carlo"`` (:func:`monte_carlo_advantages` over the round's buffer, as the
        paper does; needs no table, only states that repeat).
    :return: Dict with ``round``, ``num_timesteps``, ``spearman``, ``p_value``, ``true_advantage_kind`` and
        per-record arrays (shape ``(n_steps, n_envs)``) ``influence``, ``true_advantage``, ``estimated_advantage``,
        ``state`` (the state index on a Discrete observation space, else the observations), ``action``.
        ``spearman`` correlates the influence *values* with ``Ā·Â`` (positive influence =
        helpful); the rank with 1 = most helpful correlates with ``Ā·Â`` by ``-spearman``.
    """
    _check_choices(estimated, true_advantage)
    buffer = model.rollout_buffer
    influence = model.compute_influence(target, cache=True)
    raw = buffer.flat_field("observations")
    observations: Any = (
        {key: buffer.to_records(np.asarray(value)) for key, value in raw.items()}
        if isinstance(raw, dict)
        else buffer.to_records(np.asarray(raw))
    )
    actions = buffer.to_records(np.asarray(buffer.flat_field("actions")))
    if isinstance(model.action_space, spaces.Discrete):
        actions = actions.reshape(buffer.buffer_size, buffer.n_envs).astype(np.int64)
    # The state index on a Discrete observation space (the observations themselves otherwise)
    states = (
        observations.reshape(buffer.buffer_size, buffer.n_envs).astype(np.int64)
        if isinstance(model.observation_space, spaces.Discrete)
        else observations
    )
    if estimated == "advantage":
        estimate = buffer.to_records(buffer.flat_field("advantages").astype(np.float64))
    else:
        estimate = model.training_advantages()
    if true_advantage == "exact":
        true_values = tabular_true_advantages(model, env).advantage[states, actions]
    else:
        true_values = monte_carlo_advantages(
            observations,
            actions,
            buffer.to_records(np.asarray(buffer.flat_field("rewards")).reshape(-1)),
            buffer.to_records(np.asarray(buffer.flat_field("episode_starts")).reshape(-1)),
            model.gamma,
        )
    rho, p_value = advantage_correlation(influence, true_values, estimate)
    return {
        "round": model.current_round().index,
        "num_timesteps": int(model.num_timesteps),
        "spearman": rho,
        "p_value": p_value,
        "true_advantage_kind": true_advantage,
        "influence": influence,
        "true_advantage": true_values,
        "estimated_advantage": estimate,
        "state": states,
        "action": actions,
    }


class DiagnosisCallback(AnalysisCallback):
    """
    Run :func:`diagnose_tabular` at chosen rounds of an ``InfluencePPO`` training on a tabular env.

    :param rounds: Rounds to diagnose, numbered as the snapshots' ``round`` (the first rollout is round 0);
        ``None``: every round.
    :param env: The tabular env (default: the model's env).
    :param target: Target of the influence (default ``"return"``).
    :param estimated: ``"advantage"`` or ``"training_advantage"``, see :func:`diagnose_tabular`.
    :param true_advantage: ``"exact"`` or ``"monte_carlo"``, see :func:`diagnose_tabular`.
    :param verbose: 1 prints the correlation of each diagnosed round.
    :ivar results: One dict per diagnosed round, as :func:`diagnose_tabular` returns.
    """

    def __init__(
        self,
        rounds: list[int] | tuple[int, ...] | None = None,
        env: Any = None,
        target: Any = "return",
        estimated: str = "advantage",
        true_advantage: str = "exact",
        verbose: int = 0,
    ):
        super().__init__(rounds, verbose)
        _check_choices(estimated, true_advantage)
        self.diagnosis_env = env
        self.target = target
        self.estimated = estimated
        self.true_advantage = true_advantage
        self.results: list[dict[str, Any]] = []

    def _on_round(self, index: int) -> None:
        result = diagnose_tabular(
            self.model,  # type: ignore[arg-type]
            self.diagnosis_env,
            self.target,
            self.estimated,
            self.true_advantage,
        )
        self.results.append(result)
        if self.verbose >= 1:
            print(f"round {index}: Spearman(influence, true x estimated advantage) = {result['spearman']:.3f}")
