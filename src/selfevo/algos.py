"""The method's math as pure functions (after verl's core_algos): rewards and advantages, and
the statistics over seeds every report uses.
Shapes are plain sequences; every function is unit-tested directly."""

from __future__ import annotations

import functools
import hashlib
import math
import operator
import statistics
from collections.abc import Hashable, Iterable, Sequence

N_GRADER_SAMPLES = 5  # paper: the grader answers every proposed question five times


def frontier_reward(k: int, n: int = N_GRADER_SAMPLES) -> float:
    """Proposer reward for a question k of n grader samples agree with: highest when the grader
    is barely able (k=1), zero when it never or always agrees. paper: f(k) = (5-k)/4, 0<k<5."""
    if not 0 <= k <= n:
        raise ValueError(f"k={k} outside 0..{n}")
    return (n - k) / (n - 1) if 0 < k < n else 0.0


def float_sum(values: Iterable[float]) -> float:
    """The sum of floats added left to right. From Python 3.12 on, the built-in sum() of floats compensates
    its rounding (Neumaier), so the same run's weights and averages came out other in their last digits on
    3.12 than on 3.11; added in order, they are the same to the bit on every Python selfevo runs on."""
    return functools.reduce(operator.add, values, 0)


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """GRPO: reward minus the group mean, over the group std. A group whose rewards are all equal
    carries no signal (all zeros)."""
    n = len(rewards)
    if n == 0:
        return []
    mean = float_sum(rewards) / n
    std = math.sqrt(float_sum((r - mean) ** 2 for r in rewards) / n)
    if std < eps:
        return [0.0] * n
    return [(r - mean) / (std + eps) for r in rewards]


def bucket_advantages(rewards: Sequence[float], buckets: Sequence[Hashable],
                      eps: float = 1e-6) -> list[float]:
    """Advantages normalised within each bucket. paper (Dr. Zero): the proposer's rewards are
    normalised within its hop bucket, so 1-hop and 4-hop questions do not compete."""
    if len(rewards) != len(buckets):
        raise ValueError("rewards and buckets differ in length")
    out = [0.0] * len(rewards)
    groups: dict[Hashable, list[int]] = {}
    for i, b in enumerate(buckets):
        groups.setdefault(b, []).append(i)
    for idx in groups.values():
        for i, a in zip(idx, group_advantages([rewards[i] for i in idx], eps)):
            out[i] = a
    return out


def sample_index(probs: Sequence[float], u: float) -> int:
    """Inverse-CDF draw: the index whose cumulative probability first exceeds `u` in [0, 1)
    (the last index of non-zero probability if rounding leaves the sum just under `u`)."""
    acc = 0.0
    for i, p in enumerate(probs):
        acc += p
        if u < acc:
            return i
    # seven probabilities of 1/7 sum to 0.9999999999999998: a u above that fell through to the last
    # index even where its probability is 0 (an outcome that cannot happen); an empty list gave -1
    for i in range(len(probs) - 1, -1, -1):
        if probs[i] > 0:
            return i
    raise ValueError("sample_index: no index has a probability above 0")


def softmax(logits: Sequence[float], temperature: float = 1.0) -> list[float]:
    if not logits:
        return []
    if temperature <= 0:
        raise ValueError("temperature must be > 0 (use argmax for greedy)")
    m = max(logits)
    e = [math.exp((x - m) / temperature) for x in logits]
    s = float_sum(e)
    return [x / s for x in e]


def hash_unit(*keys: object) -> float:
    """A uniform draw in [0, 1) that is a pure function of `keys`: the same call gives the same
    draw in any process, so injected faults and scripted errors repeat on a rerun."""
    h = hashlib.sha256("|".join(map(str, keys)).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


# two-sided 95% Student-t quantiles by degrees of freedom (a table: no scipy dependency); between
# tabulated values the next lower df's quantile is used, so an interval is never too narrow
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110,
        18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060,
        26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042, 40: 2.021, 50: 2.009, 60: 2.000,
        80: 1.990, 100: 1.984, 120: 1.980}


def t95(df: int) -> float:
    """The two-sided 95% Student-t quantile for `df` degrees of freedom (NaN for df < 1)."""
    if df <= 0:
        return float("nan")
    return _T95[max(k for k in _T95 if k <= df)]


def summary(values: Sequence[float | None]) -> dict:
    """Mean, std and a 95% t-interval over seeds (None and NaN values are skipped)."""
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return {"mean": None, "std": None, "lo": None, "hi": None, "n": 0}
    m = statistics.fmean(vals)
    if len(vals) == 1:  # one seed has no spread and no interval: None (JSON null), never NaN (not JSON),
        return {"mean": m, "std": None, "lo": None, "hi": None, "n": 1}  # nor a 0.0 that reads as agreeing seeds
    s = statistics.stdev(vals)
    half = t95(len(vals) - 1) * s / math.sqrt(len(vals))
    return {"mean": m, "std": s, "lo": m - half, "hi": m + half, "n": len(vals)}
