import numpy as np
import pytest

from sb3_influence.common.stats import pearson, spearman


def _ranks(values: np.ndarray) -> np.ndarray:
    """Average ranks by brute force (ties share the mean of their positions)."""
    ranks = np.empty(len(values))
    for i, value in enumerate(values):
        below = np.sum(values < value)
        equal = np.sum(values == value)
        ranks[i] = below + (equal + 1) / 2
    return ranks


def test_correlations_match_brute_force_with_ties():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, size=40).astype(float)  # many ties
    y = x + rng.normal(size=40)
    assert pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-14)
    assert spearman(x, y) == pytest.approx(np.corrcoef(_ranks(x), _ranks(y))[0, 1], abs=1e-14)
    # any shape is flattened
    assert spearman(x.reshape(8, 5), y.reshape(8, 5)) == spearman(x, y)


@pytest.mark.parametrize("correlation", [pearson, spearman])
def test_degenerate_inputs_give_nan_and_mismatched_sizes_raise(correlation):
    assert np.isnan(correlation(np.ones(5), np.arange(5.0)))
    assert np.isnan(correlation(np.arange(5.0), np.zeros(5)))
    assert np.isnan(correlation(np.array([1.0]), np.array([2.0])))
    with pytest.raises(ValueError, match="same items"):
        correlation(np.arange(4.0), np.arange(5.0))
