"""What the analysis callbacks share: run ``_on_round`` at the end of chosen rollouts of an InfluencePPO training."""

from collections.abc import Iterable

import numpy as np
from stable_baselines3.common.callbacks import BaseCallback

from sb3_influence.common.snapshots import round_index


class RoundCallback(BaseCallback):
    """
    Calls ``_on_round(round)`` in ``_on_rollout_end`` (after GAE, before the update) at the chosen rounds.

    :param rounds: Rounds to act at, numbered as the snapshots' ``round`` (the first rollout is round 0);
        ``None``: every round.
    :param verbose: Verbosity level.
    """

    def __init__(self, rounds: Iterable[int] | None = None, verbose: int = 0):
        super().__init__(verbose)
        if rounds is not None:
            rounds = list(rounds)
            if not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) and r >= 0 for r in rounds):
                raise ValueError(f"rounds must be a list of non-negative ints (0 = the first rollout) or None, got {rounds!r}")
        self.rounds = None if rounds is None else {int(r) for r in rounds}

    def _init_callback(self) -> None:
        from sb3_influence.influence_ppo import InfluencePPO

        if not isinstance(self.model, InfluencePPO):
            raise TypeError(
                f"{type(self).__name__} needs an InfluencePPO model, got {type(self.model).__name__}: "
                "use sb3_influence.InfluencePPO (same arguments as PPO)"
            )

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        index = round_index(self.model)  # type: ignore[arg-type]
        if self.rounds is None or index in self.rounds:
            self._on_round(index)

    def _on_round(self, index: int) -> None:
        raise NotImplementedError
