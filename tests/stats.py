"""Goodness-of-fit helpers for the statistical tests of sampling (chi-square at p = 0.001)."""

from __future__ import annotations

from collections import Counter

# Chi-square critical values at significance 0.001 (from tables), by degrees of freedom.
CHI2_CRIT_0001 = {5: 20.52, 10: 29.59, 15: 37.70, 20: 45.31, 25: 52.62, 30: 59.70, 35: 66.62,
                  40: 73.40, 50: 86.66, 60: 99.61}


def chi_square(observed: Counter, expected: dict, total: int) -> tuple[float, int]:
    """Statistic and degrees of freedom; cells expected below 5 are pooled into one."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, p in expected.items():
        e = p * total
        if e < 5:
            pooled_obs += observed.get(key, 0)
            pooled_exp += e
            continue
        stat += (observed.get(key, 0) - e) ** 2 / e
        cells += 1
    pooled_obs += sum(n for key, n in observed.items() if key not in expected)
    pooled_exp += max(0.0, total - sum(p * total for p in expected.values()))
    if pooled_exp >= 5:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    elif pooled_obs > 10:
        stat = float("inf")  # mass where the target puts (almost) none
    return stat, cells - 1


def critical(df: int) -> float:
    return CHI2_CRIT_0001[min(CHI2_CRIT_0001, key=lambda d: (abs(d - df), d))] * max(1.0, df / 60)
