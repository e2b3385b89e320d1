"""
``-optimize`` of ``influence_ppo``: the search space (rl-zoo's PPO space + IIF fraction and rule), the sampled
fraction reaching the filter of every trial, the yaml's policy_kwargs surviving, and distributed tuning with several
worker processes on one JournalStorage file and (in CI, ``.ci/run``) one PostgreSQL database.
"""

import glob
import json
import os
import subprocess
import sys
import uuid

import pytest
import torch as th

from sb3_influence.common.filters import DROP_RULES, n_to_drop

pytest.importorskip("rl_zoo3")
optuna = pytest.importorskip("optuna")

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
# Set by .ci/run, which starts a local PostgreSQL server and creates an empty database for this test
PG_URL_VAR = "SB3_INFLUENCE_TEST_PG_URL"
PPO_PARAMS = {
    "batch_size_pow", "n_steps_pow", "one_minus_gamma", "one_minus_gae_lambda", "learning_rate", "ent_coef", "clip_range",
    "n_epochs", "max_grad_norm", "net_arch", "activation_fn",
}  # fmt: skip
# The PPO parameters the distributed tests fix (enqueued before the workers start) so that a trial takes seconds:
# 64-step rounds, one epoch, the tiny network. iif_fraction, iif_rule and the rest are still sampled by the workers.
CHEAP = {"n_steps_pow": 6, "batch_size_pow": 5, "n_epochs": 1, "net_arch": "tiny"}
N_TIMESTEPS = 128  # two rounds of 64 steps


def _expected_drops(rule: str, fraction: float, n: int, n_negative: int) -> int:
    # See sb3_influence.common.filters: "neg" ignores the fraction, "bottom" takes it of all records
    if rule == "neg":
        return n_negative
    return n_to_drop(fraction, n if rule == "bottom" else n_negative)


def _records(save_dir) -> list[dict]:
    records = []
    for path in glob.glob(os.path.join(str(save_dir), "*.jsonl")):
        with open(path) as file:
            records += [json.loads(line) for line in file]
    return records


def _check_trials(trials: list, records: list[dict]) -> None:
    """Every trial's sampled IIF settings reached the filter of each of its rounds; the yaml's SGD stayed."""
    assert trials
    for trial in trials:
        assert PPO_PARAMS | {"iif_fraction", "iif_rule"} == set(trial.params), trial.params
        fraction, rule = trial.params["iif_fraction"], trial.params["iif_rule"]
        rounds = [r for r in records if (r["iif_fraction"], r["iif_rule"]) == (fraction, rule)]
        assert len(rounds) == N_TIMESTEPS // 2 ** trial.params["n_steps_pow"], (trial.params, records)
        for r in rounds:
            assert r["n_dropped"] == _expected_drops(rule, fraction, r["n"], r["n_negative"]), r
            assert r["n_kept"] == r["n"] - r["n_dropped"]
            # CartPole's policy_kwargs in the shipped yaml: dict(optimizer_class=th.optim.SGD); the network is sampled
            assert r["optimizer"] == "SGD"
            hidden = {"tiny": [64], "small": [64, 64], "medium": [256, 256]}[trial.params["net_arch"]]
            assert r["net_arch"] == {"pi": hidden, "vf": hidden}


def _env() -> dict[str, str]:
    # The workers import sb3_influence from this checkout and the recorder callback from tests/
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")])}


def _worker(tmp_path, *extra: str, seed: int) -> list[str]:
    recorder = f"callback:[{{'zoo_recorder.IIFRecorder': dict(save_dir={str(tmp_path / 'records')!r})}}]"
    return [
        sys.executable, "-m", "sb3_influence.zoo", "train", "--algo", "influence_ppo", "--env", "CartPole-v1",
        "-optimize", "--sampler", "random", "--pruner", "none", "--seed", str(seed), "-n", str(N_TIMESTEPS),
        "--n-evaluations", "1", "--eval-episodes", "1", "--no-optim-plots", "-f", str(tmp_path / "logs"),
        *extra, "-params", recorder,
    ]  # fmt: skip


def _run_two_workers(tmp_path, storage_arg: str, storage, study_name: str) -> None:
    """Create the study and its two cheap trials first (no schema race), run two workers, check the study."""
    study = optuna.create_study(storage=storage, study_name=study_name, direction="maximize")
    for _ in range(2):
        study.enqueue_trial(CHEAP)
    storage_args = ("--storage", storage_arg, "--study-name", study_name, "--n-trials", "1")
    workers = [
        subprocess.Popen(
            _worker(tmp_path, *storage_args, seed=seed), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=_env(), cwd=str(tmp_path),
        )
        for seed in (1, 2)
    ]  # fmt: skip
    for worker in workers:
        output, _ = worker.communicate(timeout=240)
        assert worker.returncode == 0, output[-3000:]
    study = optuna.load_study(storage=storage, study_name=study_name)
    trials = study.get_trials(states=[optuna.trial.TrialState.COMPLETE])
    assert len(trials) == 2
    records = _records(tmp_path / "records")
    assert len({r["pid"] for r in records}) == 2, "each worker ran one of the study's trials"
    _check_trials(trials, records)


def test_sampler_is_ppo_space_plus_iif():
    from sb3_influence.zoo.sampler import IIF_RULES, convert_influence_ppo_params, sample_influence_ppo_params

    assert set(IIF_RULES) <= set(DROP_RULES)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(5):
        trial = study.ask()
        kwargs = sample_influence_ppo_params(trial, 2, 1, {})
        assert set(trial.params) == PPO_PARAMS | {"iif_fraction", "iif_rule"}
        assert 0 <= kwargs["iif_fraction"] <= 1 and kwargs["iif_rule"] in IIF_RULES
        # The sampled network is merged into the yaml's policy_kwargs by ZooInfluencePPO, not put in their place
        assert "policy_kwargs" not in kwargs
        assert set(kwargs["policy_kwargs_update"]) == {"net_arch", "activation_fn"}
        # --trial-id rebuilds the same keyword arguments from the trial's params
        assert convert_influence_ppo_params(trial.params) == kwargs
        study.tell(trial, 0.0)
    distribution = study.trials[0].distributions["iif_fraction"]
    assert (distribution.low, distribution.high) == (0.0, 1.0)


def test_optimize_in_memory_two_trials(tmp_path):
    # --seed 159: rl-zoo's random sampler then draws two cheap trials (n_steps 64 and 32): see _check_trials
    result = subprocess.run(
        _worker(tmp_path, "--n-trials", "2", seed=159), capture_output=True, text=True, timeout=280, env=_env(),
        cwd=str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "-optimize without --storage keeps the study in memory" in result.stderr
    (report,) = glob.glob(str(tmp_path / "logs" / "influence_ppo" / "report_CartPole-v1_2-trials-*.pkl"))
    with open(report, "rb") as file:
        study = __import__("pickle").load(file)
    assert os.path.exists(report[: -len(".pkl")] + ".csv")  # the trials' table (pandas)
    trials = study.get_trials(states=[optuna.trial.TrialState.COMPLETE])
    assert len(trials) == 2
    _check_trials(trials, _records(tmp_path / "records"))


def test_journal_storage_two_workers(tmp_path):
    path = str(tmp_path / "study.log")
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))
    _run_two_workers(tmp_path, path, storage, "iif-journal")


def test_postgresql_two_workers(tmp_path):
    url = os.environ.get(PG_URL_VAR)
    if not url:
        pytest.skip(f"{PG_URL_VAR} is not set: .ci/run sets it after starting a local PostgreSQL server")
    pytest.importorskip("psycopg", reason="install the distributed extra: pip install -e '.[distributed]'")
    _run_two_workers(tmp_path, url, url, f"iif-{uuid.uuid4().hex[:8]}")


def test_trial_id_trains_with_the_trials_settings(tmp_path, monkeypatch):
    from sb3_influence.zoo import ZooInfluencePPO, main
    from sb3_influence.zoo.sampler import sample_influence_ppo_params

    path = str(tmp_path / "study.log")
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))
    study = optuna.create_study(storage=storage, study_name="done", direction="maximize")
    # Two trials: rl-zoo 2.9 ignores --trial-id 0 (it tests `if self.trial_id:`)
    study.enqueue_trial({**CHEAP, "activation_fn": "tanh", "iif_fraction": 0.5, "iif_rule": "neg"})
    study.enqueue_trial({**CHEAP, "activation_fn": "relu", "iif_fraction": 0.375, "iif_rule": "bottom"})
    for value in (0.0, 1.0):
        trial = study.ask()
        sample_influence_ppo_params(trial, 2, 1, {})
        study.tell(trial, value)
    monkeypatch.chdir(tmp_path)
    argv = [
        "train", "--algo", "influence_ppo", "--env", "CartPole-v1", "--storage", path, "--study-name", "done",
        "--trial-id", "1", "-n", "64", "--eval-freq", "-1", "--seed", "0", "-f", str(tmp_path / "logs"),
    ]  # fmt: skip
    assert main(argv) == 0
    model = ZooInfluencePPO.load(str(tmp_path / "logs" / "influence_ppo" / "CartPole-v1_1" / "CartPole-v1.zip"))
    assert (model.iif_fraction, model.iif_rule, model.n_steps) == (0.375, "bottom", 64)
    assert isinstance(model.policy.optimizer, th.optim.SGD)  # from the yaml, kept
    assert model.policy.net_arch == dict(pi=[64], vf=[64]) and model.policy.activation_fn is th.nn.ReLU
