"""One HTTP client for every OpenAI-compatible chat endpoint (vLLM, llama.cpp's server, a hosted
API, `selfevo serve-model`), shared by the remote solver and the LLM judge.

    client = ChatClient(url, model, api_key=...)          # url: the OpenAI base URL, .../v1
    client.chat(messages, temperature=0.8, top_p=0.95, max_tokens=512, seed=7, n=1,
                stop=["</search>"])  -> [Choice(text, finish_reason), ...]  (n of them)
    client.complete(messages)        -> the first choice's text

Every setting has a client-wide default (the constructor) and a per-call override. Retries with
exponential backoff and jitter (tenacity) on timeouts, connection errors, 408, 409, 425, 429 and
5xx, honouring Retry-After; 401/403/404 and redirects (3xx, never followed) raise `EndpointError` at
once (nothing will work: wrong key, URL or model); any other failure after the retries raises
`CallFailed`, which a caller survives (one bad call must not stop an evaluation or an audit). A 200 whose body is no
chat completion (a proxy's error page, a broken server) is retried like a 5xx: it says nothing about
what the model would answer, so a caller must never keep it as a reply (the judge caches replies).

The API key is sent as `Authorization: Bearer ...` and never logged, printed or written: a key with
whitespace or control characters (which httpx would refuse, quoting the header) is refused up front
without being shown, and error texts are scrubbed of it.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, stop_any, wait_exponential, wait_random

from selfevo._io import encodable, shown_url
from selfevo.search.client import MAX_REPLY_BYTES, MAX_WAIT_S, ReplyTooLarge, body_text, read_reply, retry_after_seconds

_UNSET: Any = object()
# besides 5xx: a proxy's request timeout, a conflict, "too early", rate limiting (as openai-python)
RETRIED_STATUS = (408, 409, 425, 429)
MAX_FAILED_IN_A_ROW = 16  # `FailureStreak`'s default limit


class FailureStreak:
    """Calls that failed for good (after their retries) with no reply between them, counted across a
    caller's threads. Past `limit` the endpoint is taken for one that does not answer (a dead server,
    a request it refuses with a 4xx): the caller (the remote solver, the LLM judge) stops, rather than
    turn every remaining item into a scored "no answer" after minutes of retries each."""

    def __init__(self, limit: int = MAX_FAILED_IN_A_ROW):
        self.limit, self.count, self.last = limit, 0, ""  # last: the text of the last call that failed
        self._lock = threading.Lock()

    def failed(self, reason: str) -> None:
        with self._lock:
            self.count += 1
            self.last = reason

    def answered(self) -> None:
        """A reply came (or a new batch may try the endpoint afresh): the streak is over."""
        with self._lock:
            self.count = 0

    def broken(self) -> str | None:
        """None while under the limit; else what happened, in words, for the caller's error."""
        with self._lock:
            count, last = self.count, self.last
        return f"{count} calls in a row failed for good (last: {last})" if count >= self.limit else None


def unless_stopped(stop: threading.Event, call: Callable, *args):
    """A batch's queued call, for a thread pool: not made (None) once the batch has stopped, and stopping it
    when it raises. The worker whose call raised says so at once; the pool's cancelling comes only once the
    batch's own thread wakes, and until then an instant refusal (a 401) let one worker go on to the calls
    still queued (all 20 of a test's, on Python 3.13)."""
    if stop.is_set():
        return None
    try:
        return call(*args)
    except BaseException:
        stop.set()
        raise


class EndpointError(RuntimeError):
    """The endpoint cannot work at all (HTTP 401/403: the API key; 404: the URL or the model)."""


class CallFailed(RuntimeError):
    """One call failed for good after its retries."""


class _Retryable(RuntimeError):
    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class Choice:
    """One completion of a call. `finish_reason` is the server's in OpenAI's words ("stop",
    "length", ...; "stop" when it sends none; see `openai_finish_reason`)."""

    text: str
    finish_reason: str = "stop"
    stop_reason: str | None = None  # the stop string that ended it, where the server says (vLLM does)
    model: str | None = None  # the model the reply names (None: it names none), whatever name was asked for


# finish reasons of servers that predate or sidestep OpenAI's words for "it stopped by itself" (TGI:
# "eos_token", "stop_sequence"): read as "stop", else the action the stop string ended is not closed
_STOPPED = frozenset({"eos_token", "eos", "stop_sequence", "end_turn"})


def openai_finish_reason(reason: object) -> str:
    """A reply's finish_reason in OpenAI's words: none sent is "stop", and so is a synonym for it."""
    if not isinstance(reason, str) or not reason:
        return "stop"
    return "stop" if reason in _STOPPED else reason




def _error_message(r: httpx.Response) -> str:
    """The message of an error reply in the OpenAI shape (`{"error": {"message"}}`) or vLLM's
    (`{"message"}`); "" if the body is neither."""
    try:
        body = r.json()
    except (ValueError, RecursionError):  # RecursionError: a body nested past the parser's limit
        return ""
    if not isinstance(body, dict):
        return ""
    error = body.get("error")
    message = error.get("message") if isinstance(error, dict) else body.get("message")
    return str(message) if message else ""


def _content_text(content: object) -> str:
    """A reply message's `content` as text: a string; null (nothing written: a tool call, a reasoning
    model stopped while thinking) is ""; a list of content parts (some APIs answer a reasoning model
    so, its thinking in parts of another type) is the text of its text parts, in order. Anything else
    raises TypeError (no chat completion): read as "", a reply would be scored, and cached by the
    judge, as an empty answer."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        texts = [part.get("text") for part in content if part.get("type", "text") == "text"]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise TypeError(f"message content is a {type(content).__name__}, not text")


def _busy(r: httpx.Response) -> bool:
    """A reply worth asking again: the server is starting, overloaded or failing for the moment."""
    return r.status_code in RETRIED_STATUS or r.status_code >= 500


class ChatClient:
    """POST {url}/chat/completions with retries (see the module docstring). `key_env` and
    `hint_404` only word the error messages. A reply body past `max_reply_bytes` fails its call at once
    (`CallFailed`; the start-up probe's, `EndpointError`)."""

    max_reply_bytes = MAX_REPLY_BYTES

    def __init__(self, url: str, model: str, api_key: str | None = None, timeout: float = 60.0,
                 max_retries: int = 4, backoff: float = 0.5, max_backoff: float = 30.0, *,
                 max_tokens: int = 384, temperature: float = 0.0, top_p: float | None = None,
                 seed: int | None = None, stop: Sequence[str] | None = None, json_mode: bool = False,
                 key_env: str = "SELFEVO_API_KEY",
                 hint_404: str = "wrong URL or model name?",
                 on_event: Callable[[str], None] | None = None):
        if max_retries < 0:
            raise ValueError(f"max_retries: must be >= 0, got {max_retries}")
        if api_key and not api_key.isascii():  # httpx would refuse the header, quoting the key whole
            raise EndpointError(f"{key_env}: the API key holds a character that is not ASCII (a pasted "
                                "'…' or curly quote?); copy it again")
        if api_key and not (api_key.isprintable() and " " not in api_key):
            raise EndpointError(f"{key_env}: the API key holds whitespace or control characters (a trailing "
                                "space or \\r from a file?); strip it")
        url = url.rstrip("/")
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as e:
            raise EndpointError(f"{url}: not a valid URL ({e})") from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise EndpointError(f"{shown_url(url)}: not an http(s) URL with a host, e.g. http://127.0.0.1:8000/v1")
        if parsed.query or parsed.fragment:  # the routes are appended to the URL: "…/v1?x=1/chat/completions"
            raise EndpointError(f"{shown_url(url)}: a base URL takes no query or fragment (?…, #…)")
        self.base_url = url.removesuffix("/chat/completions")
        self.endpoint = f"{self.base_url}/chat/completions"
        self.model, self.max_retries, self.timeout = model, max_retries, timeout
        self.defaults = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens, "seed": seed,
                         "stop": ([stop] if isinstance(stop, str) else list(stop)) if stop else None,
                         "json_mode": json_mode}
        self._key_env, self._hint_404, self._key = key_env, hint_404, api_key
        self._expo = wait_exponential(multiplier=backoff, max=max_backoff) + wait_random(0, backoff)  # with jitter
        self._event = on_event or (lambda _: None)
        # the model each reply names, so that records can say which model answered whatever name was
        # asked for (llama.cpp's server and `serve-model` answer any)
        self.reply_models: Counter[str] = Counter()
        self._models_lock = threading.Lock()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=httpx.Timeout(timeout), headers=headers)

    def _scrub(self, text: str) -> str:
        """`text` without the key (an exception's text may quote a request header) or the URL's
        credentials (an error quotes the URL)."""
        return shown_url(text.replace(self._key, "***") if self._key else text)

    def _said(self, r: httpx.Response, or_body: bool = False) -> str:
        """What an error reply says (its message; with `or_body`, else its body), without the key (a
        server may quote the key it refuses), then cut to 200 characters."""
        return encodable(self._scrub(_error_message(r) or (body_text(r.text) if or_body else "")))[:200]

    def __repr__(self) -> str:  # never the key
        return f"ChatClient({shown_url(self.endpoint)!r}, model={self.model!r})"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ChatClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- one request
    def _wait(self, state) -> float:
        exc = state.outcome.exception() if state.outcome else None
        after = getattr(exc, "retry_after", None) or 0.0
        return min(max(self._expo(state), after), MAX_WAIT_S)

    def _check_status(self, r: httpx.Response) -> None:
        if _busy(r):  # the reason is what a warning quotes
            said = self._said(r, or_body=True)
            raise _Retryable(f"HTTP {r.status_code}{f': {said}' if said else ''}",
                             retry_after_seconds(r.headers.get("retry-after")))
        self._check_refused(r)
        if r.status_code == 404:  # a wrong path, or (vLLM, OpenAI, serve-model --served-model-name) model
            said = self._said(r)
            raise EndpointError(f"{shown_url(self.endpoint)}: HTTP 404{f': {said}' if said else ''} ({self._hint_404})")
        if r.status_code >= 400:  # not retried: the same request gets the same answer
            raise CallFailed(f"HTTP {r.status_code} (not retried): {self._said(r, or_body=True)}")

    def _check_refused(self, r: httpx.Response) -> None:
        """A reply that no retry or other call will change (a chat call's and the probe's alike):
        the key is refused, or the URL redirects (never followed: a redirect's body is no reply)."""
        if r.status_code in (401, 403):
            said = self._said(r)
            raise EndpointError(f"{shown_url(str(r.request.url))}: HTTP {r.status_code}{f': {said}' if said else ''} "
                                f"(is {self._key_env} set correctly?)")
        if 300 <= r.status_code < 400:
            raise EndpointError(f"{shown_url(str(r.request.url))}: HTTP {r.status_code}, redirected to "
                                f"{r.headers.get('location', '(no Location)')}: give the URL the endpoint redirects to")

    def body(self, messages: Sequence[dict], n: int = 1, **overrides: Any) -> dict:
        """The request body of a call: the client's defaults, then `overrides` (None: not sent)."""
        unknown = set(overrides) - set(self.defaults)
        if unknown:
            raise TypeError(f"unknown chat settings: {', '.join(sorted(unknown))}")
        s = {**self.defaults, **{k: v for k, v in overrides.items() if v is not _UNSET}}
        # a lone surrogate in a message is no UTF-8: the request could not be sent (a bare UnicodeEncodeError)
        messages = [{**m, "content": encodable(m["content"])} if isinstance(m.get("content"), str) else m
                    for m in messages]
        body: dict[str, Any] = {"model": self.model, "messages": messages, "n": n}
        for key in ("max_tokens", "temperature", "top_p", "seed"):
            if s[key] is not None:
                body[key] = s[key]
        if s["stop"]:
            body["stop"] = [s["stop"]] if isinstance(s["stop"], str) else list(s["stop"])
        if s["json_mode"]:
            body["response_format"] = {"type": "json_object"}
        return body

    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        return read_reply(self._http, method, url, self.timeout, self.max_reply_bytes, **kwargs)

    def _send(self, body: dict) -> list[Choice]:
        self._event("request")
        try:
            r = self._request("POST", self.endpoint, json=body)
        except httpx.TimeoutException:
            self._event("timeout")
            raise
        except httpx.DecodingError:  # a Content-Encoding the body does not have (a proxy's fault)
            self._event("malformed_body")
            raise _Retryable("a reply body that does not decode as its Content-Encoding says") from None
        except ReplyTooLarge as e:
            self._event("malformed_body")
            raise CallFailed(self._scrub(f"{e} (not retried)")) from None
        self._check_status(r)
        self._event("reply")
        try:
            data = r.json()
            choices = data["choices"]
            # every text as UTF-8 can carry it: JSON can escape a lone surrogate, which then fails every
            # write of it (the judge's cache line, a record), far from here
            named = encodable(data["model"]) if isinstance(data.get("model"), str) else None
            out = []
            for c in choices:
                content = encodable(_content_text(c["message"]["content"]))
                stop_reason = c.get("stop_reason")  # vLLM: a stop string, a token id (int) or None
                out.append(Choice(content,
                                  openai_finish_reason(c.get("finish_reason")),
                                  encodable(stop_reason) if isinstance(stop_reason, str) else None, named))
            if not out:
                raise ValueError("no choices")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError):
            # a 200 that is no chat completion (a proxy's error page, a broken server; RecursionError:
            # a body nested past the parser's limit); an error it carries is what a warning quotes
            self._event("malformed_body")
            said = self._said(r)
            raise _Retryable(f"HTTP 200 without a chat completion{f': {said}' if said else ''}") from None
        if named is not None:
            with self._models_lock:
                self.reply_models[named] += 1
        return out

    # -------------------------------------------------------------- the API
    def chat(self, messages: Sequence[dict], *, n: int = 1, temperature: float | None = _UNSET,
             top_p: float | None = _UNSET, max_tokens: int | None = _UNSET, seed: int | None = _UNSET,
             stop: Sequence[str] | None = _UNSET, json_mode: bool = _UNSET,
             stopped: threading.Event | None = None) -> list[Choice]:
        """The choices of one call (normally `n`). Raises CallFailed after `max_retries` retries,
        EndpointError at once on 401/403/404. `stopped`: set by a caller that is stopping (an error
        elsewhere in its batch, Ctrl-C): the call makes no further attempt and ends its wait for one,
        so the caller's threads end within one timeout instead of all their retries. Each batch passes
        its own: a client is shared by the batches of several threads."""
        body = self.body(messages, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                         seed=seed, stop=stop, json_mode=json_mode)
        last: BaseException | None = None  # the failure of the attempt before
        stopped = stopped if stopped is not None else threading.Event()
        try:
            # the wait before a retry (up to a minute of backoff or Retry-After) ends when the caller
            # stops, and no attempt follows it
            for attempt in Retrying(retry=retry_if_exception_type((httpx.TransportError, _Retryable)),
                                    stop=stop_any(stop_after_attempt(self.max_retries + 1),
                                                  lambda _: stopped.is_set()), wait=self._wait,
                                    sleep=stopped.wait,
                                    before_sleep=lambda _: self._event("retry"), reraise=True):
                with attempt:
                    if last is not None and stopped.is_set():
                        raise last
                    try:
                        return self._send(body)
                    except (httpx.TransportError, _Retryable) as e:
                        last = e
                        raise
        except (httpx.TransportError, _Retryable) as e:
            # a reply is named by what it said; a transport error by its class (ConnectError, ReadTimeout)
            if isinstance(e, _Retryable) or not str(e):
                said = str(e) or type(e).__name__
            else:
                said = f"{type(e).__name__}: {e}"
            raise CallFailed(self._scrub(said)) from None
        raise AssertionError("unreachable")

    def complete(self, messages: Sequence[dict], **overrides: Any) -> str:
        """The text of the first choice (see `chat`)."""
        return self.chat(messages, **overrides)[0].text

    def _lists_models(self, url: str) -> bool:
        """Whether GET `url` answers as an OpenAI model list does (a probe: any failure is a no)."""
        try:
            listed = self._request("GET", url).json()
            return isinstance(listed, dict) and isinstance(listed.get("data"), list)
        except (httpx.HTTPError, ValueError, TypeError):
            return False

    def check(self) -> list[str]:
        """Probe the endpoint (GET {url}/models) before a long run: raises EndpointError if it is
        unreachable or refuses the key; returns the model ids it lists ([] if it lists none, or has no
        /models route). A busy reply (408, 429, 5xx) or a timeout is asked again, as a chat call is: read
        as "lists none", it turned a judge's whole cache off for the run, without a word."""
        def probe() -> httpx.Response:
            r = self._request("GET", f"{self.base_url}/models")
            if _busy(r):
                raise _Retryable(f"HTTP {r.status_code}", retry_after_seconds(r.headers.get("retry-after")))
            return r

        try:
            for attempt in Retrying(retry=retry_if_exception_type((httpx.TimeoutException, _Retryable)),
                                    stop=stop_after_attempt(self.max_retries + 1), wait=self._wait, reraise=True):
                with attempt:
                    r = probe()
        except _Retryable as e:
            warnings.warn(f"{shown_url(self.base_url)}/models answered {e} to {self.max_retries + 1} tries: read "
                          "as listing no models (an LLM judge then uses none of its stored replies)", stacklevel=2)
            return []
        except httpx.TransportError as e:
            raise EndpointError(self._scrub(f"{self.base_url}: cannot connect ({type(e).__name__}: {e})")) from None
        except httpx.DecodingError as e:  # it connected: a Content-Encoding the body does not have (a proxy's fault)
            raise EndpointError(self._scrub(f"{self.base_url}/models: a reply body that does not decode as its "
                                            f"Content-Encoding says ({e})")) from None
        except ReplyTooLarge as e:
            raise EndpointError(self._scrub(str(e))) from None
        self._check_refused(r)
        if r.status_code == 404 and not self.base_url.rstrip("/").endswith("/v1") and self._lists_models(
                f"{self.base_url}/v1/models"):
            # the server's OpenAI routes are under /v1: every call to this URL would be a 404 (after,
            # say, hours of indexing)
            raise EndpointError(self._scrub(f"{self.base_url}: no such route, but {self.base_url}/v1 answers: "
                                            "give the OpenAI base URL (…/v1)"))
        if r.status_code != 200:
            return []
        try:
            return [str(m["id"]) for m in r.json()["data"]]
        except (ValueError, KeyError, TypeError, RecursionError):
            return []
