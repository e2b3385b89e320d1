"""
Rank and linear correlations that return ``nan`` instead of raising or warning when either side is constant.

Every correlation the package reports (LDS, the formation association, the report's columns, the faithfulness
benchmark's per-record agreement) goes through these two functions.
"""

import numpy as np


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """
    Spearman rank correlation of two equally long 1-D arrays.

    :param x: Values, any shape (flattened).
    :param y: Values of the same items, same size.
    :return: The correlation; ``nan`` with fewer than two items or when either side is constant.
    """
    from scipy.stats import spearmanr

    x = np.asarray(x, dtype=np.float64).reshape(-1)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    _check_sizes(x, y)
    if x.size < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(spearmanr(x, y).statistic)


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """
    Pearson correlation of two equally long 1-D arrays.

    :param x: Values, any shape (flattened).
    :param y: Values of the same items, same size.
    :return: The correlation; ``nan`` with fewer than two items or when either side is constant.
    """
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    _check_sizes(x, y)
    x = x - x.mean() if x.size else x
    y = y - y.mean() if y.size else y
    denominator = float(np.sqrt((x * x).sum() * (y * y).sum()))
    return float((x * y).sum() / denominator) if denominator > 0 else float("nan")


def _check_sizes(x: np.ndarray, y: np.ndarray) -> None:
    if x.size != y.size:
        raise ValueError(f"a correlation needs the same items on both sides, got {x.size} and {y.size} values")
