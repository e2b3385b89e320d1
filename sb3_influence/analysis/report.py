"""
``sb3-influence report RUN_DIR``: a self-contained HTML page (and its PNGs) from a run's attribution snapshots.

The page shows, over rounds: the distribution of influence scores, the fraction of records kept by filtering,
the Spearman correlation of influence with the advantage estimates and the learning curve; and, for the last
round, the most helpful and most harmful records. Figures are embedded as base64 PNGs, so the HTML file can be
mailed or archived alone; the same PNGs are also written next to it.

The learning curve comes from SB3 ``Monitor`` files (``*monitor.csv``) under ``RUN_DIR`` when present, else from an
``EvalCallback``'s ``evaluations.npz``, else from the episodes completed inside the snapshots' rollouts.
"""

import argparse
import base64
import html
import io
import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sb3_influence.common.stats import spearman
from sb3_influence.common.command_line import ArgumentParser, one_line
from sb3_influence.common.progress import Progress
from sb3_influence.common.snapshots import Snapshot, as_snapshot, load_all
from sb3_influence.extras import import_optional

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

_MAX_BOXES = 30

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
img { max-width: 100%; border: 1px solid #eee; }
table { border-collapse: collapse; font-size: 0.85em; } td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
th { background: #f3f3f3; } pre { background: #f8f8f8; padding: 0.8em; overflow-x: auto; font-size: 0.8em; }
.note { color: #666; font-size: 0.9em; } .wide { overflow-x: auto; max-width: 100%; } td { white-space: nowrap; }
"""


def _figure() -> "Figure":
    figure = import_optional("matplotlib.figure", "analysis", "build_report()")
    return figure.Figure(figsize=(8, 3.2), layout="constrained")


def _png(figure: "Figure") -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def rollout_episode_returns(snapshot: Snapshot | dict[str, np.ndarray]) -> np.ndarray:
    """
    Returns of the episodes that start and end inside one snapshot's rollout.

    :param snapshot: The snapshot (needs ``reward`` and ``episode_start``).
    :return: One return per complete episode (possibly empty).
    """
    arrays = as_snapshot(snapshot).arrays
    rewards = np.asarray(arrays["reward"], dtype=np.float64)
    starts = np.asarray(arrays["episode_start"], dtype=bool)
    returns = []
    for env in range(rewards.shape[1]):
        boundaries = np.flatnonzero(starts[:, env])
        for begin, end in itertools.pairwise(boundaries):
            returns.append(rewards[begin:end, env].sum())
    return np.asarray(returns)


def round_summary(snapshots: list[Snapshot], target: str | None = None) -> "pd.DataFrame":
    """
    One row per snapshot: round, timesteps, records, kept fraction, influence statistics and correlations.

    :param snapshots: Snapshots in round order.
    :param target: Target name (default ``"return"``, else the only one).
    :return: DataFrame with ``round``, ``num_timesteps``, ``n_records``, ``kept_fraction``, ``negative_fraction``,
        ``influence_mean``, ``influence_std``, ``spearman_advantage``, ``spearman_training_advantage``,
        ``rollout_return``.
    """
    import pandas as pd

    rows = []
    for snapshot in map(as_snapshot, snapshots):
        arrays = snapshot.arrays
        scores = snapshot.scores(target)
        episode_returns = rollout_episode_returns(snapshot) if {"reward", "episode_start"} <= set(arrays) else np.array([])
        row = {
            "round": snapshot.round,
            "num_timesteps": snapshot.num_timesteps,
            "n_records": scores.size,
            "kept_fraction": float(np.mean(arrays["keep"])) if "keep" in arrays else float("nan"),
            "negative_fraction": float((scores < 0).mean()),
            "influence_mean": float(scores.mean()),
            "influence_std": float(scores.std()),
            "rollout_return": float(episode_returns.mean()) if episode_returns.size else float("nan"),
        }
        for name in ("advantage", "training_advantage"):
            values = snapshot.flat(name).astype(np.float64) if name in arrays else None
            row[f"spearman_{name}"] = spearman(scores, values) if values is not None else float("nan")
        rows.append(row)
    return pd.DataFrame(rows)


def _learning_curve(run_dir: Path, summary: "pd.DataFrame") -> tuple[np.ndarray, np.ndarray, str]:
    """(timesteps, returns, source) for the learning curve."""
    import pandas as pd

    monitors = sorted(run_dir.rglob("*monitor.csv"))
    if monitors:
        frames = []
        for path in monitors:
            frame = pd.read_csv(path, skiprows=1)
            if {"r", "l", "t"} <= set(frame.columns) and len(frame):
                frames.append(frame)
        if frames:
            episodes = pd.concat(frames).sort_values("t")
            timesteps = episodes["l"].cumsum().to_numpy()
            returns = episodes["r"].rolling(max(1, len(episodes) // 50), min_periods=1).mean().to_numpy()
            return timesteps, returns, f"Monitor files ({len(monitors)}), rolling mean of episode returns"
    evaluations = sorted(run_dir.rglob("evaluations.npz"))
    if evaluations:
        with np.load(evaluations[0]) as data:
            if "timesteps" in data and "results" in data:
                return data["timesteps"], data["results"].mean(axis=1), "EvalCallback evaluations.npz, mean return"
    return (
        summary["num_timesteps"].to_numpy(),
        summary["rollout_return"].to_numpy(),
        "episodes completed inside each snapshot's rollout, mean return",
    )


def _figures(
    snapshots: list[Snapshot], summary: "pd.DataFrame", target: str | None, run_dir: Path
) -> dict[str, tuple[str, bytes, str]]:
    figures: dict[str, tuple[str, bytes, str]] = {}
    rounds = summary["round"].to_numpy()

    # Influence distribution over rounds (at most _MAX_BOXES evenly spaced rounds)
    chosen = np.unique(np.linspace(0, len(snapshots) - 1, min(len(snapshots), _MAX_BOXES)).round().astype(int))
    figure = _figure()
    ax = figure.subplots()
    data = [snapshots[i].scores(target) for i in chosen]
    ax.boxplot(data, positions=np.arange(len(chosen)), showfliers=False)
    ax.set_xticks(np.arange(len(chosen)), [f"{rounds[i]:g}" for i in chosen], rotation=90 if len(chosen) > 12 else 0)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xlabel("round")
    ax.set_ylabel("influence")
    ax.set_title("Influence of the records, per round (whiskers 1.5 IQR, no outliers)")
    note = f"{len(chosen)} of {len(snapshots)} rounds shown."
    figures["influence_distribution"] = ("Influence distribution over rounds", _png(figure), note)

    figure = _figure()
    ax = figure.subplots()
    ax.plot(rounds, summary["kept_fraction"], marker=".", label="kept")
    ax.plot(rounds, summary["negative_fraction"], marker=".", label="negative influence")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("round")
    ax.set_ylabel("fraction of records")
    ax.legend()
    note = "Kept: the keep mask after filtering (1 without IIF)."
    figures["kept_fraction"] = ("Kept fraction and negative fraction", _png(figure), note)

    figure = _figure()
    ax = figure.subplots()
    ax.plot(rounds, summary["spearman_advantage"], marker=".", label="Spearman(I, Â raw)")
    ax.plot(rounds, summary["spearman_training_advantage"], marker=".", label="Spearman(I, Â as trained)")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_ylim(-1.05, 1.05)
    ax.set_xlabel("round")
    ax.set_ylabel("rank correlation")
    ax.legend()
    figures["advantage_correlation"] = (
        "Correlation of influence with advantage estimates",
        _png(figure),
        "Spearman rank correlation per round, with the raw GAE advantage and with the advantage as normalised for the update.",
    )

    timesteps, returns, source = _learning_curve(run_dir, summary)
    figure = _figure()
    ax = figure.subplots()
    ax.plot(timesteps, returns, marker="." if len(timesteps) < 60 else None)
    ax.set_xlabel("timesteps")
    ax.set_ylabel("return")
    figures["learning_curve"] = ("Learning curve", _png(figure), f"Source: {source}.")
    return figures


_MIN_REVISITED = 0.3  # below this share of revisited records the in-buffer Monte-Carlo advantage says little


def _diagnosis_section(snapshots: list[Snapshot], target: str | None) -> str:
    """The Sec. 4.1 table (influence vs Ā·Â with the in-buffer Monte-Carlo Ā) when the rounds' states repeat."""
    from sb3_influence.analysis.diagnosis import snapshot_diagnosis

    try:
        rows = [snapshot_diagnosis(snapshot, target) for snapshot in snapshots]
    except ValueError as error:
        return f'<p class="note">Not shown: {html.escape(one_line(error))}</p>'
    revisited = float(np.median([row["revisited"] for row in rows]))
    if revisited < _MIN_REVISITED:
        return (
            f'<p class="note">Not shown: only {100 * revisited:.0f} % of the records (median over rounds) are in a state '
            "that the round also visits with another action, so the in-buffer Monte-Carlo advantage Ā is "
            "uninformative (it needs repeated states, as in tabular or grid worlds).</p>"
        )
    import pandas as pd

    table = pd.DataFrame(rows).rename(
        columns={
            "spearman": "Spearman(I, Ā·Â)",
            "revisited": "revisited share",
            "sign_flips": "Ā·Â < 0 (all)",
            "sign_flips_bottom": "Ā·Â < 0 (bottom 5 %)",
        }
    )
    note = (
        '<p class="note">Ā: the in-buffer Monte-Carlo advantage (mean return-to-go of the same state and action minus '
        "that of the same state, within the round); Â: the GAE estimate the update used. A positive correlation means "
        "the records whose estimate has the wrong sign are the harmful ones (the paper's Sec. 4.1, where -0.67 is "
        "the same finding with ranks counted from the most helpful record).</p>"
    )
    return '<div class="wide">' + table.to_html(index=False, float_format=lambda x: f"{x:.3g}", border=0) + "</div>" + note


def _intervention_figure(run_dir: Path, run_id: str | None, on_error: str) -> tuple[str, bytes, str] | None:
    """Δ target and Δ test return of each arm per round, from ``InterventionCallback(save_dir=...)`` files."""
    from sb3_influence.analysis.intervention import read_interventions

    table, others = read_interventions(str(run_dir), run_id, on_error)
    if table.empty:
        return None
    arms = [arm for arm in dict.fromkeys(table["arm"]) if arm != "none"]
    has_return = bool(np.isfinite(table["test_return"].to_numpy(dtype=float)).any())
    figure = _figure()
    axes = figure.subplots(1, 2 if has_return else 1, squeeze=False)[0]
    for axis, column, label in zip(axes, ("delta_target", "delta_return"), ("Δ target", "Δ test return"), strict=False):
        for arm in arms:
            rows = table[table["arm"] == arm]
            axis.plot(rows["round"], rows[column], marker="o", ms=3, label=arm)
        axis.axhline(0.0, color="grey", lw=0.8)
        axis.set_xlabel("round")
        axis.set_ylabel(f"{label} vs retraining on every record")
        axis.legend(fontsize=7)
    note = "Each round retrained from θ(k) once per arm (intervene); 0 = the unfiltered retrain, i.e. PPO's own update."
    if others:
        note += f" {others} intervention file(s) of other runs under the folder were left out."
    return "Targeted intervention per round", _png(figure), note


def _records_table(snapshot: Snapshot, target: str | None, top_k: int) -> str:
    from sb3_influence.analysis.diagnosis import top_bottom_records

    table = top_bottom_records(snapshot, target=target, k=top_k)
    for column in ("obs", "action"):
        if column in table and table[column].dtype == object:
            table[column] = [
                np.array2string(np.asarray(v), precision=3, threshold=8, max_line_width=10**6) for v in table[column]
            ]
    return '<div class="wide">' + table.to_html(index=False, float_format=lambda x: f"{x:.4g}", border=0) + "</div>"


def _trajectories_table(snapshot: Snapshot, target: str, top_k: int) -> str:
    """The ``top_k`` most harmful and most helpful trajectories of one snapshot (summed influence)."""
    from sb3_influence.analysis.trajectories import trajectory_frame

    rows = trajectory_frame([snapshot]).sort_values(f"influence_{target}", kind="stable")
    columns = ["trajectory_id", "env", "first_step", "length", "reward", "advantage", f"influence_{target}", "kept_fraction"]
    table = _harmful_and_helpful(rows[columns], top_k)
    return '<div class="wide">' + table.to_html(index=False, float_format=lambda x: f"{x:.4g}", border=0) + "</div>"


def _harmful_and_helpful(rows: "pd.DataFrame", top_k: int) -> "pd.DataFrame":
    """The first (most harmful) and last (most helpful) ``top_k`` rows, labelled, without repeating a row."""
    import pandas as pd

    bottom = rows.head(top_k).assign(group="harmful")
    top = rows.iloc[max(len(rows) - top_k, min(top_k, len(rows))) :].iloc[::-1].assign(group="helpful")
    return pd.concat([bottom, top], ignore_index=True)


def _filtering(snapshots: list[Snapshot]) -> str:
    """One line saying which filters acted on the reported rounds, with their settings."""
    settings: list[str] = []
    for snapshot in snapshots:
        for source in snapshot.metadata.get("filters", []):
            text = ", ".join(f"{key}={value}" for key, value in source.items()) if isinstance(source, dict) else str(source)
            if text not in settings:
                settings.append(text)
    if not settings:
        return "none: no filter dropped records in these rounds (plain PPO updates)."
    return "; ".join(settings) + ". The kept fraction per round is plotted below."


def build_report(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    target: str | None = None,
    top_k: int = 10,
    title: str | None = None,
    run_id: str | None = None,
    on_error: str = "raise",
    progress: bool = False,
) -> Path:
    """
    Write ``report.html`` and its PNGs for the snapshots found under ``run_dir``.

    :param run_dir: A folder holding snapshots (searched recursively) and optionally Monitor / EvalCallback files.
    :param out_dir: Where to write (default ``<run_dir>/report``).
    :param target: Target whose influence is shown (default ``"return"``, else the only one).
    :param top_k: Records listed per group in the top/bottom table.
    :param title: Page title (default: the run folder's name).
    :param run_id: The run to report when ``run_dir`` holds several (a unique prefix is enough); a folder of
        several runs is refused without it.
    :param on_error: ``"raise"``: a damaged snapshot file raises :class:`~sb3_influence.common.snapshots.SnapshotError`;
        ``"skip"``: it is left out with a warning naming it.
    :param progress: Show the snapshot files read and an ETA (:class:`~sb3_influence.common.progress.Progress`:
        a tqdm bar on a terminal, else a plain line on stdout every 30 s); it changes nothing in the report.
    :return: Path of the HTML file.
    """
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ValueError(
            f"run_dir {str(run_dir)!r} does not exist; pass the folder AttributionCallback(save_dir=...) wrote to"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    reporter: Progress | None = None

    def on_file(done: int, total: int) -> None:
        nonlocal reporter
        if reporter is None:  # the number of files is known once the folder is listed
            reporter = Progress(total, unit="snapshot", desc="report: reading", enabled=progress)
        reporter.update(done - reporter.done)

    try:
        snapshots = load_all(run_dir, on_error=on_error, run_id=run_id, on_file=on_file)
    finally:
        if reporter is not None:
            reporter.close()
    target = snapshots[-1].influence_key(target).split("/", 1)[1]
    out = Path(out_dir) if out_dir is not None else (run_dir / "report" if run_dir.is_dir() else run_dir.parent / "report")
    out.mkdir(parents=True, exist_ok=True)

    summary = round_summary(snapshots, target)
    figures = _figures(snapshots, summary, target, run_dir if run_dir.is_dir() else run_dir.parent)
    intervention = _intervention_figure(
        run_dir if run_dir.is_dir() else run_dir.parent, snapshots[-1].metadata.get("run_id"), on_error
    )
    if intervention is not None:
        figures["intervention"] = intervention
    for name, (_, png, _) in figures.items():
        (out / f"{name}.png").write_bytes(png)

    metadata = snapshots[-1].metadata
    title = title or f"sb3_influence report: {run_dir.resolve().name}"
    files = [Path(snapshot.path) for snapshot in snapshots]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="note">{len(snapshots)} snapshot(s) from <code>{html.escape(str(run_dir))}</code>, target '
        f"<b>{html.escape(target)}</b>, targets available: {html.escape(', '.join(snapshots[-1].targets))}. "
        f"Positive influence helps the target, negative hurts it.</p>",
    ]
    parts.append(f'<p id="filtering"><b>Filtering:</b> {html.escape(_filtering(snapshots))}</p>')
    for name, (caption, png, note) in figures.items():
        encoded = base64.b64encode(png).decode("ascii")
        parts.append(f'<h2 id="{name}">{html.escape(caption)}</h2>')
        parts.append(f'<img alt="{html.escape(caption)}" src="data:image/png;base64,{encoded}">')
        parts.append(f'<p class="note">{html.escape(note)}</p>')
    last = snapshots[-1]
    parts.append(f'<h2 id="records">Top and bottom records of the last round (round {last.round})</h2>')
    parts.append(_records_table(last, target, int(top_k)))
    parts.append('<h2 id="summary">Per-round summary</h2>')
    parts.append('<div class="wide">' + summary.to_html(index=False, float_format=lambda x: f"{x:.4g}", border=0) + "</div>")
    parts.append('<h2 id="diagnosis">Diagnosis: influence against advantage errors</h2>')
    parts.append(_diagnosis_section(snapshots, target))
    if "trajectory_id" in last.arrays:
        parts.append(f'<h2 id="trajectories">Most harmful and most helpful trajectories of round {last.round}</h2>')
        parts.append(_trajectories_table(last, target, int(top_k)))
        parts.append('<p class="note">Trajectory influence is the sum of its records\' influence (Units and rules).</p>')
    parts.append('<h2 id="metadata">Run metadata (last snapshot)</h2>')
    parts.append(f"<pre>{html.escape(json.dumps(metadata, indent=2, sort_keys=True, default=str))}</pre>")
    names = ", ".join(p.name for p in files[:5]) + (" ..." if len(files) > 5 else "")
    parts.append(f'<p class="note">Snapshot files: {html.escape(names)}</p>')
    parts.append("</body></html>")
    path = out / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    """
    Entry point of ``sb3-influence report``.

    :param argv: Command-line arguments (default: ``sys.argv[2:]`` through ``sb3_influence.cli``).
    :return: Exit status.
    """
    parser = ArgumentParser(
        prog="sb3-influence report",
        description="Build a self-contained HTML report (and PNGs) from the attribution snapshots of a run.",
    )
    parser.add_argument("run_dir", help="folder with the snapshots written by AttributionCallback (searched recursively)")
    parser.add_argument("-o", "--out", default=None, help="output folder (default: RUN_DIR/report)")
    parser.add_argument("--target", default=None, help="target name to show (default: 'return', else the only one)")
    parser.add_argument("--top", type=int, default=10, help="records per group in the top/bottom table (default: 10)")
    parser.add_argument("--title", default=None, help="page title")
    parser.add_argument("--run-id", default=None, help="the run to report when RUN_DIR holds several (a unique prefix)")
    parser.add_argument(
        "--skip-damaged", action="store_true", help="leave damaged snapshot files out (with a warning) instead of stopping"
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="show the snapshot files read and an ETA: a bar on a terminal (with tqdm), else a plain line on stdout "
        "every 30 s (default: on)",
    )
    args = parser.parse_args(argv)
    try:
        path = build_report(
            args.run_dir,
            out_dir=args.out,
            target=args.target,
            top_k=args.top,
            title=args.title,
            run_id=args.run_id,
            on_error="skip" if args.skip_damaged else "raise",
            progress=args.progress,
        )
    except (ValueError, OSError) as error:
        parser.error(one_line(error))
    print(f"report written to {path}")
    return 0
