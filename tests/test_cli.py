"""The ``sb3-influence`` command line: usage, unknown commands, and the one-line message of a missing extra."""

import os
import subprocess
import sys

from sb3_influence import AttributionCallback, InfluencePPO
from sb3_influence.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_usage_and_unknown_command(capsys):
    assert main([]) == 0
    assert "report" in capsys.readouterr().out
    assert main(["plot"]) == 2
    assert "unknown command 'plot'" in capsys.readouterr().err


def test_report_without_the_analysis_extra_names_it(tmp_path):
    model = InfluencePPO("MlpPolicy", "CartPole-v1", n_steps=32, batch_size=32, n_epochs=1, seed=0)
    model.learn(32, callback=AttributionCallback(save_dir=str(tmp_path / "snapshots")))
    # A fresh interpreter in which matplotlib cannot be imported (pandas and scipy are core requirements)
    code = (
        "import sys; sys.modules['matplotlib'] = None; "
        "from sb3_influence.cli import main; sys.exit(main(['report', sys.argv[1]]))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-c", code, str(tmp_path / "snapshots")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line == "error: sb3-influence report: No module named 'matplotlib': pip install 'sb3_influence[analysis]'"
