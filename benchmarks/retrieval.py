"""BM25 retrieval benchmark on the real corpus and the seven QA sets.

Measures index build time, load-from-cache time, batched and single-query throughput, and
answer recall@3 per benchmark; prints a table and writes the "## Retrieval (BM25)" section of
docs/benchmarks.md (other sections of that file are left as they are).

    python benchmarks/retrieval.py [--corpus PATH] [--qa-dir DIR] [--out docs/benchmarks.md]

Answer recall@3 = share of questions where some gold alias is contained in the top-3 passages,
i.e. the evaluation's Cover-EM (`selfevo.evaluate.cover_em`: FlashRAG normalization, substring
match) applied to the concatenated passages. It bounds what a one-search reader could answer.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import bm25s
from _common import REPO, cpu_model, replace_section
from _common import median_time as _median_time
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from selfevo.corpus import read_corpus, read_qa_dir
from selfevo.evaluate import BENCHMARKS, MULTI_HOP, SINGLE_HOP, cover_em
from selfevo.search.bm25 import BM25Index

SECTION = "## Retrieval (BM25)"
TOPK = 3
REPEATS = 3


def median_time(fn) -> float:
    return _median_time(fn, REPEATS)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=REPO / "../shared/data/corpus/wiki18-mini.jsonl")
    ap.add_argument("--qa-dir", type=Path, default=REPO / "../shared/data/qa")
    ap.add_argument("--out", type=Path, default=REPO / "docs/benchmarks.md")
    args = ap.parse_args()
    console = Console()

    start = time.perf_counter()
    docs = read_corpus(args.corpus)
    read_s = time.perf_counter() - start
    qa = read_qa_dir(args.qa_dir)
    names = [b for b in BENCHMARKS if b in qa] + sorted(set(qa) - set(BENCHMARKS))
    items = [it for b in names for it in qa[b]]
    questions = [it.question for it in items]

    # Building takes a few seconds a time: worth a progress bar.
    build_times = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"building the index over {len(docs):,} passages", total=REPEATS)
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            index = BM25Index.build(docs)
            build_times.append(time.perf_counter() - t0)
            progress.advance(task)
    build_s = statistics.median(build_times)

    with tempfile.TemporaryDirectory() as tmp:
        index.save(tmp)
        load_s = median_time(lambda: BM25Index.load(tmp))

    index.retrieve(questions[:10], TOPK)  # warm up caches before timing
    batched_s = median_time(lambda: index.retrieve(questions, TOPK))
    single_s = median_time(lambda: [index.retrieve([q], TOPK) for q in questions])

    results = index.retrieve(questions, TOPK)
    found = {it.id: cover_em(" ".join(h.document.contents for h in hits), it.golden_answers)
             for it, hits in zip(items, results)}
    recall = {b: sum(found[it.id] for it in qa[b]) / len(qa[b]) for b in names}
    groups = {"macro (7)": names,
              "single-hop": [b for b in names if b in SINGLE_HOP],
              "multi-hop": [b for b in names if b in MULTI_HOP]}
    averages = {g: sum(recall[b] for b in bs) / len(bs) for g, bs in groups.items() if bs}

    # ------------------------------------------------------------ report
    n_q = len(questions)
    speed = [
        ("corpus read (JSONL → Documents)", f"{read_s:.2f} s"),
        (f"index build, median of {REPEATS}", f"{build_s:.2f} s  (runs: "
         + ", ".join(f"{t:.2f}" for t in build_times) + ")"),
        (f"index load from disk, median of {REPEATS}", f"{load_s:.2f} s"),
        (f"batched retrieval, {n_q:,} questions, top-{TOPK}",
         f"{n_q / batched_s:,.0f} queries/s  ({batched_s * 1e3 / n_q:.3f} ms/query)"),
        (f"single-query calls, {n_q:,} × retrieve([q])",
         f"{n_q / single_s:,.0f} queries/s  ({single_s * 1e3 / n_q:.3f} ms/query)"),
    ]
    table = Table(title=f"BM25 over {len(docs):,} passages")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for k, v in speed:
        table.add_row(escape(k), v)  # "[q]" would otherwise be read as rich markup
    console.print(table)
    rtable = Table(title=f"answer recall@{TOPK}")
    rtable.add_column("benchmark")
    rtable.add_column("questions", justify="right")
    rtable.add_column(f"recall@{TOPK}", justify="right")
    for b in names:
        rtable.add_row(b, str(len(qa[b])), f"{recall[b]:.3f}")
    for g, v in averages.items():
        rtable.add_row(f"[bold]{g}[/bold]", "", f"[bold]{v:.3f}[/bold]")
    console.print(rtable)

    try:
        corpus_arg = os.path.relpath(args.corpus.resolve(), REPO)
    except ValueError:
        corpus_arg = str(args.corpus)
    lines = [
        SECTION,
        "",
        f"Command: `python benchmarks/retrieval.py --corpus {corpus_arg}` (from the repo root)  ",
        (f"Machine: {os.cpu_count()} cores, {cpu_model()}; Python {platform.python_version()}, "
         f"bm25s {bm25s.__version__} (numpy backend)  "),
        f"Date: {dt.date.today().isoformat()}  ",
        (f"Corpus: `{args.corpus.name}`, {len(docs):,} passages; index = title + text, "
         "lowercase, bm25s English stopwords, no stemming, BM25 Lucene k1=1.5 b=0.75."),
        "",
        "| measure | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in speed],
        "",
        (f"Answer recall@{TOPK}: share of questions where some gold alias (FlashRAG-normalized) "
         f"is a substring of the normalized top-{TOPK} passages (`selfevo.evaluate.cover_em`)."),
        "",
        f"| benchmark | questions | recall@{TOPK} |",
        "|---|---:|---:|",
        *[f"| {b} | {len(qa[b])} | {recall[b]:.3f} |" for b in names],
        *[f"| **{g}** | | **{v:.3f}** |" for g, v in averages.items()],
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    old = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
    args.out.write_text(replace_section(old, SECTION, "\n".join(lines), "# Benchmarks"), encoding="utf-8")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
