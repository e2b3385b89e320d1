"""IIF drop rules as pure functions: exact counts, which records, reproducible random baselines."""

import numpy as np
import pytest

from sb3_influence.common.filters import DROP_RULES, get_drop_rule, n_to_drop, resolve_drop_rule


def _scores(n_neg: int, n_pos: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scores = np.concatenate([-rng.uniform(0.1, 5.0, n_neg), rng.uniform(0.1, 5.0, n_pos), np.zeros(3)])
    return rng.permutation(scores)


@pytest.mark.parametrize("fraction", [0.0, 0.0625, 0.125, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("n_neg", [0, 1, 7, 40])
def test_neg_bottom_drops_floor_fraction_of_negatives_most_negative_first(fraction, n_neg):
    scores = _scores(n_neg, 25)
    drop = get_drop_rule("neg-bottom")(scores, fraction, np.random.default_rng(0))
    assert drop.dtype == bool and drop.shape == scores.shape
    assert drop.sum() == int(np.floor(fraction * n_neg + 1e-9))
    if drop.any():
        # Every dropped record is negative and more negative than every kept negative record
        assert (scores[drop] < 0).all()
        kept_negative = scores[~drop & (scores < 0)]
        if kept_negative.size:
            assert scores[drop].max() <= kept_negative.min()


def test_neg_drops_every_negative_and_nothing_else():
    scores = _scores(13, 20)
    for fraction in (0.0, 0.5, 1.0):
        drop = get_drop_rule("neg")(scores, fraction, np.random.default_rng(0))
        np.testing.assert_array_equal(drop, scores < 0)


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.25, 0.99])
def test_bottom_drops_lowest_fraction_of_all(fraction):
    scores = _scores(5, 30)
    drop = get_drop_rule("bottom")(scores, fraction, np.random.default_rng(0))
    k = int(np.floor(fraction * len(scores) + 1e-9))
    assert drop.sum() == k
    np.testing.assert_array_equal(np.sort(scores[drop]), np.sort(scores)[:k])


@pytest.mark.parametrize("rule", ["random", "neg-random"])
def test_random_rules_size_reproducibility_and_support(rule):
    scores = _scores(30, 50)
    n_neg = int((scores < 0).sum())
    drop_a = get_drop_rule(rule)(scores, 0.5, np.random.default_rng(123))
    drop_b = get_drop_rule(rule)(scores, 0.5, np.random.default_rng(123))
    drop_c = get_drop_rule(rule)(scores, 0.5, np.random.default_rng(124))
    assert drop_a.sum() == n_neg // 2
    np.testing.assert_array_equal(drop_a, drop_b)
    assert not np.array_equal(drop_a, drop_c)
    if rule == "neg-random":
        assert (scores[drop_a] < 0).all()


def test_random_rule_draws_among_all_records():
    # Over many draws, "random" drops positive records too (it is the size-matched baseline, not a negative filter)
    scores = _scores(20, 60)
    rng = np.random.default_rng(0)
    hits = sum(get_drop_rule("random")(scores, 1.0, rng)[scores > 0].sum() for _ in range(20))
    assert hits > 0


def test_rules_do_not_modify_scores_and_break_ties_deterministically():
    scores = np.array([-1.0, -1.0, -1.0, -1.0, 2.0])
    copy = scores.copy()
    for name, rule in DROP_RULES.items():
        rule(scores, 0.5, np.random.default_rng(0))
        np.testing.assert_array_equal(scores, copy, err_msg=name)
    # Stable sort: ties go by position
    np.testing.assert_array_equal(get_drop_rule("neg-bottom")(scores, 0.5, None), [True, True, False, False, False])


def test_n_to_drop_is_robust_to_float_error():
    assert n_to_drop(0.29, 100) == 29  # 0.29 * 100 == 28.999999999999996
    assert n_to_drop(0.5, 7) == 3
    assert n_to_drop(1.0, 7) == 7
    assert n_to_drop(0.0, 7) == 0


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown rule 'worst'"):
        get_drop_rule("worst")
    with pytest.raises(ValueError, match="flat score array"):
        get_drop_rule("neg-bottom")(np.zeros((2, 2)), 0.5, np.random.default_rng(0))
    with pytest.raises(ValueError, match="NaN"):
        get_drop_rule("bottom")(np.array([0.0, np.nan]), 0.5, np.random.default_rng(0))


def test_top_and_uniform_rules():
    scores = np.array([3.0, -1.0, 0.5, -2.0, 4.0, 0.0, 1.0, -0.5, 2.0, -3.0])
    top = get_drop_rule("top")(scores, 0.2, None)
    assert set(scores[top]) == {4.0, 3.0}
    uniform = get_drop_rule("uniform")(scores, 0.3, np.random.default_rng(0))
    assert uniform.sum() == 3


def test_registry_is_read_only_and_own_rules_plug_in():
    with pytest.raises(TypeError):
        DROP_RULES["mine"] = lambda scores, fraction, rng: scores < 0  # type: ignore[index]

    def drop_largest_magnitude(scores, fraction, rng):
        return np.abs(scores) == np.abs(scores).max()

    scores = np.array([0.1, -5.0, 2.0])
    assert resolve_drop_rule(drop_largest_magnitude) is drop_largest_magnitude
    np.testing.assert_array_equal(resolve_drop_rule("neg")(scores, 0.0, None), [False, True, False])
    with pytest.raises(TypeError, match="rule must be a name"):
        resolve_drop_rule(3.0)


# Rules budgeted in records over units of several records (trajectories): rule -> (order, drawn from, budget of)
_SIZED = {
    "neg-bottom": ("ascending", "negative", "negative"),
    "bottom": ("ascending", "all", "all"),
    "top": ("descending", "all", "all"),
    "random": ("random", "all", "negative"),
    "neg-random": ("random", "negative", "negative"),
    "uniform": ("random", "all", "all"),
}


@pytest.mark.parametrize("rule", sorted(_SIZED))
@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.125, 0.5, 1.0])
def test_sized_rules_take_whole_units_until_the_record_budget(rule, fraction):
    scores = _scores(9, 6, seed=3)
    sizes = np.random.default_rng(7).integers(1, 40, size=scores.shape)
    drop = get_drop_rule(rule)(scores, fraction, np.random.default_rng(11), sizes=sizes)
    order_key, drawn_from, budget_of = _SIZED[rule]
    negative = scores < 0
    # The budget in records, by brute force: one entry per record of the counted units
    budget = int(
        np.floor(fraction * np.repeat(negative if budget_of == "negative" else ~np.isnan(scores), sizes).sum() + 1e-9)
    )
    candidates = np.flatnonzero(negative) if drawn_from == "negative" else np.arange(len(scores))
    if order_key == "random":
        order = np.random.default_rng(11).permutation(candidates)
    else:
        key = scores if order_key == "ascending" else -scores
        order = candidates[np.argsort(key[candidates], kind="stable")]
    # The dropped units are the shortest prefix of the order holding at least the budget's records
    prefix = 0
    while prefix < len(order) and sizes[order[:prefix]].sum() < budget:
        prefix += 1
    expected = np.zeros(len(scores), dtype=bool)
    expected[order[:prefix]] = True
    np.testing.assert_array_equal(drop, expected)
    assert drop.any() == (budget > 0)
    assert sizes[drop].sum() >= budget


@pytest.mark.parametrize("rule", ["neg-bottom", "bottom", "top", "neg"])
def test_unit_sizes_of_one_are_the_unsized_rule(rule):
    scores = _scores(12, 20, seed=5)
    for fraction in (0.0, 0.1, 0.5, 1.0):
        unsized = get_drop_rule(rule)(scores, fraction, None)
        sized = get_drop_rule(rule)(scores, fraction, None, sizes=np.ones(len(scores), dtype=int))
        np.testing.assert_array_equal(sized, unsized)


def test_sized_rule_drops_a_unit_larger_than_the_budget():
    # 8 trajectories of 256 records, 3 negative: floor(0.125 · 3) = 0 trajectories, but 96 records
    scores = np.array([0.5, -1.0, 2.0, -3.0, 0.1, -0.2, 1.0, 4.0])
    sizes = np.full(8, 256)
    rule = get_drop_rule("neg-bottom")
    assert not rule(scores, 0.125, None).any()
    np.testing.assert_array_equal(np.flatnonzero(rule(scores, 0.125, None, sizes=sizes)), [3])


def test_bad_sizes_and_rules_without_sizes():
    from sb3_influence.common.filters import takes_sizes

    scores = np.array([-1.0, 2.0])
    with pytest.raises(ValueError, match="sizes must be positive integers"):
        get_drop_rule("neg-bottom")(scores, 0.5, None, sizes=np.array([0, 3]))
    with pytest.raises(ValueError, match="sizes must be positive integers"):
        get_drop_rule("neg-bottom")(scores, 0.5, None, sizes=np.array([1.5, 3.0]))
    with pytest.raises(ValueError, match="sizes must be positive integers"):
        get_drop_rule("neg-bottom")(scores, 0.5, None, sizes=np.array([1, 2, 3]))
    assert all(takes_sizes(rule) for rule in DROP_RULES.values())
    assert not takes_sizes(lambda scores, fraction, rng: scores < 0)
    assert takes_sizes(lambda scores, fraction, rng, **kwargs: scores < 0)
