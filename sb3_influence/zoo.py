"""
The rl-zoo launcher: rl_zoo3's own ``train`` / ``enjoy`` scripts with ``influence_ppo`` registered.

::

    python -m sb3_influence.zoo train --algo influence_ppo --env Acrobot-v1 -conf zoo_configs/influence_ppo.yml
    sb3-influence-zoo train --algo ppo --env Acrobot-v1 -conf zoo_configs/ppo.yml   # the matching baseline

Every rl_zoo3 ``train`` flag works (``-n``, ``-params``, ``-tb``, ``--vec-env subproc``, ``-optimize``, ...). The
yaml ``callback:`` key takes our callbacks with keyword arguments, as rl-zoo's ``get_callback_list`` parses them::

    callback:
      - sb3_influence.IIFCallback:
          fraction: 0.5
      - sb3_influence.AttributionCallback:
          save_dir: snapshots/acrobot

``policy_kwargs`` strings (evaluated by rl-zoo) may name ``th``, ``nn``, ``sb3_influence`` and ``MiniGridCNN``.
"""

import sys
from collections.abc import Callable

ALGO_NAME = "influence_ppo"
SCRIPTS = ("train", "enjoy")


def register() -> None:
    """
    Register ``influence_ppo`` with rl_zoo3 (idempotent): the algorithm in ``ALGOS``, PPO's optuna sampler and
    converter for ``-optimize``, and the names ``sb3_influence`` / ``MiniGridCNN`` for ``policy_kwargs`` strings.
    """
    from rl_zoo3 import exp_manager, hyperparams_opt, utils

    import sb3_influence
    from sb3_influence import InfluencePPO, MiniGridCNN

    # rl_zoo3's modules share these dicts (`from ... import ALGOS`), so adding a key is seen everywhere
    utils.ALGOS[ALGO_NAME] = InfluencePPO
    # InfluencePPO takes every PPO hyperparameter: tune it with PPO's search space
    hyperparams_opt.HYPERPARAMS_SAMPLER[ALGO_NAME] = hyperparams_opt.sample_ppo_params
    hyperparams_opt.HYPERPARAMS_CONVERTER[ALGO_NAME] = hyperparams_opt.convert_onpolicy_params
    # rl-zoo evaluates `policy_kwargs: "dict(...)"` in the namespace of its exp_manager module
    namespace = vars(exp_manager)
    namespace.setdefault("sb3_influence", sb3_influence)
    namespace.setdefault("MiniGridCNN", MiniGridCNN)


def _scripts() -> dict[str, Callable[[], None]]:
    try:
        from rl_zoo3.enjoy import enjoy
        from rl_zoo3.train import train
    except ImportError as error:
        raise ImportError(
            "sb3_influence.zoo needs rl_zoo3: install it with `pip install rl_zoo3` or `pip install sb3_influence[zoo]`"
        ) from error
    return {"train": train, "enjoy": enjoy}


def _usage() -> str:
    return (
        "usage: sb3-influence-zoo {train,enjoy} [RL_ZOO3 ARGS...]\n\n"
        "Runs rl_zoo3's train/enjoy with --algo influence_ppo available, e.g.\n"
        "  sb3-influence-zoo train --algo influence_ppo --env Acrobot-v1 -conf zoo_configs/influence_ppo.yml\n"
        "`sb3-influence-zoo train --help` lists rl_zoo3's flags."
    )


def main(argv: list[str] | None = None) -> int:
    """
    Entry point of ``sb3-influence-zoo`` and ``python -m sb3_influence.zoo``.

    :param argv: ``[script, *rl_zoo3_args]`` (default: ``sys.argv[1:]``).
    :return: The exit status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    script, rest = argv[0], argv[1:]
    if script not in SCRIPTS:
        print(f"sb3-influence-zoo: unknown script {script!r}, use one of {list(SCRIPTS)}\n\n{_usage()}", file=sys.stderr)
        return 2
    scripts = _scripts()
    register()
    # rl_zoo3's scripts parse sys.argv themselves
    saved_argv = sys.argv
    sys.argv = [f"sb3-influence-zoo {script}", *rest]
    try:
        scripts[script]()
    finally:
        sys.argv = saved_argv
    return 0


if __name__ == "__main__":
    sys.exit(main())
