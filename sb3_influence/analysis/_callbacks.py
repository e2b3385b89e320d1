"""What the analysis callbacks share: observe chosen rounds of an influence algorithm's training."""

from collections.abc import Iterable

import numpy as np

from sb3_influence.common.callbacks import RoundCallback
from sb3_influence.common.round import InfluenceRound


class AnalysisCallback(RoundCallback):
    """
    An observer of the round (after every filter acted, before the update) that calls ``_on_round(index)`` at
    the chosen rounds; the parameters are θ(k) and the buffer holds round k.

    :param rounds: Rounds to act at, numbered as the snapshots' ``round`` (the first rollout is round 0);
        ``None``: every round.
    :param verbose: Verbosity level.
    """

    round_role = "observer"

    def __init__(self, rounds: Iterable[int] | None = None, verbose: int = 0):
        super().__init__(verbose)
        if rounds is not None:
            rounds = list(rounds)
            if not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) and r >= 0 for r in rounds):
                raise ValueError(f"rounds must be a list of non-negative ints (0 = the first rollout) or None, got {rounds!r}")
        self.rounds = None if rounds is None else {int(r) for r in rounds}

    def on_round(self, round_: InfluenceRound) -> None:
        if self.rounds is None or round_.index in self.rounds:
            self._on_round(round_.index)

    def _on_round(self, index: int) -> None:
        raise NotImplementedError
