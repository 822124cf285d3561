"""An index directory around a FAISS index built elsewhere: `selfevo index import`.

Why: the paper's retriever, like Dr. Zero's and Search-R1's, is FlashRAG's e5 index over wiki-18
(`e5_Flat.index`, 21M passages, about 65 GB), which takes GPU-hours to encode again. Adopting it
needs only its corpus (the passages in the index's row order) and the encoder it was built with;
the FAISS file is hard-linked into the index directory (copied when it lives on another file
system) and opened memory-mapped like any saved dense index. It can also be the dense half of a
hybrid index, whose BM25 half is then built over the same passages.

Nothing about the file is taken on trust: its kind (flat, HNSW or IVF over inner product), its
dimension against the encoder's, its row count against the corpus's, and a spot check that
re-encodes passages spread over the corpus and compares them with the vectors stored in their rows,
which catches another model, other prefixes, unnormalised vectors or a corpus in another order.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from selfevo._io import atomic_writer, file_sha256
from selfevo.corpus import corpus_documents, count_lines
from selfevo.search._manifest import MANIFEST
from selfevo.search._progress import ProgressBar, ticked
from selfevo.search.bm25 import BM25Index
from selfevo.search.dense import (
    VECTORS_FILE,
    DenseIndex,
    Encoder,
    HeldFile,
    _passage_text,
    _require,
    faiss_message,
    read_faiss,
)
from selfevo.search.docstore import stage
from selfevo.search.hybrid import DEPTH, RRF_K, HybridIndex, _check_fusion
from selfevo.search.index import _building, _check_not_corpus, check_index_out

SPOT_CHECK = 64  # passages re-encoded by default
# A stored row must point where the encoder points and have its length. The threshold sits between
# what should pass (the same model in float16 or bfloat16, other batches) and what should not (a
# missing prefix, a shorter token limit, shifted rows): measured by benchmarks/adopt_check.py,
# docs/benchmarks.md "Index import: the spot check".
MIN_COSINE = 0.995
MAX_NORM_ERROR = 0.01


def faiss_kind(index: Any) -> tuple[str, dict[str, int]]:
    """The index type (dense.INDEX_TYPES) and search settings of a FAISS index read from a file;
    ValueError for a kind or metric a dense index does not search (scores must be inner products)."""
    faiss = _require("faiss")
    index = faiss.downcast_index(index)
    if index.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise ValueError("the FAISS index ranks by L2 distance, not inner product: a dense index's scores "
                         "are cosines over unit vectors (build it with METRIC_INNER_PRODUCT)")
    if isinstance(index, faiss.IndexFlat):
        return "flat", {}
    if isinstance(index, faiss.IndexHNSWFlat):
        return "hnsw", {"hnsw_m": int(index.hnsw.nb_neighbors(1)),
                        "ef_construction": int(index.hnsw.efConstruction), "ef_search": int(index.hnsw.efSearch)}
    if isinstance(index, faiss.IndexIVFFlat):
        return "ivf", {"nlist": int(index.nlist), "nprobe": int(index.nprobe)}
    raise ValueError(f"a FAISS {type(index).__name__}: adoptable kinds are IndexFlatIP, IndexHNSWFlat and "
                     "IndexIVFFlat (vectors stored uncompressed, so rows can be checked against the encoder)")


def spot_rows(n: int, k: int) -> np.ndarray:
    """`k` row numbers spread evenly over `n` rows, first and last included (all rows when k ≥ n)."""
    return np.unique(np.linspace(0, n - 1, num=min(k, n)).round().astype(np.int64))


def stored_rows(index: Any, rows: np.ndarray) -> np.ndarray:
    """The vectors stored in `rows` of a flat, HNSW or IVF index."""
    faiss = _require("faiss")
    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexIVF):
        index.make_direct_map()  # row number → (list, offset); an IVF index keeps none by default
    return np.stack([index.reconstruct(int(r)) for r in rows])


def check_rows(stored: np.ndarray, encoded: np.ndarray, rows: np.ndarray) -> dict[str, Any]:
    """Compare stored vectors with the encoder's unit vectors for the same passages; ValueError
    naming the worst rows when they disagree. Returns the check's figures for the manifest."""
    norms = np.linalg.norm(stored, axis=1)
    cosines = np.einsum("ij,ij->i", stored, encoded) / np.maximum(norms, 1e-12)
    # a NaN or infinite stored row (a damaged file, a float16 overflow) makes a NaN cosine, which
    # compares false with everything: ranked as the worst, so it fails the check and is named first
    ranked = np.where(np.isnan(cosines), -np.inf, cosines)
    worst = np.argsort(ranked)[:3]
    result = {"rows": len(rows), "min_cosine": round(float(cosines.min()), 6),
              "max_norm_error": round(float(np.abs(norms - 1).max()), 6)}
    if ranked.min() < MIN_COSINE:
        shown = ", ".join(f"row {rows[i]} cosine {cosines[i]:.3f}" for i in worst)
        raise ValueError(f"the stored vectors are not this encoder's for these passages ({shown}; needs ≥ "
                         f"{MIN_COSINE}): another model, other prefixes (--passage-prefix) or a shorter token "
                         "limit (--max-seq-length), or a corpus whose lines are not in the index's row order")
    if result["max_norm_error"] > MAX_NORM_ERROR:
        raise ValueError(f"the stored vectors are not unit length (norm {norms.min():.3f}..{norms.max():.3f}): "
                         "a dense index scores by cosine, so its vectors must be L2-normalised")
    return result


def place(source: Path, target: Path, progress: bool) -> str:
    """Put `source` at `target` by a hard link (no copy, no space), else by a copy (another file system);
    either way renamed into place, so an index loaded from there keeps its mapped file. Returns how."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")  # remove_leftover_temps's pattern
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        with open(source, "rb") as src, atomic_writer(target, "wb") as dst, \
                ProgressBar(progress, source.stat().st_size, f"copying {source.name}") as advance:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
                advance(len(chunk))
        return "copy"
    try:
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return "hard link"


def adopt(faiss_file: str | os.PathLike, corpus: str | os.PathLike, out: str | os.PathLike, encoder: Encoder,
          *, check: int = SPOT_CHECK, progress: bool = False, hybrid: bool = False, rrf_k: int = RRF_K,
          depth: int = DEPTH) -> DenseIndex | HybridIndex:
    """Make `out` a dense index directory around the FAISS index `faiss_file`, whose rows are the
    passages of the corpus file `corpus` in order, encoded by `encoder`; return it, opened. With
    `hybrid`, that directory is `out`/dense and a BM25 index over the same passages is built beside it
    (`out`/bm25): a hybrid index (RRF with `rrf_k`, `depth`) whose dense half was built elsewhere.
    Refuses (ValueError) before anything in `out` changes: another kind or metric, another dimension,
    another number of passages, stored rows that are not the encoder's (`check` passages re-encoded).
    `out` is held meanwhile, as an index build holds it: a second import or build there is refused."""
    if hybrid:
        _check_fusion(rrf_k, depth)  # here, not after the passages are stored and BM25 built over them
    check_index_out(out)
    with _building(out):
        return _adopt(faiss_file, corpus, out, encoder, check, progress, hybrid, rrf_k, depth)


def _adopt(faiss_file, corpus, out, encoder: Encoder, check: int, progress: bool, hybrid: bool, rrf_k: int,
           depth: int) -> DenseIndex | HybridIndex:
    faiss_file, top = Path(faiss_file), Path(out)
    out = top / "dense" if hybrid else top
    start = time.perf_counter()
    _check_not_corpus(corpus, top)
    if not faiss_file.is_file():
        raise ValueError(f"{faiss_file}: no such file")
    try:
        source = read_faiss(faiss_file)  # mapped where FAISS can: only the header and checked rows are read
    except RuntimeError as e:  # FAISS's reader on a file that is not its own
        raise ValueError(f"{faiss_file}: not a FAISS index file ({faiss_message(e)})") from None
    index_type, params = faiss_kind(source)
    if source.d != encoder.dim:
        raise ValueError(f"{faiss_file}: vectors of dimension {source.d}, but {encoder.model!r} makes {encoder.dim}")
    # early, before the passages are stored; a gzipped corpus (read through, as every command reads it)
    # has no line count short of decompressing it: the count of stored passages below decides
    lines = count_lines(corpus)
    if lines is not None and lines < source.ntotal:
        raise ValueError(f"{faiss_file}: {source.ntotal:,} vectors, more than {corpus} has lines: not its corpus")
    out.mkdir(parents=True, exist_ok=True)
    digest = file_sha256(corpus)  # checked as the passages are read: the manifest's is the file they came from
    with ProgressBar(progress, source.ntotal, "storing the corpus's passages") as advance:
        docs = stage(ticked(corpus_documents(corpus, digest), advance), out)
    if len(docs) != source.ntotal:
        shutil.rmtree(docs.path.parent, ignore_errors=True)
        raise ValueError(f"{faiss_file}: {source.ntotal:,} vectors, but {corpus} holds {len(docs):,} passages")
    rows = spot_rows(len(docs), check)
    try:
        spot = check_rows(stored_rows(source, rows), encoder.encode_passages([_passage_text(docs[int(r)])
                                                                              for r in rows]), rows)
    except ValueError as e:
        shutil.rmtree(docs.path.parent, ignore_errors=True)
        raise ValueError(f"{faiss_file}: {e}") from None
    del source
    for done in {top / MANIFEST, out / MANIFEST}:  # written last: a partial import is refused by `load`
        done.unlink(missing_ok=True)
    how = place(faiss_file, out / VECTORS_FILE, progress)
    held = HeldFile(out / VECTORS_FILE)  # what a later save copies: the lists an IVF read mapped only names
    index = DenseIndex(encoder, read_faiss(out / VECTORS_FILE, index_type), docs, digest,
                       index_type, params, imported={"faiss_file": str(faiss_file.resolve()), "placed_by": how,
                                                     "spot_check": spot,
                                                     "seconds": round(time.perf_counter() - start, 3)})
    index.vectors_file = held
    index.seal(out)
    if not hybrid:
        return index
    bm25 = BM25Index.build(index.docs, corpus_sha256=index.corpus_sha256, store=top / "bm25", progress=progress,
                           expected=len(index.docs))
    bm25.save(top / "bm25")
    both = HybridIndex(bm25, index, rrf_k=rrf_k, depth=depth)
    both.write_manifest(top)
    return both
