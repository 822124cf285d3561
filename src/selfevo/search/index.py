"""Open any index directory, or build an index of a named kind: the one place that maps
`bm25 | dense | hybrid` to a class, for the CLI, the server and the evaluator.

An index directory says its kind in its manifest (`"kind"`); a BM25 directory, whose manifest
predates the field, is recognised by its `bm25s_version`. The dense and hybrid kinds import
torch / sentence-transformers / FAISS only when asked for.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfevo._io import directory_bytes
from selfevo.search._manifest import MANIFEST, load_manifest
from selfevo.search.tool import Retriever

KINDS = ("bm25", "dense", "hybrid")


@dataclass(frozen=True)
class DenseOptions:
    """Encoder and FAISS settings for building a dense or hybrid index (None = default).
    `model` also selects the encoder when loading; the prefixes then come from the manifest.
    `index_type` None: a cache's own type and settings (`faiss_params` over them), flat for a build."""

    model: str | None = None
    index_type: str | None = None
    batch_size: int = 32
    device: str = "cpu"
    query_prefix: str | None = None
    passage_prefix: str | None = None
    rrf_k: int | None = None
    depth: int | None = None
    faiss_params: dict[str, int] = field(default_factory=dict)  # e.g. {"nprobe": 32}; see dense.default_params

    def encoder(self) -> Any:
        from selfevo.search.dense import DEFAULT_MODEL, Encoder

        return Encoder(self.model or DEFAULT_MODEL, query_prefix=self.query_prefix,
                       passage_prefix=self.passage_prefix, batch_size=self.batch_size,
                       device=self.device)

    def fusion(self) -> dict[str, int]:
        return {k: v for k, v in (("rrf_k", self.rrf_k), ("depth", self.depth)) if v is not None}


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown retriever {kind!r}; known: {', '.join(KINDS)}")
    return kind


def index_kind(index_dir: str | os.PathLike) -> str:
    """The kind of index saved in `index_dir` (ValueError if it holds none)."""
    path = Path(index_dir) / MANIFEST
    if not path.exists():
        raise ValueError(f"{index_dir}: no {MANIFEST}; not a (complete) index directory")
    manifest = load_manifest(path)
    kind = manifest.get("kind") or ("bm25" if "bm25s_version" in manifest else None)
    if kind is None:  # another tool's manifest: a run directory's, a model's
        raise ValueError(f"{index_dir}: not an index directory (its {MANIFEST} names no index kind; make one "
                         "with `selfevo index build`)")
    if kind not in KINDS:
        raise ValueError(f"{path}: unknown index kind {kind!r}")
    return kind


def index_identity(index: Any) -> dict:
    """What decides what searches over a corpus find besides its documents: the kind of index and, for
    a dense or hybrid one, the encoder's weights (a fingerprint; None for BM25)."""
    encoder = getattr(getattr(index, "dense", index), "encoder", None)  # a hybrid's is its dense half's
    return {"kind": getattr(index, "kind", "bm25"), "encoder": encoder.fingerprint if encoder is not None else None}


def open_index(index_dir: str | os.PathLike, *, expected_corpus_sha256: str | None = None,
               options: DenseOptions | None = None) -> Retriever:
    """Load the index in `index_dir`, whatever its kind. With `options.model`, a dense or hybrid
    index is refused unless it was built with that model's weights."""
    kind = index_kind(index_dir)
    options = options or DenseOptions()
    if kind == "bm25":
        from selfevo.search.bm25 import BM25Index

        return BM25Index.load(index_dir, expected_corpus_sha256=expected_corpus_sha256)
    load_kw = dict(model=options.model, expected_corpus_sha256=expected_corpus_sha256,
                   device=options.device, batch_size=options.batch_size)
    if kind == "dense":
        from selfevo.search.dense import DenseIndex

        return DenseIndex.load(index_dir, **load_kw)
    from selfevo.search.hybrid import HybridIndex, _check_fusion

    fusion = options.fusion()
    _check_fusion(fusion.get("rrf_k", 0), fusion.get("depth", 1))  # now, not at the first query (a server's 500)
    index = HybridIndex.load(index_dir, **load_kw)
    for k, v in fusion.items():
        setattr(index, k, v)
    return index


def saved_dir(retriever: Any) -> Path | None:
    """The index directory `retriever` reads its documents from, if it was loaded from (or saved to)
    one: what another process opens to search the same documents, its files mapped and their pages
    shared, instead of building the index again. None for an index held in memory only."""
    from selfevo.search.docstore import DocStore

    docs = getattr(retriever, "docs", None)
    if not isinstance(docs, DocStore):
        return None
    kind = getattr(retriever, "kind", "bm25")
    home = docs.path.parent
    for candidate in (home, home.parent):  # a hybrid index keeps its documents in its dense half
        try:
            if index_kind(candidate) == kind:
                return candidate
        except (ValueError, OSError):
            continue
    return None


# where an index of any kind writes below its directory: there (bm25, dense) or in a hybrid's halves
PARTS = ("", "bm25", "dense")


@contextlib.contextmanager
def _building(index_dir: str | os.PathLike, cache: bool = False) -> Iterator[None]:
    """Hold `index_dir` while an index is built (or loaded from it as a cache) there: a second build into it
    would clear the first's staged documents under it, and two saves would leave one index's arrays beside
    the other's documents. A second build is refused; a second user of a cache waits, then loads what the
    first built. Held, it is clear of what a build killed in it left, never read by anything: a BM25
    save's scratch directory (the score matrix: gigabytes for wiki-18), the documents it staged (a copy of
    the corpus: 13 GB for wiki-18, beside a cache that stays valid) and atomic writes' temp files."""
    from selfevo._io import hold_directory, remove_leftover_temps
    from selfevo.search.docstore import STAGING

    busy = None if cache else (lambda: ValueError(f"{index_dir}: another process is building an index here; "
                                                  "wait for it to end (or stop it), then rerun"))
    def clear() -> None:
        # only where an index writes, not below: a directory under --out may be another build's, with its
        # own lock and its own temp files in flight
        for part in (Path(index_dir) / p for p in PARTS):
            remove_leftover_temps(part)
            for scratch in [*part.glob(".bm25-*"), part / STAGING]:
                shutil.rmtree(scratch, ignore_errors=True)

    with hold_directory(index_dir, busy):
        clear()
        before = set() if cache else _kinds_there(Path(index_dir))  # a cache of another kind is refused, not rebuilt
        try:
            yield
        except BaseException:
            clear()  # a build that failed (a full disk) leaves no copy of the corpus staged beside the index
            raise
        if before and (new := _kind_or_none(index_dir)) is not None:
            for old in before - {new}:
                _drop_old_kind(Path(index_dir), old, new)


def _kind_or_none(index_dir: str | os.PathLike) -> str | None:
    """The kind its manifest names; None without a readable one."""
    if not (Path(index_dir) / MANIFEST).is_file():
        return None
    try:
        return index_kind(index_dir)
    except (ValueError, OSError):
        return None


def _kinds_there(out: Path) -> set[str]:
    """The kind of the index in `out`; with no manifest (a save cut short removed it), every kind whose files
    are there: a failed build of another kind leaves its own files beside the old index's."""
    if (kind := _kind_or_none(out)) is not None:
        return {kind}
    if (out / MANIFEST).exists():
        return set()  # unreadable: not known to be an index's
    from selfevo.search.dense import VECTORS_FILE

    found = {"bm25": any(out.glob("*.index.*")), "dense": (out / VECTORS_FILE).exists(),
             "hybrid": any((out / part).is_dir() for part in PARTS[1:])}
    return {kind for kind, there in found.items() if there}


def _drop_old_kind(out: Path, old: str, new: str) -> None:
    """Once an index of kind `new` is saved over an index of kind `old`, remove the files of the old one
    that the new one does not use (a dense index's vectors beside a new BM25 index: gigabytes no manifest
    names). A flat index (bm25, dense) keeps its files at the top, a hybrid one its halves in bm25/ and
    dense/ (the same files a level down); the BM25 arrays are bm25s's `*.index.*`."""
    from selfevo.search.dense import VECTORS_FILE
    from selfevo.search.docstore import DOCS_FILE, OFFSETS_FILE

    docs = [out / DOCS_FILE, out / OFFSETS_FILE] if new == "hybrid" else []  # a flat index's documents
    left = {"bm25": [*out.glob("*.index.*"), *docs], "dense": [out / VECTORS_FILE, *docs],
            "hybrid": [out / "bm25", out / "dense"]}[old]
    for path in left:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _left_part(path: Path) -> bool:
    """A hybrid index's half (bm25/, dense/) that a failed or killed build or import left with nothing
    in it but what a build stages (hidden entries)."""
    return path.name in PARTS[1:] and path.is_dir() and all(p.name.startswith(".") for p in path.iterdir())


def check_index_out(out: str | os.PathLike) -> None:
    """An index is built (or imported) into a new or empty directory, over an index, or over what a
    killed build left (its staged documents): never into a directory of other files, which the
    build would write over (a `docs.jsonl` or `manifest.json` of someone else's)."""
    from selfevo.search.docstore import DOCS_FILE

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: a file, not a directory; --out names the index directory")
    if not out.is_dir() or not any(p for p in out.iterdir() if not p.name.startswith(".") and not _left_part(p)):
        return
    if (out / MANIFEST).exists():
        try:
            index_kind(out)
        except ValueError:
            raise ValueError(f"{out}: holds a {MANIFEST} that is no index's; give a new or empty directory") from None
        return
    if not any((out / part / DOCS_FILE).exists() for part in PARTS):
        raise ValueError(f"{out}: not empty, and holds no index; give a new or empty directory")


def _check_not_corpus(corpus: str | os.PathLike, index_dir: str | os.PathLike) -> None:
    """An index writes its own docs.jsonl (a hybrid one under bm25/ and dense/): never over the corpus
    it is built from, which would be rewritten in place (its other fields dropped, its bytes changed)."""
    from selfevo.search.bm25 import DOCS_FILE  # dense's is the same name

    for part in PARTS:
        target = Path(index_dir) / part / DOCS_FILE
        if target.is_file() and Path(corpus).is_file() and os.path.samefile(target, corpus):
            raise ValueError(f"{corpus}: the index would write its {DOCS_FILE} over this corpus file; "
                             "choose another --out / --index-dir (or move the corpus)")


def index_from_corpus_file(kind: str, corpus: str | os.PathLike,
                           index_dir: str | os.PathLike | None = None,
                           options: DenseOptions | None = None, progress: bool = False) -> Retriever:
    """An index of `kind` over the corpus file: loaded from `index_dir` when that holds one built
    from this exact file (and, for dense/hybrid, this encoder), else built and saved there."""
    _check_kind(kind)
    options = options or DenseOptions()
    if index_dir is None:
        return _index_from_corpus_file(kind, corpus, None, options, progress)
    _check_not_corpus(corpus, index_dir)
    with _building(index_dir, cache=True):
        return _index_from_corpus_file(kind, corpus, index_dir, options, progress)


def _index_from_corpus_file(kind: str, corpus: str | os.PathLike, index_dir: str | os.PathLike | None,
                            options: DenseOptions, progress: bool) -> Retriever:
    if index_dir is not None:
        found = _kind_or_none(index_dir)  # unreadable: a damaged cache of any kind is rebuilt, as before
        if found is not None and found != kind:
            # a cache of another kind would be overwritten by the rebuild (a dense one: hours of encoding)
            raise ValueError(f"{index_dir}: holds a {found} index, not a {kind} one; give another cache "
                             "directory (or remove this one)")
    if kind == "bm25":
        from selfevo.search.bm25 import BM25Index

        return BM25Index.from_corpus_file(corpus, index_dir=index_dir, progress=progress)
    if kind == "dense":
        from selfevo.search.dense import DenseIndex

        return DenseIndex.from_corpus_file(corpus, index_dir, options.encoder(), index_type=options.index_type,
                                           progress=progress, **options.faiss_params)
    from selfevo.search.hybrid import HybridIndex

    return HybridIndex.from_corpus_file(corpus, index_dir, options.encoder(), index_type=options.index_type,
                                        progress=progress, **options.fusion(), **options.faiss_params)


def build_index(kind: str, corpus: str | os.PathLike, out: str | os.PathLike,
                options: DenseOptions | None = None, progress: bool = False) -> Retriever:
    """Build an index of `kind` over the corpus file and save it to `out` (always rebuilds). Every
    kind streams the corpus and keeps its documents on disk in `out` as they pass (a BM25 index
    holds its term statistics while building, a dense one its FAISS vectors); a corpus that turns
    out malformed half-way leaves an index already in `out` as it was."""
    from selfevo._io import file_sha256

    _check_kind(kind)
    options = options or DenseOptions()
    check_index_out(out)
    digest = file_sha256(corpus)
    _check_not_corpus(corpus, out)
    with _building(out):
        return _build_index(kind, corpus, out, options, progress, digest)


def _build_index(kind: str, corpus: str | os.PathLike, out: str | os.PathLike, options: DenseOptions,
                 progress: bool, digest: str) -> Retriever:
    from selfevo.corpus import corpus_documents
    from selfevo.search._progress import corpus_total

    docs = corpus_documents(corpus, digest)
    stream = {"store": out, "progress": progress, "expected": corpus_total(corpus, progress)}
    if kind == "bm25":
        from selfevo.search.bm25 import BM25Index

        index: Any = BM25Index.build(docs, corpus_sha256=digest, **stream)
    elif kind == "dense":
        from selfevo.search.dense import DenseIndex

        index = DenseIndex.build(docs, options.encoder(), index_type=options.index_type or "flat", corpus_sha256=digest,
                                 **stream, **options.faiss_params)
    else:
        from selfevo.search.hybrid import HybridIndex

        index = HybridIndex.build(docs, options.encoder(), corpus_sha256=digest,
                                  index_type=options.index_type or "flat", **stream, **options.fusion(),
                                  **options.faiss_params)
    index.save(out)
    return index


def index_size_bytes(index_dir: str | os.PathLike) -> int:
    """Bytes on disk of everything in an index directory."""
    return directory_bytes(index_dir)


def get_retriever(*, corpus: str | os.PathLike | None = None, index: str | os.PathLike | None = None,
                  kind: str | None = None, cache_dir: str | os.PathLike | None = None,
                  options: DenseOptions | None = None, progress: bool = False) -> Retriever:
    """What `serve-retriever` and `eval` search: the saved index `index` (any kind; checked
    against `corpus` and `kind` when those are given), else an index of `kind` (default bm25)
    over `corpus`, cached in `cache_dir`."""
    if kind is not None:
        _check_kind(kind)
    model = options.model if options is not None else None
    if model is not None and (index_kind(index) if index is not None else kind or "bm25") == "bm25":
        raise ValueError(f"encoder model {model!r}: a bm25 index reads none (the model is a dense or hybrid "
                         "index's)")
    if index is not None:
        found = index_kind(index)
        if kind is not None and kind != found:
            raise ValueError(f"{index}: a {found} index, but retriever {kind!r} was asked for")
        from selfevo._io import file_sha256

        digest = file_sha256(corpus) if corpus is not None else None
        return open_index(index, expected_corpus_sha256=digest, options=options)
    if corpus is None:
        raise ValueError("need a corpus file or a saved index directory")
    return index_from_corpus_file(kind or "bm25", corpus, cache_dir, options, progress=progress)
