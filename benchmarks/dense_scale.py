"""Dense index memory as the corpus grows: what `selfevo index build --retriever dense` holds besides
FAISS, what a process serving the index holds as its own, and what `selfevo index import` costs.

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
build the index is opened by the same code in a fresh process and searched with the 1,325 questions of
../shared/data/qa (top-1 compared across codes; memory read from /proc/self/status, so Linux only);
this code's index is then imported (`search.adopt.adopt`, as `selfevo index import` does) into a new
directory and searched again. Writes the "## Index scale (dense build)" section of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from _common import REPO, machine_line, write_section
from index_scale import WIKI18, codes_line, run, scale_args, scale_grid

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
import json, resource, sys, time
import faiss  # before the first reading: the library is no part of the index's memory
from selfevo.search.dense import DenseIndex

def own_mib():  # resident memory of this process's own (RssAnon): not the file pages it maps, which the
    with open("/proc/self/status") as fh:  # page cache holds once for every process and can drop
        return next(int(line.split()[1]) for line in fh if line.startswith("RssAnon:")) / 1024

base = own_mib()
t = time.perf_counter()
index = DenseIndex.load(sys.argv[1], encoder=HashEncoder())
opened, after_open = time.perf_counter() - t, own_mib() - base
t = time.perf_counter()
hits = [index.retrieve([q], 1)[0] for q in json.loads(sys.argv[2])]
print(json.dumps({"top1": [h[0].document.id if h else None for h in hits], "open_seconds": opened,
                  "query_seconds": time.perf_counter() - t, "own_after_open_mib": after_open,
                  "own_after_queries_mib": own_mib() - base,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

_IMPORT = _ENCODER + """
import json, sys, time
from selfevo.search.adopt import adopt
t = time.perf_counter()
index = adopt(sys.argv[1], sys.argv[2], sys.argv[3], HashEncoder(), check=64)
print(json.dumps({"seconds": time.perf_counter() - t, "placed_by": index.imported["placed_by"],
                  "min_cosine": index.imported["spot_check"]["min_cosine"]}))
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
        index_mib = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 2**20
        query = run(_QUERY, [str(out), json.dumps(questions)], src)  # each code opens its own way
        row = {"build": build, "query": query, "index_mib": index_mib}
        if src == REPO / "src":  # `selfevo index import` of the vectors just built, with their corpus
            adopted = out.with_name(out.name + "-imported")
            shutil.rmtree(adopted, ignore_errors=True)
            row["import"] = run(_IMPORT, [str(out / "vectors.faiss"), str(corpus), str(adopted)], src)
            row["import"]["query"] = run(_QUERY, [str(adopted), json.dumps(questions)], src)
        return row

    rows = scale_grid(args, codes, "dense", measure)
    same = all(rows[(lb, n)]["query"]["top1"] == rows[("this code", n)]["query"]["top1"]
               for lb in codes for n in args.sizes)
    big = max(args.sizes)
    lines = [HEADING, "",
             f"Command: `python benchmarks/dense_scale.py --sizes {' '.join(map(str, args.sizes))}"
             + (" --baseline-src OLD/src`" if args.baseline_src else "`") + "  ",
             codes_line(codes),
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
    lines += ["", "Serving: `DenseIndex.load` of each code's index in a fresh process, then the "
              f"{len(questions):,} questions one `retrieve` each; own memory = RssAnon above the process's before "
              "the load (FAISS already imported): the memory that is the process's alone, not the file pages it "
              "maps, which the page cache holds once for every process serving the index and can drop; peak = "
              "maximum resident memory, mapped pages included. The index files had just been written, so they "
              "were in the page cache (a cold open reads them from disk).", "",
              f"| code | passages | open | own memory after open | after {len(questions):,} queries | queries "
              "| peak resident |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for label in codes:
        for n in args.sizes:
            q = rows[(label, n)]["query"]
            lines.append(f"| {label} | {n:,} | {q['open_seconds']:.2f} s | {q['own_after_open_mib']:,.0f} MiB "
                         f"| {q['own_after_queries_mib']:,.0f} MiB | {q['query_seconds']:.1f} s "
                         f"| {q['peak_mib']:,.0f} MiB |")
    lines += ["", "Import: `selfevo index import` (`search.adopt.adopt`) of each built index's vectors.faiss with "
              "its corpus and the stand-in encoder (64 passages re-encoded), into a new directory on the same "
              "file system; then served as above.", "",
              "| passages | import | FAISS file | lowest spot-check cosine | own memory serving | top-1 as built |",
              "|---:|---:|---|---:|---:|---|"]
    for n in args.sizes:
        r = rows[("this code", n)]
        imp = r["import"]
        lines.append(f"| {n:,} | {imp['seconds']:.1f} s | {imp['placed_by']} | {imp['min_cosine']:.6f} "
                     f"| {imp['query']['own_after_queries_mib']:,.0f} MiB "
                     f"| {'yes' if imp['query']['top1'] == r['query']['top1'] else 'NO'} |")
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
