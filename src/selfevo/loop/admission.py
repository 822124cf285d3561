"""Admission rules: which proposed questions train the solver, and with which label."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from selfevo.agents.base import Proposal
from selfevo.search.tool import SearchTool


@dataclass
class Decision:
    admitted: bool
    label: str  # the adopted label (the training target when admitted)
    detail: dict = field(default_factory=dict)  # rule-specific record (e.g. MSV samples)


class Admission(Protocol):
    name: str

    def decide(self, proposals: Sequence[Proposal], tool: SearchTool, seed: int) -> list[Decision]: ...

    def generations(self) -> int:
        """Extra model generations this rule has spent so far (compute accounting)."""
        ...


class AdmitAll:
    """Dr. Zero: every well-formed proposal is admitted with its draft label."""

    name = "none"

    def decide(self, proposals: Sequence[Proposal], tool: SearchTool, seed: int) -> list[Decision]:
        return [Decision(True, p.draft_label) for p in proposals]

    def generations(self) -> int:
        return 0
