"""The synthetic world with exact truth (the embedded default).

`make_world` generates it; `save_world` / `load_world` write and read a world directory:
`corpus.jsonl` (FlashRAG corpus), `qa/<benchmark>.jsonl` (FlashRAG QA), `truth.json`, `world.json`.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from selfevo._io import _UMASK, read_json, write_json
from selfevo.corpus import read_corpus, read_qa_dir, write_corpus, write_qa

if TYPE_CHECKING:
    from selfevo.world.generate import World

_LAZY = {"SIZES": "generate", "World": "generate", "WorldConfig": "generate", "make_world": "generate",
         "Truth": "truth"}


def __getattr__(name: str):
    # Lazy, so that importing the world's language (what agents may read) does not load the
    # world's truth and generator into the agents' process at all.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"selfevo.world.{_LAZY[name]}"), name)
    raise AttributeError(name)

__all__ = ["SIZES", "World", "WorldConfig", "WorldError", "load_world", "make_world", "resolve_world", "save_world",
           "world_fingerprint"]


class WorldError(ValueError):
    """A world that cannot be made or read (bad spec, missing or broken world directory)."""


def save_world(world: World, out: str | os.PathLike) -> Path:
    """Write the world to `out`, which must be missing or empty: the files go to a directory beside it,
    renamed onto it whole. A kill leaves no half world at `out`, and of two writers to one `out`
    the second is refused (WorldError), never mixed into the first's world or replacing it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        os.chmod(tmp, 0o777 & ~_UMASK)  # mkdtemp makes 0700; the world should read like any new directory
        write_corpus(tmp / "corpus.jsonl", world.documents)
        for bench, items in world.benchmarks.items():
            write_qa(tmp / "qa" / f"{bench}.jsonl", items)
        write_json(tmp / "truth.json", world.truth.to_json())
        write_json(tmp / "world.json", {"format": 1, "config": asdict(world.config)})
        try:
            os.rename(tmp, out)  # onto a missing or empty directory only
        except OSError as e:
            if e.errno == errno.ENOTDIR:
                raise WorldError(f"{out}: a file, not a directory") from None
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise WorldError(f"{out}: not empty (another `world make` wrote there?); a world is written once, "
                                 "to a new directory") from None
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _require_world_dir(path: Path) -> None:
    if not (path / "world.json").exists():
        raise WorldError(f"{path}: not a world directory (no world.json); make one with `selfevo world make`"
                         " or use --world small|default")


def load_world(path: str | os.PathLike) -> World:
    from selfevo.world.generate import World, WorldConfig
    from selfevo.world.truth import Truth

    path = Path(path)
    _require_world_dir(path)
    name = "world.json"  # the file a failure is in, named in its error
    try:
        meta = read_json(path / name)
        config = WorldConfig(**meta["config"])
        name = "truth.json"
        truth = Truth.from_json(read_json(path / name))
    except (OSError, ValueError, TypeError, KeyError) as e:  # JSONDecodeError is a ValueError
        raise WorldError(f"{path}: broken world directory: {name}: {type(e).__name__}: {e}") from None
    if not (path / "qa").is_dir():  # else read_qa_dir's bare FileNotFoundError
        raise WorldError(f"{path}: broken world directory (no qa/ directory of benchmarks)")
    return World(config, read_corpus(path / "corpus.jsonl"), read_qa_dir(path / "qa"), truth)


def world_fingerprint(path: str | os.PathLike) -> str:
    """sha256 over a world directory's files (names and bytes): what a run made on it records, so
    that an audit or resume on a world since rewritten is refused instead of judged by other truth."""
    path = Path(path)
    _require_world_dir(path)  # else a mistyped --world is reported as a missing corpus.jsonl
    h = hashlib.sha256()
    for f in sorted([path / "world.json", path / "truth.json", path / "corpus.jsonl", *(path / "qa").glob("*.jsonl")]):
        h.update(f.relative_to(path).as_posix().encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()


def resolve_world(spec: str, **params) -> World:
    """`small` / `default` generate a world (params: seed, confusable_rate, shared_misreading,
    value_skew); anything else is a world directory."""
    from selfevo.world.generate import SIZES, WorldConfig, make_world

    if spec in SIZES:
        return make_world(WorldConfig(size=spec, **params))
    if params:  # they were ignored: the world was the directory's, made with its own
        raise WorldError(f"{spec}: a world directory has the parameters it was made with (its world.json); "
                         f"{', '.join(sorted(params))} are for a generated world (small, default)")
    return load_world(spec)
