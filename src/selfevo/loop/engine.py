"""The self-evolution loop, written once. It reads top to bottom:

    for each round:
        the feedback rule names this round's graders (coupled: main solver after round r-1)
        18 proposer steps: propose -> admission rule -> grade 5x -> frontier reward -> update
        25 main-solver steps on the admitted questions (policy gradient vs the adopted label)
        the feedback rule trains what else it trains (CrossFit: the auxiliary solvers)
        evaluate the main solver on the seven benchmarks; checkpoint
    (and, with step_checkpoints, a checkpoint within the round every so many steps and after each
    auxiliary solver's training)

Everything is written to the run directory as it happens; nothing here reads the audit or the
world's truth. Seeds are derived from (run seed, round, step, purpose), so a run resumed from a
round or step checkpoint draws exactly what an uninterrupted run draws.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

from selfevo._bar import Progress
from selfevo._io import json_problem
from selfevo._plugins import ContractError
from selfevo.agents.base import Proposal, Proposer, TrainableSolver, empty_answer, mark_missing
from selfevo.algos import frontier_reward
from selfevo.evaluate import answers_match, check_answers
from selfevo.loop.admission import Admission, Decision
from selfevo.loop.feedback import Feedback, lineage_of, record_training
from selfevo.loop.folds import FoldAssignment
from selfevo.loop.schedule import LoopConfig, ScheduledStep, derive_seed, schedule
from selfevo.records import item_record, malformed_record, step_record
from selfevo.search.tool import SearchTool


def check_proposals(proposer: str, proposals: Sequence) -> None:
    """A proposer's answer to `propose`: `Proposal`s whose texts are strings, whose hop count is at least 1 and
    whose lineage (`source_ids`) holds the page it was given. A proposer of a user's that breaks this is named
    here: a proposal with no lineage would train the main solver with no fold recorded."""
    if not isinstance(proposals, list | tuple):
        raise ContractError(f"proposer {proposer!r}: propose returns a list of Proposal, got "
                            f"{type(proposals).__name__}")
    for p in proposals:
        if not isinstance(p, Proposal):
            raise ContractError(f"proposer {proposer!r}: propose returned a {type(p).__name__}, not a "
                                "selfevo.agents.base.Proposal")
        if not (isinstance(p.question, str) and isinstance(p.draft_label, str) and isinstance(p.source_id, str)):
            raise ContractError(f"proposer {proposer!r}: a proposal's question, draft_label and source_id are strings "
                                f"({p.question!r}, {p.draft_label!r}, {p.source_id!r})")
        if isinstance(p.hops, bool) or not isinstance(p.hops, int) or p.hops < 1:
            raise ContractError(f"proposer {proposer!r}: {p.question!r}: hops is the number of pages the question "
                                f"chains through (>= 1), got {p.hops!r}")
        if p.source_id not in tuple(p.source_ids):
            raise ContractError(f"proposer {proposer!r}: {p.question!r}: source_ids {tuple(p.source_ids)!r} (every "
                                f"page read) must hold its source_id {p.source_id!r}")


def check_stats(who: str, stats: object) -> dict:
    """What an `update` returns, written into the step record: a dict of JSON values."""
    if not isinstance(stats, dict):
        raise ContractError(f"{who}.update returns a dict of statistics (JSON values), got {type(stats).__name__}")
    if problem := json_problem(stats):
        raise ContractError(f"{who}.update: its statistics are written to the step records as JSON: {problem}")
    return stats


# what the loop calls of each piece (the protocols of agents.base, loop.admission and loop.feedback)
_PIECES = {
    "proposer": ("propose", "update", "state_dict", "load_state_dict"),
    "main solver": ("name", "answer", "update", "snapshot", "lineage", "state_dict", "load_state_dict"),
    "admission rule": ("name", "generations_per_candidate", "begin_round", "decide"),
    "feedback rule": ("item_fold", "begin_round", "route", "n_aux", "end_round", "state_dict", "load_state_dict"),
}
# compute.json's generation keys of the loop's own; an admission rule's cost is booked under its own key
RESERVED_GENERATIONS = ("proposer", "grader", "solver_rollouts", "aux_rollouts", "evaluation")


def check_pieces(pieces: dict) -> None:
    """Each piece (by `_PIECES`'s names) has what the loop calls, and an admission rule books its cost under
    a key of its own: a piece of a user's (a feedback rule handed as the admission rule, one missing a
    method) is named now, not met as an AttributeError rounds later."""
    for what, piece in pieces.items():
        missing = [a for a in _PIECES[what] if not hasattr(piece, a)]
        if missing:
            raise ContractError(f"{what} {getattr(piece, 'name', type(piece).__name__)!r} ({type(piece).__name__}): "
                                f"has no {', '.join(missing)} (docs/extending.md)")
    admission = pieces["admission rule"]
    key = getattr(admission, "purpose", admission.name)
    if not isinstance(key, str):
        raise ContractError(f"admission rule {admission.name!r}: its purpose, else its name, names its generations "
                            f"in compute.json: a string, got {type(key).__name__}")
    if key in RESERVED_GENERATIONS:
        raise ContractError(f"admission rule {admission.name!r}: its generations are counted in compute.json under "
                            f"its purpose, else its name, {key!r}: that must be a name other than the loop's own "
                            f"({', '.join(RESERVED_GENERATIONS)})")


def check_decisions(admission: Admission, proposals: Sequence[Proposal], decisions: Sequence) -> None:
    """An admission rule's answer to `decide`: one `Decision` a proposal, in order, and no admitted one
    with an empty label (it would train the solver on ''); and its cost, an integer count of generations a
    candidate. A rule of a user's that breaks this is named."""
    rule, extra = admission.name, admission.generations_per_candidate
    if isinstance(extra, bool) or not isinstance(extra, int) or extra < 0:
        raise ContractError(f"admission rule {rule!r}: generations_per_candidate is the number of extra generations "
                            f"a candidate costs (an integer >= 0), got {extra!r}")
    if len(decisions) != len(proposals):
        raise ContractError(f"admission rule {rule!r}: {len(decisions)} decisions for {len(proposals)} proposals; "
                            "decide returns one Decision a proposal, in their order")
    for p, d in zip(proposals, decisions):
        if not isinstance(d, Decision):
            raise ContractError(f"admission rule {rule!r}: decide returned a {type(d).__name__}, not a "
                                "selfevo.loop.admission.Decision")
        if not isinstance(d.admitted, bool) or not isinstance(d.label, str):
            raise ContractError(f"admission rule {rule!r}: {p.question!r}: a Decision's admitted is True or False and "
                                f"its label a string, got {d.admitted!r}, {d.label!r}")
        if d.admitted and empty_answer(d.label):
            raise ContractError(f"admission rule {rule!r} admitted {p.question!r} with the label {d.label!r}: an "
                                "admitted question needs a label to train on")
        if not isinstance(d.detail, dict) or json_problem(d.detail):
            raise ContractError(f"admission rule {rule!r}: {p.question!r}: a Decision's detail is a dict of JSON "
                                f"values (it is written to the step records), got {str(d.detail)[:80]!r}")


def cap_admissions(decisions: Sequence[Decision], room: int) -> int:
    """Hold a round to its admission budget: with `room` admissions left, the admitted decisions
    beyond it, in order, become not admitted (`over_budget` in their detail). Returns the room left
    (negative once over)."""
    for d in decisions:
        if d.admitted:
            if room <= 0:
                d.admitted, d.detail = False, {**d.detail, "over_budget": True}
            room -= 1
    return room


@dataclass
class Candidate:
    """A proposal on its way through the loop, with its lineage."""

    item_id: str
    proposal: Proposal
    fold: int  # the fold used for cross-fitting (its source's; the question's under question-split)
    source_folds: tuple[int, ...]  # folds of every page read while composing it (lineage)
    decision: Decision
    round: int
    step: int

    @property
    def label(self) -> str:
        return self.decision.label

    def to_json(self) -> dict:
        """What a step checkpoint keeps of an admitted candidate (no trace: nothing after its step reads it)."""
        p, d = self.proposal, self.decision
        return {"item_id": self.item_id, "question": p.question, "draft_label": p.draft_label,
                "source_id": p.source_id, "source_ids": list(p.source_ids), "hops": p.hops, "fold": self.fold,
                "source_folds": list(self.source_folds), "admitted": d.admitted, "label": d.label,
                "detail": d.detail, "round": self.round, "step": self.step}

    @classmethod
    def from_json(cls, o: Mapping) -> Candidate:
        proposal = Proposal(o["question"], o["draft_label"], o["source_id"], tuple(o["source_ids"]), o["hops"])
        return cls(o["item_id"], proposal, o["fold"], tuple(o["source_folds"]),
                   Decision(o["admitted"], o["label"], dict(o["detail"])), o["round"], o["step"])


# the downstream evaluation's keys in compute.json (generations; seconds): counted, but the same in
# every arm and no part of the training whose overhead `selfevo compare` reports (the paper's Table 3)
EVAL_GENERATIONS, EVAL_PHASE = "evaluation", "eval"


@dataclass
class Compute:
    """Compute accounting: generations by purpose, updates per model, wall seconds per phase."""

    generations: dict[str, int] = field(default_factory=dict)
    updates: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, table: str, key: str, value: float) -> None:
        d = getattr(self, table)
        d[key] = d.get(key, 0) + value

    def to_json(self) -> dict:
        return {"generations": dict(self.generations), "updates": dict(self.updates),
                "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
                "total_generations": sum(self.generations.values()),
                "total_updates": sum(self.updates.values())}

    @classmethod
    def from_json(cls, obj: dict) -> Compute:
        return cls(dict(obj["generations"]), dict(obj["updates"]), dict(obj["seconds"]))


class BadStepState(ValueError):
    """A step checkpoint that does not load into this loop (edited, or of another config)."""


class RunSink(Protocol):
    """Where the loop writes (implemented by `selfevo.runs.RunDir`)."""

    def append_steps(self, rows: list[dict]) -> None: ...

    def checkpoint(self, round: int, state: dict) -> None: ...

    def step_checkpoint(self, state: dict) -> None: ...


@dataclass
class Loop:
    config: LoopConfig
    seed: int
    proposer: Proposer
    main: TrainableSolver
    admission: Admission
    feedback: Feedback
    tool: SearchTool
    folds: FoldAssignment
    # (solver, round) -> writes the eval files and returns evaluate_solver's result
    evaluate: Callable[[TrainableSolver, int], dict] | None = None
    compute: Compute = field(default_factory=Compute)
    # a mid-round checkpoint every this many steps of a round, and after its last step (0: only the
    # round's own, after its evaluation): with language models a round is hours
    step_checkpoints: int = 0

    def __post_init__(self):
        check_pieces({"proposer": self.proposer, "main solver": self.main, "admission rule": self.admission,
                      "feedback rule": self.feedback})

    def _timed(self, phase: str, t0: float) -> float:
        t1 = time.perf_counter()
        self.compute.add("seconds", phase, t1 - t0)
        return t1

    # ---------------------------------------------------------------- one proposer step
    def proposer_step(self, st: ScheduledStep, room: int) -> tuple[dict, list[Candidate]]:
        """`room`: admissions left in this round's budget; admitted candidates beyond it are
        recorded as not admitted (`over_budget`)."""
        cfg, t = self.config, time.perf_counter()
        proposed = self.proposer.propose(cfg.proposals_per_step, self.tool,
                                         derive_seed(self.seed, st.round, st.step, "propose"))
        check_proposals(getattr(self.proposer, "name", type(self.proposer).__name__), proposed)
        proposals = [mark_missing(p) for p in proposed]
        self.compute.add("generations", "proposer", len(proposals))
        t = self._timed("propose", t)
        # a malformed proposal (LM proposers) is neither admitted nor graded
        wellformed = [p for p in proposals if p.format_error is None]
        made = list(self.admission.decide(wellformed, self.tool, derive_seed(self.seed, st.round, st.step, "admit")))
        check_decisions(self.admission, wellformed, made)
        decided = iter(made)
        decisions = [next(decided) if p.format_error is None else
                     Decision(False, p.draft_label) for p in proposals]
        self.compute.add("generations", getattr(self.admission, "purpose", self.admission.name),
                         self.admission.generations_per_candidate * len(wellformed))
        cap_admissions(decisions, room)
        t = self._timed("admit", t)
        cands = []
        for i, (p, d) in enumerate(zip(proposals, decisions, strict=True)):
            cands.append(Candidate(f"r{st.round}-s{st.step}-{i}", p, self.feedback.item_fold(p),
                                   tuple(sorted(self.folds.lineage(p.source_ids))), d, st.round, st.step))
        # grade: each question by the grader its lineage allows (the feedback rule)
        by_grader: dict[int, list[int]] = {}
        graders, routes = {}, {}
        for i, c in enumerate(cands):
            if c.proposal.format_error is not None:
                continue
            g, routes[i] = self.feedback.route(c)
            graders[i] = g
            by_grader.setdefault(id(g), []).append(i)
        responses: dict[int, list[str]] = {}
        for idx in sorted(by_grader.values(), key=lambda v: v[0]):
            g = graders[idx[0]]
            trajs = check_answers(g.name, g.answer([cands[i].proposal.question for i in idx], self.tool,
                                                   greedy=False, n=cfg.grader_samples,
                                                   seed=derive_seed(self.seed, st.round, st.step, "grade", g.name)),
                                  len(idx), cfg.grader_samples)
            for i, ts in zip(idx, trajs):
                responses[i] = [tr.answer for tr in ts]
        self.compute.add("generations", "grader", cfg.grader_samples * len(graders))
        t = self._timed("grade", t)
        # paper: k counts grader samples matching the proposer's draft answer; f(k) pays it
        rewards, items, malformed = [], [], []
        for i, c in enumerate(cands):
            if c.proposal.format_error is not None:  # recorded apart: no grader, nothing to audit
                r = -getattr(self.proposer, "format_penalty", 0.0)
                p = c.proposal
                malformed.append(malformed_record(item_id=c.item_id, source_id=p.source_id, hops=p.hops,
                                                  question=p.question, draft_label=p.draft_label,
                                                  format_error=p.format_error, reward=r,
                                                  # a language model's rollout (the sim's proposals keep none)
                                                  text=getattr(p.trace, "last_action", None)))
                rewards.append(r)
                continue
            k = sum(answers_match(z, c.proposal.draft_label) for z in responses[i])
            r = frontier_reward(k, cfg.grader_samples)
            rewards.append(r)
            items.append(self._item_record(c, responses[i], k, r, lineage_of(graders[i]), routes[i]))
        stats = check_stats("proposer", self.proposer.update([c.proposal for c in cands], rewards))
        self.compute.add("updates", "proposer", 1)
        self._timed("proposer_update", t)
        admitted = [c for c in cands if c.decision.admitted]
        return self._step_record(st, "proposer", items, stats, malformed), admitted

    # ---------------------------------------------------------------- one main-solver step
    def solver_step(self, st: ScheduledStep, batch: Sequence[Candidate]) -> dict:
        cfg, t = self.config, time.perf_counter()
        trajs = check_answers(self.main.name, self.main.answer([c.proposal.question for c in batch], self.tool,
                                                               greedy=False, n=cfg.grader_samples,
                                                               seed=derive_seed(self.seed, st.round, st.step,
                                                                                "rollout")),
                              len(batch), cfg.grader_samples)
        self.compute.add("generations", "solver_rollouts", cfg.grader_samples * len(batch))
        t = self._timed("solver_rollout", t)
        identity = lineage_of(self.main)
        stats = check_stats("main solver", self.main.update([(ts, c.label) for ts, c in zip(trajs, batch)]))
        self.compute.add("updates", "main", 1)
        record_training(self.main, sorted({f for c in batch for f in c.source_folds}), st.round)
        self._timed("solver_update", t)
        items = []
        for c, ts in zip(batch, trajs):
            answers = [tr.answer for tr in ts]
            k = sum(answers_match(z, c.label) for z in answers)
            items.append(self._item_record(c, answers, k, k / len(answers), identity))
        return self._step_record(st, "solver", items, stats)

    # ---------------------------------------------------------------- records
    @staticmethod
    def _item_record(c: Candidate, responses: list[str], k: int, reward: float, grader: dict,
                     routing: dict | None = None) -> dict:
        p = c.proposal
        # `routing` before `admission`, in the order the engine integrations write them
        return item_record(item_id=c.item_id, source_id=p.source_id, source_ids=p.source_ids, fold=c.fold,
                           source_folds=c.source_folds, hops=p.hops, question=p.question,
                           draft_label=p.draft_label, adopted_label=c.label, admitted=c.decision.admitted,
                           responses=responses, k=k, reward=reward, grader=grader,
                           **({"routing": routing} if routing else {}),
                           **({"admission": c.decision.detail} if c.decision.detail else {}))

    @staticmethod
    def _step_record(st: ScheduledStep, kind: str, items: list[dict], stats: dict,
                     malformed: list[dict] | None = None) -> dict:
        return step_record(round=st.round, step=st.step, step_in_round=st.step_in_round, kind=kind, items=items,
                           stats=stats, malformed=malformed)

    # ---------------------------------------------------------------- the run
    def run(self, sink: RunSink, start_round: int = 1, progress: bool = True,
            step_state: Mapping | None = None) -> None:
        """Rounds `start_round`.. to the end. `step_state`: a step checkpoint of round `start_round`
        (the loop restored to the round before it), which the round goes on from."""
        cfg = self.config
        steps = [s for s in schedule(cfg) if s.round >= start_round]
        last_done = step_state["step"] if step_state is not None else 0
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, disable=not progress, transient=True) as bar:
            task = bar.add_task("evolve", total=len(steps), completed=sum(s.step <= last_done for s in steps))
            for r in range(start_round, cfg.rounds + 1):
                # the round's graders and admission are made from the models as the round began ...
                self.feedback.begin_round(r, self.main)
                self.admission.begin_round(r, self.main)
                pool: list[Candidate] = []
                if r == start_round and step_state is not None:  # ... and go on from where it stopped
                    pool = self._load_step_state(step_state)
                round_steps = [s for s in steps if s.round == r]
                for st in round_steps[: cfg.proposer_steps]:
                    if st.step <= last_done:
                        continue
                    bar.update(task, description=f"round {r} proposer step {st.step_in_round}")
                    record, admitted = self.proposer_step(st, cfg.admit_per_round - len(pool))
                    sink.append_steps([record])
                    pool.extend(admitted)
                    self._maybe_step_checkpoint(sink, st, pool)
                    bar.advance(task)
                for j, st in enumerate(round_steps[cfg.proposer_steps:]):
                    if st.step <= last_done:
                        continue
                    # (step_in_round counts the proposer steps first: "solver step 37" of 25)
                    bar.update(task, description=f"round {r} solver step {j + 1}")
                    # an even split, so every scheduled step trains when the pool allows
                    batch = pool[j * len(pool) // cfg.solver_steps:(j + 1) * len(pool) // cfg.solver_steps]
                    record = self.solver_step(st, batch) if batch else self._step_record(st, "solver", [], {})
                    sink.append_steps([record])
                    self._maybe_step_checkpoint(sink, st, pool)
                    bar.advance(task)
                t = time.perf_counter()

                def trained(n: int, counts: dict, r=r, step=round_steps[-1].step, pool=pool) -> None:
                    nonlocal t
                    for table in ("updates", "generations"):
                        for key, value in counts[table].items():
                            self.compute.add(table, key, value)
                    self._timed("aux", t)
                    if self.step_checkpoints:  # an auxiliary solver's training is many updates too
                        self._step_checkpoint(sink, r, step, pool, aux_trained=n)
                    # the checkpoint's write is no arm's training (the steps' checkpoints are not timed
                    # either): counted as "aux", it was CrossFit's overhead alone
                    t = time.perf_counter()

                start = step_state.get("aux_trained", 0) if r == start_round and step_state is not None else 0
                last = r == cfg.rounds
                if self.feedback.n_aux and not last:  # (after the last round none are trained)
                    bar.update(task, description=f"round {r} auxiliary solvers")
                self.feedback.end_round(r, pool, self.tool, derive_seed(self.seed, r, "aux"),
                                        last=last, start=start, trained=trained)
                self._timed("aux", t)
                if self.evaluate is not None:
                    bar.update(task, description=f"round {r} evaluation")
                self.evaluate_main(r)
                sink.checkpoint(r, self.state_dict())

    def evaluate_main(self, r: int) -> None:
        """The main solver on the benchmarks after round r (0: the base model), counted (one
        trajectory a question) and timed."""
        t = time.perf_counter()
        if self.evaluate is not None:
            result = self.evaluate(self.main, r)
            self.compute.add("generations", EVAL_GENERATIONS, result["run"]["questions"])
        self._timed(EVAL_PHASE, t)

    def _maybe_step_checkpoint(self, sink: RunSink, st: ScheduledStep, pool: Sequence[Candidate]) -> None:
        """A step checkpoint every `step_checkpoints` steps of a round and after its last: what the
        round changed so far (proposer, main solver, compute, the admitted pool). The graders and the
        auxiliary solvers do not change during the round's steps: a resume makes them from the round
        before (after the steps, one checkpoint for each auxiliary solver trained holds them too)."""
        n, last = self.step_checkpoints, self.config.proposer_steps + self.config.solver_steps
        if n and (st.step_in_round % n == 0 or st.step_in_round == last):
            self._step_checkpoint(sink, st.round, st.step, pool)

    def _step_checkpoint(self, sink: RunSink, round_: int, step: int, pool: Sequence[Candidate],
                         aux_trained: int | None = None) -> None:
        """The step checkpoint's one form: during the steps without the feedback rule's state, after
        them with it and the count of auxiliary solvers it holds trained (`aux_trained`)."""
        aux = {} if aux_trained is None else {"aux_trained": aux_trained}
        sink.step_checkpoint({"round": round_, "step": step, **aux,
                              **self.state_dict(feedback=aux_trained is not None),
                              "pool": [c.to_json() for c in pool]})

    def _load_step_state(self, state: Mapping) -> list[Candidate]:
        """The step checkpoint's models (and, written after the round's steps, those of the auxiliary
        solvers trained so far: `aux_trained`) loaded; its admitted pool returned."""
        aux_trained = state.get("aux_trained")
        if aux_trained is not None and not (isinstance(aux_trained, int) and 0 <= aux_trained <= self.feedback.n_aux):
            raise BadStepState(f"field 'aux_trained' should be 0..{self.feedback.n_aux}, got {aux_trained!r}")
        try:
            self.load_state_dict(state, feedback=aux_trained is not None)
            return [Candidate.from_json(c) for c in state["pool"]]
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise BadStepState(f"{type(e).__name__}: {e}") from None

    def state_dict(self, feedback: bool = True) -> dict:
        """Every model's state and the compute counts (`feedback=False`: what a round changes before
        its end, for a step checkpoint)."""
        out = {"proposer": self.proposer.state_dict(), "main": self.main.state_dict()}
        if feedback:
            out["feedback"] = self.feedback.state_dict()
        return {**out, "compute": self.compute.to_json()}

    def load_state_dict(self, state: Mapping, feedback: bool = True) -> None:
        self.proposer.load_state_dict(state["proposer"])
        self.main.load_state_dict(state["main"])
        if feedback:
            self.feedback.load_state_dict(state["feedback"])
        self.compute = Compute.from_json(state["compute"])

