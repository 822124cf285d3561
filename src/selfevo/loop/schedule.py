"""The paper's schedule: rounds of proposer updates then main-solver updates."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from selfevo.algos import N_GRADER_SAMPLES

MAX_STEPS = 1_000_000  # scheduled steps a run may have
# a round's admitted questions and a question's samples: a typo's 10**12 would grow memory until stopped
# (the paper's: 1,600 and 5)
MAX_ADMITTED = 10_000_000
MAX_SAMPLES = 1_000
MAX_SEEDS = 10_000  # seeds of a grid or a replay study: each is a run per treatment, or a study's jobs


@dataclass(frozen=True)
class LoopConfig:
    rounds: int = 3
    proposer_steps: int = 18  # paper: 18 proposer updates a round
    solver_steps: int = 25  # paper: 25 main-solver updates a round
    admit_per_round: int = 1600  # paper: 1,600 admitted questions a round
    # paper: the grader answers each question five times; here also the solvers' rollouts a question
    # (their GRPO group; engine-run keeps them apart: engine.solver_generations)
    grader_samples: int = N_GRADER_SAMPLES
    # Dr. Zero draws its seed documents from a fixed training pool, not the whole corpus; the
    # pool's size sets how often a source comes back across rounds (0 = every document)
    source_docs: int = 300
    # MSV (an msv treatment): the admission model's samples with the source, and as many without; a
    # strict majority of each must exist and match (paper: 3, so 2 of 3)
    msv_samples: int = 3

    def __post_init__(self):
        if not isinstance(self.source_docs, int) or isinstance(self.source_docs, bool) or self.source_docs < 0:
            raise ValueError(f"loop.source_docs: must be an integer >= 0, got {self.source_docs!r}")
        for name in ("rounds", "proposer_steps", "solver_steps", "admit_per_round", "grader_samples", "msv_samples"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"loop.{name}: must be a positive integer, got {value!r}")
        for name, most in (("admit_per_round", MAX_ADMITTED), ("grader_samples", MAX_SAMPLES),
                           ("msv_samples", MAX_SAMPLES)):
            if getattr(self, name) > most:
                raise ValueError(f"loop.{name}: must be at most {most:,}, got {getattr(self, name):,}")
        if self.rounds * (self.proposer_steps + self.solver_steps) > MAX_STEPS:
            # the schedule is listed before the first step: a typo's 10**12 rounds would hang start-up
            # named by the largest factor (the one likeliest mistyped), with the rule over all three
            per_round = self.proposer_steps + self.solver_steps
            field = "rounds" if self.rounds >= per_round else max(("proposer_steps", "solver_steps"),
                                                                 key=lambda f: getattr(self, f))
            raise ValueError(f"loop.{field}: {self.rounds:,} rounds × ({self.proposer_steps:,} + "
                             f"{self.solver_steps:,}) steps = {self.rounds * per_round:,} scheduled steps exceed "
                             f"{MAX_STEPS:,} (loop.rounds × (loop.proposer_steps + loop.solver_steps); the paper's: "
                             "3 × (18 + 25) = 129)")
        if self.grader_samples < 2:
            # f(k) = (n-k)/(n-1) pays only 0 < k < n: with one sample no k qualifies, every reward is 0
            raise ValueError(f"loop.grader_samples: the frontier reward needs at least 2 grader samples, "
                             f"got {self.grader_samples}")

    @property
    def proposals_per_step(self) -> int:
        """Enough proposals over the proposer steps to fill the round's admission budget."""
        return math.ceil(self.admit_per_round / self.proposer_steps)


@dataclass(frozen=True)
class ScheduledStep:
    round: int
    step: int  # 1-based over the whole run
    step_in_round: int  # 1-based within the round, proposer steps first
    kind: str  # "proposer" | "solver"


def schedule(cfg: LoopConfig) -> list[ScheduledStep]:
    steps, n = [], 0
    for r in range(1, cfg.rounds + 1):
        for i in range(cfg.proposer_steps + cfg.solver_steps):
            n += 1
            kind = "proposer" if i < cfg.proposer_steps else "solver"
            steps.append(ScheduledStep(r, n, i + 1, kind))
    return steps


def derive_seed(seed: int, *keys: object) -> int:
    """An independent seed for one purpose at one step. Deriving every seed from (run seed,
    round, step, purpose) makes a resumed run draw exactly what an uninterrupted one draws,
    without checkpointing any random state."""
    h = hashlib.blake2b("\x1f".join(map(str, (seed, *keys))).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")
