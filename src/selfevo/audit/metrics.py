"""The audit's metrics (DESIGN.md §1), pure functions over judged items.

For every resolved item and each of its label-response pairs:
  A   response matches the adopted label (what the loop sees)
  T_S response is correct
  F   response matches the label and the label is wrong (false agreement)
  L   response is correct and the label is wrong (lost credit)
T_P is the share of resolved items whose adopted label is correct; coverage the share of items
the judge resolved. Reading rule: agreement is trustworthy only when A rises together with T_P and
T_S while F stays low.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

METRICS = ("A", "T_P", "T_S", "F", "L", "coverage")


@dataclass(frozen=True)
class JudgedItem:
    matches: tuple[bool, ...]  # response i matches the adopted label (the loop's matcher)
    resolved: bool
    label_correct: bool | None = None
    responses_correct: tuple[bool, ...] | None = None

    def __post_init__(self):
        if self.resolved and (self.label_correct is None or self.responses_correct is None):
            raise ValueError("a resolved item needs label_correct and responses_correct")
        if self.resolved and len(self.responses_correct) != len(self.matches):
            raise ValueError("responses_correct and matches differ in length")


def audit_metrics(items: Sequence[JudgedItem]) -> dict:
    """A, T_P, T_S, F, L over the pairs of resolved items; coverage over all items. Metrics are
    None (not 0) when nothing was resolved: an empty audit is not a clean one."""
    resolved = [it for it in items if it.resolved]
    pairs = sum(len(it.matches) for it in resolved)
    out = {"items": len(items), "resolved": len(resolved), "pairs": pairs,
           "coverage": len(resolved) / len(items) if items else None}
    if not resolved or pairs == 0:
        return {**out, "A": None, "T_P": None, "T_S": None, "F": None, "L": None}
    a = t_s = f = lost = 0
    for it in resolved:
        for match, correct in zip(it.matches, it.responses_correct, strict=True):
            a += match
            t_s += correct
            f += match and not it.label_correct
            lost += correct and not it.label_correct
    return {**out, "A": a / pairs, "T_P": sum(it.label_correct for it in resolved) / len(resolved),
            "T_S": t_s / pairs, "F": f / pairs, "L": lost / pairs}
