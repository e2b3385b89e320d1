"""
IIF per record vs IIF per trajectory vs DTV-Loo vs PPO on MiniGrid (issue 13), one result file per run, resumable.

Runs use only the public API of ``sb3_influence``. Every arm of a seed starts from the same weights (same seed)
and uses the paper's MiniGrid settings (SGD, lr 5e-3, no gradient clipping, p = 0.125, MiniGridCNN); evaluation
samples the stochastic policy on ``--eval-episodes`` episodes with the same seed for every arm.

    nice -n 19 python benchmarks/units_dtv.py run --env Empty-8x8 --arms ppo iif-record iif-trajectory dtv-loo \
        --seeds 0 1 2 3 4 --rounds 40 --out benchmarks/results/units_dtv
    python benchmarks/units_dtv.py summary --out benchmarks/results/units_dtv

``summary`` prints, per env and arm, the interquartile mean (IQM) and mean of the final evaluation return over
seeds with 95 % percentile-bootstrap intervals (rliable's estimators, in numpy: rliable is not a dependency).
"""

import argparse
import json
import os
import tempfile
import time
from typing import Any

import numpy as np
import torch as th

ENVS = {"Empty-8x8": "MiniGrid-Empty-8x8-v0", "DoorKey-8x8": "MiniGrid-DoorKey-8x8-v0"}
ARMS = ("ppo", "iif-record", "iif-trajectory", "dtv-loo")
FRACTION = 0.125


def make_env(env_id: str, n_envs: int, seed: int) -> Any:
    import minigrid  # noqa: F401  (registers the MiniGrid ids)
    from minigrid.wrappers import ImgObsWrapper
    from stable_baselines3.common.env_util import make_vec_env

    return make_vec_env(env_id, n_envs=n_envs, seed=seed, wrapper_class=ImgObsWrapper)


def make_callback(arm: str) -> Any:
    from sb3_influence import DTVLooCallback, IIFCallback

    if arm == "ppo":
        return None
    if arm == "iif-record":
        return IIFCallback(fraction=FRACTION, unit="record")
    if arm == "iif-trajectory":
        return IIFCallback(fraction=FRACTION, unit="trajectory")
    if arm == "dtv-loo":
        return DTVLooCallback(fraction=FRACTION)
    raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")


def evaluate(model: Any, env_id: str, episodes: int, seed: int) -> float:
    from stable_baselines3.common.evaluation import evaluate_policy

    env = make_env(env_id, min(episodes, 10), seed)
    with th.random.fork_rng(devices=[]):
        th.manual_seed(seed)
        mean, _ = evaluate_policy(model, env, n_eval_episodes=episodes, deterministic=False, warn=False)
    env.close()
    return float(mean)


def write_json(path: str, payload: dict[str, Any]) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp_", suffix=".json")
    with os.fdopen(fd, "w") as file:
        json.dump(payload, file, indent=1)
    os.replace(tmp, path)


def run_one(env_name: str, arm: str, seed: int, args: argparse.Namespace) -> None:
    from sb3_influence import InfluencePPO, MiniGridCNN

    path = os.path.join(args.out, env_name, f"{arm}_seed{seed}.json")
    if os.path.exists(path):
        print(f"skip {path} (done)")
        return
    env_id = ENVS[env_name]
    th.set_num_threads(1)
    model = InfluencePPO(
        "CnnPolicy",
        make_env(env_id, 1, seed),
        learning_rate=5e-3,
        n_steps=args.n_steps,
        batch_size=64,
        n_epochs=10,
        max_grad_norm=1e10,
        seed=seed,
        policy_kwargs=dict(
            optimizer_class=th.optim.SGD, features_extractor_class=MiniGridCNN, net_arch=dict(pi=[64, 64], vf=[64, 64])
        ),
    )
    evaluations: list[dict[str, float]] = []
    start, cpu_start = time.time(), time.process_time()
    callback = make_callback(arm)
    for round_ in range(args.rounds):
        model.learn(args.n_steps, callback=callback, reset_num_timesteps=round_ == 0)
        if (round_ + 1) % args.eval_every == 0 or round_ + 1 == args.rounds:
            evaluations.append(
                {
                    "round": round_ + 1,
                    "timesteps": model.num_timesteps,
                    "return": evaluate(model, env_id, args.eval_episodes, 10_000 + seed),
                }
            )
            print(f"{env_name} {arm} seed {seed} round {round_ + 1}: {evaluations[-1]['return']:.3f}", flush=True)
    write_json(
        path,
        {
            "env": env_id,
            "arm": arm,
            "seed": seed,
            "fraction": FRACTION,
            "rounds": args.rounds,
            "n_steps": args.n_steps,
            "eval_episodes": args.eval_episodes,
            "evaluations": evaluations,
            "final_return": evaluations[-1]["return"],
            "wall_seconds": time.time() - start,
            "cpu_seconds": time.process_time() - cpu_start,
        },
    )


def iqm(values: np.ndarray) -> float:
    """Interquartile mean: the mean of the middle 50 % (rliable's aggregate)."""
    values = np.sort(np.asarray(values, dtype=np.float64))
    n = len(values)
    return float(values[int(np.floor(0.25 * n)) : max(int(np.ceil(0.75 * n)), int(np.floor(0.25 * n)) + 1)].mean())


def bootstrap(values: np.ndarray, statistic: Any, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    draws = [statistic(rng.choice(values, size=len(values), replace=True)) for _ in range(reps)]
    return float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))


def summary(args: argparse.Namespace) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for env_name in sorted(os.listdir(args.out)):
        folder = os.path.join(args.out, env_name)
        if not os.path.isdir(folder):
            continue
        for arm in ARMS:
            runs = [
                json.load(open(os.path.join(folder, name)))
                for name in sorted(os.listdir(folder))
                if name.startswith(f"{arm}_seed") and name.endswith(".json")
            ]
            if not runs:
                continue
            finals = np.array([run["final_return"] for run in runs])
            table[f"{env_name}/{arm}"] = {
                "seeds": [run["seed"] for run in runs],
                "iqm": iqm(finals),
                "iqm_ci95": bootstrap(finals, iqm),
                "mean": float(finals.mean()),
                "mean_ci95": bootstrap(finals, np.mean),
                "cpu_seconds_per_run": float(np.mean([run["wall_seconds"] for run in runs])),
                "rounds": runs[0]["rounds"],
                "n_steps": runs[0]["n_steps"],
                "eval_episodes": runs[0]["eval_episodes"],
            }
            row = table[f"{env_name}/{arm}"]
            print(
                f"{env_name:12s} {arm:15s} n={len(runs)} IQM {row['iqm']:.3f} [{row['iqm_ci95'][0]:.3f}, "
                f"{row['iqm_ci95'][1]:.3f}]  mean {row['mean']:.3f}  {row['cpu_seconds_per_run']:.0f} s/run"
            )
    write_json(os.path.join(args.out, "summary.json"), table)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("run", "summary"))
    parser.add_argument("--env", nargs="+", default=["Empty-8x8"], choices=sorted(ENVS))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--n-steps", type=int, default=2048)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-episodes", type=int, default=100)
    parser.add_argument("--out", default="benchmarks/results/units_dtv")
    args = parser.parse_args()
    if args.command == "summary":
        summary(args)
        return
    # Seed-major order: a partial run still compares every arm on the same seeds
    for env_name in args.env:
        for seed in args.seeds:
            for arm in args.arms:
                run_one(env_name, arm, seed, args)


if __name__ == "__main__":
    main()
