"""
Targeted intervention (the paper's Sec. 4.3): retrain one round without a chosen set of records.

From θ(k) and the rollout buffer of round k, :func:`intervene` runs the model's own update once per *arm* — all
records (the reference), without the negative records, without the bottom / top x %, without a random set of
the same size — and reports how the target and the test return move against the unfiltered retrain. Each arm
starts from the round's captured training state at θ(k) (parameters, optimizer, RNG); afterwards the model's
training state is put back (:func:`sb3_influence.common.state.training_state`), so training goes on exactly as if
nothing had happened. The arms use the drop rules of :mod:`sb3_influence.common.filters`, the same ones
``IIFCallback`` uses. :class:`InterventionCallback` runs it at chosen rounds.
"""

import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch as th
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv

from sb3_influence.analysis._callbacks import AnalysisCallback
from sb3_influence.common import sb3_compat
from sb3_influence.common.files import make_folder, write_json
from sb3_influence.common.filters import get_drop_rule
from sb3_influence.common.state import training_state
from sb3_influence.common.targets import Target, as_target

if TYPE_CHECKING:
    import pandas as pd

    from sb3_influence.influence_ppo import InfluencePPO

ARMS = ("negatives", "bottom", "top", "random", "random_negatives")

# Arm -> (drop rule of sb3_influence.common.filters, whether the arm's `fraction` applies; else the rule gets 1)
_ARM_RULES = MappingProxyType(
    {
        "negatives": ("neg", False),
        "bottom": ("bottom", True),
        "top": ("top", True),
        "random": ("random", False),
        "random_negatives": ("uniform", True),
    }
)


def drop_mask(scores: np.ndarray, arm: str, fraction: float = 0.05, rng: np.random.Generator | None = None) -> np.ndarray:
    """
    The records an arm drops.

    :param scores: Influence scores, shape ``(n_steps, n_envs)`` (or flat, by record id).
    :param arm: ``"negatives"`` (every record with I < 0), ``"bottom"`` / ``"top"`` (the ``floor(fraction · n)``
        lowest / highest), ``"random"`` (as many records as ``"negatives"``, uniformly),
        ``"random_negatives"`` (``floor(fraction · n)`` records drawn uniformly: the size of bottom/top).
    :param fraction: Share of records for ``bottom``, ``top`` and ``random_negatives``.
    :param rng: Generator for the random arms (default: seeded with 0).
    :return: Boolean array of the same shape, True for dropped records.
    """
    if arm not in _ARM_RULES:
        raise ValueError(f"arm must be one of {ARMS} or a boolean drop mask, got {arm!r}")
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, (int, float, np.integer, np.floating))
        or not 0.0 <= fraction <= 1.0
    ):
        raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
    scores = np.asarray(scores, dtype=np.float64)
    # Rules see records by record id (env-major), as everywhere else in the package
    flat = scores.swapaxes(0, 1).reshape(-1) if scores.ndim == 2 else scores.reshape(-1)
    rule, uses_fraction = _ARM_RULES[arm]
    drop = get_drop_rule(rule)(
        flat, float(fraction) if uses_fraction else 1.0, np.random.default_rng(0) if rng is None else rng
    )
    if scores.ndim == 2:
        return drop.reshape(scores.shape[1], scores.shape[0]).swapaxes(0, 1)
    return drop.reshape(scores.shape)


def target_value(model: "InfluencePPO", target: str | Target = "return", batch_size: int | None = None) -> float:
    """
    ``f(θ)`` at the model's current parameters, over its current rollout buffer.

    :param model: The model.
    :param target: ``"return"`` or a :class:`~sb3_influence.Target`.
    :param batch_size: Samples per forward pass (default: ``model.influence_batch_size``).
    :return: The value.
    """
    target = as_target(target)
    engine = model.influence_engine
    with engine.eval_mode(), th.no_grad():
        terms = target.terms(engine, batch_size or model.influence_batch_size)
        return float(sum(float(term.detach().cpu()) for term in terms))


def _evaluate(model: "InfluencePPO", eval_env: VecEnv | None, n_eval_episodes: int, seed: int, deterministic: bool) -> float:
    if eval_env is None:
        return float("nan")
    # Common random numbers: every arm sees the same episode seeds and the same action-sampling noise
    eval_env.seed(seed)
    th.manual_seed(seed)
    episode_rewards, _ = evaluate_policy(
        model, eval_env, n_eval_episodes=n_eval_episodes, deterministic=deterministic, warn=False, return_episode_rewards=True
    )
    return float(np.mean(episode_rewards))


def intervene(
    model: "InfluencePPO",
    arms: Sequence[str] | Mapping[str, np.ndarray] = ("negatives", "random", "bottom", "top"),
    fraction: float = 0.05,
    target: str | Target = "return",
    eval_env: Any = None,
    n_eval_episodes: int = 5,
    deterministic: bool = False,
    seed: int = 0,
    evaluator: Callable[[Any], float] | None = None,
) -> "pd.DataFrame":
    """
    Retrain the current round from θ(k) once per arm and compare each with the unfiltered retrain.

    Call it while the rollout buffer holds round k: from :class:`InterventionCallback` (before the update), or
    after ``learn()`` for the last round (every arm starts from the round's θ(k), which the round keeps). The
    model is left exactly as it was found.

    :param model: An ``InfluencePPO`` model.
    :param arms: Names from :data:`ARMS` (see :func:`drop_mask`), or a mapping ``name -> drop mask`` of
        shape ``(n_steps, n_envs)`` (True = drop) for a set of your own.
    :param fraction: Share of records for the ``bottom``, ``top`` and ``random_negatives`` arms.
    :param target: The target that ranks the records and is measured before/after (default ``"return"``).
    :param eval_env: Environment for the test return (gym env or VecEnv); ``None``: no test return (nan).
    :param n_eval_episodes: Test episodes per arm.
    :param deterministic: Evaluate the deterministic policy (the paper evaluates the stochastic one).
    :param seed: Seed of the random arms and of the evaluation (the same for every arm).
    :param evaluator: A function ``model -> test return`` used instead of ``eval_env`` / ``n_eval_episodes``
        (e.g. an exact evaluation on a tabular env, or a vectorised one); it must leave the model as it found it.
        For a paired comparison it should seed its episodes and action sampling the same way at every call, as the
        ``eval_env`` path does (``sb3_influence.bench.evaluation.evaluate`` does).
    :return: DataFrame, one row per arm, the reference ``"none"`` first: ``arm``, ``n_dropped``,
        ``target_before``, ``target_after``, ``delta_target`` (target_after minus the reference's),
        ``test_return``, ``delta_return`` (minus the reference's), ``test_return_start`` (the test return at
        θ(k), before any update: ``test_return`` of ``"none"`` minus it is what PPO's own update gained), plus
        ``round`` and ``num_timesteps``.
    """
    import pandas as pd

    buffer = model.rollout_buffer
    if buffer is None or not buffer.full:
        raise RuntimeError("intervene() needs a full rollout buffer at θ(k): call it from a callback's _on_rollout_end")
    if isinstance(n_eval_episodes, bool) or not isinstance(n_eval_episodes, (int, np.integer)) or n_eval_episodes < 1:
        raise ValueError(f"n_eval_episodes must be a positive int, got {n_eval_episodes!r}")
    if evaluator is not None and not callable(evaluator):
        raise TypeError(f"evaluator must be a function model -> test return, got {type(evaluator).__name__}")
    if evaluator is not None and eval_env is not None:
        raise ValueError("pass either eval_env (evaluated with evaluate_policy) or evaluator, not both")
    if eval_env is not None and not isinstance(eval_env, VecEnv):
        env = eval_env
        eval_env = DummyVecEnv([lambda: env])

    def test_return() -> float:
        if evaluator is not None:
            return float(evaluator(model))
        return _evaluate(model, eval_env, int(n_eval_episodes), seed, deterministic)

    target = as_target(target)
    shape = buffer.keep.shape
    if isinstance(arms, Mapping):
        masks = {}
        for name, mask in arms.items():
            mask = np.asarray(mask)
            if mask.dtype != bool or mask.shape != shape:
                raise ValueError(f"arms[{name!r}] must be a boolean drop mask of shape {shape}, got {mask.dtype} {mask.shape}")
            masks[str(name)] = mask
    else:
        if isinstance(arms, str):
            raise TypeError(f"arms must be a list of arm names, e.g. [{arms!r}], not a string")
        scores = model.compute_influence(target, cache=True)
        rng = np.random.default_rng(seed)
        masks = {str(arm): drop_mask(scores, arm, fraction, rng) for arm in arms}
    if "none" in masks:
        raise ValueError("arms: 'none' is the name of the unfiltered reference, choose another name")

    round_ = model.current_round()
    rows = []
    with training_state(model) as now:
        base_keep = buffer.keep.copy() if now.keep is None else now.keep
        round_.start_state.restore(model, keep=False)
        before = target_value(model, target)
        start_return = test_return()
        for name, drop in {"none": np.zeros(shape, dtype=bool), **masks}.items():
            round_.start_state.restore(model, keep=False)
            buffer.keep[...] = base_keep & ~drop
            sb3_compat.set_model_logger(model, Logger(folder=None, output_formats=[]))
            if buffer.keep.any():
                model.update()
            rows.append(
                {
                    "arm": name,
                    "n_dropped": int((base_keep & drop).sum()),
                    "target_before": before,
                    "target_after": target_value(model, target),
                    "test_return": test_return(),
                }
            )
    table = pd.DataFrame(rows)
    table["delta_target"] = table["target_after"] - table.loc[0, "target_after"]
    table["delta_return"] = table["test_return"] - table.loc[0, "test_return"]
    table["test_return_start"] = start_return
    table["round"] = round_.index
    table["num_timesteps"] = int(model.num_timesteps)
    return table


INTERVENTION_FILE = "intervention_round{:06d}.json"


def write_intervention(save_dir: str, model: Any, table: "pd.DataFrame") -> str:
    """
    Write one round's :func:`intervene` table, with the run's id, atomically (temporary file, then rename).

    :param save_dir: The folder.
    :param model: The model (for its ``run_id``).
    :param table: The table.
    :return: The file's path.
    """
    round_index = int(table["round"].iloc[0])
    path = os.path.join(save_dir, INTERVENTION_FILE.format(round_index))
    data = {"run_id": getattr(model, "run_id", None), "round": round_index, "rows": table.to_dict(orient="records")}
    write_json(path, data, indent=None)
    return path


def read_interventions(run_dir: str, run_id: str | None, on_error: str = "raise") -> tuple["pd.DataFrame", int]:
    """
    The intervention tables written under ``run_dir`` (searched recursively) for one run.

    :param run_dir: The folder.
    :param run_id: Keep the files of this run only (files without a run id match ``None`` only).
    :param on_error: ``"raise"``: a file that is not a table written by :func:`write_intervention` raises
        ``ValueError`` naming it; ``"skip"``: it is left out with a warning naming it.
    :return: ``(table, n_other)``: the rows of every matching file in round order, arms as written (empty if
        none), and how many files of other runs were left out.
    """
    import pandas as pd

    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    frames, others = [], 0
    for path in sorted(Path(run_dir).rglob("intervention_round*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or "round" not in data:
                raise ValueError("no 'round' and 'rows'")
            frame = pd.DataFrame(data["rows"])
            if len(frame) and not {"arm", "round", "delta_target", "test_return"} <= set(frame.columns):
                raise ValueError(
                    f"rows lack columns {sorted({'arm', 'round', 'delta_target', 'test_return'} - set(frame.columns))}"
                )
        except (OSError, ValueError) as error:
            message = f"{path}: not an intervention table written by InterventionCallback ({error})"
            if on_error == "raise":
                raise ValueError(f"{message}; remove it, or skip damaged files (--skip-damaged)") from error
            warnings.warn(f"{message}; left out", stacklevel=2)
            continue
        if data.get("run_id") != run_id:
            others += 1
        elif len(frame):
            frames.append(frame)
    if not frames:
        return pd.DataFrame(), others
    return pd.concat(frames, ignore_index=True).sort_values("round", kind="stable"), others


class InterventionCallback(AnalysisCallback):
    """
    Run :func:`intervene` at chosen rounds of an ``InfluencePPO`` training; training itself is unaffected.

    :param rounds: Rounds to run at, numbered as the snapshots' ``round`` (the first rollout is round 0);
        ``None``: every round.
    :param eval_env: Environment for the test return (``None``: none measured).
    :param intervene_kwargs: Keyword arguments of :func:`intervene` (``arms``, ``fraction``, ``target``, ...).
    :param save_dir: Folder to write each round's table to, as ``intervention_round<k>.json`` with the run's id
        (give the ``save_dir`` of ``AttributionCallback`` and ``sb3-influence report`` plots them); ``None``: keep
        them in :attr:`results` only.
    :param verbose: 1 prints each round's table.
    :ivar results: One DataFrame per round, as :func:`intervene` returns.
    """

    def __init__(
        self,
        rounds: Sequence[int] | None = None,
        eval_env: Any = None,
        verbose: int = 0,
        *,
        save_dir: str | None = None,
        **intervene_kwargs: Any,
    ):
        super().__init__(rounds, verbose)
        if save_dir is not None and not isinstance(save_dir, (str, os.PathLike)):
            raise TypeError(f"save_dir must be a folder path or None, got {type(save_dir).__name__}")
        self.eval_env = eval_env
        self.save_dir = None if save_dir is None else os.fspath(save_dir)
        self.intervene_kwargs = intervene_kwargs
        self.results: list[pd.DataFrame] = []

    def _init_callback(self) -> None:
        super()._init_callback()
        if self.save_dir is not None:
            make_folder(self.save_dir, "InterventionCallback")

    def _on_round(self, index: int) -> None:
        table = intervene(self.model, eval_env=self.eval_env, **self.intervene_kwargs)  # type: ignore[arg-type]
        self.results.append(table)
        if self.save_dir is not None:
            write_intervention(self.save_dir, self.model, table)
        if self.verbose >= 1:
            print(table[["arm", "n_dropped", "delta_target", "delta_return"]].to_string(index=False))
