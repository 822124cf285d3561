"""The agent protocols. Every backend (sim, lm, remote, the retrieval baseline) implements
these few methods; the loop and the evaluator know nothing else about an agent."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from selfevo.search.tool import SearchTool


@dataclass
class Trajectory:
    """One solver rollout: the searches it made and the answer it gave."""

    answer: str
    searches: list[str] = field(default_factory=list)
    actions: int = 0


class Solver(Protocol):
    name: str

    def answer(self, questions: Sequence[str], tool: SearchTool, *, greedy: bool = True,
               n: int = 1, seed: int | None = None) -> list[list[Trajectory]]:
        """`n` trajectories per question (greedy: deterministic; else sampled)."""
        ...
