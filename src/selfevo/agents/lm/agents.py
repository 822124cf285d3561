"""The language-model Proposer and Solver: policies of an `LMPolicy` (adapters on one base) that
speak the protocols of `protocol.py` through the one rollout driver of `rollout.py`.

Neither sees anything but documents, questions, the search tool and (in training) the loop's
labels and rewards; the loop, MSV and CrossFit drive them exactly as they drive the sim agents.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence

from selfevo.agents.base import Proposal, Trajectory
from selfevo.agents.lm.policy import LMPolicy
from selfevo.agents.lm.protocol import (
    parse_proposer_action,
    proposer_messages,
    read_proposal,
    sample_hops,
    scaffolded,
    solver_messages,
)
from selfevo.agents.lm.rollout import run_rollouts
from selfevo.algos import bucket_advantages, group_advantages
from selfevo.evaluate import answers_match
from selfevo.loop.schedule import derive_seed
from selfevo.records import Document
from selfevo.search.tool import SearchTool


class LMSolver:
    """A Search-R1 solver. `policy_name=None` answers with the base model (evaluation of an
    untrained model); a frozen snapshot refuses to train."""

    def __init__(self, policy: LMPolicy, name: str, policy_name: str | None = None, frozen: bool = False,
                 lineage: dict | None = None):
        self.policy, self.name, self.policy_name, self.frozen = policy, name, policy_name, frozen
        self.lineage = lineage if lineage is not None else {}
        self.updates = 0

    @classmethod
    def trainable(cls, policy: LMPolicy, name: str, policy_name: str | None = None) -> LMSolver:
        """A fresh adapter (the base model's function) named `policy_name` (default `name`): the
        name seeds its initialisation and its dropout."""
        policy_name = policy_name or name
        policy.new(policy_name)
        return cls(policy, name, policy_name=policy_name)

    @classmethod
    def from_file(cls, policy: LMPolicy, name: str, path: str) -> LMSolver:
        """A frozen solver with the policy saved in `path` (a checkpoint's safetensors file)."""
        policy.load_file("evaluated", path)
        return cls(policy, name, policy_name="evaluated", frozen=True)

    def snapshot(self, name: str | None = None) -> LMSolver:
        name = name or f"{self.name}@frozen"
        self.policy.new(name, like=self.policy_name)
        return LMSolver(self.policy, name, policy_name=name, frozen=True, lineage=copy.deepcopy(self.lineage))

    def answer(self, questions: Sequence[str], tool: SearchTool, *, greedy: bool = True, n: int = 1,
               seed: int | None = None, contexts: Sequence[Document] | None = None) -> list[list[Trajectory]]:
        if contexts is not None and len(contexts) != len(questions):
            raise ValueError("one context per question")
        copies = 1 if greedy else n  # greedy samples are identical: generate one, repeat it
        starts = [solver_messages(q, None if contexts is None else self._context(contexts[i]))
                  for i, q in enumerate(questions) for _ in range(copies)]
        cfg = self.policy.cfg

        def generate(convs, s):
            return self.policy.generate(self.policy_name, convs, greedy=greedy, seed=s)

        rollouts = run_rollouts(starts, tool, generate, max_actions=cfg.max_actions,
                                seed=None if greedy else (seed if seed is not None else 0))
        out = []
        for i in range(len(questions)):
            trajs = [Trajectory(ro.answer, list(ro.searches), ro.actions, trace=ro)
                     for ro in rollouts[i * copies:(i + 1) * copies]]
            out.append(trajs * n if greedy else trajs)
        return out

    def _context(self, doc: Document) -> str:
        return self.policy.truncate(doc.contents, self.policy.cfg.doc_tokens)

    def update(self, groups: Sequence[tuple[list[Trajectory], str]]) -> dict:
        """Reward 1 when an answer matches the label under the loop's matcher; advantages within
        each question's group of responses (GRPO); Equation (1) over the assistant tokens."""
        if self.frozen:
            raise RuntimeError(f"{self.name} is a frozen snapshot")
        seqs, advs, rewards = [], [], []
        for trajs, label in groups:
            r = [1.0 if answers_match(t.answer, label) else 0.0 for t in trajs]
            rewards += r
            advs += group_advantages(r)
            seqs += [self.policy.encode(t.trace.messages) for t in trajs]
        stats = self.policy.update(self.policy_name, seqs, advs)
        self.updates += 1
        return {**stats, "reward": sum(rewards) / max(1, len(rewards))}

    def state_dict(self) -> dict:
        return {"name": self.name, "policy": self.policy.save(self.policy_name), "updates": self.updates,
                "lineage": self.lineage}

    def load_state_dict(self, state: dict) -> None:
        self.policy.load(self.policy_name, state["policy"])
        self.updates, self.lineage = state["updates"], state.get("lineage", {})


class LMProposer:
    """A Dr. Zero proposer: from the first `doc_tokens` tokens of a source drawn from its pool it
    writes an exactly-n-hop question and answer (n in ratio 4:3:2:1), optionally searching first."""

    def __init__(self, policy: LMPolicy, name: str, pool: Sequence[Document], like: str | None = None,
                 frozen: bool = False):
        if not pool:
            raise ValueError("the proposer needs at least one source document")
        self.policy, self.name, self.pool, self.frozen = policy, name, list(pool), frozen
        policy.new(name, like=like)
        self.format_penalty = policy.cfg.format_penalty
        self.updates = 0

    def snapshot(self, name: str | None = None) -> LMProposer:
        return LMProposer(self.policy, name or f"{self.name}@frozen", self.pool, like=self.name, frozen=True)

    def propose(self, n: int, tool: SearchTool, seed: int) -> list[Proposal]:
        rnd = random.Random(seed)
        picks = [(self.pool[rnd.randrange(len(self.pool))], sample_hops(rnd.random())) for _ in range(n)]
        cfg = self.policy.cfg
        searching = cfg.proposer_searches
        starts = [proposer_messages(self.policy.truncate(doc.contents, cfg.doc_tokens), hops, searching)
                  for doc, hops in picks]

        def generate(convs, s, **kw):  # kw: the scaffold's prefix and stops
            return self.policy.generate(self.name, convs, greedy=False, seed=s, **kw)

        if cfg.proposer_scaffold:
            generate = scaffolded(generate)
        rollouts = run_rollouts(starts, tool, generate, max_actions=cfg.max_actions if searching else 1,
                                seed=derive_seed(seed, "proposer"), parse=parse_proposer_action)
        out = []
        for (doc, hops), ro in zip(picks, rollouts):
            question, answer, error = read_proposal(ro.final)
            read = tuple(dict.fromkeys([doc.id, *ro.read]))
            out.append(Proposal(question, answer, doc.id, read, hops, trace=ro, format_error=error))
        return out

    def update(self, proposals: Sequence[Proposal], rewards: Sequence[float]) -> dict:
        """Advantages within each hop bucket (Dr. Zero); the terminal answer is not trained."""
        if self.frozen:
            raise RuntimeError(f"{self.name} is a frozen snapshot")
        advs = bucket_advantages(rewards, [p.hops for p in proposals])
        seqs = [self.policy.encode(p.trace.messages, mask_final_answer=True) for p in proposals]
        stats = self.policy.update(self.name, seqs, advs)
        self.updates += 1
        return {**stats, "reward": sum(rewards) / max(1, len(rewards)),
                "malformed": sum(p.format_error is not None for p in proposals)}

    def state_dict(self) -> dict:
        return {"name": self.name, "policy": self.policy.save(self.name), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.policy.load(self.name, state["policy"])
        self.updates = state["updates"]
