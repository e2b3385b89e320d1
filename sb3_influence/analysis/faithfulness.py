"""
How faithful is a score? The linear datamodeling score (LDS) of one round, by counterfactual retraining.

For random subsets S of the round's records, retrain the round from θ(k) without S and measure the change of the
target, ``Δf_S = f(θ_S) − f(θ_full)``. Two ways to leave S out (``drop_mode``): ``"remove"`` (the records are
removed and the rest re-batched, which is what IIF does) and ``"zero-weight"`` (the records stay in their
minibatches, in the same order, with their loss weighted 0: the counterfactual that first-order scores describe,
without the re-batching).
A faithful score predicts it: ``Δf_S ≈ −Σ_{i∈S} I_i``. The LDS is the Spearman correlation of prediction and truth
over the subsets (as dattri and TRAK define it); the Pearson correlation is reported too.

Under Adam one retrain's outcome depends on the minibatch order (dropping records re-batches everything), so the
truth is averaged over several orders, and the split-half reliability of that average (Spearman–Brown corrected)
bounds what any score can reach: ``ceiling ≈ √reliability``. :func:`faithfulness` also measures the effect of
dropping each score's bottom and top 5 %, in standard deviations of random drops of the same size.

Every retrain starts from the round's captured training state and the model is left exactly as it was found
(:func:`sb3_influence.common.state.training_state`).
"""

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch as th

from sb3_influence.analysis.intervention import target_value
from sb3_influence.common import sb3_compat
from sb3_influence.common.progress import Progress
from sb3_influence.common.scoring.unrolled import unrolled_replay
from sb3_influence.common.state import training_state
from sb3_influence.common.stats import pearson, spearman
from sb3_influence.common.targets import Target, as_target

#: How a retrain leaves records out: removed and the rest re-batched, or kept in place with loss weight 0.
DROP_MODES = ("remove", "zero-weight")


def check_drop_mode(model: Any, drop_mode: str) -> None:
    """
    Raise ``ValueError`` for an unknown ``drop_mode``, or ``"zero-weight"`` on a model whose update cannot be
    replayed with record weights (not PPO, or ``target_kl`` early stopping), naming the fix.
    """
    if drop_mode not in DROP_MODES:
        raise ValueError(f"drop_mode must be one of {DROP_MODES}, got {drop_mode!r}")
    if drop_mode == "zero-weight":
        if not getattr(model, "unrolled_update", False):
            raise ValueError(
                f"drop_mode='zero-weight' replays PPO's update with record weights; {type(model).__name__} has no such "
                "replay: use drop_mode='remove'"
            )
        if model.target_kl is not None:
            raise ValueError(
                "drop_mode='zero-weight' does not replay target_kl early stopping: set target_kl=None on the model or use "
                "drop_mode='remove'"
            )


def retrained_target(
    model: Any, drop: np.ndarray, order_seed: int, target: str | Target = "return", drop_mode: str = "remove"
) -> float:
    """
    ``f`` after retraining the model's current round from θ(k) without the records ``drop``, with the minibatch
    orders drawn from ``order_seed`` (the first epoch's too).

    :param model: An influence algorithm whose buffer holds the round.
    :param drop: Boolean mask ``(n_steps, n_envs)`` of records to leave out.
    :param order_seed: Seed of the minibatch orders.
    :param target: The target measured after the retrain.
    :param drop_mode: ``"remove"``: the model's own update on the other records (re-batched, as IIF trains).
        ``"zero-weight"``: every record stays in its minibatch, in the order of ``order_seed``, and the left-out ones
        have loss weight 0 (the update's differentiable replay, :func:`~sb3_influence.common.scoring.unrolled.
        unrolled_replay`, which lands on the real update's parameters when nothing is left out; the minibatch's
        advantage normalisation still counts them). PPO (``InfluencePPO``, ``InfluenceMaskablePPO``) with
        ``target_kl=None`` only.
    :return: The target's value.
    """
    from stable_baselines3.common.logger import Logger

    check_drop_mode(model, drop_mode)
    round_ = model.current_round()
    buffer = model.rollout_buffer
    permutation = round_.first_permutation
    with training_state(model) as now:
        base_keep = buffer.keep.copy() if now.keep is None else now.keep
        round_.start_state.restore(model, keep=False)
        buffer.keep[...] = base_keep & ~drop if drop_mode == "remove" else base_keep
        sb3_compat.set_model_logger(model, Logger(folder=None, output_formats=[]))
        np.random.seed(order_seed)
        round_.first_permutation = np.random.permutation(buffer.n_records)
        try:
            if drop_mode == "zero-weight":
                weights = th.as_tensor(~buffer.to_flat(drop), dtype=th.float64)
                theta = unrolled_replay(model, weights, order_seed=order_seed)
                with th.no_grad():
                    for name, param in model.policy.named_parameters():
                        param.copy_(theta[name])
            elif buffer.keep.any():
                model.update()
            return target_value(model, target)
        finally:
            round_.first_permutation = permutation


def _measured_round(model: Any, target: str | Target, drop_mode: str) -> tuple[Target, tuple[int, int], np.ndarray]:
    """Check a measurement's arguments; return its target, the buffer's shape and the flat indices of kept records."""
    check_drop_mode(model, drop_mode)
    keep = model.rollout_buffer.keep
    return as_target(target), keep.shape, np.flatnonzero(keep.reshape(-1))


def _order_seeds(rng: np.random.Generator, n_orders: int) -> np.ndarray:
    """The minibatch-order seeds of a measurement: the first draw of its generator."""
    return rng.integers(0, 2**31 - 1, size=n_orders)


def _retrain(
    model: Any, drop: np.ndarray, order_seeds: np.ndarray, target: Target, drop_mode: str, reporter: Progress
) -> np.ndarray:
    """``f`` after retraining without ``drop`` under each of the orders."""
    values = []
    for order_seed in order_seeds:
        values.append(retrained_target(model, drop, int(order_seed), target, drop_mode))
        reporter.update(1)
    return np.array(values)


def leave_one_out(
    model: Any,
    n_orders: int = 4,
    target: str | Target = "return",
    seed: int = 0,
    progress: bool = False,
    drop_mode: str = "remove",
) -> np.ndarray:
    """
    The measured effect of leaving out each record alone, in the sign of an influence score:
    ``I_i = −mean_o [f(θ_{−i}, o) − f(θ, o)]`` over the minibatch orders ``o`` (positive: the record helped ``f``).

    Passed to :func:`faithfulness` as one more score, with the same ``seed``, ``n_orders``, ``target`` and
    ``drop_mode`` (so the same orders), its LDS is what an *additive* score reaches when it knows every record's
    true effect alone: the prediction ``−Σ_{i∈S} I_i`` is then the sum of the measured single-record effects.
    The gap between that LDS and the ceiling is what the records do together (group effects); the gap between a
    score's LDS and it is what the score gets wrong about records one at a time. Costs one retrain per kept
    record and order (plus one reference per order).

    :param model: An influence algorithm whose buffer holds round k (see :func:`faithfulness`).
    :param n_orders: Minibatch orders averaged over (the first ``n_orders`` orders of ``faithfulness(seed=seed)``).
    :param target: The target whose change is measured.
    :param seed: Seed of the orders; use the one given to :func:`faithfulness`.
    :param progress: Show the retrains done and an ETA.
    :param drop_mode: How a retrain leaves the record out (see :func:`retrained_target`).
    :return: Scores of shape ``(n_steps, n_envs)``; 0 for records the buffer does not keep.
    """
    if isinstance(n_orders, bool) or not isinstance(n_orders, (int, np.integer)) or n_orders < 1:
        raise ValueError(f"n_orders must be an integer of at least 1, got {n_orders!r}")
    target, shape, kept = _measured_round(model, target, drop_mode)
    order_seeds = _order_seeds(np.random.default_rng(seed), n_orders)
    reporter = Progress(n_orders * (1 + len(kept)), unit="retrain", desc="leave-one-out", enabled=progress)
    reference = _retrain(model, np.zeros(shape, dtype=bool), order_seeds, target, drop_mode, reporter)
    scores = np.zeros(shape[0] * shape[1], dtype=np.float64)
    for record in kept:
        drop = np.zeros(shape[0] * shape[1], dtype=bool)
        drop[record] = True
        scores[record] = -float(
            np.mean(_retrain(model, drop.reshape(shape), order_seeds, target, drop_mode, reporter) - reference)
        )
    reporter.close()
    return scores.reshape(shape)


def noise_floor(truths: np.ndarray) -> float:
    """
    The same drops under another minibatch order: the mean Spearman correlation, over every pair of orders, of the
    subsets' Δf under one order with their Δf under the other. It is the LDS that one retrain's outcome would get as
    a predictor of another's: a score below it predicts a single retrain worse than the order's own noise does.

    :param truths: Δf, subsets × orders (≥ 2 orders).
    :return: The mean pairwise Spearman correlation.
    """
    truths = np.asarray(truths, dtype=np.float64)
    if truths.ndim != 2 or truths.shape[1] < 2:
        raise ValueError(f"truths must be subsets x orders with at least 2 orders, got shape {truths.shape}")
    pairs = [(a, b) for a in range(truths.shape[1]) for b in range(a + 1, truths.shape[1])]
    return float(np.mean([spearman(truths[:, a], truths[:, b]) for a, b in pairs]))


def faithfulness(
    model: Any,
    scores: Mapping[str, np.ndarray],
    sizes: tuple[float, ...] = (0.01, 0.05, 0.2),
    n_subsets: int = 100,
    n_orders: int = 4,
    target: str | Target = "return",
    seed: int = 0,
    progress: bool = False,
    drop_mode: str = "remove",
) -> dict[str, Any]:
    """
    LDS, Pearson correlation and extreme-drop effects of several scores of the model's current round.

    :param model: An influence algorithm whose buffer holds round k (call it at θ(k), or after the update: every
        retrain starts from the round's captured state).
    :param scores: Score name → scores of shape ``(n_steps, n_envs)`` (from ``compute_influence``).
    :param sizes: Subset sizes, as fractions of the kept records.
    :param n_subsets: Random subsets per size.
    :param n_orders: Minibatch orders the truth is averaged over (≥ 2 for the reliability).
    :param target: The target whose change is measured (the one the scores are for).
    :param seed: Seed of the subsets and the orders.
    :param progress: Show the retrains done and an ETA (:class:`~sb3_influence.common.progress.Progress`: a tqdm
        bar on a terminal, else a plain line on stdout every 30 s); it changes no result.
    :param drop_mode: How every retrain leaves its records out: ``"remove"`` (re-batched, as IIF trains) or
        ``"zero-weight"`` (kept in their minibatches with loss weight 0); see :func:`retrained_target`.
    :return: Dict with ``per_size`` (one dict per size: ``lds`` and ``pearson`` by score, ``reliability``, ``ceiling``,
        ``noise_floor``), ``lds``/``pearson`` over all subsets by score, ``reliability``, ``ceiling``, ``noise_floor``
        (:func:`noise_floor`), ``extremes`` (per score, effect of
        dropping its bottom/top 5 % in standard deviations of random 5 % drops), ``n_retrains``, ``drop_mode``,
        ``order_seeds`` (the seeds of the minibatch orders, as :func:`retrained_target` takes them).
    """
    if n_orders < 2:
        raise ValueError(f"n_orders must be at least 2 (the split-half reliability needs two halves), got {n_orders}")
    if n_subsets < 3:
        raise ValueError(f"n_subsets must be at least 3 (a correlation needs points), got {n_subsets}")
    target, shape, kept = _measured_round(model, target, drop_mode)
    rng = np.random.default_rng(seed)
    order_seeds = _order_seeds(rng, n_orders)
    # reference + subsets + random 5 % drops + bottom/top of each score, each under every order
    planned = n_orders * (1 + len(sizes) * n_subsets + max(5, n_subsets // 10) + 2 * len(scores))
    reporter = Progress(planned, unit="retrain", desc="faithfulness", enabled=progress)

    def retrain(drop: np.ndarray) -> np.ndarray:
        return _retrain(model, drop, order_seeds, target, drop_mode, reporter)

    reference = retrain(np.zeros(shape, dtype=bool))
    n_retrains = n_orders

    def truth(drop: np.ndarray) -> np.ndarray:
        nonlocal n_retrains
        n_retrains += n_orders
        return retrain(drop) - reference

    flat_scores = {name: np.asarray(value, dtype=np.float64).reshape(-1) for name, value in scores.items()}
    rows_prediction: dict[str, list[float]] = {name: [] for name in flat_scores}
    rows_truth: list[np.ndarray] = []
    per_size = []
    for size in sizes:
        k = max(1, round(size * len(kept)))
        predictions: dict[str, list[float]] = {name: [] for name in flat_scores}
        truths = []
        for _ in range(n_subsets):
            chosen = rng.choice(kept, size=k, replace=False)
            drop = np.zeros(shape[0] * shape[1], dtype=bool)
            drop[chosen] = True
            truths.append(truth(drop.reshape(shape)))
            for name, values in flat_scores.items():
                predictions[name].append(-float(values[chosen].sum()))
        truth_array = np.array(truths)
        mean_truth = truth_array.mean(axis=1)
        half = n_orders // 2
        split = spearman(truth_array[:, :half].mean(axis=1), truth_array[:, half:].mean(axis=1))
        reliability = 2 * split / (1 + split) if split > -1 else float("nan")
        per_size.append(
            {
                "size": size,
                "k": k,
                "lds": {name: spearman(np.array(p), mean_truth) for name, p in predictions.items()},
                "pearson": {name: pearson(np.array(p), mean_truth) for name, p in predictions.items()},
                "reliability": reliability,
                "ceiling": float(np.sqrt(max(reliability, 0.0))),
                "noise_floor": noise_floor(truth_array),
                "truth_std": float(mean_truth.std()),
            }
        )
        rows_truth.extend(truth_array)
        for name in flat_scores:
            rows_prediction[name].extend(predictions[name])
    all_truth = np.array(rows_truth)
    half = n_orders // 2
    split = spearman(all_truth[:, :half].mean(axis=1), all_truth[:, half:].mean(axis=1))
    reliability = 2 * split / (1 + split) if split > -1 else float("nan")

    # Drop the bottom / top 5 % of each score, against random drops of that size
    k = max(1, round(0.05 * len(kept)))
    random_effects = []
    for _ in range(max(5, n_subsets // 10)):
        drop = np.zeros(shape[0] * shape[1], dtype=bool)
        drop[rng.choice(kept, size=k, replace=False)] = True
        random_effects.append(truth(drop.reshape(shape)).mean())
    random_mean, random_std = float(np.mean(random_effects)), float(np.std(random_effects) + 1e-30)
    extremes = {}
    for name, values in flat_scores.items():
        order = kept[np.argsort(values[kept], kind="stable")]
        effects = {}
        for label, chosen in (("bottom", order[:k]), ("top", order[len(order) - k :])):
            drop = np.zeros(shape[0] * shape[1], dtype=bool)
            drop[chosen] = True
            effects[label] = (float(truth(drop.reshape(shape)).mean()) - random_mean) / random_std
        extremes[name] = effects
    reporter.close()
    return {
        "per_size": per_size,
        "lds": {name: spearman(np.array(p), all_truth.mean(axis=1)) for name, p in rows_prediction.items()},
        "pearson": {name: pearson(np.array(p), all_truth.mean(axis=1)) for name, p in rows_prediction.items()},
        "reliability": reliability,
        "ceiling": float(np.sqrt(max(reliability, 0.0))),
        "noise_floor": noise_floor(all_truth),
        "extremes": extremes,
        "n_retrains": n_retrains,
        "drop_mode": drop_mode,
        "order_seeds": [int(order_seed) for order_seed in order_seeds],
    }
