"""An OpenAI-compatible chat server over any `ChatModel`.

    POST /v1/chat/completions   {"model", "messages", "temperature", "top_p", "max_tokens", "n",
                                 "seed", "stop", "response_format"} -> a `chat.completion` object
    GET  /v1/models             the model served (under its served names, if given)
    GET  /health

Enough of the OpenAI API for the official `openai` client, vLLM-style callers and selfevo's own
judge. Departures, all on the side of refusing: no streaming (400), caps on body size, messages,
`max_tokens` and `n`, no prompt as long as the model's context (400), no messages the model's chat
template refuses (400, with its reason); content must be a string (no
list of parts) and the role system, user or assistant; every bad request is a 4xx, never a 500 (a
5xx is a model failure, which the scripted model injects on purpose). A `max_tokens` within the
request cap but above the model's own budget (or what its context leaves after the prompt) is clamped
by the model (finish_reason "length"), as servers with a context limit do.
Binds loopback by default; with `api_key` set, requests need `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import hmac
import threading
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from selfevo._http import read_body
from selfevo._io import url_host
from selfevo.agents.lm.model import ChatModel, GarbageBody, ModelFault

MAX_BODY_BYTES = 4 << 20  # 4 MiB
MAX_MESSAGES = 64
MAX_CONTENT_CHARS = 200_000
MAX_STOP = 4  # OpenAI's limit on `stop` strings
MAX_STOP_CHARS = 256

StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS)]


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")  # json_schema carries a schema we do not enforce
    type: Literal["text", "json_object", "json_schema"] = "text"


def _request_model(max_tokens_cap: int, max_n: int) -> type[BaseModel]:
    class ChatRequest(BaseModel):
        # Unknown fields (user, logprobs, ...) are ignored, as OpenAI-compatible servers do.
        model_config = ConfigDict(extra="ignore")
        model: str | None = None
        messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
        temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default
        top_p: float = Field(1.0, gt=0.0, le=1.0)
        max_tokens: int | None = Field(None, ge=1, le=max_tokens_cap)
        max_completion_tokens: int | None = Field(None, ge=1, le=max_tokens_cap)
        n: int = Field(1, ge=1, le=max_n)
        # torch.manual_seed takes [-2**63, 2**64): outside it the model would fail (a 500, retried)
        seed: int | None = Field(None, ge=-(2**63), lt=2**64)
        # a string or up to 4; the reply ends before the first one found (which is not returned)
        stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
        stream: bool = False
        response_format: ResponseFormat | None = None

    return ChatRequest


def make_app(model: ChatModel, max_body_bytes: int = MAX_BODY_BYTES, max_tokens_cap: int = 32_768,
             max_n: int = 8, default_max_tokens: int = 256, api_key: str | None = None,
             served_names: Sequence[str] = ()) -> FastAPI:
    """The chat API over `model`. Without `served_names` a request may name any model and gets this
    one (as llama.cpp's server does); with them, as vLLM's `--served-model-name`, a request naming
    another model is a 404 saying which it serves, so a client configured for the wrong model fails
    at its first call instead of collecting another model's answers."""
    app = FastAPI(title="selfevo chat model", docs_url=None, redoc_url=None)
    names = list(served_names) or [model.name]
    request_model = _request_model(max_tokens_cap, max_n)
    created = int(time.time())

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise HTTPException(401, "missing or wrong API key")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": model.name}

    @app.get("/v1/models")
    def models(request: Request) -> dict[str, Any]:
        check_key(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                             "owned_by": "selfevo"} for name in names]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        check_key(request)
        body = await read_body(request, max_body_bytes)
        try:
            req = request_model.model_validate_json(body)
        except ValidationError as e:
            raise HTTPException(422, e.errors(include_url=False, include_input=False,
                                              include_context=False)) from None
        if req.stream:
            raise HTTPException(400, "streaming is not supported; send stream=false")
        if served_names and req.model is not None and req.model not in served_names:
            return JSONResponse({"error": {"message": f"The model `{req.model}` does not exist; this server "
                                           f"serves {', '.join(served_names)}", "type": "NotFoundError",
                                           "code": 404}}, status_code=404)
        max_tokens = req.max_completion_tokens or req.max_tokens or default_max_tokens
        json_mode = req.response_format is not None and req.response_format.type != "text"
        messages = [m.model_dump() for m in req.messages]
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        try:
            # generation is CPU-bound and synchronous: keep it off the event loop
            comps = await run_in_threadpool(model.generate, messages, temperature=req.temperature,
                                            top_p=req.top_p, max_tokens=max_tokens, n=req.n,
                                            seed=req.seed, json_mode=json_mode, stop=stop or None)
        except ModelFault as e:
            kind = "server_error" if e.status >= 500 else "invalid_request_error"
            return JSONResponse({"error": {"message": str(e), "type": kind}}, status_code=e.status)
        except GarbageBody:
            return PlainTextResponse("<html><body>502 Bad Gateway</body></html>")
        return JSONResponse({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": (req.model or names[0]) if served_names else model.name,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "logprobs": None}
                        for i, c in enumerate(comps)],
            "usage": {"prompt_tokens": comps[0].prompt_tokens,
                      "completion_tokens": sum(c.completion_tokens for c in comps),
                      "total_tokens": comps[0].prompt_tokens + sum(c.completion_tokens for c in comps)},
        })

    return app


@contextmanager
def running(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve `app` on a background thread (port 0: any free port); yields the base URL
    (`http://host:port/v1`). For tests, benchmarks and in-process audits."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:  # the start-up wait too: a Ctrl-C in it, or its time-out, left the model served on its thread
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the chat server did not start")
            time.sleep(0.02)
        bound = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://{url_host(host)}:{bound}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        if thread.is_alive():  # a request still generating, say: the daemon thread ends with this process
            warnings.warn("the chat server's thread had not ended 30 s after it was told to stop", RuntimeWarning,
                          stacklevel=3)


def serve(model: ChatModel, host: str = "127.0.0.1", port: int = 8001, api_key: str | None = None,
          **limits) -> None:
    """Serve `model` until killed. Loopback by default: without `api_key` there is no authentication."""
    import uvicorn

    uvicorn.run(make_app(model, api_key=api_key, **limits), host=host, port=port, log_level="info")
