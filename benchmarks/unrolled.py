"""
Diagnostic: the exact first-order influence through the whole unrolled update (a hypergradient), against the LDS.

The optimizer-aware score (``compute_influence(optimizer_aware=True)``) carries each step's parameter change to the
end of the round unchanged: it leaves out curvature between steps. This script differentiates the round's update
itself: it replays it with a weight ``w_i`` on every record's loss (``w = 1`` is the real update), through the
gradient clip and Adam, keeping the graph, and returns ``∂f(θ_J)/∂w_i`` — the exact first-order effect of
zero-weighting record i, curvature included. It only runs Adam (SB3's default) and small MLP policies (the graph
of the whole update is kept in memory). If its LDS is high where the optimizer-aware score's is low, curvature is
what the in-run score misses.

    nice -n 19 python benchmarks/unrolled.py --env CartPole-v1 --round 3 --seed 1
"""

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch as th
from torch import nn

RESULTS = Path(__file__).parent / "results" / "unrolled"


class _Losses(nn.Module):
    def __init__(self, model: Any):
        super().__init__()
        self.policy = model.policy
        self.__dict__["_model"] = model

    def forward(self, samples: Any, advantages: th.Tensor, clip_range: float) -> th.Tensor:
        model = self.__dict__["_model"]
        return model.record_losses(samples, advantages, clip_range, None)


class _LogProb(nn.Module):
    def __init__(self, model: Any):
        super().__init__()
        self.policy = model.policy

    def forward(self, observations: th.Tensor, actions: th.Tensor) -> th.Tensor:
        return self.policy.evaluate_actions(observations, actions)[1]


def unrolled_influence(model: Any) -> np.ndarray:
    """``∂f(θ_J)/∂w_i`` for every record of the current round, Adam and gradient clipping included."""
    from sb3_influence.common import sb3_compat
    from sb3_influence.common.state import training_state

    round_ = model.current_round()
    buffer = model.rollout_buffer
    optimizer = model.policy.optimizer
    assert isinstance(optimizer, th.optim.Adam), "this diagnostic replays Adam only"
    with training_state(model):
        round_.start_state.restore(model, keep=False)
        group = optimizer.param_groups[0]
        lr, (beta1, beta2), eps = model.lr_schedule(sb3_compat.progress_remaining(model)), group["betas"], group["eps"]
        clip_range = model.clip_range(sb3_compat.progress_remaining(model))
        names = [name for name, p in model.policy.named_parameters()]
        originals = dict(model.policy.named_parameters())
        params = {name: originals[name].detach().clone().requires_grad_(True) for name in names}
        state = {name: optimizer.state.get(originals[name], {}) for name in names}
        m = {name: state[name].get("exp_avg", th.zeros_like(params[name])).clone() for name in names}
        v = {name: state[name].get("exp_avg_sq", th.zeros_like(params[name])).clone() for name in names}
        steps = {name: int(state[name].get("step", 0)) for name in names}
        weights = th.ones(buffer.n_records, requires_grad=True)
        losses_module, log_prob_module = _Losses(model), _LogProb(model)
        model.policy.set_training_mode(True)
        theta = dict(params)
        for epoch in range(model.n_epochs):
            order = round_.first_permutation if epoch == 0 else np.random.permutation(buffer.n_records)
            for ids in buffer.kept_minibatches(order, model.batch_size):
                samples = buffer.samples(ids)
                advantages = samples.advantages
                if model.normalize_advantage and len(advantages) > 1:
                    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
                per_record = th.func.functional_call(losses_module, {f"policy.{k}": t for k, t in theta.items()},
                                                     (samples, advantages, clip_range), tie_weights=False)  # fmt: skip
                loss = (weights[th.as_tensor(ids)] * per_record).mean()
                grads = th.autograd.grad(loss, list(theta.values()), create_graph=True, allow_unused=True)
                grads = [th.zeros_like(t) if g is None else g for g, t in zip(grads, theta.values(), strict=True)]
                norm = th.sqrt(sum((g * g).sum() for g in grads))
                coefficient = th.clamp(model.max_grad_norm / (norm + 1e-6), max=1.0)
                new_theta = {}
                for (name, t), g in zip(theta.items(), grads, strict=True):
                    g = g * coefficient
                    steps[name] += 1
                    m[name] = beta1 * m[name] + (1 - beta1) * g
                    v[name] = beta2 * v[name] + (1 - beta2) * g * g
                    m_hat = m[name] / (1 - beta1 ** steps[name])
                    v_hat = v[name] / (1 - beta2 ** steps[name])
                    new_theta[name] = t - lr * m_hat / (th.sqrt(v_hat + 1e-30) + eps)
                theta = new_theta
        observations = th.as_tensor(buffer.flat_field("observations")).float()
        actions = th.as_tensor(buffer.flat_field("actions"))
        if actions.shape[-1] == 1 and model.action_space.shape == ():
            actions = actions.long().flatten()
        model.policy.set_training_mode(False)
        log_prob = th.func.functional_call(log_prob_module, {f"policy.{k}": t for k, t in theta.items()},
                                           (observations, actions), tie_weights=False)  # fmt: skip
        raw = th.as_tensor(buffer.flat_field("advantages")).float()
        target = (raw * log_prob).mean()
        (gradient,) = th.autograd.grad(target, weights)
    return buffer.to_records(gradient.detach().double().numpy())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--env", default="CartPole-v1", help="gymnasium id (MLP policy)")
    parser.add_argument("--round", type=int, default=3, help="rounds trained before the scored one")
    parser.add_argument("--seed", type=int, default=1, help="seed")
    parser.add_argument("--n-steps", type=int, default=512, help="records per round")
    parser.add_argument("--subsets", type=int, default=40, help="random 5 %% subsets")
    args = parser.parse_args()

    from sb3_influence import InfluencePPO
    from sb3_influence.analysis.faithfulness import faithfulness

    th.set_num_threads(1)
    model = InfluencePPO("MlpPolicy", args.env, n_steps=args.n_steps, seed=args.seed)
    if args.round:
        model.learn(args.round * args.n_steps)
    _, callback = model._setup_learn(args.n_steps, callback=None, reset_num_timesteps=False)
    callback.on_training_start(locals(), globals())
    model.collect_rollouts(model.env, callback, model.rollout_buffer, n_rollout_steps=args.n_steps)
    start = time.process_time()
    scores = {
        "single": model.compute_influence(),
        "aware": model.compute_influence(optimizer_aware=True),
        "unrolled": unrolled_influence(model),
    }
    seconds = time.process_time() - start
    result = faithfulness(model, scores, sizes=(0.05,), n_subsets=args.subsets, n_orders=4, seed=1)
    result.update(env=args.env, round=args.round, seed=args.seed, n_steps=args.n_steps, scoring_cpu_s=seconds)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.env}_r{args.round}_s{args.seed}_n{args.subsets}.json"
    path.write_text(json.dumps(result, indent=1))
    print(path.name, {name: round(value, 3) for name, value in result["lds"].items()}, "ceiling", round(result["ceiling"], 3))


if __name__ == "__main__":
    main()
