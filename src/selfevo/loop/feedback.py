"""Feedback rules: who grades a proposed question (the only thing CrossFit changes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from selfevo.agents.base import Solver, TrainableSolver


def lineage_of(solver) -> dict:
    """The grader's identity and what it was trained on: cross-fitting is a query over this."""
    lin = getattr(solver, "lineage", {}) or {}
    return {"id": solver.name, "trained_on": {"folds": sorted(lin.get("folds", [])),
                                              "rounds": sorted(lin.get("rounds", []))}}


class Feedback(Protocol):
    name: str

    def begin_round(self, round: int, main: TrainableSolver) -> None: ...

    def grader_for(self, fold: int) -> Solver:
        """The frozen solver that grades a question whose source is in `fold`."""
        ...

    def end_round(self, round: int, admitted: Sequence, tool, seed: int) -> dict:
        """Train whatever the rule trains besides the main solver (aux solvers)."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class CoupledFeedback:
    """Dr. Zero: the grader of round r is the main solver as it stood after round r-1."""

    name = "coupled"

    def __init__(self):
        self.grader: Solver | None = None

    def begin_round(self, round: int, main: TrainableSolver) -> None:
        self.grader = main.snapshot(name=f"main@r{round - 1}")

    def grader_for(self, fold: int) -> Solver:
        assert self.grader is not None, "begin_round first"
        return self.grader

    def end_round(self, round: int, admitted: Sequence, tool, seed: int) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
