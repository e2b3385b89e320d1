"""The rl-zoo launcher and the zoo_configs files."""

import importlib
import importlib.util
import inspect
import os
import subprocess
import sys

import gymnasium as gym
import pytest
import torch as th
import yaml
from stable_baselines3 import PPO
from stable_baselines3.common.policies import ActorCriticPolicy
from torch import nn

import sb3_influence
from sb3_influence import InfluencePPO, MiniGridCNN, load_snapshots

pytest.importorskip("rl_zoo3")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"influence_ppo.yml": InfluencePPO, "ppo.yml": PPO}
# Keys rl-zoo's ExperimentManager consumes itself (the others go to the algorithm's constructor)
ZOO_KEYS = {
    "n_timesteps", "policy", "n_envs", "normalize", "env_wrapper", "vec_env_wrapper", "env_kwargs", "callback",
    "frame_stack", "monitor_kwargs",
}  # fmt: skip
# Envs whose package is optional
OPTIONAL_ENVS = {"highway-v0": "highway_env"}


def _load(name: str) -> dict:
    with open(os.path.join(ROOT, "zoo_configs", name)) as file:
        return yaml.safe_load(file)


def _get_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_every_key_is_a_real_parameter(config_name):
    algo = CONFIGS[config_name]
    algo_params = set(inspect.signature(algo.__init__).parameters) - {"self", "env", "_init_setup_model"}
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
        if "env_wrapper" in entry:
            _get_class(entry["env_wrapper"])
        for item in entry.get("callback", []):
            ((path, kwargs),) = item.items()
            callback_class = _get_class(path)
            assert set(kwargs) <= set(inspect.signature(callback_class.__init__).parameters)
            callback_class(**kwargs)
        if env_id in OPTIONAL_ENVS:
            if importlib.util.find_spec(OPTIONAL_ENVS[env_id]) is None:
                continue
            importlib.import_module(OPTIONAL_ENVS[env_id])  # registers its ids, as rl-zoo's gym_packages does
        assert env_id in gym.envs.registry, f"{env_id} is not a registered env"
        if "env_kwargs" in entry:
            gym.make(env_id, **entry["env_kwargs"]).close()


def test_ppo_baselines_match_the_iif_configs():
    iif, ppo = _load("influence_ppo.yml"), _load("ppo.yml")
    assert set(iif) == set(ppo)
    for env_id, entry in iif.items():
        assert any("IIFCallback" in next(iter(item)) for item in entry["callback"])
        assert {key: value for key, value in entry.items() if key != "callback"} == ppo[env_id], env_id


def test_register_adds_algo_and_tuning_hooks():
    optuna = pytest.importorskip("optuna")
    from rl_zoo3 import exp_manager, hyperparams_opt, utils

    from sb3_influence import zoo

    zoo.register()
    zoo.register()
    assert utils.ALGOS["influence_ppo"] is InfluencePPO
    assert exp_manager.ALGOS["influence_ppo"] is InfluencePPO
    sampler = exp_manager.HYPERPARAMS_SAMPLER["influence_ppo"]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    kwargs = sampler(study.ask(), 2, 1, {})
    model = InfluencePPO("MlpPolicy", "CartPole-v1", **kwargs)
    assert model.n_steps == kwargs["n_steps"]
    assert hyperparams_opt.HYPERPARAMS_CONVERTER["influence_ppo"] is hyperparams_opt.convert_onpolicy_params


def test_main_usage_and_unknown_script(capsys):
    from sb3_influence import zoo

    assert zoo.main([]) == 0
    assert "influence_ppo" in capsys.readouterr().out
    assert zoo.main(["plot"]) == 2
    assert "unknown script 'plot'" in capsys.readouterr().err


def test_cli_train_run_with_yaml_callbacks(tmp_path):
    callbacks = (
        f"callback:[{{'sb3_influence.IIFCallback': dict(fraction=0.5)}}, "
        f"{{'sb3_influence.AttributionCallback': dict(save_dir={str(tmp_path / 'snap')!r})}}]"
    )
    command = [
        sys.executable, "-m", "sb3_influence.zoo", "train", "--algo", "influence_ppo", "--env", "CartPole-v1",
        "-conf", os.path.join(ROOT, "zoo_configs", "influence_ppo.yml"), "-n", "256", "--eval-freq", "-1",
        "--seed", "3", "-f", str(tmp_path / "logs"), "-tb", str(tmp_path / "tb"),
        "-params", "n_steps:64", "batch_size:32", "n_epochs:1", "policy_kwargs:dict(net_arch=[16])", callbacks,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "iif/n_dropped" in result.stdout or "n_dropped" in result.stdout
    model_path = tmp_path / "logs" / "influence_ppo" / "CartPole-v1_1" / "CartPole-v1.zip"
    assert model_path.exists()
    model = InfluencePPO.load(str(model_path))
    assert model.n_steps == 64 and model.num_timesteps == 256
    frame = load_snapshots(str(tmp_path / "snap"))
    assert sorted(frame["num_timesteps"].unique()) == [64, 128, 192, 256]
    assert (frame.groupby("round")["keep"].mean() < 1).all()
    assert os.listdir(tmp_path / "tb" / "CartPole-v1")


def _zoo_train(tmp_path, env_id: str, timesteps: int, seed: int, n_steps: int, batch_size: int) -> None:
    """One in-process `sb3-influence-zoo train` with the paper's config and a tiny hyperparameter override."""
    from sb3_influence import zoo

    argv = [
        "train", "--algo", "influence_ppo", "--env", env_id,
        "-conf", os.path.join(ROOT, "zoo_configs", "influence_ppo.yml"),
        "-n", str(timesteps), "--eval-freq", "-1", "--seed", str(seed), "-f", str(tmp_path / "logs"), "--verbose", "0",
        "-params", f"n_steps:{n_steps}", f"batch_size:{batch_size}", "n_epochs:1",
    ]  # fmt: skip
    assert zoo.main(argv) == 0


def test_in_process_train_with_the_paper_config(tmp_path, monkeypatch):
    # The config's own callback list (IIFCallback + AttributionCallback for CartPole) and policy_kwargs string
    monkeypatch.chdir(tmp_path)
    _zoo_train(tmp_path, "CartPole-v1", timesteps=128, seed=1, n_steps=64, batch_size=64)
    model = InfluencePPO.load(str(tmp_path / "logs" / "influence_ppo" / "CartPole-v1_1" / "CartPole-v1.zip"))
    assert isinstance(model.policy.optimizer, th.optim.SGD)
    assert model.max_grad_norm >= 1e9
    config = (tmp_path / "logs" / "influence_ppo" / "CartPole-v1_1" / "CartPole-v1" / "config.yml").read_text()
    assert "sb3_influence.IIFCallback" in config


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
