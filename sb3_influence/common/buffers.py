"""Rollout buffers that know their records: ids, a keep mask and the first epoch's minibatches."""

from collections.abc import Generator
from typing import Any, ClassVar

import numpy as np
from stable_baselines3.common.buffers import DictRolloutBuffer, RolloutBuffer

from sb3_influence.common import sb3_compat


class InfluenceRolloutBufferMixin:
    """
    What ``InfluenceRolloutBuffer`` and ``InfluenceDictRolloutBuffer`` add to SB3's rollout buffers.

    Every entry ``(step, env)`` of the buffer is a *record* (one transition with its advantage, the unit the
    paper attributes to). Its id follows SB3's own flattening (``swap_and_flatten``): ``record_id = env * n_steps
    + step``. Every flat per-record array of this package (scores, snapshot columns, DataFrame rows) uses that
    order; :meth:`to_records` and :meth:`to_flat` convert between it and the buffer's ``(n_steps, n_envs)`` layout.

    - ``keep``: boolean array of shape ``(n_steps, n_envs)``, all ``True`` after each rollout. The update walks
      minibatches of the kept records only (:meth:`kept_minibatches`), so a dropped record has no effect on it
      and fewer records mean fewer optimiser steps.
    - The permutation of the first epoch is drawn once per rollout (from numpy's global RNG, exactly as
      ``RolloutBuffer.get`` draws it) and kept for the whole round: scoring normalises advantages with the
      statistics of the minibatch each record will sit in, and the update's first epoch uses the same order.
    - ``rollout_id`` changes with every rollout, so nothing computed for one rollout is mistaken for another's.
    """

    #: The fields besides the observations that ``get()`` flattens (subclasses add their own, e.g. action masks)
    flat_fields: ClassVar[tuple[str, ...]] = ("actions", "values", "log_probs", "advantages", "returns")

    buffer_size: int
    n_envs: int
    observations: Any
    swap_and_flatten: Any
    generator_ready: bool
    full: bool
    keep: np.ndarray
    _first_permutation: np.ndarray | None
    rollout_id: int

    def _reset_records(self) -> None:
        self.keep = np.ones((self.buffer_size, self.n_envs), dtype=bool)
        self._first_permutation = None
        self.rollout_id = getattr(self, "rollout_id", -1) + 1

    @property
    def n_records(self) -> int:
        """Number of records the buffer holds when full (``n_steps * n_envs``)."""
        return self.buffer_size * self.n_envs

    @property
    def record_ids(self) -> np.ndarray:
        """Flat record ids, shape ``(n_steps, n_envs)``: ``env * n_steps + step``."""
        steps = np.arange(self.buffer_size)[:, None]
        envs = np.arange(self.n_envs)[None, :]
        return envs * self.buffer_size + steps

    def to_records(self, values: np.ndarray) -> np.ndarray:
        """Reshape a flat per-record array (indexed by record id) to ``(n_steps, n_envs, ...)``."""
        values = np.asarray(values)
        return values.reshape(self.n_envs, self.buffer_size, *values.shape[1:]).swapaxes(0, 1)

    def to_flat(self, values: np.ndarray) -> np.ndarray:
        """Reshape a ``(n_steps, n_envs, ...)`` array to a flat array indexed by record id."""
        values = np.asarray(values)
        return values.swapaxes(0, 1).reshape(self.n_records, *values.shape[2:])

    @property
    def flat_keep(self) -> np.ndarray:
        """The keep mask indexed by record id, shape ``(n_steps * n_envs,)``."""
        keep = np.asarray(self.keep)
        if keep.shape != (self.buffer_size, self.n_envs) or keep.dtype != bool:
            raise ValueError(
                f"rollout_buffer.keep must be a boolean array of shape (n_steps, n_envs) = "
                f"{(self.buffer_size, self.n_envs)}, got {keep.dtype} {keep.shape}. Modify it in place "
                "(e.g. `buffer.keep[step, env] = False`) instead of replacing it."
            )
        return self.to_flat(keep)

    def first_epoch_permutation(self) -> np.ndarray:
        """
        The record order of the first training epoch, drawn once per rollout and kept until the next one.

        :return: A permutation of all record ids (dropped records included: the update skips them).
        """
        if not self.full:
            raise RuntimeError("The rollout buffer is not full yet: collect a rollout first")
        if self._first_permutation is None:
            self._first_permutation = np.random.permutation(self.n_records)
        return self._first_permutation

    def first_epoch_minibatch_ids(self, batch_size: int) -> np.ndarray:
        """
        Index of the minibatch each record would sit in during the first epoch if no record were dropped.

        :param batch_size: The PPO minibatch size.
        :return: Flat array of shape ``(n_steps * n_envs,)`` indexed by record id.
        """
        permutation = self.first_epoch_permutation()
        minibatch = np.empty(self.n_records, dtype=np.int64)
        minibatch[permutation] = np.arange(self.n_records) // batch_size
        return minibatch

    def reset(self) -> None:
        """SB3's reset, then every record kept, a new ``rollout_id`` and no first-epoch order yet."""
        super().reset()  # type: ignore[misc]
        self._reset_records()

    def _prepare_flat(self) -> None:
        """Flatten the stored arrays to record-id order, as ``RolloutBuffer.get`` does on its first call."""
        if self.generator_ready:
            return
        if isinstance(self.observations, dict):
            for key, obs in self.observations.items():
                self.observations[key] = self.swap_and_flatten(obs)
        else:
            self.observations = self.swap_and_flatten(self.observations)
        for name in self.flat_fields:
            self.__dict__[name] = self.swap_and_flatten(self.__dict__[name])
        self.generator_ready = True

    def get(self, batch_size: int | None = None) -> Generator[Any, None, None]:
        """Minibatches of the kept records, in a fresh random order (the update itself uses ``kept_minibatches``)."""
        for batch_inds in self.kept_minibatches(np.random.permutation(self.n_records), batch_size):
            yield self.samples(batch_inds)

    def record_action_masks(self, ids: np.ndarray) -> np.ndarray | None:
        """
        The invalid-action masks of the records ``ids`` (buffers of masked policies override this).

        :param ids: Flat record ids.
        :return: Array of shape ``(len(ids), mask_dims)``, or ``None``: the records carry no masks.
        """
        return None

    def trajectory_ids(self) -> np.ndarray:
        """
        The trajectory of every record: a trajectory is a maximal run of one env's records inside the buffer,
        from an episode start (or the buffer's first step) to the step before the next episode start (or the
        buffer's last step). Trajectories are numbered 0, 1, ... in record-id order (env by env, in time order).

        :return: Flat int64 array indexed by record id.
        """
        starts = np.array(self.flat_field("episode_starts"), dtype=bool).reshape(self.n_records)
        # Each env's first record starts a trajectory, whatever episode it continues
        starts[:: self.buffer_size] = True
        return np.cumsum(starts, dtype=np.int64) - 1

    def kept_minibatches(self, order: np.ndarray, batch_size: int | None) -> list[np.ndarray]:
        """
        Split the kept records, in the given order, into minibatches (what one epoch of the update walks).

        With every record kept this is exactly ``RolloutBuffer.get``'s split. When records were dropped and the
        last minibatch would hold a single record, that record joins the previous minibatch instead: one
        record cannot be normalised (PPO skips advantage normalisation for it) and breaks batch norm.

        :param order: A permutation of all record ids (dropped ones are skipped).
        :param batch_size: Records per minibatch (``None``: one minibatch).
        :return: The minibatches as arrays of flat record ids.
        """
        assert self.full, "The rollout buffer is not full yet: collect a rollout first"
        self._prepare_flat()
        keep = self.flat_keep
        dropped = not keep.all()
        if dropped:
            order = order[keep[order]]
        if batch_size is None:
            batch_size = self.n_records
        batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
        if dropped and len(batches) > 1 and len(batches[-1]) == 1:
            batches[-2:] = [np.concatenate(batches[-2:])]
        return batches

    def samples(self, ids: np.ndarray) -> Any:
        """The samples tuple (as ``get()`` yields it) of the records ``ids``."""
        self._prepare_flat()
        return sb3_compat.buffer_samples(self, ids)  # type: ignore[arg-type]

    def flat_field(self, name: str) -> Any:
        """
        A buffer field in record-id order, whatever state the buffer is in.

        :param name: ``observations``, ``actions``, ``rewards``, ``episode_starts``, ``values``, ``log_probs``,
            ``advantages`` or ``returns``.
        :return: The flattened array (a dict of arrays for Dict observations).
        """
        value = getattr(self, name)
        if self.generator_ready and name not in ("rewards", "episode_starts"):
            # Already flattened by get() (SB3 never flattens rewards and episode_starts)
            return value if name in ("observations", "actions") else value.reshape(-1)
        # A flattened copy: the buffer keeps SB3's (n_steps, n_envs, ...) layout until get() runs
        if isinstance(value, dict):
            return {key: self.to_flat(array) for key, array in value.items()}
        return self.to_flat(value)


class InfluenceRolloutBuffer(InfluenceRolloutBufferMixin, RolloutBuffer):
    """
    ``RolloutBuffer`` with record ids and a keep mask, see :class:`InfluenceRolloutBufferMixin`.
    The constructor takes the same arguments as ``RolloutBuffer``.
    """


class InfluenceDictRolloutBuffer(InfluenceRolloutBufferMixin, DictRolloutBuffer):
    """
    ``DictRolloutBuffer`` with record ids and a keep mask, see :class:`InfluenceRolloutBufferMixin`.
    The constructor takes the same arguments as ``DictRolloutBuffer``.
    """
