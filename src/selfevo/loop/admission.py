"""Admission rules: which proposed questions train the solver, and with which label."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from selfevo.agents.base import Proposal, Solver, TrainableSolver
from selfevo.evaluate import answers_match, check_answers
from selfevo.loop.feedback import snapshot_of
from selfevo.loop.schedule import derive_seed
from selfevo.records import Document
from selfevo.search.tool import SearchTool


@dataclass
class Decision:
    admitted: bool
    label: str  # the adopted label (the training target when admitted)
    detail: dict = field(default_factory=dict)  # rule-specific record (e.g. MSV samples)


class Admission(Protocol):
    name: str

    def begin_round(self, round: int, main: TrainableSolver) -> None: ...

    # extra model generations per candidate (compute accounting), counted in compute.json under the rule's
    # `purpose` where it has one (selfevo's rules: "msv"), else its `name`
    generations_per_candidate: int

    def decide(self, proposals: Sequence[Proposal], tool: SearchTool, seed: int) -> list[Decision]: ...


class AdmitAll:
    """Dr. Zero: every well-formed proposal is admitted with its draft label."""

    name = "none"
    purpose = "msv"  # compute.json's key for admission generations (none here): one key in every run
    generations_per_candidate = 0

    def begin_round(self, round: int, main: TrainableSolver) -> None:
        pass

    def decide(self, proposals: Sequence[Proposal], tool: SearchTool, seed: int) -> list[Decision]:
        return [Decision(True, p.draft_label) for p in proposals]


def majority(answers: Sequence[str], min_count: int = 2) -> str | None:
    """An answer that at least `min_count` of `answers` share under the loop's matcher (the
    first such in order), else None. Empty answers never form a majority."""
    for a in answers:
        if sum(answers_match(a, b) for b in answers) >= min_count:
            return a
    return None


class MSV:
    """Multi-sample verification. For a candidate (x, q, y~): sample the model 3 times with the
    source x in context and 3 times without it; neither sees y~. Admit iff both majorities exist
    and match; the matched majority replaces y~ as the training label.

    The model is the main solver as it stood at the start of the round (the one the coupled
    loop grades with), so MSV alone cannot see past what that solver already believes.
    """

    name = purpose = "msv"

    def __init__(self, documents: Mapping[str, Document], samples: int = 3):
        self.documents, self.samples = documents, samples
        # paper: 2 of 3; in general a strict majority of the samples (1 of 1, 2 of 2, 3 of 5...),
        # so at most one answer qualifies and the sample order cannot pick the label
        self.min_count = samples // 2 + 1
        self.generations_per_candidate = 2 * samples  # paper: 6 extra generations a candidate
        self.model: Solver | None = None

    def begin_round(self, round: int, main: TrainableSolver) -> None:
        self.model = snapshot_of(main, f"msv@r{round - 1}")

    def decide(self, proposals: Sequence[Proposal], tool: SearchTool, seed: int) -> list[Decision]:
        assert self.model is not None, "begin_round first"
        questions = [p.question for p in proposals]
        if unknown := sorted({p.source_id for p in proposals} - self.documents.keys()):
            raise ValueError(f"MSV: proposals whose source_id is none of the source documents it was given "
                             f"({', '.join(map(repr, unknown[:3]))}{' ...' if len(unknown) > 3 else ''}): a proposal's "
                             "source_id names the document it was written from, one of the run's sources")
        contexts = [self.documents[p.source_id] for p in proposals]
        who = getattr(self.model, "name", type(self.model).__name__)
        with_src = check_answers(who, self.model.answer(
            questions, tool, greedy=False, n=self.samples, seed=derive_seed(seed, "with-source"), contexts=contexts),
            len(questions), self.samples)
        without = check_answers(who, self.model.answer(
            questions, tool, greedy=False, n=self.samples, seed=derive_seed(seed, "without-source")),
            len(questions), self.samples)
        out = []
        for p, ws, wo in zip(proposals, with_src, without, strict=True):
            a, b = [t.answer for t in ws], [t.answer for t in wo]
            ma, mb = majority(a, self.min_count), majority(b, self.min_count)
            ok = ma is not None and mb is not None and answers_match(ma, mb)
            detail = {"with_source": a, "without_source": b, "majority_with": ma, "majority_without": mb}
            out.append(Decision(ok, ma if ok else p.draft_label, detail))
        return out
