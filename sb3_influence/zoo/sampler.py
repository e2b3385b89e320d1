"""
The ``-optimize`` search space of ``influence_ppo``: rl-zoo's PPO space plus the IIF fraction and rule.

rl-zoo calls the sampler with the trial only (it never sees the yaml) and does
``kwargs.update(sampled_hyperparams)``, which would replace the yaml's ``policy_kwargs`` as a whole. The network
rl-zoo's PPO space samples (``net_arch``, ``activation_fn``) is therefore returned as ``policy_kwargs_update``,
which ``ZooInfluencePPO`` merges into the yaml's ``policy_kwargs``: ``optimizer_class=th.optim.SGD`` and any
other key the search space does not name stay.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import optuna

#: The drop rules the sampler chooses from: the ones that rank records by their scores (see
#: :mod:`sb3_influence.common.filters`). The random rules are baselines for experiments, not candidates to tune.
IIF_RULES = ("neg-bottom", "bottom", "neg")


def _to_zoo_kwargs(hyperparams: dict[str, Any]) -> dict[str, Any]:
    hyperparams = dict(hyperparams)
    hyperparams["policy_kwargs_update"] = hyperparams.pop("policy_kwargs")
    return hyperparams


def sample_influence_ppo_params(
    trial: "optuna.Trial", n_actions: int, n_envs: int, additional_args: dict[str, Any]
) -> dict[str, Any]:
    """
    Sample ``influence_ppo`` hyperparameters: rl-zoo's ``sample_ppo_params`` plus ``iif_fraction`` (uniform in
    ``[0, 1]``; 0 keeps every record) and ``iif_rule`` (categorical over :data:`IIF_RULES`).

    :param trial: The optuna trial.
    :param n_actions: Passed on to rl-zoo's PPO sampler.
    :param n_envs: Passed on to rl-zoo's PPO sampler.
    :param additional_args: Passed on to rl-zoo's PPO sampler.
    :return: ``ZooInfluencePPO`` keyword arguments (the network in ``policy_kwargs_update``).
    """
    from rl_zoo3.hyperparams_opt import sample_ppo_params

    hyperparams = _to_zoo_kwargs(sample_ppo_params(trial, n_actions, n_envs, additional_args))
    hyperparams["iif_fraction"] = trial.suggest_float("iif_fraction", 0.0, 1.0)
    hyperparams["iif_rule"] = trial.suggest_categorical("iif_rule", IIF_RULES)
    return hyperparams


def convert_influence_ppo_params(sampled_params: dict[str, Any]) -> dict[str, Any]:
    """
    Turn a finished trial's ``params`` back into ``ZooInfluencePPO`` keyword arguments (rl-zoo's ``--trial-id``).

    :param sampled_params: The trial's ``params``: rl-zoo's PPO ones plus ``iif_fraction`` and ``iif_rule``.
    :return: ``ZooInfluencePPO`` keyword arguments (the network in ``policy_kwargs_update``).
    """
    from rl_zoo3.hyperparams_opt import convert_onpolicy_params

    # rl-zoo's converter passes keys it does not know (iif_fraction, iif_rule) through unchanged
    return _to_zoo_kwargs(convert_onpolicy_params(sampled_params))
