"""The search tool an agent calls: a retriever behind a per-trajectory call budget.

Every agent (sim, LM, retrieval baseline) and every evaluation gets its searches through this
one class, so the tool budget is identical for every row of a results table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from selfevo._io import encodable
from selfevo.records import Document


@dataclass(frozen=True)
class Hit:
    document: Document
    score: float


class Retriever(Protocol):
    """Anything that maps queries to ranked documents: a local BM25 index, a remote server."""

    def retrieve(self, queries: Sequence[str], topk: int = 3) -> list[list[Hit]]: ...


MAX_QUERY_CHARS = 2_000  # the /retrieve server's cap (search/server.py); longer queries are cut here
SERVER_TIMEOUT_S = 30.0  # the /retrieve server's limit on a request's body, and again on its retrieval


def clip_query(query: str) -> str:
    """A query as every retriever sees it: at most MAX_QUERY_CHARS characters, so a model that writes
    a runaway query gets the same hits from a local index and from a `/retrieve` server (which would
    refuse it with a 422 and end the whole batch). A lone surrogate (no character: not encodable as
    UTF-8, so not sendable) becomes U+FFFD, for the same reason."""
    return encodable(query[:MAX_QUERY_CHARS])


def check_queries(queries: Sequence[str]) -> Sequence[str]:
    """`queries` as a retriever takes them: a sequence of strings. One string alone was searched as its
    characters (a list of empty results, one a character)."""
    if isinstance(queries, str):
        raise TypeError(f"queries: a list of query strings, got one string ({queries[:40]!r}): pass [query]")
    return queries


class SearchBudgetExhausted(RuntimeError):
    """Raised when a trajectory asks for more searches than its budget allows."""


class SearchTool:
    """Budgeted access to a retriever, with an LRU cache of results.

    The cache matters for the sim backend: thousands of rollouts issue the same few queries, and
    retrieval is deterministic, so a repeated query must not cost a second index lookup.
    """

    def __init__(self, retriever: Retriever, topk: int = 3, max_calls: int = 5,
                 cache_size: int = 200_000):
        if topk < 1 or max_calls < 0:
            raise ValueError("topk must be >= 1 and max_calls >= 0")
        self.retriever, self.topk, self.max_calls = retriever, topk, max_calls
        self._cache: OrderedDict[str, list[Hit]] = OrderedDict()
        self._cache_size = cache_size
        self.queries_issued = 0  # index lookups actually made (cache misses)
        self.calls = 0  # searches agents made (hits + misses)

    def session(self) -> SearchSession:
        """A fresh budget for one trajectory."""
        return SearchSession(self)

    def lookup(self, queries: Sequence[str]) -> list[list[Hit]]:
        """Unbudgeted, cached batch lookup (the session enforces the budget)."""
        # the common case is one query already cached (the sim's rollouts): nothing but this scan
        missing = [q for q in check_queries(queries) if q not in self._cache]
        if missing:
            missing = list(dict.fromkeys(missing))
            results = self.retriever.retrieve([clip_query(q) for q in missing], topk=self.topk)
            self.queries_issued += len(missing)
            for q, hits in zip(missing, results):
                self._cache[q] = hits
        out = []
        for q in queries:
            self._cache.move_to_end(q)
            out.append(self._cache[q])
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        self.calls += len(queries)
        return out


class SearchSession:
    """One trajectory's view of the tool: at most `max_calls` searches."""

    def __init__(self, tool: SearchTool):
        self.tool = tool
        self.calls_left = tool.max_calls
        self.queries: list[str] = []

    def search(self, query: str) -> list[Hit]:
        if self.calls_left <= 0:
            raise SearchBudgetExhausted(f"search budget of {self.tool.max_calls} calls used up")
        self.calls_left -= 1
        self.queries.append(query)
        return self.tool.lookup([query])[0]
