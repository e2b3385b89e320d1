"""
``sb3-influence bench docs``: regenerate ``docs/benchmarks.md`` from the result files.

The prose is hand-written in a Markdown template (``benchmarks/benchmarks.md.in``); every ``{{name}}`` in it is
replaced by a generated block (tables, figure links) listed in :data:`BLOCKS`. A cell whose runs are not all
finished is shown as incomplete, never as a result.
"""

from types import MappingProxyType
import itertools
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from sb3_influence.bench.grid import Job, cpu_hours, grid, missing
from sb3_influence.bench.harness import checkpoint_path, resume_round, run_config
from sb3_influence.bench.protocol import (
    ARMS,
    ENVS,
    EXTRA_ENVS,
    PAPER_ENVS,
    SETTINGS,
    arms_for,
    cell_name,
    check_seeds,
    result_path,
    reuses_unfiltered,
    run_kwargs,
)
from sb3_influence.bench.summary import load_runs, markdown_table, percent, plot, summarize
from sb3_influence.extras import import_optional

# The paper's IIF numbers (Hu et al. 2025): SE_ave, SE_peak, RT_peak as (mean, s.e.) in percent (Sec. 5 main
# results; Table 3 for Adam, which reports no RT_peak) and the 95 % CI of the final-return gain (Table 4)
PAPER: Mapping[tuple[str, str], dict[str, Any]] = MappingProxyType(
    {
        ("FrozenLake", "sgd"): {"se_ave": (34.0, 2.0), "se_peak": (19.2, 5.9), "rt_peak": (29.5, 2.9)},
        ("Acrobot", "sgd"): {"se_ave": (36.7, 6.5), "se_peak": (48.5, 0.8), "rt_peak": (55.2, 1.0)},
        ("MiniGrid", "sgd"): {"se_ave": (65.8, 3.3), "se_peak": (61.7, 4.1), "rt_peak": (69.1, 1.7), "final_ci": (0.04, 0.33)},
        ("highway", "sgd"): {"se_ave": (37.7, 6.1), "se_peak": (55.1, 2.9), "rt_peak": (59.9, 0.7)},
        ("LunarLander", "sgd"): {
            "se_ave": (26.0, 1.8),
            "se_peak": (39.7, 3.7),
            "rt_peak": (44.9, 2.5),
            "final_ci": (22.5, 130.5),
        },
        ("BipedalWalker", "adam3e-4"): {
            "se_ave": (31.0, 8.7),
            "se_peak": (26.2, 8.0),
            "rt_peak": (29.2, 0.7),
            "final_ci": (24.4, 76.0),
        },
        ("LunarLander", "adam1e-3"): {"se_ave": (46.7, None), "se_peak": (62.2, None)},
        ("MiniGrid", "adam1e-3"): {"se_ave": (24.1, None), "se_peak": (13.3, None)},
    }
)

BLOCKS = (
    "status",
    "cost",
    "results",
    "incomplete",
    "paper",
    "aggregate",
    "reading",
    "variants",
    "curves",
    "partial_minibatches",
    "one_record_collapses",
    "reproduction",
    "legacy_results",
    "legacy_paper",
    "legacy_aggregate",
    "legacy_curves",
)


class _Cell:
    """One environment × setting (× variants) folder of results, its arms (those that apply to its setting) and how
    complete it is."""

    def __init__(self, out: str, env: str, name: str, seeds: Sequence[int], legacy: bool = False):
        self.out, self.env, self.name, self.legacy = out, env, name, legacy
        self.directory = os.path.join(out, env) if legacy else os.path.join(out, env, name)
        self.runs = load_runs(self.directory)
        self.seeds = list(seeds)
        self.label = f"{env}" if legacy else f"{env} {name}"
        # The superseded protocol ran the SGD setting with these arms
        self.required = ("ppo", "iif", "random") if legacy else arms_for(name, env=env)
        # The optimizer setting and the variants of the cell's folder name ("sgd+drop-partial")
        self.setting, *self.variants = name.split("+")
        # Arms the cell does not need (opt-in arms, Arm.opt_in; in a variant cell, all but VARIANT_ARMS) join it
        # once a run of theirs started in it
        joined = set()
        for arm in [] if legacy else arms_for(name, list(ARMS), env):
            paths = (result_path(out, env, self.setting, arm, seed, self.variants) for seed in self.seeds)
            if arm not in self.required and (arm in self.runs or any(os.path.exists(path) for path in paths)):
                joined.add(arm)
        self.arms = tuple(arm for arm in ARMS if arm in self.required or arm in joined) if not legacy else self.required

    def complete_seeds(self, arm: str) -> list[int]:
        return sorted(set(self.runs.get(arm, {})) & set(self.seeds))

    def complete_for(self, arms: Sequence[str]) -> bool:
        """Whether every one of ``arms`` has all the seeds (an arm that does not apply here never does)."""
        return all(arm in self.arms and len(self.complete_seeds(arm)) == len(self.seeds) for arm in arms)

    @property
    def complete(self) -> bool:
        """Every arm the cell needs has all the seeds (opt-in arms are not needed)."""
        return self.complete_for(self.required)

    @property
    def paired(self) -> bool:
        others = (self.complete_seeds(a) for a in self.arms if a != "ppo")
        return bool(set(self.complete_seeds("ppo")) & set().union(*others))

    def row(self) -> tuple[str, str, str]:
        return (self.label, self.directory, self.env)


def _cells(out: str, seeds: Sequence[int]) -> list[_Cell]:
    """The protocol's cells (:data:`PAPER_ENVS` and :data:`EXTRA_ENVS` × their settings) and every variant cell found
    on disk."""
    cells = []
    for env in PAPER_ENVS + EXTRA_ENVS:
        names = list(ENVS[env].settings)
        folder = os.path.join(out, env)
        if os.path.isdir(folder):
            names += sorted(n for n in os.listdir(folder) if n not in names and n.split("+")[0] in SETTINGS)
        cells += [_Cell(out, env, name, seeds) for name in names]
    return cells


def _jobs(cell: _Cell) -> list[Job]:
    return grid([cell.env], list(cell.arms), cell.seeds, [cell.setting], cell.variants)


def _partial(cell: _Cell, arm: str) -> str:
    """``"k/n"`` finished seeds, plus the unfinished runs' progress."""
    text = f"{len(cell.complete_seeds(arm))}/{len(cell.seeds)}"
    progress = []
    for job in _jobs(cell):
        path = job.path(cell.out)
        if job.arm == arm and os.path.exists(path) and job.seed not in cell.runs.get(arm, {}):
            with open(path) as file:
                result = json.load(file)
            progress.append(f"seed {job.seed} at round {result['rows'][-1]['round']}/{result['config']['rounds']}")
    return text + (f" ({'; '.join(progress)})" if progress else "")


def _status(cells: list[_Cell], out: str) -> str:
    # Opt-in arms get a column once they ran somewhere
    shown = [arm for arm in ARMS if not ARMS[arm].opt_in or any(arm in cell.arms for cell in cells)]
    lines = [
        "| env | setting | rounds | " + " | ".join(f"{arm} seeds done" for arm in shown) + " | CPU h spent | status |",
        "|---|---|---|" + "---|" * len(shown) + "---|---|",
    ]
    for cell in cells:
        rounds = run_kwargs(ENVS[cell.env], cell.setting, cell.variants)["rounds"]
        state = "complete" if cell.complete else ("not started" if not cell.runs and not _any_file(cell) else "incomplete")
        hours = cpu_hours(_jobs(cell), out)
        lines.append(
            f"| {cell.env} | {cell.name} | {rounds} | "
            + " | ".join(_partial(cell, arm) if arm in cell.arms else "—" for arm in shown)
            + f" | {hours:.2f} | {state} |"
        )
    return "\n".join(lines)


def _any_file(cell: _Cell) -> bool:
    return os.path.isdir(cell.directory) and any(name.endswith(".json") for name in os.listdir(cell.directory))


def _arm_cost(arm: str) -> float:
    """An arm's :attr:`~sb3_influence.bench.protocol.Arm.cost` (1 for a name no longer in :data:`ARMS`)."""
    return ARMS[arm].cost if arm in ARMS else 1.0


def _run_cost(cell: _Cell, probes: dict[str, Any]) -> tuple[float, str]:
    """CPU hours of one run of a cell by an arm of cost 1 (runs of costlier arms are divided by their cost) and
    where the number comes from."""
    finished = [
        r["total_cpu_time"] / _arm_cost(arm)
        for arm, runs in cell.runs.items()
        for r in runs.values()
        if "total_cpu_time" in r and "reused_from" not in r
    ]
    if finished:
        return float(np.mean(finished)) / 3600, f"measured, mean of {len(finished)} finished runs"
    partial = []
    if _any_file(cell):
        for name in os.listdir(cell.directory):
            with open(os.path.join(cell.directory, name)) as file:
                result = json.load(file)
            done = result["rows"][-1]["round"]
            if done and "total_cpu_time" in result:
                cost = _arm_cost(result["config"]["arm"])
                partial.append(result["total_cpu_time"] / done * result["config"]["rounds"] / cost)
    if partial:
        return float(np.mean(partial)) / 3600, f"extrapolated from {len(partial)} unfinished runs"
    probe = probes.get(f"{cell.env} {cell.name}")
    if probe is not None:
        rounds = run_kwargs(ENVS[cell.env], cell.setting, cell.variants)["rounds"]
        evals = len(ENVS[cell.env].eval_rounds(rounds))
        return (probe["round_cpu_s"] * rounds + probe["eval_cpu_s"] * evals) / 3600, "probe: 1 IIF round + 1 evaluation"
    return float("nan"), "not measured"


def _cell_cost(cell: _Cell, arm: str) -> float:
    """How many runs of cost 1 an arm's run in the cell is: 0 where it is reused from the cell without variants
    (each of its finished runs was; a run that started elsewhere is trained in the variant's cell)."""
    reused = arm in ARMS and reuses_unfiltered(arm, cell.variants)
    return 0.0 if reused and all("reused_from" in r for r in cell.runs.get(arm, {}).values()) else _arm_cost(arm)


def _arms_cell(cell: _Cell) -> str:
    """The number of arms of a cell, and the arms that count as more or less than one run."""
    costly = [
        f"{arm} reused" if _cell_cost(cell, arm) == 0 else f"{arm} ×{ARMS[arm].cost:g}"
        for arm in cell.arms
        if _cell_cost(cell, arm) != 1
    ]
    return f"{len(cell.arms)}" + (f" ({', '.join(costly)})" if costly else "")


def _share_left(job: Job, out: str) -> float:
    """
    The share of a run of the protocol's length that an unfinished job still needs: its rounds after the
    checkpoint it would resume from (all of them where there is none, or where its file is of another config), over
    the protocol's rounds for its cell (a job with ``--rounds`` of its own is a longer or shorter run).
    """
    path = job.path(out)
    previous = None
    if os.path.exists(path):
        with open(path) as file:
            previous = json.load(file)
    config = run_config(job.env, job.setting, job.arm, job.seed, job.variants, job.rounds, job.eval_episodes)
    done = resume_round(previous, config, checkpoint_path(out, job.env, job.setting, job.arm, job.seed, job.variants))
    return (config["rounds"] - done) / run_kwargs(ENVS[job.env], job.setting, job.variants)["rounds"]


def _left(cell: _Cell, per_run: float) -> float:
    """
    CPU hours the cell still needs to be complete: for each run of an arm it needs (opt-in arms that joined it are
    not needed) that has not finished, ``per_run`` × the arm's cost × :func:`_share_left`.
    """
    return sum(
        per_run * _cell_cost(cell, job.arm) * _share_left(job, cell.out)
        for job in _jobs(cell)
        if job.arm in cell.required and job.seed not in cell.runs.get(job.arm, {})
    )


def _probes(out: str) -> dict[str, Any]:
    """The cost probe's cells (``cost_probe.json`` beside the results directory), empty where it has not run."""
    path = os.path.join(os.path.dirname(out.rstrip("/")), "cost_probe.json")
    if not os.path.exists(path):
        return {}
    with open(path) as file:
        return json.load(file)["cells"]


def hours_left(jobs: Sequence[Job], out: str) -> float:
    """
    CPU hours the unfinished ``jobs`` still need, estimated as the cost table of ``docs/benchmarks.md`` does: the
    cost of a run in the job's cell (measured from its finished runs, else extrapolated from its unfinished ones,
    else the cost probe's) × the arm's cost × :func:`_share_left`.

    :param jobs: From :func:`~sb3_influence.bench.grid.grid`.
    :param out: Results directory.
    :return: The hours; ``nan`` where a cell of an unfinished job has no cost measured yet.
    """
    probes = _probes(out)
    cells: dict[tuple[str, str, tuple[str, ...]], list[Job]] = {}
    for job in missing(jobs, out):
        cells.setdefault((job.env, job.setting, job.variants), []).append(job)
    left = 0.0
    for (env, setting, variants), todo in cells.items():
        cell = _Cell(out, env, cell_name(setting, variants), sorted({job.seed for job in todo}))
        per_run = _run_cost(cell, probes)[0]
        left += sum(per_run * _cell_cost(cell, job.arm) * _share_left(job, out) for job in todo)
    return left


def _cost(cells: list[_Cell], out: str) -> str:
    probes = _probes(out)
    lines = [
        f"| env | setting | CPU h per run | arms | CPU h per cell (arms × {len(cells[0].seeds)} seeds) | CPU h left "
        "| source |",
        "|---|---|---|---|---|---|---|",
    ]
    total = total_left = 0.0
    for cell in cells:
        per_run, source = _run_cost(cell, probes)
        per_cell = per_run * sum(_cell_cost(cell, arm) for arm in cell.arms) * len(cell.seeds)
        left = _left(cell, per_run)
        total += per_cell if np.isfinite(per_cell) else 0.0
        total_left += left if np.isfinite(left) else 0.0
        arms = _arms_cell(cell)
        shown = f"{per_run:.2f} | {arms} | {per_cell:.1f} | {left:.1f}" if np.isfinite(per_run) else f"— | {arms} | — | —"
        lines.append(f"| {cell.env} | {cell.name} | {shown} | {source} |")
    unmeasured = sum(not np.isfinite(_run_cost(cell, probes)[0]) for cell in cells)
    bound, note = ("≥ ", f" ({unmeasured} cells not measured)") if unmeasured else ("", "")
    lines.append(f"| **all** | | | | **{bound}{total:.0f}{note}** | **{bound}{total_left:.0f}** | |")
    return "\n".join(lines)


def _paper(cells: list[_Cell]) -> str:
    def paper(value: tuple[float, float | None] | None) -> str:
        if value is None:
            return "—"
        return f"{value[0]:.1f}" + (f" ± {value[1]:.1f}" if value[1] is not None else "") + " %"

    lines = [
        "| cell | seeds | SE_ave here | SE_ave paper | SE_peak here | SE_peak paper | RT_peak here | RT_peak paper | "
        "final gain CI here | final gain CI paper |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        numbers = PAPER.get((cell.env, "sgd" if cell.legacy else cell.name))
        if numbers is None:
            continue
        entry = summarize(cell.directory, cell.env).get("iif") if cell.complete_for(("ppo", "iif")) else None
        if entry is None:
            here = [f"incomplete ({len(cell.complete_seeds('iif'))}/{len(cell.seeds)} seeds)"] + ["—"] * 3
            seeds = "—"
        else:
            ci = entry["final_gain"]["ci"]
            here = [
                percent(entry["se_ave"]),
                percent(entry["se_peak"]),
                percent(entry["rt_peak"]),
                f"[{ci[0]:+.3g}, {ci[1]:+.3g}]",
            ]
            seeds = str(len(entry["per_seed"]))
        final = numbers.get("final_ci")
        lines.append(
            f"| {cell.label} | {seeds} | {here[0]} | {paper(numbers.get('se_ave'))} | {here[1]} | "
            f"{paper(numbers.get('se_peak'))} | {here[2]} | {paper(numbers.get('rt_peak'))} | {here[3]} | "
            f"{'—' if final is None else f'[{final[0]}, {final[1]}]'} |"
        )
    return "\n".join(lines)


def _scores(cells: list[_Cell], kind: str, arms: Sequence[str]) -> dict[str, np.ndarray]:
    from sb3_influence.bench.stats import normalized_score

    seeds = cells[0].seeds
    return {
        arm: np.array([[normalized_score(c.runs[arm][seed], c.env, kind) for c in cells] for seed in seeds]) for arm in arms
    }


def _aggregate_groups(cells: list[_Cell]) -> list[tuple[list[_Cell], tuple[str, ...], tuple[str, ...]]]:
    """
    The task sets of the aggregate statistics: the cells where the arms that apply everywhere (``Arm.settings`` and
    ``Arm.envs`` ``None``) are complete, with those arms; then, for the arms that apply to only some cells, the cells where
    every arm that applies is complete (arms with the same cells together). A restricted arm still running does
    not hold back the other arms' statistics. Cells with variants are left out.

    :return: ``(cells, arms, new)`` per task set: its cells, the arms that apply to all of them, and the arms whose
        comparisons (``Arm.versus``) it reports (all of them in the first set, the restricted ones after).
    """
    # One task per environment × setting: a cell with variants would count its environment twice (and reuses the
    # runs of the cell without them); the variants table compares those cells
    cells = [cell for cell in cells if not cell.variants]
    common = tuple(arm for arm, spec in ARMS.items() if spec.settings is None and spec.envs is None and not spec.opt_in)
    base = [cell for cell in cells if cell.complete_for(common)]
    groups = [(base, common, common)] if base else []
    complete = [cell for cell in cells if cell.complete]
    by_cells: dict[tuple[str, ...], list[str]] = {}
    for arm in ARMS:
        if arm not in common:
            where = tuple(cell.label for cell in complete if arm in cell.arms and cell.complete_for((arm,)))
            if where:
                by_cells.setdefault(where, []).append(arm)
    for labels, new in by_cells.items():
        subset = [cell for cell in complete if cell.label in labels]
        arms = tuple(arm for arm in ARMS if all(arm in cell.arms and cell.complete_for((arm,)) for cell in subset))
        groups.append((subset, arms, tuple(new)))
    return groups


def _aggregate(cells: list[_Cell], figures: str, relative: str, name: str, title: str) -> str:
    """rliable's IQM, optimality gap, probability of improvement and profiles over the complete cells; an arm that
    applies to only some of them (``Arm.settings``) gets its own task set, the cells where it applies."""
    from sb3_influence.bench.stats import aggregate_metrics, plot_aggregates, probability_of_improvement

    task_poi = import_optional("rliable.metrics", "bench", "the aggregate statistics").probability_of_improvement

    groups = _aggregate_groups(cells)
    if not groups:
        return "*No cell is complete yet: no aggregate statistics.*"
    labels = {arm: spec.label for arm, spec in ARMS.items()}
    colors = {arm: spec.color for arm, spec in ARMS.items()}
    blocks = []
    for number, (tasks, arms, new) in enumerate(groups):
        table = ["| score | arm | IQM [95 % CI] | optimality gap [95 % CI] |", "|---|---|---|---|"]
        poi = ["| score | comparison | P(X > Y) over all tasks [95 % CI] | per task |", "|---|---|---|---|"]
        images = []
        stem = name if number == 0 else f"{name}_{'_'.join(new)}"
        heading = title if number == 0 else f"{title}, {', '.join(labels[arm] for arm in new)}"
        for kind in ("curve", "final"):
            scores = _scores(tasks, kind, arms)
            aggregates = aggregate_metrics(scores)
            for arm, entry in aggregates.items():
                iqm, gap = entry["iqm"], entry["optimality_gap"]
                table.append(
                    f"| {kind} | {arm} | {iqm['value']:.3f} [{iqm['ci'][0]:.3f}, {iqm['ci'][1]:.3f}] | "
                    f"{gap['value']:.3f} [{gap['ci'][0]:.3f}, {gap['ci'][1]:.3f}] |"
                )
            for better, other in [(a, other) for a in new for other in ARMS[a].versus if other in arms]:
                overall = probability_of_improvement(scores[better], scores[other])
                per_task = ", ".join(
                    f"{cell.label} {task_poi(scores[better][:, [i]], scores[other][:, [i]]):.2f}"
                    for i, cell in enumerate(tasks)
                )
                low, high = overall["ci"]
                poi.append(f"| {kind} | {better} > {other} | {overall['value']:.2f} [{low:.2f}, {high:.2f}] | {per_task} |")
            path = os.path.join(figures, f"{stem}_{kind}.png")
            plot_aggregates(aggregates, scores, labels, colors, path, f"{heading}: {kind} score")
            images.append(f"![{heading}, {kind} score]({relative}/{stem}_{kind}.png)")
        where = f"Tasks: {', '.join(cell.label for cell in tasks)} ({len(tasks[0].seeds)} seeds each)."
        if number:
            where = f"{', '.join(new)} (only where {'they apply' if len(new) > 1 else 'it applies'}). " + where
        blocks.append("\n".join([where, "", *table, "", *poi, "", "\n\n".join(images)]))
    return "\n\n".join(blocks)


def _reading(cells: list[_Cell]) -> str:
    """
    Per cell and arm compared with PPO (``"ppo"`` in its ``Arm.versus``): faster, slower or no clear difference by
    the paper's SE_ave, and, beside it, the curve score's probability of improvement with its reading (ahead or
    behind when the interval excludes 0.5): the two measure speed differently and can disagree.
    """
    from sb3_influence.bench.stats import probability_of_improvement

    lines = [
        "| cell | arm | reading (vs PPO) | SE_ave [95 % CI] | curve: P(arm > PPO) [95 % CI] | curve reading | "
        "final gain [95 % CI] |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        summary = summarize(cell.directory, cell.env)
        for arm in [arm for arm in cell.arms if "ppo" in ARMS[arm].versus]:
            entry = summary.get(arm) if cell.complete_for(("ppo", arm)) else None
            if entry is None:
                done = len(cell.complete_seeds(arm))
                lines.append(
                    f"| {cell.label} | {arm} | incomplete ({done}/{len(cell.seeds)} seeds): no reading yet | — | — | — | — |"
                )
                continue
            low, high = entry["se_ave"]["ci"]
            verdict = "faster" if low > 0 else ("slower" if high < 0 else "no clear difference")
            scores = _scores([cell], "curve", ("ppo", arm))
            poi = probability_of_improvement(scores[arm], scores["ppo"])
            p_low, p_high = poi["ci"]
            curve = "ahead" if p_low > 0.5 else ("behind" if p_high < 0.5 else "no clear difference")
            if {verdict, curve} in ({"faster", "behind"}, {"slower", "ahead"}):
                curve = f"**{curve}: disagrees with SE_ave**"
            gain = entry["final_gain"]
            lines.append(
                f"| {cell.label} | {arm} | **{verdict}** | {100 * entry['se_ave']['mean']:.1f} % [{100 * low:.1f}, "
                f"{100 * high:.1f}] | {poi['value']:.2f} [{p_low:.2f}, {p_high:.2f}] | {curve} | "
                f"{gain['mean']:+.3g} [{gain['ci'][0]:+.3g}, {gain['ci'][1]:+.3g}] |"
            )
    return "\n".join(lines)


def _variants(cells: list[_Cell]) -> str:
    """
    Per variant cell and arm that the variant can change (every filtering arm; PPO too where the variant is not
    about filtering only): the arm with the variant against the same arm in the cell without it (same seeds), by the
    probability of improvement of the curve score and of the final score, each with its reading (ahead or behind
    when the interval excludes 0.5).
    """
    from sb3_influence.bench.stats import probability_of_improvement

    lines = [
        "| cell | arm | curve: P(variant > without) [95 % CI] | reading | final: P(variant > without) [95 % CI] | reading |",
        "|---|---|---|---|---|---|",
    ]
    base = {(c.env, c.name): c for c in cells}
    for cell in cells:
        if not cell.variants or (cell.env, cell.setting) not in base:
            continue
        without = base[(cell.env, cell.setting)]
        for arm in [a for a in cell.arms if ARMS[a].rule is not None or not reuses_unfiltered(a, cell.variants)]:
            if not (cell.complete_for((arm,)) and without.complete_for((arm,))):
                n = len(cell.seeds)
                done = f"with it {len(cell.complete_seeds(arm))}/{n}, without {len(without.complete_seeds(arm))}/{n}"
                lines.append(f"| {cell.label} | {arm} | incomplete ({done} seeds): no reading yet | — | — | — |")
                continue
            row = f"| {cell.label} | {arm} |"
            for kind in ("curve", "final"):
                poi = probability_of_improvement(_scores([cell], kind, (arm,))[arm], _scores([without], kind, (arm,))[arm])
                low, high = poi["ci"]
                reading = "ahead" if low > 0.5 else ("behind" if high < 0.5 else "no clear difference")
                row += f" {poi['value']:.2f} [{low:.2f}, {high:.2f}] | {reading} |"
            lines.append(row)
    return "\n".join(lines) if len(lines) > 2 else "*No variant cell has results yet.*"


def _partial_minibatches(cells: list[_Cell]) -> str:
    """How often a filtering arm's update ends with a partial minibatch, and how small it is (from kept fractions)."""
    lines = [
        "| cell | arm | rounds | with a partial minibatch | median size | ≤ 8 records | ≤ 2 records |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        for arm in [name for name in ARMS if name != "ppo" and name in cell.runs]:
            sizes = []
            for result in cell.runs[arm].values():
                config = result["config"]
                n = config.get("n_steps", 2048) * config.get("n_envs", 1)
                sizes += [round(row["kept_fraction"] * n) % config.get("batch_size", 64) for row in result["rows"][1:]]
            array = np.array(sizes)
            partial = array[array > 0]
            median = f"{np.median(partial):.0f}" if len(partial) else "—"
            lines.append(
                f"| {cell.label} | {arm} | {len(array)} | {np.mean(array > 0):.0%} | {median} | "
                f"{np.mean((array > 0) & (array <= 8)):.0%} | {np.mean((array > 0) & (array <= 2)):.0%} |"
            )
    return "\n".join(lines)


def _one_record_collapses(cells: list[_Cell]) -> str:
    """
    Between consecutive evaluations: did a round end with a one-record minibatch (SB3 normalises the advantages
    only of minibatches of 2 or more, so that step uses the record's raw advantage), and did the test return
    collapse (fall by more than a quarter of the environment's score range)? Counts and Fisher's exact test.
    """
    from scipy.stats import fisher_exact

    lines = [
        "| cell | arm | intervals with a one-record minibatch: collapses | other intervals: collapses | Fisher p |",
        "|---|---|---|---|---|",
    ]
    for cell in cells:
        low, high = ENVS[cell.env].score_range
        for arm in [name for name in ARMS if name in cell.runs]:
            table = np.zeros((2, 2), dtype=int)
            for result in cell.runs[arm].values():
                config = result["config"]
                n, batch = config.get("n_steps", 2048) * config.get("n_envs", 1), config.get("batch_size", 64)
                one = {row["round"] for row in result["rows"][1:] if round(row["kept_fraction"] * n) % batch == 1}
                evals = [(row["round"], row["eval_return"]) for row in result["rows"] if row["eval_return"] is not None]
                for (r0, v0), (r1, v1) in itertools.pairwise(evals):
                    table[int(bool(one & set(range(r0 + 1, r1 + 1)))), int(v0 - v1 > (high - low) / 4)] += 1
            p = fisher_exact(table)[1] if table[1].sum() else float("nan")
            lines.append(
                f"| {cell.label} | {arm} | {table[1, 1]} of {table[1].sum()} | {table[0, 1]} of {table[0].sum()} | "
                f"{'—' if np.isnan(p) else f'{p:.3f}'} |"
            )
    return "\n".join(lines)


def _reproduction(cells: list[_Cell], old: list[_Cell]) -> str:
    """Grid runs against the superseded runs of the same env, arm and seed where the evaluation is the same (exact):
    identical returns, and the ratio of their training CPU times (the load of the machine, since the work is equal)."""
    lines = ["| env | arm | seed | identical test returns | training CPU time, grid / superseded |", "|---|---|---|---|---|"]
    legacy = {cell.env: cell for cell in old}
    for cell in cells:
        if cell.name != "sgd" or cell.env not in legacy or not ENVS[cell.env].exact_eval:
            continue
        for arm, runs in cell.runs.items():
            for seed, result in sorted(runs.items()):
                before = legacy[cell.env].runs.get(arm, {}).get(seed)
                if before is None:
                    continue
                same = [r["eval_return"] for r in result["rows"]] == [r["eval_return"] for r in before["rows"]]
                ratio = result["rows"][-1]["cpu_time"] / before["rows"][-1]["cpu_time"]
                lines.append(f"| {cell.env} | {arm} | {seed} | {'yes' if same else '**no**'} | {ratio:.2f} |")
    return "\n".join(lines) if len(lines) > 2 else "*No grid run has a superseded counterpart with the same evaluation yet.*"


def _curves(cells: list[_Cell], figures: str, relative: str, prefix: str) -> str:
    links = []
    for cell in cells:
        name = f"{prefix}{cell.label.replace(' ', '_')}.png"
        title = f"{cell.label} ({ENVS[cell.env].env_id})" + ("" if cell.complete else " — INCOMPLETE")
        if plot(cell.directory, cell.env, os.path.join(figures, name), title=title):
            links.append(f"![{cell.label} learning curves]({relative}/{name})")
    return "\n\n".join(links) if links else "*No finished run yet: no learning curves.*"


def generate_page(
    template: str, output: str, figures: str, out: str, legacy: str, seeds: Sequence[int] = (0, 1, 2, 3, 4)
) -> dict[str, Any]:
    """
    Fill ``template`` with the generated blocks and write ``output`` (and the figures under ``figures``).

    :param template: Markdown template; ``{{name}}`` for each name of :data:`BLOCKS` it uses.
    :param output: The generated page.
    :param figures: Directory of the figures.
    :param out: Results directory of the grid.
    :param legacy: Results directory of the superseded protocol (``<legacy>/<env>/<arm>_seed<seed>.json``).
    :param seeds: The seeds a complete cell has.
    :return: What was generated: complete and incomplete cells, CPU hours.
    :raises ValueError: For a template block not in :data:`BLOCKS`, or seeds that are empty, below 0 or repeated.
    """
    check_seeds(seeds)
    with open(template) as file:
        text = file.read()
    unknown = sorted(set(re.findall(r"\{\{(\w+)\}\}", text)) - set(BLOCKS))
    if unknown:
        raise ValueError(f"template {template} has unknown blocks {unknown}: use {list(BLOCKS)}")
    relative = os.path.relpath(figures, os.path.dirname(os.path.abspath(output)) or ".").replace(os.sep, "/")
    cells = _cells(out, seeds)
    old = [_Cell(legacy, env, "sgd", (0, 1, 2), legacy=True) for env in PAPER_ENVS if os.path.isdir(os.path.join(legacy, env))]
    makers: dict[str, Callable[[], str]] = {
        "status": lambda: _status(cells, out),
        "cost": lambda: _cost(cells, out),
        "results": lambda: (
            markdown_table([c.row() for c in cells if c.complete])
            if any(c.complete for c in cells)
            else "*No cell is complete yet.*"
        ),
        "incomplete": lambda: (
            markdown_table([c.row() for c in cells if not c.complete and c.paired])
            if any(not c.complete and c.paired for c in cells)
            else "*None.*"
        ),
        "paper": lambda: _paper(cells),
        "aggregate": lambda: _aggregate(cells, figures, relative, "aggregate", "grid"),
        "reading": lambda: _reading(cells),
        "variants": lambda: _variants(cells),
        "curves": lambda: _curves(cells, figures, relative, "grid_"),
        "partial_minibatches": lambda: _partial_minibatches(old + [c for c in cells if c.runs]),
        "one_record_collapses": lambda: _one_record_collapses(old + [c for c in cells if c.runs]),
        "reproduction": lambda: _reproduction(cells, old),
        "legacy_results": lambda: markdown_table([c.row() for c in old]),
        "legacy_paper": lambda: _paper(old),
        "legacy_aggregate": lambda: _aggregate(old, figures, relative, "legacy_aggregate", "legacy protocol"),
        "legacy_curves": lambda: _curves(old, figures, relative, "legacy_"),
    }
    for name in BLOCKS:
        if "{{" + name + "}}" in text:
            text = text.replace("{{" + name + "}}", makers[name]())
    header = (
        f"<!-- Generated by `sb3-influence bench docs` from {template} and the result files: edit the template, "
        "not this page. -->\n\n"
    )
    with open(output, "w") as file:
        file.write(header + text)
    return {
        "complete": [c.label for c in cells if c.complete],
        "incomplete": [c.label for c in cells if not c.complete],
        "cpu_hours": sum(cpu_hours(_jobs(c), out) for c in cells),
    }
