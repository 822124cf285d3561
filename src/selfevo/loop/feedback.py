"""Feedback rules: who grades a proposed question. This is the only thing CrossFit and its
controls change; the reward formula, the proposer and the main solver's training are untouched.

    coupled         grader of round r = the main solver after round r-1 (Dr. Zero)
    crossfit        a question from fold h is graded by an auxiliary solver trained only on
                    admitted questions from another fold (K folds; K=2 is the paper's)
    same-source     control: the aux solver of the question's own fold grades it
    full-data       control: one extra solver trained on everything grades every question
    question-split  control: folds drawn per question, not per source
    half-budget     CrossFit with the aux solvers' updates halved (25 a round in total)
    connected       CrossFit over link-graph clusters, lineage-aware (see folds.py)

Round 1 is shared by every rule: no aux solver has trained yet, so the base model grades.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from selfevo._plugins import ContractError
from selfevo.agents.base import Proposal, Solver, TrainableSolver
from selfevo.evaluate import check_answers
from selfevo.loop.folds import FoldAssignment, question_fold
from selfevo.loop.schedule import derive_seed

# ---------------------------------------------------------------- the rules, as pure functions
# One home for CrossFit's rules: AuxFeedback below and the engine integrations (routing, datasets,
# engine) call these, so the loop and the served graders cannot drift apart.


def crossfit_fold(folds: FoldAssignment, split: str, source_id: str, question: str) -> int:
    """The fold used for cross-fitting: the source's, or (split="question", the control) the
    question's, so the same source lands in both folds."""
    if split == "question":
        return question_fold(question, folds.seed, folds.k)
    if split != "source":  # a misspelt control would run as CrossFit
        raise ValueError(f"split: source or question, got {split!r}")
    return folds.of(source_id)


def touched_folds(fold: int, page_folds: Collection[int], lineage_aware: bool) -> set[int]:
    """The folds a question counts as touching: lineage-aware, the folds of every page read while
    composing it; else only its own fold."""
    return set(page_folds) if lineage_aware else {fold}


def trains_on(j: int, fold: int, page_folds: Collection[int], lineage_aware: bool) -> bool:
    """Whether the aux solver of fold j trains on a question of `fold` whose pages lie in
    `page_folds`. Lineage-aware: only a question all of whose pages are fold j's."""
    return set(page_folds) == {j} if lineage_aware else fold == j


def other_fold(h: int, touched: Collection[int], k: int) -> tuple[int, bool]:
    """`(j, fallback)`: the fold whose aux solver grades a fold-h question -- the next fold after
    h (deterministic) that the question did not touch; when it touched every fold, the next fold
    all the same (`fallback`: the source rule, and the records say so)."""
    if not (isinstance(k, int) and k >= 2 and 0 <= h < k):
        raise ValueError(f"other_fold: fold {h!r} of k={k!r} (k >= 2 folds, numbered 0..k-1)")
    for step in range(1, k):
        j = (h + step) % k
        if j not in touched:
            return j, False
    return (h + 1) % k, True


def grader_index(grades: str, h: int, touched: Collection[int], k: int) -> tuple[int, bool]:
    """`(index into aux_names, fallback)` of the grader of a fold-h question from round 2 on."""
    if grades == "full":  # the full-data control: its one solver grades everything
        return 0, False
    if grades == "own-fold":  # the same-source control
        return h, False
    if grades != "other-fold":  # a misspelt control would run as CrossFit
        raise ValueError(f"grades: other-fold, own-fold or full, got {grades!r}")
    return other_fold(h, touched, k)


def aux_names(trains: str, k: int) -> list[str]:
    """The auxiliary solvers: one per fold, or one on everything (the full-data control)."""
    return ["aux-all"] if trains == "everything" else [f"aux-{j}" for j in range(k)]


def aux_count(trains: str, k: int) -> int:
    """len(aux_names(trains, k)), without building the list: a config's K may be huge."""
    return 1 if trains == "everything" else k


def aux_updates(updates_per_round: int, n_aux: int, budget: float = 1.0) -> list[int]:
    """Updates of each aux solver a round: `budget` of `updates_per_round` each, the total split
    evenly (the first solvers take the remainder).
    paper: each aux solver gets 25 updates a round; half budget: 25 a round in total."""
    total = round(updates_per_round * n_aux * budget)
    return [total // n_aux + (1 if j < total % n_aux else 0) for j in range(n_aux)]


def budget_batches(n: int, full: int, updates: int, seed: int) -> list[tuple[int, int, int]]:
    """`(batch, start, stop)`: the item ranges an aux solver trains on, one an update: the full budget's even
    split of its `n` items into `full` batches (as the main solver's, so every update trains; fewer
    items than updates: one item a batch, the others empty), of which a smaller budget takes `updates`
    drawn at random, in order, an empty one drawn being no update: a budget's share of the items whatever
    their number. Not the first ones: the items come in proposer-step order, and the round's first steps'
    questions are the proposer's before its updates of the round (`engine-run` samples its subset too)."""
    drawn = range(full) if updates >= full else sorted(random.Random(seed).sample(range(full), updates))
    return [(u, u * n // full, (u + 1) * n // full) for u in drawn if (u + 1) * n // full > u * n // full]


def fewest_aux_updates(updates_per_round: int, n_aux: int, budget: float = 1.0) -> int:
    """min(aux_updates(...)) without building the list: a config's K may be huge."""
    return round(updates_per_round * n_aux * budget) // n_aux


class UntrainedGrader(UserWarning):
    """An auxiliary solver had no admitted question to train on in a round: it grades the next round
    as it was (the base model, if it never trained)."""


def untrained_grader(name: str, round: int, ever_trained: bool) -> str:
    """What the loop and `engine-run` say of an auxiliary solver with nothing to train on."""
    return (f"round {round}: auxiliary solver {name} had no admitted question to train on; it grades "
            f"round {round + 1} "
            + ("as it was after its last training" if ever_trained else "untrained, as the base model"))


def lineage_of(solver) -> dict:
    """The grader's identity and what it was trained on: cross-fitting is a query over this."""
    return {"id": solver.name, "trained_on": _trained_on(solver)}


def _trained_on(solver) -> dict:
    lin = getattr(solver, "lineage", {}) or {}
    return {"folds": sorted(lin.get("folds", [])), "rounds": sorted(lin.get("rounds", []))}


def snapshot_of(solver, name: str):
    """`solver.snapshot(name=name)`, checked to carry what its model was trained on: a learner whose copy
    leaves its lineage behind would have every grading recorded as by a model trained on nothing."""
    snap = solver.snapshot(name=name)
    if (copied := _trained_on(snap)) != (had := _trained_on(solver)):
        raise ContractError(f"{type(solver).__name__}.snapshot: the copy's lineage {copied} is not the model's "
                            f"{had}; a snapshot carries a copy of `lineage` (selfevo.agents.base.TrainableSolver)")
    return snap


def record_training(solver, folds: Sequence[int], round: int) -> None:
    lin = getattr(solver, "lineage", None)
    if not isinstance(lin, dict):
        raise ContractError(f"{type(solver).__name__} ({solver.name}): no `lineage` dict to record its training in "
                            "(selfevo.agents.base.TrainableSolver)")
    lin["folds"] = sorted(set(lin.get("folds", [])) | set(folds))
    lin["rounds"] = sorted(set(lin.get("rounds", [])) | {round})


class Feedback(Protocol):
    name: str

    def item_fold(self, proposal: Proposal) -> int:
        """The fold an item belongs to for cross-fitting (its source's, or its own)."""
        ...

    def begin_round(self, round: int, main: TrainableSolver) -> None: ...

    def route(self, item) -> tuple[Solver, dict | None]:
        """The frozen solver that grades this item (a `loop.engine.Candidate`), and the record's
        `routing` field for it (where a fallback grader grades it), else None."""
        ...

    def grader_for(self, item) -> Solver:
        """`route(item)`'s grader."""
        ...

    @property
    def n_aux(self) -> int:
        """How many auxiliary solvers `end_round` trains, one after another."""
        ...

    def end_round(self, round: int, admitted: Sequence, tool, seed: int, last: bool, start: int = 0,
                  trained: Callable[[int, dict], None] | None = None) -> None:
        """Train whatever the rule trains besides the main solver: auxiliary solvers `start`.. (those
        before it trained already: a resumed round), calling `trained(j + 1, counts)` once solver j
        is done, where `counts` are its updates and generations (`{"updates": {name: n},
        "generations": {purpose: n}}`)."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class CoupledFeedback:
    """Dr. Zero: the grader of round r is the main solver as it stood after round r-1."""

    name = "coupled"
    n_aux = 0

    def __init__(self, folds: FoldAssignment):
        self.folds = folds
        self.grader: Solver | None = None

    def item_fold(self, proposal: Proposal) -> int:
        return self.folds.of(proposal.source_id)

    def begin_round(self, round: int, main: TrainableSolver) -> None:
        self.grader = snapshot_of(main, f"main@r{round - 1}")

    def route(self, item) -> tuple[Solver, dict | None]:
        assert self.grader is not None, "begin_round first"
        return self.grader, None

    def grader_for(self, item) -> Solver:
        return self.route(item)[0]

    def end_round(self, round: int, admitted: Sequence, tool, seed: int, last: bool, start: int = 0,
                  trained: Callable[[int, dict], None] | None = None) -> None:
        pass  # it trains nothing besides the main solver

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class AuxFeedback:
    """Auxiliary solvers trained on slices of the admitted questions, and a rule choosing which
    one grades a question. One class serves CrossFit and every control; the options say how
    they differ (`trains`, `grades`, `split`, `budget`, `lineage_aware`: each treatment's are
    `loop.treatments.feedback_options`)."""

    def __init__(self, name: str, folds: FoldAssignment, make_solver: Callable[[str], TrainableSolver],
                 updates_per_round: int, samples: int, trains: str = "own-fold",
                 grades: str = "other-fold", split: str = "source", budget: float = 1.0,
                 lineage_aware: bool = False):
        if trains not in ("own-fold", "everything") or grades not in ("other-fold", "own-fold", "full"):
            raise ValueError(f"feedback {name}: bad trains/grades option")
        if split not in ("source", "question") or not 0 < budget <= 1:
            raise ValueError(f"feedback {name}: bad split or budget")
        self.name, self.folds, self.samples = name, folds, samples
        self.trains, self.grades, self.split, self.lineage_aware = trains, grades, split, lineage_aware
        self.aux = [make_solver(aux) for aux in aux_names(trains, folds.k)]
        self.updates = aux_updates(updates_per_round, len(self.aux), budget)
        self.full_updates = updates_per_round
        self.graders: list[Solver] = []
        self.base: Solver | None = None

    # ---------------------------------------------------------------- folds
    def item_fold(self, proposal: Proposal) -> int:
        return crossfit_fold(self.folds, self.split, proposal.source_id, proposal.question)

    def _page_folds(self, item) -> set[int]:
        """The folds of every page read while composing the item (its lineage)."""
        return self.folds.lineage(item.proposal.source_ids)

    def _item_folds(self, item) -> set[int]:
        return touched_folds(item.fold, self._page_folds(item), self.lineage_aware)

    def _trains_on(self, j: int, item) -> bool:
        if self.trains == "everything":
            return True
        return trains_on(j, item.fold, self._page_folds(item), self.lineage_aware)

    # ---------------------------------------------------------------- grading
    def begin_round(self, round: int, main: TrainableSolver) -> None:
        if round == 1:  # shared by all arms: no aux solver has trained yet
            self.base = snapshot_of(main, "main@r0")
        self.graders = [snapshot_of(a, f"{a.name}@r{round - 1}") for a in self.aux]
        self._round = round

    def route(self, item) -> tuple[Solver, dict | None]:
        """Round 1: the shared base model. Later: the grader `grader_index` allows; where the question
        touched every fold, the fallback grader, recorded `{"fallback": True, "touched": [...]}` as the
        engine integrations record it."""
        if self._round == 1:
            return self.base, None
        touched = self._item_folds(item)
        j, fallback = grader_index(self.grades, item.fold, touched, self.folds.k)
        return self.graders[j], {"fallback": True, "touched": sorted(touched)} if fallback else None

    def grader_for(self, item) -> Solver:
        return self.route(item)[0]

    # ---------------------------------------------------------------- training
    @property
    def n_aux(self) -> int:
        return len(self.aux)

    def end_round(self, round: int, admitted: Sequence, tool, seed: int, last: bool, start: int = 0,
                  trained: Callable[[int, dict], None] | None = None) -> None:
        # after the last round nobody would be graded by them, so they are not trained
        if last:
            return
        for j, aux in enumerate(self.aux[start:], start=start):
            items = [c for c in admitted if self._trains_on(j, c)]
            updates, rollouts = 0, 0
            if not items:
                # e.g. connected grouping: a fold can have sources and no question all of whose pages lie in it
                warnings.warn(UntrainedGrader(untrained_grader(aux.name, round, bool(aux.lineage.get("rounds")))),
                              stacklevel=2)
            chosen = budget_batches(len(items), self.full_updates, self.updates[j],
                                    derive_seed(seed, aux.name, "budget"))
            for u, lo, hi in chosen:
                batch = items[lo:hi]
                trajs = check_answers(aux.name, aux.answer([c.proposal.question for c in batch], tool, greedy=False,
                                                           n=self.samples, seed=derive_seed(seed, aux.name, u)),
                                      len(batch), self.samples)
                aux.update([(ts, c.label) for ts, c in zip(trajs, batch, strict=True)])
                record_training(aux, sorted({f for c in batch for f in self._item_folds(c)}), round)
                updates, rollouts = updates + 1, rollouts + self.samples * len(batch)
            if trained is not None:
                trained(j + 1, {"updates": {aux.name: updates} if updates else {},
                                "generations": {"aux_rollouts": rollouts}})

    def state_dict(self) -> dict:
        return {"aux": [a.state_dict() for a in self.aux]}

    def load_state_dict(self, state: dict) -> None:
        for a, s in zip(self.aux, state["aux"], strict=True):
            a.load_state_dict(s)
