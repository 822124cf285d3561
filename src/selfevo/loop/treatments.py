"""Treatments: a name on the command line -> an admission rule and a feedback rule.

    coupled | msv | crossfit | msv+crossfit | same-source | full-data | question-split |
    half-budget | crossfit-k<K> | crossfit-connected[-k<K>]

Any feedback name may be prefixed `msv+` (MSV decides admission and label; the feedback rule
decides the grader). A name an installed package gives under the `selfevo.treatments` entry points is a
treatment of a user's: its function makes both rules (`evolve.make_rules`, docs/extending.md).

`feedback_options` is the one mapping from a treatment to how its auxiliary solvers train and
grade; the loop (`evolve.make_rules` -> `loop.feedback.AuxFeedback`) and the engine integrations
(`integrations.routing`, `datasets`, `engine`) all read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FEEDBACKS = ("coupled", "crossfit", "same-source", "full-data", "question-split", "half-budget")
# where an installed package names a treatment of its own (its pyproject.toml:
# [project.entry-points."selfevo.treatments"] NAME = "module:rules"), for `--treatment NAME`
USER_TREATMENTS = "selfevo.treatments"
# ASCII digits and fullmatch: `\d` took other scripts' digits ("crossfit-k٣") and `$` a trailing newline
# ("crossfit\n"), each a run under a name no other run of the treatment shares
_CROSSFIT = re.compile(r"crossfit(?:-(connected))?(?:-k([0-9]+))?")


@dataclass(frozen=True)
class Treatment:
    name: str
    msv: bool
    feedback: str  # one of FEEDBACKS, or "user": a user's treatment, whose rules are its own
    k: int = 2
    grouping: str = "source"  # how sources are grouped into folds: source | connected


@dataclass(frozen=True)
class FeedbackOptions:
    """How CrossFit and each of its controls differ (the options of `loop.feedback.AuxFeedback`)."""

    trains: str = "own-fold"  # aux-j trains on fold j's questions | everything: one aux solver on all
    grades: str = "other-fold"  # another fold's aux solver grades | own-fold: its own fold's | full: aux-all
    split: str = "source"  # folds by source | question: by question text (the question-split control)
    budget: float = 1.0  # share of the full aux budget (25 updates a round each); half budget: 0.5
    lineage_aware: bool = False  # folds of every page read count (connected grouping), not only the source's


def feedback_options(treatment: Treatment) -> FeedbackOptions | None:
    """The aux-solver options of a treatment; None for coupled (the main solver grades, no aux) and for a
    user's treatment (no auxiliary solvers of selfevo's: its rules train what they train)."""
    f = treatment.feedback
    if f in ("coupled", "user"):
        return None
    if f == "crossfit":
        return FeedbackOptions(lineage_aware=treatment.grouping == "connected")
    if f == "half-budget":
        # paper: each aux solver gets 25 updates a round; half budget: 25 a round in total
        return FeedbackOptions(budget=0.5)
    if f == "same-source":
        return FeedbackOptions(grades="own-fold")
    if f == "full-data":
        return FeedbackOptions(trains="everything", grades="full")
    if f == "question-split":
        return FeedbackOptions(split="question")
    raise AssertionError(f"feedback {f!r} has no options")  # parse_treatment admits nothing else


def parse_treatment(name: str, *, recorded: bool = False) -> Treatment:
    """Validate and decompose a treatment name; errors name the field and list what is known. `recorded`: the
    name of a finished run whose manifest names a user's treatment's rules (`runs.RunDir.run_config`), read
    without its package (only a resume needs the rules)."""
    from selfevo._plugins import DIRECTORY_NAME

    if (t := _parse_builtin(name)) is not None:
        return t
    mine = user_treatments()
    if name in mine or (recorded and DIRECTORY_NAME.fullmatch(name)):
        # its folds: K = 2, by source (folds.json), its rules' to read or not
        return Treatment(name, False, "user")
    raise ValueError(f"treatment: unknown {name!r} (known: coupled, msv, "
                     f"{', '.join(FEEDBACKS[1:])}, crossfit-k<K>, crossfit-connected[-k<K>], "
                     "and msv+<any of them but msv>"
                     + "".join(f", {n}" for n in mine) + "; a treatment of yours: a name an installed "
                     f"package gives under the {USER_TREATMENTS} entry points)")


def _parse_builtin(name: str) -> Treatment | None:
    """One of selfevo's own treatments (ValueError for a crossfit-k<K> of a K it refuses), else None."""
    msv, rest = (True, name[len("msv+"):]) if name.startswith("msv+") else (False, name)
    if rest == "msv" and not msv:
        return Treatment(name, True, "coupled")
    if rest in FEEDBACKS:
        return Treatment(name, msv, rest)
    m = _CROSSFIT.fullmatch(rest)
    if m:
        if m[2] and len(m[2]) > 18:  # int() refuses over 4,300 digits with a message naming no field
            raise ValueError(f"treatment: crossfit-k<K> takes at most 18 digits of K, got {len(m[2])}")
        k = int(m[2]) if m[2] else 2
        if k < 2:
            raise ValueError(f"treatment: crossfit needs k >= 2, got {name!r}")
        return Treatment(name, msv, "crossfit", k, "connected" if m[1] else "source")
    return None


def _builtin(name: str) -> bool:
    """A name of selfevo's own treatments' grammar (a refused K included): a package's such name is shadowed."""
    try:
        return _parse_builtin(name) is not None
    except ValueError:
        return True


def user_treatments() -> list[str]:
    """The treatments installed packages name: selfevo's own names win, and a name that is no path component
    (a grid's run directory is named after it) is none."""
    from selfevo._plugins import DIRECTORY_NAME, installed

    return sorted(n for n in installed(USER_TREATMENTS) if DIRECTORY_NAME.fullmatch(n) and not _builtin(n))


def user_rules(name: str):
    """The function that makes the rules of the user's treatment `name` (ValueError, naming the field, where
    no installed package names it, its import fails or it is no function)."""
    from selfevo._plugins import load, recorded_name

    if name not in user_treatments():
        raise ValueError(f"treatment: {name!r} is a treatment of a package that is not installed (none names it "
                         f"under the {USER_TREATMENTS} entry points); install it (again) to run it")
    try:
        rules = load(USER_TREATMENTS, name, "treatment")
    except ValueError as e:  # its package's import failed
        raise ValueError(f"treatment: {str(e).removeprefix('treatment ')}") from None
    recorded_name(rules, f"treatment: {name!r} names", "(cfg, sources, folds, make_solver) -> (admission, feedback)")
    return rules
