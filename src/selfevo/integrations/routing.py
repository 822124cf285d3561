"""Who may grade a question, when the graders are served models behind URLs.

The rule is the loop's (`loop.feedback`): coupled grades with the main solver as it stood after the
previous round; CrossFit sends a question from fold h to the auxiliary solver of another fold;
round 1 is shared by every arm (the base model grades). Here the graders are not objects in memory
but endpoints, each with a lineage (the folds and rounds of the questions it trained on), so the
rule is a query over lineage, and it is checked: a cross-fitted question is never sent to a grader
whose lineage includes a fold the question touched (`RoutingError` instead), unless every fold was
touched, where the loop's own fallback applies and the record says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from selfevo.loop.feedback import aux_names, crossfit_fold, grader_index
from selfevo.loop.feedback import touched_folds as _touched
from selfevo.loop.folds import FoldAssignment
from selfevo.loop.treatments import FeedbackOptions, Treatment, feedback_options, parse_treatment


class RoutingError(RuntimeError):
    """No grader the question's lineage allows (a missing endpoint, or a grader that trained on
    the question's fold)."""


@dataclass(frozen=True)
class Grader:
    """A served solver: its endpoint and its lineage."""

    role: str  # main | aux-0 | aux-1 | ... | aux-all
    url: str  # OpenAI base URL (…/v1)
    model: str  # the model name the endpoint serves
    name: str = ""  # identity in the records, e.g. "aux-1@r1" (default: the role)
    folds: tuple[int, ...] = ()  # folds of the questions it trained on
    rounds: tuple[int, ...] = ()  # rounds it trained in

    def lineage(self) -> dict:
        """The record's `grader` field, as `loop.feedback.lineage_of` writes it."""
        return {"id": self.name or self.role, "trained_on": {"folds": sorted(self.folds),
                                                             "rounds": sorted(self.rounds)}}

    def to_json(self) -> dict:
        return {"role": self.role, "url": self.url, "model": self.model, "name": self.name,
                "folds": list(self.folds), "rounds": list(self.rounds)}

    @classmethod
    def from_json(cls, obj: Mapping) -> Grader:
        return cls(obj["role"], obj["url"], obj["model"], obj.get("name", ""),
                   tuple(obj.get("folds", ())), tuple(obj.get("rounds", ())))


@dataclass(frozen=True)
class Route:
    grader: Grader
    fallback: bool = False  # every fold touched: the loop's fallback grader (see module docstring)
    touched: tuple[int, ...] = field(default=())


def treatment_of(name: str | Treatment) -> Treatment:
    return name if isinstance(name, Treatment) else parse_treatment(name)


def options_of(treatment: str | Treatment) -> FeedbackOptions:
    """The treatment's aux-solver options (coupled: the defaults, which route nothing to an aux)."""
    return feedback_options(treatment_of(treatment)) or FeedbackOptions()


def aux_roles(treatment: str | Treatment) -> list[str]:
    """The auxiliary solvers a treatment trains (none for coupled)."""
    t = treatment_of(treatment)
    opts = feedback_options(t)
    return [] if opts is None else aux_names(opts.trains, t.k)


def item_fold(treatment: str | Treatment, folds: FoldAssignment, source_id: str, question: str) -> int:
    """The fold used for cross-fitting: the source's, or (question-split control) the question's."""
    return crossfit_fold(folds, options_of(treatment).split, source_id, question)


def touched_folds(treatment: str | Treatment, folds: FoldAssignment, fold: int,
                  source_ids: Iterable[str]) -> set[int]:
    """The folds a question counts as touching: with the connected grouping every page it read
    (lineage-aware), else its own fold."""
    return _touched(fold, folds.lineage(source_ids), options_of(treatment).lineage_aware)


def grader_role(treatment: str | Treatment, round: int, fold: int, touched: set[int]) -> tuple[str, bool]:
    """`(role, fallback)`: the loop's rule (`loop.feedback.grader_index`, `CoupledFeedback`)."""
    t = treatment_of(treatment)
    opts = feedback_options(t)
    if opts is None or round == 1:  # coupled; round 1 is shared: the base model grades
        return "main", False
    j, fallback = grader_index(opts.grades, fold, touched, t.k)
    return aux_names(opts.trains, t.k)[j], fallback


def route(treatment: str | Treatment, round: int, fold: int, touched: set[int],
          graders: Mapping[str, Grader]) -> Route:
    """The grader of one question, checked against its lineage."""
    t = treatment_of(treatment)
    role, fallback = grader_role(t, round, fold, touched)
    grader = graders.get(role)
    if grader is None:
        raise RoutingError(f"round {round}: the {t.name} rule sends a fold-{fold} question to {role!r}, "
                           f"but no such grader is served (have: {', '.join(sorted(graders)) or 'none'})")
    # cross-fitted (CrossFit, half budget, question split): the grader must not have trained on
    # a fold the question touched
    cross_fitted = round > 1 and t.feedback != "coupled" and options_of(t).grades == "other-fold"
    if cross_fitted and not fallback and set(grader.folds) & touched:
        raise RoutingError(f"round {round}: {grader.name or role} trained on fold(s) {sorted(grader.folds)}, "
                           f"which a question touching fold(s) {sorted(touched)} must not be graded by")
    return Route(grader, fallback, tuple(sorted(touched)))
