"""``sb3-influence report RUN_DIR``: the HTML page and PNGs built from a run's snapshots."""

import base64
import re
import shutil
import subprocess

import numpy as np
import pytest
from stable_baselines3.common.env_util import make_vec_env

from conftest import requires
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


@requires("matplotlib", extra="analysis")
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


@requires("matplotlib", extra="analysis")
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
@requires("matplotlib", extra="analysis")
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


@requires("matplotlib", extra="analysis")
def test_report_diagnosis_and_intervention_on_frozen_lake(tmp_path):
    """States repeat on FrozenLake: the page carries the in-buffer diagnosis table and the intervention plot."""
    import gymnasium as gym

    from sb3_influence.analysis import InterventionCallback, snapshot_diagnosis
    from sb3_influence.analysis.intervention import read_interventions

    model = InfluencePPO(
        "MlpPolicy",
        gym.make("FrozenLake-v1", is_slippery=False),
        n_steps=256,
        batch_size=64,
        n_epochs=1,
        seed=0,
        policy_kwargs=dict(net_arch=[8]),
    )
    save_dir = str(tmp_path / "run")
    intervention = InterventionCallback(rounds=[0, 1], save_dir=save_dir, arms=["negatives", "random"])
    model.learn(256 * 2, callback=[intervention, AttributionCallback(save_dir=save_dir)])
    out = tmp_path / "report"
    build_report(save_dir, out_dir=str(out))
    page = (out / "report.html").read_text()
    section = page.split('id="diagnosis"')[1].split("<h2")[0]
    snapshots = sorted((load_snapshot(str(p)) for p in (tmp_path / "run").glob("*.npz")), key=lambda s: s.round)
    rewarded = [snapshot for snapshot in snapshots if snapshot.arrays["reward"].sum() > 0]
    assert rewarded  # a round that reached the goal (otherwise every return, hence Ā, is 0 and ρ is nan)
    for snapshot in rewarded:
        rho = snapshot_diagnosis(snapshot)["spearman"]
        assert np.isfinite(rho) and f"{rho:.3g}" in section
    # The intervention files hold the callback's own tables, and the page shows their plot
    table, others = read_interventions(save_dir, model.run_id)
    assert others == 0 and sorted(set(table["round"])) == [0, 1]
    np.testing.assert_array_equal(table[table["round"] == 1]["delta_target"], intervention.results[1]["delta_target"])
    png = (out / "intervention.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and base64.b64encode(png).decode() in page
    # Files of another run under the folder are left out, and said so
    assert read_interventions(save_dir, "another-run")[1] == 2


@requires("matplotlib", extra="analysis")
def test_report_says_why_the_diagnosis_is_not_shown(run_dir, tmp_path):
    build_report(str(run_dir), out_dir=str(tmp_path / "r"))
    section = (tmp_path / "r" / "report.html").read_text().split('id="diagnosis"')[1].split("<h2")[0]
    assert "Not shown" in section and "repeated states" in section
    assert not (tmp_path / "r" / "intervention.png").exists()


@requires("matplotlib", extra="analysis")
def test_report_refuses_a_damaged_intervention_file_or_skips_it(run_dir, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(run_dir, folder)
    (folder / "intervention_round000001.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"intervention_round000001\.json"):
        build_report(str(folder), out_dir=str(tmp_path / "r1"))
    with pytest.warns(UserWarning, match=r"intervention_round000001\.json"):
        build_report(str(folder), out_dir=str(tmp_path / "r2"), on_error="skip")
    assert not (tmp_path / "r2" / "intervention.png").exists()
