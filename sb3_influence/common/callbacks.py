"""
Callbacks that score every round's records (``AttributionCallback``) and filter them (``IIFCallback``).

Both act in ``_on_rollout_end``: after GAE, before ``train()``. Whatever order they are given in, one round goes:

1. every attached callback computes its scores, on the unfiltered buffer (``compute_influence(cache=True)``, so a
   target shared by several callbacks is scored once);
2. every ``IIFCallback`` clears the keep mask of the records its rule drops;
3. every ``AttributionCallback`` logs its statistics and writes its snapshot, whose ``keep`` is the final mask.

The first of the attached callbacks to run does steps 1 and 2 for all of them.
"""

import os
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
from stable_baselines3.common.callbacks import BaseCallback

from sb3_influence.common.filters import DROP_RULES, get_drop_rule
from sb3_influence.common.snapshots import record_arrays, round_index, save_snapshot, snapshot_metadata, snapshot_path
from sb3_influence.common.targets import Target, as_target

if TYPE_CHECKING:
    from sb3_influence.influence_ppo import InfluencePPO

# Only for logs: rich types (histograms) go to TensorBoard
_TENSORBOARD_ONLY = ("stdout", "log", "json", "csv")

# model -> the influence callbacks training it right now (registered at training start, removed at training end)
_ACTIVE: "weakref.WeakKeyDictionary[Any, weakref.WeakSet[_InfluenceCallback]]" = weakref.WeakKeyDictionary()


class _InfluenceCallback(BaseCallback):
    """What both callbacks share: the type check, the per-model registry and the once-per-round steps."""

    model: "InfluencePPO"

    def _init_callback(self) -> None:
        from sb3_influence.influence_ppo import InfluencePPO

        if not isinstance(self.model, InfluencePPO):
            raise TypeError(
                f"{type(self).__name__} needs an InfluencePPO model (it reads influence scores and the keep mask of "
                f"its rollout buffer), got {type(self.model).__name__}. Use sb3_influence.InfluencePPO instead of "
                f"{type(self.model).__name__}: it takes the same arguments as PPO."
            )
        self._scored_round: tuple[int, int] | None = None

    def _on_training_start(self) -> None:
        _ACTIVE.setdefault(self.model, weakref.WeakSet()).add(self)

    def _on_training_end(self) -> None:
        # Safe to call twice (rl-zoo calls on_training_end again after learn())
        active = _ACTIVE.get(self.model)
        if active is not None:
            active.discard(self)

    def _on_step(self) -> bool:
        return True

    def _round_key(self) -> tuple[int, int]:
        buffer = self.model.rollout_buffer
        return (id(buffer), buffer.rollout_index)

    def _prepare_round(self) -> None:
        """Steps 1 and 2 of the round, for every influence callback attached to this model (idempotent)."""
        callbacks = sorted(_ACTIVE.get(self.model, ()), key=id)
        if self not in callbacks:
            callbacks.append(self)
        for callback in callbacks:
            callback._score_once()
        for callback in callbacks:
            if isinstance(callback, IIFCallback):
                callback._filter_once()

    def _score_once(self) -> None:
        key = self._round_key()
        if self._scored_round != key:
            self._scored_round = key
            self._score()

    def _score(self) -> None:
        raise NotImplementedError


class IIFCallback(_InfluenceCallback):
    """
    Iterative influence-based filtering (IIF, METHOD §4): every round, score the records with a target at the
    current parameters and drop the ones the rule selects before the PPO update. Needs an ``InfluencePPO``.

    Rules (see :mod:`sb3_influence.common.filters`), with ``n`` records of which ``n_neg`` have a negative score:

    - ``"neg-bottom"`` (the paper's): drop the ``floor(fraction · n_neg)`` most negative records;
    - ``"neg"``: drop every negative record (``fraction`` is ignored);
    - ``"bottom"``: drop the ``floor(fraction · n)`` lowest-scored records;
    - ``"random"``: baseline, drop ``floor(fraction · n_neg)`` records drawn uniformly among all;
    - ``"neg-random"``: baseline, drop ``floor(fraction · n_neg)`` records drawn uniformly among the negative ones.

    The random rules draw from a generator seeded with the model's seed and the round index, never from numpy's
    global RNG (which PPO uses for its minibatches), so random-drop runs are reproducible. With ``fraction=0``
    (any rule but ``"neg"``) nothing is dropped and training is bit-identical to ``PPO``.
    Logs ``iif/kept_fraction``, ``iif/n_dropped`` and ``iif/n_negative``.

    :param fraction: The fraction ``p`` in ``[0, 1]`` (0.5 FrozenLake/Acrobot, 0.125 MiniGrid/LunarLander,
        0.0625 BipedalWalker in the paper).
    :param target: What the records are scored against: ``"return"`` (the paper's) or a ``Target``.
    :param rule: The drop rule, one of ``"neg-bottom"``, ``"neg"``, ``"bottom"``, ``"random"``, ``"neg-random"``.
    :param batch_size: Records per scoring chunk (default: the model's ``influence_batch_size``).
    :param verbose: Verbosity level: 0 no output, 1 one line per round.
    """

    def __init__(
        self,
        fraction: float = 0.125,
        target: str | Target = "return",
        rule: str = "neg-bottom",
        batch_size: int | None = None,
        verbose: int = 0,
    ):
        super().__init__(verbose)
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float, np.integer, np.floating)):
            raise TypeError(f"IIFCallback: fraction must be a number in [0, 1], got {fraction!r}")
        if not 0.0 <= float(fraction) <= 1.0:
            raise ValueError(
                f"IIFCallback: fraction must be in [0, 1] (the share of negative records to drop), got {fraction}"
            )
        if not isinstance(rule, str) or rule not in DROP_RULES:
            raise ValueError(f"IIFCallback: unknown rule {rule!r}, use one of {sorted(DROP_RULES)}")
        _check_batch_size(batch_size, "IIFCallback")
        self.fraction = float(fraction)
        self.target = as_target(target)
        self.rule = rule
        self.batch_size = batch_size
        self._drop_rule = get_drop_rule(rule)
        self._filtered_round: tuple[int, int] | None = None
        self._scores: np.ndarray | None = None
        self.last_drop: np.ndarray | None = None

    def _init_callback(self) -> None:
        super()._init_callback()
        self._filtered_round = None
        seed = self.model.seed
        # Without a model seed the random baselines are still independent of numpy's global RNG
        if seed is None:
            seed = int(np.random.SeedSequence().generate_state(1, np.uint64)[0])
        self._seed_entropy = int(seed) % 2**63

    def round_rng(self) -> np.random.Generator:
        """The generator of the random rules for the current round (model seed + round index)."""
        return np.random.default_rng([self._seed_entropy, round_index(self.model)])

    def _score(self) -> None:
        self._scores = self.model.compute_influence(self.target, batch_size=self.batch_size, cache=True)

    def _filter_once(self) -> None:
        key = self._round_key()
        if self._filtered_round == key:
            return
        self._score_once()
        self._filtered_round = key
        buffer = self.model.rollout_buffer
        assert self._scores is not None
        drop_flat = self._drop_rule(buffer.to_flat(self._scores), self.fraction, self.round_rng())
        drop = buffer.to_records(drop_flat)
        buffer.keep[drop] = False
        self.last_drop = drop
        n_dropped = int(drop.sum())
        kept_fraction = float(np.mean(buffer.keep))
        self.logger.record("iif/kept_fraction", kept_fraction)
        self.logger.record("iif/n_dropped", n_dropped)
        self.logger.record("iif/n_negative", int(np.count_nonzero(self._scores < 0)))
        if self.verbose >= 1:
            print(f"IIF round {round_index(self.model)}: dropped {n_dropped} records ({self.rule}), kept {kept_fraction:.3f}")

    def _on_rollout_end(self) -> None:
        self._prepare_round()


class AttributionCallback(_InfluenceCallback):
    """
    Score every record of a round against one or more targets, log statistics and (optionally) write one
    attribution snapshot per round (see :mod:`sb3_influence.common.snapshots`). Needs an ``InfluencePPO``.

    Logs, per target: ``influence/<target>/mean``, ``/std``, ``/min``, ``/max``, ``/frac_negative``,
    ``/corr_advantage`` (Pearson correlation with the raw advantage) and ``/hist`` (a histogram of the scores,
    TensorBoard only). Snapshots are named ``<save_dir>/<name_prefix>_<num_timesteps>_steps.npz`` and written
    atomically; their ``keep`` is the mask after every ``IIFCallback`` of the same run has filtered the round.

    :param targets: The targets: ``"return"`` and/or ``Target`` objects with distinct names.
    :param save_dir: Folder for the snapshots (created if needed); ``None``: log only.
    :param every: Score every ``every`` rounds (rounds 0, every, 2·every, ...).
    :param name_prefix: File name prefix of the snapshots.
    :param batch_size: Records per scoring chunk (default: the model's ``influence_batch_size``).
    :param log_histogram: Log a histogram of the scores to TensorBoard.
    :param verbose: Verbosity level: 0 no output, 1 one line per snapshot.
    """

    def __init__(
        self,
        targets: Iterable[str | Target] | str | Target = ("return",),
        save_dir: str | os.PathLike | None = None,
        every: int = 1,
        name_prefix: str = "snapshot",
        batch_size: int | None = None,
        log_histogram: bool = True,
        verbose: int = 0,
    ):
        super().__init__(verbose)
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
        _check_batch_size(batch_size, "AttributionCallback")
        self.save_dir = os.fspath(save_dir) if save_dir is not None else None
        self.every = int(every)
        self.name_prefix = name_prefix
        self.batch_size = batch_size
        self.log_histogram = log_histogram
        self.scores: dict[str, np.ndarray] = {}
        self.last_path: str | None = None

    def _init_callback(self) -> None:
        super()._init_callback()
        if self.save_dir is not None:
            os.makedirs(self.save_dir, exist_ok=True)

    def _due(self) -> bool:
        return round_index(self.model) % self.every == 0

    def _score(self) -> None:
        self.scores = {}
        if not self._due():
            return
        for target in self.targets:
            self.scores[target.name] = self.model.compute_influence(target, batch_size=self.batch_size, cache=True)

    def _log(self) -> None:
        advantages = self.model.rollout_buffer.to_records(self.model.rollout_buffer.flat_field("advantages"))
        for name, scores in self.scores.items():
            prefix = f"influence/{name}"
            self.logger.record(f"{prefix}/mean", float(scores.mean()))
            self.logger.record(f"{prefix}/std", float(scores.std()))
            self.logger.record(f"{prefix}/min", float(scores.min()))
            self.logger.record(f"{prefix}/max", float(scores.max()))
            self.logger.record(f"{prefix}/frac_negative", float(np.mean(scores < 0)))
            self.logger.record(f"{prefix}/corr_advantage", _pearson(scores.ravel(), np.asarray(advantages).ravel()))
            if self.log_histogram:
                self.logger.record(f"{prefix}/hist", scores.ravel().astype(np.float32), exclude=_TENSORBOARD_ONLY)

    def _on_rollout_end(self) -> None:
        self._prepare_round()
        if not self.scores:
            return
        self._log()
        if self.save_dir is None:
            return
        arrays = record_arrays(self.model)
        for name, scores in self.scores.items():
            arrays[f"influence/{name}"] = scores
        path = snapshot_path(self.save_dir, self.name_prefix, self.model.num_timesteps)
        save_snapshot(path, arrays, snapshot_metadata(self.model, list(self.scores)))
        self.last_path = path
        if self.verbose >= 1:
            print(f"Saving attribution snapshot to {path}")


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation, NaN when one side is constant."""
    x = x - x.mean()
    y = y - y.mean()
    denominator = float(np.sqrt((x * x).sum() * (y * y).sum()))
    return float((x * y).sum() / denominator) if denominator > 0 else float("nan")


def _check_batch_size(batch_size: Any, owner: str) -> None:
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1
    ):
        raise ValueError(f"{owner}: batch_size must be a positive int or None (records per scoring chunk), got {batch_size!r}")
