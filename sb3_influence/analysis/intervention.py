"""
Targeted intervention (METHOD §5.3): retrain one round without a chosen set of records.

From θ(k) and the rollout buffer of round k, :func:`intervene` runs PPO's ordinary update once per *arm* — all
records (the reference), without the negative records, without the bottom / top x %, without a random set of
the same size — and reports how the target and the test return move against the unfiltered retrain. Between
arms, and at the end, it restores θ(k), the optimizer state, the keep mask and the numpy / torch RNG states, so
training goes on exactly as if nothing had happened. :class:`InterventionCallback` runs it at chosen rounds.
"""

import copy
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch as th
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv

from sb3_influence.analysis._callbacks import RoundCallback
from sb3_influence.common.snapshots import round_index
from sb3_influence.common.targets import Target, as_target

if TYPE_CHECKING:
    import pandas as pd

    from sb3_influence.influence_ppo import InfluencePPO

ARMS = ("negatives", "bottom", "top", "random", "random_negatives")


def drop_mask(scores: np.ndarray, arm: str, fraction: float = 0.05, rng: np.random.Generator | None = None) -> np.ndarray:
    """
    The records an arm drops.

    :param scores: Influence scores, shape ``(n_steps, n_envs)``.
    :param arm: ``"negatives"`` (every record with I < 0), ``"bottom"`` / ``"top"`` (the ``floor(fraction · n)``
        lowest / highest), ``"random"`` (as many records as ``"negatives"``, uniformly),
        ``"random_negatives"`` (``floor(fraction · n)`` records drawn at random: the same size as bottom/top).
    :param fraction: Share of records for ``bottom``, ``top`` and ``random_negatives``.
    :param rng: Generator for the random arms (default: seeded with 0).
    :return: Boolean array of the same shape, True for dropped records.
    """
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS} or a boolean drop mask, got {arm!r}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
    scores = np.asarray(scores, dtype=np.float64)
    flat = scores.reshape(-1)
    rng = np.random.default_rng(0) if rng is None else rng
    drop = np.zeros(flat.size, dtype=bool)
    n_fraction = int(np.floor(fraction * flat.size))
    order = np.argsort(flat, kind="stable")
    if arm == "negatives":
        drop = flat < 0
    elif arm == "bottom":
        drop[order[:n_fraction]] = True
    elif arm == "top":
        drop[order[flat.size - n_fraction :]] = True
    elif arm == "random":
        drop[rng.choice(flat.size, size=int((flat < 0).sum()), replace=False)] = True
    else:
        drop[rng.choice(flat.size, size=n_fraction, replace=False)] = True
    return drop.reshape(scores.shape)


def target_value(model: "InfluencePPO", target: str | Target = "return", batch_size: int | None = None) -> float:
    """
    ``f(θ)`` at the model's current parameters, over its current rollout buffer.

    :param model: The model.
    :param target: ``"return"`` or a :class:`~sb3_influence.Target`.
    :param batch_size: Samples per forward pass (default: ``model.influence_batch_size``).
    :return: The value.
    """
    target = as_target(target)
    engine = model.influence_engine
    with engine.eval_mode(), th.no_grad():
        terms = target.terms(engine, batch_size or model.influence_batch_size)
        return float(sum(float(term.detach().cpu()) for term in terms))


class _State:
    """Everything ``train()`` or an evaluation changes, saved once and restored as often as needed."""

    def __init__(self, model: "InfluencePPO"):
        buffer = model.rollout_buffer
        self.policy = copy.deepcopy(model.policy.state_dict())
        self.optimizer = copy.deepcopy(model.policy.optimizer.state_dict())
        self.training = model.policy.training
        self.n_updates = model._n_updates
        self.keep = buffer.keep.copy()
        permutation = buffer._first_permutation
        self.permutation = None if permutation is None else permutation.copy()
        self.numpy_rng = np.random.get_state()
        self.torch_rng = th.get_rng_state()
        self.logger = model.__dict__.get("_logger")

    def restore(self, model: "InfluencePPO") -> None:
        buffer = model.rollout_buffer
        model.policy.load_state_dict(self.policy)
        model.policy.optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        model.policy.set_training_mode(self.training)
        model._n_updates = self.n_updates
        buffer.keep[...] = self.keep
        buffer._first_permutation = None if self.permutation is None else self.permutation.copy()
        np.random.set_state(self.numpy_rng)
        th.set_rng_state(self.torch_rng)
        if self.logger is None:
            model.__dict__.pop("_logger", None)
        else:
            model._logger = self.logger


def _evaluate(model: "InfluencePPO", eval_env: VecEnv | None, n_eval_episodes: int, seed: int, deterministic: bool) -> float:
    if eval_env is None:
        return float("nan")
    # Common random numbers: every arm sees the same episode seeds and the same action-sampling noise
    eval_env.seed(seed)
    th.manual_seed(seed)
    episode_rewards, _ = evaluate_policy(
        model, eval_env, n_eval_episodes=n_eval_episodes, deterministic=deterministic, warn=False, return_episode_rewards=True
    )
    return float(np.mean(episode_rewards))


def intervene(
    model: "InfluencePPO",
    arms: Sequence[str] | Mapping[str, np.ndarray] = ("negatives", "random", "bottom", "top"),
    fraction: float = 0.05,
    target: str | Target = "return",
    eval_env: Any = None,
    n_eval_episodes: int = 5,
    deterministic: bool = False,
    seed: int = 0,
) -> "pd.DataFrame":
    """
    Retrain the current round from θ(k) once per arm and compare each with the unfiltered retrain.

    Call it while the rollout buffer holds round k and the parameters are θ(k): from a callback's
    ``_on_rollout_end`` (see :class:`InterventionCallback`). The model is left exactly as it was found.

    :param model: An ``InfluencePPO`` model.
    :param arms: Names from :data:`ARMS` (see :func:`drop_mask`), or a mapping ``name -> drop mask`` of
        shape ``(n_steps, n_envs)`` (True = drop) for a set of your own.
    :param fraction: Share of records for the ``bottom``, ``top`` and ``random_negatives`` arms.
    :param target: The target that ranks the records and is measured before/after (default ``"return"``).
    :param eval_env: Environment for the test return (gym env or VecEnv); ``None``: no test return (nan).
    :param n_eval_episodes: Test episodes per arm.
    :param deterministic: Evaluate the deterministic policy (the paper evaluates the stochastic one).
    :param seed: Seed of the random arms and of the evaluation (the same for every arm).
    :return: DataFrame, one row per arm, the reference ``"none"`` first: ``arm``, ``n_dropped``,
        ``target_before``, ``target_after``, ``delta_target`` (target_after minus the reference's),
        ``test_return``, ``delta_return`` (minus the reference's), plus ``round`` and ``num_timesteps``.
    """
    import pandas as pd

    buffer = model.rollout_buffer
    if buffer is None or not buffer.full:
        raise RuntimeError("intervene() needs a full rollout buffer at θ(k): call it from a callback's _on_rollout_end")
    if isinstance(n_eval_episodes, bool) or not isinstance(n_eval_episodes, (int, np.integer)) or n_eval_episodes < 1:
        raise ValueError(f"n_eval_episodes must be a positive int, got {n_eval_episodes!r}")
    if eval_env is not None and not isinstance(eval_env, VecEnv):
        env = eval_env
        eval_env = DummyVecEnv([lambda: env])
    target = as_target(target)
    shape = buffer.keep.shape
    if isinstance(arms, Mapping):
        masks = {}
        for name, mask in arms.items():
            mask = np.asarray(mask)
            if mask.dtype != bool or mask.shape != shape:
                raise ValueError(f"arms[{name!r}] must be a boolean drop mask of shape {shape}, got {mask.dtype} {mask.shape}")
            masks[str(name)] = mask
    else:
        if isinstance(arms, str):
            raise TypeError(f"arms must be a list of arm names, e.g. [{arms!r}], not a string")
        scores = model.compute_influence(target, cache=True)
        rng = np.random.default_rng(seed)
        masks = {str(arm): drop_mask(scores, arm, fraction, rng) for arm in arms}
    if "none" in masks:
        raise ValueError("arms: 'none' is the name of the unfiltered reference, choose another name")

    state = _State(model)
    before = target_value(model, target)
    rows = []
    try:
        for name, drop in {"none": np.zeros(shape, dtype=bool), **masks}.items():
            state.restore(model)
            buffer.keep[...] = state.keep & ~drop
            model._logger = Logger(folder=None, output_formats=[])
            model.train()
            rows.append(
                {
                    "arm": name,
                    "n_dropped": int((state.keep & drop).sum()),
                    "target_before": before,
                    "target_after": target_value(model, target),
                    "test_return": _evaluate(model, eval_env, int(n_eval_episodes), seed, deterministic),
                }
            )
    finally:
        state.restore(model)
    table = pd.DataFrame(rows)
    table["delta_target"] = table["target_after"] - table.loc[0, "target_after"]
    table["delta_return"] = table["test_return"] - table.loc[0, "test_return"]
    table["round"] = round_index(model)
    table["num_timesteps"] = int(model.num_timesteps)
    return table


class InterventionCallback(RoundCallback):
    """
    Run :func:`intervene` at chosen rounds of an ``InfluencePPO`` training; training itself is unaffected.

    :param rounds: Rounds to run at, numbered as the snapshots' ``round`` (the first rollout is round 0);
        ``None``: every round.
    :param eval_env: Environment for the test return (``None``: none measured).
    :param intervene_kwargs: Keyword arguments of :func:`intervene` (``arms``, ``fraction``, ``target``, ...).
    :param verbose: 1 prints each round's table.
    :ivar results: One DataFrame per round, as :func:`intervene` returns.
    """

    def __init__(self, rounds: Sequence[int] | None = None, eval_env: Any = None, verbose: int = 0, **intervene_kwargs: Any):
        super().__init__(rounds, verbose)
        self.eval_env = eval_env
        self.intervene_kwargs = intervene_kwargs
        self.results: list[pd.DataFrame] = []

    def _on_round(self, index: int) -> None:
        table = intervene(self.model, eval_env=self.eval_env, **self.intervene_kwargs)  # type: ignore[arg-type]
        self.results.append(table)
        if self.verbose >= 1:
            print(table[["arm", "n_dropped", "delta_target", "delta_return"]].to_string(index=False))
