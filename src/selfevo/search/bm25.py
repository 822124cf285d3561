"""A local BM25 retriever over a FlashRAG corpus, built on `bm25s`.

bm25s precomputes every (term, document) score into a sparse matrix at build time, so a query
is a sum of a few matrix columns. What is ours: one tokenizer shared by index and queries
(so the two can never drift), deterministic top-k (ties broken by corpus order), and an index
directory with a manifest that ties it to the exact corpus it was built from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import bm25s
import numpy as np
from bm25s.stopwords import STOPWORDS_EN

from selfevo._io import file_sha256, write_json
from selfevo.corpus import iter_corpus, read_corpus, write_corpus
from selfevo.records import Document
from selfevo.search._manifest import MANIFEST, read_manifest
from selfevo.search.tool import Hit

FORMAT_VERSION = 1
DOCS_FILE = "docs.jsonl"

# bm25s's own default splitter and English stop list, so an index built here scores exactly as
# `bm25s.tokenize(..., stopwords="en")` would.
_TOKEN_RE = re.compile(r"(?u)\b\w\w+\b")
_STOPWORDS = frozenset(STOPWORDS_EN)


def _tokens(text: str) -> list[str]:
    """Lowercase, split, drop English stopwords. No stemming: Snowball (PyStemmer) measured no
    gain in answer recall@3 on wiki18-mini (macro 0.2249 vs 0.2250), so it is not a dependency."""
    return [w for w in _TOKEN_RE.findall(text.lower()) if w not in _STOPWORDS]


def docs_sha256(docs: Sequence[Document]) -> str:
    """Content hash of documents held in memory (the same bytes `write_corpus` would write)."""
    h = hashlib.sha256()
    for d in docs:
        h.update((json.dumps(d.to_json(), ensure_ascii=False) + "\n").encode("utf-8"))
    return h.hexdigest()


class BM25Index:
    """BM25 (Lucene variant, k1=1.5, b=0.75: bm25s defaults) over title + text.

    Implements the `Retriever` protocol. Use `build`, `load` or `from_corpus_file`; the
    constructor is the common tail of all three.
    """

    def __init__(self, model: bm25s.BM25, docs: Sequence[Document], corpus_sha256: str):
        if model.scores["num_docs"] != len(docs):
            raise ValueError(f"index holds {model.scores['num_docs']} documents, "
                             f"document list {len(docs)}")
        self.model = model
        self.docs = list(docs)
        self.corpus_sha256 = corpus_sha256
        self._vocab: dict[str, int] = model.vocab_dict

    def __len__(self) -> int:
        return len(self.docs)

    # ------------------------------------------------------------ building

    @classmethod
    def build(cls, docs: Sequence[Document], corpus_sha256: str | None = None) -> BM25Index:
        """Index `docs` (title and text). `corpus_sha256` names the corpus in the manifest;
        by default it is the hash of the documents' JSONL serialisation."""
        if not docs:
            raise ValueError("cannot build a BM25 index over zero documents")
        corpus_tokens = [_tokens(f"{d.title} {d.text}") for d in docs]  # queries use _tokens too
        model = bm25s.BM25()
        model.index(corpus_tokens, show_progress=False)
        return cls(model, docs, corpus_sha256 or docs_sha256(docs))

    @classmethod
    def from_corpus_file(cls, path: str | os.PathLike,
                         index_dir: str | os.PathLike | None = None) -> BM25Index:
        """Load the cached index from `index_dir` if it was built from this exact corpus file
        (same sha256), else build it from the file and, with `index_dir`, save it there."""
        digest = file_sha256(path)
        if index_dir is not None and (Path(index_dir) / MANIFEST).exists():
            try:
                return cls.load(index_dir, expected_corpus_sha256=digest)
            except (ValueError, OSError):
                pass  # stale, foreign or damaged cache: rebuild below and overwrite it
        index = cls.build(read_corpus(path), corpus_sha256=digest)
        if index_dir is not None:
            index.save(index_dir)
        return index

    # ------------------------------------------------------------ persistence

    def save(self, index_dir: str | os.PathLike) -> None:
        """bm25s's own files (numpy arrays + JSON, no pickle), docs.jsonl, then manifest.json.

        The manifest is removed first and written last, so an interrupted save leaves a
        directory that `load` refuses rather than a mix of old and new files."""
        index_dir = Path(index_dir)
        index_dir.mkdir(parents=True, exist_ok=True)
        (index_dir / MANIFEST).unlink(missing_ok=True)
        self.model.save(index_dir, allow_pickle=False, show_progress=False)
        write_corpus(index_dir / DOCS_FILE, self.docs)
        write_json(index_dir / MANIFEST, {
            "format_version": FORMAT_VERSION,
            "corpus_sha256": self.corpus_sha256,
            "num_docs": len(self.docs),
            "tokenizer": "lowercase, \\w\\w+, bm25s English stopwords, no stemming",
            "bm25s_version": bm25s.__version__,
        })

    @classmethod
    def load(cls, index_dir: str | os.PathLike,
             expected_corpus_sha256: str | None = None) -> BM25Index:
        """Load a saved index. Refuses (ValueError) an index of another format version, or of
        another corpus when `expected_corpus_sha256` is given."""
        index_dir = Path(index_dir)
        manifest_path = index_dir / MANIFEST
        manifest = read_manifest(index_dir, "BM25", FORMAT_VERSION)
        if expected_corpus_sha256 is not None and manifest.get("corpus_sha256") != expected_corpus_sha256:
            raise ValueError(f"{manifest_path}: index was built from corpus sha256 "
                             f"{manifest.get('corpus_sha256')}, expected {expected_corpus_sha256}")
        docs = list(iter_corpus(index_dir / DOCS_FILE))
        if len(docs) != manifest.get("num_docs"):
            raise ValueError(f"{manifest_path}: manifest says {manifest.get('num_docs')} documents, "
                             f"{DOCS_FILE} holds {len(docs)}")
        model = bm25s.BM25.load(index_dir, allow_pickle=False, show_progress=False)
        return cls(model, docs, manifest["corpus_sha256"])

    # ------------------------------------------------------------ retrieval

    def retrieve(self, queries: Sequence[str], topk: int = 3) -> list[list[Hit]]:
        """Top-k documents per query, best first, ties broken by corpus order.

        Only documents sharing at least one term with the query are returned (Lucene idf is
        positive, so score > 0 exactly then): an empty, all-stopword or all-unknown query
        gets no hits rather than `topk` arbitrary zero-score documents."""
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        return [self._retrieve_one(q, topk) for q in queries]

    def _retrieve_one(self, query: str, topk: int) -> list[Hit]:
        ids = [self._vocab[t] for t in _tokens(query) if t in self._vocab]
        if not ids:
            return []
        scores = self.model.get_scores_from_ids(ids)
        matched = np.flatnonzero(scores > 0)  # ascending doc order
        if len(matched) > topk:
            # Keep everything scoring at least the k-th best score, so a tie at the cut-off is
            # resolved by doc order below rather than by argpartition's arbitrary choice.
            kth = np.partition(scores[matched], len(matched) - topk)[len(matched) - topk]
            matched = matched[scores[matched] >= kth]
        # Stable sort on descending score keeps ascending doc order among equal scores.
        order = matched[np.argsort(-scores[matched], kind="stable")][:topk]
        return [Hit(self.docs[i], float(scores[i])) for i in order]
