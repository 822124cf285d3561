"""The Search-R1 / verl retrieval API over any `Retriever`.

`POST /retrieve` with `{"queries": [...], "topk": 3, "return_scores": true}` answers
`{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}`, or bare documents
when `return_scores` is false, exactly as Search-R1's `retrieval_server.py` does, so a
Search-R1 or verl trainer can point its `retriever.url` here unchanged.

Departures from Search-R1's server, all on the side of refusing bad input: limits on queries,
query length, topk and body size; every bad request is a 4xx, never a 500; a body that does not
arrive within `timeout_s` is a 408 and a retrieval that does not finish within it a 504, so no
request holds a connection forever; `topk` defaults to 3 (Search-R1 falls back to its launch-time
`--topk`, which its scripts set to 3).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from selfevo._http import read_body
from selfevo._io import url_host
from selfevo._threads import DaemonThreads
from selfevo.search.tool import MAX_QUERY_CHARS, SERVER_TIMEOUT_S, Retriever

if TYPE_CHECKING:
    from selfevo.search.index import DenseOptions

# Search-R1's trainer sends every search of a turn, over the whole rollout batch (train batch x
# n_agent, 512 x 5 in its scripts), in one request: 4,096 queries by default
MAX_QUERIES = 4096
# the body room a query of MAX_QUERY_CHARS characters may take in JSON: 12 bytes a character outside
# the BMP escaped as Python's and most clients' JSON writes it ("\ud83d\ude00"), then its quotes, comma
# and some indentation
QUERY_BYTES = 12 * MAX_QUERY_CHARS + 64
ENVELOPE_BYTES = 4096  # the rest of a request: {"queries": [...], "topk": ..., "return_scores": ...}


def body_cap(max_queries: int) -> int:
    """The largest body a request of `max_queries` queries within the caps can need (94 MiB at 4,096)."""
    return max_queries * QUERY_BYTES + ENVELOPE_BYTES


TIMEOUT_S = SERVER_TIMEOUT_S  # for the body to arrive, and again for the retrieval to finish


def _request_model(max_queries: int, max_topk: int) -> type[BaseModel]:
    """The request schema, with this app's limits baked in."""

    class RetrieveRequest(BaseModel):
        # Unknown fields are ignored: Search-R1 clients may send extras we do not use.
        model_config = ConfigDict(extra="ignore")

        # empty: a turn in which no trajectory searched, which Search-R1's trainer still posts
        queries: list[Annotated[str, StringConstraints(max_length=MAX_QUERY_CHARS)]] = Field(
            max_length=max_queries)
        topk: int = Field(3, ge=1, le=max_topk)
        return_scores: bool = False  # Search-R1's default

    return RetrieveRequest


def make_app(retriever: Retriever, max_queries: int = MAX_QUERIES, max_topk: int = 50,
             max_body_bytes: int | None = None, timeout_s: float = TIMEOUT_S) -> FastAPI:
    """A FastAPI app serving `retriever`. The body is parsed by hand (not as a FastAPI body
    parameter) so that its size is capped before any JSON parsing happens: at `body_cap(max_queries)`
    unless `max_body_bytes` says otherwise."""
    max_body_bytes = body_cap(max_queries) if max_body_bytes is None else max_body_bytes
    # retrievals on daemon threads (as many as asyncio's default pool has): one a request gave up on (below)
    # does not hold up the server's exit, where Ctrl-C waited for it to finish, however long that took
    retrievals = DaemonThreads(min(32, (os.cpu_count() or 1) + 4), thread_name_prefix="retrieve")
    app = FastAPI(title="selfevo retriever", docs_url=None, redoc_url=None)
    request_model = _request_model(max_queries, max_topk)
    n_docs = len(retriever) if hasattr(retriever, "__len__") else None

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "documents": n_docs}

    @app.post("/retrieve")
    async def retrieve(request: Request) -> JSONResponse:
        try:
            body = await asyncio.wait_for(read_body(request, max_body_bytes), timeout_s)
        except asyncio.TimeoutError:  # a client trickling its body in
            raise HTTPException(408, f"request body not received within {timeout_s:g} s") from None
        try:
            req = request_model.model_validate_json(body)
        except ValidationError as e:
            # include_input=False: never echo a (possibly huge) offending value back.
            raise HTTPException(422, e.errors(include_url=False, include_input=False,
                                              include_context=False)) from None
        # Retrieval is CPU-bound and synchronous: keep it off the event loop, in a worker thread
        # that the request stops waiting for after timeout_s (a thread cannot be killed: a stuck
        # retrieval finishes, or not, in the background while the server keeps answering).
        if not req.queries:
            return JSONResponse({"result": []})  # as Search-R1's server answers it
        loop = asyncio.get_running_loop()
        try:
            results = await asyncio.wait_for(
                loop.run_in_executor(retrievals, retriever.retrieve, req.queries, req.topk), timeout_s)
        except asyncio.TimeoutError:
            # Retry-After: a client that retries at once (ours retries a 504: a proxy's is worth it)
            # started another slow retrieval beside the abandoned one, which still holds its thread
            raise HTTPException(504, f"retrieval did not finish within {timeout_s:g} s",
                                headers={"Retry-After": str(math.ceil(timeout_s))}) from None
        if req.return_scores:
            out = [[{"document": h.document.to_json(), "score": h.score} for h in hits]
                   for hits in results]
        else:
            out = [[h.document.to_json() for h in hits] for hits in results]
        # A plain JSONResponse skips FastAPI's generic encoder: the payload is JSON already.
        return JSONResponse({"result": out})

    return app


def serve(corpus: str | os.PathLike | None = None, host: str = "127.0.0.1", port: int = 8000,
          index_dir: str | os.PathLike | None = None, retriever: str | None = None,
          index: str | os.PathLike | None = None, options: DenseOptions | None = None,
          max_queries: int = MAX_QUERIES) -> None:
    """Serve a saved index directory `index` of any kind (bm25, dense, hybrid; checked against
    `corpus` when given), or build an index of kind `retriever` (default bm25) over `corpus`
    (cached in `index_dir`), and answer `/retrieve` until killed. `options` choose the encoder
    of a dense or hybrid index. Binds loopback by default: the API has no authentication."""
    import uvicorn
    from rich.console import Console
    from rich.markup import escape

    from selfevo.search.index import get_retriever, index_kind

    console = Console()
    kind = index_kind(index) if index is not None else (retriever or "bm25")
    source = index if index is not None else corpus
    start = time.perf_counter()
    # A plain line, not a spinner: building a dense index shows its own progress bar.
    console.print(escape(f"{kind} index for {source}"  # paths the user named: brackets are no markup
                         + (f" (cache: {index_dir})" if index_dir and index is None else "") + " ..."))
    searcher = get_retriever(corpus=corpus, index=index, kind=retriever, cache_dir=index_dir,
                             options=options, progress=True)
    console.print(f"[green]{kind} index ready[/green]: {len(searcher):,} documents in "
                  f"{time.perf_counter() - start:.1f} s; corpus sha256 {searcher.corpus_sha256[:12]}")
    console.print(f"serving POST http://{url_host(host)}:{port}/retrieve and GET /health")
    uvicorn.run(make_app(searcher, max_queries=max_queries), host=host, port=port,
                log_level="info")
