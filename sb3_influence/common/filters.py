"""
Drop rules: which records a round's filter removes, shared by ``IIFCallback`` (the paper's Sec. 5) and
``sb3_influence.analysis.intervention`` (Sec. 4.3).

A rule is a pure function ``rule(scores, fraction, rng) -> drop`` over the flat influence scores of one round:
``scores`` is a float array of shape ``(n,)``, ``fraction`` the IIF fraction ``p`` in ``[0, 1]`` and ``rng`` a
``np.random.Generator`` (only the random baselines draw from it). It returns a boolean mask of shape ``(n,)``,
``True`` for the records to drop. Rules never modify ``scores``.

Ranks are taken with a stable sort, so ties are broken by position and the result is deterministic.

The built-in rules are listed, read-only, in :data:`DROP_RULES`. A rule of your own is any callable with that
signature: pass it as ``IIFCallback(rule=my_rule)`` or as an ``intervene`` arm; nothing needs registering.
"""

from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import numpy as np

DropRule = Callable[[np.ndarray, float, np.random.Generator], np.ndarray]


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


def _check(scores: np.ndarray) -> np.ndarray:
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 1:
        raise ValueError(f"Drop rules take a flat score array of shape (n,), got shape {scores.shape}")
    if not np.all(np.isfinite(scores)):
        raise ValueError("Influence scores contain NaN or inf: cannot rank the records to drop")
    return scores


def drop_neg_bottom(scores: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """
    The paper's rule (Sec. 5): among the ``n_neg`` records with a negative score, drop the
    ``floor(fraction · n_neg)`` most negative. ``fraction = 1`` drops every negative record.

    :param scores: Flat influence scores, shape ``(n,)``.
    :param fraction: The fraction ``p`` of the negative records to drop.
    :param rng: Unused (the rule is deterministic).
    :return: Boolean drop mask, shape ``(n,)``.
    """
    scores = _check(scores)
    negative = np.flatnonzero(scores < 0)
    k = n_to_drop(fraction, len(negative))
    order = negative[np.argsort(scores[negative], kind="stable")]
    return _mask(len(scores), order[:k])


def drop_neg(scores: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """
    Drop every record with a negative score (the paper's intervention, Sec. 4.3). ``fraction`` is ignored.

    :param scores: Flat influence scores, shape ``(n,)``.
    :param fraction: Ignored.
    :param rng: Unused (the rule is deterministic).
    :return: Boolean drop mask, shape ``(n,)``.
    """
    return _check(scores) < 0


def drop_bottom(scores: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """
    Drop the ``floor(fraction · n)`` lowest-scored records of all ``n``, whatever their sign.

    :param scores: Flat influence scores, shape ``(n,)``.
    :param fraction: The fraction of all records to drop.
    :param rng: Unused (the rule is deterministic).
    :return: Boolean drop mask, shape ``(n,)``.
    """
    scores = _check(scores)
    k = n_to_drop(fraction, len(scores))
    return _mask(len(scores), np.argsort(scores, kind="stable")[:k])


def drop_random(scores: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """
    Baseline: drop as many records as ``"neg-bottom"`` would (``floor(fraction · n_neg)``), drawn uniformly
    among all records (with ``fraction = 1``: "a random drop of the same size" as all negatives, Sec. 4.3).

    :param scores: Flat influence scores, shape ``(n,)`` (only their signs are used, to size the drop).
    :param fraction: The fraction ``p`` of the negative records whose count is dropped.
    :param rng: The generator the records are drawn from.
    :return: Boolean drop mask, shape ``(n,)``.
    """
    scores = _check(scores)
    k = n_to_drop(fraction, int(np.count_nonzero(scores < 0)))
    return _mask(len(scores), rng.choice(len(scores), size=k, replace=False))


def drop_neg_random(scores: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """
    Baseline: drop ``floor(fraction · n_neg)`` records drawn uniformly among the negative ones.

    :param scores: Flat influence scores, shape ``(n,)``.
    :param fraction: The fraction ``p`` of the negative records to drop.
    :param rng: The generator the records are drawn from.
    :return: Boolean drop mask, shape ``(n,)``.
    """
    scores = _check(scores)
    negative = np.flatnonzero(scores < 0)
    k = n_to_drop(fraction, len(negative))
    return _mask(len(scores), rng.choice(negative, size=k, replace=False))


def drop_top(scores: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """
    Drop the ``floor(fraction · n)`` highest-scored records of all ``n`` (a control: removes the most helpful).

    :param scores: Flat influence scores, shape ``(n,)``.
    :param fraction: The fraction of all records to drop.
    :param rng: Unused (the rule is deterministic).
    :return: Boolean drop mask, shape ``(n,)``.
    """
    scores = _check(scores)
    k = n_to_drop(fraction, len(scores))
    return _mask(len(scores), np.argsort(-scores, kind="stable")[:k])


def drop_uniform(scores: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """
    Baseline: drop ``floor(fraction · n)`` records drawn uniformly among all ``n`` (the size of ``"bottom"``).

    :param scores: Flat influence scores, shape ``(n,)`` (only their number is used).
    :param fraction: The fraction of all records to drop.
    :param rng: The generator the records are drawn from.
    :return: Boolean drop mask, shape ``(n,)``.
    """
    scores = _check(scores)
    return _mask(len(scores), rng.choice(len(scores), size=n_to_drop(fraction, len(scores)), replace=False))


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


def get_drop_rule(rule: str) -> DropRule:
    """
    The built-in drop function registered under ``rule``.

    :param rule: One of the keys of :data:`DROP_RULES`.
    :return: The drop function.
    """
    if not isinstance(rule, str):
        raise TypeError(f"get_drop_rule takes a rule name, one of {sorted(DROP_RULES)}; got {type(rule).__name__}")
    return resolve_drop_rule(rule, owner="get_drop_rule")
