"""The loop's two rewards, in the calling conventions of TRL and verl.

Proposer (the frontier reward). A completion's last action is read as the loop's proposer reads
it (`protocol.parse_proposer_action`: no answer action, no final question) and parsed with the Dr. Zero
rules (`protocol.read_proposal`); a malformed one earns `-format_penalty` and is
neither graded nor admitted. A well-formed one is routed by its lineage to the grader its
treatment allows (`routing.route`: coupled -> the main solver after the previous round; CrossFit ->
the auxiliary solver of another fold), which answers it `samples` times (5; temperature 0.8, top-p
0.95) through its OpenAI-compatible endpoint with the search tool (`agents.remote.RemoteSolver`,
the Search-R1 protocol). k = answers matching the draft label under the loop's one matcher
(`evaluate.answers_match`); the reward is `algos.frontier_reward(k)`. Every graded item is appended,
with the loop's item schema (`records.item_record`), to an append-only staging log; the
admission step (`admit.py`) adds the admission decision and writes the proposer step records that
`selfevo audit` reads.

Solver. 1 if the answer extracted from the completion (its final turn read by `protocol.parse_action`,
as the loop's rollouts read every turn: the first closed `<answer>…</answer>`) matches the adopted
label under the same matcher, else 0.

Conventions:
  TRL   reward_funcs: `f(prompts, completions, **columns) -> list[float]`; completions are chat
        message lists or strings; the dataset's lineage columns (and the rollout's `answer`,
        `final`, `read` fields) arrive as keyword lists.
  verl  custom_reward_function: `compute_score(data_source, solution_str, ground_truth,
        extra_info=None, **reward_kwargs)` per sample (the naive reward manager), or
        `compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos, **kw)` (batch).
"""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selfevo._io import append_jsonl, read_json
from selfevo.agents.lm.protocol import (
    BUDGET_SPENT,
    CORRECTIVE,
    parse_action,
    parse_proposer_action,
    read_proposal,
    solver_question,
)
from selfevo.algos import frontier_reward
from selfevo.evaluate import answers_match
from selfevo.integrations.datasets import PROPOSER_SOURCE, SOLVER_SOURCE
from selfevo.integrations.routing import Grader, item_fold, route, touched_folds, treatment_of
from selfevo.loop.folds import FoldAssignment
from selfevo.loop.schedule import derive_seed
from selfevo.records import item_record, malformed_record, step_record
from selfevo.search.tool import SearchTool

# ---------------------------------------------------------------- text helpers


# how each observation the rollouts send ends: a search's <information>, the budget-spent note and the
# corrective message (the loop sends those two bare, and so does verl's tool: they have no
# </information>, and both quote <answer>/<search> tags a parser would take for an action)
_OBSERVATION_ENDS = ("</information>", BUDGET_SPENT, CORRECTIVE)


def final_turn(completion: Any) -> str:
    """The last action of a multi-turn completion: after the last observation of any kind in a string
    (verl's decoded response), the last assistant turn of chat messages (observations come back as user
    turns), read as a string too: TRL hands a `rollout_func`'s whole trajectory back as one assistant message."""
    if isinstance(completion, str):
        end = max((completion.rfind(s) + len(s) for s in _OBSERVATION_ENDS if s in completion), default=0)
        return completion[end:]
    if isinstance(completion, Mapping):
        return final_turn(str(completion.get("content") or ""))
    turns = [m for m in completion if m.get("role", "assistant") == "assistant"]
    return final_turn(str(turns[-1].get("content") or "")) if turns else ""


def extract_answer(completion: Any) -> str:
    """The answer a Search-R1 trajectory gives, read as the loop's rollouts read it: its final turn
    parsed by `protocol.parse_action` -- the first closed <answer> of that action ('' when the
    action is no answer: a search, or nothing valid)."""
    action = parse_action(final_turn(completion))
    return action.content if action.kind == "answer" else ""


def solver_reward(answer: str, label: str) -> float:
    """The solver's reward: the loop's matcher against the adopted label."""
    return 1.0 if answers_match(answer, label) else 0.0


# ---------------------------------------------------------------- the frontier reward


class GradingFailed(RuntimeError):
    """A grader call failed for good (after the client's retries): its sample has no answer, and
    counting it as a wrong one would lower k and pay the proposer for the grader's outage."""


@dataclass(frozen=True)
class ProposalSample:
    """One proposer completion with what the reward needs of its lineage."""

    text: str  # the proposer's final turn (<question>…</question> <answer>…</answer>)
    source_id: str
    hops: int
    read: tuple[str, ...] = ()  # pages its searches returned while composing (lineage)
    item_id: str = ""  # given by the caller, else derived
    written: str | None = None  # its last action as written, where `text` is not it (a rollout's '' final)


class FrontierReward:
    """Grade proposals with the grader their lineage allows; pay f(k); log every item.

    `items_path`: the append-only staging log (one JSON line per item or malformed proposal, with
    the round and the step within the round when the caller knows it). `graders`: role -> Grader
    (endpoint + lineage). `tool`: the search tool the graders use (a local index or a `/retrieve`
    client behind `SearchTool`). Thread-safe: verl scores samples concurrently."""

    def __init__(self, *, treatment: str, round: int, folds: FoldAssignment, graders: Mapping[str, Grader],
                 tool: SearchTool, items_path: str | os.PathLike, samples: int = 5, format_penalty: float = 0.5,
                 seed: int = 0, step_base: int = 0, remote: Mapping[str, Any] | None = None):
        _check_samples("FrontierReward.samples", samples)
        self.treatment, self.round, self.folds = treatment_of(treatment), round, folds
        self.graders, self.tool, self.items_path = dict(graders), tool, Path(items_path)
        self.samples, self.format_penalty, self.seed, self.step_base = samples, format_penalty, seed, step_base
        self.remote = dict(remote or {})
        self._solvers: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _solver(self, g: Grader):
        from selfevo.agents.remote import RemoteSolver

        with self._lock:
            if g.role not in self._solvers:
                self._solvers[g.role] = RemoteSolver(g.url, g.model, **self.remote)
            return self._solvers[g.role]

    def close(self) -> None:
        for s in self._solvers.values():
            s.close()
        self._solvers.clear()

    def _tool(self) -> SearchTool:
        # a tool per call: budgets are per trajectory and the result cache is not shared across threads
        return SearchTool(self.tool.retriever, topk=self.tool.topk, max_calls=self.tool.max_calls)

    def score(self, batch: Sequence[ProposalSample], step: int | None = None) -> list[float]:
        """Rewards for one batch (`step`: the step within the round, when known)."""
        rewards: list[float | None] = [None] * len(batch)
        rows, graded = [], []
        for i, s in enumerate(batch):
            # the loop's proposer (`LMProposer.propose`): its last action is its final only when it reads as
            # an answer (`parse_proposer_action`), else the proposal is "no final question" (a rollout that
            # never answered: TRL's `final` is '', verl's last turn a search)
            action = parse_proposer_action(s.text)
            question, label, error = read_proposal(action.content if action.kind == "answer" else "")
            item_id = s.item_id or self._item_id(s, step, i)
            if error is not None:
                rewards[i] = -self.format_penalty
                rows.append({"round": self.round, "step_in_round": step, "malformed": malformed_record(
                    item_id=item_id, source_id=s.source_id, hops=s.hops, question=question, draft_label=label,
                    format_error=error, reward=rewards[i], text=s.text if s.written is None else s.written)})
                continue
            source_ids = tuple(dict.fromkeys([s.source_id, *s.read]))
            fold = item_fold(self.treatment, self.folds, s.source_id, question)
            touched = touched_folds(self.treatment, self.folds, fold, source_ids)
            r = route(self.treatment, self.round, fold, touched, self.graders)
            graded.append((i, item_id, question, label, source_ids, fold, r))
        by_role: dict[str, list[int]] = {}
        for n, (*_, r) in enumerate(graded):
            by_role.setdefault(r.grader.role, []).append(n)
        responses: dict[int, list[str]] = {}
        for role, idx in by_role.items():
            g = self.graders[role]
            # a step (TRL) is graded as the loop grades it, one batch, seeded by its round and step in the round (the
            # loop's seed takes the global step: the two draw other samples). verl has no step: each
            # item alone, seeded by its content, so that an item is graded alike by compute_score and in any
            # batch of compute_score_batch (the remote solver seeds each sample by its row in the batch)
            parts = [(idx, step)] if step is not None else [([n], _content_key(batch[graded[n][0]])) for n in idx]
            for part, key in parts:
                trajs = self._solver(g).answer([graded[n][2] for n in part], self._tool(), greedy=False,
                                               n=self.samples,
                                               seed=derive_seed(self.seed, self.round, key, "grade", g.name or role))
                failed = sum(bool(getattr(t.trace, "failed", False)) for ts in trajs for t in ts)
                if failed:  # a broken scorer is an error, never a silent 0 (nothing of this batch is staged)
                    raise GradingFailed(f"round {self.round}: {failed} of {len(part) * self.samples} samples of "
                                        f"grader {g.name or role} ({g.url}) failed after retries; rerun the phase")
                for n, ts in zip(part, trajs, strict=True):
                    responses[n] = [t.answer for t in ts]
        for n, (i, item_id, question, label, source_ids, fold, r) in enumerate(graded):
            answers = responses[n]
            # paper: k counts grader samples matching the proposer's draft answer; f(k) pays it
            k = sum(answers_match(z, label) for z in answers)
            rewards[i] = frontier_reward(k, self.samples)
            s = batch[i]
            # adopted label and admission are the admission step's (admit.py) to set
            item = item_record(item_id=item_id, source_id=s.source_id, source_ids=source_ids, fold=fold,
                               source_folds=sorted(self.folds.lineage(source_ids)), hops=s.hops, question=question,
                               draft_label=label, adopted_label=label, admitted=False, responses=answers, k=k,
                               reward=rewards[i], grader=r.grader.lineage(),
                               **({"routing": {"fallback": True, "touched": list(r.touched)}} if r.fallback else {}))
            rows.append({"round": self.round, "step_in_round": step, "item": item})
        append_jsonl(self.items_path, rows)  # one write: a kill leaves at most a torn last line
        return [float(x) for x in rewards]

    def _item_id(self, s: ProposalSample, step: int | None, i: int) -> str:
        if step is not None:  # the loop's ids: round, global step, position (and process, when several)
            rank = f"p{os.environ.get('RANK', '0')}-" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
            return f"r{self.round}-s{self.step_base + step}-{rank}{i}"
        # verl scores one sample a call, concurrently and in several workers: the rollout.n samples of a
        # prompt can be the same text, and each is its own item (ids are unique in a run, as the loop's)
        return f"r{self.round}-v-{_content_key(s)}-{uuid.uuid4().hex[:8]}"


def _check_samples(field: str, samples: Any) -> None:
    # as loop.grader_samples: f(k) = (n-k)/(n-1) pays only 0 < k < n, so one sample pays 0 for everything
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 2:
        raise ValueError(f"{field}: must be >= 2 (the frontier reward pays only 0 < k < samples; with one "
                         f"sample every proposal earns 0), got {samples!r}")


def _content_key(s: ProposalSample) -> str:
    return hashlib.blake2b(f"{s.source_id}\x1f{s.text}".encode(), digest_size=6).hexdigest()


# ---------------------------------------------------------------- TRL


class TRLFrontierReward:
    """The frontier reward as a TRL reward function. One call scores one generation batch, which is
    one proposer update (GRPOConfig: steps_per_generation = gradient_accumulation_steps = 1, which
    `trl_job.PINNED_GRPO` keeps [engine.trl] from changing), so the call count is the step within the round."""

    def __init__(self, reward: FrontierReward):
        self.reward = reward
        self.__name__ = "frontier_reward"  # TRL logs a reward function under its __name__
        self.calls = 0

    def __call__(self, prompts, completions, source_id, hops, final=None, read=None, **_) -> list[float]:
        self.calls += 1
        # the rollout's `final` is its last action already; else the last turn, read as the loop's proposer
        # reads it (joining the assistant turns first would lose where the last one starts)
        last = [final_turn(c) for c in completions]
        texts = final if final is not None else last
        batch = [ProposalSample(t, sid, int(h), tuple(read[i]) if read is not None else (),
                                written=last[i] if final is not None else None)
                 for i, (t, sid, h) in enumerate(zip(texts, source_id, hops, strict=True))]
        return self.reward.score(batch, step=self.calls)


class TRLSolverReward:
    """The solver reward as a TRL reward function; with `records_path`, also the loop's solver step
    record for each call (its items: each question's responses, k and k/n)."""

    def __init__(self, records_path: str | os.PathLike | None = None, *, round: int = 0, step_base: int = 0,
                 first_step_in_round: int = 1, grader: Mapping | None = None):
        self.records_path = Path(records_path) if records_path else None
        self.round, self.step_base, self.first = round, step_base, first_step_in_round
        self.grader = dict(grader or {"id": "main", "trained_on": {"folds": [], "rounds": []}})
        self.__name__ = "solver_reward"
        self.calls = 0

    def __call__(self, prompts, completions, label, answer=None, **columns) -> list[float]:
        answers = answer if answer is not None else [extract_answer(c) for c in completions]
        rewards = [solver_reward(a, y) for a, y in zip(answers, label, strict=True)]
        if self.records_path is not None:
            self._record(prompts, answers, label, columns)
        self.calls += 1
        return rewards

    def _record(self, prompts: Sequence, answers: Sequence[str], labels: Sequence[str],
                cols: Mapping[str, Sequence]) -> None:
        groups: dict[str, list[int]] = {}
        for i, item_id in enumerate(cols["item_id"]):
            groups.setdefault(item_id, []).append(i)
        items = []
        for item_id, idx in groups.items():
            i0, resp = idx[0], [answers[i] for i in idx]
            k = sum(answers_match(z, labels[i0]) for z in resp)
            items.append(item_record(item_id=item_id, source_id=cols["source_id"][i0],
                                     source_ids=cols["source_ids"][i0], fold=int(cols["fold"][i0]),
                                     source_folds=cols["source_folds"][i0], hops=int(cols["hops"][i0]),
                                     question=solver_question(prompts[i0]), draft_label=cols["draft_label"][i0],
                                     adopted_label=labels[i0], admitted=True, responses=resp, k=k,
                                     reward=k / len(resp), grader=self.grader))
        sir = self.first + self.calls
        n = sum(len(it["responses"]) for it in items)
        append_jsonl(self.records_path, [step_record(round=self.round, step=self.step_base + sir, step_in_round=sir,
                                                     kind="solver", items=items,
                                                     stats={"reward": sum(it["k"] for it in items) / max(1, n)})])


# ---------------------------------------------------------------- verl


_SETTINGS: dict[str, tuple[float, FrontierReward]] = {}
_SETTINGS_LOCK = threading.Lock()


def reward_settings(path: str | os.PathLike, *, treatment: str, round: int, folds: FoldAssignment,
                    graders: Mapping[str, Grader], items_path: str | os.PathLike, retriever_url: str,
                    topk: int = 3, max_calls: int = 5, samples: int = 5, format_penalty: float = 0.5,
                    seed: int = 0, step_base: int = 0, remote: Mapping[str, Any] | None = None) -> Path:
    """Write the JSON a verl reward worker builds its FrontierReward from (passed to
    `compute_score` as `reward_kwargs.selfevo_settings`)."""
    from selfevo._io import write_json

    _check_samples("reward_settings.samples", samples)
    write_json(path, {"treatment": treatment, "round": round, "folds": folds.to_json(),
                      "graders": [g.to_json() for g in graders.values()], "items_path": str(items_path),
                      "retriever_url": retriever_url, "topk": topk, "max_calls": max_calls, "samples": samples,
                      "format_penalty": format_penalty, "seed": seed, "step_base": step_base,
                      "remote": dict(remote or {})})
    return Path(path)


def _frontier_from_settings(path: str) -> FrontierReward:
    with _SETTINGS_LOCK:
        mtime = os.stat(path).st_mtime
        cached = _SETTINGS.get(path)
        if cached is None or cached[0] != mtime:
            from selfevo.search.client import RetrieverClient

            s = read_json(path)
            _check_samples(f"{path}: samples", s["samples"])
            graders = {g["role"]: Grader.from_json(g) for g in s["graders"]}
            tool = SearchTool(RetrieverClient(s["retriever_url"]), topk=s["topk"], max_calls=s["max_calls"])
            reward = FrontierReward(treatment=s["treatment"], round=s["round"],
                                    folds=FoldAssignment.from_json(s["folds"]), graders=graders, tool=tool,
                                    items_path=s["items_path"], samples=s["samples"],
                                    format_penalty=s["format_penalty"], seed=s["seed"], step_base=s["step_base"],
                                    remote=s.get("remote"))
            _SETTINGS[path] = (mtime, reward)
        return _SETTINGS[path][1]


def _target(ground_truth: Any) -> str:
    """A solver row's adopted label: ground_truth.target, a list of that one label as `datasets.verl_record`
    writes it (Search-R1's layout; verl may hand it as an array), or the label string. A row without one
    is an error, not a 0 for every answer (scored against '', nothing matches)."""
    target = ground_truth.get("target") if isinstance(ground_truth, Mapping) else ground_truth
    if target is not None and not isinstance(target, str):
        try:
            labels = list(target)
        except TypeError:  # neither a label nor a list of them: named below
            labels = []
        if len(labels) > 1:  # golden answers of one's own (any of them right, to Search-R1): not one label
            raise ValueError(f"compute_score: a {SOLVER_SOURCE} row is scored against its one adopted label; "
                             f"got {len(labels)} in ground_truth.target")
        target = labels[0] if labels else None
    if not isinstance(target, str) or not target.strip():
        raise ValueError(f"compute_score: a {SOLVER_SOURCE} row needs ground_truth.target, the adopted label "
                         f"(a non-empty list or string); got ground_truth={ground_truth!r}")
    return target


def _proposal(solution_str: str, extra_info: Mapping | None) -> ProposalSample:
    """A proposer row's proposal with its lineage from extra_info (as `datasets.verl_record` writes it)."""
    info = dict(extra_info or {})
    for field in ("source_id", "hops"):
        if info.get(field) is None:  # no default: a wrong source or hop count is a wrong record, silently
            raise ValueError(f"compute_score: a {PROPOSER_SOURCE} row needs extra_info.{field} (its lineage); "
                             f"got extra_info with keys {sorted(info)}")
    read = tuple(info.get("selfevo_read") or ())  # pages the search tool returned (verl_search.py)
    return ProposalSample(final_turn(solution_str), str(info["source_id"]), int(info["hops"]), read)


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping | None = None,
                  selfevo_settings: str | None = None, **_) -> float:
    """verl's per-sample reward: the solver reward for selfevo_solver rows, the frontier reward (graded
    through the served graders, logged for the audit) for selfevo_proposer rows."""
    if data_source == SOLVER_SOURCE:
        return solver_reward(extract_answer(solution_str), _target(ground_truth))
    if data_source != PROPOSER_SOURCE:
        raise ValueError(f"compute_score: unknown data_source {data_source!r} "
                         f"(selfevo writes {SOLVER_SOURCE} and {PROPOSER_SOURCE})")
    if not selfevo_settings:
        raise ValueError("compute_score: proposer rows need reward_kwargs.selfevo_settings (see engine.py)")
    sample = _proposal(solution_str, extra_info)
    return _frontier_from_settings(selfevo_settings).score([sample])[0]


def compute_score_batch(data_sources: Sequence[str], solution_strs: Sequence[str], ground_truths: Sequence[Any],
                        extra_infos: Sequence[Mapping | None], selfevo_settings: str | None = None,
                        **_) -> list[float]:
    """verl's batch reward manager: the same rewards, each proposer row graded as `compute_score` grades it
    (seeded by its content: its samples do not depend on its batch mates)."""
    out: list[float | None] = [None] * len(data_sources)
    proposer = []
    for i, (ds, sol, gt, info) in enumerate(zip(data_sources, solution_strs, ground_truths, extra_infos,
                                                strict=True)):
        if ds == PROPOSER_SOURCE:
            proposer.append(i)
        else:
            out[i] = compute_score(ds, sol, gt, info)
    if proposer:
        if not selfevo_settings:
            raise ValueError("compute_score_batch: proposer rows need reward_kwargs.selfevo_settings")
        samples = [_proposal(solution_strs[i], extra_infos[i]) for i in proposer]
        for i, r in zip(proposer, _frontier_from_settings(selfevo_settings).score(samples), strict=True):
            out[i] = r
    return [float(x) for x in out]

