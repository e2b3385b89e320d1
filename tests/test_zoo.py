"""The rl-zoo launcher, ``ZooInfluencePPO`` and the shipped hyperparameter files."""

import importlib
import importlib.util
import inspect
import os
import subprocess
import sys

import gymnasium as gym
import pytest
import torch as th
from stable_baselines3 import PPO
from stable_baselines3.common.policies import ActorCriticPolicy
from torch import nn

import sb3_influence
from sb3_influence import IIFCallback, InfluencePPO, MiniGridCNN, load_snapshots
from sb3_influence.zoo import ZooInfluencePPO, hyperparams_path

pytest.importorskip("rl_zoo3", reason="install the zoo extra: pip install -e '.[zoo]'")
yaml = pytest.importorskip("yaml")  # a dependency of rl_zoo3

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"influence_ppo": ZooInfluencePPO, "ppo": PPO}
# What the influence_ppo file adds to ppo.yml: the IIF hyperparameters (and CartPole's AttributionCallback)
IIF_KEYS = {"iif_fraction", "iif_rule", "callback"}
# Keys rl-zoo's ExperimentManager consumes itself (the others go to the algorithm's constructor)
ZOO_KEYS = {
    "n_timesteps", "policy", "n_envs", "normalize", "env_wrapper", "vec_env_wrapper", "env_kwargs", "callback",
    "frame_stack", "monitor_kwargs",
}  # fmt: skip
# Envs registered by another extra's package (bench, minigrid), imported as rl-zoo's import_envs does
OPTIONAL_ENVS = {"highway-v0": "highway_env", "MiniGrid-Empty-8x8-v0": "minigrid"}


def _load(algo: str) -> dict:
    with open(hyperparams_path(algo)) as file:
        return yaml.safe_load(file)


def _parameters(algo: type) -> set[str]:
    # Every class up to PPO, for ZooInfluencePPO's **kwargs
    names: set[str] = set()
    for cls in algo.__mro__[: algo.__mro__.index(PPO) + 1]:
        names |= set(inspect.signature(cls.__init__).parameters)
    return names - {"self", "env", "_init_setup_model", "kwargs"}


def _get_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_every_key_is_a_real_parameter(config_name):
    algo = CONFIGS[config_name]
    algo_params = _parameters(algo)
    policy_params = set(inspect.signature(ActorCriticPolicy.__init__).parameters) - {"self"}
    # The names rl-zoo's eval of policy_kwargs strings can see once sb3_influence.zoo.register() ran
    namespace = {"th": th, "nn": nn, "sb3_influence": sb3_influence, "MiniGridCNN": MiniGridCNN}
    for env_id, entry in _load(config_name).items():
        unknown = set(entry) - algo_params - ZOO_KEYS
        assert not unknown, f"{config_name}:{env_id}: {unknown} are neither {algo.__name__} parameters nor rl-zoo keys"
        assert entry["policy"] in algo.policy_aliases
        assert isinstance(entry["n_timesteps"], int) and entry["n_timesteps"] % entry["n_steps"] == 0
        if "policy_kwargs" in entry:
            policy_kwargs = eval(entry["policy_kwargs"], namespace)
            assert set(policy_kwargs) <= policy_params, f"{env_id}: {set(policy_kwargs) - policy_params}"
        for item in entry.get("callback", []):
            ((path, kwargs),) = item.items()
            callback_class = _get_class(path)
            assert set(kwargs) <= set(inspect.signature(callback_class.__init__).parameters)
            callback_class(**kwargs)
        if env_id in OPTIONAL_ENVS:
            # An env of another extra (minigrid, box2d): its wrapper and registration are checked where it is installed
            if importlib.util.find_spec(OPTIONAL_ENVS[env_id]) is None:
                continue
            importlib.import_module(OPTIONAL_ENVS[env_id])  # registers its envs, as rl-zoo's import_envs does
        if "env_wrapper" in entry:
            _get_class(entry["env_wrapper"])
        assert env_id in gym.envs.registry, f"{env_id} is not a registered env"
        if "env_kwargs" in entry:
            gym.make(env_id, **entry["env_kwargs"]).close()


def test_ppo_baselines_match_the_iif_configs():
    iif, ppo = _load("influence_ppo"), _load("ppo")
    assert set(iif) == set(ppo)
    for env_id, entry in iif.items():
        assert 0 < entry["iif_fraction"] <= 1 and entry["iif_rule"] == "neg-bottom", env_id
        # The filter is set once, as hyperparameters (ZooInfluencePPO.learn refuses a second IIFCallback)
        assert not any("IIFCallback" in next(iter(item)) for item in entry.get("callback", [])), env_id
        assert {key: value for key, value in entry.items() if key not in IIF_KEYS} == ppo[env_id], env_id


def test_hyperparameter_files_are_package_data():
    package_dir = os.path.dirname(os.path.abspath(sb3_influence.__file__))
    for algo in CONFIGS:
        path = hyperparams_path(algo)
        assert os.path.isfile(path) and path.startswith(package_dir)
    with pytest.raises(ValueError, match="algo: sb3_influence ships hyperparameters for"):
        hyperparams_path("a2c")
    with open(os.path.join(ROOT, "setup.cfg")) as file:
        assert "sb3_influence.zoo = hyperparams/*.yml" in file.read()


def test_register_adds_algo_and_tuning_hooks():
    optuna = pytest.importorskip("optuna")
    from rl_zoo3 import exp_manager, hyperparams_opt, utils

    from sb3_influence import zoo

    from sb3_influence.zoo.sampler import convert_influence_ppo_params, sample_influence_ppo_params

    zoo.register()
    zoo.register()
    assert utils.ALGOS["influence_ppo"] is ZooInfluencePPO
    assert exp_manager.ALGOS["influence_ppo"] is ZooInfluencePPO
    assert exp_manager.HYPERPARAMS_SAMPLER["influence_ppo"] is sample_influence_ppo_params
    assert hyperparams_opt.HYPERPARAMS_CONVERTER["influence_ppo"] is convert_influence_ppo_params
    assert vars(exp_manager)["MiniGridCNN"] is MiniGridCNN
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    kwargs = exp_manager.HYPERPARAMS_SAMPLER["influence_ppo"](study.ask(), 2, 1, {})
    model = ZooInfluencePPO("MlpPolicy", "CartPole-v1", **kwargs)
    assert model.n_steps == kwargs["n_steps"] and model.iif_fraction == kwargs["iif_fraction"]


def test_main_usage_and_unknown_script(capsys):
    from sb3_influence import zoo

    assert zoo.main([]) == 0
    assert "influence_ppo" in capsys.readouterr().out
    assert zoo.main(["record_training"]) == 2
    assert "unknown script 'record_training'" in capsys.readouterr().err
    assert zoo.main(["config", "ppo"]) == 0
    assert capsys.readouterr().out.strip() == hyperparams_path("ppo")
    assert zoo.main(["config", "a2c"]) == 2
    assert "give one of ['influence_ppo', 'ppo', 'influence_a2c']" in capsys.readouterr().err
    # No -conf and an env the shipped file does not cover: one line naming --env and the fix
    assert zoo.main(["train", "--algo", "influence_ppo", "--env", "Pendulum-v1"]) == 2
    assert "error: sb3-influence-zoo train: --env Pendulum-v1: sb3_influence's influence_ppo hyperparameters cover" in (
        capsys.readouterr().err
    )


def test_cli_train_run_with_yaml_callbacks(tmp_path):
    # No -conf: the shipped influence_ppo.yml; IIF set as hyperparameters, snapshots by a yaml callback
    callbacks = f"callback:[{{'sb3_influence.AttributionCallback': dict(save_dir={str(tmp_path / 'snap')!r})}}]"
    command = [
        sys.executable, "-m", "sb3_influence.zoo", "train", "--algo", "influence_ppo", "--env", "CartPole-v1",
        "-n", "256", "--eval-freq", "-1", "--seed", "3", "-f", str(tmp_path / "logs"), "-tb", str(tmp_path / "tb"),
        "-params", "n_steps:64", "batch_size:32", "n_epochs:1", "policy_kwargs:dict(net_arch=[16])",
        "iif_fraction:0.75", "iif_rule:'bottom'", callbacks,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "iif/n_dropped" in result.stdout or "n_dropped" in result.stdout
    model_path = tmp_path / "logs" / "influence_ppo" / "CartPole-v1_1" / "CartPole-v1.zip"
    assert model_path.exists()
    assert hyperparams_path("influence_ppo") in result.stdout  # "Loading hyperparameters from: ..."
    model = InfluencePPO.load(str(model_path))
    assert model.n_steps == 64 and model.num_timesteps == 256
    assert (model.iif_fraction, model.iif_rule) == (0.75, "bottom")
    frame = load_snapshots(str(tmp_path / "snap"))
    assert sorted(frame["num_timesteps"].unique()) == [64, 128, 192, 256]
    # "bottom" drops floor(0.75 * 64) = 48 of the 64 records of every round
    assert (frame.groupby("round")["keep"].sum() == 16).all()
    assert os.listdir(tmp_path / "tb" / "CartPole-v1")


def _zoo_train(tmp_path, env_id: str, timesteps: int, seed: int, n_steps: int, batch_size: int) -> None:
    """One in-process `sb3-influence-zoo train` with the shipped config (no -conf) and a tiny hyperparameter override."""
    from sb3_influence import zoo

    argv = [
        "train", "--algo", "influence_ppo", "--env", env_id, "-n", str(timesteps), "--eval-freq", "-1", "--seed", str(seed),
        "-f", str(tmp_path / "logs"), "--verbose", "0",
        "-params", f"n_steps:{n_steps}", f"batch_size:{batch_size}", "n_epochs:1",
    ]  # fmt: skip
    assert zoo.main(argv) == 0


def test_in_process_train_with_the_paper_config(tmp_path, monkeypatch):
    # The config's own callback list (IIFCallback + AttributionCallback for CartPole) and policy_kwargs string
    monkeypatch.chdir(tmp_path)
    _zoo_train(tmp_path, "CartPole-v1", timesteps=128, seed=1, n_steps=64, batch_size=64)
    model = ZooInfluencePPO.load(str(tmp_path / "logs" / "influence_ppo" / "CartPole-v1_1" / "CartPole-v1.zip"))
    assert isinstance(model.policy.optimizer, th.optim.SGD)
    assert model.max_grad_norm >= 1e9
    assert isinstance(model, ZooInfluencePPO) and (model.iif_fraction, model.iif_rule) == (0.5, "neg-bottom")
    config = (tmp_path / "logs" / "influence_ppo" / "CartPole-v1_1" / "CartPole-v1" / "config.yml").read_text()
    assert "iif_fraction" in config and "sb3_influence.AttributionCallback" in config


def test_minigrid_entry_builds_the_papers_cnn(tmp_path, monkeypatch):
    pytest.importorskip("minigrid")
    monkeypatch.chdir(tmp_path)
    _zoo_train(tmp_path, "MiniGrid-Empty-8x8-v0", timesteps=32, seed=0, n_steps=32, batch_size=32)
    run_dir = tmp_path / "logs" / "influence_ppo" / "MiniGrid-Empty-8x8-v0_1"
    model = InfluencePPO.load(str(run_dir / "MiniGrid-Empty-8x8-v0.zip"))
    extractor = model.policy.features_extractor
    assert isinstance(extractor, MiniGridCNN)
    convs = [layer for layer in extractor.cnn if isinstance(layer, nn.Conv2d)]
    assert [(conv.in_channels, conv.out_channels, conv.kernel_size) for conv in convs] == [(3, 16, (3, 3)), (16, 32, (3, 3))]
    assert extractor.linear[0].in_features == 288 and extractor.linear[0].out_features == 64
    assert model.policy.net_arch == dict(pi=[64, 64], vf=[64, 64])
    with pytest.raises(ValueError, match="ImgObsWrapper"):
        MiniGridCNN(gym.spaces.Box(0, 1, (4,)))


def test_enjoy_and_record_video_after_train(tmp_path, monkeypatch):
    from sb3_influence import zoo

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")
    _zoo_train(tmp_path, "CartPole-v1", timesteps=64, seed=0, n_steps=64, batch_size=64)
    common = ["--algo", "influence_ppo", "--env", "CartPole-v1", "-f", str(tmp_path / "logs"), "-n", "20", "--no-render"]
    assert zoo.main(["enjoy", *common]) == 0
    assert zoo.main(["record_video", *common, "-o", str(tmp_path / "videos")]) == 0
    assert any(name.endswith(".mp4") for name in os.listdir(tmp_path / "videos"))


def _run_python(code: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)


def test_a_missing_module_names_itself_and_its_extra(tmp_path):
    # Hide `requests` (rl_zoo3's enjoy imports it through load_from_hub; its train does not)
    hide = "import sys; sys.modules['requests'] = None; from sb3_influence.zoo import main; "
    result = _run_python(hide + "sys.exit(main(['enjoy', '--help']))", tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: sb3-influence-zoo enjoy: No module named 'requests': pip install 'sb3_influence[zoo]'"
    )
    # The launcher imports only the script it runs: train does not need requests
    result = _run_python(hide + "sys.exit(main(['train', '--help']))", tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--algo" in result.stdout and "influence_ppo" in result.stdout


def test_zoo_package_imports_without_rl_zoo3(tmp_path):
    hide = "import sys; sys.modules['rl_zoo3'] = sys.modules['optuna'] = sys.modules['yaml'] = None; "
    result = _run_python(hide + "from sb3_influence.zoo import main; sys.exit(main(['train', '--help']))", tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: sb3-influence-zoo train: No module named 'rl_zoo3': pip install 'sb3_influence[zoo]'"
    )


def test_missing_module_message():
    from sb3_influence.extras import missing_module_message

    error = ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
    assert missing_module_message(error, "sb3-influence report", "analysis").endswith("pip install 'sb3_influence[analysis]'")
    assert missing_module_message(error, "sb3-influence-zoo train", "zoo").endswith("pip install 'sb3_influence[zoo]'")
    error = ModuleNotFoundError("No module named 'minigrid.wrappers'", name="minigrid.wrappers")
    message = missing_module_message(error, "x", "zoo")
    assert message == "error: x: No module named 'minigrid': pip install 'sb3_influence[minigrid]'"
    error = ModuleNotFoundError("No module named 'wandb'", name="wandb")
    assert "no sb3_influence extra installs" in missing_module_message(error, "x", "zoo")


def test_every_extra_named_in_messages_exists():
    import configparser

    from sb3_influence.extras import EXTRA_MODULES

    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    assert set(EXTRA_MODULES) <= set(config["options.extras_require"])


class TestZooInfluencePPO:
    def _model(self, **kwargs) -> ZooInfluencePPO:
        kwargs = {"n_steps": 64, "batch_size": 32, "n_epochs": 1, "seed": 0, **kwargs}
        return ZooInfluencePPO("MlpPolicy", "CartPole-v1", **kwargs)

    def test_bad_settings_name_the_argument(self):
        with pytest.raises(ValueError, match=r"iif_fraction must be in \[0, 1\]"):
            self._model(iif_fraction=1.5)
        with pytest.raises(TypeError, match="iif_fraction must be a number"):
            self._model(iif_fraction="0.5")
        with pytest.raises(ValueError, match="iif_rule must be one of"):
            self._model(iif_fraction=0.5, iif_rule="worst")
        with pytest.raises(TypeError, match="policy_kwargs_update must be a dict"):
            self._model(policy_kwargs_update=[16])

    def test_no_fraction_no_filter(self):
        model = self._model().learn(64)
        assert model.iif_fraction is None and model.rollout_buffer.keep.all()

    def test_fraction_reaches_the_filter(self):
        model = self._model(iif_fraction=0.25, iif_rule="bottom").learn(64)
        assert int((~model.rollout_buffer.keep).sum()) == 16  # floor(0.25 * 64)

    def test_a_second_iif_callback_is_refused(self):
        with pytest.raises(ValueError, match="filter every round twice"):
            self._model(iif_fraction=0.5).learn(64, callback=[IIFCallback(0.5)])
        # Without iif_fraction a yaml IIFCallback is the filter, as before
        model = self._model().learn(64, callback=IIFCallback(0.25, rule="bottom"))
        assert int((~model.rollout_buffer.keep).sum()) == 16

    def test_policy_kwargs_update_keeps_the_other_keys(self):
        model = self._model(
            policy_kwargs=dict(optimizer_class=th.optim.SGD, net_arch=[8]),
            policy_kwargs_update=dict(net_arch=dict(pi=[16], vf=[16]), activation_fn=nn.ReLU),
        )
        assert isinstance(model.policy.optimizer, th.optim.SGD)
        assert model.policy.net_arch == dict(pi=[16], vf=[16]) and model.policy.activation_fn is nn.ReLU

    def test_save_load_keeps_the_iif_settings(self, tmp_path):
        self._model(iif_fraction=0.5, iif_rule="neg").save(tmp_path / "model")
        loaded = ZooInfluencePPO.load(tmp_path / "model")
        assert (loaded.iif_fraction, loaded.iif_rule) == (0.5, "neg")
        assert InfluencePPO.load(tmp_path / "model").n_steps == 64


# An option only each of rl_zoo3's plot scripts has
PLOT_OPTIONS = {"plot_train": "--episode-window", "all_plots": "--print-n-trials", "plot_from_file": "--merge"}


@pytest.mark.parametrize("script", ["train", "enjoy", "record_video", "load_from_hub", "plot_train", "all_plots",
                                    "plot_from_file"])  # fmt: skip
def test_every_script_runs_through_the_launcher(script, capsys):
    from sb3_influence import zoo
    from sb3_influence.zoo.launcher import SCRIPTS, broken_import

    assert script in SCRIPTS
    if script in ("plot_train", "all_plots", "plot_from_file") and broken_import("rliable.library") is not None:
        # rliable 1.2 + arch 7 do not import under pandas 3: the launcher says so and names the fix
        assert zoo.main([script, "--help"]) == 2
        err = capsys.readouterr().err
        assert f"sb3-influence-zoo {script}: rl_zoo3's plots import rliable" in err and "pip install 'pandas<3'" in err
        return
    # argparse's --help exits 0 after printing the script's own usage
    with pytest.raises(SystemExit) as exit_info:
        zoo.main([script, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    if script in PLOT_OPTIONS:
        # rl_zoo3's plot scripts name their parser by a description (its usage line shows that), so the check is
        # for an option of the script's own
        assert out.startswith("usage: ") and PLOT_OPTIONS[script] in out
    else:
        assert f"usage: sb3-influence-zoo {script}" in out
    if SCRIPTS[script][2]:  # --algo is checked against rl_zoo3's ALGOS: influence_ppo is a valid choice
        assert "influence_ppo" in out


def test_broken_import_tells_a_broken_install_from_a_missing_one(tmp_path, monkeypatch):
    from sb3_influence.zoo.launcher import broken_import

    (tmp_path / "fake_broken_dep").mkdir()
    (tmp_path / "fake_broken_dep" / "__init__.py").write_text("")
    (tmp_path / "fake_broken_dep" / "library.py").write_text("raise TypeError('needs another pandas')\n")
    (tmp_path / "fake_missing_inside").mkdir()
    (tmp_path / "fake_missing_inside" / "__init__.py").write_text("import fake_module_nobody_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert broken_import("fake_broken_dep.library") == "TypeError: needs another pandas"
    assert broken_import("fake_broken_dep") is None
    assert broken_import("fake_missing_inside") is None  # an ImportError is rl_zoo3's own fallback, not broken
    assert broken_import("fake_module_nobody_installed.library") is None
