"""Treatments: a name on the command line -> an admission rule and a feedback rule.

    coupled | msv | crossfit | msv+crossfit | same-source | full-data | question-split |
    half-budget | crossfit-k<K> | crossfit-connected[-k<K>]

Any feedback name may be prefixed `msv+` (MSV decides admission and label; the feedback rule
decides the grader).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FEEDBACKS = ("coupled", "crossfit", "same-source", "full-data", "question-split", "half-budget")
_CROSSFIT = re.compile(r"^crossfit(?:-(connected))?(?:-k(\d+))?$")


@dataclass(frozen=True)
class Treatment:
    name: str
    msv: bool
    feedback: str  # one of FEEDBACKS
    k: int = 2
    grouping: str = "source"  # how sources are grouped into folds: source | connected


def parse_treatment(name: str) -> Treatment:
    """Validate and decompose a treatment name; errors name the field and list what is known."""
    msv, rest = (True, name[len("msv+"):]) if name.startswith("msv+") else (False, name)
    if rest == "msv" and not msv:
        return Treatment(name, True, "coupled")
    if rest in FEEDBACKS:
        return Treatment(name, msv, rest)
    m = _CROSSFIT.match(rest)
    if m:
        k = int(m[2]) if m[2] else 2
        if k < 2:
            raise ValueError(f"treatment: crossfit needs k >= 2, got {name!r}")
        return Treatment(name, msv, "crossfit", k, "connected" if m[1] else "source")
    raise ValueError(f"treatment: unknown {name!r} (known: coupled, msv, "
                     f"{', '.join(FEEDBACKS[1:])}, crossfit-k<K>, crossfit-connected[-k<K>], "
                     "and msv+<any of them>)")
