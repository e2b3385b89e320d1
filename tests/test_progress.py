import io
import json
import os
import re
import sys

import pytest

from conftest import requires
from sb3_influence import bench
from sb3_influence.bench.grid import GridProgress
from sb3_influence.bench.harness import checkpoint_path
from sb3_influence.common.progress import Progress, format_duration


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class FlushRecorder(io.StringIO):
    """A non-terminal stream that records what had been written at each flush."""

    def __init__(self):
        super().__init__()
        self.flushed = []

    def flush(self):
        super().flush()
        self.flushed.append(self.getvalue())


def test_plain_lines_are_flushed_rate_limited_and_estimate_the_eta():
    clock, stream = Clock(), FlushRecorder()
    progress = Progress(4, unit="round", desc="work", stream=stream, interval=10.0, clock=clock)
    assert progress._bar is None  # not a terminal: plain lines
    clock.now += 3.0
    progress.update(1, "run A: round 1/4")
    assert stream.getvalue() == ""  # 3 s < 10 s since the start
    clock.now += 9.0
    progress.update(1, "run A: round 2/4")
    lines = stream.getvalue().splitlines()
    # 12 s for 2 rounds: 6 s a round, 2 rounds left
    assert lines == ["work: 2/4 rounds | run A: round 2/4 | 12s elapsed, ETA 12s (6s/round)"]
    assert stream.flushed and stream.flushed[-1] == stream.getvalue()
    clock.now += 1.0
    progress.update(1, "run A: round 3/4")
    assert len(stream.getvalue().splitlines()) == 1  # rate limit: 1 s since the last line
    progress.update(0, "run A ended", force=True)  # an event worth a line, whatever the rate limit
    assert stream.getvalue().splitlines()[-1].startswith("work: 3/4 rounds | run A ended | 13s elapsed, ETA")
    clock.now += 2.0
    progress.update(1)
    progress.close()
    assert stream.getvalue().splitlines()[-1] == "work: 4/4 rounds | run A ended | 15s elapsed, all done"
    assert len(stream.flushed) == len(stream.getvalue().splitlines()) == 3


def test_short_work_stays_silent_and_disabled_prints_nothing():
    stream = FlushRecorder()
    with Progress(3, stream=stream, interval=60.0) as progress:
        progress.update(3)
    assert stream.getvalue() == ""
    silent = Progress(3, stream=stream, interval=0.0, enabled=False)
    silent.update(1, force=True)
    silent.close()
    assert stream.getvalue() == "" and silent._bar is None


def test_eta_before_the_first_unit_and_bad_arguments():
    clock = Clock()
    progress = Progress(2, unit="snapshot", stream=io.StringIO(), interval=0.0, clock=clock)
    assert progress.eta() is None and "ETA after the first snapshot" in progress.line()
    clock.now += 30.0
    progress.update(1)
    assert progress.eta() == pytest.approx(30.0)
    assert format_duration(45) == "45s" and format_duration(725) == "12m05s" and format_duration(11_220) == "3h07m"
    with pytest.raises(ValueError, match="total"):
        Progress(-1)
    with pytest.raises(ValueError, match="interval"):
        Progress(1, interval=-5)
    with pytest.raises(ValueError, match="n must be"):
        progress.update(-1)


class Terminal(io.StringIO):
    """A stream that says it is a terminal, so that ``Progress`` shows a tqdm bar on it."""

    def isatty(self):
        return True


def test_bar_on_a_terminal():
    pytest.importorskip("tqdm")
    stream = Terminal()
    progress = Progress(2, unit="round", desc="bench run", stream=stream)
    assert progress._bar is not None
    progress.update(1, "runs 0/1 done")
    progress.write("a run ended", lambda text: stream.write(f"{text}\n"))
    progress.close()
    assert "a run ended\n" in stream.getvalue()
    assert "bench run" in stream.getvalue() and "runs 0/1 done" in stream.getvalue()


def _without_times(path):
    """A result file without the measured times (which differ from run to run)."""
    with open(path) as file:
        result = json.load(file)
    result.pop("total_cpu_time")
    for row in result["rows"]:
        for key in ("wall_time", "round_time", "cpu_time", "eval_cpu_time"):
            row.pop(key, None)
    return result


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


def test_grid_in_this_process_reports_rounds_and_leaves_the_results_as_without(tmp_path, capsys):
    jobs = bench.grid(["CartPole"], ["ppo"], [0, 1], rounds=2, eval_episodes=2)
    bench.run_grid(jobs, str(tmp_path / "on"), workers=1, backend="process", progress=True, progress_interval=0.0)
    lines = capsys.readouterr().out.splitlines()
    progress = [line for line in lines if line.startswith("bench run: ")]
    # every round of both runs, in order, then each run's end
    assert any("runs 0/2 done; CartPole sgd ppo seed 0: round 1/2" in line for line in progress)
    assert any("runs 1/2 done; CartPole sgd ppo seed 1: round 2/2" in line for line in progress)
    assert re.search(r"1/4 rounds .* ETA \d+s \(\d+s/round\)", "\n".join(progress))
    assert progress[-1].startswith("bench run: 4/4 rounds | runs 2/2 done |")
    bench.run_grid(jobs, str(tmp_path / "off"), workers=1, backend="process", log=lambda line: None)
    assert capsys.readouterr().out == ""
    # Progress writes no file and changes no result
    assert _files(tmp_path / "on") == _files(tmp_path / "off")
    for job in jobs:
        assert _without_times(job.path(str(tmp_path / "on"))) == _without_times(job.path(str(tmp_path / "off")))


def test_grid_through_the_process_pool_reports_rounds_from_the_worker(tmp_path, capsys):
    out = str(tmp_path)
    jobs = bench.grid(["CartPole"], ["ppo"], [2], rounds=2, eval_episodes=2)
    # A run killed after round 1 of another configuration: not taken for this one's progress
    bench.run_one("CartPole", "ppo", 2, out, rounds=1, eval_episodes=1)
    lines = []
    bench.run_grid(jobs, out, workers=2, backend="process", log=lines.append, progress=True, progress_interval=0.0)
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("bench run: ")]
    # The round before the run's end is seen in the parent, from the result file the worker writes after each round
    mid_run = [line for line in progress if "runs 0/1 done; CartPole sgd ppo seed 2: round 1/2" in line]
    assert mid_run and mid_run[0].startswith("bench run: 1/2 rounds") and "ETA" in mid_run[0]
    assert progress[-1].startswith("bench run: 2/2 rounds | runs 1/1 done |")
    assert lines[-2].startswith("CartPole sgd ppo seed 2: ") and not bench.missing(jobs, out)
    assert _files(out) == [os.path.join("CartPole", "sgd", "ppo_seed2.json")]


def test_grid_progress_counts_a_resumed_run_from_its_checkpoint(tmp_path):
    out = str(tmp_path)
    job = bench.Job("CartPole", "sgd", "ppo", 0, rounds=30, eval_episodes=2)
    config = bench.run_config("CartPole", "sgd", "ppo", 0, (), 30, 2)
    rows = [{"round": r} for r in range(13)]
    bench.write_json(job.path(out), {"config": config, "complete": False, "checkpoint_round": 10, "rows": rows})
    # Without its checkpoint the harness starts the run again from round 1: all 30 rounds are left
    assert GridProgress([job], 3, out, stream=io.StringIO(), interval=0.0).progress.total == 30
    checkpoint = checkpoint_path(out, "CartPole", "sgd", "ppo", 0)
    os.makedirs(os.path.dirname(checkpoint))
    open(checkpoint, "wb").close()
    watcher = GridProgress([job], 3, out, stream=io.StringIO(), interval=0.0)
    # 20 rounds left (the run resumes after round 10); the file left by the killed run is not read as progress
    assert watcher.progress.total == 20 and watcher.runs_done == 2
    watcher.poll()
    assert watcher.progress.done == 0
    watcher.on_round_of(job)(11, 30)
    assert watcher.progress.done == 1 and "round 11/30" in watcher.progress.status
    watcher.run_done(job.path(out))
    assert watcher.progress.done == 20 and watcher.progress.status == "runs 3/3 done"
    with pytest.raises(ValueError, match="--progress-interval"):
        bench.run_grid([job], out, progress_interval=-1)


def _on_a_terminal(monkeypatch, work, *args, **kwargs):
    """``work(*args, **kwargs)`` with ``sys.stdout`` a terminal; its result and what it printed."""
    terminal = Terminal()
    with monkeypatch.context() as patch:
        patch.setattr(sys, "stdout", terminal)
        result = work(*args, **kwargs)
    return result, terminal.getvalue()


@requires("matplotlib", extra="analysis")
def test_report_and_faithfulness_give_the_same_results_with_progress(tmp_path, monkeypatch):
    import numpy as np
    import torch as th
    from conftest import collect_rollout

    from sb3_influence import AttributionCallback, InfluencePPO
    from sb3_influence.analysis.faithfulness import faithfulness
    from sb3_influence.analysis.report import build_report
    from sb3_influence.common.snapshots import load_all

    model = InfluencePPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, n_epochs=1, seed=0,
                         policy_kwargs=dict(net_arch=[16]))  # fmt: skip
    model.learn(64 * 3, callback=AttributionCallback(save_dir=str(tmp_path / "run")))
    calls = []
    snapshots = load_all(tmp_path / "run", on_file=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 3), (2, 3), (3, 3)] and len(snapshots) == 3
    # On a terminal, so that progress shows (a bar) even for work this short; off, nothing is shown
    page_off, report_off = _on_a_terminal(monkeypatch, build_report, tmp_path / "run", tmp_path / "off", progress=False)
    page_on, report_on = _on_a_terminal(monkeypatch, build_report, tmp_path / "run", tmp_path / "on", progress=True)
    assert page_off.read_bytes() == page_on.read_bytes()
    model = InfluencePPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=64, n_epochs=1, learning_rate=1e-3, seed=0,
                         policy_kwargs=dict(net_arch=[16], optimizer_class=th.optim.SGD))  # fmt: skip
    collect_rollout(model)
    scores = {"single": model.compute_influence()}
    settings = dict(sizes=(0.1,), n_subsets=3, n_orders=2)
    result_off, retrains_off = _on_a_terminal(monkeypatch, faithfulness, model, scores, progress=False, **settings)
    result_on, retrains_on = _on_a_terminal(monkeypatch, faithfulness, model, scores, progress=True, **settings)
    n_retrains = result_off["n_retrains"]
    assert n_retrains == 2 * (1 + 3 + 5 + 2)
    np.testing.assert_equal(result_off, result_on)
    assert report_off == "" and retrains_off == ""
    pytest.importorskip("tqdm", reason="the progress shown is checked on tqdm's bar")
    # The bar counted every file read and every retrain, up to the planned total
    assert re.search(r"report: reading: 100%\|.*\| 3/3 ", report_on), report_on
    assert re.search(rf"faithfulness: 100%\|.*\| {n_retrains}/{n_retrains} ", retrains_on), retrains_on
