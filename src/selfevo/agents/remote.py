"""An inference-only solver over any OpenAI-compatible chat endpoint (vLLM, llama.cpp's server, a
hosted API, `selfevo serve-model`): the spec `remote:MODEL@URL`, e.g.

    selfevo eval --agent remote:qwen@http://127.0.0.1:8000/v1 --data-dir qa/ --corpus wiki.jsonl --out ev/

It speaks the Search-R1 protocol of the local LM backends (`agents.lm.protocol`) through the one
rollout driver (`agents.lm.rollout.run_rollouts`); it only supplies `generate`: every running
conversation is one chat call, sent concurrently (a bounded thread pool) with
`stop=["</search>", "</answer>"]`, so one call is one assistant action. Greedy is temperature 0;
sampling uses temperature 0.8, top-p 0.95 (paper). Each call carries a seed derived from the batch
seed, the turn and the row (its place in the batch), so a seeded server samples reproducibly, the n
samples of a question differ, and a row that ends early changes no other row's seeds.

Failures: the HTTP client (`agents.chat_client`, shared with the LLM judge) retries timeouts,
connection errors, 408, 409, 425, 429, 5xx and 200s that are no chat completion. A call that still
fails ends its trajectory unanswered (an empty answer, scored as wrong) and is counted in `stats` --
one bad call does not stop an evaluation of 1,325 questions; `max_failed_in_a_row` calls of one `answer` batch
failing with no reply between them do (`EndpointError`: the endpoint is not answering). HTTP 401/403/404 raise
`EndpointError` at once (wrong key, URL or model: nothing would work).

The API key comes from `api_key` or the SELFEVO_API_KEY environment variable; it is never logged,
printed or written (`describe()` says only whether one is set).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, wait

from selfevo._io import shown_url
from selfevo._threads import DaemonThreads
from selfevo.agents.base import Trajectory
from selfevo.agents.chat_client import (
    MAX_FAILED_IN_A_ROW,
    CallFailed,
    ChatClient,
    EndpointError,
    FailureStreak,
    unless_stopped,
)
from selfevo.agents.lm.protocol import STOP_STRINGS, solver_messages
from selfevo.agents.lm.rollout import run_rollouts
from selfevo.loop.schedule import derive_seed
from selfevo.records import Document
from selfevo.search.tool import SearchTool

API_KEY_ENV = "SELFEVO_API_KEY"
SAMPLE_TEMPERATURE, SAMPLE_TOP_P = 0.8, 0.95  # paper: the grader's five samples
SEED_MASK = 0x7FFF_FFFF  # request seeds fit every server (llama.cpp reads a uint32, vLLM an int64)

log = logging.getLogger(__name__)
# the client's events, as counted in `stats` (which also has calls, failed_calls, trajectories, ...)
_EVENTS = {"request": "requests", "reply": "replies", "retry": "retries", "timeout": "timeouts",
           "malformed_body": "malformed_bodies"}

_SPEC = re.compile(r"(?P<model>\S+?)@(?P<url>https?://\S+)")  # the model ends at the first "@http"


def parse_remote_spec(arg: str) -> tuple[str, str]:
    """`MODEL@URL` (the part of `remote:MODEL@URL` after the colon) -> (model, url)."""
    m = _SPEC.fullmatch(arg.strip())
    if not m:
        raise ValueError(f"agent 'remote' needs MODEL@URL, e.g. remote:qwen@http://127.0.0.1:8000/v1; got '{arg}'")
    return m["model"], m["url"]


class RemoteSolver:
    """A `Solver` whose every action is one chat call to an OpenAI-compatible endpoint (see the
    module docstring). Inference only: it has no `update`."""

    def __init__(self, url: str, model: str, api_key: str | None = None, *,
                 temperature: float = SAMPLE_TEMPERATURE, top_p: float = SAMPLE_TOP_P,
                 max_tokens: int = 512, max_actions: int = 5, concurrency: int = 4,
                 timeout: float = 120.0, max_retries: int = 4, backoff: float = 0.5,
                 context: Callable[[str], str] | None = None, max_failed_in_a_row: int = MAX_FAILED_IN_A_ROW):
        if concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
        if max_actions < 1:
            raise ValueError(f"max_actions: must be >= 1, got {max_actions}")
        self.name = f"remote:{model}@{shown_url(url)}"  # in score.json and logs: no password
        self.url, self.model = url, model
        self.temperature, self.top_p = temperature, top_p
        self.max_tokens, self.max_actions, self.concurrency = max_tokens, max_actions, concurrency
        # what a source shown with a question becomes (MSV's "with the source"); the loop's LMSolver
        # shows the first lm.doc_tokens tokens, the proposer's view, and so should a served solver
        self._context = context or (lambda text: text)
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self._has_key = bool(key)
        self.stats: Counter[str] = Counter()
        # past it the endpoint is not answering; counted per `answer` call (a streak of its own): a solver
        # shared across threads (verl's concurrent reward calls) must not have one batch's start reset the
        # count of another, nor another batch's failures stop it
        self.max_failed_in_a_row = max_failed_in_a_row
        self.endpoint_models: list[str] | None = None
        self._lock = threading.Lock()
        self.client = ChatClient(url, model, api_key=key, timeout=timeout, max_retries=max_retries,
                                 backoff=backoff, max_tokens=max_tokens, stop=STOP_STRINGS,
                                 key_env=API_KEY_ENV,
                                 hint_404="is the URL the OpenAI base URL (…/v1) and the model one it serves?",
                                 on_event=lambda what: self._count(_EVENTS.get(what, what)))

    def __repr__(self) -> str:  # never the key
        return f"RemoteSolver({shown_url(self.url)!r}, model={self.model!r})"

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.stats[what] += n

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> RemoteSolver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check(self) -> None:
        """Fail fast (EndpointError) when the endpoint is unreachable or refuses the key; keep the
        model ids it lists for the records."""
        self.endpoint_models = self.client.check()

    def describe(self) -> dict:
        """Settings and counters, for a run's records (no API key, only whether one is set)."""
        return {"agent": self.name, "url": shown_url(self.url), "model": self.model,
                "api_key": "set" if self._has_key else "unset",
                # sampled calls (rollouts, grading); a greedy one (an evaluation) is sent at 0 / 1
                "temperature": self.temperature, "top_p": self.top_p, "greedy": {"temperature": 0.0, "top_p": 1.0},
                "max_tokens": self.max_tokens, "max_actions": self.max_actions,
                "stop": list(STOP_STRINGS), "concurrency": self.concurrency,
                "max_retries": self.client.max_retries, "stats": dict(self.stats),
                # what the endpoint listed (None: not probed) and the model each reply named: a server
                # that answers any requested name shows here which model gave the answers
                "endpoint_models": self.endpoint_models, "reply_models": dict(self.client.reply_models)}

    def _check_answering(self, streak: FailureStreak) -> None:
        if (broken := streak.broken()) is not None:
            raise EndpointError(f"{shown_url(self.url)}: {broken}; the endpoint is not answering")

    # -------------------------------------------------------------- generation
    def _generate(self, conversations: list[list[dict]], seed: int | None, greedy: bool,
                  streak: FailureStreak, stop: threading.Event, rows: Sequence[int]) -> list[tuple[str, str]]:
        """One assistant action per conversation, `(text, finish_reason)`; "error" for a call that
        failed for good (the rollout then ends that conversation unanswered). `streak`: the calling
        batch's failures in a row; `stop`: set when the batch stops, its calls then retry no more;
        `rows`: each conversation's place in the batch, which its call's seed is derived from."""
        temperature, top_p = (0.0, 1.0) if greedy else (self.temperature, self.top_p)

        def one(row: int) -> tuple[str, str]:
            self._check_answering(streak)  # once it is not, the calls still queued are not sent
            self._count("calls")
            row_seed = None if seed is None else derive_seed(seed, "row", rows[row]) & SEED_MASK
            try:
                choice = self.client.chat(conversations[row], temperature=temperature, top_p=top_p,
                                          seed=row_seed, stopped=stop)[0]
            except CallFailed as e:
                self._count("failed_calls")
                streak.failed(str(e))  # the server's reason, for the warning below
                log.debug("remote call failed for good: %s", e)
                self._check_answering(streak)
                return "", "error"
            streak.answered()
            if choice.finish_reason == "stop" and choice.stop_reason in STOP_STRINGS:
                # the server says which stop string it dropped: put that one back, so that the action
                # reads as a local backend's does (`close_action` can only guess it from the text)
                return choice.text + choice.stop_reason, choice.finish_reason
            return choice.text, choice.finish_reason

        # daemon threads: an interrupt does not wait out the calls in flight (each up to its timeout)
        with DaemonThreads(min(self.concurrency, max(1, len(conversations))), thread_name_prefix="remote") as pool:
            # (a call not made once the batch stopped gives None: the batch raises, its results unread)
            futures = [pool.submit(unless_stopped, stop, one, row) for row in range(len(conversations))]
            try:
                # the first failure, not the first row: an EndpointError of a later row must not wait
                # for an earlier row sleeping out a Retry-After
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                for f in done:
                    if f.exception() is not None:
                        raise f.exception()
                return [f.result() for f in futures]
            except BaseException:  # nothing else will work (EndpointError), or we are stopping (Ctrl-C)
                for f in futures:  # do not send the rest ...
                    f.cancel()
                stop.set()  # ... nor retry this batch's calls in flight (another thread's batch goes on)
                raise

    # -------------------------------------------------------------- the Solver protocol
    def answer(self, questions: Sequence[str], tool: SearchTool, *, greedy: bool = True, n: int = 1,
               seed: int | None = None,
               contexts: Sequence[Document | None] | None = None) -> list[list[Trajectory]]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if contexts is not None and len(contexts) != len(questions):
            raise ValueError(f"{len(contexts)} contexts for {len(questions)} questions")
        starts = [solver_messages(q, context=None if contexts is None or contexts[i] is None
                                  else self._context(contexts[i].contents)) for i, q in enumerate(questions)]
        copies = 1 if greedy else n  # greedy: the n trajectories are identical, run one
        streak = FailureStreak(self.max_failed_in_a_row)  # each batch tries the endpoint afresh
        stop = threading.Event()  # this batch's own: a client is shared by the batches of several threads
        # a conversation's place in the batch, not among those still running: else a row that ended (an
        # answer, a call failed for good) changed the seeds of every later row's calls
        place: dict[int, int] = {}

        def generate(convs: list[list[dict]], s: int | None) -> list[tuple[str, str]]:
            if not place:  # the first turn holds every conversation, in order; each keeps its message list
                place.update({id(c): i for i, c in enumerate(convs)})
            return self._generate(convs, s, greedy, streak, stop, [place[id(c)] for c in convs])

        rollouts = run_rollouts([s for s in starts for _ in range(copies)], tool, generate,
                                max_actions=self.max_actions, seed=seed)
        trajs = [Trajectory(answer=ro.answer, searches=list(ro.searches), actions=ro.actions, trace=ro)
                 for ro in rollouts]
        self._count("trajectories", len(trajs))
        self._count("unanswered", sum(not ro.answered for ro in rollouts))
        self._count("failed_trajectories", sum(ro.failed for ro in rollouts))
        self._count("invalid_actions", sum(ro.invalid for ro in rollouts))
        self._count("truncated_trajectories", sum(ro.truncated for ro in rollouts))
        # this batch's own (the stats are shared: the frontier reward grades batches on threads)
        failed = sum(ro.failed for ro in rollouts)
        if failed:
            log.warning("%s: %d call(s) failed for good; their trajectories have no answer (last: %s)",
                        self.name, failed, streak.last)
        groups = [trajs[i * copies:(i + 1) * copies] for i in range(len(questions))]
        if greedy and n > 1:
            groups = [[g[0]] + [dataclasses.replace(g[0], searches=list(g[0].searches)) for _ in range(n - 1)]
                      for g in groups]
        return groups
