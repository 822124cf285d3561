"""Small file primitives shared by every room: atomic writes and append-only JSONL logs.

Why: a run is killed at arbitrary points (cluster pre-emption, kill -9). A reader must never see
a half-written file, and an append-only log must survive a torn last line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

_UMASK = os.umask(0)
os.umask(_UMASK)

_SURROGATE = re.compile("[\ud800-\udfff]")


def encodable(text: str) -> str:
    """A model's text as a file or a request can carry it: a lone surrogate (no character, so no
    UTF-8; a remote endpoint's JSON can escape one) becomes U+FFFD. Kept, it fails every write of it."""
    return _SURROGATE.sub("\ufffd", text)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "w", fsync: bool = True) -> Iterator[Any]:
    """Write to a temp file beside `path`, then rename over it. On error nothing is left."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; the result should read like any new file
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
            yield fh
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def remove_leftover_temps(directory: str | os.PathLike, name: str = "*", recursive: bool = False) -> None:
    """Remove the temp files a kill inside `atomic_writer` left for `name` (any file: "*") in
    `directory` (and below it, `recursive`): `.NAME.XXXXXXXX.tmp`, never read by anything."""
    directory = Path(directory)
    pattern = f".{name}.*.tmp"
    for tmp in directory.rglob(pattern) if recursive else directory.glob(pattern):
        tmp.unlink(missing_ok=True)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_writer(path) as fh:
        json.dump(obj, fh, indent=2, sort_keys=False)
        fh.write("\n")


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> None:
    with atomic_writer(path) as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def append_jsonl(path: str | os.PathLike, rows: Iterable[dict], fsync: bool = True) -> None:
    """Append whole lines in one write so a kill leaves at most one torn last line."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if not data:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(data)
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, read in 4 MiB chunks (corpora are gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def check_local_path(name: str) -> None:
    """A model or file named by a path (./x, ../x, /x, ~/x) must exist. Loaders that also accept
    hub ids (transformers, sentence-transformers) report a missing directory as a malformed hub
    id, which hides the typo."""
    if name.startswith((".", "/", "~")) and not Path(name).expanduser().exists():
        raise FileNotFoundError(2, "no such file or directory", name)


def read_jsonl_log(path: str | os.PathLike, repair: bool = False) -> list[dict]:
    """Read an append-only log of JSON objects. A torn (unterminated, unparsable) last line is a
    crash artefact: it is dropped, and with `repair=True` truncated from the file so appends
    continue cleanly. A malformed line anywhere else is corruption and raises."""
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    rows: list[dict] = []
    offset = 0
    lines = raw.split(b"\n")
    for i, line in enumerate(lines):
        last = i == len(lines) - 1
        if last and line == b"":
            break
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            if last:  # torn tail: no newline was written after it
                if repair:
                    with open(path, "r+b") as fh:
                        fh.truncate(offset)
                break
            raise ValueError(f"{path}:{i + 1}: corrupt log line") from None
        if not isinstance(row, dict):  # no prefix of an object parses as anything else
            raise ValueError(f"{path}:{i + 1}: corrupt log line (a JSON {type(row).__name__}, not an object)")
        rows.append(row)
        offset += len(line) + 1
        if last and repair:
            # the write stopped just before its newline: the row is whole, so it is kept, but its
            # line is ended, or the next append would be glued onto it
            with open(path, "ab") as fh:
                fh.write(b"\n")
    return rows
