"""Fetch the paper's real evaluation data from the Hugging Face Hub: the seven FlashRAG benchmarks
and the wiki-18 (DPR, 100-word passages) corpus, converted to the formats `selfevo.corpus` reads.

Layout written under an output directory:

    qa/<benchmark>.jsonl    FlashRAG QA lines {"id", "question", "golden_answers", "metadata": {"benchmark", "hop"}}
    corpus/wiki-18.jsonl    FlashRAG corpus lines {"id", "contents"}
    manifest.json           sources (repo ids, requested revisions, resolved commits, sha256), outputs
                            (sha256, sizes, counts) and the settings each output was made with

Sources. Benchmarks: the dataset repo `RUC-NLPIR/FlashRAG_datasets`, one folder per benchmark with
`train.jsonl` / `dev.jsonl` / `test.jsonl`. The split used is the test split where the benchmark has a
labelled one (NQ, TriviaQA, PopQA, Bamboogle), else dev (HotpotQA, 2WikiMultiHopQA, MuSiQue); if the
preferred file is missing on the Hub the other of the two is tried. Corpus: the Search-R1 dataset repo
`PeterJinGo/wiki-18-corpus`, file `wiki-18.jsonl.gz`. Any `.jsonl`, `.jsonl.gz` or `.zip` (holding one
`.jsonl`) corpus file can be named instead, e.g. FlashRAG's own `retrieval-corpus/wiki18_100w.zip`.

Subsampling (the paper's evaluation set: 200 items from each of six benchmarks plus all of Bamboogle).
Every well-formed item of the split is a candidate; an item is ranked by the SHA-256 hex digest of
`"{seed}:{benchmark}:{source id}"`, and the `per_benchmark` lowest-ranked items are kept, written in
the order of the source file. The rule needs no random-number generator (the same selection on every
Python and platform) and an item's selection depends only on its own id and the ids of the others.
Bamboogle (125 items) and any split no larger than `per_benchmark` are kept whole; `per_benchmark=0`
keeps every split whole.

Ids. An item's id is `"<benchmark>-<source id>"` (FlashRAG's ids, e.g. `test_0`, repeat across
benchmarks; a directory of QA files needs them unique), unless the source id already starts with
`"<benchmark>-"`. FlashRAG's own metadata (supporting facts, contexts) is not carried over.

Everything that touches the network goes through one function, `download(repo_id, filename, revision)
-> local path`; the default, `hub_download`, uses `huggingface_hub.hf_hub_download` (the standard HF
cache, token, `HF_ENDPOINT` and `HF_HUB_OFFLINE`). The conversion functions take local paths only.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import math
import os
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selfevo._io import atomic_writer, file_sha256, hold_directory, read_json, remove_leftover_temps, write_json

# the readers' own line checks, so a downloaded file fails exactly where `selfevo.corpus` would fail it
from selfevo.corpus import (
    GZIP_MAGIC,
    DataError,
    _require_str,
    iter_json_lines,
    iter_qa,
    parse_json_line,
    read_qa_dir,
)
from selfevo.evaluate import scorable
from selfevo.records import QAItem

QA_REPO = "RUC-NLPIR/FlashRAG_datasets"
CORPUS_REPO = "PeterJinGo/wiki-18-corpus"
CORPUS_FILE = "wiki-18.jsonl.gz"
CORPUS_OUT = "corpus/wiki-18.jsonl"
MANIFEST = "manifest.json"
FORMAT = 1  # bump when the conversion changes: outputs made by an older version are redone
SUBSAMPLE_RULE = ("keep the per_benchmark items with the smallest sha256('{seed}:{benchmark}:{source id}') "
                  "hex digests, in source-file order; Bamboogle and smaller splits whole")


@dataclass(frozen=True)
class Benchmark:
    name: str
    hop: str  # "single" | "multi"
    splits: tuple[str, ...]  # files tried in this order: the split the paper's protocol uses first
    keep_all: bool = False  # never subsampled (Bamboogle: the paper uses all 125 items)

    def files(self) -> list[str]:
        return [f"{self.name}/{split}.jsonl" for split in self.splits]


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("nq", "single", ("test", "dev")),
    Benchmark("triviaqa", "single", ("test", "dev")),
    Benchmark("popqa", "single", ("test", "dev")),
    Benchmark("hotpotqa", "multi", ("dev", "test")),
    Benchmark("2wikimultihopqa", "multi", ("dev", "test")),
    Benchmark("musique", "multi", ("dev", "test")),
    Benchmark("bamboogle", "multi", ("test", "dev"), keep_all=True),
)}


class DownloadError(RuntimeError):
    """A file could not be fetched. `str()` is one line that says what to do."""


class MissingFileError(DownloadError):
    """The repository (at that revision) has no such file."""


Download = Callable[[str, str, str | None], str | os.PathLike]


# ---------------------------------------------------------------- the Hub


def hub_download(repo_id: str, filename: str, revision: str | None = None) -> Path:
    """Fetch one file of a Hub *dataset* repo into the standard HF cache and return its local path.
    Every failure becomes a `DownloadError` (a `MissingFileError` when the file does not exist)."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise DownloadError("huggingface_hub is not installed: pip install 'selfevo[data]'") from None
    try:
        return Path(hf_hub_download(repo_id=repo_id, filename=filename, repo_type="dataset", revision=revision))
    except Exception as e:  # huggingface_hub and its HTTP client raise many types; each gets one line
        raise describe_hub_error(e, repo_id, filename, revision) from None


def describe_hub_error(exc: BaseException, repo_id: str, filename: str, revision: str | None) -> DownloadError:
    """Map an exception from `hf_hub_download` to a one-line `DownloadError`. Classes are matched by
    name along the MRO so the mapping holds across huggingface_hub versions (0.2x and 1.x+)."""
    names = [c.__name__ for c in type(exc).__mro__]
    what = f"{repo_id}/{filename}" + (f"@{revision}" if revision else "")
    if "LocalEntryNotFoundError" in names:  # offline, or the Hub unreachable, and nothing cached
        if _hf_offline():
            return DownloadError(f"cannot fetch {what}: HF_HUB_OFFLINE is set and the file is not in the "
                                 "local Hugging Face cache")
        return DownloadError(f"cannot fetch {what}: the Hub is unreachable (check the network or HF_ENDPOINT) "
                             "and the file is not in the local Hugging Face cache")
    if "OfflineModeIsEnabled" in names:
        return DownloadError(f"cannot fetch {what}: HF_HUB_OFFLINE is set")
    if "EntryNotFoundError" in names or "RemoteEntryNotFoundError" in names:
        return MissingFileError(f"cannot fetch {what}: no such file in the repository")
    if "GatedRepoError" in names:
        return DownloadError(f"cannot fetch {what}: the repository is gated; accept its terms on the Hub and "
                             "set HF_TOKEN")
    if "RepositoryNotFoundError" in names:
        return DownloadError(f"cannot fetch {what}: no such dataset repository (or it is private: set HF_TOKEN)")
    if "RevisionNotFoundError" in names:
        return DownloadError(f"cannot fetch {what}: no such revision {revision!r}")
    detail = " ".join(str(exc).split())[:200] or type(exc).__name__
    return DownloadError(f"cannot fetch {what}: {detail}")


def _hf_offline() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover - an unusual huggingface_hub
        return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def commit_of(path: str | os.PathLike) -> str | None:
    """The commit a file of the HF cache was fetched at (`.../snapshots/<commit>/...`), if it shows."""
    parts = Path(path).parts
    for i, part in enumerate(parts[:-1]):
        if part == "snapshots" and len(parts[i + 1]) == 40:
            return parts[i + 1]
    return None


# ---------------------------------------------------------------- benchmarks (pure, local paths)


def _answers(obj: dict, path, lineno) -> list[str]:
    """The answer aliases, verbatim (numbers as strings); [] when none has any text."""
    for key in ("golden_answers", "answers", "answer"):
        if key in obj and obj[key] is not None:
            value = obj[key]
            break
    else:
        raise DataError(path, lineno, "missing field 'golden_answers'")
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list):
        raise DataError(path, lineno, f"field '{key}' must be a list of strings, got {type(value).__name__}")
    out: list[str] = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise DataError(path, lineno, f"field '{key}' must hold only strings, got {type(v).__name__}")
        if isinstance(v, float) and not math.isfinite(v):  # NaN (a missing cell) would be the answer "nan"
            raise DataError(path, lineno, f"field '{key}' holds {v}, not an answer")
        # a year read as a number (1939.0 from a numeric column) is the answer "1939"
        # (an int as it is: float() of one past 10**308 overflows)
        out.append(v if isinstance(v, str) else str(v) if isinstance(v, int) else str(int(v) if v.is_integer() else v))
    return out if any(v.strip() for v in out) else []


def load_split(path: str | os.PathLike, benchmark: str) -> tuple[list[QAItem], int]:
    """Read one FlashRAG split file into QA items in the selfevo format (prefixed ids, metadata
    `benchmark` and `hop`). Returns (items, skipped): an item with no answer left after normalization is skipped;
    anything else malformed raises a `DataError` naming the file and line."""
    bench = BENCHMARKS[benchmark]
    items: list[QAItem] = []
    seen: set[str] = set()
    skipped = 0
    for lineno, obj in iter_json_lines(path):
        source_id = _require_str(obj, "id", path, lineno)
        question = _require_str(obj, "question", path, lineno)
        golds = _answers(obj, path, lineno)
        if not scorable(golds):  # blank, or "The" alone: no answer could be right
            skipped += 1
            continue
        item_id = source_id if source_id.startswith(f"{benchmark}-") else f"{benchmark}-{source_id}"
        if item_id in seen:
            raise DataError(path, lineno, f"duplicate id '{source_id}'")
        seen.add(item_id)
        items.append(QAItem(item_id, question, tuple(golds), {"benchmark": benchmark, "hop": bench.hop}))
    if not items:
        raise DataError(path, None, "no usable QA items")
    return items, skipped


def _source_id(item: QAItem) -> str:
    bench = item.metadata.get("benchmark", "")
    return item.id[len(bench) + 1:] if bench and item.id.startswith(f"{bench}-") else item.id


def subsample(items: Sequence[QAItem], k: int, seed: int, benchmark: str) -> list[QAItem]:
    """The module docstring's rule: the k items with the smallest sha256("{seed}:{benchmark}:{id}")
    digests, in their original order. k <= 0, or k >= len(items), keeps everything. {id} is the id
    without its "<benchmark>-" prefix: a source that spells an id "nq-5" and one that spells it "5"
    make the same item id (load_split), so they rank it the same and pick the same items."""
    if k <= 0 or k >= len(items):
        return list(items)

    def rank(i: int) -> str:
        return hashlib.sha256(f"{seed}:{benchmark}:{_source_id(items[i])}".encode()).hexdigest()

    keep = set(sorted(range(len(items)), key=rank)[:k])
    return [it for i, it in enumerate(items) if i in keep]


def _staged(dest: Path) -> Path:
    """Where a benchmark file is written and read back before it replaces `dest`."""
    return dest.parent / f".{dest.name}.staged"


def convert_benchmark(src: str | os.PathLike, benchmark: str, dest: str | os.PathLike,
                      per_benchmark: int = 200, seed: int = 0) -> dict[str, Any]:
    """Convert one downloaded split file to `dest` (FlashRAG QA JSONL). The file is written beside
    `dest`, read back through `selfevo.corpus.iter_qa`, and only then renamed into place.
    Returns the counts and the sha256 of what was written."""
    if benchmark not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r} (known: {', '.join(BENCHMARKS)})")
    items, skipped = load_split(src, benchmark)
    k = 0 if BENCHMARKS[benchmark].keep_all else per_benchmark
    chosen = subsample(items, k, seed, benchmark)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staged = _staged(dest)
    try:
        with atomic_writer(staged) as fh:
            for it in chosen:
                fh.write(json.dumps(it.to_json(), ensure_ascii=False) + "\n")
        back = list(iter_qa(staged))
        if [it.id for it in back] != [it.id for it in chosen] or any(it.benchmark != benchmark for it in back):
            raise DataError(dest, None, "the written file does not read back as written")
        digest = file_sha256(staged)
        os.replace(staged, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged)
    return {"items": len(chosen), "available": len(items), "skipped": skipped, "sha256": digest,
            "bytes": dest.stat().st_size}


# ---------------------------------------------------------------- the corpus (pure, local paths)


class _HashingReader(io.RawIOBase):
    """A read-only stream that hashes every byte read through it."""

    def __init__(self, fh):
        self._fh, self.sha256 = fh, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self._fh.readinto(b)
        if n:
            self.sha256.update(memoryview(b)[:n])
        return n

    def drain(self) -> None:  # hash any bytes a decompressor left unread (trailing garbage, padding)
        while self._fh.read(1 << 20):
            pass


@contextlib.contextmanager
def _open_corpus(path: Path) -> Iterator[tuple[Any, Callable[[], str]]]:
    """Yield (binary line stream, function returning the source file's sha256)."""
    if path.name.endswith(".zip"):
        with zipfile.ZipFile(path) as zf:
            members = [m for m in zf.namelist() if m.endswith(".jsonl") and not m.startswith("__MACOSX")]
            if len(members) != 1:
                raise DataError(path, None, f"expected one .jsonl file in the archive, found {members or 'none'}")
            with zf.open(members[0]) as fh:
                yield io.BufferedReader(fh, 1 << 20), lambda: file_sha256(path)
        return
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == GZIP_MAGIC  # by content, whatever the name, as selfevo.corpus reads it
        raw.seek(0)
        reader = _HashingReader(raw)
        if gzipped:
            stream = io.BufferedReader(gzip.GzipFile(fileobj=io.BufferedReader(reader, 1 << 20)), 1 << 20)
        else:
            stream = io.BufferedReader(reader, 1 << 20)

        def digest() -> str:
            reader.drain()
            return reader.sha256.hexdigest()

        yield stream, digest


class _IdSet:
    """Seen passage ids. wiki-18's 21M ids are decimal integers: those below 2**28 go in a bitmap
    (at most 32 MB) instead of a set of strings (GBs); any other id goes in a set."""

    def __init__(self):
        self._bits = bytearray()
        self._other: set[str] = set()

    def add(self, doc_id: str) -> bool:
        """Add; False when already present."""
        n = int(doc_id) if doc_id.isascii() and doc_id.isdigit() and len(doc_id) < 10 else -1
        if 0 <= n < 1 << 28 and str(n) == doc_id:  # canonical decimal: "07" is another id than "7"
            byte, bit = divmod(n, 8)
            if byte >= len(self._bits):
                self._bits.extend(bytes(max(byte + 1 - len(self._bits), len(self._bits))))
            if self._bits[byte] >> bit & 1:
                return False
            self._bits[byte] |= 1 << bit
            return True
        if doc_id in self._other:
            return False
        self._other.add(doc_id)
        return True


def _check_passage(raw: bytes, path: Path, lineno: int, ids: _IdSet) -> bool:
    """The checks of `selfevo.corpus.iter_corpus`, applied to one line of a stream: False for a blank line
    (Unicode whitespace too, as the reader skips it), which is not copied."""
    obj = parse_json_line(raw, path, lineno)
    if obj is None:
        return False
    doc_id = _require_str(obj, "id", path, lineno)
    _require_str(obj, "contents", path, lineno, allow_empty=True)
    if not ids.add(doc_id):
        raise DataError(path, lineno, f"duplicate id '{doc_id}'")
    return True


def convert_corpus(src: str | os.PathLike, dest: str | os.PathLike,
                   progress: Callable[[int], None] | None = None, every: int = 1_000_000) -> dict[str, Any]:
    """Stream a corpus file (`.jsonl`, `.jsonl.gz`, or a `.zip` holding one `.jsonl`) to `dest` as
    FlashRAG corpus JSONL, validating every line as it goes (errors name the source file and its
    decompressed line). Lines are copied byte for byte (blank lines dropped, a final newline added);
    `dest` appears only when the whole stream was valid."""
    src, dest = Path(src), Path(dest)
    if not src.exists():
        raise DataError(src, None, "file not found")
    ids = _IdSet()
    out_sha = hashlib.sha256()
    n = lineno = 0
    with atomic_writer(dest, "wb") as out:
        try:
            with _open_corpus(src) as (stream, source_digest):
                for lineno, raw in enumerate(stream, start=1):
                    line = raw.rstrip(b"\r\n")
                    if lineno == 1:  # a BOM, as iter_corpus reads past it (not copied: dest is plain UTF-8)
                        line = line.removeprefix(b"\xef\xbb\xbf")
                    if not _check_passage(line, src, lineno, ids):
                        continue
                    line += b"\n"
                    out.write(line)
                    out_sha.update(line)
                    n += 1
                    if progress is not None and n % every == 0:
                        progress(n)
                src_sha = source_digest()
        except (EOFError, zlib.error, zipfile.BadZipFile, gzip.BadGzipFile) as e:
            raise DataError(src, None, f"corrupt or truncated archive after line {lineno} ({e}); delete it "
                                       "and fetch it again") from None
        if n == 0:
            raise DataError(src, None, "corpus is empty")
    return {"passages": n, "sha256": out_sha.hexdigest(), "bytes": dest.stat().st_size, "source_sha256": src_sha}


# ---------------------------------------------------------------- orchestration


def parse_benchmarks(spec: str | Sequence[str] | None) -> list[str]:
    """'nq,hotpotqa' (or a list, or None / 'all') -> benchmark names, in the canonical order."""
    if spec is None:
        return list(BENCHMARKS)
    names = [s.strip().lower() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not names:  # an empty --benchmarks is a slip, not a request for all seven
        raise ValueError(f"--benchmarks: name at least one (or all); known: {', '.join(BENCHMARKS)}")
    if names == ["all"]:
        return list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {', '.join(unknown)} (known: {', '.join(BENCHMARKS)})")
    return [n for n in BENCHMARKS if n in names]


def _load_manifest(out: Path) -> dict[str, Any]:
    path = out / MANIFEST
    if not path.exists():
        return {"format": FORMAT, "files": {}}
    try:
        manifest = read_json(path)
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested past the parser's limit
        raise DataError(path, None, f"unreadable manifest ({e}); delete it to start over") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise DataError(path, None, "not a manifest written by `selfevo data download`; delete it to start over")
    for rel, entry in manifest["files"].items():  # each is read as an object (`_complete`), else a traceback
        if not isinstance(entry, dict):
            raise DataError(path, None, f"files.{rel}: expected an object, got a JSON {type(entry).__name__} "
                                        "(edited by hand?); delete it to start over")
    return manifest


def _complete(out: Path, rel: str, entry: dict | None, request: dict) -> bool:
    """An output is complete when the manifest made it with the same request and it still hashes
    to what the manifest says."""
    if not entry or entry.get("request") != request:
        return False
    path = out / rel
    try:
        if path.stat().st_size != entry.get("bytes"):
            return False
    except OSError:
        return False
    return file_sha256(path) == entry.get("sha256")


def _fetch_first(download: Download, repo_id: str, files: Sequence[str], revision: str | None) -> tuple[str, Path]:
    """Download the first of `files` the repository has."""
    for i, filename in enumerate(files):
        try:
            return filename, Path(download(repo_id, filename, revision))
        except MissingFileError:
            if i == len(files) - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def download_data(
    out: str | os.PathLike,
    benchmarks: str | Sequence[str] | None = None,
    per_benchmark: int = 200,
    seed: int = 0,
    corpus: bool = True,
    revision: str | None = None,
    corpus_revision: str | None = None,
    qa_repo: str = QA_REPO,
    corpus_repo: str = CORPUS_REPO,
    corpus_file: str = CORPUS_FILE,
    download: Download | None = None,
    dry_run: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Fetch, convert, validate and record. Outputs already complete (same request, same sha256 as
    the manifest records) are skipped without touching the network; the manifest is rewritten after
    each output, so an interrupted run keeps what it finished. With `dry_run`, nothing is fetched or
    written: the plan is logged and returned. Raises `DownloadError` (network, missing files),
    `DataError` (malformed data) or `ValueError` (bad arguments)."""
    args = dict(benchmarks=benchmarks, per_benchmark=per_benchmark, seed=seed, corpus=corpus, revision=revision,
                corpus_revision=corpus_revision, qa_repo=qa_repo, corpus_repo=corpus_repo, corpus_file=corpus_file,
                download=download, dry_run=dry_run, log=log)
    if dry_run:
        return _download_data(Path(out), **args)
    # one download into `out` at a time: a second removed the first's temp file under it (the first failed
    # after converting the whole corpus) and rewrote the manifest from its own copy, dropping entries
    with hold_directory(out, lambda: ValueError(f"{out}: another `selfevo data download` is writing here; wait "
                                                "for it to end (or stop it), then rerun")):
        return _download_data(Path(out), **args)


def _download_data(out: Path, benchmarks, per_benchmark, seed, corpus, revision, corpus_revision, qa_repo,
                   corpus_repo, corpus_file, download, dry_run, log) -> dict[str, Any]:
    names = parse_benchmarks(benchmarks)
    if per_benchmark < 0:
        raise ValueError(f"per_benchmark must be >= 0, got {per_benchmark}")
    download = download or hub_download
    manifest = _load_manifest(out)
    files: dict[str, Any] = manifest["files"]
    plan: list[dict[str, Any]] = []

    jobs: list[tuple[str, dict, Callable[[], dict]]] = []
    for name in names:
        bench = BENCHMARKS[name]
        rel = f"qa/{name}.jsonl"
        request = {"format": FORMAT, "repo_id": qa_repo, "files": bench.files(), "revision": revision,
                   "per_benchmark": 0 if bench.keep_all else per_benchmark, "seed": None if bench.keep_all else seed}

        def run_qa(name=name, rel=rel, bench=bench, request=request) -> dict:
            filename, local = _fetch_first(download, qa_repo, bench.files(), revision)
            log(f"converting {qa_repo}/{filename} -> {rel}")
            info = convert_benchmark(local, name, out / rel, per_benchmark, seed)
            source = {"repo_id": qa_repo, "repo_type": "dataset", "filename": filename, "revision": revision,
                      "commit": commit_of(local), "sha256": file_sha256(local)}
            return {"kind": "qa", "benchmark": name, "hop": bench.hop, "split": Path(filename).stem,
                    "subsample": SUBSAMPLE_RULE, **info, "source": source}

        jobs.append((rel, request, run_qa))
    if corpus:
        request = {"format": FORMAT, "repo_id": corpus_repo, "files": [corpus_file], "revision": corpus_revision}

        def run_corpus() -> dict:
            _, local = _fetch_first(download, corpus_repo, [corpus_file], corpus_revision)
            log(f"converting {corpus_repo}/{corpus_file} -> {CORPUS_OUT} (streaming; wiki-18 takes minutes)")
            info = convert_corpus(local, out / CORPUS_OUT, progress=lambda n: log(f"  {n:,} passages"))
            source = {"repo_id": corpus_repo, "repo_type": "dataset", "filename": corpus_file,
                      "revision": corpus_revision, "commit": commit_of(local), "sha256": info.pop("source_sha256")}
            return {"kind": "corpus", **info, "source": source}

        jobs.append((CORPUS_OUT, request, run_corpus))

    for rel, request, run in jobs:
        done = _complete(out, rel, files.get(rel), request)
        repo = request["repo_id"]
        at = f"@{request['revision']}" if request["revision"] else ""
        plan.append({"output": rel, "action": "skip" if done else "fetch", "repo_id": repo,
                     "files": request["files"], "revision": request["revision"]})
        if done:
            log(f"skip {rel}: complete (sha256 matches {MANIFEST})")
            continue
        if dry_run:
            log(f"would fetch {repo}{at}: {' or '.join(request['files'])} -> {out / rel}")
            continue
        # a kill inside an earlier conversion left its temp file beside the output (wiki-18: ~14 GB,
        # never read by anything) or the QA staging file: clear them, as a run's resume does
        dest = out / rel
        remove_leftover_temps(dest.parent, dest.name)
        remove_leftover_temps(dest.parent, _staged(dest).name)  # `..NAME.staged.XXXXXXXX.tmp`: its own name
        _staged(dest).unlink(missing_ok=True)
        entry = run()
        entry["request"] = request
        files[rel] = entry
        manifest["format"] = FORMAT
        write_json(out / MANIFEST, manifest)
        count = f"{entry['items']} of {entry['available']} items" if entry["kind"] == "qa" else \
            f"{entry['passages']:,} passages"
        log(f"wrote {rel}: {count}")

    if not dry_run and names:
        read_qa_dir(out / "qa")  # every QA file of the directory reads back, ids unique across files
    return {"out": str(out), "dry_run": dry_run, "plan": plan, "manifest": None if dry_run else manifest}

