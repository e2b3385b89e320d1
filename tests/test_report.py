"""``sb3-influence report RUN_DIR``: the HTML page and PNGs built from a run's snapshots."""

import base64
import re
import shutil
import subprocess

import numpy as np
import pytest
from stable_baselines3.common.env_util import make_vec_env

from sb3_influence import AttributionCallback, IIFCallback, InfluencePPO, load_snapshot
from sb3_influence.analysis.report import build_report, main, rollout_episode_returns, round_summary
from sb3_influence.cli import main as cli_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ("influence_distribution", "kept_fraction", "advantage_correlation", "learning_curve")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny IIF run on CartPole with Monitor files and one snapshot per round."""
    path = tmp_path_factory.mktemp("run")
    env = make_vec_env("CartPole-v1", n_envs=2, seed=0, monitor_dir=str(path / "monitor"))
    model = InfluencePPO("MlpPolicy", env, n_steps=64, batch_size=32, n_epochs=2, seed=0, policy_kwargs=dict(net_arch=[16]))
    callbacks = [IIFCallback(fraction=0.5), AttributionCallback(save_dir=str(path / "snapshots"))]
    model.learn(64 * 2 * 4, callback=callbacks)
    return path


def _snapshots(run_dir):
    snapshots = [load_snapshot(str(p)) for p in (run_dir / "snapshots").glob("*.npz")]
    return [s.arrays for s in sorted(snapshots, key=lambda s: s.num_timesteps)]


def test_report_command_writes_a_self_contained_page(run_dir, tmp_path, capsys):
    out = tmp_path / "report"
    assert main([str(run_dir), "--out", str(out), "--top", "3", "--title", "CartPole IIF"]) == 0
    assert str(out / "report.html") in capsys.readouterr().out
    page = (out / "report.html").read_text()
    for name in FIGURES:
        png = (out / f"{name}.png").read_bytes()
        assert png.startswith(PNG_MAGIC)
        # The page embeds exactly the PNG written next to it
        assert base64.b64encode(png).decode() in page
    images = re.findall(r'<img[^>]*src="([^"]+)"', page)
    assert len(images) == len(FIGURES) and all(src.startswith("data:image/png;base64,") for src in images)
    # Self-contained: nothing is fetched from elsewhere
    assert not re.search(r'(src|href)="(?!data:|#)', page)
    assert "<title>CartPole IIF</title>" in page
    # The top/bottom table lists the last round's most extreme records
    last = _snapshots(run_dir)[-1]
    scores = last["influence/return"].reshape(-1)
    table = page.split('id="records"')[1].split('id="summary"')[0]
    assert f"{scores.max():.4g}" in table and f"{scores.min():.4g}" in table
    assert table.count("</tr>") == 1 + 2 * 3  # header + top 3 + bottom 3
    # The learning curve comes from the Monitor files
    assert "Monitor files" in page


def test_round_summary_matches_snapshots(run_dir):
    snapshots = _snapshots(run_dir)
    summary = round_summary(snapshots)
    assert list(summary["round"]) == [0, 1, 2, 3]
    for row, arrays in zip(summary.itertuples(), snapshots, strict=True):
        assert row.kept_fraction == arrays["keep"].mean()
        assert row.negative_fraction == (arrays["influence/return"] < 0).mean()
    # IIF with fraction 0.5 dropped records every round
    assert (summary["kept_fraction"] < 1).all()


def test_rollout_episode_returns():
    rewards = np.ones((6, 2))
    starts = np.array([[1, 1], [0, 0], [1, 0], [0, 1], [0, 0], [1, 0]], dtype=bool)
    # env 0: episodes [0, 2) and [2, 5) complete; env 1: [0, 3) complete, [3, ...) not
    np.testing.assert_array_equal(rollout_episode_returns({"reward": rewards, "episode_start": starts}), [2.0, 3.0, 3.0])


def test_report_through_the_cli_and_default_location(run_dir):
    snapshots = run_dir / "snapshots"
    assert cli_main(["report", str(snapshots)]) == 0
    page = (snapshots / "report" / "report.html").read_text()
    # No Monitor file under this folder: the curve comes from the rollouts
    assert "inside each snapshot" in page


def test_report_bad_input(tmp_path, run_dir):
    with pytest.raises(SystemExit) as error:
        main([str(tmp_path)])
    assert error.value.code == 2
    with pytest.raises(ValueError, match="does not exist"):
        build_report(tmp_path / "missing")
    with pytest.raises(ValueError, match="not in this snapshot"):
        build_report(run_dir / "snapshots", out_dir=tmp_path / "x", target="nope")
    with pytest.raises(ValueError, match="top_k"):
        build_report(run_dir / "snapshots", out_dir=tmp_path / "x", top_k=0)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs a chromium browser (scripts/check_report_in_browser.sh installs one)")
def test_report_renders_in_headless_chromium(run_dir, tmp_path):
    from matplotlib.image import imread

    path = build_report(run_dir, out_dir=tmp_path / "report")
    screenshot = tmp_path / "page.png"
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1200,2400",
        f"--screenshot={screenshot}",
        path.as_uri(),
    ]
    subprocess.run(command, check=True, timeout=120, capture_output=True)
    pixels = imread(screenshot)
    assert pixels.shape[0] == 2400 and pixels.shape[1] == 1200
    # A rendered page with figures, not a blank or an error page: many distinct colours
    colours = np.unique((pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 50
