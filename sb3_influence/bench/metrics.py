"""
The speed-up metrics of Hu et al., "A Snapshot of Influence" (arXiv 2505.19281), Sec. 5 — how much sooner IIF
reaches the test returns standard PPO reaches — and bootstrap confidence intervals.
"""

from collections.abc import Sequence

import numpy as np

# A curve: a list or a 1-D numpy array
Floats = Sequence[float] | np.ndarray
Ints = Sequence[int] | np.ndarray


def first_round(rounds: Ints, returns: Floats, level: float) -> int | None:
    """
    ``m(v)``: the first round whose test return is ``>= level`` (the paper's Sec. 5).

    :param rounds: Round numbers, increasing.
    :param returns: Test return evaluated after each of those rounds.
    :param level: The level ``v``.
    :return: The round, or ``None`` if the curve never reaches ``level``.
    """
    if len(rounds) != len(returns):
        raise ValueError(f"rounds and returns must have the same length, got {len(rounds)} and {len(returns)}")
    for round_, value in zip(rounds, returns, strict=True):
        if value >= level:
            return int(round_)
    return None


def ppo_levels(rounds: Ints, returns: Floats) -> list[tuple[int, float]]:
    """
    The increasing levels reached by standard PPO: every round (after round 0) whose return is a new best over
    all earlier evaluations, including the initial one.

    :param rounds: Round numbers, increasing; round 0 (the initial policy) may be included.
    :param returns: PPO's test returns.
    :return: ``(round, value)`` pairs, in order.
    """
    levels = []
    best = -np.inf
    for round_, value in zip(rounds, returns, strict=True):
        if value > best:
            if round_ > 0:
                levels.append((int(round_), float(value)))
            best = value
    return levels


def curve_mean(rounds: Ints, returns: Floats) -> float:
    """
    The mean test return over a run's rounds after round 0 (the area under its learning curve over the rounds):
    each evaluation stands for the rounds since the previous one, so that a schedule that evaluates some rounds
    more densely (highway-v0's first ten) does not weigh them more. With evaluations at regular rounds it is the
    mean of the evaluations after round 0.

    :param rounds: Evaluation rounds, increasing, starting at 0.
    :param returns: Test return at each of them.
    :return: The weighted mean.
    """
    rounds, returns = np.asarray(rounds), np.asarray(returns, dtype=np.float64)
    if len(rounds) != len(returns) or len(rounds) < 2 or rounds[0] != 0:
        raise ValueError(f"need evaluations at round 0 and later, one return per round, got rounds {rounds.tolist()}")
    return float(np.average(returns[1:], weights=np.diff(rounds)))


def _reduction(m_ref: float, m_new: float | None, never: float) -> float:
    return 1.0 - (never if m_new is None else m_new) / m_ref


def speedup_metrics(
    rounds: Ints,
    ppo_returns: Floats,
    new_returns: Floats,
    ppo_time: Floats | None = None,
    new_time: Floats | None = None,
    resolution: float = 0.0,
) -> dict[str, float]:
    """
    SE_ave, SE_peak and (with times) RT_peak of one paired run (the paper's Sec. 5). A level the new method never reaches
    counts as reached one round after the last (so the reduction is penalised rather than dropped).

    :param rounds: Evaluation rounds, shared by both curves (0 = initial policy allowed).
    :param ppo_returns: Standard PPO's test returns.
    :param new_returns: The compared method's test returns (IIF or random filtering).
    :param ppo_time: PPO's cumulative wall-clock time at each of ``rounds``.
    :param new_time: The compared method's cumulative wall-clock time at each of ``rounds``.
    :param resolution: Floor both curves to a multiple of this first (0: use them as they are).
    :return: ``{"se_ave", "se_peak", "rt_peak", "n_levels", "peak_reached"}`` (fractions, not percents;
        ``rt_peak`` is NaN without times, and everything is NaN when PPO never improves on round 0).
    """
    if not (len(rounds) == len(ppo_returns) == len(new_returns)):
        raise ValueError("rounds, ppo_returns and new_returns must have the same length")
    if resolution < 0:
        raise ValueError(f"resolution must be >= 0, got {resolution}")
    if resolution > 0:
        ppo_returns = np.floor(np.asarray(ppo_returns, dtype=np.float64) / resolution + 1e-9) * resolution
        new_returns = np.floor(np.asarray(new_returns, dtype=np.float64) / resolution + 1e-9) * resolution
    levels = ppo_levels(rounds, ppo_returns)
    nan = float("nan")
    if not levels:
        return {"se_ave": nan, "se_peak": nan, "rt_peak": nan, "n_levels": 0, "peak_reached": nan}
    never = float(rounds[-1]) + (rounds[-1] - rounds[-2] if len(rounds) > 1 else 1)
    reductions = [_reduction(m, first_round(rounds, new_returns, v), never) for m, v in levels]
    m_peak, v_peak = max(levels, key=lambda level: level[1])
    m_new = first_round(rounds, new_returns, v_peak)
    rt_peak = nan
    if ppo_time is not None and new_time is not None:
        if len(ppo_time) != len(rounds) or len(new_time) != len(rounds):
            raise ValueError("ppo_time and new_time must have one entry per round")
        t_ppo = float(ppo_time[list(rounds).index(m_peak)])
        # Not reached: the whole run's time, extrapolated by one more round
        if m_new is None:
            per_round = new_time[-1] / max(rounds[-1], 1)
            t_new = float(new_time[-1]) + per_round * (never - rounds[-1])
        else:
            t_new = float(new_time[list(rounds).index(m_new)])
        rt_peak = 1.0 - t_new / t_ppo
    return {
        "se_ave": float(np.mean(reductions)),
        "se_peak": _reduction(m_peak, m_new, never),
        "rt_peak": rt_peak,
        "n_levels": len(levels),
        "peak_reached": float(m_new is not None),
    }


def bootstrap_ci(values: Floats, n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """
    Percentile bootstrap confidence interval of the mean over seeds of one cell (for aggregates over cells see
    :mod:`sb3_influence.bench.stats`).

    :param values: One value per seed (NaNs are dropped).
    :param n_boot: Bootstrap resamples.
    :param level: Confidence level.
    :param seed: Seed of the resampling.
    :return: ``(low, high)``; ``(nan, nan)`` with no finite value.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    array = np.asarray(values, dtype=np.float64)
    array = array[np.isfinite(array)]
    if len(array) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = rng.choice(array, size=(n_boot, len(array)), replace=True).mean(axis=1)
    alpha = (1 - level) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))
