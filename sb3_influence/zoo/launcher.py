"""
The ``sb3-influence-zoo`` command: rl_zoo3's own scripts with ``influence_ppo`` registered.

rl_zoo3 only knows the algorithms of its ``ALGOS`` dict, so plain ``python -m rl_zoo3.train --algo influence_ppo``
fails; this launcher adds ``influence_ppo`` to that dict (and its tuning sampler to rl_zoo3's sampler dicts) in its
own process, then runs the script. It imports only the script it runs.
"""

import argparse
import importlib
import runpy
import sys
from importlib import resources
from types import MappingProxyType

from sb3_influence.extras import missing_module_message

ALGO_NAME = "influence_ppo"
# Our hyperparameter files (package data), by algorithm: the paper's settings for influence_ppo and their PPO baselines
CONFIGS = ("influence_ppo", "ppo", "influence_a2c")
# Algorithms whose shipped file is the default -conf of `train --algo NAME`
DEFAULT_CONFIGS = ("influence_ppo", "influence_a2c")

# script -> (rl_zoo3 module, its function or None to run the module as __main__ like `python -m`, whether its --algo
# is checked against rl_zoo3's ALGOS: then influence_ppo is registered first). Not here: rl_zoo3's record_training
# and benchmark start `python -m rl_zoo3.record_video` / `python enjoy.py` subprocesses, which cannot know
# influence_ppo; rl_zoo3 2.9.2's push_to_hub does not import with the huggingface_sb3 it depends on (3.x has no
# `generate_metadata`).
SCRIPTS: "MappingProxyType[str, tuple[str, str | None, bool]]" = MappingProxyType(
    {
        "train": ("rl_zoo3.train", "train", True),
        "enjoy": ("rl_zoo3.enjoy", "enjoy", True),
        "record_video": ("rl_zoo3.record_video", None, True),
        "load_from_hub": ("rl_zoo3.load_from_hub", None, True),
        "plot_train": ("rl_zoo3.plots.plot_train", "plot_train", False),
        "all_plots": ("rl_zoo3.plots.all_plots", "all_plots", False),
        "plot_from_file": ("rl_zoo3.plots.plot_from_file", "plot_from_file", False),
    }
)


def hyperparams_path(algo: str) -> str:
    """
    The path of a hyperparameter file shipped with sb3_influence (``sb3-influence-zoo config ALGO`` prints it).

    :param algo: ``"influence_ppo"`` (the paper's settings, the default of ``--algo influence_ppo``) or ``"ppo"``
        (the matching PPO baselines).
    :return: The path of the yaml file.
    """
    if algo not in CONFIGS:
        raise ValueError(f"algo: sb3_influence ships hyperparameters for {list(CONFIGS)}, got {algo!r}")
    return str(resources.files("sb3_influence.zoo").joinpath("hyperparams", f"{algo}.yml"))


def register() -> None:
    """
    Register ``influence_ppo`` with rl_zoo3 (idempotent): ``ZooInfluencePPO`` in ``ALGOS``, its optuna sampler and
    converter for ``-optimize`` / ``--trial-id``, and the names ``sb3_influence`` / ``MiniGridCNN`` for
    ``policy_kwargs`` strings. This is the only place sb3_influence touches rl_zoo3's registries.
    """
    from rl_zoo3 import exp_manager, hyperparams_opt, utils

    import sb3_influence
    from sb3_influence import MiniGridCNN
    from sb3_influence.zoo.model import ZooInfluencePPO
    from sb3_influence.zoo.sampler import convert_influence_ppo_params, sample_influence_ppo_params

    # rl_zoo3's modules share these dicts (`from ... import ALGOS`), so adding a key is seen everywhere
    utils.ALGOS[ALGO_NAME] = ZooInfluencePPO
    hyperparams_opt.HYPERPARAMS_SAMPLER[ALGO_NAME] = sample_influence_ppo_params
    hyperparams_opt.HYPERPARAMS_CONVERTER[ALGO_NAME] = convert_influence_ppo_params
    # The other influence algorithms: rl-zoo's own search spaces of the algorithms they extend (IIF as a callback)
    for name, algo, base in (
        ("influence_a2c", sb3_influence.InfluenceA2C, "a2c"),
        ("influence_maskable_ppo", sb3_influence.InfluenceMaskablePPO, "ppo"),
    ):
        utils.ALGOS[name] = algo
        if base in hyperparams_opt.HYPERPARAMS_SAMPLER:
            hyperparams_opt.HYPERPARAMS_SAMPLER[name] = hyperparams_opt.HYPERPARAMS_SAMPLER[base]
        if base in getattr(hyperparams_opt, "HYPERPARAMS_CONVERTER", {}):
            hyperparams_opt.HYPERPARAMS_CONVERTER[name] = hyperparams_opt.HYPERPARAMS_CONVERTER[base]
    # rl-zoo evaluates `policy_kwargs: "dict(...)"` in the namespace of its exp_manager module
    namespace = vars(exp_manager)
    namespace.setdefault("sb3_influence", sb3_influence)
    namespace.setdefault("MiniGridCNN", MiniGridCNN)


def _train_args(args: list[str]) -> list[str]:
    """
    ``train``'s arguments, plus ``-conf <our influence_ppo.yml>`` for ``--algo influence_ppo`` without ``-conf``.
    Warns on stderr when ``-optimize`` keeps its study in memory.

    :raises ValueError: for ``--algo influence_ppo`` without ``-conf`` on an env that file does not cover.
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("--algo", default="ppo")
    parser.add_argument("--env", default="CartPole-v1")  # rl_zoo3 train's default
    parser.add_argument("-conf", "--conf-file", default=None)
    parser.add_argument("-optimize", "--optimize-hyperparameters", action="store_true")
    parser.add_argument("--storage", default=None)
    known, _ = parser.parse_known_args(args)
    if known.optimize_hyperparameters and known.storage is None:
        print(
            "warning: sb3-influence-zoo train: -optimize without --storage keeps the study in memory: it cannot be resumed, "
            "shared by several workers or watched with optuna-dashboard (only the final report is written). "
            "Pass e.g. --storage logs/study.log --study-name NAME to keep it.",
            file=sys.stderr,
        )
    if known.algo not in DEFAULT_CONFIGS or known.conf_file is not None or known.help:
        return args
    import yaml  # a dependency of rl_zoo3, not of sb3_influence

    path = hyperparams_path(known.algo)
    with open(path) as file:
        env_ids = list(yaml.safe_load(file))
    if known.env not in env_ids:
        raise ValueError(
            f"--env {known.env}: sb3_influence's {known.algo} hyperparameters cover {env_ids}; for another env, "
            "pass your own file with -conf FILE (rl-zoo's yaml format)"
        )
    return [*args, "-conf", path]


def _usage() -> str:
    return (
        f"usage: sb3-influence-zoo {{{','.join(SCRIPTS)}}} [RL_ZOO3 ARGS...]\n"
        f"       sb3-influence-zoo config {{{','.join(CONFIGS)}}}\n\n"
        "Runs rl_zoo3's scripts with --algo influence_ppo available; `train --algo influence_ppo` reads sb3_influence's\n"
        "own hyperparameters unless -conf is given. `config ALGO` prints the path of a shipped hyperparameter file.\n"
        "  sb3-influence-zoo train --algo influence_ppo --env Acrobot-v1\n"
        '  sb3-influence-zoo train --algo ppo --env Acrobot-v1 -conf "$(sb3-influence-zoo config ppo)"\n'
        "`sb3-influence-zoo SCRIPT --help` lists rl_zoo3's flags."
    )


class BrokenDependencyError(RuntimeError):
    """A dependency of the script is installed but does not import (not a missing extra: installing it is no fix)."""


def broken_import(name: str) -> str | None:
    """
    Why an installed module fails to import with an error other than ``ImportError``, or ``None`` when it imports
    or is not installed (rl_zoo3's plots import rliable under ``try``/``except ImportError`` only).

    :param name: A dotted module name.
    :return: ``"ExceptionType: message"``, or ``None``.
    """
    import importlib.util

    try:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            return None
        importlib.import_module(name)
    except ImportError:
        return None
    except Exception as error:  # any other failure at import is what is reported
        return f"{type(error).__name__}: {error}"
    return None


def _run(script: str) -> None:
    module_name, function, uses_algos = SCRIPTS[script]
    if module_name.startswith("rl_zoo3.plots."):
        error = broken_import("rliable.library")
        if error is not None:
            raise BrokenDependencyError(
                f"rl_zoo3's plots import rliable, which is installed here but does not import ({error}); rliable "
                "1.2 needs arch < 8, and arch 7 does not import under pandas 3. Fix: pip install 'pandas<3', or "
                "pip uninstall rliable (rl_zoo3's plots then leave out their rliable figures)"
            )
    if uses_algos:
        register()
    if function is not None:
        getattr(importlib.import_module(module_name), function)()
    else:
        runpy.run_module(module_name, run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    """
    Entry point of ``sb3-influence-zoo`` and ``python -m sb3_influence.zoo``.

    :param argv: ``[script, *rl_zoo3_args]`` or ``["config", algo]`` (default: ``sys.argv[1:]``).
    :return: The exit status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    script, rest = argv[0], argv[1:]
    if script == "config":
        if len(rest) != 1 or rest[0] not in CONFIGS:
            print(f"error: sb3-influence-zoo config: give one of {list(CONFIGS)}, got {rest}", file=sys.stderr)
            return 2
        print(hyperparams_path(rest[0]))
        return 0
    if script not in SCRIPTS:
        print(f"error: sb3-influence-zoo: unknown script {script!r}, use one of {', '.join(SCRIPTS)}", file=sys.stderr)
        return 2
    saved_argv = sys.argv
    try:
        try:
            args = _train_args(rest) if script == "train" else rest
        except ValueError as error:
            print(f"error: sb3-influence-zoo {script}: {error}", file=sys.stderr)
            return 2
        # rl_zoo3's scripts parse sys.argv themselves
        sys.argv = [f"sb3-influence-zoo {script}", *args]
        _run(script)
    except ModuleNotFoundError as error:
        print(missing_module_message(error, f"sb3-influence-zoo {script}", extra="zoo"), file=sys.stderr)
        return 2
    except BrokenDependencyError as error:
        print(f"error: sb3-influence-zoo {script}: {error}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved_argv
    return 0
