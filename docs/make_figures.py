"""
Draw the figures of docs/guide/applications.md into docs/_static/img/ (about a minute on a laptop CPU).

    python docs/make_figures.py

FrozenLake 4x4 (not slippery), SGD lr 5e-3 as in the paper, but 512-step rounds (the paper uses 2048) to stay fast.
"""

import os
import sys

import gymnasium as gym
import numpy as np
import torch as th
from matplotlib.figure import Figure

from sb3_influence import ActionTarget, AttributionCallback, InfluencePPO
from sb3_influence.analysis import DiagnosisCallback, InterventionCallback, behaviour_formation, plot_phases

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_static", "img")


def frozen_lake() -> gym.Env:
    return gym.make("FrozenLake-v1", map_name="4x4", is_slippery=False)


def main(snapshot_dir: str = "/tmp/sb3_influence_docs_snapshots") -> None:
    os.makedirs(OUT, exist_ok=True)
    kwargs = dict(n_steps=512, batch_size=64, n_epochs=10, learning_rate=5e-3, seed=0, max_grad_norm=1e10)
    kwargs["policy_kwargs"] = dict(optimizer_class=th.optim.SGD)
    model = InfluencePPO("MlpPolicy", frozen_lake(), **kwargs)
    # Behaviour: "go down (action 1) from the start state 0"
    behaviour = ActionTarget(np.array([0]), np.array([1]), name="down_at_start")
    diagnosis = DiagnosisCallback(rounds=None)
    intervention = InterventionCallback(rounds=None, eval_env=frozen_lake(), n_eval_episodes=20, fraction=0.1)
    attribution = AttributionCallback(targets=["return", behaviour], save_dir=snapshot_dir)
    model.learn(512 * 15, callback=[attribution, diagnosis, intervention])

    # 1. Diagnosis: influence vs true x estimated advantage, one round
    result = diagnosis.results[5]
    figure = Figure(figsize=(4.5, 3.5), layout="constrained")
    ax = figure.subplots()
    product = (result["true_advantage"] * result["estimated_advantage"]).ravel()
    ax.scatter(product, result["influence"].ravel(), s=6, alpha=0.5)
    ax.set_xlabel("true advantage x estimated advantage")
    ax.set_ylabel("influence on f_return")
    ax.set_title(f"FrozenLake round {result['round']}: Spearman {result['spearman']:.2f}", fontsize=10)
    figure.savefig(os.path.join(OUT, "diagnosis.png"), dpi=100)
    rhos = [r["spearman"] for r in diagnosis.results]
    print("diagnosis Spearman per round:", np.round(rhos, 2))

    # 2. Behaviour formation: phase plot
    formation = behaviour_formation(
        snapshot_dir,
        target="down_at_start",
        embed=lambda obs: np.stack([obs[:, 0] // 4, obs[:, 0] % 4], axis=1),
        n_neighbors=20,
    )
    plot_phases(formation, title="FrozenLake: 'down at the start state'").savefig(os.path.join(OUT, "formation.png"), dpi=100)
    print(formation.round(3).to_string(index=False))

    # 3. Intervention: change of test return against the unfiltered retrain, per arm and round
    import pandas as pd

    table = pd.concat(intervention.results)
    pivot = table[table.arm != "none"].pivot(index="round", columns="arm", values="delta_target")
    figure = Figure(figsize=(6, 3.2), layout="constrained")
    ax = figure.subplots()
    pivot.plot.bar(ax=ax, width=0.8)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_ylabel("Δ f_return vs unfiltered retrain")
    ax.set_title("Retraining a round without chosen records", fontsize=10)
    figure.savefig(os.path.join(OUT, "intervention.png"), dpi=100)
    summary = (
        table[table.arm != "none"].groupby("arm")[["delta_target", "delta_return"]].agg(["mean", lambda x: (x > 0).mean()])
    )
    print(summary.round(4).to_string())


if __name__ == "__main__":
    main(*sys.argv[1:])
