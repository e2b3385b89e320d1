"""
rl-zoo support: the ``sb3-influence-zoo`` launcher, ``influence_ppo`` as rl-zoo's algorithm, its tuning search space
and the paper's hyperparameter files (package data in ``sb3_influence/zoo/hyperparams/``).

::

    sb3-influence-zoo train --algo influence_ppo --env Acrobot-v1            # the paper's settings, IIF p = 0.5
    sb3-influence-zoo train --algo ppo --env Acrobot-v1 -conf "$(sb3-influence-zoo config ppo)"   # the baseline
    sb3-influence-zoo train --algo influence_ppo --env CartPole-v1 -optimize --storage logs/study.log --study-name iif

Every rl_zoo3 flag works (``-n``, ``-params``, ``-tb``, ``--vec-env subproc``, ``-optimize``, ...). ``iif_fraction``
and ``iif_rule`` are hyperparameters of ``influence_ppo`` (see :class:`~sb3_influence.zoo.model.ZooInfluencePPO`);
the yaml ``callback:`` key takes our other callbacks with keyword arguments, as rl-zoo's ``get_callback_list``
parses them. ``policy_kwargs`` strings (evaluated by rl-zoo) may name ``th``, ``nn``, ``sb3_influence`` and
``MiniGridCNN``. Importing this package does not import rl_zoo3.
"""

from sb3_influence.zoo.launcher import hyperparams_path, main, register
from sb3_influence.zoo.model import ZooInfluencePPO

__all__ = ["ZooInfluencePPO", "hyperparams_path", "main", "register"]
