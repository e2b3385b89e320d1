"""
One benchmark run: an arm trained on one cell of the protocol (:mod:`sb3_influence.bench.protocol`) with one seed,
round by round, its result file written after every round.
"""

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch as th
from sb3_influence.common.callbacks import RoundCallback
from sb3_influence.common.files import write_json

from sb3_influence.bench.evaluation import EVAL_ENVS, evaluate, make_eval_env
from sb3_influence.bench.protocol import (
    ARMS,
    ENVS,
    PPO_KWARGS,
    EnvSpec,
    cell_name,
    check_applies,
    check_names,
    check_seeds,
    result_path,
    reuses_unfiltered,
    run_kwargs,
)
from sb3_influence.bench.summary import same_start


def make_env(spec: EnvSpec, n_envs: int, seed: int) -> Any:
    """
    The vectorised environment of a benchmark (``Monitor``-wrapped, ``ImgObsWrapper`` for MiniGrid).

    :param spec: The benchmark.
    :param n_envs: Number of environments.
    :param seed: Seed of the first environment.
    :return: A ``DummyVecEnv``.
    """
    import importlib

    from stable_baselines3.common.env_util import make_vec_env

    if spec.register is not None:
        try:
            importlib.import_module(spec.register)
        except ImportError as error:
            raise ImportError(
                f"{spec.env_id} needs the {spec.register!r} package: pip install {spec.register.replace('_', '-')}"
            ) from error
    wrapper = None
    if spec.minigrid:
        from minigrid.wrappers import ImgObsWrapper

        wrapper = ImgObsWrapper
    return make_vec_env(spec.env_id, n_envs=n_envs, seed=seed, env_kwargs=_plain(spec.env_kwargs), wrapper_class=wrapper)


def _plain(value: Any) -> Any:
    """A copy with every mapping a plain ``dict`` (read-only ``MappingProxyType`` configs cannot be pickled)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def make_model(spec: EnvSpec, seed: int, setting: str = "sgd", **overrides: Any) -> Any:
    """
    An ``InfluencePPO`` for ``spec`` with an optimizer setting of :data:`SETTINGS`.

    :param spec: The benchmark.
    :param seed: Seed (same seed, same initial weights, whatever the arm).
    :param setting: A key of :data:`SETTINGS`.
    :param overrides: Replace any keyword argument (``n_envs``, ``n_steps``, ``policy_kwargs``, ...).
    :return: The model.
    """
    from sb3_influence import InfluencePPO, MiniGridCNN

    kwargs = {**run_kwargs(spec, setting), **overrides}
    kwargs.pop("rounds")
    n_envs = kwargs.pop("n_envs")
    optimizer = {"sgd": th.optim.SGD, "adam": th.optim.Adam}[kwargs.pop("optimizer")]
    policy_kwargs = {"optimizer_class": optimizer, **kwargs.pop("policy_kwargs", {})}
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


class DropPartialMinibatch(RoundCallback):
    """
    Drop the leftover partial minibatch of the kept records (the ``"drop-partial"`` variant): after the filters,
    clear the keep mask of ``n_kept mod batch_size`` kept records drawn uniformly (model seed + round), so the
    update takes ``n_epochs · floor(n_kept / batch_size)`` steps. (A data loader with ``drop_last`` drops other
    leftover records every epoch; this drops the same ones in every epoch of a round.) A round filter: put it after
    the ``IIFCallback`` in the callback list (filters act in the order given).
    """

    round_role = "filter"

    def on_round(self, round_: Any) -> None:
        model: Any = self.model
        keep = model.rollout_buffer.keep
        leftover = int(keep.sum()) % model.batch_size
        if leftover:
            rng = np.random.default_rng([int(model.seed or 0), int(round_.index)])
            drop = np.zeros(keep.size, dtype=bool)
            drop[rng.choice(np.flatnonzero(keep), size=leftover, replace=False)] = True
            model.drop_records(drop.reshape(keep.shape), source={"filter": "DropPartialMinibatch"})


def make_callback(arm: str, fraction: float, variants: Sequence[str] = ()) -> Any:
    """
    The callback that turns ``InfluencePPO`` into an arm of :data:`ARMS`: none for an arm without a rule, else
    ``filter_class(fraction, rule, **iif_kwargs)`` (``IIFCallback`` unless the arm names another filter; followed
    by :class:`DropPartialMinibatch` with that variant).

    :param arm: A key of :data:`ARMS`.
    :param fraction: The drop fraction ``p``.
    :param variants: Keys of :data:`~sb3_influence.bench.protocol.VARIANTS`.
    :return: A callback or ``None``.
    """
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {sorted(ARMS)}, got {arm!r}")
    check_names(variants=variants)
    spec = ARMS[arm]
    if spec.rule is None:
        return None
    from stable_baselines3.common.callbacks import CallbackList

    import sb3_influence

    callback = getattr(sb3_influence, spec.filter_class)(fraction=fraction, rule=spec.rule, **spec.iif_kwargs)
    if "drop-partial" in variants:
        return CallbackList([callback, DropPartialMinibatch()])
    return callback


def parameter_hash(model: Any) -> str:
    """SHA-256 of the policy's parameters (to check that arms start from identical weights)."""
    digest = hashlib.sha256()
    for name, tensor in model.policy.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def parameter_fingerprint(model: Any) -> list[float]:
    """Per parameter tensor of the policy, the float64 sum, sum of absolute values and sum of squares: equal up to
    rounding for weights that differ by a few ulps (another machine's kernels), far apart for another seed's."""
    values = []
    for tensor in model.policy.state_dict().values():
        array = tensor.detach().cpu().double()
        values += [float(array.sum()), float(array.abs().sum()), float((array**2).sum())]
    return values


def checkpoint_path(out: str, env: str, setting: str, arm: str, seed: int, variants: Sequence[str] = ()) -> str:
    """
    Where an unfinished run keeps its model: ``<out>/checkpoints/<env>/<cell>/<arm>_seed<seed>.zip``, next to the
    result files and committed with the unfinished run's file, so that a run longer than a session (highway-v0,
    BipedalWalker) resumes in the next one, on this machine or another; deleted when the run finishes.
    """
    return os.path.join(out, "checkpoints", env, cell_name(setting, variants), f"{arm}_seed{seed}.zip")


def resume_round(previous: dict[str, Any] | None, config: dict[str, Any], checkpoint: str) -> int:
    """
    The round a run resumes after: its result file's ``checkpoint_round`` when the file is of the same config and
    the checkpoint exists, else 0 (the run starts again from round 1).

    :param previous: The run's result file, or ``None``.
    :param config: The run's config (:func:`run_config`).
    :param checkpoint: Its checkpoint path (:func:`checkpoint_path`).
    :return: The last finished round to resume after.
    """
    if previous is None or previous.get("config") != config or not os.path.exists(checkpoint):
        return 0
    return int(previous.get("checkpoint_round", 0))


def run_config(
    env: str,
    setting: str,
    arm: str,
    seed: int,
    variants: Sequence[str] = (),
    rounds: int | None = None,
    eval_episodes: int = 100,
) -> dict[str, Any]:
    """
    Everything that determines a run, as stored in its result file (a finished run with the same config is
    skipped). An arm's ``iif_kwargs`` are recorded only when it has some, and its ``filter_class`` only when it is
    not ``IIFCallback``, so that the configs of the arms without them stay what they were.

    :raises ValueError: For an unknown name, an arm that does not apply to ``setting`` or ``env`` (``Arm.settings``,
        ``Arm.envs``), a seed
        that is not an int >= 0, or ``rounds`` / ``eval_episodes`` below 1.
    """
    check_names(envs=[env], settings=[setting], arms=[arm], variants=variants)
    check_seeds([seed])
    check_applies(arm, setting, env)
    spec = ENVS[env]
    kwargs = run_kwargs(spec, setting, variants)
    if rounds is not None:
        kwargs["rounds"] = rounds
    if kwargs["rounds"] < 1 or eval_episodes < 1:
        raise ValueError(
            f"rounds and eval_episodes must be >= 1, got rounds={kwargs['rounds']}, eval_episodes={eval_episodes}"
        )
    extra: dict[str, Any] = {"iif_kwargs": dict(ARMS[arm].iif_kwargs)} if ARMS[arm].iif_kwargs else {}
    if ARMS[arm].filter_class != "IIFCallback":
        extra["filter_class"] = ARMS[arm].filter_class
    return {
        "env": env,
        "env_id": spec.env_id,
        "setting": setting,
        "variants": sorted(variants),
        "arm": arm,
        "rule": ARMS[arm].rule,
        **extra,
        "seed": seed,
        "fraction": spec.fraction,
        "eval_episodes": "exact" if spec.exact_eval else eval_episodes,
        "eval_envs": None if spec.exact_eval else min(eval_episodes, EVAL_ENVS),
        "eval_every": spec.eval_every,
        # only where it is set, so that the configs (and result files) of the other environments stay as they were
        **({"eval_first": spec.eval_first} if spec.eval_first else {}),
        **kwargs,
    }


def run_one(
    env: str,
    arm: str,
    seed: int,
    out: str,
    setting: str = "sgd",
    variants: Sequence[str] = (),
    rounds: int | None = None,
    eval_episodes: int = 100,
    checkpoint_every: int = 10,
    on_round: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """
    Train one arm on one cell, writing :func:`result_path` after every round; a finished run with the same
    config is returned without training, an unfinished one resumes from its last checkpoint (:func:`checkpoint_path`).
    A process that watches the result file sees every finished round (that is how ``run_grid`` follows runs in
    worker processes); ``on_round`` gets them in this process.

    :param env: A key of :data:`ENVS`.
    :param arm: A key of :data:`ARMS`.
    :param seed: Seed (training env, initial weights); evaluation uses ``10_000 + seed`` in every arm.
    :param out: Results directory.
    :param setting: A key of :data:`SETTINGS`.
    :param variants: Keys of :data:`~sb3_influence.bench.protocol.VARIANTS`.
    :param rounds: Number of rounds (default: the paper's budget of environment steps).
    :param eval_episodes: Stochastic evaluation episodes per evaluation (ignored for exact evaluation).
    :param checkpoint_every: Save the model at :func:`checkpoint_path` every this many rounds (to resume).
    :param on_round: Called as ``on_round(round, rounds)`` after each round's result is written (not for a run
        returned without training); it must not change the model.
    :return: The result dict (also on disk).
    """
    if on_round is not None and not callable(on_round):
        raise TypeError(f"on_round must be a callable on_round(round, rounds) or None, got {type(on_round).__name__}")
    config = run_config(env, setting, arm, seed, variants, rounds, eval_episodes)
    # One torch thread per run (runs go in parallel, one per core); the caller's setting is restored afterwards
    previous = th.get_num_threads()
    th.set_num_threads(1)
    try:
        return _run_one(config, out, eval_episodes, checkpoint_every, on_round)
    finally:
        th.set_num_threads(previous)


def _load(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path) as file:
        return json.load(file)


def package_versions() -> dict[str, str]:
    """The versions of the packages a run's initial weights and training depend on (stored in its result file)."""
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "stable-baselines3", "gymnasium", "numpy")}


def check_same_start(config: dict[str, Any], out: str, start: dict[str, Any]) -> None:
    """
    Raise ``RuntimeError`` before any training when the cell's PPO run of the same seed, which this run is compared
    with, started from other initial weights (:func:`~sb3_influence.bench.summary.same_start`): the comparison would
    be refused at the end, after hours of CPU. A PPO run is nobody's follower; where the cell has no PPO run yet, its
    PPO run will start where this one does (trained here, or reused only from a run that started there,
    :func:`_reuse_unfiltered`).

    :param start: This run's ``init_hash`` and ``init_fingerprint``.
    """
    if config["arm"] == "ppo":
        return
    env, setting, seed, variants = config["env"], config["setting"], config["seed"], config["variants"]
    path = result_path(out, env, setting, "ppo", seed, variants)
    base = _load(path)
    if base is not None and not same_start(base, start):
        init_hash = start["init_hash"]
        # The cell's other runs of this seed that started with that PPO run: their comparison goes with it
        paired = [
            other
            for other in (result_path(out, env, setting, arm, seed, variants) for arm in ARMS if arm != "ppo")
            if (run := _load(other)) is not None and same_start(base, run)
        ]
        files = [path, *paired]
        delete = f"{', '.join(files[:-1])} and {files[-1]}" if paired else path
        raise RuntimeError(
            f"{config['arm']} seed {seed} of {env} {cell_name(setting, variants)} would start from other initial "
            f"weights (hash {init_hash}) than the PPO run it is compared with, {path} (hash {base.get('init_hash')}): "
            f"the installed packages or the machine differ from that run's (its versions: "
            f"{base.get('versions', 'not recorded')}; now: {package_versions()}; a file without 'init_fingerprint' "
            f"is matched by its hash only, which another CPU's kernels change by a few ulps). Delete {delete} and "
            "run them again here too (or run this one on the machine that made them), so that the arms of the seed "
            "start from the same weights."
        )


def _reuse_unfiltered(config: dict[str, Any], out: str, eval_episodes: int, start: dict[str, Any]) -> dict[str, Any] | None:
    """
    The finished run of an arm without a rule in the cell without the variants, when the variants only change
    filtering (so training would repeat it bit for bit) and that run started where this one would
    (:func:`~sb3_influence.bench.summary.same_start`: on another machine the same seed can give other weights);
    ``None`` otherwise, and the run is trained in its own cell.

    :param start: The ``init_hash`` and ``init_fingerprint`` this run would start from.
    """
    if not reuses_unfiltered(config["arm"], config["variants"]):
        return None
    base_config = run_config(
        config["env"], config["setting"], config["arm"], config["seed"], (), config["rounds"], eval_episodes
    )
    base_path = result_path(out, config["env"], config["setting"], config["arm"], config["seed"])
    base = _load(base_path)
    if base is None or not base.get("complete") or base.get("config") != base_config or not same_start(base, start):
        return None
    # The CPU time was spent once, by the run reused: not counted again
    return {**base, "config": config, "reused_from": os.path.relpath(base_path, out), "total_cpu_time": 0.0}


def _run_one(
    config: dict[str, Any],
    out: str,
    eval_episodes: int,
    checkpoint_every: int,
    on_round: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    from sb3_influence import InfluencePPO

    env, arm, seed, setting, variants = config["env"], config["arm"], config["seed"], config["setting"], config["variants"]
    spec, rounds = ENVS[env], config["rounds"]
    path = result_path(out, env, setting, arm, seed, variants)
    previous = _load(path)
    if previous is not None and previous.get("config") == config and previous.get("complete"):
        return previous
    cpu_start = time.process_time()
    overrides = {key: config[key] for key in ("n_envs", *PPO_KWARGS, "learning_rate", "max_grad_norm")}
    model = make_model(spec, seed, setting, **overrides)
    start_weights = {"init_hash": parameter_hash(model), "init_fingerprint": parameter_fingerprint(model)}
    reused = _reuse_unfiltered(config, out, eval_episodes, start_weights)
    if reused is not None:
        write_json(path, reused)
        return reused
    eval_seed = 10_000 + seed
    checkpoint = checkpoint_path(out, env, setting, arm, seed, variants)
    eval_env = make_eval_env(spec, eval_episodes, eval_seed)
    result: dict[str, Any] = {
        "config": config,
        **start_weights,
        "versions": package_versions(),
        "complete": False,
        "rows": [],
    }
    start = 1
    done = resume_round(previous, config, checkpoint)
    if done == 0:
        check_same_start(config, out, start_weights)
    if previous is not None and done > 0:
        model = InfluencePPO.load(checkpoint, env=model.get_env())
        # A resumed run is reproducible, but not the same as an uninterrupted one (fresh RNG streams)
        model.set_random_seed(seed + 1_000 * done)
        result = {**previous, "rows": [row for row in previous["rows"] if row["round"] <= done]}
        result.setdefault("resumed_at", []).append(done)
        result.setdefault("resumed_versions", []).append(package_versions())
        start = done + 1
    if start == 1:
        tic = time.process_time()
        initial = evaluate(model, spec, eval_episodes, eval_seed, eval_env)
        result["rows"].append(
            dict(
                round=0,
                timesteps=0,
                wall_time=0.0,
                round_time=0.0,
                cpu_time=0.0,
                eval_cpu_time=time.process_time() - tic,
                eval_return=initial,
                kept_fraction=1.0,
            )
        )
    callback = make_callback(arm, spec.fraction, variants)
    n_round = model.n_steps * model.n_envs
    wall, cpu = result["rows"][-1]["wall_time"], result["rows"][-1].get("cpu_time", float("nan"))
    spent = result.get("total_cpu_time", 0.0) if start > 1 else 0.0
    for round_ in range(start, rounds + 1):
        # Wall-clock and process CPU time of the round (rollout + scoring + update), evaluation excluded. On a
        # shared machine the CPU time of this single-threaded process is the load-independent measure.
        tic, cpu_tic = time.perf_counter(), time.process_time()
        filtering = callback if round_ > 1 or "first-unfiltered" not in variants else None
        model.learn(n_round, callback=filtering, reset_num_timesteps=False)
        round_time = time.perf_counter() - tic
        wall += round_time
        cpu += time.process_time() - cpu_tic
        row = dict(
            round=round_,
            timesteps=int(model.num_timesteps),
            wall_time=wall,
            round_time=round_time,
            cpu_time=cpu,
            kept_fraction=float(model.rollout_buffer.flat_keep.mean()),
            eval_return=None,
        )
        if spec.evaluated(round_, rounds):
            tic = time.process_time()
            row["eval_return"] = evaluate(model, spec, eval_episodes, eval_seed, eval_env)
            row["eval_cpu_time"] = time.process_time() - tic
        result["rows"].append(row)
        if round_ % checkpoint_every == 0 and round_ < rounds:
            os.makedirs(os.path.dirname(checkpoint), exist_ok=True)
            model.save(checkpoint)
            result["checkpoint_round"] = round_
        result["complete"] = round_ == rounds
        # Everything this process spent on the run (setup, rounds, evaluations), summed over resumptions
        result["total_cpu_time"] = spent + time.process_time() - cpu_start
        write_json(path, result)
        if result["complete"] and os.path.exists(checkpoint):
            os.remove(checkpoint)
        if on_round is not None:
            on_round(round_, rounds)
    eval_env.close()
    return result
