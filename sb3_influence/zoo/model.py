"""
``influence_ppo`` as rl-zoo sees it: ``InfluencePPO`` whose IIF settings are constructor arguments.

rl-zoo hands hyperparameters to the algorithm's constructor only: the yaml keys, ``-params`` and every trial of
``-optimize`` (``kwargs.update(sampled_hyperparams)``), while its callbacks are built from the yaml before the trial
samples anything. So the IIF fraction and rule can only be set per run, and tuned, if they are hyperparameters.
"""

from typing import Any, TypeVar

from stable_baselines3.common.callbacks import BaseCallback, CallbackList, ConvertCallback
from stable_baselines3.common.type_aliases import MaybeCallback

from sb3_influence.common.callbacks import IIFCallback
from sb3_influence.common.filters import DROP_RULES
from sb3_influence.influence_ppo import InfluencePPO

SelfZooInfluencePPO = TypeVar("SelfZooInfluencePPO", bound="ZooInfluencePPO")


def _contains_iif(callback: MaybeCallback) -> bool:
    if isinstance(callback, IIFCallback):
        return True
    if isinstance(callback, CallbackList):
        return any(_contains_iif(item) for item in callback.callbacks)
    if isinstance(callback, list):
        return any(_contains_iif(item) for item in callback)
    return False


class ZooInfluencePPO(InfluencePPO):
    """
    ``InfluencePPO`` with IIF (iterative influence-based filtering) as two hyperparameters, registered as
    ``influence_ppo`` by ``sb3-influence-zoo``. With ``iif_fraction`` set, every ``learn()`` puts an
    ``IIFCallback(iif_fraction, rule=iif_rule)`` first in its callbacks: exactly what the yaml entry
    ``callback: [sb3_influence.IIFCallback: {fraction: ...}]`` does, but settable by ``-params`` and tunable by
    ``-optimize``. A new callback is made for every ``learn()``; the model keeps nothing but the two settings
    (saved with it, like ``n_steps``). ``InfluencePPO.load`` reads the saved model too.

    All of ``InfluencePPO``'s parameters are accepted unchanged, plus:

    :param iif_fraction: The fraction ``p`` in ``[0, 1]`` of ``IIFCallback``; ``None`` (default): no filtering.
    :param iif_rule: The drop rule of ``IIFCallback``, one of ``sb3_influence.common.filters.DROP_RULES``.
    :param policy_kwargs_update: Merged into ``policy_kwargs``, its keys winning. The tuning sampler puts the
        network it samples here, so that the yaml's other ``policy_kwargs`` (``optimizer_class=th.optim.SGD``, a
        features extractor, ...) stay; rl-zoo would otherwise replace ``policy_kwargs`` as a whole.
    """

    def __init__(
        self,
        policy: Any,
        env: Any,
        iif_fraction: float | None = None,
        iif_rule: str = "neg-bottom",
        policy_kwargs_update: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        if iif_fraction is not None:
            if isinstance(iif_fraction, bool) or not isinstance(iif_fraction, (int, float)):
                raise TypeError(f"iif_fraction must be a number in [0, 1] or None (no filtering), got {iif_fraction!r}")
            if not 0.0 <= iif_fraction <= 1.0:
                raise ValueError(
                    f"iif_fraction must be in [0, 1] (the share of negative records IIF drops), got {iif_fraction}"
                )
            iif_fraction = float(iif_fraction)
        if iif_rule not in DROP_RULES:
            raise ValueError(f"iif_rule must be one of {sorted(DROP_RULES)}, got {iif_rule!r}")
        if policy_kwargs_update is not None:
            if not isinstance(policy_kwargs_update, dict):
                raise TypeError(f"policy_kwargs_update must be a dict or None, got {policy_kwargs_update!r}")
            kwargs["policy_kwargs"] = {**(kwargs.get("policy_kwargs") or {}), **policy_kwargs_update}
        self.iif_fraction = iif_fraction
        self.iif_rule = iif_rule
        super().__init__(policy, env, **kwargs)

    def learn(
        self: SelfZooInfluencePPO,
        total_timesteps: int,
        callback: MaybeCallback = None,
        *args: Any,
        **kwargs: Any,
    ) -> SelfZooInfluencePPO:
        """
        ``InfluencePPO.learn`` with ``IIFCallback(iif_fraction, rule=iif_rule)`` before ``callback`` when
        ``iif_fraction`` is set.

        :raises ValueError: when ``iif_fraction`` is set and ``callback`` already holds an ``IIFCallback``.
        """
        if self.iif_fraction is not None:
            if _contains_iif(callback):
                raise ValueError(
                    f"influence_ppo has iif_fraction={self.iif_fraction} and its callbacks hold an IIFCallback too: "
                    "that would filter every round twice. Set the filter once: remove the IIFCallback from the yaml "
                    "`callback:` entry (use iif_fraction / iif_rule), or remove iif_fraction."
                )
            iif = IIFCallback(self.iif_fraction, rule=self.iif_rule)
            if callback is None:
                callback = [iif]
            elif isinstance(callback, list):
                callback = [iif, *callback]
            elif isinstance(callback, BaseCallback):
                callback = [iif, callback]
            else:  # a plain function, as SB3 accepts
                callback = [iif, ConvertCallback(callback)]
        return super().learn(total_timesteps, callback, *args, **kwargs)
