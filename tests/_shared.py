"""Test helpers: where the read-only data beside the repository lives (../shared/data), one place;
a stand-in for the loop where a test checks what evolve does around it."""

from __future__ import annotations

import contextlib
import sys
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


@contextlib.contextmanager
def frequent_thread_switches(seconds: float = 1e-6):
    """Threads switch every `seconds` (the interpreter's switch interval, 5 ms by default): a worker thread
    that wakes another then runs on interleaved with it, so a race in which the worker starts its next
    task before the woken thread stops it is lost far more often than at the default."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@contextlib.contextmanager
def corpus_served_elsewhere(monkeypatch, cache):
    """CORPUS's BM25 index served on loopback (a /retrieve server, as `selfevo serve-retriever` serves one),
    while this process may not open or build an index of it (`evolve._corpus_index` fails the test) and
    keeps its corpus stores in `cache`. Yields the server's URL and the list of every query it was asked."""
    from _servers import serve_app

    from selfevo import evolve as evolve_module
    from selfevo.search.bm25 import BM25Index
    from selfevo.search.server import make_app

    index = BM25Index.from_corpus_file(CORPUS)
    searched = []
    retrieve = index.retrieve
    index.retrieve = lambda queries, *a, **k: searched.extend(queries) or retrieve(queries, *a, **k)

    def no_local_index(*args, **kwargs):
        raise AssertionError("an index was opened or built in this process")

    monkeypatch.setattr(evolve_module, "_corpus_index", no_local_index)
    monkeypatch.setattr(evolve_module, "cache_root", lambda: cache)
    with serve_app(make_app(index)) as url:
        yield url, searched
