"""
The grid of runs (environment × optimizer setting × arm × seed), what of it is missing, and its dispatch: Ray
(locally or on a cluster), a local process pool, or this process.

Progress: a run writes its result file after every round (atomically), so the parent follows the runs in worker
processes by watching the result files of the runs not finished yet (their modification time, every
``_POLL_S`` seconds while it waits for a run to end); a run in this process reports its rounds through
``run_one(on_round=...)``. Nothing else is written: a killed grid leaves only what it always left (result files
and checkpoints), and resumes as before. On a Ray cluster whose nodes do not share ``out`` with the driver, only
the ends of runs are seen.
"""

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from sb3_influence.bench.harness import checkpoint_path, resume_round, run_config, run_one, write_json
from sb3_influence.bench.protocol import (
    ARMS,
    ENVS,
    PAPER_ENVS,
    arms_for,
    cell_name,
    check_names,
    check_seeds,
    result_path,
)
from sb3_influence.common.progress import Progress
from sb3_influence.extras import import_optional

# Seconds between two looks at the result files of the running runs (while waiting for a run to end)
_POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class Job:
    """One run of the grid (the arguments of :func:`~sb3_influence.bench.harness.run_one`)."""

    env: str
    setting: str
    arm: str
    seed: int
    variants: tuple[str, ...] = ()
    rounds: int | None = None
    eval_episodes: int = 100

    def path(self, out: str) -> str:
        """Its result file."""
        return result_path(out, self.env, self.setting, self.arm, self.seed, self.variants)

    def finished(self, out: str) -> bool:
        """Whether its result file holds a complete run with the same config."""
        path = self.path(out)
        if not os.path.exists(path):
            return False
        with open(path) as file:
            result = json.load(file)
        config = run_config(self.env, self.setting, self.arm, self.seed, self.variants, self.rounds, self.eval_episodes)
        return bool(result.get("complete")) and result.get("config") == config

    def describe(self) -> str:
        variants = "".join(f"+{v}" for v in self.variants)
        return f"{self.env} {self.setting}{variants} {self.arm} seed {self.seed}"


def grid(
    envs: Sequence[str] = PAPER_ENVS,
    arms: Sequence[str] | None = None,
    seeds: Sequence[int] = (0, 1, 2, 3, 4),
    settings: Sequence[str] | None = None,
    variants: Sequence[str] = (),
    rounds: int | None = None,
    eval_episodes: int = 100,
) -> list[Job]:
    """
    The jobs of a grid, environment by environment and setting by setting; within a cell PPO and the arms compared
    with it (``"ppo"`` in their ``Arm.versus``: IIF, optimizer-aware IIF) of every seed before the other arms (so
    that paired results come first). Each arm runs only in the settings it applies
    to (:func:`~sb3_influence.bench.protocol.arms_for`): an arm restricted to the Adam settings has no job in an
    SGD cell.

    :param envs: Keys of :data:`~sb3_influence.bench.harness.ENVS`.
    :param arms: Keys of :data:`~sb3_influence.bench.harness.ARMS`; ``None``: every arm but the opt-in ones
        (``Arm.opt_in``), each in the settings it applies to; with ``variants``, ``VARIANT_ARMS``.
    :param seeds: Seeds.
    :param settings: Keys of :data:`~sb3_influence.bench.harness.SETTINGS`; ``None``: each environment's own
        protocol settings (``EnvSpec.settings``).
    :param variants: Keys of :data:`~sb3_influence.bench.harness.VARIANTS`, applied to every cell.
    :param rounds: Rounds per run (default: each cell's budget).
    :param eval_episodes: Evaluation episodes.
    :return: The jobs.
    :raises ValueError: For unknown names, no seeds, a seed below 0 or given twice, or an arm given in ``arms``
        that applies to none of the cells asked for (it would have no job at all).
    """
    check_names(envs=envs, settings=settings or (), arms=arms or (), variants=variants)
    check_seeds(seeds)
    jobs = []
    for env in envs:
        for setting in ENVS[env].settings if settings is None else settings:
            applicable = arms_for(cell_name(setting, variants), arms, env)
            first = [a for a in applicable if a == "ppo" or "ppo" in ARMS[a].versus]
            rest = [a for a in applicable if a not in first]
            for group in (first, rest):
                jobs += [
                    Job(env, setting, arm, seed, tuple(sorted(variants)), rounds, eval_episodes)
                    for seed in seeds
                    for arm in group
                ]
    for arm in dict.fromkeys(arms or ()):
        if not any(job.arm == arm for job in jobs):
            asked = sorted({s for env in envs for s in (ENVS[env].settings if settings is None else settings)})
            raise ValueError(
                f"arm {arm!r} applies to none of the cells asked for (settings {', '.join(asked)} of "
                f"{', '.join(envs)}): it runs in {ARMS[arm].where()} only (ARMS[{arm!r}].settings, .envs); add one "
                f"of those (--settings, --envs), or leave {arm!r} out of the arms"
            )
    for job in jobs:  # validates rounds and eval_episodes before anything runs
        run_config(job.env, job.setting, job.arm, job.seed, job.variants, job.rounds, job.eval_episodes)
    return jobs


def missing(jobs: Sequence[Job], out: str) -> list[Job]:
    """The jobs whose result file does not hold a finished run."""
    return [job for job in jobs if not job.finished(out)]


def _execute(
    job: Job, out: str, niceness: int, on_round: Callable[[int, int], None] | None = None
) -> tuple[str, dict[str, Any]]:
    if niceness:
        os.nice(niceness)
    tic = time.perf_counter()
    result = run_one(
        job.env, job.arm, job.seed, out, job.setting, job.variants, job.rounds, job.eval_episodes, on_round=on_round
    )
    hours = result.get("total_cpu_time", float("nan")) / 3600
    line = f"{job.describe()}: {time.perf_counter() - tic:.0f} s, {hours:.3f} CPU h"
    return line, result


def _stop_when_orphaned(parent: int) -> Callable[[int, int], None]:
    """
    A pool worker's ``on_round``: end the worker (after the round's result file is written) once its parent is
    gone. A parent killed by a signal (``timeout``, ``kill``) runs no cleanup and leaves its pool's workers alive,
    training on and writing result files that nobody runs any more; a grid run again would run them twice over.
    """

    def on_round(round_: int, rounds: int) -> None:
        if os.getppid() != parent:
            raise SystemExit(f"the grid that started this run (pid {parent}) is gone: stopping after round {round_}")

    return on_round


def _execute_star(args: tuple[Job, str, int]) -> tuple[str, dict[str, Any]]:
    return _execute(*args, on_round=_stop_when_orphaned(os.getppid()))


def _ray_results(jobs: Sequence[Job], out: str, workers: int, niceness: int, address: str | None) -> Iterator[Any]:
    ray = import_optional("ray", "distributed", "backend 'ray' (or use --backend process)")
    started = not ray.is_initialized()
    if started:
        if address is None:
            # A new Ray instance on this machine, even if a stale cluster address is lying around
            ray.init(address="local", num_cpus=workers, include_dashboard=False, log_to_driver=False)
        else:
            # A running cluster (sb3_influence must be installed on its nodes); ray:// addresses use Ray Client
            ray.init(address=address, log_to_driver=False)
    try:
        # One CPU per run: each run uses one torch thread
        remote = ray.remote(num_cpus=1, max_calls=1)(_execute)
        pending = [remote.remote(job, out, niceness) for job in jobs]
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=_POLL_S)
            yield ray.get(done[0]) if done else None
    finally:
        if started:
            ray.shutdown()


def _pool_results(results: Any) -> Iterator[Any]:
    """The results of a pool's ``imap_unordered``, with ``None`` every ``_POLL_S`` seconds while none arrives."""
    import multiprocessing

    while True:
        try:
            yield results.next(timeout=_POLL_S)
        except multiprocessing.TimeoutError:
            yield None
        except StopIteration:
            return


def _read_result(path: str, config: dict[str, Any]) -> dict[str, Any] | None:
    """The result file at ``path`` if it holds the run ``config`` (finished or not), else ``None``."""
    try:
        with open(path) as file:
            result = json.load(file)
    except (OSError, ValueError):
        return None
    return result if result.get("config") == config else None


class GridProgress:
    """
    Rounds and runs of a grid, shown by a :class:`~sb3_influence.common.progress.Progress` whose unit is the
    round: its total is the rounds left in the runs to do (a run that resumes from a checkpoint does not count the
    rounds before it); its status, the runs done out of the grid's and the current round of each run under way.

    :param todo: The runs to do.
    :param n_jobs: The runs of the grid (finished ones included).
    :param out: Results directory.
    :param progress: Keyword arguments of :class:`~sb3_influence.common.progress.Progress` (``enabled``,
        ``interval``, ``stream``, ``bar``, ``clock``).
    """

    def __init__(self, todo: Sequence[Job], n_jobs: int, out: str, **progress: Any):
        self.out = out
        self.n_jobs = n_jobs
        self.runs_done = n_jobs - len(todo)
        self.configs = {
            job.path(out): run_config(job.env, job.setting, job.arm, job.seed, job.variants, job.rounds, job.eval_episodes)
            for job in todo
        }
        self.names = {job.path(out): job.describe() for job in todo}
        # Rounds of each run counted so far: a run resumes after its checkpoint round
        checkpoints = {
            job.path(out): checkpoint_path(out, job.env, job.setting, job.arm, job.seed, job.variants) for job in todo
        }
        self.counted = {
            path: resume_round(_read_result(path, config), config, checkpoints[path]) for path, config in self.configs.items()
        }
        self.running: dict[str, int] = {}  # the runs under way: their last round seen
        # Files left by an earlier invocation are read again only once a run of this one has written them
        self.mtimes = {path: self._mtime(path) for path in self.configs}
        total = sum(config["rounds"] - self.counted[path] for path, config in self.configs.items())
        self.progress = Progress(total, unit="round", desc="bench run", **progress)
        self.progress.update(0, self._status())

    @staticmethod
    def _mtime(path: str) -> int | None:
        try:
            return os.stat(path).st_mtime_ns
        except OSError:
            return None

    def _status(self) -> str:
        running = [f"{self.names[path]}: round {r}/{self.configs[path]['rounds']}" for path, r in self.running.items()]
        return "; ".join([f"runs {self.runs_done}/{self.n_jobs} done", *running])

    def on_round(self, path: str, round_: int) -> None:
        """Round ``round_`` of the run whose result file is ``path`` has finished."""
        new = max(0, round_ - self.counted[path])
        self.counted[path] = max(self.counted[path], round_)
        self.running[path] = round_
        self.progress.update(new, self._status())

    def on_round_of(self, job: Job) -> Callable[[int, int], None]:
        """The ``on_round`` of :func:`~sb3_influence.bench.harness.run_one` for a run in this process."""
        path = job.path(self.out)
        return lambda round_, rounds: self.on_round(path, round_)

    def poll(self) -> None:
        """Look at the result files of the runs not finished yet; report the rounds written since the last look."""
        if not self.progress.enabled:
            return
        for path, config in self.configs.items():
            mtime = self._mtime(path)
            if self.counted[path] >= config["rounds"] or mtime is None or mtime == self.mtimes[path]:
                continue
            self.mtimes[path] = mtime
            result = _read_result(path, config)
            round_ = int(result["rows"][-1]["round"]) if result and result.get("rows") else 0
            if round_ > 0 and round_ != self.running.get(path):
                self.on_round(path, round_)

    def run_done(self, path: str) -> None:
        """The run whose result file is ``path`` has ended (one line, whatever the rate limit)."""
        rounds = self.configs[path]["rounds"] if path in self.configs else 0
        new = max(0, rounds - self.counted.get(path, rounds))
        self.counted[path] = rounds
        self.running.pop(path, None)
        self.runs_done += 1
        self.progress.update(new, self._status(), force=True)

    def close(self) -> None:
        """End the bar."""
        self.progress.close()


def run_grid(
    jobs: Sequence[Job],
    out: str,
    workers: int = 2,
    backend: str = "auto",
    address: str | None = None,
    niceness: int = 0,
    log: Callable[[str], None] = print,
    progress: bool = False,
    progress_interval: float = 30.0,
) -> float:
    """
    Run the jobs that are not finished yet and write their result files.

    :param jobs: From :func:`grid`.
    :param out: Results directory (on a Ray cluster the driver writes each finished result here too).
    :param workers: Runs at a time on this machine (ignored with ``address``: the cluster's CPUs decide).
    :param backend: ``"ray"``, ``"process"`` (a local process pool; ``workers=1`` runs in this process) or
        ``"auto"`` (Ray when it is installed or ``address`` is given, else ``"process"``).
    :param address: Address of a Ray cluster (``ray.init(address=...)``); ``None``: start Ray locally.
    :param niceness: Added to the workers' nice value.
    :param log: Where the lines at the start and at the end of each run go.
    :param progress: Show the rounds of the runs under way, the runs done and an ETA (:class:`GridProgress`): a
        tqdm bar when stdout is a terminal, else plain lines on stdout, flushed.
    :param progress_interval: Plain lines: at least this many seconds between two lines, except at the end of a
        run (always one line).
    :return: CPU hours spent by the finished runs of ``jobs`` (all of them, including earlier invocations).
    """
    if backend not in ("auto", "ray", "process"):
        raise ValueError(f"backend must be 'auto', 'ray' or 'process', got {backend!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if not progress_interval >= 0:
        raise ValueError(
            f"progress_interval (--progress-interval) must be a number of seconds >= 0, got {progress_interval!r}"
        )
    if backend == "auto":
        import importlib.util

        backend = "ray" if address is not None or importlib.util.find_spec("ray") is not None else "process"
    todo = missing(jobs, out)
    log(f"{len(jobs) - len(todo)} of {len(jobs)} runs already finished; running {len(todo)} with backend {backend!r}")
    if todo:
        watcher = GridProgress(todo, len(jobs), out, enabled=progress, interval=progress_interval)
        try:
            if backend == "ray":
                results: Iterator[Any] = _ray_results(todo, out, workers, niceness, address)
            elif workers == 1:
                results = (_execute(job, out, niceness, watcher.on_round_of(job)) for job in todo)
            else:
                import multiprocessing

                pool = multiprocessing.get_context("spawn").Pool(workers, maxtasksperchild=1)
                results = _pool_results(pool.imap_unordered(_execute_star, [(job, out, niceness) for job in todo]))
            for item in results:
                watcher.poll()
                if item is None:
                    continue
                line, result = item
                config = result["config"]
                job = Job(config["env"], config["setting"], config["arm"], config["seed"], tuple(config["variants"]))
                write_json(job.path(out), result)
                watcher.progress.write(line, log)
                watcher.run_done(job.path(out))
            if backend == "process" and workers > 1:
                pool.close()
                pool.join()
        finally:
            watcher.close()
    hours = cpu_hours(jobs, out)
    log(f"CPU time of the {len(jobs) - len(missing(jobs, out))} finished runs: {hours:.2f} h")
    return hours


def cpu_hours(jobs: Sequence[Job], out: str) -> float:
    """Total CPU hours (``total_cpu_time``) recorded in the result files of ``jobs`` (unfinished ones included)."""
    total = 0.0
    for job in jobs:
        path = job.path(out)
        if os.path.exists(path):
            with open(path) as file:
                total += json.load(file).get("total_cpu_time", 0.0)
    return total / 3600
