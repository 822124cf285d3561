"""The manifest every index directory carries, written last on save and checked first on load."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from selfevo._io import read_json

MANIFEST = "manifest.json"


def load_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """A manifest file as a JSON object, or a ValueError naming it (damaged, foreign, not an object)."""
    try:
        manifest = read_json(path)
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: unreadable, not a JSON manifest ({e})") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: expected a JSON object, got a JSON {type(manifest).__name__}")
    return manifest


def read_manifest(index_dir: str | os.PathLike, what: str, format_version: int,
                  kind: str | None = None, fields: tuple[str, ...] = ("corpus_sha256",)) -> dict[str, Any]:
    """The manifest of a `what` index, refusing (ValueError) a missing one, another kind (when
    `kind` is given; BM25 manifests carry none), another format version, or one without `fields`."""
    path = Path(index_dir) / MANIFEST
    if not path.exists():
        raise ValueError(f"{index_dir}: no {MANIFEST}; not a (complete) {what} index")
    manifest = load_manifest(path)
    if kind is not None and manifest.get("kind") != kind:
        raise ValueError(f"{path}: a {manifest.get('kind') or 'bm25'!r} index, not a {what} one")
    if manifest.get("format_version") != format_version:
        raise ValueError(f"{path}: format version {manifest.get('format_version')!r}, "
                         f"this code reads {format_version}")
    missing = [f for f in fields if f not in manifest]
    if missing:
        raise ValueError(f"{path}: field(s) {', '.join(missing)} missing; not a {what} index this code wrote")
    return manifest
