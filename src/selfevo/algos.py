"""The method's math as pure functions (after verl's core_algos): rewards and advantages.
Shapes are plain sequences; every function is unit-tested directly."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Sequence

N_GRADER_SAMPLES = 5  # paper: the grader answers every proposed question five times


def frontier_reward(k: int, n: int = N_GRADER_SAMPLES) -> float:
    """Proposer reward for a question k of n grader samples agree with: highest when the grader
    is barely able (k=1), zero when it never or always agrees. paper: f(k) = (5-k)/4, 0<k<5."""
    if not 0 <= k <= n:
        raise ValueError(f"k={k} outside 0..{n}")
    return (n - k) / (n - 1) if 0 < k < n else 0.0


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """GRPO: reward minus the group mean, over the group std. A group whose rewards are all equal
    carries no signal (all zeros)."""
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
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
    (the last index if rounding leaves the sum just under `u`)."""
    acc = 0.0
    for i, p in enumerate(probs):
        acc += p
        if u < acc:
            return i
    return len(probs) - 1


def softmax(logits: Sequence[float], temperature: float = 1.0) -> list[float]:
    if not logits:
        return []
    if temperature <= 0:
        raise ValueError("temperature must be > 0 (use argmax for greedy)")
    m = max(logits)
    e = [math.exp((x - m) / temperature) for x in logits]
    s = sum(e)
    return [x / s for x in e]


def hash_unit(*keys: object) -> float:
    """A uniform draw in [0, 1) that is a pure function of `keys`: the same call gives the same
    draw in any process, so injected faults and scripted errors repeat on a rerun."""
    h = hashlib.sha256("|".join(map(str, keys)).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64
