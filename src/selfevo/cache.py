"""What selfevo keeps in its cache directory (`cache_root()`) and how much of it can go.

Two kinds of entry live there: converted models (`models/<name>`, a GGUF checkpoint dequantized once:
`agents.lm.model.convert_gguf`) and corpus stores (`corpora/<sha256>`, a copy of a corpus file's
documents that a run searching through a /retrieve server reads by id: `search.docstore.corpus_store`).
A store is named by its file's content, so a corpus rewritten leaves the old store behind (for wiki-18,
13 GB); `prune` removes the stores no recorded file holds any more, and what a killed build left.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from selfevo._io import directory_bytes, hold_directory, read_json
from selfevo.search.docstore import OFFSETS_FILE, source_state, store_lock, store_scratch, store_sources

_SHA = re.compile(r"[0-9a-f]{64}")
_MODEL_TMP = re.compile(r"\.(.+)\.tmp-([0-9]+)-[0-9]+")  # convert_gguf's: .NAME.tmp-PID-THREAD
_STORE_SCRATCH = re.compile(r"\.([0-9a-f]{64})\.tmp")  # `store_scratch`'s names


@dataclass(frozen=True)
class Entry:
    kind: str  # "model", "corpus store", or "leftover" (a killed build's)
    path: Path
    bytes: int
    made_from: tuple[tuple[str, str], ...] = ()  # a store's recorded files, each with its `source_state`
    note: str = ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _held(lock: Path) -> bool:
    """Is a store's lock held by a process (building it, or recording a file it was opened from)?"""
    if not lock.is_dir():
        return False
    try:
        with hold_directory(lock, lambda: BlockingIOError()):
            return False
    except BlockingIOError:
        return True


def entries(root: Path, confirm: bool = False) -> list[Entry]:
    """Every entry under `root`, models first, each kind by name. `confirm`: hash a recorded corpus file whose
    time changed but not its size, to tell "same content" from "rewritten" (else "touched")."""
    out: list[Entry] = []
    models = root / "models"
    for p in sorted(models.iterdir()) if models.is_dir() else []:
        if (m := _MODEL_TMP.fullmatch(p.name)) and p.is_dir():
            if not _alive(int(m[2])):  # a conversion in progress is not a leftover
                out.append(Entry("leftover", p, directory_bytes(p), note=f"a killed conversion of {m[1]}"))
        elif (p / "config.json").exists():
            try:
                src = read_json(p / "selfevo-source.json")
                note = f"converted from {src['gguf']} ({src['bytes']:,} bytes)"
            except (OSError, ValueError, KeyError, TypeError):
                note = ""
            out.append(Entry("model", p, directory_bytes(p), note=note))
    corpora = root / "corpora"
    for p in sorted(corpora.iterdir()) if corpora.is_dir() else []:
        if (m := _STORE_SCRATCH.fullmatch(p.name)) and p.is_dir():
            if not _held(store_lock(corpora, m[1])):  # a build in progress holds its lock
                out.append(Entry("leftover", p, directory_bytes(p), note="a killed copy of a corpus"))
        elif _SHA.fullmatch(p.name) and (p / OFFSETS_FILE).exists():
            made_from = tuple((r["path"], source_state(r, p.name, confirm)) for r in store_sources(p))
            out.append(Entry("corpus store", p, directory_bytes(p), made_from,
                             "" if made_from else "made before stores recorded their files"))
    return out


def stale(entry: Entry) -> str | None:
    """Why `prune` removes an entry (judged on states a confirmed `entries` gave), or None to keep it: a
    leftover; a store none of whose recorded files holds its content. A store that records no file is kept
    (made by an older selfevo: nothing says it is unused)."""
    if entry.kind == "leftover":
        return entry.note
    if entry.kind == "corpus store" and entry.made_from and not any(
            state in ("as recorded", "same content") for _, state in entry.made_from):
        return "no file it was made from holds its content: " + ", ".join(f"{p} ({s})" for p, s in entry.made_from)
    return None


def remove(entry: Entry) -> bool:
    """Remove an entry, under its lock for a store (False, nothing removed: a process holds it). A process
    reading a removed store reads on (its files stay open until it closes them); one opening it meanwhile
    builds it again."""
    if entry.kind != "corpus store":
        shutil.rmtree(entry.path)
        return True
    sha, root = entry.path.name, entry.path.parent
    try:
        with hold_directory(store_lock(root, sha), lambda: BlockingIOError()):
            trash = store_scratch(root, sha)  # a name the next build clears: a kill mid-removal leaves no half store
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(entry.path, trash)
            shutil.rmtree(trash)
    except BlockingIOError:
        return False
    return True
