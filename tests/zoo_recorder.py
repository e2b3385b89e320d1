"""
A test-only rl-zoo callback (``-params "callback:[{'zoo_recorder.IIFRecorder': ...}]"``): what the IIF filter of
``influence_ppo`` did in every round, one JSON line per round in ``<save_dir>/<pid>.jsonl``.
"""

import json
import os

from stable_baselines3.common.callbacks import BaseCallback


class IIFRecorder(BaseCallback):
    """
    Record, after the filter (``ZooInfluencePPO`` puts its ``IIFCallback`` first), the model's IIF settings, the
    counts the filter logged and the optimiser the policy was built with.

    :param save_dir: Folder of the JSON lines files (one per process).
    """

    def __init__(self, save_dir: str):
        super().__init__()
        self.save_dir = save_dir

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        logged = self.model.logger.name_to_value
        record = {
            "pid": os.getpid(),
            "iif_fraction": self.model.iif_fraction,
            "iif_rule": self.model.iif_rule,
            "n": int(self.model.rollout_buffer.keep.size),
            "n_kept": int(self.model.rollout_buffer.keep.sum()),
            "n_dropped": logged.get("iif/n_dropped"),
            "n_negative": logged.get("iif/n_negative"),
            "optimizer": type(self.model.policy.optimizer).__name__,
            "net_arch": self.model.policy.net_arch,
        }
        os.makedirs(self.save_dir, exist_ok=True)
        with open(os.path.join(self.save_dir, f"{os.getpid()}.jsonl"), "a") as file:
            file.write(json.dumps(record) + "\n")
