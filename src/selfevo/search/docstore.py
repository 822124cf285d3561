"""The documents of a saved index, read from its `docs.jsonl` on demand.

Why: an index over wiki-18 (21M passages, 13 GB) cannot hold every `Document` as a Python object
(about 40 GB on a straight line from 1M passages: docs/benchmarks.md, "Index scale"); a search needs
only the few documents it returns. The store keeps one byte offset per
document (`docs.offsets.npy`, 8 bytes each) and memory-maps the file, so opening it costs no parse
and a lookup reads one line. The file is the same FlashRAG JSONL as before: an index saved by an
older version (no offsets file) is scanned once when opened.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from selfevo._io import atomic_writer, file_sha256, hold_directory, read_json, write_json
from selfevo.corpus import DataError, corpus_documents
from selfevo.records import Document
from selfevo.search._progress import ProgressBar, corpus_total, ticked

DOCS_FILE = "docs.jsonl"
OFFSETS_FILE = "docs.offsets.npy"
SOURCES_FILE = "sources.json"  # a corpus store's: the files it was made or opened from
STAGING = ".docs-building"  # where a streaming build writes its documents until the index is saved


def _line(doc: Document) -> bytes:
    return (json.dumps(doc.to_json(), ensure_ascii=False) + "\n").encode("utf-8")


class DocStore(Sequence[Document]):
    """A read-only sequence of the documents in `directory/docs.jsonl`, in file order. Safe to
    share between threads (a lookup slices the memory map; nothing seeks)."""

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / DOCS_FILE
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        offsets_path = Path(directory) / OFFSETS_FILE
        offsets = np.load(offsets_path, allow_pickle=False, mmap_mode="r") if offsets_path.exists() else None
        if offsets is None or offsets.ndim != 1 or not len(offsets) or int(offsets[-1]) != size:
            offsets = _scan(self._map, size)  # an older index, or offsets of another file: rescan
        self._offsets = offsets

    @classmethod
    def write(cls, directory: str | os.PathLike, docs: Iterable[Document]) -> DocStore:
        """Write `docs` (streamed: any iterable) as `directory/docs.jsonl` with their offsets, both
        atomically, and open the result. Writing a store over its own file is a no-op."""
        directory = Path(directory)
        if isinstance(docs, DocStore) and docs.path.resolve() == (directory / DOCS_FILE).resolve():
            return docs
        lengths = array("q")  # 8 bytes a document, not a Python int's 36
        with atomic_writer(directory / DOCS_FILE, "wb") as fh:
            for doc in docs:
                line = _line(doc)
                fh.write(line)
                lengths.append(len(line))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(np.frombuffer(lengths, dtype=np.int64), out=offsets[1:])
        with atomic_writer(directory / OFFSETS_FILE, "wb") as fh:
            np.save(fh, offsets, allow_pickle=False)
        return cls(directory)

    def move_to(self, directory: str | os.PathLike) -> DocStore:
        """Move this store's files into `directory` (each renamed over its place) and open them there."""
        directory = Path(directory)
        os.replace(self.path.with_name(OFFSETS_FILE), directory / OFFSETS_FILE)
        os.replace(self.path, directory / DOCS_FILE)
        return DocStore(directory)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document {i} of {n}")
        i %= n
        start, end = int(self._offsets[i]), int(self._offsets[i + 1])
        try:
            obj = json.loads(self._map[start:end])
            if not isinstance(obj["contents"], str):
                raise TypeError(f"contents is {type(obj['contents']).__name__}, not a string")
            return Document.from_contents(obj["id"], obj["contents"])
        except (ValueError, KeyError, TypeError) as e:  # a damaged index file
            raise DataError(self.path, i + 1, f"not a document line of this index ({e})") from None

    def __iter__(self) -> Iterator[Document]:
        for i in range(len(self)):
            yield self[i]

    def __eq__(self, other: object) -> bool:
        """The same documents in the same order (compared by bytes, never parsed)."""
        if isinstance(other, DocStore):
            if not np.array_equal(self._offsets, other._offsets):
                return False
            step = 1 << 24  # in slices: two wiki-18 stores would not fit in memory at once
            return all(self._map[i:i + step] == other._map[i:i + step]
                       for i in range(0, int(self._offsets[-1]), step))
        if isinstance(other, Sequence):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self):  # to another process (a worker pool, Ray) as its directory: a map is no value
        return DocStore, (self.path.parent,)


def held(docs: Iterable[Document]) -> Sequence[Document]:
    """How an index keeps its documents: a store as it is (on disk), anything else as a list."""
    return docs if isinstance(docs, DocStore) else list(docs)


def stage(docs: Iterable[Document], store: str | os.PathLike | None) -> Sequence[Document]:
    """The documents of an index being built, kept as they stream past: a list without `store`; with it
    a `DocStore` in `store`/.docs-building, beside the index and not over its docs.jsonl, so a corpus that
    turns out malformed half-way leaves a saved index there as it was (`settle` moves them into place).
    Refuses (ValueError) a stream of no document."""
    if store is None:
        kept: Sequence[Document] = list(docs)
    else:
        staging = Path(store) / STAGING
        shutil.rmtree(staging, ignore_errors=True)  # a killed build's
        try:
            kept = DocStore.write(staging, docs)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if not len(kept):
            shutil.rmtree(staging, ignore_errors=True)
    if not len(kept):
        raise ValueError("cannot build an index over zero documents")
    return kept


def settle(docs: Sequence[Document], index_dir: str | os.PathLike) -> DocStore:
    """An index's documents saved as `index_dir`'s docs.jsonl: the store `stage` made there moved into
    place, any other sequence written."""
    index_dir = Path(index_dir)
    if isinstance(docs, DocStore) and docs.path.parent.resolve() == (index_dir / STAGING).resolve():
        docs = docs.move_to(index_dir)
        shutil.rmtree(index_dir / STAGING, ignore_errors=True)
        return docs
    return DocStore.write(index_dir, docs)


def corpus_store(corpus: str | os.PathLike, root: str | os.PathLike, progress: bool = False) -> DocStore:
    """The documents of a corpus file as a store in `root`/<the file's sha256>, written on first use (read
    and checked as any corpus: `corpus_documents`) and opened as it is after: what needs a corpus's
    documents by id and has no index of it (a run searching through a /retrieve server) keeps them on
    disk, not as Python objects (wiki-18 would take about 40 GB). One process builds a corpus's store at a
    time (another waits, then opens it), beside its place, renamed into place when whole: a kill never
    leaves a half store under the name, and the next build removes what it left. The store records the
    corpus files it was made or opened from (`SOURCES_FILE`), so `selfevo cache prune` can tell a store
    no file holds any more. `progress`: a bar while the store is written."""
    if not Path(corpus).is_file():
        raise DataError(corpus, None, "not a file" if Path(corpus).exists() else "file not found")
    try:
        seen = file_record(corpus)  # before the hash: a rewrite while it is read shows as a change later
        sha = file_sha256(corpus)
    except OSError as e:  # (any OSError after this one is the store's)
        raise DataError(corpus, None, f"cannot read: {e.strerror}") from None
    out = Path(root) / sha
    store = _whole_store(out)
    if store is None:
        with hold_directory(store_lock(root, sha), None):
            store = _whole_store(out)  # (another process may have built it while this one waited)
            if store is None:
                tmp = store_scratch(root, sha)
                shutil.rmtree(tmp, ignore_errors=True)  # a killed build's
                try:
                    with ProgressBar(progress, corpus_total(corpus, progress),
                                     f"copying {Path(corpus).name} to {out}") as advance:
                        DocStore.write(tmp, ticked(corpus_documents(corpus, sha), advance))
                    os.rename(tmp, out)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                store = DocStore(out)
    if seen not in store_sources(out):
        # a cache this process cannot write (another user's) is read as it is: the record only guides a prune
        with contextlib.suppress(OSError), hold_directory(store_lock(root, sha), None):
            if out.is_dir():  # (`cache prune` may have removed a store this process had opened: it reads on)
                write_json(out / SOURCES_FILE, [r for r in store_sources(out) if r["path"] != seen["path"]] + [seen])
    return store


def store_lock(root: str | os.PathLike, sha: str) -> Path:
    """The lock of the store of content `sha` in `root`: held while it is built, its files recorded, or removed."""
    return Path(root) / f".{sha}.lock"


def store_scratch(root: str | os.PathLike, sha: str) -> Path:
    """Where the store of content `sha` is built (or put to be deleted) before it is renamed: never read."""
    return Path(root) / f".{sha}.tmp"


def _whole_store(out: Path) -> DocStore | None:
    """The store at `out` if one is there whole (a store is renamed into place whole, offsets included), else
    None, as when `selfevo cache prune` removes it between the look and the open."""
    if not (out / OFFSETS_FILE).exists():
        return None
    try:
        return DocStore(out)
    except FileNotFoundError:
        return None


def file_record(path: str | os.PathLike) -> dict:
    """A corpus file as a store records it: its absolute path, size and modification time."""
    st = os.stat(path)
    return {"path": str(Path(path).resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def store_sources(store: str | os.PathLike) -> list[dict]:
    """The corpus files (`file_record`s) a store was made or opened from; [] for a store made before stores
    recorded them (or a record that cannot be read: a cache is rebuilt, never trusted)."""
    try:
        rows = read_json(Path(store) / SOURCES_FILE)
    except (OSError, ValueError):
        return []
    keys = {"path", "bytes", "mtime_ns"}
    return [r for r in rows if isinstance(r, dict) and set(r) == keys] if isinstance(rows, list) else []


def source_state(record: dict, sha: str, confirm: bool) -> str:
    """Does the file a store recorded still hold the store's content (sha256 `sha`)? "as recorded" (the
    same size and time), "missing", "rewritten" (another size, or `confirm` and another hash), "same
    content" (touched: another time, `confirm` and the same hash) or "touched" (another time, not hashed)."""
    try:
        now = file_record(record["path"])
    except OSError:
        return "missing"
    if now == record:
        return "as recorded"
    if now["bytes"] != record["bytes"]:
        return "rewritten"
    if not confirm:
        return "touched"
    try:
        return "same content" if file_sha256(record["path"]) == sha else "rewritten"
    except OSError:
        return "missing"


def hashed(docs: Iterable[Document], h: Any) -> Iterator[Document]:
    """Pass `docs` through, feeding `h` (a hashlib object) each as the JSONL line `write_corpus`
    writes: a streamed corpus's content hash, taken on the way."""
    for d in docs:
        h.update(_line(d))
        yield d


def _scan(data, size: int) -> np.ndarray:
    """Byte offsets of every line start, and the end (one pass; an index saved without offsets)."""
    offsets, pos = [0], 0
    while pos < size:
        nl = data.find(b"\n", pos)
        pos = size if nl < 0 else nl + 1
        offsets.append(pos)
    return np.asarray(offsets, dtype=np.int64)


class ById(Mapping[str, Any]):
    """Documents by id over any sequence of them, `value(doc)` each (the document itself by default):
    a lazy view, so a corpus read on demand stays on disk; its id table (ids only) is made on the first
    lookup. Ids are unique in a corpus (`iter_corpus` refuses duplicates); were one repeated, the last
    would win, as in a dict."""

    def __init__(self, docs: Sequence[Document], value: Callable[[Document], Any] = lambda d: d):
        self._docs, self._value = docs, value
        self._pos: dict[str, int] | None = None

    def _table(self) -> dict[str, int]:
        if self._pos is None:
            self._pos = {}
            for i, d in enumerate(self._docs):
                self._pos[d.id] = i
        return self._pos

    def __getitem__(self, doc_id: str) -> Any:
        return self._value(self._docs[self._table()[doc_id]])

    def __contains__(self, doc_id: object) -> bool:
        return doc_id in self._table()

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


def contents_by_id(docs: Sequence[Document]) -> Mapping[str, str]:
    """What a judge reads: each document's FlashRAG contents by id."""
    return ById(docs, lambda d: d.contents)
