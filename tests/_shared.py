"""Test helpers: where the read-only data beside the repository lives (../shared/data), one place;
a stand-in for the loop where a test checks what evolve does around it."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
QA_DIR = SHARED / "qa"
CORPUS = SHARED / "corpus" / "wiki18-mini.jsonl"


def loop_that_trains_nothing(cfg, env, tool, folds, evaluate, **kwargs):
    """For `evolve`'s `build_loop` (monkeypatched) where the language model is not what is checked:
    a loop that trains nothing, whose main solver (the retrieval baseline) loads no model."""
    from types import SimpleNamespace

    from selfevo.agents.baseline import RetrievalBaseline

    main = RetrievalBaseline()
    return SimpleNamespace(main=main, run=lambda *a, **k: None, evaluate_main=lambda r: evaluate(main, r))
