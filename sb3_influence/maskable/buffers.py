"""sb3-contrib's maskable rollout buffers with record ids, a keep mask and per-record action masks."""

from collections.abc import Generator

import numpy as np
from sb3_contrib.common.maskable.buffers import (
    MaskableDictRolloutBuffer,
    MaskableDictRolloutBufferSamples,
    MaskableRolloutBuffer,
    MaskableRolloutBufferSamples,
)

from sb3_influence.common.buffers import _FLAT_FIELDS, InfluenceRolloutBufferMixin

# What MaskableRolloutBuffer.get flattens besides the observations
_MASKABLE_FLAT_FIELDS = (*_FLAT_FIELDS, "action_masks")


class _MaskableRecordsMixin(InfluenceRolloutBufferMixin):
    """The action masks of the records, as the scoring engine asks for them."""

    action_masks: np.ndarray
    mask_dims: int

    def record_action_masks(self, ids: np.ndarray) -> np.ndarray:
        """
        The action masks stored with the records ``ids`` (all ones when collected with ``use_masking=False``).

        :param ids: Flat record ids.
        :return: Float32 array of shape ``(len(ids), mask_dims)``, 1 for a valid choice.
        """
        # Flattened by get()/samples(), or still in SB3's (n_steps, n_envs, mask_dims) layout
        masks = self.action_masks if self.generator_ready else self.to_flat(self.action_masks)
        return masks[np.asarray(ids)].reshape(-1, self.mask_dims)


class InfluenceMaskableRolloutBuffer(_MaskableRecordsMixin, MaskableRolloutBuffer):
    """
    ``MaskableRolloutBuffer`` with record ids and a keep mask (see
    :class:`~sb3_influence.common.buffers.InfluenceRolloutBufferMixin`); its samples carry ``action_masks``.
    The constructor takes the same arguments as ``MaskableRolloutBuffer``.
    """

    def reset(self) -> None:
        super().reset()
        self._reset_records()

    def _prepare_flat(self) -> None:
        if not self.generator_ready:
            for name in ("observations", *_MASKABLE_FLAT_FIELDS):
                self.__dict__[name] = self.swap_and_flatten(self.__dict__[name])
            self.generator_ready = True

    def get(self, batch_size: int | None = None) -> Generator[MaskableRolloutBufferSamples, None, None]:  # type: ignore[override]
        """Minibatches of the kept records, in a fresh random order (the update itself uses ``kept_minibatches``)."""
        for batch_inds in self.kept_minibatches(np.random.permutation(self.n_records), batch_size):
            yield self.samples(batch_inds)


class InfluenceMaskableDictRolloutBuffer(_MaskableRecordsMixin, MaskableDictRolloutBuffer):
    """
    ``MaskableDictRolloutBuffer`` with record ids and a keep mask (see
    :class:`~sb3_influence.common.buffers.InfluenceRolloutBufferMixin`); its samples carry ``action_masks``.
    The constructor takes the same arguments as ``MaskableDictRolloutBuffer``.
    """

    def reset(self) -> None:
        super().reset()
        self._reset_records()

    def _prepare_flat(self) -> None:
        if not self.generator_ready:
            for key, obs in self.observations.items():
                self.observations[key] = self.swap_and_flatten(obs)
            for name in _MASKABLE_FLAT_FIELDS:
                self.__dict__[name] = self.swap_and_flatten(self.__dict__[name])
            self.generator_ready = True

    def get(self, batch_size: int | None = None) -> Generator[MaskableDictRolloutBufferSamples, None, None]:  # type: ignore[override]
        """Minibatches of the kept records, in a fresh random order (the update itself uses ``kept_minibatches``)."""
        for batch_inds in self.kept_minibatches(np.random.permutation(self.n_records), batch_size):
            yield self.samples(batch_inds)
