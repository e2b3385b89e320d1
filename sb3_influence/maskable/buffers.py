"""sb3-contrib's maskable rollout buffers with record ids, a keep mask and per-record action masks."""

from typing import ClassVar

import numpy as np
from sb3_contrib.common.maskable.buffers import (
    MaskableDictRolloutBuffer,
    MaskableRolloutBuffer,
)

from sb3_influence.common.buffers import InfluenceRolloutBufferMixin


class _MaskableRecordsMixin(InfluenceRolloutBufferMixin):
    """The action masks of the records, as the scoring engine asks for them."""

    # What MaskableRolloutBuffer.get flattens besides the observations
    flat_fields: ClassVar[tuple[str, ...]] = (*InfluenceRolloutBufferMixin.flat_fields, "action_masks")

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


class InfluenceMaskableDictRolloutBuffer(_MaskableRecordsMixin, MaskableDictRolloutBuffer):
    """
    ``MaskableDictRolloutBuffer`` with record ids and a keep mask (see
    :class:`~sb3_influence.common.buffers.InfluenceRolloutBufferMixin`); its samples carry ``action_masks``.
    The constructor takes the same arguments as ``MaskableDictRolloutBuffer``.
    """
