"""Hybrid retrieval: BM25 and dense top-`depth` lists fused by reciprocal-rank fusion.

RRF (Cormack, Clarke & Büttcher 2009): score(d) = Σ_lists 1 / (k + rank_list(d)), ranks from 1,
k = 60. It needs no score calibration between BM25 (unbounded) and cosine ([-1, 1]), which is
why it is the usual default for fusing lexical and dense runs.

An index directory holds `bm25/` and `dense/` (each a complete index of its kind, over the same
corpus) and a manifest with the fusion settings.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from selfevo._io import file_sha256, write_json
from selfevo.corpus import corpus_documents
from selfevo.records import Document
from selfevo.search._manifest import MANIFEST, read_manifest
from selfevo.search._progress import corpus_total
from selfevo.search.bm25 import BM25Index
from selfevo.search.dense import DenseIndex, Encoder, cache_serves, load_cache
from selfevo.search.docstore import DocStore
from selfevo.search.tool import Hit, check_queries

FORMAT_VERSION = 2  # 2: documents keep a corpus's contents verbatim (1 re-quoted an unquoted title)
KIND = "hybrid"
RRF_K = 60
DEPTH = 50


def rrf_fuse(rankings: Sequence[Sequence[int]], k: int = RRF_K) -> list[tuple[int, float]]:
    """Fuse ranked lists of item keys (best first) into one [(key, rrf score)], best first.

    Ties (equal fused score, e.g. an item ranked 1st by one list and one ranked 1st by the
    other) go to the better best rank, then to the smaller key (for corpus positions: corpus
    order), so the result is a pure function of the input lists."""
    if k < 0:
        raise ValueError(f"RRF k must be >= 0, got {k}")
    score: dict[int, float] = {}
    best: dict[int, int] = {}
    for ranking in rankings:
        for rank, key in enumerate(ranking, start=1):
            score[key] = score.get(key, 0.0) + 1.0 / (k + rank)
            best[key] = min(best.get(key, rank), rank)
    return sorted(score.items(), key=lambda kv: (-kv[1], best[kv[0]], kv[0]))


def _part(store: str | os.PathLike | None, name: str) -> Path | None:
    return None if store is None else Path(store) / name


def _same_documents(a: Sequence[Document], b: Sequence[Document]) -> bool:
    """Whether two saved halves hold the same documents, judged without reading them in full: each
    half's manifest already ties it to the corpus (sha256 checked against the same digest, the document
    count against its docs.jsonl), so what is left to catch is a half swapped in or edited by hand. Equal
    docs.jsonl sizes and equal documents at a few spread positions do that; a byte-for-byte comparison
    read both files whole (2 x 13 GB for wiki-18) on every open."""
    if len(a) != len(b):
        return False
    if isinstance(a, DocStore) and isinstance(b, DocStore) and a.path.stat().st_size != b.path.stat().st_size:
        return False
    n = len(a)
    return n == 0 or all(a[i] == b[i] for i in (0, n // 2, n - 1))


def _check_fusion(rrf_k: int, depth: int) -> None:
    if rrf_k < 0 or depth < 1:
        raise ValueError(f"need rrf_k >= 0 and depth >= 1, got {rrf_k}, {depth}")


class HybridIndex:
    """BM25 + dense over one corpus, fused by RRF. Implements the `Retriever` protocol.

    `depth`: how many hits each retriever contributes (at least `topk`); `rrf_k`: the RRF constant.
    Hit scores are the fused RRF scores."""

    kind = KIND

    def __init__(self, bm25: BM25Index, dense: DenseIndex, rrf_k: int = RRF_K, depth: int = DEPTH,
                 build_seconds: float | None = None):
        _check_fusion(rrf_k, depth)
        if bm25.corpus_sha256 != dense.corpus_sha256 or len(bm25) != len(dense):
            raise ValueError(f"BM25 ({len(bm25)} docs, corpus {bm25.corpus_sha256[:12]}) and dense "
                             f"({len(dense)} docs, corpus {dense.corpus_sha256[:12]}) indexes "
                             "were built from different corpora")
        self.bm25, self.dense = bm25, dense
        self.rrf_k, self.depth = rrf_k, depth
        self.build_seconds = build_seconds  # both halves
        self.corpus_sha256 = dense.corpus_sha256

    @property
    def docs(self) -> Sequence[Document]:
        return self.dense.docs  # the same documents as the BM25 half's, in the same order

    def __len__(self) -> int:
        return len(self.docs)

    # ------------------------------------------------------------ building

    @classmethod
    def build(cls, docs: Iterable[Document], encoder: Encoder | None = None, *,
              corpus_sha256: str | None = None, rrf_k: int = RRF_K, depth: int = DEPTH,
              index_type: str = "flat", store: str | os.PathLike | None = None, progress: bool = False,
              expected: int | None = None, **params: Any) -> HybridIndex:
        """Both halves over `docs`, streamed once: the dense half first (`DenseIndex.build`), then the
        BM25 half over the documents it kept. With `store` each half keeps them on disk under it
        (`bm25/`, `dense/`), so a corpus larger than memory is read once and never held."""
        _check_fusion(rrf_k, depth)  # now, not after both halves are built
        start = time.perf_counter()
        dense = DenseIndex.build(docs, encoder, index_type=index_type, corpus_sha256=corpus_sha256,
                                 store=_part(store, "dense"), progress=progress, expected=expected, **params)
        bm25 = BM25Index.build(dense.docs, corpus_sha256=dense.corpus_sha256, store=_part(store, "bm25"),
                               progress=progress, expected=len(dense.docs))
        return cls(bm25, dense, rrf_k=rrf_k, depth=depth,
                   build_seconds=round(time.perf_counter() - start, 3))

    @classmethod
    def from_corpus_file(cls, path: str | os.PathLike, index_dir: str | os.PathLike | None = None,
                         encoder: Encoder | None = None, *, rrf_k: int = RRF_K, depth: int = DEPTH,
                         index_type: str | None = None, progress: bool = False, **params: Any) -> HybridIndex:
        """Load from `index_dir` if built from this corpus file with this encoder and the FAISS
        settings asked for (`DenseIndex.take_settings`), else build (and save there). Fusion settings
        are taken from the arguments, not the cache."""
        _check_fusion(rrf_k, depth)  # a cached index would take a bad one and fail at its first query
        digest = file_sha256(path)
        encoder = encoder or Encoder()
        cached = load_cache(cls.load, index_dir, encoder, digest)
        served, index_type = cache_serves(None if cached is None else cached.dense, index_type, params)
        if served:
            cached.rrf_k, cached.depth = rrf_k, depth
            return cached
        index = cls.build(corpus_documents(path, digest), encoder, corpus_sha256=digest, rrf_k=rrf_k, depth=depth,
                          index_type=index_type or "flat", store=index_dir, progress=progress,
                          expected=corpus_total(path, progress), **params)
        if index_dir is not None:
            index.save(index_dir)
        return index

    # ------------------------------------------------------------ persistence

    def save(self, index_dir: str | os.PathLike) -> None:
        index_dir = Path(index_dir)
        index_dir.mkdir(parents=True, exist_ok=True)
        # written last, removed once a half is about to change: a partial save is refused, and one that fails
        # while writing the BM25 arrays (a full disk) leaves a hybrid index there as it was
        self.bm25.save(index_dir / "bm25", before_replacing=lambda: (index_dir / MANIFEST).unlink(missing_ok=True))
        (index_dir / MANIFEST).unlink(missing_ok=True)
        self.dense.save(index_dir / "dense")
        self.write_manifest(index_dir)

    def write_manifest(self, index_dir: Path) -> None:
        """The last step of a save, once both halves are in `index_dir` (`bm25/`, `dense/`)."""
        write_json(index_dir / MANIFEST, {
            "format_version": FORMAT_VERSION,
            "kind": KIND,
            "fusion": "reciprocal rank fusion",
            "rrf_k": self.rrf_k,
            "depth": self.depth,
            "corpus_sha256": self.corpus_sha256,
            "num_docs": len(self.docs),
            "model": self.dense.encoder.model,
            "model_fingerprint": self.dense.encoder.fingerprint,
            "parts": {"bm25": "bm25", "dense": "dense"},
            "build_seconds": self.build_seconds,
        })

    @classmethod
    def load(cls, index_dir: str | os.PathLike, encoder: Encoder | None = None, *,
             model: str | None = None, expected_corpus_sha256: str | None = None,
             device: str = "cpu", batch_size: int = 32) -> HybridIndex:
        """Load both halves; the same refusals as `BM25Index.load` and `DenseIndex.load`."""
        index_dir = Path(index_dir)
        path = index_dir / MANIFEST
        manifest = read_manifest(index_dir, "hybrid", FORMAT_VERSION, KIND,
                                 ("corpus_sha256", "parts", "rrf_k", "depth"))
        digest = expected_corpus_sha256 or manifest["corpus_sha256"]
        if manifest.get("corpus_sha256") != digest:
            raise ValueError(f"{path}: index was built from corpus sha256 "
                             f"{manifest.get('corpus_sha256')}, expected {digest}")
        parts, rrf_k, depth = manifest["parts"], manifest["rrf_k"], manifest["depth"]
        # checked here: a damaged or hand-edited manifest was a TypeError/KeyError traceback, not a named error
        if not (isinstance(parts, dict) and all(isinstance(parts.get(p), str) for p in ("bm25", "dense"))):
            raise ValueError(f"{path}: parts {parts!r}: expected an object naming the bm25 and dense directories")
        for name, value, least in (("rrf_k", rrf_k, 0), ("depth", depth, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{path}: {name} {value!r}: expected an integer >= {least}")
        bm25 = BM25Index.load(index_dir / parts["bm25"], expected_corpus_sha256=digest)
        dense = DenseIndex.load(index_dir / parts["dense"], encoder, model=model,
                                expected_corpus_sha256=digest, device=device, batch_size=batch_size)
        if not _same_documents(bm25.docs, dense.docs):
            raise ValueError(f"{index_dir}: the BM25 and dense halves hold different documents")
        return cls(bm25, dense, rrf_k=rrf_k, depth=depth, build_seconds=manifest.get("build_seconds"))

    # ------------------------------------------------------------ retrieval

    def retrieve(self, queries: Sequence[str], topk: int = 3) -> list[list[Hit]]:
        """Top-k by fused RRF score, best first; deterministic ties (see `rrf_fuse`)."""
        queries = check_queries(queries)
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        depth = max(self.depth, topk)
        lexical = self.bm25.search(queries, depth)  # both halves rank corpus positions
        dense = self.dense.search(queries, depth)
        out = []
        for lex_hits, dense_hits in zip(lexical, dense):
            fused = rrf_fuse([[i for i, _ in lex_hits], [i for i, _ in dense_hits]], k=self.rrf_k)[:topk]
            out.append([Hit(self.docs[i], s) for i, s in fused])
        return out
