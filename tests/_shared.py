"""Test helper: where the read-only data beside the repository lives (../shared/data), one place."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
QA_DIR = SHARED / "qa"
CORPUS = SHARED / "corpus" / "wiki18-mini.jsonl"
