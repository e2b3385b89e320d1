"""The paired runs: the paper's environments and settings, one arm × env × seed per run, resumable."""

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
    "LunarLander": EnvSpec("LunarLander-v3", 0.125, 150, eval_every=3),
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
