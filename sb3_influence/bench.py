"""
``sb3-influence bench``: the paper's PPO / IIF / random-filtering comparison (METHOD §4 and §6).

Every run trains one arm (``ppo``, ``iif`` or ``random``) on one environment with one seed, round by round
(one round = one rollout of ``n_steps * n_envs`` records + one PPO update), evaluates the stochastic policy after
every ``eval_every`` rounds and writes its per-round results to ``<out>/<env>/<arm>_seed<seed>.json`` as it goes.
Arms with the same seed start from identical initial weights (same seed, same construction; the harness stores a
hash of the initial parameters in every result file and :func:`summarize` checks it). Finished runs are skipped
when the command is run again; an unfinished run resumes from its last checkpoint in ``<out>/raw/``.

The metrics (:func:`first_round`, :func:`ppo_levels`, :func:`speedup_metrics`) follow METHOD §6:
``m(v)`` is the first round whose test return is ``>= v``, ``Reduction(v) = 1 - m_IIF(v) / m_PPO(v)``, SE_ave is
the mean reduction over the successive new-best values of standard PPO, SE_peak the reduction at PPO's peak and
RT_peak the same in cumulative wall-clock time.
"""

import argparse
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch as th

ARMS = ("ppo", "iif", "random")
# A curve: a list or a 1-D numpy array
Floats = Sequence[float] | np.ndarray
Ints = Sequence[int] | np.ndarray


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """
    One benchmark environment with the paper's settings (METHOD §4).

    :param env_id: Gymnasium id.
    :param fraction: IIF drop fraction ``p`` (rule ``"neg-bottom"``); the random arm drops the same fraction.
    :param rounds: Number of rounds (rollouts + updates).
    :param env_kwargs: Keyword arguments of ``gym.make``.
    :param minigrid: Wrap with ``ImgObsWrapper`` and use the MiniGrid CNN.
    :param exact_eval: Evaluate the stochastic policy exactly (tabular, deterministic env: FrozenLake) instead
        of by sampling episodes.
    :param eval_every: Evaluate every this many rounds (and after the last one).
    :param resolution: Returns are floored to a multiple of this before computing the metrics (0: as measured).
        Exact evaluation creeps towards its optimum by ever smaller steps, each of which would be a new PPO
        "level"; 0.01 for FrozenLake gives levels of 1 % success probability.
    """

    env_id: str
    fraction: float
    rounds: int
    env_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    minigrid: bool = False
    exact_eval: bool = False
    eval_every: int = 1
    resolution: float = 0.0


ENVS: dict[str, EnvSpec] = {
    "FrozenLake": EnvSpec(
        "FrozenLake-v1", 0.5, 50, {"map_name": "4x4", "is_slippery": False}, exact_eval=True, resolution=0.01
    ),
    "Acrobot": EnvSpec("Acrobot-v1", 0.5, 50),
    "MiniGrid": EnvSpec("MiniGrid-Empty-8x8-v0", 0.125, 40, minigrid=True),
    # The paper runs 150 rounds; 50 here to fit a shared 2-core compute budget (pass --rounds 150 for the paper's)
    "LunarLander": EnvSpec("LunarLander-v3", 0.125, 50, eval_every=3),
    # Not in the paper: a few-second smoke test
    "CartPole": EnvSpec("CartPole-v1", 0.5, 2),
}

# PPO settings shared by every arm (METHOD §4; gradient clipping disabled as in the authors' code)
PPO_KWARGS: dict[str, Any] = dict(
    learning_rate=5e-3,
    n_steps=2048,
    batch_size=64,
    n_epochs=10,
    gamma=0.99,
    gae_lambda=0.95,
    clip_range=0.2,
    ent_coef=0.0,
    vf_coef=0.5,
    max_grad_norm=1e10,
)


# ---------------------------------------------------------------------------------------------------- metrics
def first_round(rounds: Ints, returns: Floats, level: float) -> int | None:
    """
    ``m(v)``: the first round whose test return is ``>= level`` (METHOD §6).

    :param rounds: Round numbers, increasing.
    :param returns: Test return evaluated after each of those rounds.
    :param level: The level ``v``.
    :return: The round, or ``None`` if the curve never reaches ``level``.
    """
    if len(rounds) != len(returns):
        raise ValueError(f"rounds and returns must have the same length, got {len(rounds)} and {len(returns)}")
    for round_, value in zip(rounds, returns, strict=True):
        if value >= level:
            return int(round_)
    return None


def ppo_levels(rounds: Ints, returns: Floats) -> list[tuple[int, float]]:
    """
    The increasing levels reached by standard PPO: every round (after round 0) whose return is a new best over
    all earlier evaluations, including the initial one.

    :param rounds: Round numbers, increasing; round 0 (the initial policy) may be included.
    :param returns: PPO's test returns.
    :return: ``(round, value)`` pairs, in order.
    """
    levels = []
    best = -np.inf
    for round_, value in zip(rounds, returns, strict=True):
        if value > best:
            if round_ > 0:
                levels.append((int(round_), float(value)))
            best = value
    return levels


def _reduction(m_ref: float, m_new: float | None, never: float) -> float:
    return 1.0 - (never if m_new is None else m_new) / m_ref


def speedup_metrics(
    rounds: Ints,
    ppo_returns: Floats,
    new_returns: Floats,
    ppo_time: Floats | None = None,
    new_time: Floats | None = None,
    resolution: float = 0.0,
) -> dict[str, float]:
    """
    SE_ave, SE_peak and (with times) RT_peak of one paired run (METHOD §6). A level the new method never reaches
    counts as reached one round after the last (so the reduction is penalised rather than dropped).

    :param rounds: Evaluation rounds, shared by both curves (0 = initial policy allowed).
    :param ppo_returns: Standard PPO's test returns.
    :param new_returns: The compared method's test returns (IIF or random filtering).
    :param ppo_time: PPO's cumulative wall-clock time at each of ``rounds``.
    :param new_time: The compared method's cumulative wall-clock time at each of ``rounds``.
    :param resolution: Floor both curves to a multiple of this first (0: use them as they are).
    :return: ``{"se_ave", "se_peak", "rt_peak", "n_levels", "peak_reached"}`` (fractions, not percents;
        ``rt_peak`` is NaN without times, and everything is NaN when PPO never improves on round 0).
    """
    if not (len(rounds) == len(ppo_returns) == len(new_returns)):
        raise ValueError("rounds, ppo_returns and new_returns must have the same length")
    if resolution < 0:
        raise ValueError(f"resolution must be >= 0, got {resolution}")
    if resolution > 0:
        ppo_returns = np.floor(np.asarray(ppo_returns, dtype=np.float64) / resolution + 1e-9) * resolution
        new_returns = np.floor(np.asarray(new_returns, dtype=np.float64) / resolution + 1e-9) * resolution
    levels = ppo_levels(rounds, ppo_returns)
    nan = float("nan")
    if not levels:
        return {"se_ave": nan, "se_peak": nan, "rt_peak": nan, "n_levels": 0, "peak_reached": nan}
    never = float(rounds[-1]) + (rounds[-1] - rounds[-2] if len(rounds) > 1 else 1)
    reductions = [_reduction(m, first_round(rounds, new_returns, v), never) for m, v in levels]
    m_peak, v_peak = max(levels, key=lambda level: level[1])
    m_new = first_round(rounds, new_returns, v_peak)
    rt_peak = nan
    if ppo_time is not None and new_time is not None:
        if len(ppo_time) != len(rounds) or len(new_time) != len(rounds):
            raise ValueError("ppo_time and new_time must have one entry per round")
        t_ppo = float(ppo_time[list(rounds).index(m_peak)])
        # Not reached: the whole run's time, extrapolated by one more round
        if m_new is None:
            per_round = new_time[-1] / max(rounds[-1], 1)
            t_new = float(new_time[-1]) + per_round * (never - rounds[-1])
        else:
            t_new = float(new_time[list(rounds).index(m_new)])
        rt_peak = 1.0 - t_new / t_ppo
    return {
        "se_ave": float(np.mean(reductions)),
        "se_peak": _reduction(m_peak, m_new, never),
        "rt_peak": rt_peak,
        "n_levels": len(levels),
        "peak_reached": float(m_new is not None),
    }


def bootstrap_ci(values: Floats, n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """
    Percentile bootstrap confidence interval of the mean (numpy; rliable is not a dependency).

    :param values: One value per seed (NaNs are dropped).
    :param n_boot: Bootstrap resamples.
    :param level: Confidence level.
    :param seed: Seed of the resampling.
    :return: ``(low, high)``; ``(nan, nan)`` with no finite value.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    array = np.asarray(values, dtype=np.float64)
    array = array[np.isfinite(array)]
    if len(array) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = rng.choice(array, size=(n_boot, len(array)), replace=True).mean(axis=1)
    alpha = (1 - level) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


# ---------------------------------------------------------------------------------------------------- harness
def make_env(spec: EnvSpec, n_envs: int, seed: int) -> Any:
    """
    The vectorised environment of a benchmark (``Monitor``-wrapped, ``ImgObsWrapper`` for MiniGrid).

    :param spec: The benchmark.
    :param n_envs: Number of environments.
    :param seed: Seed of the first environment.
    :return: A ``DummyVecEnv``.
    """
    from stable_baselines3.common.env_util import make_vec_env

    wrapper = None
    if spec.minigrid:
        import minigrid  # noqa: F401  (registers the MiniGrid ids)
        from minigrid.wrappers import ImgObsWrapper

        wrapper = ImgObsWrapper
    return make_vec_env(spec.env_id, n_envs=n_envs, seed=seed, env_kwargs=spec.env_kwargs, wrapper_class=wrapper)


def make_model(spec: EnvSpec, seed: int, **overrides: Any) -> Any:
    """
    An ``InfluencePPO`` with the paper's settings (SGD, lr 5e-3, no gradient clipping) for ``spec``.

    :param spec: The benchmark.
    :param seed: Seed (same seed, same initial weights, whatever the arm).
    :param overrides: Replace any of :data:`PPO_KWARGS` (or add ``n_envs``, ``policy_kwargs``).
    :return: The model.
    """
    from sb3_influence import InfluencePPO, MiniGridCNN

    kwargs = {**PPO_KWARGS, **overrides}
    n_envs = kwargs.pop("n_envs", 1)
    policy_kwargs = {"optimizer_class": th.optim.SGD, **kwargs.pop("policy_kwargs", {})}
    policy = "MlpPolicy"
    if spec.minigrid:
        policy = "CnnPolicy"
        policy_kwargs.setdefault("features_extractor_class", MiniGridCNN)
        policy_kwargs.setdefault("net_arch", dict(pi=[64, 64], vf=[64, 64]))
    # The initial weights depend on torch's thread count (SB3's orthogonal init goes through a QR decomposition):
    # build every model with one thread, so that the same seed gives the same weights whatever the caller uses
    previous = th.get_num_threads()
    th.set_num_threads(1)
    try:
        return InfluencePPO(policy, make_env(spec, n_envs, seed), seed=seed, policy_kwargs=policy_kwargs, **kwargs)
    finally:
        th.set_num_threads(previous)


def make_callback(arm: str, fraction: float) -> Any:
    """
    The callback that turns ``InfluencePPO`` into an arm: none for ``ppo``, ``IIFCallback(rule="neg-bottom")`` for
    ``iif``, ``IIFCallback(rule="random")`` for ``random``.

    :param arm: ``"ppo"``, ``"iif"`` or ``"random"``.
    :param fraction: The drop fraction ``p``.
    :return: A callback or ``None``.
    """
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    if arm == "ppo":
        return None
    from sb3_influence import IIFCallback  # type: ignore[attr-defined]

    return IIFCallback(fraction=fraction, rule="neg-bottom" if arm == "iif" else "random")


def parameter_hash(model: Any) -> str:
    """SHA-256 of the policy's parameters (to check that arms start from identical weights)."""
    digest = hashlib.sha256()
    for name, tensor in model.policy.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def exact_frozenlake_return(model: Any, env: Any) -> float:
    """
    Expected undiscounted return of the stochastic policy on a deterministic tabular env (FrozenLake,
    ``is_slippery=False``) within its time limit, by dynamic programming over the transition table.

    :param model: The model (discrete observations and actions).
    :param env: One (unwrapped or wrapped) ``FrozenLake`` environment.
    :return: The exact expected return (= success probability).
    """
    base = env.unwrapped
    n_states, n_actions = base.observation_space.n, base.action_space.n
    horizon = env.spec.max_episode_steps if env.spec is not None and env.spec.max_episode_steps else 100
    with th.no_grad():
        obs, _ = model.policy.obs_to_tensor(np.arange(n_states))
        probs = model.policy.get_distribution(obs).distribution.probs.cpu().numpy().astype(np.float64)
    value = np.zeros(n_states)
    for _ in range(horizon):
        new_value = np.zeros(n_states)
        for state in range(n_states):
            for action in range(n_actions):
                for prob, next_state, reward, done in base.P[state][action]:
                    new_value[state] += probs[state, action] * prob * (reward + (0.0 if done else value[next_state]))
        value = new_value
    return float(value[0])


def evaluate(model: Any, spec: EnvSpec, episodes: int, seed: int) -> float:
    """
    Mean return of the stochastic policy (METHOD §4): exact for tabular specs, else ``episodes`` episodes on
    ``min(episodes, 10)`` parallel environments seeded with ``seed``. The global torch RNG is restored
    afterwards, so evaluating does not change the training run.

    :param model: The model.
    :param spec: The benchmark.
    :param episodes: Number of evaluation episodes.
    :param seed: Seed of the evaluation envs and action sampling (same across arms: paired evaluation).
    :return: Mean return.
    """
    from stable_baselines3.common.evaluation import evaluate_policy

    if spec.exact_eval:
        import gymnasium as gym

        env = gym.make(spec.env_id, **spec.env_kwargs)
        return exact_frozenlake_return(model, env)
    eval_env = make_env(spec, min(episodes, 10), seed)
    with th.random.fork_rng(devices=[]):
        th.manual_seed(seed)
        mean = evaluate_policy(model, eval_env, n_eval_episodes=episodes, deterministic=False, warn=False)[0]
    eval_env.close()
    return float(np.mean(mean))


def _write_json(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as file:
        json.dump(data, file, indent=1)
    os.replace(tmp, path)


def result_path(out: str, env: str, arm: str, seed: int) -> str:
    """Where a run's per-round results go."""
    return os.path.join(out, env, f"{arm}_seed{seed}.json")


def run_one(
    env: str, arm: str, seed: int, out: str, rounds: int | None = None, eval_episodes: int = 10, checkpoint_every: int = 10
) -> dict[str, Any]:
    """
    Train one arm on one benchmark, writing ``<out>/<env>/<arm>_seed<seed>.json`` after every round.

    :param env: A key of :data:`ENVS`.
    :param arm: ``"ppo"``, ``"iif"`` or ``"random"``.
    :param seed: Seed (training env, initial weights); evaluation uses ``10_000 + seed`` in every arm.
    :param out: Results directory.
    :param rounds: Number of rounds (default: the paper's).
    :param eval_episodes: Stochastic evaluation episodes per evaluation (ignored for exact evaluation).
    :param checkpoint_every: Save the model under ``<out>/raw/`` every this many rounds (to resume).
    :return: The result dict (also on disk).
    """
    # One torch thread per run (runs go in parallel, one per core); the caller's setting is restored afterwards
    previous = th.get_num_threads()
    th.set_num_threads(1)
    try:
        return _run_one(env, arm, seed, out, rounds, eval_episodes, checkpoint_every)
    finally:
        th.set_num_threads(previous)


def _run_one(
    env: str, arm: str, seed: int, out: str, rounds: int | None, eval_episodes: int, checkpoint_every: int
) -> dict[str, Any]:
    from sb3_influence import InfluencePPO

    if env not in ENVS:
        raise ValueError(f"env must be one of {sorted(ENVS)}, got {env!r}")
    spec = ENVS[env]
    rounds = spec.rounds if rounds is None else rounds
    if rounds < 1 or eval_episodes < 1:
        raise ValueError(f"rounds and eval_episodes must be >= 1, got {rounds} and {eval_episodes}")
    path = result_path(out, env, arm, seed)
    config = {"env": env, "env_id": spec.env_id, "arm": arm, "seed": seed, "rounds": rounds, "fraction": spec.fraction,
              "eval_episodes": "exact" if spec.exact_eval else eval_episodes, "eval_every": spec.eval_every,
              "optimizer": "SGD", **PPO_KWARGS}  # fmt: skip
    if os.path.exists(path):
        with open(path) as file:
            previous = json.load(file)
        if previous.get("config") == config and previous.get("complete"):
            return previous
    eval_seed = 10_000 + seed
    checkpoint = os.path.join(out, "raw", env, f"{arm}_seed{seed}.zip")
    model = make_model(spec, seed)
    result: dict[str, Any] = {"config": config, "init_hash": parameter_hash(model), "complete": False, "rows": []}
    start = 1
    if os.path.exists(path) and os.path.exists(checkpoint):
        with open(path) as file:
            previous = json.load(file)
        done = previous.get("checkpoint_round", 0)
        if previous.get("config") == config and done > 0:
            model = InfluencePPO.load(checkpoint, env=model.get_env())
            # A resumed run is reproducible, but not the same as an uninterrupted one (fresh RNG streams)
            model.set_random_seed(seed + 1_000 * done)
            result = {**previous, "rows": [row for row in previous["rows"] if row["round"] <= done]}
            result.setdefault("resumed_at", []).append(done)
            start = done + 1
    if start == 1:
        initial = evaluate(model, spec, eval_episodes, eval_seed)
        result["rows"].append(
            dict(round=0, timesteps=0, wall_time=0.0, round_time=0.0, cpu_time=0.0, eval_return=initial, kept_fraction=1.0)
        )
    callback = make_callback(arm, spec.fraction)
    n_round = model.n_steps * model.n_envs
    wall, cpu = result["rows"][-1]["wall_time"], result["rows"][-1].get("cpu_time", float("nan"))
    for round_ in range(start, rounds + 1):
        # Wall-clock and process CPU time of the round (rollout + scoring + update), evaluation excluded. On a
        # shared machine the CPU time of this single-threaded process is the load-independent measure.
        tic, cpu_tic = time.perf_counter(), time.process_time()
        model.learn(n_round, callback=callback, reset_num_timesteps=False)
        round_time = time.perf_counter() - tic
        wall += round_time
        cpu += time.process_time() - cpu_tic
        row = dict(round=round_, timesteps=int(model.num_timesteps), wall_time=wall, round_time=round_time, cpu_time=cpu,
                   kept_fraction=float(model.rollout_buffer.flat_keep.mean()), eval_return=None)  # fmt: skip
        if round_ % spec.eval_every == 0 or round_ == rounds:
            row["eval_return"] = evaluate(model, spec, eval_episodes, eval_seed)
        result["rows"].append(row)
        if round_ % checkpoint_every == 0 and round_ < rounds:
            model.save(checkpoint)
            result["checkpoint_round"] = round_
        result["complete"] = round_ == rounds
        _write_json(path, result)
    return result


def _run_job(job: tuple[str, str, int, str, int | None, int, int]) -> str:
    env, arm, seed, out, rounds, eval_episodes, niceness = job
    if niceness:
        os.nice(niceness)
    tic = time.perf_counter()
    run_one(env, arm, seed, out, rounds=rounds, eval_episodes=eval_episodes)
    return f"{env} {arm} seed {seed}: {time.perf_counter() - tic:.0f} s"


def run_all(
    envs: Sequence[str],
    arms: Sequence[str],
    seeds: Sequence[int],
    out: str,
    workers: int = 2,
    rounds: int | None = None,
    eval_episodes: int = 10,
    niceness: int = 0,
    log: Callable[[str], None] = print,
) -> None:
    """
    Run every (env, arm, seed), ``workers`` processes in parallel (one torch thread each), in the order given:
    environment by environment, PPO and IIF of every seed before random filtering.

    :param envs: Keys of :data:`ENVS`.
    :param arms: Subset of :data:`ARMS`.
    :param seeds: Seeds.
    :param out: Results directory.
    :param workers: Parallel processes (1: run in this process).
    :param rounds: Rounds per run (default: each env's paper value).
    :param eval_episodes: Evaluation episodes.
    :param niceness: Added to the workers' nice value.
    :param log: Where progress lines go.
    """
    for name in envs:
        if name not in ENVS:
            raise ValueError(f"unknown env {name!r}: choose from {sorted(ENVS)}")
    for arm in arms:
        if arm not in ARMS:
            raise ValueError(f"unknown arm {arm!r}: choose from {ARMS}")
    if (rounds is not None and rounds < 1) or eval_episodes < 1:
        raise ValueError(f"rounds and eval_episodes must be >= 1, got rounds={rounds}, eval_episodes={eval_episodes}")
    order = sorted(arms, key=ARMS.index)
    jobs = [(env, arm, seed, out, rounds, eval_episodes, niceness) for env in envs for arm in order for seed in seeds]
    if workers <= 1:
        for job in jobs:
            log(_run_job(job))
        return
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(workers, maxtasksperchild=1) as pool:
        for line in pool.imap(_run_job, jobs):
            log(line)


# ---------------------------------------------------------------------------------------------------- summary
def load_runs(out: str, env: str) -> dict[str, dict[int, dict[str, Any]]]:
    """
    The complete runs of one benchmark: ``{arm: {seed: result}}``.

    :param out: Results directory.
    :param env: A key of :data:`ENVS`.
    :return: The results (incomplete runs are left out).
    """
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    directory = os.path.join(out, env)
    if not os.path.isdir(directory):
        return runs
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json"):
            with open(os.path.join(directory, name)) as file:
                result = json.load(file)
            if result.get("complete"):
                runs.setdefault(result["config"]["arm"], {})[result["config"]["seed"]] = result
    return runs


def time_key(result: dict[str, Any]) -> str:
    """``"cpu_time"`` when every row of the run has a finite process CPU time, else ``"wall_time"``."""
    cpu = [row.get("cpu_time") for row in result["rows"]]
    return "cpu_time" if all(c is not None and np.isfinite(c) for c in cpu) else "wall_time"


def curve(result: dict[str, Any], clock: str = "wall_time") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rounds, eval_returns, cumulative time)`` at the evaluated rounds of one run; ``clock`` is the row key
    of the time (``"wall_time"`` or ``"cpu_time"``)."""
    rows = [row for row in result["rows"] if row["eval_return"] is not None]
    return (
        np.array([r["round"] for r in rows]),
        np.array([r["eval_return"] for r in rows]),
        np.array([r[clock] for r in rows]),
    )


def summarize(out: str, env: str, final_window: int = 5) -> dict[str, Any]:
    """
    Paired metrics of IIF and random filtering against PPO on one benchmark, per seed and aggregated (mean,
    standard error and 95 % percentile-bootstrap CI over seeds). Checks identical initial weights per seed.

    :param out: Results directory.
    :param env: A key of :data:`ENVS`.
    :param final_window: The final return is the mean of the last this-many evaluations.
    :return: ``{arm: {"per_seed": {...}, metric: {"mean", "se", "ci"}}}`` for the filtering arms.
    """
    runs = load_runs(out, env)
    summary: dict[str, Any] = {}
    for arm in ("iif", "random"):
        seeds = sorted(set(runs.get(arm, {})) & set(runs.get("ppo", {})))
        if not seeds:
            continue
        per_seed = {}
        for seed in seeds:
            base, new = runs["ppo"][seed], runs[arm][seed]
            if base["init_hash"] != new["init_hash"]:
                raise RuntimeError(f"{env} seed {seed}: ppo and {arm} did not start from the same initial weights")
            # CPU time when both runs have it (load-independent on a shared machine), else wall-clock time
            clock = "cpu_time" if time_key(base) == time_key(new) == "cpu_time" else "wall_time"
            rounds, ppo_ret, ppo_time = curve(base, clock)
            rounds_new, new_ret, new_time = curve(new, clock)
            if not np.array_equal(rounds, rounds_new):
                raise RuntimeError(f"{env} seed {seed}: ppo and {arm} were evaluated at different rounds")
            metrics: dict[str, Any] = speedup_metrics(rounds, ppo_ret, new_ret, ppo_time, new_time, ENVS[env].resolution)
            metrics["clock"] = clock
            metrics["final_gain"] = float(new_ret[-final_window:].mean() - ppo_ret[-final_window:].mean())
            metrics["auc_gain"] = float(new_ret[1:].mean() - ppo_ret[1:].mean())
            metrics["round_time_ratio"] = float(new_time[-1] / ppo_time[-1])
            per_seed[seed] = metrics
        entry: dict[str, Any] = {"per_seed": per_seed}
        for key in ("se_ave", "se_peak", "rt_peak", "final_gain", "auc_gain", "round_time_ratio"):
            values = np.array([m[key] for m in per_seed.values()], dtype=np.float64)
            finite = values[np.isfinite(values)]
            se = float(finite.std(ddof=1) / np.sqrt(len(finite))) if len(finite) > 1 else float("nan")
            entry[key] = {"mean": float(finite.mean()) if len(finite) else float("nan"), "se": se, "ci": bootstrap_ci(finite)}
        summary[arm] = entry
    return summary


def plot(out: str, env: str, path: str) -> None:
    """
    Learning curves (mean over seeds, shaded 95 % bootstrap CI of the mean) of every arm, saved to ``path``.

    :param out: Results directory.
    :param env: A key of :data:`ENVS`.
    :param path: Output image.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load_runs(out, env)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for arm, color in zip(ARMS, ("tab:blue", "tab:red", "tab:gray"), strict=True):
        if arm not in runs:
            continue
        curves = [curve(result) for result in runs[arm].values()]
        rounds = curves[0][0]
        returns = np.stack([c[1] for c in curves if np.array_equal(c[0], rounds)])
        mean = returns.mean(axis=0)
        low, high = np.array([bootstrap_ci(column, n_boot=2000) for column in returns.T]).T
        ax.plot(
            rounds, mean, color=color, label=f"{arm.upper() if arm != 'random' else 'random filter'} ({len(returns)} seeds)"
        )
        ax.fill_between(rounds, low, high, color=color, alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("test return (stochastic policy)")
    ax.set_title(f"{env} ({ENVS[env].env_id})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _percent(entry: dict[str, Any]) -> str:
    if not np.isfinite(entry["mean"]):
        return "n/a"
    return f"{100 * entry['mean']:.1f} ± {100 * entry['se']:.1f} %"


def markdown_table(out: str, envs: Sequence[str]) -> str:
    """The results table of ``docs/benchmarks.md`` (IIF and random filtering vs PPO, mean ± s.e. over seeds)."""
    lines = [
        "| env | arm | seeds | SE_ave | SE_peak | RT_peak | final gain [95 % CI] | mean-curve gain | time vs PPO | clock |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for env in envs:
        for arm, entry in summarize(out, env).items():
            gain, auc, ratio = entry["final_gain"], entry["auc_gain"], entry["round_time_ratio"]
            clocks = "/".join(sorted({m["clock"].replace("_time", "") for m in entry["per_seed"].values()}))
            lines.append(
                f"| {env} | {arm} | {len(entry['per_seed'])} | {_percent(entry['se_ave'])} | {_percent(entry['se_peak'])} | "
                f"{_percent(entry['rt_peak'])} | {gain['mean']:+.3g} [{gain['ci'][0]:+.3g}, {gain['ci'][1]:+.3g}] | "
                f"{auc['mean']:+.3g} | {ratio['mean']:.3f} | {clocks} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sb3-influence bench``."""
    parser = argparse.ArgumentParser(prog="sb3-influence bench", description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train the arms (skips finished runs, resumes unfinished ones)")
    run.add_argument("--envs", nargs="+", default=["FrozenLake", "Acrobot", "MiniGrid", "LunarLander"], choices=sorted(ENVS))
    run.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    run.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    run.add_argument("--rounds", type=int, default=None, help="rounds per run (default: the paper's; LunarLander 50 of 150)")
    run.add_argument("--eval-episodes", type=int, default=10)
    run.add_argument("--workers", type=int, default=2)
    run.add_argument("--nice", type=int, default=0)
    summary = sub.add_parser("summary", help="print the metrics table and write the plots")
    summary.add_argument(
        "--envs", nargs="+", default=["FrozenLake", "Acrobot", "MiniGrid", "LunarLander"], choices=sorted(ENVS)
    )
    summary.add_argument("--plots", default=None, help="directory for <env>.png learning curves")
    summary.add_argument("--json", default=None, help="write the full summary to this JSON file")
    for sub_parser in (run, summary):
        sub_parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.command == "run":
        run_all(args.envs, args.arms, args.seeds, args.out, args.workers, args.rounds, args.eval_episodes, args.nice)
        return 0
    print(markdown_table(args.out, args.envs))
    if args.plots:
        for env in args.envs:
            if load_runs(args.out, env):
                plot(args.out, env, os.path.join(args.plots, f"{env}.png"))
    if args.json:
        _write_json(args.json, {env: summarize(args.out, env) for env in args.envs})
    return 0
