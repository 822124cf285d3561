"""A `Retriever` backed by any Search-R1-compatible `POST /retrieve` server (ours or theirs)."""

from __future__ import annotations

import datetime as dt
import email.utils
import html
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import BaseModel, FiniteFloat, ValidationError

from selfevo._io import shown_url
from selfevo.records import Document
from selfevo.search.tool import SERVER_TIMEOUT_S, Hit, check_queries, clip_query

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11


class RetrieverError(RuntimeError):
    """The server refused the request, kept failing, or answered something unreadable."""


class _Doc(BaseModel):
    id: str | int  # FlashRAG corpora in the wild carry numeric ids too
    contents: str


class _ScoredDoc(BaseModel):
    document: _Doc
    score: FiniteFloat  # a NaN would order hits by nothing


class _Response(BaseModel):
    result: list[list[_ScoredDoc]]


# Worth another try: the server is starting, restarting, overloaded or briefly unreachable.
# Retrieval is read-only, so repeating a request is always safe.
_RETRY_STATUS = {429, 500, 502, 503, 504}
MAX_WAIT_S = 60.0  # the longest a client waits before a retry, whatever a server asks
# The most a reply's body may hold: a /retrieve reply of a 64-query batch and a chat completion of n
# samples are kilobytes to a few MB.
MAX_REPLY_BYTES = 64 * 2**20
# How long a call waits for the server's answer: longer than our server's own limit on a retrieval
# (plus room for its reply), so the server decides: a slow retrieval is answered, or ends in its 504
# naming the limit. With both at 30 s the client's read timeout fired first, and its retry started
# another retrieval while the one it abandoned, still inside the server's limit, kept its thread.
TIMEOUT_S = 2 * SERVER_TIMEOUT_S


def retry_after_seconds(value: str | None) -> float | None:
    """A `Retry-After` header's wait in seconds (RFC 9110: a number of seconds or an HTTP date;
    a date in the past is 0), or None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.replace(".", "", 1).isdigit():
        try:
            return float(value)
        except ValueError:  # isdigit() also takes digits float() does not read ("²"): unreadable
            return None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # an HTTP date is GMT
        when = when.replace(tzinfo=dt.timezone.utc)
    return max(0.0, (when - dt.datetime.now(dt.timezone.utc)).total_seconds())


_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
_TAG = re.compile(r"<[^>]*>")


def body_text(text: str) -> str:
    """An error body that is no JSON error, as one line for an error message: an HTML page's title (a
    proxy's "502 Bad Gateway", whose page is mostly markup and line breaks), else the text without tags."""
    title = _TITLE.search(text)
    return " ".join(html.unescape(title.group(1) if title else _TAG.sub(" ", text)).split())


class ReplyTooLarge(httpx.HTTPError):
    """A reply whose body runs past `read_reply`'s `max_bytes`: not retried, as the same request would
    get the same reply."""


def read_reply(http: httpx.Client, method: str, url: str, timeout: float, max_bytes: int = MAX_REPLY_BYTES,
               **kwargs: Any) -> httpx.Response:
    """One request, its whole body read within `timeout` and `max_bytes`: httpx's timeout bounds each
    read only, so a server trickling its body in (a byte now and then) would hold the call for ever,
    and one sending hundreds of MB fast would fill memory before the reply failed to parse. The bound
    is on the body as decoded (a small gzip stream can inflate to gigabytes)."""
    deadline = time.monotonic() + timeout
    with http.stream(method, url, **kwargs) as r:
        if r.is_stream_consumed:  # a reply made in memory (an httpx.MockTransport's): nothing left to wait for
            return r
        body = bytearray()
        for chunk in r.iter_bytes():  # decoded as its Content-Encoding says (an httpx.DecodingError if not)
            body += chunk
            if len(body) > max_bytes:
                raise ReplyTooLarge(f"{method} {shown_url(url)}: reply body larger than {max_bytes:,} bytes")
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout(f"reply not received within {timeout:g} s", request=r.request)
    headers = [(k, v) for k, v in r.headers.multi_items() if k not in ("content-encoding", "content-length")]
    return httpx.Response(r.status_code, headers=headers, content=bytes(body), request=r.request)


class RetrieverClient:
    """HTTP retriever. `url` is the server root (a trailing `/retrieve`, as Search-R1 configs
    write it, is accepted too). Queries go out in batches of `batch_size`; transport errors,
    429 and 5xx are retried `retries` times with exponential backoff, or after the wait a
    `Retry-After` header asks for when that is longer (at most `MAX_WAIT_S`); a reply body past
    `max_reply_bytes` is refused at once. `transport` swaps the network for an in-process fake
    (`httpx.MockTransport`)."""

    max_reply_bytes = MAX_REPLY_BYTES

    def __init__(self, url: str, timeout: float = TIMEOUT_S, batch_size: int = 64, retries: int = 3,
                 backoff_s: float = 0.5, transport: httpx.BaseTransport | None = None):
        if batch_size < 1 or retries < 0:
            raise ValueError("batch_size must be >= 1 and retries >= 0")
        self.url = url.rstrip("/").removesuffix("/retrieve")
        self.batch_size, self.retries, self.backoff_s, self.timeout = batch_size, retries, backoff_s, timeout
        # One pooled client: thousands of single-query calls must not each open a connection.
        self._http = httpx.Client(timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        """Send with retries; return the decoded JSON of a 2xx answer."""
        url = f"{self.url}{path}"
        said = f"{method} {shown_url(url)}"  # (a URL's password is not printed)
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            asked = None  # the server's Retry-After
            try:
                resp = read_reply(self._http, method, url, self.timeout, self.max_reply_bytes, **kwargs)
            except ReplyTooLarge as e:
                raise RetrieverError(str(e)) from None
            except (httpx.TransportError, httpx.DecodingError) as e:  # (DecodingError: a proxy's wrong encoding)
                if last:
                    raise RetrieverError(shown_url(f"{said}: {type(e).__name__}: {e} "
                                                   f"(after {self.retries + 1} attempts)")) from None
            else:
                if resp.status_code < 300:
                    try:
                        return resp.json()
                    except (ValueError, RecursionError):  # (RecursionError: nested past the parser's limit)
                        raise RetrieverError(f"{said}: response is not JSON: {resp.text[:200]!r}") from None
                if resp.status_code not in _RETRY_STATUS or last:
                    raise RetrieverError(f"{said}: HTTP {resp.status_code}: {body_text(resp.text)[:500]}")
                asked = retry_after_seconds(resp.headers.get("retry-after"))
            time.sleep(min(max(self.backoff_s * 2**attempt, asked or 0.0), MAX_WAIT_S))
        raise AssertionError("unreachable")

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health")

    def probe(self) -> None:
        """One query, before a command writes anything (Search-R1's own server has no /health to ask): a
        server that answers nothing, or not as /retrieve does, is a RetrieverError now, not in the first
        search, perhaps hours into a run."""
        self.retrieve(["probe"], 1)

    def retrieve(self, queries: Sequence[str], topk: int = 3) -> list[list[Hit]]:
        queries = check_queries(queries)
        out: list[list[Hit]] = []
        for start in range(0, len(queries), self.batch_size):
            batch = [clip_query(q) for q in queries[start:start + self.batch_size]]  # the server's cap
            payload = self._request("POST", "/retrieve", json={
                "queries": batch, "topk": topk, "return_scores": True})
            try:
                result = _Response.model_validate(payload).result
            except ValidationError as e:
                raise RetrieverError(f"malformed /retrieve response from {shown_url(self.url)}: "
                                     f"{e.error_count()} problem(s), first: "
                                     f"{e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from None
            if len(result) != len(batch):
                raise RetrieverError(f"malformed /retrieve response from {shown_url(self.url)}: "
                                     f"{len(result)} result lists for {len(batch)} queries")
            out.extend([Hit(Document.from_contents(str(h.document.id), h.document.contents),
                            h.score) for h in hits] for hits in result)
        return out


def probed_client(url: str) -> RetrieverClient:
    """A client of the /retrieve server at `url` (http or https), asked one query (`probe`) before a command
    loads or writes anything: a URL of another scheme, or a server that answers nothing, is a RetrieverError
    now (the caller names its option)."""
    if not url.startswith(("http://", "https://")):
        raise RetrieverError(f"expected http(s)://HOST:PORT, got {shown_url(url)!r}")
    client = RetrieverClient(url)
    try:
        client.probe()
    except BaseException:
        client.close()
        raise
    return client
