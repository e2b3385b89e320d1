"""
DTV-Loo: drop the trajectories whose loss gradient opposes the leave-one-out consensus of the others.

No validation target: each trajectory t of the round is compared with the mean gradient of the other ``T − 1``
trajectories, ``s_t = ⟨g_t, (G − g_t)/(T − 1)⟩ = (⟨g_t, G⟩ − ‖g_t‖²)/(T − 1)`` with ``g_t`` the gradient of its
records' policy losses and ``G = Σ_t g_t`` (see :mod:`sb3_influence.common.scoring.trajectory`). A negative
``s_t`` means following t moves the parameters against what the rest of the rollout asks for.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from sb3_influence.common import sb3_compat
from sb3_influence.common.callbacks import IIFCallback
from sb3_influence.common.filters import DropRule
from sb3_influence.common.round import InfluenceRound, ScoreRequest
from sb3_influence.common.scoring.trajectory import LossTarget, trajectory_sq_norms
from sb3_influence.common.state import training_state


@contextmanager
def _at_round_start(model: Any) -> Iterator[None]:
    """The model at θ(k) of its current round (put back as it was afterwards if the update already ran)."""
    round_ = model.current_round()
    if sb3_compat.n_updates(model) == round_.start_state.n_updates:
        yield
        return
    with training_state(model):
        round_.start_state.restore(model, keep=False)
        yield


def dtv_loo_scores(model: Any, batch_size: int | None = None) -> np.ndarray:
    """
    The DTV-Loo score of every trajectory of the current round's buffer, at θ(k):
    ``s_t = (⟨g_t, G⟩ − ‖g_t‖²)/(T − 1)``, over all the buffer's records (0 for every trajectory when ``T = 1``).

    :param model: An influence algorithm of this package with a full rollout buffer.
    :param batch_size: Records per chunk (default: the model's ``influence_batch_size``); scores do not depend
        on it.
    :return: Float64 array indexed by trajectory id (``model.rollout_buffer.trajectory_ids()`` maps records to it).
    """
    batch_size = model.influence_batch_size if batch_size is None else batch_size
    buffer = model.rollout_buffer
    trajectory_ids = buffer.trajectory_ids()
    n_trajectories = int(trajectory_ids.max()) + 1
    if n_trajectories < 2:
        return np.zeros(n_trajectories)
    with _at_round_start(model):
        advantages = buffer.to_flat(model.training_advantages())
        # Σ_{i∈t} ⟨∇ℓ_i, G⟩ = ⟨g_t, G⟩: the engine's influence on the round's own (negated) loss
        alignment = model.compute_influence(LossTarget(advantages), batch_size=batch_size, unit="trajectory")
        sq_norms = trajectory_sq_norms(model.influence_engine, advantages, trajectory_ids, batch_size)
    return (alignment - sq_norms) / (n_trajectories - 1)


class DTVLooCallback(IIFCallback):
    """
    A round filter: score the trajectories with :func:`dtv_loo_scores` at θ(k) and drop whole trajectories with
    the rule (default ``"neg-bottom"``: the trajectories opposing the consensus, most
    opposed first, until they hold at least ``floor(fraction · n)`` records, ``n`` the records of the opposing
    trajectories; with ``budget="units"``, ``floor(fraction · n_neg)`` trajectories). Needs an influence algorithm
    of this package. Logs as ``IIFCallback`` does (``iif/...``; ``iif/n_negative`` counts trajectories).

    :param fraction: The fraction ``p`` in ``[0, 1]``.
    :param rule: The drop rule (a name of :data:`~sb3_influence.common.filters.DROP_RULES` or a ``DropRule``),
        applied to the trajectory scores.
    :param budget: ``"records"`` or ``"units"``: how ``fraction`` sizes the drop (see ``IIFCallback``).
    :param verbose: Verbosity level: 0 no output, 1 one line per round.
    """

    def __init__(
        self, fraction: float = 0.125, rule: str | DropRule = "neg-bottom", budget: str = "records", verbose: int = 0
    ):
        super().__init__(fraction=fraction, rule=rule, unit="trajectory", budget=budget, verbose=verbose)

    @property
    def settings(self) -> dict[str, Any]:
        """What this filter does, as recorded in snapshots: fraction, rule, scorer and unit."""
        settings = dict(super().settings)
        settings.pop("target")
        for scorer_option in ("optimizer_aware", "n_orders", "clip_smoothing"):
            settings.pop(scorer_option)
        settings["scorer"] = "dtv-loo"
        return settings

    def score_requests(self, round_: InfluenceRound) -> Sequence[ScoreRequest]:
        return ()

    def unit_scores(self, round_: InfluenceRound) -> np.ndarray:
        return dtv_loo_scores(self.model)
