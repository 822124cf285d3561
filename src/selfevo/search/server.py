"""The Search-R1 / verl retrieval API over any `Retriever`.

`POST /retrieve` with `{"queries": [...], "topk": 3, "return_scores": true}` answers
`{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}`, or bare documents
when `return_scores` is false, exactly as Search-R1's `retrieval_server.py` does, so a
Search-R1 or verl trainer can point its `retriever.url` here unchanged.

Departures from Search-R1's server, all on the side of refusing bad input: limits on queries,
query length, topk and body size; every bad request is a 4xx, never a 500; `topk` defaults to 3
(Search-R1 falls back to its launch-time `--topk`, which its scripts set to 3).
"""

from __future__ import annotations

import os
import time
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from selfevo.search.tool import Retriever

MAX_QUERY_CHARS = 2_000
MAX_BODY_BYTES = 1 << 20  # 1 MiB: 256 queries of 2,000 characters fit with room to spare


def _request_model(max_queries: int, max_topk: int) -> type[BaseModel]:
    """The request schema, with this app's limits baked in."""

    class RetrieveRequest(BaseModel):
        # Unknown fields are ignored: Search-R1 clients may send extras we do not use.
        model_config = ConfigDict(extra="ignore")

        queries: list[Annotated[str, StringConstraints(max_length=MAX_QUERY_CHARS)]] = Field(
            min_length=1, max_length=max_queries)
        topk: int = Field(3, ge=1, le=max_topk)
        return_scores: bool = False  # Search-R1's default

    return RetrieveRequest


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over `limit` bytes without reading it all:
    a declared Content-Length is checked first, a chunked body while it streams in."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"request body over {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HTTPException(413, f"request body over {limit} bytes")
    return bytes(body)


def make_app(retriever: Retriever, max_queries: int = 256, max_topk: int = 50,
             max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """A FastAPI app serving `retriever`. The body is parsed by hand (not as a FastAPI body
    parameter) so that its size is capped before any JSON parsing happens."""
    app = FastAPI(title="selfevo retriever", docs_url=None, redoc_url=None)
    request_model = _request_model(max_queries, max_topk)
    n_docs = len(retriever) if hasattr(retriever, "__len__") else None

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "documents": n_docs}

    @app.post("/retrieve")
    async def retrieve(request: Request) -> JSONResponse:
        body = await _read_body(request, max_body_bytes)
        try:
            req = request_model.model_validate_json(body)
        except ValidationError as e:
            # include_input=False: never echo a (possibly huge) offending value back.
            raise HTTPException(422, e.errors(include_url=False, include_input=False,
                                              include_context=False)) from None
        # Retrieval is CPU-bound and synchronous: keep it off the event loop.
        results = await run_in_threadpool(retriever.retrieve, req.queries, req.topk)
        if req.return_scores:
            out = [[{"document": h.document.to_json(), "score": h.score} for h in hits]
                   for hits in results]
        else:
            out = [[h.document.to_json() for h in hits] for hits in results]
        # A plain JSONResponse skips FastAPI's generic encoder: the payload is JSON already.
        return JSONResponse({"result": out})

    return app


def serve(corpus: str | os.PathLike, host: str = "127.0.0.1", port: int = 8000,
          index_dir: str | os.PathLike | None = None) -> None:
    """Build (or load from `index_dir`) a BM25 index over `corpus` and serve it until killed.
    Binds loopback by default: the API has no authentication."""
    import uvicorn
    from rich.console import Console

    from selfevo.search.bm25 import BM25Index

    console = Console()
    start = time.perf_counter()
    with console.status(f"BM25 index for {corpus}"
                        + (f" (cache: {index_dir})" if index_dir else "") + " ..."):
        index = BM25Index.from_corpus_file(corpus, index_dir=index_dir)
    console.print(f"[green]BM25 index ready[/green]: {len(index):,} documents in "
                  f"{time.perf_counter() - start:.1f} s; corpus sha256 {index.corpus_sha256[:12]}")
    console.print(f"serving POST http://{host}:{port}/retrieve and GET /health")
    uvicorn.run(make_app(index), host=host, port=port, log_level="info")
