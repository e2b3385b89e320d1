"""
Cost of influence scoring next to PPO's own update, measured side by side on the same rounds.

Per round: collect one rollout; time ``compute_influence()`` (``"return"`` target; median of 3 calls); pick the
records to drop with the paper's ``neg-bottom`` rule; time PPO's ``train()`` on every record and on the kept
records only, in ABBA order (full, filtered, filtered, full), each from the same saved parameters, optimizer
state and RNG state, so that drifts of a shared machine's load cancel; then take the unfiltered update and go on
to the next round. Reported: medians over rounds of ``t_influence / t_train``, of ``t_floor / t_train`` (one forward
and one backward pass of ``Σ log π`` over the buffer: what any exact gradient score needs at least), of the PPO round
(``rollout + train``) and of the IIF round (``rollout + influence + filtered train``), the ratio of optimizer
steps, and the peak resident memory added by ``compute_influence`` (RSS sampled every 0.5 ms by a thread,
in a child process with
glibc's mmap threshold fixed at 64 KiB so that freed tensors leave RSS; timings are taken without that setting,
which slows allocation), with its scaling in ``n``.

    python benchmarks/overhead.py --repeats 5 --out benchmarks/results/overhead.json

One torch thread (``--threads``), CPU only.
"""

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import torch as th

from sb3_influence import bench
from sb3_influence.common import sb3_compat
from sb3_influence.common.filters import drop_neg_bottom

_PAGE = os.sysconf("SC_PAGE_SIZE")

CASES: dict[str, dict[str, Any]] = {
    "LunarLander MLP 64x64, n=2048": dict(env="LunarLander", n_envs=1, n_steps=2048, net_arch=None),
    "MiniGrid CNN, n=2048": dict(env="MiniGrid", n_envs=1, n_steps=2048, net_arch=None),
    "LunarLander MLP 256x256, 8 envs x 2048 = 16384": dict(env="LunarLander", n_envs=8, n_steps=2048, net_arch=[256, 256]),
}


def _rss() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * _PAGE


class PeakRSS:
    """Context manager: peak resident memory above the level at entry, sampled by a background thread."""

    def __init__(self, interval: float = 5e-4):
        self.interval = interval
        self.peak = 0

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self.baseline = _rss()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *args: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def added(self) -> int:
        return self.peak - self.baseline


def _model(env: str, n_envs: int, n_steps: int, net_arch: list[int] | None, seed: int = 0) -> Any:
    spec = bench.ENVS[env]
    policy_kwargs = {} if net_arch is None else {"net_arch": dict(pi=net_arch, vf=net_arch)}
    model = bench.make_model(spec, seed, n_envs=n_envs, n_steps=n_steps, policy_kwargs=policy_kwargs)
    sb3_compat.setup_learn(model, 10**9)
    return model


def _collect(model: Any) -> float:
    from stable_baselines3.common.callbacks import CallbackList

    callback = CallbackList([])
    callback.init_callback(model)
    tic = time.perf_counter()
    model.collect_rollouts(model.env, callback, model.rollout_buffer, n_rollout_steps=model.n_steps)
    return time.perf_counter() - tic


def _restore(model: Any, saved: tuple[dict, dict], rng: tuple[Any, th.Tensor]) -> None:
    model.policy.load_state_dict(saved[0])
    model.policy.optimizer.load_state_dict(saved[1])
    np.random.set_state(rng[0])
    th.set_rng_state(rng[1])


def _timed_train(model: Any) -> float:
    tic = time.perf_counter()
    model.train()
    return time.perf_counter() - tic


def _timed_floor(model: Any) -> float:
    """
    One forward and one backward pass of ``Σ log π(a|s)`` over the whole buffer, to the policy's parameters: the
    least an exact gradient-based score of every record needs (the scorer needs this and more).
    """
    buffer = model.rollout_buffer
    obs, _ = model.policy.obs_to_tensor(buffer.flat_field("observations"))
    actions = th.as_tensor(buffer.flat_field("actions"), device=model.device)
    if model.action_space.shape == ():
        actions = actions.long().flatten()
    params = [param for param in model.policy.parameters() if param.requires_grad]
    tic = time.perf_counter()
    log_prob = model.policy.get_distribution(obs).log_prob(actions)
    th.autograd.grad(log_prob.sum(), params, allow_unused=True)
    return time.perf_counter() - tic


def measure_case(
    env: str, n_envs: int, n_steps: int, net_arch: list[int] | None, repeats: int, fraction: float
) -> dict[str, Any]:
    """
    Side-by-side timings of one configuration over ``repeats`` rounds.

    :return: Medians and the raw per-round numbers.
    """
    model = _model(env, n_envs, n_steps, net_arch)
    # Warm-up round, not timed (first calls pay for lazy set-up and allocator growth)
    _collect(model)
    model.compute_influence("return")
    model.train()
    rows = []
    for _ in range(repeats):
        t_rollout = _collect(model)
        saved = (copy.deepcopy(model.policy.state_dict()), copy.deepcopy(model.policy.optimizer.state_dict()))
        rng = (np.random.get_state(), th.get_rng_state())

        times, peaks = [], []
        for _ in range(3):
            with PeakRSS() as memory:
                tic = time.perf_counter()
                scores = model.compute_influence("return")
                times.append(time.perf_counter() - tic)
            peaks.append(memory.added)
        floor = statistics.median(_timed_floor(model) for _ in range(3))
        buffer = model.rollout_buffer
        iif_keep = ~buffer.to_records(drop_neg_bottom(buffer.to_flat(scores), fraction, np.random.default_rng(0)))
        # ABBA order (full, filtered, filtered, full) from the same parameters, so that load drifts cancel
        train, train_iif = [], []
        for filtered in (False, True, True, False):
            buffer.keep[:] = iif_keep if filtered else True
            (train_iif if filtered else train).append(_timed_train(model))
            _restore(model, saved, rng)
        # The next round starts from the unfiltered update
        buffer.keep[:] = True
        model.train()
        n_kept = int(iif_keep.sum())
        rows.append(dict(rollout=t_rollout, train=float(np.mean(train)), influence=statistics.median(times), floor=floor,
                         train_iif=float(np.mean(train_iif)), kept=n_kept / buffer.n_records,
                         steps=model.n_epochs * -(-buffer.n_records // model.batch_size),
                         steps_iif=model.n_epochs * -(-n_kept // model.batch_size),
                         memory_mib=max(peaks) / 2**20))  # fmt: skip
    ratio = [r["influence"] / r["train"] for r in rows]
    ppo_round = [r["rollout"] + r["train"] for r in rows]
    iif_round = [r["rollout"] + r["influence"] + r["train_iif"] for r in rows]
    return {
        "n": n_envs * n_steps,
        "influence_s": statistics.median(r["influence"] for r in rows),
        "train_s": statistics.median(r["train"] for r in rows),
        "influence_over_train": statistics.median(ratio),
        "floor_s": statistics.median(r["floor"] for r in rows),
        "floor_over_train": statistics.median(r["floor"] / r["train"] for r in rows),
        "ppo_round_s": statistics.median(ppo_round),
        "iif_round_s": statistics.median(iif_round),
        "iif_over_ppo_round": statistics.median(i / p for i, p in zip(iif_round, ppo_round, strict=True)),
        "kept_fraction": statistics.median(r["kept"] for r in rows),
        "optimizer_steps_iif_over_ppo": statistics.median(r["steps_iif"] / r["steps"] for r in rows),
        "influence_peak_mib": max(r["memory_mib"] for r in rows),
        "rounds": rows,
    }


def measure_scaling(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    """Time and peak memory of one ``compute_influence`` call (a single chunk) against ``n`` (LunarLander MLP)."""
    results = []
    for n in sizes:
        model = _model("LunarLander", 1, n, None)
        _collect(model)
        model.compute_influence("return", batch_size=n)
        times, peaks = [], []
        for _ in range(repeats):
            with PeakRSS() as memory:
                tic = time.perf_counter()
                model.compute_influence("return", batch_size=n)
                times.append(time.perf_counter() - tic)
            peaks.append(memory.added / 2**20)
        results.append({"n": n, "influence_s": statistics.median(times), "peak_mib": statistics.median(peaks)})
    return results


def measure_memory(cases: list[str], sizes: list[int]) -> dict[str, Any]:
    """
    Peak extra RSS of one ``compute_influence`` call per case and per ``n`` (LunarLander MLP, one chunk). Run in a
    child process with glibc's mmap threshold fixed at 64 KiB, so that freed tensors leave RSS (which also makes
    allocation slower: timings are taken in the parent, without it).
    """
    memory: dict[str, Any] = {"cases": {}, "scaling": {}}
    for name in cases:
        model = _model(**CASES[name])
        _collect(model)
        model.compute_influence("return")
        with PeakRSS() as peak:
            model.compute_influence("return")
        memory["cases"][name] = peak.added / 2**20
    for n in sizes:
        model = _model("LunarLander", 1, n, None)
        _collect(model)
        model.compute_influence("return", batch_size=n)
        with PeakRSS() as peak:
            model.compute_influence("return", batch_size=n)
        memory["scaling"][str(n)] = peak.added / 2**20
    return memory


def markdown(result: dict[str, Any]) -> str:
    """The tables of ``docs/benchmarks.md``."""
    lines = [
        "| case | n | influence (s) | PPO train() (s) | influence / train | one forward + backward / train | PPO round (s) "
        "| IIF round (s) | IIF / PPO round | kept | optimizer steps IIF / PPO | peak extra RSS (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, case in result["cases"].items():
        lines.append(
            f"| {name} | {case['n']} | {case['influence_s']:.3f} | {case['train_s']:.2f} | "
            f"{100 * case['influence_over_train']:.1f} % | {100 * case['floor_over_train']:.1f} % | "
            f"{case['ppo_round_s']:.2f} | {case['iif_round_s']:.2f} | "
            f"{case['iif_over_ppo_round']:.3f} | {case['kept_fraction']:.3f} | {case['optimizer_steps_iif_over_ppo']:.3f} | "
            f"{case['influence_peak_mib']:.1f} |"
        )
    lines += ["", "| n (one chunk) | influence (s) | peak extra RSS (MiB) | MiB per 1000 records |", "|---|---|---|---|"]
    for row in result["scaling"]:
        lines.append(
            f"| {row['n']} | {row['influence_s']:.4f} | {row['peak_mib']:.1f} | {1000 * row['peak_mib'] / row['n']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds per case (medians over them)")
    parser.add_argument("--fraction", type=float, default=0.125, help="IIF fraction p of the filtered update")
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the results to this JSON file")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        th.set_num_threads(args.threads)
        print(json.dumps(measure_memory(args.cases, args.sizes)))
        return
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    th.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/overhead.py", *sys.argv[1:]]),
        "threads": args.threads,
        "torch": th.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cases": {},
    }
    for name in args.cases:
        result["cases"][name] = measure_case(**CASES[name], repeats=args.repeats, fraction=args.fraction)
        print(name, {k: v for k, v in result["cases"][name].items() if k != "rounds"}, flush=True)
    result["scaling"] = measure_scaling(args.sizes, args.repeats)
    # Memory in a child process whose large blocks come straight from mmap and go back to the OS when freed (glibc)
    command = [sys.executable, os.path.abspath(__file__), "--memory-child", "--threads", str(args.threads), "--sizes"]
    command += [str(n) for n in args.sizes] + ["--cases", *args.cases]
    child = subprocess.run(command, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}, capture_output=True, text=True)
    if child.returncode != 0:
        raise RuntimeError(f"memory measurement failed:\n{child.stderr}")
    memory = json.loads(child.stdout.strip().splitlines()[-1])
    for name, case in result["cases"].items():
        case["influence_peak_mib"] = memory["cases"][name]
    for row in result["scaling"]:
        row["peak_mib"] = memory["scaling"][str(row["n"])]
    print(markdown(result))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
