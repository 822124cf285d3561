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

from collections.abc import Callable, Sequence
from typing import Protocol

from selfevo.agents.base import Proposal, Solver, TrainableSolver
from selfevo.loop.folds import FoldAssignment, question_fold
from selfevo.loop.schedule import derive_seed


def lineage_of(solver) -> dict:
    """The grader's identity and what it was trained on: cross-fitting is a query over this."""
    lin = getattr(solver, "lineage", {}) or {}
    return {"id": solver.name, "trained_on": {"folds": sorted(lin.get("folds", [])),
                                              "rounds": sorted(lin.get("rounds", []))}}


def record_training(solver, folds: Sequence[int], round: int) -> None:
    lin = solver.lineage
    lin["folds"] = sorted(set(lin.get("folds", [])) | set(folds))
    lin["rounds"] = sorted(set(lin.get("rounds", [])) | {round})


class Feedback(Protocol):
    name: str

    def item_fold(self, proposal: Proposal, item_id: str) -> int:
        """The fold an item belongs to for cross-fitting (its source's, or its own)."""
        ...

    def begin_round(self, round: int, main: TrainableSolver) -> None: ...

    def grader_for(self, item) -> Solver:
        """The frozen solver that grades this item (a `loop.engine.Candidate`)."""
        ...

    def end_round(self, round: int, admitted: Sequence, tool, seed: int, last: bool) -> dict:
        """Train whatever the rule trains besides the main solver (aux solvers)."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class CoupledFeedback:
    """Dr. Zero: the grader of round r is the main solver as it stood after round r-1."""

    name = "coupled"

    def __init__(self, folds: FoldAssignment):
        self.folds = folds
        self.grader: Solver | None = None

    def item_fold(self, proposal: Proposal, item_id: str) -> int:
        return self.folds.of(proposal.source_id)

    def begin_round(self, round: int, main: TrainableSolver) -> None:
        self.grader = main.snapshot(name=f"main@r{round - 1}")

    def grader_for(self, item) -> Solver:
        assert self.grader is not None, "begin_round first"
        return self.grader

    def end_round(self, round: int, admitted: Sequence, tool, seed: int, last: bool) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class AuxFeedback:
    """Auxiliary solvers trained on slices of the admitted questions, and a rule choosing which
    one grades a question. One class serves CrossFit and every control; the options say how
    they differ (`trains`, `grades`, `split`, `budget`)."""

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
        n_aux = 1 if trains == "everything" else folds.k
        self.aux = [make_solver("aux-all" if n_aux == 1 else f"aux-{j}") for j in range(n_aux)]
        # paper: each aux solver gets 25 updates a round; half budget: 25 a round in total
        total = round(updates_per_round * n_aux * budget)
        self.updates = [total // n_aux + (1 if j < total % n_aux else 0) for j in range(n_aux)]
        self.full_updates = updates_per_round
        self.graders: list[Solver] = []
        self.base: Solver | None = None

    # ---------------------------------------------------------------- folds
    def item_fold(self, proposal: Proposal, item_id: str) -> int:
        if self.split == "question":  # control: the same source lands in both folds
            return question_fold(proposal.question, self.folds.seed, self.folds.k)
        return self.folds.of(proposal.source_id)

    def _item_folds(self, item) -> set[int]:
        if self.lineage_aware:
            return self.folds.lineage(item.proposal.source_ids)
        return {item.fold}

    def _trains_on(self, j: int, item) -> bool:
        if self.trains == "everything":
            return True
        folds = self._item_folds(item)
        # lineage-aware: an aux solver trains only on questions all of whose pages are its fold's
        return folds == {j} if self.lineage_aware else item.fold == j

    # ---------------------------------------------------------------- grading
    def begin_round(self, round: int, main: TrainableSolver) -> None:
        if round == 1:  # shared by all arms: no aux solver has trained yet
            self.base = main.snapshot(name="main@r0")
        self.graders = [a.snapshot(name=f"{a.name}@r{round - 1}") for a in self.aux]
        self._round = round

    def grader_for(self, item) -> Solver:
        if self._round == 1:
            return self.base
        if self.grades == "full":
            return self.graders[0]
        h = item.fold
        if self.grades == "own-fold":
            return self.graders[h]
        touched = self._item_folds(item)
        k = self.folds.k
        for step in range(1, k):  # prefer the next fold, deterministic
            j = (h + step) % k
            if j not in touched:
                return self.graders[j]
        return self.graders[(h + 1) % k]  # every fold touched: fall back to the source rule

    # ---------------------------------------------------------------- training
    def end_round(self, round: int, admitted: Sequence, tool, seed: int, last: bool) -> dict:
        # after the last round nobody would be graded by them, so they are not trained
        if last:
            return {}
        updates, rollouts = {}, 0
        for j, aux in enumerate(self.aux):
            items = [c for c in admitted if self._trains_on(j, c)]
            if not items:
                continue
            # the full budget's even split (as the main solver's), so every one of its updates
            # trains; a smaller budget takes the first of those batches
            n, full = len(items), self.full_updates
            for u in range(self.updates[j]):
                batch = items[u * n // full:(u + 1) * n // full]
                if not batch:  # fewer items than updates
                    continue
                trajs = aux.answer([c.proposal.question for c in batch], tool, greedy=False, n=self.samples,
                                   seed=derive_seed(seed, aux.name, u))
                aux.update([(ts, c.label) for ts, c in zip(trajs, batch, strict=True)])
                record_training(aux, sorted({f for c in batch for f in self._item_folds(c)}), round)
                updates[aux.name] = updates.get(aux.name, 0) + 1
                rollouts += self.samples * len(batch)
        return {"updates": updates, "generations": {"aux_rollouts": rollouts}}

    def state_dict(self) -> dict:
        return {"aux": [a.state_dict() for a in self.aux]}

    def load_state_dict(self, state: dict) -> None:
        for a, s in zip(self.aux, state["aux"], strict=True):
            a.load_state_dict(s)
