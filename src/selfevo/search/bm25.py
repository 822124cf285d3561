"""A local BM25 retriever over a FlashRAG corpus, built on `bm25s`.

bm25s precomputes every (term, document) score into a sparse matrix at build time, so a query
is a sum of a few matrix columns. What is ours: one tokenizer shared by index and queries
(so the two can never drift), deterministic top-k (ties broken by corpus order), and an index
directory with a manifest that ties it to the exact corpus it was built from.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import bm25s
import numpy as np
from bm25s.stopwords import STOPWORDS_EN

from selfevo._io import file_sha256, write_json
from selfevo.corpus import corpus_documents
from selfevo.records import Document
from selfevo.search._manifest import MANIFEST, read_manifest
from selfevo.search._progress import ProgressBar, corpus_total, ticked
from selfevo.search.docstore import DOCS_FILE, DocStore, hashed, held, settle, stage
from selfevo.search.tool import Hit, check_queries

FORMAT_VERSION = 2  # 2: documents keep a corpus's contents verbatim (1 re-quoted an unquoted title)
K1, B = 1.5, 0.75  # bm25s's defaults (Lucene BM25)
_BATCH = 20_000  # documents per numpy batch of the build

# bm25s's own default splitter and English stop list, so an index built here scores exactly as
# `bm25s.tokenize(..., stopwords="en")` would.
_TOKEN_RE = re.compile(r"(?u)\b\w\w+\b")
_STOPWORDS = frozenset(STOPWORDS_EN)


def _tokens(text: str) -> list[str]:
    """Lowercase, split, drop English stopwords. No stemming: Snowball (PyStemmer) measured no
    gain in answer recall@3 on wiki18-mini (macro 0.2249 vs 0.2250), so it is not a dependency."""
    return [w for w in _TOKEN_RE.findall(text.lower()) if w not in _STOPWORDS]


class _Postings:
    """The term statistics of a corpus, gathered one document at a time: per document its length
    and its distinct term ids with their counts, as numpy batches (a few bytes per (document, term)
    pair instead of a Python list of strings per document), and each term's document frequency."""

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self._pending: list[list[int]] = []
        self.lengths: list[np.ndarray] = []  # tokens per document
        self.n_terms: list[np.ndarray] = []  # distinct terms per document
        self.terms: list[np.ndarray] = []  # (document, term) pairs in document order, term ids ascending
        self.tf: list[np.ndarray] = []
        self.df = np.zeros(0, dtype=np.int64)

    def add(self, tokens: list[str]) -> None:
        vocab = self.vocab
        self._pending.append([vocab.setdefault(t, len(vocab)) for t in tokens])
        if len(self._pending) >= _BATCH:
            self._flush()

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            return
        lengths = np.fromiter(map(len, batch), np.int64, len(batch))
        ids = np.fromiter(itertools.chain.from_iterable(batch), np.int64, int(lengths.sum()))
        doc = np.repeat(np.arange(len(batch), dtype=np.int64), lengths)
        keys, tf = np.unique((doc << 32) | ids, return_counts=True)  # sorted: by document, then term
        terms = (keys & 0xFFFFFFFF).astype(np.int32)
        self.lengths.append(lengths)
        self.n_terms.append(np.bincount(keys >> 32, minlength=len(batch)))
        self.terms.append(terms)
        self.tf.append(tf.astype(np.int32))
        df = np.bincount(terms, minlength=len(self.vocab))
        df[:len(self.df)] += self.df
        self.df = df

    def score_matrix(self) -> dict:
        """bm25s's `scores`: the Lucene BM25 weight of every (term, document) pair as a CSC matrix
        (a column per term, rows ascending), equal to the one `bm25s.BM25().index` computes, bit for
        bit: the same float64 arithmetic, rounded to float32 at the end."""
        self._flush()  # the last flush saw the whole vocabulary: self.df has a count for every term
        df = self.df
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int64)
        n_docs = len(lengths)
        avg_len = lengths.mean() if n_docs else 0.0
        # bm25s: math.log per term, stored as float32
        idf = np.array([math.log(1 + (n_docs - d + 0.5) / (d + 0.5)) if d else 0.0 for d in df.tolist()],
                       dtype=np.float32)
        indptr = np.zeros(len(df) + 1, dtype=np.int64)
        np.cumsum(df, out=indptr[1:])
        data = np.empty(int(indptr[-1]), dtype=np.float32)
        indices = np.empty(int(indptr[-1]), dtype=np.int32)
        heads = indptr[:-1].copy()  # next free slot of each column
        first = 0
        for n_terms, terms, tf in zip(self.n_terms, self.terms, self.tf):
            docs = np.repeat(np.arange(first, first + len(n_terms), dtype=np.int64), n_terms)
            first += len(n_terms)
            if not len(terms):  # a batch of empty or stopword-only passages adds nothing to any column
                continue
            tf64 = tf.astype(np.float64)
            tfc = tf64 / (K1 * ((1 - B) + B * lengths[docs] / avg_len) + tf64)
            # counting sort into the columns: each pair's slot is its column's next free one, and a
            # stable sort by term keeps documents (rows) ascending within a column
            order = np.argsort(terms, kind="stable")
            col = terms[order]
            starts = np.flatnonzero(np.r_[True, col[1:] != col[:-1]])
            counts = np.diff(np.r_[starts, len(col)])
            slots = heads[col] + np.arange(len(col)) - np.repeat(starts, counts)
            data[slots] = (idf[col].astype(np.float64) * tfc[order]).astype(np.float32)
            indices[slots] = docs[order]
            heads[col[starts]] += counts
        self.terms, self.tf = [], []  # spent: free them before the caller goes on
        return {"data": data, "indices": indices, "indptr": indptr, "num_docs": n_docs}


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
        self.docs = held(docs)
        self.corpus_sha256 = corpus_sha256
        self._vocab: dict[str, int] = model.vocab_dict

    def __len__(self) -> int:
        return len(self.docs)

    # ------------------------------------------------------------ building

    @classmethod
    def build(cls, docs: Iterable[Document], corpus_sha256: str | None = None,
              store: str | os.PathLike | None = None, progress: bool = False,
              expected: int | None = None) -> BM25Index:
        """Index `docs` (title and text) in one streaming pass. `corpus_sha256` names the corpus in
        the manifest; by default it is the hash of the documents' JSONL serialisation. With `store`
        (a directory) the documents are written there as they stream past and the index reads them
        back on demand (`DocStore`): a corpus larger than memory is indexed without ever holding it;
        without it they are kept in a list. `progress`: a count of the passages indexed (of
        `expected`, if given: the bar then shows the time left)."""
        sha = hashlib.sha256()
        stream = hashed(docs, sha) if corpus_sha256 is None else docs
        postings = _Postings()

        def tokenised(advance) -> Iterator[Document]:
            for doc in ticked(stream, advance):
                postings.add(_tokens(f"{doc.title} {doc.text}"))  # queries use _tokens too
                yield doc

        with ProgressBar(progress, expected, "indexing passages (BM25)") as advance:
            kept = stage(tokenised(advance), store)
        model = bm25s.BM25()
        model.scores, model.vocab_dict = postings.score_matrix(), postings.vocab
        model.vocab_dict[""] = len(postings.vocab)  # bm25s's empty token, as its own `index` adds
        model.unique_token_ids_set = set(model.vocab_dict.values())
        model.nonoccurrence_array = None  # Lucene BM25 has none (bm25s's `index` sets the same)
        return cls(model, kept, corpus_sha256 or sha.hexdigest())

    @classmethod
    def from_corpus_file(cls, path: str | os.PathLike, index_dir: str | os.PathLike | None = None,
                         progress: bool = False) -> BM25Index:
        """Load the cached index from `index_dir` if it was built from this exact corpus file
        (same sha256), else build it from the file (streamed) and, with `index_dir`, save it there."""
        digest = file_sha256(path)
        if index_dir is not None and (Path(index_dir) / MANIFEST).exists():
            try:
                return cls.load(index_dir, expected_corpus_sha256=digest)
            except (ValueError, OSError):
                pass  # stale, foreign or damaged cache: rebuild below and overwrite it
        index = cls.build(corpus_documents(path, digest), corpus_sha256=digest, store=index_dir, progress=progress,
                          expected=corpus_total(path, progress))
        if index_dir is not None:
            index.save(index_dir)
        return index

    # ------------------------------------------------------------ persistence

    def save(self, index_dir: str | os.PathLike, before_replacing: Callable[[], None] | None = None) -> None:
        """bm25s's own files (numpy arrays + JSON, no pickle), docs.jsonl with its offsets, then
        manifest.json.

        The manifest is removed before the first file is renamed into place and written last, so an
        interrupted save leaves a directory that `load` refuses rather than a mix of old and new files;
        a save that fails while writing its arrays (a full disk) leaves an index already there as it was.
        Each file is written beside its place and renamed over it: an index loaded from this directory
        keeps reading the files it mapped (a file rewritten in place under a memory map kills the reader).
        `before_replacing` is called there too (a hybrid index removes its own manifest then)."""
        index_dir = Path(index_dir)
        index_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".bm25-", dir=index_dir) as tmp:
            try:
                self.model.save(tmp, allow_pickle=False, show_progress=False)
            except OSError as e:  # numpy's tofile says only "N requested and M written" on a full disk
                why = e.strerror or f"{e}: is the disk full?"
                raise OSError(e.errno, f"writing the BM25 arrays failed: {why}", str(index_dir)) from e
            (index_dir / MANIFEST).unlink(missing_ok=True)
            if before_replacing is not None:
                before_replacing()
            for f in Path(tmp).iterdir():
                os.replace(f, index_dir / f.name)
        self.docs = settle(self.docs, index_dir)
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
        docs = DocStore(index_dir)  # read on demand: the whole corpus is never in memory
        if len(docs) != manifest.get("num_docs"):
            raise ValueError(f"{manifest_path}: manifest says {manifest.get('num_docs')} documents, "
                             f"{DOCS_FILE} holds {len(docs)}")
        # memory-mapped score matrix: a wiki-18 index is opened in seconds and pages in what queries touch
        try:
            model = bm25s.BM25.load(index_dir, allow_pickle=False, show_progress=False, mmap=True)
            index = cls(model, docs, manifest["corpus_sha256"])
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            # bm25s's own files damaged (truncated arrays, JSON that does not parse or is not its
            # object) or not of these documents: its errors name no file, and some are no ValueError
            raise ValueError(f"{index_dir}: damaged BM25 index files ({type(e).__name__}: {e})") from None
        return index

    # ------------------------------------------------------------ retrieval

    def retrieve(self, queries: Sequence[str], topk: int = 3) -> list[list[Hit]]:
        """Top-k documents per query, best first, ties broken by corpus order.

        Only documents sharing at least one term with the query are returned (Lucene idf is
        positive, so score > 0 exactly then): an empty, all-stopword or all-unknown query
        gets no hits rather than `topk` arbitrary zero-score documents."""
        queries = check_queries(queries)
        return [[Hit(self.docs[i], s) for i, s in ranked] for ranked in self.search(queries, topk)]

    def search(self, queries: Sequence[str], topk: int) -> list[list[tuple[int, float]]]:
        """Like `retrieve`, as (corpus position, score) pairs (hybrid fusion uses positions)."""
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        return [self._search_one(q, topk) for q in queries]

    def _search_one(self, query: str, topk: int) -> list[tuple[int, float]]:
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
        return [(int(i), float(scores[i])) for i in order]
