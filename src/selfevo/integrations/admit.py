"""Admission between proposal generation and solver training, and the proposer step records.

The proposer's training rollouts are the round's proposals, as in the loop (`Loop.proposer_step`:
propose -> admit -> grade -> pay). The reward has graded them and staged every item; this step runs
the admission rule over them in step order -- every well-formed proposal (Dr. Zero), or MSV
(`loop.admission.MSV`, here over the main solver's served endpoint: sample it 3 times with the
source and 3 times without; admit iff both majorities exist and match; the majority becomes the
label) -- caps the round at its budget (1,600 in the paper; the rest are recorded `over_budget`),
and writes the proposer step records, in the loop's schema, to the run's `records/steps.jsonl`.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from selfevo._io import append_jsonl, read_jsonl_log, write_jsonl
from selfevo.agents.base import Proposal, Solver
from selfevo.loop.admission import MSV, Decision
from selfevo.loop.engine import cap_admissions
from selfevo.loop.schedule import derive_seed
from selfevo.records import Document, round6, step_record
from selfevo.runs import RunError
from selfevo.search.tool import SearchTool


def read_staged(path: str | os.PathLike) -> list[dict]:
    """The staged items (a torn last line, from a kill, is dropped)."""
    return read_jsonl_log(path, repair=True)


def trim_staged(reward: Mapping[str, Any], steps_done: int) -> None:
    """Keep what a training phase staged (proposer items, or solver step records; the file its
    `reward` settings name) for its first `steps_done` steps and drop the rest: a phase resumed from a
    checkpoint of that step trains and stages the later steps again; 0 drops everything (the phase
    starts over)."""
    staged = reward.get("items_path") or reward.get("records_path")
    if not staged:
        return
    path, first_step_in_round = Path(staged), reward.get("first_step_in_round", 1)
    if not steps_done or not path.exists():
        path.unlink(missing_ok=True)
        return
    kept = []
    for i, line in enumerate(path.read_bytes().splitlines(), 1):
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            # torn by a process killed mid-write; with several processes appending, another one's
            # later row may follow it, so it need not be the last line. Every process wrote (and
            # synced) its rows for the checkpoint's steps before the checkpoint was taken: a torn row
            # is a later step's
            continue
        step = row.get("step_in_round") if isinstance(row, dict) else None
        if not isinstance(step, int):
            raise RunError(f"{path}:{i}: a staged row without an integer step_in_round: cannot tell whether "
                           "it precedes the phase's checkpoint (resume with engine.save_steps = 0 to start the "
                           "phase over)")
        if step - first_step_in_round < steps_done:
            kept.append(row)
    write_jsonl(path, kept)  # whole lines only: the resumed phase appends after them


def _id_order(row: dict) -> tuple:
    """Sort key of an item or malformed row: its item_id with the numbers in it compared as numbers
    (`r1-s1-2` before `r1-s1-10`: one process's items keep the order it wrote them in)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part)
                 for part in re.split(r"(\d+)", str(row.get("item_id", ""))))


def group_steps(staged: Sequence[dict], proposer_steps: int) -> list[tuple[int, list[dict], list[dict]]]:
    """`(step_in_round, items, malformed)` per proposer step, each by item_id: data-parallel processes
    append their shares of a step in whatever order they finish, and the admission rule and the budget
    cap must not see that order. TRL knows each item's step; verl scores samples one at a time in step
    order, so its items are cut into `proposer_steps` equal runs."""
    if all(r.get("step_in_round") is not None for r in staged):
        keys = sorted({r["step_in_round"] for r in staged})
        chunks = [[r for r in staged if r["step_in_round"] == s] for s in keys]
    else:
        size = math.ceil(len(staged) / proposer_steps) if staged else 1
        keys = list(range(1, proposer_steps + 1))
        chunks = [list(staged[i * size:(i + 1) * size]) for i in range(proposer_steps)]
    return [(s, sorted((r["item"] for r in c if "item" in r), key=_id_order),
             sorted((r["malformed"] for r in c if "malformed" in r), key=_id_order))
            for s, c in zip(keys, chunks) if c]


class _Unfailing:
    """A solver whose batch fails whole when one of its calls failed for good (after the client's
    retries): that sample has no answer, and MSV would read it as one that forms no majority and reject
    the proposal, dropping admitted questions for a server's outage (the frontier reward's case too)."""

    def __init__(self, model: Solver):
        self.model = model

    def answer(self, questions, tool, **kw):
        from selfevo.integrations.rewards import GradingFailed

        groups = self.model.answer(questions, tool, **kw)
        failed = sum(bool(getattr(t.trace, "failed", False)) for ts in groups for t in ts)
        if failed:
            raise GradingFailed(f"MSV: {failed} of {sum(map(len, groups))} samples of the main solver failed after "
                                "retries; rerun the phase")
        return groups


def msv_filter(items: Sequence[dict], model: Solver, documents: Mapping[str, Document], tool: SearchTool,
               seed: int, samples: int = 3) -> list[Decision]:
    """MSV as a data filter: one decision per item (the loop's MSV over any Solver, e.g. a
    RemoteSolver on the main solver's endpoint)."""
    rule = MSV(documents, samples=samples)
    rule.model = _Unfailing(model)  # the main solver as it stood at the start of the round (the loop's choice)
    proposals = [Proposal(it["question"], it["draft_label"], it["source_id"], tuple(it["source_ids"]), it["hops"])
                 for it in items]
    return rule.decide(proposals, tool, seed) if proposals else []


def admit_round(staged: Sequence[dict], *, round: int, step_base: int, proposer_steps: int, budget: int,
                seed: int, decide: Callable[[list[dict], int], list[Decision]] | None = None
                ) -> tuple[list[dict], list[dict]]:
    """Step records and admitted items of one round. `decide(items, seed)` is the admission rule
    (None: admit every well-formed proposal with its draft label)."""
    records, admitted, room = [], [], budget
    for sir, items, malformed in group_steps(staged, proposer_steps):
        step = step_base + sir
        items = [dict(it) for it in items]
        decisions = (decide(items, derive_seed(seed, round, step, "admit")) if decide and items
                     else [Decision(True, it["draft_label"]) for it in items])
        room = cap_admissions(decisions, room)  # the loop's cap, carried across the round's steps
        for it, d in zip(items, decisions, strict=True):
            it["admitted"], it["adopted_label"] = d.admitted, d.label
            if d.detail:
                it["admission"] = d.detail
            if d.admitted:
                admitted.append(it)
        rewards = [it["reward"] for it in items] + [m["reward"] for m in malformed]
        records.append(step_record(round=round, step=step, step_in_round=sir, kind="proposer", items=items,
                                   stats={"reward": sum(rewards) / max(1, len(rewards)),
                                          "malformed": len(malformed),
                                          "admitted": sum(it["admitted"] for it in items)},
                                   malformed=malformed))
    return records, admitted


def merge_step_records(records: Sequence[dict]) -> list[dict]:
    """One record per step: data-parallel processes each log their share of a step's items."""
    merged: dict[tuple[int, int], dict] = {}
    for rec in records:
        key = (rec["round"], rec["step"])
        if key not in merged:
            merged[key] = {**rec, "items": list(rec["items"])}
        else:
            merged[key]["items"].extend(rec["items"])
    out = []
    for rec in sorted(merged.values(), key=lambda r: r["step"]):
        n = sum(len(it["responses"]) for it in rec["items"])
        if n and "reward" in rec.get("stats", {}):
            rec["stats"] = {**rec["stats"], "reward": round6(sum(it["k"] for it in rec["items"]) / n)}
        out.append(rec)
    return out


def commit_records(steps_path: str | os.PathLike, records: Sequence[dict], round: int, kind: str) -> None:
    """Append a phase's step records to the run's log, first dropping what a killed earlier attempt
    of the same phase left (its round's records of this kind, and anything later)."""
    path = Path(steps_path)
    rows = read_jsonl_log(path, repair=True)
    keep = [r for r in rows if r["round"] < round or (r["round"] == round and r["kind"] != kind)]
    if len(keep) != len(rows):
        write_jsonl(path, keep)
    append_jsonl(path, records)
