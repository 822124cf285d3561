"""The manifest every index directory carries, written last on save and checked first on load."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from selfevo._io import read_json

MANIFEST = "manifest.json"


def read_manifest(index_dir: str | os.PathLike, what: str, format_version: int,
                  kind: str | None = None) -> dict[str, Any]:
    """The manifest of a `what` index, refusing (ValueError) a missing one, another kind (when
    `kind` is given; BM25 manifests carry none) or another format version."""
    path = Path(index_dir) / MANIFEST
    if not path.exists():
        raise ValueError(f"{index_dir}: no {MANIFEST}; not a (complete) {what} index")
    manifest = read_json(path)
    if kind is not None and manifest.get("kind") != kind:
        raise ValueError(f"{path}: a {manifest.get('kind') or 'bm25'!r} index, not a {what} one")
    if manifest.get("format_version") != format_version:
        raise ValueError(f"{path}: format version {manifest.get('format_version')!r}, "
                         f"this code reads {format_version}")
    return manifest
