"""
A test-only rl-zoo callback (``-params "callback:[{'zoo_recorder.IIFRecorder': ...}]"``): what the IIF filter of
``influence_ppo`` did in every round, one JSON line per round in ``<save_dir>/<pid>.jsonl``.
"""

import json
import os
from typing import Any

from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.logger import KVWriter


class _RoundWriter(KVWriter):
    """An extra output of the model's logger: SB3 dumps a round's values after its filter ran, before the update."""

    def __init__(self, recorder: "IIFRecorder"):
        self.recorder = recorder

    def write(self, key_values: dict[str, Any], key_excluded: dict[str, Any], step: int = 0) -> None:
        if "iif/n_dropped" in key_values:
            self.recorder.record(key_values)

    def close(self) -> None:
        pass


class IIFRecorder(BaseCallback):
    """
    Record, for every round, the model's IIF settings, the counts its filter logged, the keep mask's size and sum,
    and the optimiser and network the policy was built with.

    :param save_dir: Folder of the JSON lines files (one per process).
    """

    def __init__(self, save_dir: str):
        super().__init__()
        self.save_dir = save_dir

    def _init_callback(self) -> None:
        self.model.logger.output_formats.append(_RoundWriter(self))

    def _on_step(self) -> bool:
        return True

    def record(self, logged: dict[str, Any]) -> None:
        keep = self.model.rollout_buffer.keep
        record = {
            "pid": os.getpid(),
            "iif_fraction": self.model.iif_fraction,
            "iif_rule": self.model.iif_rule,
            "n": int(keep.size),
            "n_kept": int(keep.sum()),
            "n_dropped": int(logged["iif/n_dropped"]),
            "n_negative": int(logged["iif/n_negative"]),
            "optimizer": type(self.model.policy.optimizer).__name__,
            "net_arch": self.model.policy.net_arch,
        }
        os.makedirs(self.save_dir, exist_ok=True)
        with open(os.path.join(self.save_dir, f"{os.getpid()}.jsonl"), "a") as file:
            file.write(json.dumps(record) + "\n")
