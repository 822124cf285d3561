"""Corpora and QA sets on disk: FlashRAG / Search-R1 JSONL, Search-R1 parquet.

Readers stream and validate; every problem is one `DataError` naming the file and line.
Writers are atomic: a failed write leaves the old file (or nothing), never half a file.
"""

from __future__ import annotations

import codecs
import dataclasses
import gzip
import hashlib
import json
import os
import re
import warnings
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from selfevo._io import atomic_writer, file_sha256
from selfevo.records import Document, QAItem


class DataError(ValueError):
    """Malformed input data. `str()` reads `file:line: what is wrong`."""

    def __init__(self, path: str | os.PathLike, line: int | None, message: str):
        # one line whatever a library put in it (pyarrow's messages carry newlines and raw bytes)
        message = "".join(c if c.isprintable() else "?" for c in " ".join(message.split()))
        self.path, self.line, self.message = str(path), line, message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


GZIP_MAGIC = b"\x1f\x8b"  # a gzip stream's first two bytes
# archives and compressions that are not read (their bytes would be "invalid UTF-8 at line 1"), by their first bytes
UNREAD_MAGIC = {b"PK\x03\x04": "zip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}
PARQUET_MAGIC = b"PAR1"
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip")


class _Hashing:
    """A binary file whose bytes, as they are read, go into `digest` too (a gzip stream's compressed ones)."""

    def __init__(self, fh, digest):
        self.fh, self.digest = fh, digest

    def read(self, size: int = -1) -> bytes:
        data = self.fh.read(size)
        self.digest.update(data)
        return data


def iter_json_lines(path: str | os.PathLike, digest=None) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, object) for every non-blank line; bytes are decoded per line so a
    bad byte is reported where it is. `digest` (a hashlib object), if given, takes the file's bytes
    as they are read."""
    path = Path(path)
    if not path.exists():
        raise DataError(path, None, "file not found")
    try:
        fh = open(path, "rb")
    except OSError as e:  # a directory, no permission
        raise DataError(path, None, f"cannot read: {e.strerror}") from None
    with fh:
        head = fh.read(6)
        gzipped = head[:2] == GZIP_MAGIC  # by content, whatever the name: a gzip stream is read through
        kind = next((k for magic, k in UNREAD_MAGIC.items() if head.startswith(magic)), None)
        if kind:
            raise DataError(path, None, f"a {kind} archive, which is not read: unpack it (gzip is read as it is), "
                                        "or convert a FlashRAG download with `selfevo data download`")
        if head.startswith(PARQUET_MAGIC):  # read by name as a QA set only; here its bytes are "invalid UTF-8"
            raise DataError(path, None, "a parquet file, which is read only as a QA set named *.parquet: a corpus is "
                                        "FlashRAG JSONL (gzipped or not)")
        fh.seek(0)
        lines = gzip.GzipFile(fileobj=fh if digest is None else _Hashing(fh, digest)) if gzipped else fh
        lineno = 0
        try:
            for lineno, raw in enumerate(lines, start=1):
                if digest is not None and not gzipped:
                    digest.update(raw)
                if lineno == 1 and raw.startswith(codecs.BOM_UTF8):  # as Windows tools write it
                    raw = raw[len(codecs.BOM_UTF8):]
                obj = parse_json_line(raw, path, lineno)
                if obj is not None:
                    yield lineno, obj
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # a truncated or damaged download
            raise DataError(path, lineno + 1, f"damaged gzip stream: {e}") from None


def parse_json_line(raw: bytes, path: str | os.PathLike, lineno: int) -> dict[str, Any] | None:
    """One JSONL line as an object (None for a blank line), or a DataError naming file and line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(path, lineno, f"invalid UTF-8 at byte {e.start}") from None
    if not text.strip():
        return None
    try:
        # without its line ending: a line cut short is then at fault where it ends, not at "column 1" of
        # the line after
        obj = json.loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        raise DataError(path, lineno, f"malformed JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise DataError(path, lineno, "malformed JSON: nested too deeply") from None
    except ValueError as e:  # an integer of more than 4,300 digits (Python's limit on converting one)
        raise DataError(path, lineno, f"malformed JSON: {e}") from None
    if not isinstance(obj, dict):
        raise DataError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
    if _SURROGATE_ESCAPE.search(text) and not _encodable(obj):
        # valid JSON, but "\ud800" alone is no character: it would fail every later write
        raise DataError(path, lineno, "invalid Unicode: a lone surrogate escape (\\ud800-\\udfff)")
    return obj


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _encodable(obj: Any) -> bool:
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _require_str(obj: dict, key: str, path, lineno, allow_empty: bool = False) -> str:
    if key not in obj:
        raise DataError(path, lineno, f"missing field '{key}'")
    value = obj[key]
    if isinstance(value, int) and not isinstance(value, bool) and key == "id":
        value = str(value)  # numeric ids are common in the wild; they are ids all the same
    if not isinstance(value, str):
        raise DataError(path, lineno, f"field '{key}' must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise DataError(path, lineno, f"field '{key}' is empty")
    return value


# ---------------------------------------------------------------- corpora


def iter_corpus(path: str | os.PathLike, digest=None) -> Iterator[Document]:
    """Stream a FlashRAG corpus (`{"id","contents"}` per line). Duplicate ids are an error. `digest`:
    as `iter_json_lines`'s."""
    seen: set[str] = set()
    for lineno, obj in iter_json_lines(path, digest):
        doc_id = _require_str(obj, "id", path, lineno)
        contents = _require_str(obj, "contents", path, lineno, allow_empty=True)
        if doc_id in seen:
            raise DataError(path, lineno, f"duplicate id '{doc_id}'")
        seen.add(doc_id)
        yield Document.from_contents(doc_id, contents)


def corpus_documents(path: str | os.PathLike, sha256: str | None = None) -> Iterator[Document]:
    """`iter_corpus`, refusing (DataError, once the stream ends) a file that holds no document, and,
    given the `sha256` an index will record for it, one whose bytes as read were another file's: a
    corpus rewritten while it was indexed would be recorded as the new one, its passages the old."""
    digest = None if sha256 is None else hashlib.sha256()
    empty = True
    for doc in iter_corpus(path, digest):
        empty = False
        yield doc
    if empty:
        raise DataError(path, None, "corpus is empty")
    if digest is not None and digest.hexdigest() != sha256:
        raise DataError(path, None, f"changed while it was read (sha256 {sha256[:12]}… before, "
                                    f"{digest.hexdigest()[:12]}… as read); index a file that stays put")


def count_lines(path: str | os.PathLike) -> int | None:
    """Lines in a file, read in 16 MiB chunks and never parsed: a corpus's document count, for a
    progress bar's total (a blank line counts too). None for a gzip stream: its compressed bytes'
    line breaks are not its lines, and counting those would mean decompressing it."""
    lines, last = 0, b"\n"
    with open(path, "rb") as fh:
        if fh.read(2) == GZIP_MAGIC:
            return None
        fh.seek(0)
        while chunk := fh.read(1 << 24):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return lines + (last != b"\n")


def read_corpus(path: str | os.PathLike) -> list[Document]:
    return list(corpus_documents(path))


def write_corpus(path: str | os.PathLike, docs: Iterable[Document]) -> int:
    n = 0
    with atomic_writer(path) as fh:
        for doc in docs:
            fh.write(json.dumps(doc.to_json(), ensure_ascii=False) + "\n")
            n += 1
    return n


# ---------------------------------------------------------------- QA sets


def _qa_item(obj: dict, path, lineno, default_benchmark: str | None) -> QAItem:
    item_id = _require_str(obj, "id", path, lineno)
    question = _require_str(obj, "question", path, lineno)
    golds = obj.get("golden_answers")
    if golds is None:  # Search-R1 parquet nests the target under reward_model.ground_truth
        reward_model = obj.get("reward_model") or {}
        if not isinstance(reward_model, dict):
            raise DataError(path, lineno, "field 'reward_model' must be an object")
        truth = reward_model.get("ground_truth") or {}
        if not isinstance(truth, dict):
            raise DataError(path, lineno, "field 'reward_model.ground_truth' must be an object")
        golds = truth.get("target")
    if golds is None:
        raise DataError(path, lineno, "missing field 'golden_answers'")
    if isinstance(golds, str):
        golds = [golds]
    golds = list(golds) if not isinstance(golds, (dict, bytes)) and hasattr(golds, "__iter__") else golds
    if not isinstance(golds, list):
        raise DataError(path, lineno, "field 'golden_answers' must be a list of strings")
    if not all(isinstance(g, str) for g in golds):
        raise DataError(path, lineno, "field 'golden_answers' must hold only strings")
    if not any(g.strip() for g in golds):
        raise DataError(path, lineno, "field 'golden_answers' is empty")
    metadata = obj.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise DataError(path, lineno, "field 'metadata' must be an object")
    metadata = dict(metadata)
    if metadata.get("benchmark", "") is None:  # how a parquet struct holds a field one row lacks
        del metadata["benchmark"]
    if "benchmark" not in metadata:
        bench = obj.get("data_source") or default_benchmark
        if bench:
            metadata["benchmark"] = bench
    if "benchmark" in metadata:
        field = ("metadata.benchmark" if (obj.get("metadata") or {}).get("benchmark") is not None
                 else "data_source" if obj.get("data_source") else None)  # None: the file's name
        if not isinstance(metadata["benchmark"], str):
            raise DataError(path, lineno, f"field '{field}' must be a string")
        if metadata["benchmark"] != metadata["benchmark"].strip():  # "nq " would be a benchmark beside "nq"
            where = f"field '{field}'" if field else "the file's name, the benchmark of its rows,"
            raise DataError(path, lineno, f"{where} has spaces around it: {metadata['benchmark']!r}")
    return QAItem(item_id, question, tuple(g for g in golds if g.strip()), metadata)


def _iter_parquet_rows(path: Path) -> Iterator[tuple[int, dict]]:
    import pyarrow.parquet as pq

    try:
        # to_pylist decodes the strings: a damaged page can hold bytes that are not UTF-8
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for a broken file
        raise DataError(path, None, f"unreadable parquet: {e}") from None
    for i, row in enumerate(rows, start=1):
        if "id" not in row or row["id"] is None:
            extra = row.get("extra_info") or {}
            index = extra.get("index") if isinstance(extra, dict) else None
            row["id"] = str(index if index is not None else i - 1)
        yield i, row  # "line" of a parquet file = 1-based row number


QA_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


def qa_name(path: str | os.PathLike) -> str:
    """A QA file's benchmark name when its rows name none: the file name without its suffix."""
    name = Path(path).name
    return next((name[:-len(s)] for s in QA_SUFFIXES if name.endswith(s)), Path(path).stem)


def iter_qa(path: str | os.PathLike) -> Iterator[QAItem]:
    """Stream a QA set: FlashRAG JSONL (gzipped or not), or Search-R1 parquet (rows reported as lines).

    Ids are unique within a file. A parquet file of several benchmarks whose ids repeat across them
    (Search-R1's merged test.parquet: FlashRAG's `test_0` is in four of its seven, and so is an id
    made from `extra_info.index`) has every id qualified as `<benchmark>-<id>`, unless it already
    starts so: the ids `selfevo data download` writes. (FlashRAG's JSONL is one file a benchmark.)
    """
    return (item for _, item in _iter_qa_lines(path))


def _iter_qa_lines(path: str | os.PathLike) -> Iterator[tuple[int, QAItem]]:
    """`iter_qa`, with the line (parquet: row) of every item."""
    path = Path(path)
    parquet = path.suffix == ".parquet"
    rows = _iter_parquet_rows(path) if parquet else iter_json_lines(path)
    items: Iterable[tuple[int, QAItem]] = (
        (lineno, _qa_item(obj, path, lineno, default_benchmark=qa_name(path))) for lineno, obj in rows)
    if parquet:  # its rows are in memory already
        items = list(items)
        bench_of: dict[str, str | None] = {}
        if any(bench_of.setdefault(it.id, it.benchmark) != it.benchmark for _, it in items):
            items = [(lineno, it if it.id.startswith(f"{it.benchmark}-") else
                      dataclasses.replace(it, id=f"{it.benchmark}-{it.id}")) for lineno, it in items]
    from selfevo.evaluate import scorable  # it imports this module

    seen: dict[str, int] = {}
    unscorable: list[tuple[int, str]] = []
    for lineno, item in items:
        if item.id in seen:
            raise DataError(path, lineno, f"duplicate id '{item.id}' (first on line {seen[item.id]})")
        seen[item.id] = lineno
        if not scorable(item.golden_answers):  # counted in every average, right for no answer: left out, said
            unscorable.append((lineno, item.golden_answers[0]))
            continue
        yield lineno, item
    if unscorable:
        (line, gold), n = unscorable[0], len(unscorable)
        warnings.warn(f"{path}: {n} item(s) left out whose every gold answer normalises to nothing, so that no "
                      f"answer could score (line {line}: {gold!r}: articles and punctuation only)", stacklevel=2)


def read_qa(path: str | os.PathLike) -> list[QAItem]:
    return list(iter_qa(path))


def qa_files(data_dir: str | os.PathLike) -> list[Path]:
    """The QA files of a directory, in the order `read_qa_dir` reads them."""
    return sorted(p for p in Path(data_dir).iterdir() if p.name.endswith(QA_SUFFIXES))


def qa_sha256(data_dir: str | os.PathLike) -> str:
    """The sha256 of a QA directory's files (names and bytes): what a run's evaluations were asked."""
    h = hashlib.sha256()
    for path in qa_files(data_dir):
        h.update(path.name.encode() + b"\0" + file_sha256(path).encode())
    return h.hexdigest()


def unread_benchmark(path: Path) -> bool:
    """Is a file of a QA directory that `qa_files` does not read named or made like a benchmark: a QA
    suffix in another case (popqa.JSONL), a compressed file (gzip is read as *.jsonl.gz only), or JSON
    Lines of questions named *.json (as Dataset.to_json names them)? Other files (a score.json, a README)
    are not."""
    name = path.name.lower()
    if name.endswith(QA_SUFFIXES):
        return True
    if name.endswith(COMPRESSED):  # hotpotqa.json.gz (Dataset.to_json's), musique.jsonl.bz2, nq.zip: not opened
        return True
    if not name.endswith(".json") or not path.is_file():
        return False
    with open(path, "rb") as fh:  # (a line read up to 1 MiB: a one-line JSON document of gigabytes is none)
        first = next((line for line in iter(lambda: fh.readline(1 << 20), b"") if line.strip()), b"")
    try:
        obj = json.loads(first)
    except ValueError:  # a pretty-printed JSON document, not JSON Lines
        return False
    return isinstance(obj, dict) and "question" in obj


def read_qa_dir(data_dir: str | os.PathLike) -> dict[str, list[QAItem]]:
    """Every QA file of a directory, grouped by benchmark name (`metadata.benchmark`, else the
    file stem). Ids must be unique across the whole directory."""
    data_dir = Path(data_dir)
    files = qa_files(data_dir)
    for p in sorted(set(data_dir.iterdir()) - set(files)):
        if unread_benchmark(p):  # it would drop out of every average without a word
            raise DataError(p, None, "in a QA directory but not read: QA files are named *.jsonl, *.jsonl.gz or "
                                     "*.parquet (lower case, gzip the only compression); rename or convert it, or "
                                     "move it out of the directory")
    if not files:
        raise DataError(data_dir, None, "no .jsonl, .jsonl.gz or .parquet QA files found")
    out: dict[str, list[QAItem]] = {}
    origin: dict[str, tuple[Path, int]] = {}  # id -> file and line
    for f in files:
        items = list(_iter_qa_lines(f))
        if not items:  # a benchmark that silently drops out would change the macro average
            raise DataError(f, None, "no questions (an empty QA file; a truncated download?)")
        for lineno, item in items:
            if item.id in origin:
                raise DataError(f, lineno, "id '{}' also appears in {}:{}".format(item.id, *origin[item.id]))
            origin[item.id] = f, lineno
            out.setdefault(item.benchmark or qa_name(f), []).append(item)
    from selfevo.evaluate import BENCHMARKS  # it imports this module

    for name in out:  # "NQ" beside "nq" would be a benchmark of its own, in macro but in no hop group
        standard = next((b for b in BENCHMARKS if b == name.lower() and b != name), None)
        if standard:
            raise DataError(*origin[out[name][0].id], f"benchmark {name!r} differs from the standard "
                            f"{standard!r} only in case; name it {standard!r} (metadata.benchmark, or the file name)")
    return out


def write_qa(path: str | os.PathLike, items: Iterable[QAItem]) -> int:
    """Write FlashRAG JSONL, or Search-R1 parquet when the path ends in `.parquet`."""
    path = Path(path)
    items = list(items)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = [
            {
                "id": it.id,
                "question": it.question,
                "golden_answers": list(it.golden_answers),
                "data_source": it.benchmark or path.stem,
                "reward_model": {"style": "rule", "ground_truth": {"target": list(it.golden_answers)}},
            }
            for it in items
        ]
        with atomic_writer(path, "wb") as fh:
            pq.write_table(pa.Table.from_pylist(rows), fh)
        return len(items)
    with atomic_writer(path) as fh:
        for it in items:
            fh.write(json.dumps(it.to_json(), ensure_ascii=False) + "\n")
    return len(items)
