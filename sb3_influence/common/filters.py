"""
Drop rules: which records a round's filter removes, shared by ``IIFCallback`` (the paper's Sec. 5) and
``sb3_influence.analysis.intervention`` (Sec. 4.3).

A rule is a pure function ``rule(scores, fraction, rng, sizes=None) -> drop`` over the flat influence scores of
one round's units: ``scores`` is a float array of shape ``(n,)``, ``fraction`` the IIF fraction ``p`` in ``[0, 1]``
and ``rng`` a ``np.random.Generator`` (only the random baselines draw from it). It returns a boolean mask of shape
``(n,)``, ``True`` for the units to drop. Rules never modify ``scores``.

``sizes`` (optional, integers of shape ``(n,)``) gives the number of records in each unit when the units are
trajectories and the drop is budgeted in records (``IIFCallback(unit="trajectory", budget="records")``). The
built-in rules then size their drop in records, ``floor(fraction · records of the counted units)``, and take
whole units in their order until the dropped units hold at least that many records (the last unit may overshoot,
so a rule with a budget of one record or more drops at least one unit). Without ``sizes`` every unit counts as
one record: the budget is ``floor(fraction · units)`` units, as the paper's rule on records.

Ranks are taken with a stable sort, so ties are broken by position and the result is deterministic.

The built-in rules are listed, read-only, in :data:`DROP_RULES`. A rule of your own is any callable with that
signature: pass it as ``IIFCallback(rule=my_rule)`` or as an ``intervene`` arm; nothing needs registering.
"""

import inspect
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import numpy as np

DropRule = Callable[..., np.ndarray]


def n_to_drop(fraction: float, n: int) -> int:
    """
    ``floor(fraction · n)``, robust to floating-point error (``0.29 · 100`` is 29, not 28).

    :param fraction: The fraction in ``[0, 1]``.
    :param n: The number of candidate records.
    :return: How many of the ``n`` records to drop.
    """
    return min(n, int(np.floor(fraction * n + 1e-9)))


def _mask(n: int, drop_ids: np.ndarray) -> np.ndarray:
    drop = np.zeros(n, dtype=bool)
    drop[drop_ids] = True
    return drop


def _check(scores: np.ndarray, sizes: np.ndarray | None = None) -> np.ndarray:
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 1:
        raise ValueError(f"Drop rules take a flat score array of shape (n,), got shape {scores.shape}")
    if not np.all(np.isfinite(scores)):
        raise ValueError("Influence scores contain NaN or inf: cannot rank the records to drop")
    if sizes is not None:
        sizes = np.asarray(sizes)
        if sizes.shape != scores.shape or not np.issubdtype(sizes.dtype, np.integer) or np.any(sizes < 1):
            raise ValueError(
                f"sizes must be positive integers, one per unit (shape {scores.shape}), got dtype {sizes.dtype} and "
                f"shape {sizes.shape}"
            )
    return scores


def _budget(fraction: float, counted: np.ndarray, sizes: np.ndarray | None) -> int:
    """``floor(fraction · c)``, ``c`` the number of ``counted`` units, or of their records with ``sizes``."""
    return n_to_drop(fraction, len(counted) if sizes is None else int(np.sum(np.asarray(sizes)[counted])))


def _take(n: int, order: np.ndarray, budget: int, sizes: np.ndarray | None) -> np.ndarray:
    """
    The drop mask of the first units of ``order``: ``budget`` units without ``sizes``; with ``sizes``, units until
    they hold at least ``budget`` records (all of ``order`` if it holds fewer).
    """
    if sizes is None:
        return _mask(n, order[:budget])
    if budget <= 0:
        return _mask(n, order[:0])
    covered = np.cumsum(np.asarray(sizes)[order])
    return _mask(n, order[: int(np.searchsorted(covered, budget, side="left")) + 1])


def drop_neg_bottom(
    scores: np.ndarray, fraction: float, rng: np.random.Generator, sizes: np.ndarray | None = None
) -> np.ndarray:
    """
    The paper's rule (Sec. 5): among the ``n_neg`` units with a negative score, drop the
    ``floor(fraction · n_neg)`` most negative. ``fraction = 1`` drops every negative unit.

    :param scores: Flat influence scores, shape ``(n,)``.
    :param fraction: The fraction ``p`` of the negative units (their records, with ``sizes``) to drop.
    :param rng: Unused (the rule is deterministic).
    :param sizes: Records per unit, or ``None`` (see the module's docstring).
    :return: Boolean drop mask, shape ``(n,)``.
    """
    scores = _check(scores, sizes)
    negative = np.flatnonzero(scores < 0)
    order = negative[np.argsort(scores[negative], kind="stable")]
    return _take(len(scores), order, _budget(fraction, negative, sizes), sizes)


def drop_neg(scores: np.ndarray, fraction: float, rng: np.random.Generator, sizes: np.ndarray | None = None) -> np.ndarray:
    """
    Drop every unit with a negative score (the paper's intervention, Sec. 4.3). ``fraction`` is ignored.

    :param scores: Flat influence scores, shape ``(n,)``.
    :param fraction: Ignored.
    :param rng: Unused (the rule is deterministic).
    :param sizes: Checked, otherwise unused.
    :return: Boolean drop mask, shape ``(n,)``.
    """
    return _check(scores, sizes) < 0


def drop_bottom(scores: np.ndarray, fraction: float, rng: np.random.Generator, sizes: np.ndarray | None = None) -> np.ndarray:
    """
    Drop the ``floor(fraction · n)`` lowest-scored units of all ``n``, whatever their sign.

    :param scores: Flat influence scores, shape ``(n,)``.
    :param fraction: The fraction of all units (records, with ``sizes``) to drop.
    :param rng: Unused (the rule is deterministic).
    :param sizes: Records per unit, or ``None`` (see the module's docstring).
    :return: Boolean drop mask, shape ``(n,)``.
    """
    scores = _check(scores, sizes)
    every = np.arange(len(scores))
    return _take(len(scores), np.argsort(scores, kind="stable"), _budget(fraction, every, sizes), sizes)


def drop_top(scores: np.ndarray, fraction: float, rng: np.random.Generator, sizes: np.ndarray | None = None) -> np.ndarray:
    """
    Drop the ``floor(fraction · n)`` highest-scored units of all ``n`` (a control: removes the most helpful).

    :param scores: Flat influence scores, shape ``(n,)``.
    :param fraction: The fraction of all units (records, with ``sizes``) to drop.
    :param rng: Unused (the rule is deterministic).
    :param sizes: Records per unit, or ``None`` (see the module's docstring).
    :return: Boolean drop mask, shape ``(n,)``.
    """
    scores = _check(scores, sizes)
    every = np.arange(len(scores))
    return _take(len(scores), np.argsort(-scores, kind="stable"), _budget(fraction, every, sizes), sizes)


def _random_take(n: int, pool: np.ndarray, budget: int, rng: np.random.Generator, sizes: np.ndarray | None) -> np.ndarray:
    """Units of ``pool`` drawn uniformly without replacement, ``budget`` of them (records, with ``sizes``)."""
    if sizes is None:
        return _mask(n, rng.choice(pool, size=budget, replace=False))
    return _take(n, rng.permutation(pool), budget, sizes)


def drop_random(scores: np.ndarray, fraction: float, rng: np.random.Generator, sizes: np.ndarray | None = None) -> np.ndarray:
    """
    Baseline: drop as many units as ``"neg-bottom"`` would (``floor(fraction · n_neg)``; records, with ``sizes``),
    drawn uniformly among all (with ``fraction = 1``: "a random drop of the same size" as all negatives, Sec. 4.3).

    :param scores: Flat influence scores, shape ``(n,)`` (only their signs are used, to size the drop).
    :param fraction: The fraction ``p`` of the negative units whose count is dropped.
    :param rng: The generator the units are drawn from.
    :param sizes: Records per unit, or ``None`` (see the module's docstring).
    :return: Boolean drop mask, shape ``(n,)``.
    """
    scores = _check(scores, sizes)
    budget = _budget(fraction, np.flatnonzero(scores < 0), sizes)
    return _random_take(len(scores), np.arange(len(scores)), budget, rng, sizes)


def drop_neg_random(
    scores: np.ndarray, fraction: float, rng: np.random.Generator, sizes: np.ndarray | None = None
) -> np.ndarray:
    """
    Baseline: drop ``floor(fraction · n_neg)`` units (records, with ``sizes``) drawn uniformly among the negative ones.

    :param scores: Flat influence scores, shape ``(n,)``.
    :param fraction: The fraction ``p`` of the negative units to drop.
    :param rng: The generator the units are drawn from.
    :param sizes: Records per unit, or ``None`` (see the module's docstring).
    :return: Boolean drop mask, shape ``(n,)``.
    """
    scores = _check(scores, sizes)
    negative = np.flatnonzero(scores < 0)
    return _random_take(len(scores), negative, _budget(fraction, negative, sizes), rng, sizes)


def drop_uniform(scores: np.ndarray, fraction: float, rng: np.random.Generator, sizes: np.ndarray | None = None) -> np.ndarray:
    """
    Baseline: drop ``floor(fraction · n)`` units (records, with ``sizes``) drawn uniformly among all ``n`` (the size
    of ``"bottom"``).

    :param scores: Flat influence scores, shape ``(n,)`` (only their number is used).
    :param fraction: The fraction of all units to drop.
    :param rng: The generator the units are drawn from.
    :param sizes: Records per unit, or ``None`` (see the module's docstring).
    :return: Boolean drop mask, shape ``(n,)``.
    """
    scores = _check(scores, sizes)
    every = np.arange(len(scores))
    return _random_take(len(scores), every, _budget(fraction, every, sizes), rng, sizes)


#: Built-in rules by name (read-only): ``IIFCallback(rule=name)``.
DROP_RULES: "MappingProxyType[str, DropRule]" = MappingProxyType(
    {
        "neg-bottom": drop_neg_bottom,
        "neg": drop_neg,
        "bottom": drop_bottom,
        "top": drop_top,
        "random": drop_random,
        "neg-random": drop_neg_random,
        "uniform": drop_uniform,
    }
)


def resolve_drop_rule(rule: Any, owner: str = "rule") -> DropRule:
    """
    The drop function for a rule name of :data:`DROP_RULES`, or a callable rule itself.

    :param rule: A name, or a callable ``rule(scores, fraction, rng) -> drop mask``.
    :param owner: Who asks (named in the error message).
    :return: The drop function.
    """
    if isinstance(rule, str):
        if rule not in DROP_RULES:
            raise ValueError(f"{owner}: unknown rule {rule!r}, use one of {sorted(DROP_RULES)} or a callable DropRule")
        return DROP_RULES[rule]
    if callable(rule):
        return rule
    raise TypeError(
        f"{owner}: rule must be a name of {sorted(DROP_RULES)} or a callable rule(scores, fraction, rng) -> drop mask, "
        f"got {type(rule).__name__}"
    )


def takes_sizes(rule: DropRule) -> bool:
    """Whether a rule accepts the ``sizes`` keyword (every built-in rule does; a rule of your own may not)."""
    try:
        parameters = inspect.signature(rule).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "sizes" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def get_drop_rule(rule: str) -> DropRule:
    """
    The built-in drop function registered under ``rule``.

    :param rule: One of the keys of :data:`DROP_RULES`.
    :return: The drop function.
    """
    if not isinstance(rule, str):
        raise TypeError(f"get_drop_rule takes a rule name, one of {sorted(DROP_RULES)}; got {type(rule).__name__}")
    return resolve_drop_rule(rule, owner="get_drop_rule")
