"""Shared pieces of the project's HTTP servers (the retriever, the model/judge server)."""

from __future__ import annotations

from fastapi import HTTPException, Request


async def read_body(request: Request, limit: int) -> bytes:
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
