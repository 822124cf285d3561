"""Dense index build memory: what `selfevo index build --retriever dense` holds besides FAISS, as the
corpus grows.

    python benchmarks/dense_scale.py [--sizes 100000 300000 1000000] [--baseline-src OLD/src]
                                     [--work DIR] [--out docs/benchmarks.md]

The corpora are index_scale.py's (synthetic, seed 0, wiki-18-shaped; made there if missing). The
encoder is a stand-in with the shape of a 768-dimensional model and none of its cost: each text's
vector is drawn from a generator seeded by the text's crc32 and L2-normalised, so the same text gets
the same vector in every code and run. What is measured is therefore the build's own memory and
time (reading, holding or streaming the corpus, the vectors, FAISS, the document store), not a
model's: with a real encoder the encoding dominates the time (hours for wiki-18 on a GPU) and its
model adds a constant to the memory. Each build runs in a fresh process (`ru_maxrss` = its peak);
a flat index (exact inner product), as FlashRAG's and Search-R1's wiki-18 e5 index is. After each
build the index is opened and searched with the 1,325 questions of ../shared/data/qa (top-1 compared
across codes). Writes the "## Index scale (dense build)" section of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from _common import REPO, machine_line, write_section
from index_scale import WIKI18, run, scale_args, scale_grid

HEADING = "## Index scale (dense build)"
DIM = 768  # e5-base-v2's, the encoder of FlashRAG's and Search-R1's wiki-18 index

_ENCODER = f"""
import zlib
import numpy as np

class HashEncoder:
    model, dim, query_prefix, passage_prefix, batch_size, max_seq_length = "crc32-hash", {DIM}, "", "", 32, 0
    fingerprint = "crc32-hash-{DIM}"

    def describe(self):
        return {{"model": self.model, "model_path": "", "model_fingerprint": self.fingerprint, "dim": self.dim,
                "query_prefix": "", "passage_prefix": "", "max_seq_length": 0}}

    def _encode(self, texts):
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            out[i] = np.random.default_rng(zlib.crc32(t.encode())).standard_normal(self.dim)
        out /= np.linalg.norm(out, axis=1, keepdims=True)  # in place, as a model's output array would be
        return out

    def encode_passages(self, texts, *progress, **kw):  # a progress hook, if the code passes one, unused
        return self._encode(list(texts))

    def encode_queries(self, queries):
        return self._encode(list(queries))

from selfevo.search import index as _index
_index.DenseOptions.encoder = lambda self: HashEncoder()
"""

_BUILD = _ENCODER + """
import json, resource, sys, time
t = time.perf_counter()
_index.build_index("dense", sys.argv[1], sys.argv[2])
print(json.dumps({"seconds": time.perf_counter() - t,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

_QUERY = _ENCODER + """
import json, resource, sys
from selfevo.search.dense import DenseIndex
index = DenseIndex.load(sys.argv[1], encoder=HashEncoder())
hits = [index.retrieve([q], 1)[0] for q in json.loads(sys.argv[2])]
print(json.dumps({"top1": [h[0].document.id if h else None for h in hits],
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

_IMPORTS = _ENCODER + """
import json, resource
import faiss, sentence_transformers  # what a build imports: its floor
print(json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> None:
    args, questions, codes = scale_args(__doc__)
    floor = run(_IMPORTS, [], REPO / "src")["peak_mib"]

    def measure(corpus: Path, out: Path, src: Path) -> dict:
        shutil.rmtree(out, ignore_errors=True)  # a fresh build each time
        build = run(_BUILD, [str(corpus), str(out)], src)
        query = run(_QUERY, [str(out), json.dumps(questions)], REPO / "src")
        return {"build": build, "query": query,
                "index_mib": sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 2**20}

    rows = scale_grid(args, codes, "dense", measure)
    same = all(rows[(lb, n)]["query"]["top1"] == rows[("this code", n)]["query"]["top1"]
               for lb in codes for n in args.sizes)
    big = max(args.sizes)
    lines = [HEADING, "",
             f"Command: `python benchmarks/dense_scale.py --sizes {' '.join(map(str, args.sizes))}"
             + (" --baseline-src OLD/src`" if args.baseline_src else "`") + "  ",
             f"Machine: {machine_line()}  ",
             "Corpora: index_scale.py's (above). Build = `build_index(\"dense\", corpus, dir)` (`selfevo index "
             f"build --retriever dense`, flat index) with a stand-in {DIM}-dimensional encoder (a seeded hash of "
             "each text, no model: see the script's docstring), each in a fresh process; peak = its maximum resident "
             f"memory; FAISS = the vectors a flat index holds ({DIM} float32 a passage); above FAISS = peak − FAISS "
             f"− the imports' floor ({floor:,.0f} MiB: Python, numpy, FAISS, sentence-transformers, torch).", "",
             "| code | passages | build | build peak | FAISS | above FAISS | index on disk |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label in codes:
        for n in args.sizes:
            r = rows[(label, n)]
            faiss_mib = n * DIM * 4 / 2**20
            lines.append(f"| {label} | {n:,} | {r['build']['seconds']:.1f} s | {r['build']['peak_mib']:,.0f} MiB "
                         f"| {faiss_mib:,.0f} MiB | {r['build']['peak_mib'] - faiss_mib - floor:,.0f} MiB "
                         f"| {r['index_mib']:,.0f} MiB |")
    lines.append("")
    lines.append("Top-1 document of every question (the stand-in encodes them too) identical across the codes: "
                 f"{'yes' if same else 'NO'}.")
    if len(args.sizes) >= 2:
        lo, hi = min(args.sizes), big
        wiki_m = WIKI18["passages"] / 1e6
        for label in codes:
            a, b = rows[(label, lo)], rows[(label, hi)]
            per_m = (b["build"]["peak_mib"] - a["build"]["peak_mib"]) / ((hi - lo) / 1e6)
            lines.append(f"- {label}: build peak grows {per_m:,.0f} MiB per million passages (FAISS's share "
                         f"{1e6 * DIM * 4 / 2**20:,.0f}); a straight line to wiki-18's {wiki_m:.0f}M passages (an "
                         "extrapolation, not a measurement): about "
                         f"{(a['build']['peak_mib'] + per_m * (wiki_m - lo / 1e6)) / 1024:,.0f} GiB at peak, "
                         "plus the encoder.")
    write_section(args.out, HEADING, "\n".join(lines), title="# Benchmarks")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
