"""BM25 index scale: peak memory and time of building, opening and querying an index as the corpus
grows, towards wiki-18 (21M passages, 13 GB).

    python benchmarks/index_scale.py [--sizes 100000 300000 1000000] [--baseline-src OLD/src]
                                     [--work DIR] [--out docs/benchmarks.md]

Corpora: synthetic and seeded (seed 0), shaped like wiki-18's passages: a title and 100 words each,
90% drawn from the words of ../shared/data/corpus/wiki18-mini.jsonl and 10% from a long Zipf tail of
made-up words, so the vocabulary grows with the corpus as a real one's does. Each measurement runs in
a fresh process (its own peak resident memory, `ru_maxrss`): `build_index("bm25", ...)` (what
`selfevo index build` runs), then `open_index` and the 1,325 questions of ../shared/data/qa one
`retrieve([q], 3)` call each (`--corpus`, `--qa-dir`: other places for the two). `--baseline-src`
measures another checkout's code the same way (the "before" rows). Writes the "## Index scale (BM25)"
section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from _common import REPO, machine_line, write_section
from rich.progress import Progress

HEADING = "## Index scale (BM25)"
SHARED = REPO.parent / "shared" / "data"
WIKI18 = {"passages": 21_015_324, "bytes": 13.0e9}  # wiki-18 (FlashRAG's wiki18_100w)

_BUILD = """
import json, resource, sys, time
from selfevo.search.index import build_index
t = time.perf_counter()
build_index("bm25", sys.argv[1], sys.argv[2])
print(json.dumps({"seconds": time.perf_counter() - t,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

_QUERY = """
import json, resource, sys, time
from selfevo.search.index import open_index
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t = time.perf_counter()
index = open_index(sys.argv[1])
opened = time.perf_counter() - t
questions = json.loads(sys.argv[2])
t = time.perf_counter()
hits = [index.retrieve([q], 3)[0] for q in questions]
seconds = time.perf_counter() - t
status = open("/proc/self/status").read()  # Linux: private (anonymous) vs file-backed resident pages
anon = int(status.split("RssAnon:")[1].split()[0]) / 1024
print(json.dumps({"open_seconds": opened, "qps": len(questions) / seconds, "anon_mib": anon,
                  "top1": [h[0].document.id if h else None for h in hits],
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "import_mib": base}))
"""


def make_corpus(n: int, path: Path, words_from: Path) -> None:
    """A seeded wiki-18-shaped corpus of `n` passages (see the module docstring)."""
    if path.exists():
        return
    rng = random.Random(0)
    words: list[str] = []
    with open(words_from, encoding="utf-8") as fh:
        for line in fh:
            words += re.findall(r"\S+", json.loads(line)["contents"].split("\n", 1)[-1])
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        for i in range(n):
            toks = [f"x{int(rng.paretovariate(0.7)) % 5_000_000}" if rng.random() < 0.1
                    else words[rng.randrange(len(words))] for _ in range(100)]
            out.write(json.dumps({"id": str(i), "contents": f'"Passage {i}"\n' + " ".join(toks)}) + "\n")
    os.replace(tmp, path)


def run(code: str, args: list[str], src: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{src}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(corpus: Path, index_dir: Path, src: Path, questions: list[str]) -> dict:
    build = run(_BUILD, [str(corpus), str(index_dir)], src)
    query = run(_QUERY, [str(index_dir), json.dumps(questions)], src)
    size = sum(p.stat().st_size for p in index_dir.rglob("*") if p.is_file())
    return {"build": build, "query": query, "index_mib": size / 2**20}


def scale_args(doc: str) -> tuple[argparse.Namespace, list[str], dict[str, Path]]:
    """The command line of a scale benchmark (this one's and dense_scale.py's): the arguments, the
    questions of --qa-dir, and the codes to measure by label (this checkout's src/, --baseline-src)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[100_000, 300_000, 1_000_000])
    ap.add_argument("--baseline-src", type=Path, default=None, help="another checkout's src/ to compare")
    ap.add_argument("--baseline-label", default="before")
    ap.add_argument("--work", type=Path, default=Path("/tmp/selfevo-index-scale"))
    ap.add_argument("--corpus", type=Path, default=SHARED / "corpus" / "wiki18-mini.jsonl",
                    help="the real passages whose words the synthetic corpora use")
    ap.add_argument("--qa-dir", type=Path, default=SHARED / "qa")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    questions = [json.loads(line)["question"] for f in sorted(args.qa_dir.glob("*.jsonl"))
                 for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not questions or not args.corpus.is_file():
        ap.error(f"need the questions of {args.qa_dir} and the corpus {args.corpus} (see --qa-dir, --corpus)")
    codes = {"this code": REPO / "src"}
    if args.baseline_src is not None:
        codes[args.baseline_label] = args.baseline_src.resolve()
    return args, questions, codes


def commit_of(src: Path) -> str:
    """The checkout `src` lies in, as a short commit ("uncommitted changes" marked), for the page to name."""
    try:
        sha = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "."], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    return f"commit {sha}" + (" with uncommitted changes" if dirty else "")


def codes_line(codes: dict[str, Path]) -> str:
    """Which code each row label measured."""
    return "Codes: " + "; ".join(f"`{label}` = {commit_of(src)}" for label, src in codes.items()) + ".  "


def scale_grid(args: argparse.Namespace, codes: dict[str, Path], kind: str,
               measure_one: Callable[[Path, Path, Path], dict]) -> dict[tuple[str, int], dict]:
    """Every corpus size (made once) measured under every code: `measure_one(corpus, index_dir,
    src)` by (code label, size); the index directories are `--work`/KIND-SIZE-LABEL."""
    rows: dict[tuple[str, int], dict] = {}
    with Progress() as bar:
        task = bar.add_task(f"corpora and {kind} indexes", total=len(args.sizes) * (1 + len(codes)))
        for n in args.sizes:
            corpus = args.work / f"corpus-{n}.jsonl"
            make_corpus(n, corpus, args.corpus)
            bar.advance(task)
            for label, src in codes.items():
                rows[(label, n)] = measure_one(corpus, args.work / f"{kind}-{n}-{label.replace(' ', '_')}", src)
                bar.advance(task)
    return rows


def main() -> None:
    args, questions, codes = scale_args(__doc__)
    rows = scale_grid(args, codes, "index", lambda corpus, index_dir, src: measure(corpus, index_dir, src, questions))
    same = all(rows[(lb, n)]["query"]["top1"] == rows[("this code", n)]["query"]["top1"]
               for lb in codes for n in args.sizes)
    big = max(args.sizes)
    corpus_mib = (args.work / f"corpus-{big}.jsonl").stat().st_size / 2**20
    lines = [HEADING, "",
             f"Command: `python benchmarks/index_scale.py --sizes {' '.join(map(str, args.sizes))}"
             + (" --baseline-src OLD/src`" if args.baseline_src else "`") + "  ",
             codes_line(codes),
             f"Machine: {machine_line()}  ",
             "Corpora: synthetic, seed 0, wiki-18-shaped (a title and 100 words a passage; 90% of the words "
             "from wiki18-mini, 10% from a Zipf tail of made-up words, so the vocabulary grows with the corpus); "
             f"the largest is {corpus_mib:,.0f} MiB. Each step is a fresh process; peak = its maximum resident "
             "memory. Build = `build_index(\"bm25\", corpus, dir)` (`selfevo index build`); open = `open_index`; "
             "queries = the 1,325 questions of ../shared/data/qa, one `retrieve([q], 3)` call each.", "",
             "| code | passages | build | build peak | index on disk | open | open + 1,325 queries peak "
             "| of it private | q/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label in codes:
        for n in args.sizes:
            r = rows[(label, n)]
            lines.append(f"| {label} | {n:,} | {r['build']['seconds']:.1f} s | {r['build']['peak_mib']:,.0f} MiB "
                         f"| {r['index_mib']:,.0f} MiB | {r['query']['open_seconds']:.2f} s "
                         f"| {r['query']['peak_mib']:,.0f} MiB | {r['query']['anon_mib']:,.0f} MiB "
                         f"| {r['query']['qps']:,.0f} |")
    lines.append("")
    lines.append(f"Top-1 document of every question identical across the codes and runs: {'yes' if same else 'NO'}. "
                 "`of it private`: resident memory that is the process's own at the end (RssAnon); the rest is "
                 "pages of files it maps (the score matrix and documents, read on demand), which the kernel can "
                 "drop and read again.")
    if len(args.sizes) >= 2:
        lo, hi = min(args.sizes), big
        for label in codes:
            a, b = rows[(label, lo)], rows[(label, hi)]
            per_m = (b["build"]["peak_mib"] - a["build"]["peak_mib"]) / ((hi - lo) / 1e6)
            sec_m = (b["build"]["seconds"] - a["build"]["seconds"]) / ((hi - lo) / 1e6)
            q_m = (b["query"]["peak_mib"] - a["query"]["peak_mib"]) / ((hi - lo) / 1e6)
            wiki_m = WIKI18["passages"] / 1e6
            ms_m = (1e3 / b["query"]["qps"] - 1e3 / a["query"]["qps"]) / ((hi - lo) / 1e6)
            lines.append(f"- {label}: build peak grows {per_m:,.0f} MiB and build time {sec_m:,.0f} s per million "
                         f"passages, serving peak {q_m:,.0f} MiB per million; a straight line to wiki-18's "
                         f"{wiki_m:.0f}M passages (an extrapolation, not a measurement): build peak about "
                         f"{(a['build']['peak_mib'] + per_m * (wiki_m - lo / 1e6)) / 1024:,.0f} GiB, "
                         f"{(a['build']['seconds'] + sec_m * (wiki_m - lo / 1e6)) / 60:,.0f} min, serving "
                         f"about {(a['query']['peak_mib'] + q_m * (wiki_m - lo / 1e6)) / 1024:,.1f} GiB; a query "
                         f"costs {ms_m:.1f} ms more per million passages (bm25s sums the query's columns into "
                         f"one score per document), about {1e3 / a['query']['qps'] + ms_m * (wiki_m - lo / 1e6):,.0f} "
                         "ms at wiki-18's size.")
    write_section(args.out, HEADING, "\n".join(lines), title="# Benchmarks")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
