"""Small file primitives shared by every room: atomic writes and append-only JSONL logs.

Why: a run is killed at arbitrary points (cluster pre-emption, kill -9). A reader must never see
a half-written file, and an append-only log must survive a torn last line.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock
    fcntl = None

_UMASK = os.umask(0)
os.umask(_UMASK)

_SURROGATE = re.compile("[\ud800-\udfff]")


# the userinfo of an http(s) URL: `user:KEY@`
_CREDENTIALS = re.compile(r"(https?://)[^/@\s]+@", re.IGNORECASE)


def shown_url(text: str) -> str:
    """`text` (a URL, or an agent spec `remote:MODEL@URL`) as records and logs may show it: credentials
    in a URL (`https://user:KEY@host/v1`, which httpx sends as basic auth) become `***`, as the API
    key from the environment is never written."""
    return _CREDENTIALS.sub(r"\1***@", text)


def url_host(address: str) -> str:
    """A bind address as a URL writes it: an IPv6 address in brackets (`http://::1:8000` is no URL)."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def bind_once(family: int, address: tuple) -> None:
    """Bind `address` once as a server binds it (SO_REUSEADDR) and let go: OSError where the port is in use
    or no interface here has the address."""
    import socket

    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)


def encodable(text: str) -> str:
    """A model's text as a file or a request can carry it: a lone surrogate (no character, so no
    UTF-8; a remote endpoint's JSON can escape one) becomes U+FFFD. Kept, it fails every write of it."""
    return _SURROGATE.sub("\ufffd", text)


# a write that failed for want of room: the OSError names no file (it came from write or fsync)
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _named(e: OSError, path: Path) -> OSError:
    """`e` naming `path` where it names no file (a full disk): one line the user can act on."""
    if e.filename is None and e.errno in _NO_ROOM:
        return OSError(e.errno, e.strerror, str(path))
    return e


def fsync_directory(path: str | os.PathLike) -> None:
    """Flush directory `path`'s entries to disk. A rename or a new file is a change to its directory,
    not to the file: without this, after a power cut or an OS crash (not a kill: the kernel has it) the
    file may be back under its old contents or gone, while a later file that names it (a manifest
    naming a checkpoint) survived. A file system that cannot sync a directory is left as it is."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # not POSIX (Windows opens no directory), or gone: nothing to flush here
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):  # some network file systems
            raise
    finally:
        os.close(fd)


def _make_parent(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError as e:  # a file where the directory should be; "File exists" says too little
        raise NotADirectoryError(errno.ENOTDIR, "File exists and is not a directory", e.filename) from None


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "w", fsync: bool = True) -> Iterator[Any]:
    """Write to a temp file beside `path`, then rename over it. On error nothing is left."""
    path = Path(path)
    if path.is_dir():  # refused now, not after the whole file is written (the rename would name the temp file)
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a file", str(path))
    _make_parent(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; the result should read like any new file
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
            yield fh
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        if fsync:  # the rename is durable too, not only the bytes
            fsync_directory(path.parent)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and (named := _named(e, path)) is not e:
            raise named from None
        raise


def json_problem(value: object) -> str | None:
    """Why `value` cannot be written as strict JSON (a set, a NaN, a Path), or None."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def write_all_atomically(files: Mapping[str | os.PathLike, bytes]) -> None:
    """Write every file beside its place, whole and synced, before any is renamed over its place: a write
    that fails (a full disk) changes none of them, where one at a time left, say, a new results.json beside
    an old report.html. Only the renames, which need no space, come last."""
    with contextlib.ExitStack() as stack:
        for path, data in files.items():
            fh = stack.enter_context(atomic_writer(path, "wb"))
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())


@contextlib.contextmanager
def hold_directory(path: str | os.PathLike, busy: Callable[[], BaseException] | None) -> Iterator[None]:
    """Hold directory `path` (made if missing) for this process while it writes there: an exclusive
    `flock` on it, which the kernel drops when the process ends, however (a kill -9 never leaves it
    held). Another holder, in this process or another, makes it raise `busy()`; with `busy` None it
    waits for the holder to end instead (a cache the other process is filling). A directory made here
    and left empty (a start that failed) is removed again, by its holder only: two starters can both
    find it missing, and the one refused would remove the directory the other holds."""
    path = Path(path)
    made = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY)
    held = False
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if busy is not None else 0))
            except BlockingIOError:
                raise busy() from None
        held = True
        yield
    finally:
        if made and held and not any(path.iterdir()):
            with contextlib.suppress(OSError):
                path.rmdir()
        os.close(fd)


def stray_files(directory: str | os.PathLike, mine: Iterable[str]) -> str | None:
    """The first few names in `directory` (if it exists) that a command writing there would not have
    written (`mine`; hidden files are temp files and locks), as text: a command that writes beside
    other files (a run's, a demo's, an index's) could replace one of them. None: none there."""
    directory, mine = Path(directory), set(mine)
    other = sorted(p.name for p in directory.iterdir() if not p.name.startswith(".") and p.name not in mine) \
        if directory.is_dir() else []
    return f"{', '.join(other[:3])}{', ...' if len(other) > 3 else ''}" if other else None


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
    """Append whole lines in one write so a kill leaves at most one torn last line. A write that fails
    (a full disk) is cut back off: the log is left as it was, so a later append is not glued onto part
    of a line (which would make the log corrupt before its last line)."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    if not data:
        return
    path = Path(path)
    _make_parent(path)
    created = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # unbuffered: nothing is left to flush
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:  # one write for a regular file; a short one goes on
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
                if created:  # a new log's name is in its directory, which the file's fsync does not flush
                    fsync_directory(path.parent)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise _named(e, path) from None
    finally:
        os.close(fd)


def cache_root() -> Path:
    """Where selfevo keeps what it makes once and reuses (converted models, corpus stores):
    $SELFEVO_CACHE_DIR, else ~/.cache/selfevo."""
    return Path(os.environ.get("SELFEVO_CACHE_DIR") or Path.home() / ".cache" / "selfevo")


def directory_bytes(path: str | os.PathLike) -> int:
    """Bytes of the files under `path` (a file removed while they are counted is left out: a cache entry
    another process is building or removing)."""
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(d, f)).st_size
    return total


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, read in 4 MiB chunks (corpora are gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def is_path(name: str) -> bool:
    """Does a model name (a hub id, a shipped name or a path) name a path: ./x, ../x, /x, ~/x?"""
    return name.startswith((".", "/", "~"))


def expand_user(path: str | os.PathLike) -> Path:
    """`Path.expanduser`, with a `~user` who has no home here a ValueError naming the path (pathlib
    raises a RuntimeError, which reached the user as a traceback)."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        raise ValueError(f"{path}: no home directory for {str(path).split('/', 1)[0]} here") from None


def absolute(path: str, field: str) -> str:
    """A path setting as a config stores it: `~` expanded, absolute; a `~user` with no home here is a
    ValueError naming the field."""
    try:
        return str(expand_user(path).resolve())
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None


def check_local_path(name: str) -> None:
    """A model or file named by a path (./x, ../x, /x, ~/x) must exist. Loaders that also accept
    hub ids (transformers, sentence-transformers) report a missing directory as a malformed hub
    id, which hides the typo."""
    if not is_path(name):
        return
    try:
        found = expand_user(name).exists()
    except ValueError:  # under the home of no user here
        found = False
    if not found:
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
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):  # RecursionError: absurd nesting
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
