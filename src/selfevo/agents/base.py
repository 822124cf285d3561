"""The agent protocols. Every backend (sim, lm, remote, the retrieval baseline) implements
these few methods; the loop and the evaluator know nothing else about an agent."""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from selfevo.evaluate import normalize_answer
from selfevo.records import Document
from selfevo.search.tool import SearchTool


@dataclass
class Trajectory:
    """One solver rollout: the searches it made and the answer it gave."""

    answer: str
    searches: list[str] = field(default_factory=list)
    actions: int = 0
    # backend-private record of the choices made (what an update needs); never serialised
    trace: Any = field(default=None, repr=False, compare=False)


class Solver(Protocol):
    name: str

    def answer(self, questions: Sequence[str], tool: SearchTool, *, greedy: bool = True,
               n: int = 1, seed: int | None = None,
               contexts: Sequence[Document] | None = None) -> list[list[Trajectory]]:
        """`n` trajectories per question (greedy: deterministic; else sampled). `contexts`, one
        per question, puts a document in front of the model (MSV's "with the source")."""
        ...


@dataclass
class Proposal:
    """A question written from a source document, with the proposer's draft answer."""

    question: str
    draft_label: str
    source_id: str  # the page the proposer was given
    source_ids: tuple[str, ...]  # every page it read while composing (lineage of connected sources)
    hops: int
    trace: Any = field(default=None, repr=False, compare=False)
    # the format rule it breaks (LM proposers: empty, long answer, answer in the question), or None;
    # a malformed proposal is neither graded nor admitted, and earns -format_penalty
    format_error: str | None = None


def blank(text: str) -> bool:
    """Nothing a reader sees: only whitespace and format characters (category Cf: zero-width space,
    joiners, BOM), which `str.strip` keeps. `<answer>\u200b</answer>` is read as an empty answer."""
    return all(c.isspace() or unicodedata.category(c) == "Cf" for c in text)


def missing_part(question: str, answer: str) -> str | None:
    """"empty question" or "empty answer" where a proposal has nothing there to read (an answer the
    loop's normalisation empties, "the" or ".", counts: it matches nothing), else None."""
    if blank(question):
        return "empty question"
    if empty_answer(answer):
        return "empty answer"
    return None


def empty_answer(answer: str) -> bool:
    """An answer with nothing to match: blank, or emptied by the loop's normalisation ("the", ".")."""
    return blank(answer) or not normalize_answer(answer)


def mark_missing(p: Proposal) -> Proposal:
    """`p`, or a copy marked malformed where its question or draft label is empty and its proposer left
    `format_error` unset: admitted, such a proposal would train the solver on ''. (selfevo's proposers
    mark it themselves; one of a user's own may not.)"""
    empty = None if p.format_error is not None else missing_part(p.question, p.draft_label)
    return replace(p, format_error=empty) if empty else p


class Learner(Protocol):
    """What the loop needs to train and snapshot a model."""

    name: str

    def snapshot(self, name: str | None = None) -> Learner:
        """A frozen copy (a grader must not change while it grades), named `name` (default its own); a
        solver's carries a copy of its `lineage`."""
        ...

    def state_dict(self) -> dict:
        """JSON-serialisable parameters (no pickle: run data must be safe to load)."""
        ...

    def load_state_dict(self, state: dict) -> None: ...


class TrainableSolver(Solver, Learner, Protocol):
    # which folds and rounds its training data came from, `{"folds": [...], "rounds": [...]}` ({} untrained):
    # the loop records each training into it (`loop.feedback.record_training`) and writes it beside every
    # grading; `snapshot` and `state_dict` carry a copy of it
    lineage: dict

    def update(self, groups: Sequence[tuple[list[Trajectory], str]]) -> dict:
        """One policy-gradient step on groups of rollouts, each rewarded against its label."""
        ...


class Proposer(Learner, Protocol):
    def propose(self, n: int, tool: SearchTool, seed: int) -> list[Proposal]: ...

    def update(self, proposals: Sequence[Proposal], rewards: Sequence[float]) -> dict:
        """One policy-gradient step on the frontier rewards of a batch of proposals."""
        ...
