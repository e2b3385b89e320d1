"""
Callbacks that take part in the influence round: ``IIFCallback`` filters, ``AttributionCallback`` observes.

They are thin: the model runs the round (see :mod:`sb3_influence.common.round`). After each rollout it asks every
participant of the current ``learn()`` call which scores it needs, computes each distinct one once at θ(k), lets
the filters drop records in the order they were given, then hands the round to the observers, whose snapshots and
logs therefore see the final keep mask. Callbacks keep no state shared with other callbacks or other models.
"""

import os
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np
from stable_baselines3.common.callbacks import BaseCallback

from sb3_influence.common.files import make_folder
from sb3_influence.common.filters import DropRule, resolve_drop_rule, takes_sizes
from sb3_influence.common.round import InfluenceModel, InfluenceRound, ScoreRequest, as_optimizer_aware, check_unrolled_options
from sb3_influence.common.stats import pearson
from sb3_influence.common.snapshots import (
    claim_save_dir,
    record_arrays,
    remove_orphaned_temp_files,
    save_snapshot,
    snapshot_metadata,
    snapshot_path,
)
from sb3_influence.common.targets import Target, as_target, check_target
from sb3_influence.common.units import check_budget, check_unit, to_records, trajectory_sums

# Only for logs: rich types (histograms) go to TensorBoard
_TENSORBOARD_ONLY = ("stdout", "log", "json", "csv")


class RoundCallback(BaseCallback):
    """
    Base class of the callbacks that take part in an influence algorithm's round (a
    :class:`~sb3_influence.common.round.RoundParticipant`). Subclasses set ``round_role`` and implement
    :meth:`score_requests` and :meth:`on_round`. Attaching one to a model that has no round (plain ``PPO``)
    raises at ``_init_callback``.
    """

    round_role: Literal["filter", "observer"] = "observer"
    model: Any

    def _init_callback(self) -> None:
        if not isinstance(self.model, InfluenceModel):
            raise TypeError(
                f"{type(self).__name__} needs an influence algorithm (it reads influence scores and the keep mask "
                f"of its rollout buffer), got {type(self.model).__name__}. Use sb3_influence.InfluencePPO instead of "
                f"{type(self.model).__name__}: it takes the same arguments as PPO."
            )

    def _on_step(self) -> bool:
        return True

    def score_requests(self, round_: InfluenceRound) -> Sequence[ScoreRequest]:
        """
        The scores this callback needs in ``round_`` (computed once by the model, shared by all participants).

        :param round_: The round.
        :return: The requests (empty: none).
        """
        return ()

    def on_round(self, round_: InfluenceRound) -> None:
        """
        Act on the round (filters: ``model.drop_records``; observers: log, save, analyse).

        :param round_: The round, with its scores.
        """
        raise NotImplementedError

    def after_update(self, round_: InfluenceRound) -> None:
        """
        Called after the round's update, when in-run scores are ready (nothing by default).

        :param round_: The round.
        """


class IIFCallback(RoundCallback):
    """
    Iterative influence-based filtering (IIF, the paper's Sec. 5): every round, score the records against a
    target at θ(k) and drop the ones the rule selects before the PPO update. Needs an ``InfluencePPO``.

    Rules (see :mod:`sb3_influence.common.filters`), with ``n`` records of which ``n_neg`` have a negative score:

    - ``"neg-bottom"`` (the paper's): drop the ``floor(fraction · n_neg)`` most negative records;
    - ``"neg"``: drop every negative record (``fraction`` is ignored);
    - ``"bottom"`` / ``"top"``: drop the ``floor(fraction · n)`` lowest / highest-scored records;
    - ``"random"``: baseline, drop ``floor(fraction · n_neg)`` records drawn uniformly among all;
    - ``"neg-random"``: baseline, drop ``floor(fraction · n_neg)`` records drawn uniformly among the negative ones;
    - ``"uniform"``: baseline, drop ``floor(fraction · n)`` records drawn uniformly among all;
    - or any callable ``rule(scores, fraction, rng) -> drop mask`` of your own (see ``DropRule``).

    The random rules draw from a generator seeded with the model's seed and the round index, never from numpy's
    global RNG (which PPO uses for its minibatches), so random-drop runs are reproducible. With ``fraction=0``
    (any rule but ``"neg"``) nothing is dropped and training is bit-identical to ``PPO``.
    Logs ``iif/kept_fraction``, ``iif/n_dropped``, ``iif/n_negative`` and ``iif/round``.

    :param fraction: The fraction ``p`` in ``[0, 1]`` (0.5 FrozenLake/Acrobot, 0.125 MiniGrid/LunarLander,
        0.0625 BipedalWalker in the paper).
    :param target: What the records are scored against: ``"return"`` (the paper's) or a ``Target``.
    :param rule: The drop rule: a name of :data:`~sb3_influence.common.filters.DROP_RULES` or a ``DropRule``.
    :param optimizer_aware: Rank records by the optimizer-aware score instead of the paper's single-checkpoint SGD
        proxy: ``True`` (in-run score, by replaying the update before the real one: about twice the update's cost)
        or ``"unrolled"`` (through the whole update, the most faithful under Adam: about 5x).
    :param n_orders: With ``optimizer_aware="unrolled"``: average the score over this many minibatch orders (the
        real update's first; each costs one more replay).
    :param clip_smoothing: With ``optimizer_aware="unrolled"``: soften PPO's ratio clip in the replay to a softplus of
        this width (``3e-2`` with ``n_orders=4`` predicted removals best under SB3's Adam, see the faithfulness page).
    :param unit: ``"record"``: the rule ranks records. ``"trajectory"``: the rule ranks the buffer's trajectories
        by the sum of their records' scores and whole trajectories are dropped (see
        :mod:`sb3_influence.common.units`); ``n_neg`` and ``iif/n_negative`` then count trajectories
        (``iif/n_dropped`` still counts records).
    :param budget: How ``fraction`` sizes a trajectory drop (with ``unit="record"`` a unit is a record, so both
        budgets are the same). ``"records"`` (the default): in records, as with ``unit="record"``: ``"neg-bottom"``
        drops the most negative trajectories until they hold at least ``floor(fraction · n)`` records, ``n`` the
        records of the negative trajectories (the last trajectory may overshoot). ``"units"``: in trajectories,
        ``floor(fraction · n_neg)`` trajectories, which is 0 whenever a round has fewer than ``1 / fraction`` negative
        trajectories. A rule of your own needs a ``sizes`` keyword for ``"records"`` (see
        :mod:`sb3_influence.common.filters`).
    :param verbose: Verbosity level: 0 no output, 1 one line per round.
    """

    round_role = "filter"

    def __init__(
        self,
        fraction: float = 0.125,
        target: str | Target = "return",
        rule: str | DropRule = "neg-bottom",
        optimizer_aware: bool | str = False,
        unit: str = "record",
        budget: str = "records",
        verbose: int = 0,
        n_orders: int = 1,
        clip_smoothing: float = 0.0,
    ):
        super().__init__(verbose)
        self.unit = check_unit(unit, "IIFCallback")
        self.budget = check_budget(budget, "IIFCallback")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float, np.integer, np.floating)):
            raise TypeError(f"IIFCallback: fraction must be a number in [0, 1], got {fraction!r}")
        if not 0.0 <= float(fraction) <= 1.0:
            raise ValueError(
                f"IIFCallback: fraction must be in [0, 1] (the share of negative records to drop), got {fraction}"
            )
        self.fraction = float(fraction)
        self.target = as_target(target)
        self.rule = rule
        self._drop_rule = resolve_drop_rule(rule, owner="IIFCallback")
        if self.sized and not takes_sizes(self._drop_rule):
            raise ValueError(
                f"IIFCallback: rule {rule!r} takes no `sizes` keyword, which unit='trajectory' with budget='records' "
                "passes (the records of each trajectory); add `sizes=None` to its signature, or pass budget='units'"
            )
        try:
            optimizer_aware = as_optimizer_aware(optimizer_aware)
            check_unrolled_options(optimizer_aware, n_orders, clip_smoothing)
        except ValueError as error:
            raise ValueError(f"IIFCallback: {error}") from None
        self.optimizer_aware = optimizer_aware
        self.n_orders = int(n_orders)
        self.clip_smoothing = float(clip_smoothing)
        self.request = ScoreRequest(
            self.target,
            "multi" if optimizer_aware else "single",
            optimizer_aware=optimizer_aware,
            n_orders=self.n_orders,
            clip_smoothing=self.clip_smoothing,
        )
        self.last_drop: np.ndarray | None = None

    @property
    def settings(self) -> dict[str, Any]:
        """What this filter does, as recorded in snapshots: fraction, rule and target."""
        rule = self.rule if isinstance(self.rule, str) else getattr(self.rule, "__name__", repr(self.rule))
        return {
            "fraction": self.fraction,
            "rule": rule,
            "target": self.target.name,
            "optimizer_aware": self.optimizer_aware,
            "n_orders": self.n_orders,
            "clip_smoothing": self.clip_smoothing,
            "unit": self.unit,
            "budget": self.budget,
        }

    @property
    def sized(self) -> bool:
        """Whether the rule is given the records per unit (trajectories budgeted in records)."""
        return self.unit == "trajectory" and self.budget == "records"

    def _init_callback(self) -> None:
        super()._init_callback()
        seed = self.model.seed
        # Without a model seed the random baselines are still independent of numpy's global RNG
        if seed is None:
            seed = int(np.random.SeedSequence().generate_state(1, np.uint64)[0])
        self._seed_entropy = int(seed) % 2**63
        check_target(self.target, self.model.observation_space, self.model.action_space)
        self.model.check_optimizer_aware(self.optimizer_aware)

    def round_rng(self, round_: InfluenceRound) -> np.random.Generator:
        """The generator of the random rules for a round (model seed + round index)."""
        return np.random.default_rng([self._seed_entropy, round_.index])

    def score_requests(self, round_: InfluenceRound) -> Sequence[ScoreRequest]:
        return [self.request]

    def unit_scores(self, round_: InfluenceRound) -> np.ndarray:
        """
        The scores the rule ranks this round: flat by record id, or by trajectory id with ``unit="trajectory"``.

        :param round_: The round, with its scores.
        :return: Flat float array.
        """
        buffer = self.model.rollout_buffer
        scores = buffer.to_flat(round_.score(self.request))
        return trajectory_sums(scores, buffer.trajectory_ids()) if self.unit == "trajectory" else scores

    def on_round(self, round_: InfluenceRound) -> None:
        buffer = self.model.rollout_buffer
        scores = self.unit_scores(round_)
        rng = self.round_rng(round_)
        trajectory_ids = buffer.trajectory_ids() if self.unit == "trajectory" else None
        if self.sized and trajectory_ids is not None:
            sizes = np.bincount(trajectory_ids, minlength=len(scores))
            drop = self._drop_rule(scores, self.fraction, rng, sizes=sizes)
        else:
            drop = self._drop_rule(scores, self.fraction, rng)
        if trajectory_ids is not None:
            drop = to_records(drop, trajectory_ids)
        drop = buffer.to_records(drop)
        n_dropped = self.model.drop_records(drop, source={"filter": type(self).__name__, **self.settings})
        self.last_drop = drop
        kept_fraction = float(np.mean(buffer.keep))
        self.logger.record("iif/kept_fraction", kept_fraction)
        self.logger.record("iif/n_dropped", n_dropped)
        self.logger.record("iif/n_negative", int(np.count_nonzero(scores < 0)))
        self.logger.record("iif/round", round_.index)
        if self.verbose >= 1:
            print(f"IIF round {round_.index}: dropped {n_dropped} records ({self.settings['rule']}), kept {kept_fraction:.3f}")


class AttributionCallback(RoundCallback):
    """
    Score every record of a round against one or more targets, log statistics and (optionally) write one
    attribution snapshot per round (see :mod:`sb3_influence.common.snapshots`). Needs an ``InfluencePPO``.

    Logs, per target: ``influence/<target>/mean``, ``/std``, ``/min``, ``/max``, ``/frac_negative``,
    ``/corr_advantage`` (Pearson correlation with the raw advantage) and ``/hist`` (a histogram of the scores,
    TensorBoard only), and ``influence/round``. Snapshots are named
    ``<save_dir>/<name_prefix>_round<round, 6 digits>_<num_timesteps>_steps.npz`` (so ``ls`` lists them in round
    order) and written atomically; their ``keep`` is the mask after every filter of the round acted, and their
    metadata records each filter's settings.

    :param targets: The targets: ``"return"`` and/or ``Target`` objects with distinct names.
    :param save_dir: Folder for the snapshots (created if needed); ``None``: log only.
    :param every: Score every ``every`` rounds (rounds 0, every, 2·every, ...).
    :param name_prefix: File name prefix of the snapshots.
    :param log_histogram: Log a histogram of the scores to TensorBoard.
    :param optimizer_aware: ``True``: score with the optimizer-aware in-run influence, computed during the round's
        real update from its own forward and backward passes (no replay); logs and the snapshot then come after the
        update. ``"unrolled"``: the hypergradient through the whole update (by replay, before the update).
    :param verbose: Verbosity level: 0 no output, 1 one line per snapshot.
    :param overwrite: When ``save_dir`` already holds snapshots of another run (another ``model.run_id``, or this
        run with another ``n_envs``, ``n_steps`` or ``name_prefix``), delete those snapshot files instead of
        raising. Snapshots of the same run are never overwritten without it: a resumed model continues its round
        numbering after them.
    :param n_orders: With ``optimizer_aware="unrolled"``: average the score over this many minibatch orders (the
        real update's first; each costs one more replay).
    :param clip_smoothing: With ``optimizer_aware="unrolled"``: soften PPO's ratio clip in the replay to a softplus of
        this width (see the faithfulness page). The snapshots' metadata records the scorer (``"scorer"``).
    """

    round_role = "observer"

    def __init__(
        self,
        targets: Iterable[str | Target] | str | Target = ("return",),
        save_dir: str | os.PathLike | None = None,
        every: int = 1,
        name_prefix: str = "snapshot",
        log_histogram: bool = True,
        optimizer_aware: bool | str = False,
        verbose: int = 0,
        overwrite: bool = False,
        n_orders: int = 1,
        clip_smoothing: float = 0.0,
    ):
        super().__init__(verbose)
        try:
            optimizer_aware = as_optimizer_aware(optimizer_aware)
            check_unrolled_options(optimizer_aware, n_orders, clip_smoothing)
        except ValueError as error:
            raise ValueError(f"AttributionCallback: {error}") from None
        self.optimizer_aware = optimizer_aware
        self.n_orders = int(n_orders)
        self.clip_smoothing = float(clip_smoothing)
        if isinstance(targets, (str, Target)):
            targets = [targets]
        self.targets = [as_target(target) for target in targets]
        if not self.targets:
            raise ValueError("AttributionCallback: targets is empty, give at least one (e.g. targets=('return',))")
        names = [target.name for target in self.targets]
        if len(set(names)) != len(names):
            raise ValueError(
                f"AttributionCallback: target names must be distinct (they name log keys and columns), got {names}"
            )
        if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
            raise ValueError(f"AttributionCallback: every must be a positive int (score every `every` rounds), got {every!r}")
        if save_dir is not None and not isinstance(save_dir, (str, os.PathLike)):
            raise TypeError(f"AttributionCallback: save_dir must be a folder path or None, got {type(save_dir).__name__}")
        if not isinstance(name_prefix, str) or not name_prefix or os.sep in name_prefix:
            raise ValueError(f"AttributionCallback: name_prefix must be a non-empty file name prefix, got {name_prefix!r}")
        if not isinstance(overwrite, bool):
            raise TypeError(f"AttributionCallback: overwrite must be True or False, got {overwrite!r}")
        self.save_dir = _check_save_dir(os.fspath(save_dir)) if save_dir is not None else None
        self.overwrite = overwrite
        self._written: dict[int, str] = {}
        self.every = int(every)
        self.name_prefix = name_prefix
        self.log_histogram = log_histogram
        self.scores: dict[str, np.ndarray] = {}
        self.last_path: str | None = None

    def _init_callback(self) -> None:
        super()._init_callback()
        for target in self.targets:
            check_target(target, self.model.observation_space, self.model.action_space)
        self.model.check_optimizer_aware(self.optimizer_aware)
        if self.save_dir is not None:
            make_folder(self.save_dir, "AttributionCallback")
            remove_orphaned_temp_files(self.save_dir)
            self._written = claim_save_dir(self.save_dir, self.model.run_id, self._layout(), overwrite=self.overwrite)
            # Rounds this model has not reached yet were written by another branch of the run (an older save resumed)
            later = sorted(index for index in self._written if index >= self.model.n_rounds)
            if later and not self.overwrite:
                raise ValueError(
                    f"AttributionCallback: save_dir {self.save_dir!r} already holds round(s) {later} of this run, which "
                    f"this model has not reached (n_rounds={self.model.n_rounds}): it was loaded from a save older than "
                    "those snapshots, so the two trainings would mix. Give it a new save_dir, or pass overwrite=True "
                    "to delete those rounds"
                )
            for index in later:
                os.remove(self._written.pop(index))

    def _layout(self) -> dict[str, Any]:
        """
        What makes this writer's snapshots one run with the folder's: the buffer's layout, the name prefix and the
        scorer (one ``influence/<target>`` column must not mix scores of different scorers).
        """
        return {
            "n_envs": int(self.model.n_envs),
            "n_steps": int(self.model.n_steps),
            "name_prefix": self.name_prefix,
            "scorer": self.scorer,
        }

    def score_requests(self, round_: InfluenceRound) -> Sequence[ScoreRequest]:
        if round_.index % self.every != 0:
            return ()
        if self.optimizer_aware is True:
            return [ScoreRequest(target, "multi", optimizer_aware=True, in_run=True) for target in self.targets]
        if self.optimizer_aware == "unrolled":
            return [
                ScoreRequest(
                    target, "multi", optimizer_aware="unrolled", n_orders=self.n_orders, clip_smoothing=self.clip_smoothing
                )
                for target in self.targets
            ]
        return [ScoreRequest(target) for target in self.targets]

    @property
    def scorer(self) -> dict[str, Any]:
        """The scorer of the snapshots, as their metadata records it."""
        scorer: dict[str, Any] = {"optimizer_aware": self.optimizer_aware}
        if self.optimizer_aware == "unrolled":
            scorer.update(n_orders=self.n_orders, clip_smoothing=self.clip_smoothing)
        return scorer

    def _log(self, round_: InfluenceRound) -> None:
        advantages = self.model.rollout_buffer.to_records(self.model.rollout_buffer.flat_field("advantages"))
        self.logger.record("influence/round", round_.index)
        for name, scores in self.scores.items():
            prefix = f"influence/{name}"
            self.logger.record(f"{prefix}/mean", float(scores.mean()))
            self.logger.record(f"{prefix}/std", float(scores.std()))
            self.logger.record(f"{prefix}/min", float(scores.min()))
            self.logger.record(f"{prefix}/max", float(scores.max()))
            self.logger.record(f"{prefix}/frac_negative", float(np.mean(scores < 0)))
            self.logger.record(f"{prefix}/corr_advantage", pearson(scores, advantages))
            if self.log_histogram:
                self.logger.record(f"{prefix}/hist", scores.ravel().astype(np.float32), exclude=_TENSORBOARD_ONLY)

    def on_round(self, round_: InfluenceRound) -> None:
        if self.optimizer_aware is not True:
            self._report(round_)

    def after_update(self, round_: InfluenceRound) -> None:
        if self.optimizer_aware is True:
            # In-run scores exist only once the update ran
            self._report(round_)

    def _report(self, round_: InfluenceRound) -> None:
        requests = self.score_requests(round_)
        self.scores = {request.target.name: round_.score(request) for request in requests}
        if not self.scores:
            return
        self._log(round_)
        if self.save_dir is None:
            return
        arrays = record_arrays(self.model, round_)
        for name, scores in self.scores.items():
            arrays[f"influence/{name}"] = scores
        path = snapshot_path(self.save_dir, self.name_prefix, round_.index, self.model.num_timesteps)
        earlier = self._written.get(round_.index)
        if earlier is not None and os.path.exists(earlier):
            if not self.overwrite:
                raise ValueError(
                    f"AttributionCallback: save_dir already holds round {round_.index} of this run ({earlier}): this "
                    "model was loaded from a save older than the snapshots there, so the two trainings would mix. Give "
                    "it a new save_dir, or pass overwrite=True to replace the later rounds"
                )
            os.remove(earlier)
        filters = [source for source, _ in round_.drops]
        extra = {"filters": filters, "name_prefix": self.name_prefix, "scorer": self.scorer}
        save_snapshot(path, arrays, snapshot_metadata(self.model, list(self.scores), extra=extra))
        self._written[round_.index] = path
        self.last_path = path
        if self.verbose >= 1:
            print(f"Saving attribution snapshot to {path}")


def _check_save_dir(save_dir: str) -> str:
    """A folder that exists, or that can be created: name the problem now rather than at the first snapshot."""
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise ValueError(f"AttributionCallback: save_dir {save_dir!r} is a file, not a folder: give a folder path")
    parent = os.path.abspath(save_dir)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(
            f"AttributionCallback: save_dir {save_dir!r} cannot be created: {parent!r} is a file, not a folder. Give "
            "another folder path"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(
            f"AttributionCallback: save_dir {save_dir!r} is not writable ({parent!r} denies writing): give a folder "
            "you can write to"
        )
    return save_dir
