"""
CUDA check: the scorers give the CPU's numbers on a GPU, and what scoring costs there against the PPO update.

For each case, two identical models collect the same rollout on the CPU (same seed); the second is then moved to
the GPU (policy and rollout buffer) and both score the round with every scorer. Reported: the largest difference
relative to the largest score, the Spearman correlation, and on the GPU the time of each scorer and of one PPO
update (``train()``), medians of 3 with ``torch.cuda.synchronize()``. Needs a CUDA device; writes
``benchmarks/results/cuda_check.json`` (or ``--out``).

    python benchmarks/cuda_check.py --out $OUT/cuda_check.json
"""

import argparse
import json
import platform
import time
from typing import Any

import numpy as np
import torch as th

from sb3_influence.common import sb3_compat
from sb3_influence.common.stats import spearman

SCORERS: dict[str, dict[str, Any]] = {
    "single": {},
    "multi": dict(checkpoints="multi"),
    "aware": dict(optimizer_aware=True),
    "unrolled": dict(optimizer_aware="unrolled"),
    "smoothed": dict(optimizer_aware="unrolled", clip_smoothing=3e-2, n_orders=4),
}


def make_model(case: str, n_steps: int) -> Any:
    from stable_baselines3.common.env_util import make_vec_env

    from sb3_influence import InfluencePPO, MiniGridCNN

    if case == "mlp":
        return InfluencePPO("MlpPolicy", "CartPole-v1", n_steps=n_steps, batch_size=64, seed=0, device="cpu")
    import minigrid  # noqa: F401  (registers the environments)
    from minigrid.wrappers import ImgObsWrapper

    env = make_vec_env("MiniGrid-Empty-8x8-v0", n_envs=1, seed=0, wrapper_class=ImgObsWrapper)
    policy_kwargs = dict(features_extractor_class=MiniGridCNN, normalize_images=False)
    return InfluencePPO("CnnPolicy", env, n_steps=n_steps, batch_size=64, seed=0, device="cpu", policy_kwargs=policy_kwargs)


def timed(call: Any, repeats: int = 3) -> tuple[Any, float]:
    times, out = [], None
    for _ in range(repeats):
        th.cuda.synchronize()
        start = time.perf_counter()
        out = call()
        th.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return out, float(np.median(times))


def run_case(case: str, n_steps: int) -> dict[str, Any]:
    # One after the other: the constructor seeds the global RNGs that the rollout draws from
    cpu = make_model(case, n_steps)
    sb3_compat.collect_rollout(cpu)
    gpu = make_model(case, n_steps)
    sb3_compat.collect_rollout(gpu)
    np.testing.assert_array_equal(cpu.rollout_buffer.observations, gpu.rollout_buffer.observations)
    device = th.device("cuda")
    gpu.policy.to(device)
    gpu.device = device
    gpu.rollout_buffer.device = device
    result: dict[str, Any] = {"case": case, "n_steps": n_steps, "scorers": {}}
    for name, kwargs in SCORERS.items():
        expected = cpu.compute_influence(**kwargs)
        got, seconds = timed(lambda kwargs=kwargs: gpu.compute_influence(**kwargs))
        scale = float(np.abs(expected).max())
        result["scorers"][name] = {
            "max_rel_diff": float(np.abs(got - expected).max() / scale) if scale > 0 else 0.0,
            "spearman": spearman(got, expected),
            "gpu_s": seconds,
        }
        print(case, name, result["scorers"][name], flush=True)
    state = {k: v.clone() for k, v in gpu.policy.state_dict().items()}
    optimizer = gpu.policy.optimizer.state_dict()

    def update() -> None:
        gpu.policy.load_state_dict(state)
        gpu.policy.optimizer.load_state_dict(optimizer)
        gpu.train()

    _, result["train_s"] = timed(update)
    result["single_over_train"] = result["scorers"]["single"]["gpu_s"] / result["train_s"]
    print(case, "train", result["train_s"], "single/train", result["single_over_train"], flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/cuda_check.json")
    parser.add_argument("--n-steps", type=int, default=2048)
    args = parser.parse_args()
    if not th.cuda.is_available():
        raise SystemExit("no CUDA device: this check needs one")
    results = {"device": th.cuda.get_device_name(0), "torch": th.__version__, "python": platform.python_version()}
    results["cases"] = []
    for case in ("mlp", "cnn"):
        try:
            results["cases"].append(run_case(case, args.n_steps))
        except Exception as error:  # report and go on: one failing case must not hide the other's numbers
            results["cases"].append({"case": case, "error": repr(error)})
            print(case, "error", repr(error), flush=True)
    with open(args.out, "w") as file:
        json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
