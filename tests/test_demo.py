"""``sb3-influence run`` on tiny arguments."""

import re

import numpy as np
import pytest

from sb3_influence import demo, load_snapshots
from sb3_influence.cli import main as cli_main


def test_run_prints_rounds_extremes_and_return(tmp_path, capsys):
    argv = ["--timesteps", "192", "--n-steps", "64", "--n-epochs", "1", "--eval-episodes", "1", "--seed", "2"]
    assert cli_main(["run", *argv, "--save-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    frame = load_snapshots(str(tmp_path))
    assert sorted(frame["round"].unique()) == [0, 1, 2]
    # One table row per round with its kept fraction
    for round_, rows in frame.groupby("round"):
        match = re.search(rf"^\s+{round_}\s+{(round_ + 1) * 64}\s+([0-9.]+)\s", out, flags=re.MULTILINE)
        assert match, out
        assert float(match.group(1)) == pytest.approx(rows["keep"].mean(), abs=1e-3)
    # Top / bottom records of the last round, with their influence
    last = frame[frame["round"] == 2]
    top_line = next(line for line in out.splitlines() if line.startswith("top 1"))
    bottom_line = next(line for line in out.splitlines() if line.startswith("bottom 1"))
    assert float(top_line.split()[-2]) == pytest.approx(last["influence_return"].max(), rel=1e-3)
    assert float(bottom_line.split()[-2]) == pytest.approx(last["influence_return"].min(), rel=1e-3)
    assert sum(line.startswith(("top ", "bottom ")) for line in out.splitlines()) == 6
    assert "Final mean episode return (1 eval episodes)" in out
    assert np.isfinite(frame["influence_return"]).all()


def test_run_without_save_dir_leaves_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert demo.main(["--timesteps", "64", "--n-steps", "64", "--n-epochs", "1", "--eval-episodes", "0", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "top 1" in out and "bottom 1" in out and "top 2" not in out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [["--fraction", "1.5"], ["--timesteps", "0"], ["--rule", "worst"]])
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit):
        demo.main(argv)
    assert "error" in capsys.readouterr().err
