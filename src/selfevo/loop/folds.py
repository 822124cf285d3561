"""Permanent source-level fold assignment (CrossFit's unit of cross-fitting is the source)."""

from __future__ import annotations

import hashlib


def fold_of(source_id: str, seed: int, k: int = 2) -> int:
    """Stable fold of a source document: a hash of (seed, source id), never of the question."""
    if k < 2:
        raise ValueError(f"folds: k must be >= 2, got {k}")
    h = hashlib.blake2b(f"{seed}\x1f{source_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % k
