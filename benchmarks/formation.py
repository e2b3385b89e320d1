"""
Behaviour formation on Acrobot and highway-env (the paper's Sec. 4.2, Fig. 10 and Fig. 4): train ``InfluencePPO``
with the benchmark protocol (``sgd`` setting), score every round against an ``ActionTarget`` for one behaviour,
and follow three curves over the rounds: the action-advantage association, the graph roughness of the positive
records (state embeddings from the *final* model, so that every round lives in one space) and the scale max |I|.

Usage::

    python benchmarks/formation.py --env Acrobot --seeds 0 1 2     # train (finished env x seed files are skipped)
    python benchmarks/formation.py --env highway --seeds 0 --rounds 20
    python benchmarks/formation.py --plot                           # figures from the committed result files

One result file per env x seed: ``benchmarks/results/formation/<env>_seed<seed>.json``, written atomically when
the run is finished (an interrupted run starts again from round 0). Snapshots go to a scratch folder.

The behaviours (the target is ``f_action = mean log π(a*|s)`` over fixed probe states, the paper's Sec. 3):

- Acrobot: "+1 torque while the second joint swings in the positive direction" (``θ̇2 > 0``, action 2). The torque
  then does positive work on the joint (power ``τ·θ̇2 > 0``): it pumps energy into the swing. The controller "+1 torque
  if ``θ̇2 > 0`` else -1 torque" reaches the goal in 83 steps on average (10 episodes), against 500 (time-out) for
  the random policy. Probe states: 64 states with ``θ̇2 > 0`` from rollouts of that controller (env seeds from 1000).
- highway: "slow down when closing in on a vehicle ahead in the same lane" (action 4, ``SLOWER``): a vehicle in
  the ego lane (relative ``|y| < 0.125``, a half lane), ahead within 0.15 of the normalised ``x`` range (about 30 m),
  with a negative relative speed. Probe states: 64 such states from uniformly random rollouts (env seeds 1000+).
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch as th
from stable_baselines3.common.callbacks import BaseCallback

from sb3_influence import ActionTarget, AttributionCallback
from sb3_influence.analysis import behaviour_formation, graph_roughness
from sb3_influence.analysis.formation import state_embeddings
from sb3_influence.bench.harness import make_model, write_json
from sb3_influence.bench.protocol import ENVS, run_kwargs

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "formation")
FIGURES = os.path.join(HERE, os.pardir, "docs", "_static", "img")
N_PROBES = 64
PROBE_SEED = 1000
NEIGHBOURS = (20, 100)
N_SHUFFLES = 5
# The phase rule (stated in docs/guide/applications.md)
SATURATION_SCALE = 0.1  # saturation: from the first round after which max|I| stays below 10 % of its run maximum
CLUSTER_RATIO = 0.5  # clustering: roughness (u = 20) below half that of the same scores shuffled over the records


def _rollout_states(
    env_id: str,
    env_kwargs: dict[str, Any],
    policy: Callable[[np.ndarray, Any], int],
    keep: Callable[[np.ndarray], bool],
    register: str | None,
    max_steps: int = 20_000,
) -> np.ndarray:
    """States kept by ``keep`` along rollouts of ``policy`` (env seeds ``PROBE_SEED``, +1, ...), ``N_PROBES`` of
    them drawn uniformly without replacement."""
    import importlib

    import gymnasium as gym

    if register is not None:
        importlib.import_module(register)
    env = gym.make(env_id, **env_kwargs)
    rng = np.random.default_rng(PROBE_SEED)
    found: list[np.ndarray] = []
    steps, episode = 0, 0
    while len(found) < 4 * N_PROBES and steps < max_steps:
        obs, _ = env.reset(seed=PROBE_SEED + episode)
        env.action_space.seed(PROBE_SEED + episode)
        episode += 1
        done = False
        while not done and steps < max_steps:
            if keep(obs):
                found.append(np.array(obs, dtype=np.float32))
            obs, _, terminated, truncated, _ = env.step(policy(obs, env))
            done = terminated or truncated
            steps += 1
    env.close()
    if len(found) < N_PROBES:
        raise RuntimeError(f"only {len(found)} probe states in {steps} steps of {env_id}; need {N_PROBES}")
    return np.stack(found)[rng.choice(len(found), N_PROBES, replace=False)]


def _acrobot_probes() -> np.ndarray:
    # obs = (cos θ1, sin θ1, cos θ2, sin θ2, θ̇1, θ̇2); the energy-pumping controller: +1 torque iff θ̇2 > 0
    return _rollout_states(
        "Acrobot-v1", {}, lambda obs, env: 2 if obs[5] > 0 else 0, lambda obs: bool(obs[5] > 0), ENVS["Acrobot"].register
    )


def _closing_in_ahead(obs: np.ndarray) -> bool:
    # Kinematics rows: (presence, x, y, vx, vy), row 0 the ego vehicle, the others relative to it, normalised
    others = obs[1:]
    same_lane = (others[:, 0] > 0) & (np.abs(others[:, 2]) < 0.125)
    return bool(np.any(same_lane & (others[:, 1] > 0) & (others[:, 1] < 0.15) & (others[:, 3] < 0)))


def _highway_probes() -> np.ndarray:
    spec = ENVS["highway"]
    return _rollout_states(
        spec.env_id, spec.env_kwargs, lambda obs, env: env.action_space.sample(), _closing_in_ahead, spec.register
    )


@dataclasses.dataclass(frozen=True)
class Behaviour:
    """One behaviour: the action ``a*`` and how its probe states are drawn."""

    name: str
    action: int
    description: str
    probes: Callable[[], np.ndarray]


BEHAVIOURS = {
    "Acrobot": Behaviour(
        "pump", 2, "+1 torque while the second joint swings in the positive direction (θ̇2 > 0)", _acrobot_probes
    ),
    "highway": Behaviour(
        "brake", 4, "SLOWER when closing in on a vehicle ahead in the same lane (within ~30 m)", _highway_probes
    ),
}


def result_file(out: str, env: str, seed: int) -> str:
    """``<out>/<env>_seed<seed>.json``."""
    return os.path.join(out, f"{env}_seed{seed}.json")


def _config(env: str, seed: int, rounds: int | None) -> dict[str, Any]:
    kwargs = run_kwargs(ENVS[env], "sgd")
    protocol_rounds = kwargs["rounds"]
    if rounds is not None:
        kwargs["rounds"] = rounds
    behaviour = BEHAVIOURS[env]
    return {
        "env": env,
        "env_id": ENVS[env].env_id,
        "seed": seed,
        "setting": "sgd",
        "protocol_rounds": protocol_rounds,
        "behaviour": behaviour.name,
        "behaviour_action": behaviour.action,
        "behaviour_description": behaviour.description,
        "n_probes": N_PROBES,
        "probe_seed": PROBE_SEED,
        "neighbours": list(NEIGHBOURS),
        "embedding": "latent_pi of the final model",
        **kwargs,
    }


def _roughness_ratio(snapshots: Any, target: str, embed: Callable[[np.ndarray], np.ndarray], seed: int) -> list[float]:
    """Roughness (u = 20) over the roughness of the same positive scores shuffled across the same records (mean of
    ``N_SHUFFLES`` shuffles): 1 means no more clustering than chance, 0 equal scores for neighbours."""
    from sb3_influence.common.snapshots import load_all

    rng = np.random.default_rng(seed)
    ratios = []
    for snapshot in load_all(snapshots):
        scores = snapshot.scores(target)
        positive = scores > 0
        embeddings = embed(snapshot.observations())[positive]
        kept = scores[positive]
        rough = graph_roughness(kept, embeddings, n_neighbors=NEIGHBOURS[0])
        shuffled = [graph_roughness(rng.permutation(kept), embeddings, n_neighbors=NEIGHBOURS[0]) for _ in range(N_SHUFFLES)]
        ratios.append(float(rough / np.mean(shuffled)) if np.isfinite(rough) and np.mean(shuffled) > 0 else float("nan"))
    return ratios


class RoundLog(BaseCallback):
    """Per round, at θ(k) (the parameters the round is scored at): the behaviour's mean probability on the probes,
    the mean training return of the last 100 episodes, and the wall and CPU time since the start of training."""

    def __init__(self, probes: np.ndarray, action: int):
        super().__init__()
        self.probes, self.action = probes, action
        self.rows: list[dict[str, Any]] = []
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        with th.no_grad():
            obs, _ = self.model.policy.obs_to_tensor(self.probes)
            distribution = self.model.policy.get_distribution(obs).distribution
            probability = distribution.probs[:, self.action].mean().item()
        returns = [info["r"] for info in self.model.ep_info_buffer]
        self.rows.append(
            {
                "behaviour_probability": probability,
                "train_return": float(np.mean(returns)) if returns else None,
                "wall_time": time.perf_counter() - self.wall,
                "cpu_time": time.process_time() - self.cpu,
            }
        )


def _plain(value: Any) -> Any:
    """JSON-ready: numpy scalars as Python numbers, NaN as ``None``."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, (np.integer, np.bool_)):
        return value.item()
    if isinstance(value, (float, np.floating)):
        return None if not np.isfinite(value) else float(value)
    return value


def run(env: str, seed: int, out: str, scratch: str, rounds: int | None = None) -> dict[str, Any]:
    """Train one env x seed and write its result file (returned without training when it exists with the same
    config)."""
    path = result_file(out, env, seed)
    config = _config(env, seed, rounds)
    if os.path.exists(path):
        with open(path) as file:
            previous = json.load(file)
        if previous["config"] == config:
            print(f"{path}: done, skipped")
            return previous
    th.set_num_threads(1)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    behaviour = BEHAVIOURS[env]
    probes = behaviour.probes()
    spec = ENVS[env]
    model = make_model(spec, seed, "sgd")
    target = ActionTarget(probes, np.full(len(probes), behaviour.action), name=behaviour.name)
    snapshots = os.path.join(scratch, f"{env}_seed{seed}")
    attribution = AttributionCallback(targets=[target], save_dir=snapshots, log_histogram=False, overwrite=True)
    log = RoundLog(probes, behaviour.action)
    model.learn(config["rounds"] * model.n_steps * model.n_envs, callback=[log, attribution])
    train_wall, train_cpu = time.perf_counter() - wall0, time.process_time() - cpu0

    shape = model.observation_space.shape

    def embed(obs: np.ndarray) -> np.ndarray:
        return state_embeddings(model, obs.reshape(-1, *shape).astype(np.float32))

    formation = behaviour_formation(
        snapshots, target=behaviour.name, embed=embed, n_neighbors=NEIGHBOURS[0], action=behaviour.action
    )
    formation = formation.rename(columns={"roughness": f"roughness_u{NEIGHBOURS[0]}"})
    for u in NEIGHBOURS[1:]:
        formation[f"roughness_u{u}"] = behaviour_formation(snapshots, target=behaviour.name, embed=embed, n_neighbors=u)[
            "roughness"
        ]
    formation["roughness_ratio"] = _roughness_ratio(snapshots, behaviour.name, embed, seed)
    rows = _plain([{**row, **extra} for row, extra in zip(formation.to_dict("records"), log.rows, strict=True)])
    result = {
        "config": config,
        "probes": probes.tolist(),
        "rows": rows,
        "phases": phases(rows),
        "train_wall_time": train_wall,
        "train_cpu_time": train_cpu,
        "total_wall_time": time.perf_counter() - wall0,
        "total_cpu_time": time.process_time() - cpu0,
        "host_cpus": os.cpu_count(),
    }
    write_json(path, _plain(result))
    print(f"{path}: {len(rows)} rounds, {result['total_cpu_time']:.0f} CPU s, phases {result['phases']}")
    return result


def phases(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """
    The phase rule: saturation from the first round after which ``scale`` stays below ``SATURATION_SCALE`` of its
    maximum over the run; semantic clustering from the first earlier round whose ``roughness_ratio`` is below
    ``CLUSTER_RATIO``; action-advantage association before that.

    :param rows: The per-round rows of a result file.
    :return: ``{"association": [first, last], "clustering": [first, last] or None, "saturation": [first, last] or
        None}``, rounds inclusive.
    """
    rounds = [int(row["round"]) for row in rows]
    scale = np.array([row["scale"] for row in rows], dtype=float)
    ratio = np.array([row["roughness_ratio"] for row in rows], dtype=float)
    below = scale < SATURATION_SCALE * np.nanmax(scale)
    saturation = len(rows)
    while saturation > 0 and below[saturation - 1]:
        saturation -= 1
    clustered = np.flatnonzero(ratio[:saturation] < CLUSTER_RATIO)
    clustering = int(clustered[0]) if clustered.size else saturation

    def span(first: int, stop: int) -> list[int] | None:
        return [rounds[first], rounds[stop - 1]] if stop > first else None

    return {
        "association": span(0, clustering),
        "clustering": span(clustering, saturation),
        "saturation": span(saturation, len(rows)),
    }


PHASE_COLOURS = {"association": "tab:orange", "clustering": "tab:green", "saturation": "tab:gray"}
PANELS = (
    (("action_association", "association"), "association\nSpearman(I, ±Â), (I, Â)"),
    (("roughness_u20", "roughness_u100"), "graph roughness\nu = 20, u = 100"),
    (("roughness_ratio",), "roughness / shuffled\n(u = 20)"),
    (("scale",), "scale\nmax |I|"),
    (("behaviour_probability",), "π(a*|probe)\n(mean over probes)"),
)


def _load_results(out: str, env: str) -> list[dict[str, Any]]:
    names = sorted(os.listdir(out)) if os.path.isdir(out) else []
    results = []
    for name in names:
        if name.startswith(f"{env}_seed") and name.endswith(".json"):
            with open(os.path.join(out, name)) as file:
                results.append(json.load(file))
    return results


def plot(out: str, figures: str) -> list[str]:
    """
    One figure per env from the result files in ``out``: the curves over rounds (one thin line per seed, the mean
    over seeds bold) and, in the last panel, each seed's phases by the phase rule.

    :param out: Folder of the result files.
    :param figures: Folder for ``formation_<env>.png``.
    :return: The paths written.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    written = []
    for env in BEHAVIOURS:
        results = _load_results(out, env)
        if not results:
            continue
        figure = Figure(figsize=(15, 3.0), layout="constrained")
        axes = figure.subplots(1, len(PANELS) + 1, sharex=True)
        n_rounds = min(len(result["rows"]) for result in results)
        x = np.arange(n_rounds)
        for ax, (columns, label) in zip(axes, PANELS, strict=False):
            for column, colour in zip(columns, ("tab:blue", "tab:purple"), strict=False):
                curves = np.array(
                    [[np.nan if row[column] is None else row[column] for row in r["rows"][:n_rounds]] for r in results]
                )
                for curve in curves:
                    ax.plot(x, curve, color=colour, lw=0.7, alpha=0.35)
                ax.plot(x, np.nanmean(curves, axis=0), color=colour, lw=1.8, label=column)
            if len(columns) > 1:
                ax.legend(fontsize=6)
            ax.set_xlabel("round")
            ax.set_ylabel(label, fontsize=8)
            ax.grid(alpha=0.3)
        axes[2].axhline(CLUSTER_RATIO, color="grey", lw=0.8, ls=":")
        strip = axes[-1]
        for i, result in enumerate(results):
            for phase, colour in PHASE_COLOURS.items():
                span = result["phases"][phase]
                if span is not None:
                    strip.broken_barh([(span[0] - 0.5, span[1] - span[0] + 1)], (i - 0.4, 0.8), color=colour)
        strip.set_yticks(range(len(results)), [f"seed {r['config']['seed']}" for r in results], fontsize=7)
        strip.set_xlabel("round")
        strip.set_ylabel("phases", fontsize=8)
        strip.legend(
            handles=[Patch(color=colour, label=phase) for phase, colour in PHASE_COLOURS.items()],
            fontsize=6,
            ncol=3,
            loc="upper center",
        )
        strip.set_ylim(-0.6, len(results) + 0.4)
        config = results[0]["config"]
        figure.suptitle(
            f"{env} ({config['rounds']} of the protocol's {config['protocol_rounds']} rounds): "
            f"'{config['behaviour_description']}'; {len(results)} seed(s), bold: mean",
            fontsize=9,
        )
        path = os.path.join(figures, f"formation_{env.lower()}.png")
        os.makedirs(figures, exist_ok=True)
        figure.savefig(path, dpi=100)
        written.append(path)
        print(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--env", choices=sorted(BEHAVIOURS), action="append", default=[], help="env to train (repeatable)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default: the protocol's)")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--scratch", default="/tmp/sb3_influence_formation", help="folder for the snapshots")
    parser.add_argument("--plot", action="store_true", help="draw the figures from the result files")
    parser.add_argument("--figures", default=FIGURES)
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    for env in args.env:
        for seed in args.seeds:
            run(env, seed, args.out, args.scratch, args.rounds)
    if args.plot:
        plot(args.out, os.path.normpath(args.figures))
    if not args.env and not args.plot:
        parser.error("nothing to do: give --env and/or --plot")


if __name__ == "__main__":
    main(sys.argv[1:])
