"""Lineage-carrying training sets for the engines.

One row format, two writers. A row is a chat prompt plus its lineage: the item id, the source page
and every page read while composing it, the fold used for cross-fitting and the folds of those
pages, the connected-source group, the round, the hop count and (solver rows) the adopted label.

    to_trl(rows)          a Hugging Face `datasets.Dataset`: `prompt` as chat messages, every lineage
                          field as its own column (TRL passes extra columns to reward functions)
    write_verl(rows, p)   verl / Search-R1 parquet: data_source, prompt (chat messages), ability,
                          reward_model {style: rule, ground_truth: {target: [label]}}, extra_info
                          (the lineage, plus verl's index and split), agent_name

`aux_training_sets` splits the admitted solver rows by fold the way the loop's `AuxFeedback`
trains its auxiliary solvers (own fold; all pages of the fold under the connected grouping;
everything for the full-data control).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from selfevo.agents.lm.protocol import proposer_messages, sample_hops, solver_messages, solver_question
from selfevo.loop.feedback import trains_on
from selfevo.loop.folds import FoldAssignment
from selfevo.loop.schedule import derive_seed
from selfevo.records import Document

PROPOSER_SOURCE = "selfevo_proposer"
SOLVER_SOURCE = "selfevo_solver"
AGENT_NAME = "search_r1_agent"  # the verl agent loop of `verl_search.py`
LINEAGE = ("item_id", "role", "source_id", "source_ids", "fold", "source_folds", "group", "round", "hops",
           "label", "draft_label")


def _row(role: str, item_id: str, prompt: list[dict], source_id: str, source_ids: Sequence[str], fold: int,
         folds: FoldAssignment, round: int, hops: int, label: str = "", draft_label: str = "") -> dict:
    return {"item_id": item_id, "role": role, "prompt": prompt, "source_id": source_id,
            "source_ids": list(source_ids), "fold": int(fold),
            "source_folds": sorted(folds.lineage(source_ids)),
            "group": folds.groups.get(source_id, source_id),  # the connected-source cluster (source: itself)
            "round": int(round), "hops": int(hops), "label": label, "draft_label": draft_label}


def proposer_rows(pool: Sequence[Document], folds: FoldAssignment, round: int, n: int, seed: int,
                  truncate: Callable[[str], str] = lambda s: s, search: bool = True) -> list[dict]:
    """`n` proposer prompts for one round: a source drawn from the pool and a hop count drawn in
    Dr. Zero's 4:3:2:1 ratio, each seeded by (seed, round, i), so a rerun writes the same set.
    `truncate` cuts the source to what the proposer sees (Dr. Zero: its first 256 tokens); `search`
    (lm.proposer_search) whether its prompt offers the search tool, as the loop's proposer's does."""
    if not pool:
        raise ValueError("proposer_rows: the source pool is empty")
    rows = []
    for i in range(n):
        rnd = random.Random(derive_seed(seed, "proposer-prompt", round, i))
        doc = pool[rnd.randrange(len(pool))]
        hops = sample_hops(rnd.random())
        rows.append(_row("proposer", f"r{round}-p{i}", proposer_messages(truncate(doc.contents), hops, search), doc.id,
                         [doc.id], folds.of(doc.id), folds, round, hops))
    return rows


def solver_rows(items: Sequence[Mapping], folds: FoldAssignment, round: int) -> list[dict]:
    """Solver prompts for admitted items (the loop's item records: `question`, `adopted_label`,
    `draft_label`, `source_id`, `source_ids`, `fold`, `hops`, `item_id`)."""
    return [_row("solver", it["item_id"], solver_messages(it["question"]), it["source_id"],
                 it.get("source_ids") or [it["source_id"]], it["fold"], folds, round, it["hops"],
                 label=it["adopted_label"], draft_label=it.get("draft_label", ""))
            for it in items]


def one_pass(rows: Sequence[dict], n: int, seed: int) -> list[dict]:
    """Exactly `n` rows (a phase's steps × prompts a step), so that its training is one pass over
    them: the rows in order, topped up with seeded draws from them (each row at most once a draw),
    or a seeded subset of `n` in order when there are more (a reduced-budget auxiliary solver).
    A row's copy in the d-th draw has the item id `<id>#d` (its lineage otherwise the row's): a row and
    its copy can share a batch, and the solver step record groups a batch's responses by item id, so
    one id would be one item with twice the group's responses.

    Why one pass: an engine's sampler drops the last partial batch and reshuffles each pass, and the
    shuffle's random state is in no checkpoint, so a phase resumed in its second pass would train on
    other batches than a phase never killed; HF's Trainer also runs one update past its last
    checkpoint when resumed there in a pass it did not finish. One pass also trains every admitted
    question (a second pass of ceil(n/S)-sized batches left some untrained and others twice)."""
    rows = list(rows)
    if not rows:
        raise ValueError("one_pass: no rows")
    rnd = random.Random(seed)
    if len(rows) >= n:
        return [rows[i] for i in sorted(rnd.sample(range(len(rows)), n))]
    out = list(rows)
    draw = 1
    while len(out) < n:
        draw += 1
        out += [{**r, "item_id": f"{r['item_id']}#{draw}"} for r in rnd.sample(rows, min(len(rows), n - len(out)))]
    return out


def aux_training_sets(rows: Sequence[dict], roles: Sequence[str], lineage_aware: bool = False) -> dict[str, list[dict]]:
    """The rows each auxiliary solver trains on (`loop.feedback.trains_on`, as `AuxFeedback`): aux-j
    the rows of fold j (lineage-aware: rows all of whose pages are fold j's); aux-all everything."""
    out = {}
    for role in roles:
        if role == "aux-all":
            out[role] = list(rows)
            continue
        j = int(role.removeprefix("aux-"))
        out[role] = [r for r in rows if trains_on(j, r["fold"], r["source_folds"], lineage_aware)]
    return out


# ---------------------------------------------------------------- TRL


def to_trl(rows: Sequence[dict]):
    """A `datasets.Dataset` in TRL's conversational prompt format, lineage as extra columns."""
    from datasets import Dataset

    if not rows:
        raise ValueError("to_trl: no rows (an empty training set cannot train)")
    return Dataset.from_list([{k: r[k] for k in ("prompt", *LINEAGE)} for r in rows])


# ---------------------------------------------------------------- verl / Search-R1 parquet


def verl_schema():
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    extra = pa.struct([("index", pa.int64()), ("split", pa.string()), ("selfevo_role", pa.string()),
                       ("item_id", pa.string()), ("source_id", pa.string()), ("source_ids", pa.list_(pa.string())),
                       ("fold", pa.int64()), ("source_folds", pa.list_(pa.int64())), ("group", pa.string()),
                       ("round", pa.int64()), ("hops", pa.int64()), ("draft_label", pa.string()),
                       ("question", pa.string())])
    return pa.schema([("data_source", pa.string()), ("prompt", pa.list_(message)), ("ability", pa.string()),
                      ("reward_model", pa.struct([("style", pa.string()), ("ground_truth",
                                                  pa.struct([("target", pa.list_(pa.string()))]))])),
                      ("extra_info", extra), ("agent_name", pa.string())])


def verl_record(row: dict, index: int, split: str = "train") -> dict:
    """One row as verl's RLHFDataset reads it (Search-R1's layout: ground_truth.target is the list
    of accepted answers; here the one adopted label)."""
    solver = row["role"] == "solver"
    question = solver_question(row["prompt"]) if solver else ""
    return {"data_source": SOLVER_SOURCE if solver else PROPOSER_SOURCE,
            "prompt": [{"role": m["role"], "content": m["content"]} for m in row["prompt"]],
            "ability": "search-qa" if solver else "question-writing",
            "reward_model": {"style": "rule", "ground_truth": {"target": [row["label"]] if solver else []}},
            "extra_info": {"index": index, "split": split, "selfevo_role": row["role"], "item_id": row["item_id"],
                           "source_id": row["source_id"], "source_ids": list(row["source_ids"]),
                           "fold": row["fold"], "source_folds": list(row["source_folds"]), "group": row["group"],
                           "round": row["round"], "hops": row["hops"], "draft_label": row["draft_label"],
                           "question": question},
            "agent_name": AGENT_NAME}


def write_verl(rows: Sequence[dict], path: str | os.PathLike, split: str = "train") -> Path:
    """Write rows as a verl parquet file (atomically: a reader never sees half a file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from selfevo._io import atomic_writer

    if not rows:
        raise ValueError(f"{path}: no rows (an empty training set cannot train)")
    table = pa.Table.from_pylist([verl_record(r, i, split) for i, r in enumerate(rows)], schema=verl_schema())
    path = Path(path)
    with atomic_writer(path, "wb") as fh:
        pq.write_table(table, fh)
    return path


def read_verl(path: str | os.PathLike) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()
