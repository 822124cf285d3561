"""The remote solver (`remote:MODEL@URL`) over real HTTP on loopback: selfevo's OpenAI-compatible
server in front of a ScriptedModel whose script plays a Search-R1 agent, a small in-memory
retriever whose pages name a secret word per query, and one `selfevo eval` run through the CLI on
the shared QA sets and the wiki18-mini corpus. One slow test checks `stop` on a real SmolLM2."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import signal
import threading
import time

import httpx
import pytest
from _servers import serve_app, silent_endpoint, stopped_within, trickling_app
from _shared import CORPUS, QA_DIR, frequent_thread_switches
from fastapi import FastAPI, Request
from typer.testing import CliRunner

from selfevo._io import shown_url
from selfevo.agents import load_agent
from selfevo.agents.chat_client import CallFailed, ChatClient, EndpointError, openai_finish_reason
from selfevo.agents.lm.model import (
    GarbageBody,
    ModelFault,
    ScriptedModel,
    cut_before_stop,
    echo_script,
    load_chat_model,
    messages_digest,
)
from selfevo.agents.lm.protocol import BUDGET_SPENT, CORRECTIVE, STOP_STRINGS
from selfevo.agents.lm.server import make_app
from selfevo.agents.remote import RemoteSolver, parse_remote_spec
from selfevo.cli import app
from selfevo.evaluate import evaluate_solver
from selfevo.records import Document, QAItem
from selfevo.search.tool import Hit, SearchTool

# ------------------------------------------------------------------ the world of the tests


def secret(query: str) -> str:
    """The word the pages found for `query` name (a different one per query)."""
    return "w" + hashlib.sha256(query.strip().lower().encode()).hexdigest()[:6]


class WordRetriever:
    """Every query finds `topk` pages; the first names the query's secret word."""

    def __init__(self):
        self.queries: list[str] = []

    def retrieve(self, queries, topk=3):
        self.queries.extend(queries)
        return [[Hit(Document(f"{secret(q)}-{k}", f"Page {k}",
                              f"Filler about {q}. " + (f"The secret word is {secret(q)}." if k == 0 else "")),
                     1.0 - k / 10) for k in range(topk)] for q in queries]


def tool(max_calls: int = 5) -> SearchTool:
    return SearchTool(WordRetriever(), topk=3, max_calls=max_calls)


def question_of(messages) -> str:
    return re.search(r"Question: (.*)", messages[1]["content"]).group(1)


def searcher(messages) -> str:
    """Searches the question, then answers with the secret word the results name. Like a real
    model, it runs on past its action (made-up results and an answer) unless `stop` cuts it."""
    last = messages[-1]["content"]
    found = re.search(r"The secret word is (\w+)", last)
    if last.startswith("<information>") and found:
        return f"<think>The pages say it.</think>\n<answer> {found.group(1)} </answer>\nmore talk"
    return (f"<think>I should look it up.</think>\n<search> {question_of(messages)} </search>\n"
            "<information>made-up results</information>\n<answer> wrong </answer>")


class Recording:
    """A ChatModel that records every request's messages and settings, then lets `inner` reply."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
        self.calls: list[dict] = []
        self._lock = threading.Lock()

    def generate(self, messages, **settings):
        with self._lock:
            self.calls.append({"messages": [dict(m) for m in messages], **settings})
        return self.inner.generate(messages, **settings)


def recording(script, **faults) -> Recording:
    return Recording(ScriptedModel(script, name="scripted", **faults))


def solver(url, **kw) -> RemoteSolver:
    kw.setdefault("backoff", 0.001)
    return RemoteSolver(url, "scripted", **kw)


QUESTIONS = ["who wrote the red book", "where is mount ebor"]


# ------------------------------------------------------------------ the protocol


def test_chat_client_waits_as_long_as_retry_after_asks():
    """A 429 whose Retry-After asks for longer than the backoff is retried after that wait."""
    calls: list[float] = []

    def reply(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        if len(calls) == 1:
            return httpx.Response(429, headers={"Retry-After": "0.4"}, stream=httpx.ByteStream(b""))
        body = {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}]}
        return httpx.Response(200, stream=httpx.ByteStream(json.dumps(body).encode()))  # the client streams

    with ChatClient("http://fake/v1", "m", backoff=0.001) as client:
        client._http = httpx.Client(transport=httpx.MockTransport(reply))
        assert client.complete([{"role": "user", "content": "hi"}]) == "ok"
    assert len(calls) == 2 and calls[1] - calls[0] >= 0.4


def test_multi_turn_search_protocol_over_http():
    model = recording(searcher)
    with serve_app(make_app(model)) as base, solver(f"{base}/v1") as s:
        t = tool()
        groups = s.answer(QUESTIONS, t)
    assert [len(g) for g in groups] == [1, 1]
    for q, (traj,) in zip(QUESTIONS, groups):
        ro = traj.trace
        assert traj.answer == secret(q)  # the word reached the model only through <information>
        assert traj.searches == [q] and traj.actions == 2 and ro.invalid == 0 and not ro.failed
        # the server cut the reply before "</search>"; the rollout closed the tag again
        assert ro.messages[2] == {"role": "assistant",
                                  "content": f"<think>I should look it up.</think>\n<search> {q} </search>"}
        assert ro.messages[3]["role"] == "user" and f"The secret word is {secret(q)}." in ro.messages[3]["content"]
        assert ro.messages[4]["content"].endswith(f"<answer> {secret(q)} </answer>")
    assert t.retriever.queries == QUESTIONS
    assert len(model.calls) == 4
    for c in model.calls:  # greedy, with the solver's stop strings and token budget
        assert (c["temperature"], c["top_p"], c["max_tokens"]) == (0.0, 1.0, 512)
        assert c["stop"] == list(STOP_STRINGS) and c["seed"] is None and c["n"] == 1
    assert s.stats["calls"] == s.stats["requests"] == s.stats["replies"] == 4
    assert s.stats["failed_calls"] == s.stats["unanswered"] == 0


def test_stop_is_honoured_by_the_server():
    model = ScriptedModel(searcher)
    convo = [{"role": "user", "content": "x"}, {"role": "user", "content": "Question: q1"}]
    assert model.generate(convo, stop=["</search>"])[0].text == "<think>I should look it up.</think>\n<search> q1 "
    with serve_app(make_app(model)) as base, ChatClient(f"{base}/v1", "m", backoff=0.001) as client:
        plain = client.chat(convo)[0]
        assert "made-up results" in plain.text and plain.finish_reason == "stop"
        cut = client.chat(convo, stop=list(STOP_STRINGS))[0]
        assert cut.text == "<think>I should look it up.</think>\n<search> q1 " and cut.finish_reason == "stop"
        assert client.chat(convo, stop=["</answer>"])[0].text.endswith("<answer> wrong ")
        # a single string is allowed too (OpenAI); more than 4, or an empty one, is a 4xx
        single = client._http.post(client.endpoint, json={"messages": convo, "stop": "</search>"})
        assert single.json()["choices"][0]["message"]["content"] == cut.text
        for bad in (["a", "b", "c", "d", "e"], [""]):
            with pytest.raises(CallFailed, match="HTTP 422"):
                client.chat(convo, stop=bad)
    assert model.requests and sum(model.requests.values()) == 5


def test_invalid_actions_get_the_correction_and_count_against_max_actions():
    def rambler(messages):
        return "I am not sure what to do."

    model = recording(rambler)
    with serve_app(make_app(model)) as base, solver(f"{base}/v1", max_actions=3) as s:
        (traj,), = s.answer(["q"], tool())
    assert traj.answer == "" and traj.actions == 3 and traj.trace.invalid == 3 and traj.searches == []
    assert len(model.calls) == 3
    assert [c["messages"][-1]["content"] for c in model.calls[1:]] == [CORRECTIVE, CORRECTIVE]
    assert s.stats["invalid_actions"] == 3 and s.stats["unanswered"] == 1

    def learner(messages):  # invalid once, then corrected
        return "<answer> fixed </answer>" if messages[-1]["content"] == CORRECTIVE else "no tags here"

    with serve_app(make_app(ScriptedModel(learner))) as base, solver(f"{base}/v1", max_actions=3) as s:
        (traj,), = s.answer(["q"], tool())
    assert traj.answer == "fixed" and traj.actions == 2 and traj.trace.invalid == 1


def test_the_tool_budget_holds():
    def hoarder(messages):  # searches forever, a new query every action
        return f"<search> query {sum(m['role'] == 'assistant' for m in messages)} </search>"

    model = recording(hoarder)
    with serve_app(make_app(model)) as base, solver(f"{base}/v1", max_actions=4) as s:
        t = tool(max_calls=2)
        (traj,), = s.answer(["q"], t)
    assert traj.searches == ["query 0", "query 1"] and traj.actions == 4 and traj.answer == ""
    assert t.retriever.queries == ["query 0", "query 1"]
    assert [c["messages"][-1]["content"] for c in model.calls[3:]] == [BUDGET_SPENT]
    assert [m["content"] for m in traj.trace.messages[-2:]] == [BUDGET_SPENT, "<search> query 3 </search>"]


def test_n_samples_use_the_paper_settings_and_distinct_seeds():
    model = recording(searcher)
    with serve_app(make_app(model)) as base, solver(f"{base}/v1", concurrency=3) as s:
        groups = s.answer(QUESTIONS, tool(), greedy=False, n=3, seed=11)
        first = sorted(c["seed"] for c in model.calls)
        model.calls.clear()
        s.answer(QUESTIONS, tool(), greedy=False, n=3, seed=11)
        again = sorted(c["seed"] for c in model.calls)
        model.calls.clear()
        s.answer(QUESTIONS, tool(), greedy=False, n=3, seed=12)
        other = sorted(c["seed"] for c in model.calls)
        model.calls.clear()
        greedy = s.answer(QUESTIONS, tool(), greedy=True, n=3)
        greedy_calls = list(model.calls)
    assert [len(g) for g in groups] == [3, 3]
    assert [[t.answer for t in g] for g in groups] == [[secret(q)] * 3 for q in QUESTIONS]
    assert len(first) == 12 and len(set(first)) == 12  # 6 rollouts x 2 actions, every call its own seed
    assert all(0 <= x < 2**31 for x in first)
    assert first == again and set(first).isdisjoint(other)
    # greedy: one rollout per question, copied n times
    assert [len(g) for g in greedy] == [3, 3] and len(greedy_calls) == 4
    assert all(t.answer == secret(q) for q, g in zip(QUESTIONS, greedy) for t in g)
    assert greedy[0][0] is not greedy[0][1]


def test_sampled_settings_are_sent():
    model = recording(searcher)
    with serve_app(make_app(model)) as base, solver(f"{base}/v1", temperature=0.7, top_p=0.9,
                                                      max_tokens=64) as s:
        s.answer(["q"], tool(), greedy=False, n=2, seed=1)
    assert {(c["temperature"], c["top_p"], c["max_tokens"]) for c in model.calls} == {(0.7, 0.9, 64)}
    assert RemoteSolver("http://127.0.0.1:1/v1", "m").describe()["temperature"] == 0.8  # paper defaults
    assert RemoteSolver("http://127.0.0.1:1/v1", "m").describe()["top_p"] == 0.95


def test_contexts_go_into_the_prompt():
    def reader(messages):  # reads the document when it has one, searches otherwise
        doc = re.search(r"<document>.*The secret word is (\w+)\..*</document>", messages[1]["content"], re.S)
        return f"<answer> {doc.group(1)} </answer>" if doc else searcher(messages)

    model = recording(reader)
    page = Document("p1", "Zebra page", "The secret word is zebra.")
    with serve_app(make_app(model)) as base, solver(f"{base}/v1") as s:
        (with_doc,), (without,) = s.answer(QUESTIONS, tool(), contexts=[page, None])
    assert with_doc.answer == "zebra" and with_doc.searches == [] and with_doc.actions == 1
    assert without.answer == secret(QUESTIONS[1]) and without.searches == [QUESTIONS[1]]
    opening = {c["messages"][1]["content"] for c in model.calls if len(c["messages"]) == 2}
    assert opening == {f'<document>\n"Zebra page"\nThe secret word is zebra.\n</document>\n'
                       f"Question: {QUESTIONS[0]}", f"Question: {QUESTIONS[1]}"}
    with pytest.raises(ValueError, match="contexts"):
        s.answer(QUESTIONS, tool(), contexts=[page])


# ------------------------------------------------------------------ failures


def test_the_records_name_the_model_that_answered():
    """A server that answers whatever model name a request gives (serve-model, llama.cpp's) is not
    recorded under the name asked for alone: the agent's details keep what the endpoint lists and
    the model each reply names."""
    items = [QAItem(f"q{i}", f"question number {i}", (secret(f"question number {i}"),)) for i in range(4)]
    with serve_app(make_app(ScriptedModel(searcher, name="smollm2"))) as base, \
            RemoteSolver(f"{base}/v1", "qwen", backoff=0.001) as s:
        s.check()
        detail = evaluate_solver(s, {"nq": items}, tool(), progress=False)["run"]["agent_detail"]
    assert detail["model"] == "qwen" and detail["endpoint_models"] == ["smollm2"]
    assert detail["reply_models"] == {"smollm2": detail["stats"]["calls"]}


def test_a_server_with_served_names_refuses_another_model_and_the_client_says_why():
    """`serve-model --served-model-name`: as vLLM, a request naming another model is a 404 whose
    message names what is served; the client stops at its first call with that message (a vLLM
    grader under another name fails the same way), while a right name is answered under it."""
    with serve_app(make_app(ScriptedModel(searcher, name="smollm2"), served_names=["judge", "sm"])) as base:
        listed = httpx.get(f"{base}/v1/models").json()
        assert [m["id"] for m in listed["data"]] == ["judge", "sm"]
        r = httpx.post(f"{base}/v1/chat/completions", json={"model": "qwen", "messages": [
            {"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
        unnamed = httpx.post(f"{base}/v1/chat/completions", json={"messages": [
            {"role": "system", "content": "search"}, {"role": "user", "content": "Question: hi"}]})
        assert unnamed.status_code == 200 and unnamed.json()["model"] == "judge"  # no name: the first served
        with RemoteSolver(f"{base}/v1", "qwen", backoff=0.001) as wrong:
            wrong.check()  # the probe passes: the endpoint is there, it lists what it serves
            assert wrong.endpoint_models == ["judge", "sm"]
            with pytest.raises(EndpointError, match=r"HTTP 404: The model `qwen` does not exist; this server "
                                                    r"serves judge, sm \(is the URL"):
                wrong.answer(QUESTIONS[:1], tool())
        with RemoteSolver(f"{base}/v1", "sm", backoff=0.001) as right:
            [[t]] = right.answer(QUESTIONS[:1], tool())
            assert t.answer == secret(QUESTIONS[0]) and right.describe()["reply_models"] == {"sm": 2}
        # the base URL without its /v1: every call would be a 404, found only after the index was built
        # (the probe took the 404 on /models for a server without that route; a helper's review)
        with RemoteSolver(base, "sm") as bare, pytest.raises(EndpointError, match=r"but .*/v1 answers: give the "
                                                                               r"OpenAI base URL"):
            bare.check()
    with serve_app(make_app(ScriptedModel(searcher, name="smollm2"))) as base:  # no names: any is answered
        with RemoteSolver(f"{base}/v1", "qwen", backoff=0.001) as any_name:
            [[t]] = any_name.answer(QUESTIONS[:1], tool())
            assert t.answer == secret(QUESTIONS[0]) and any_name.describe()["reply_models"] == {"smollm2": 2}


def test_faults_do_not_stop_an_evaluation_and_are_counted():
    items = [QAItem(f"q{i}", f"question number {i}", (secret(f"question number {i}"),)) for i in range(30)]
    faulty = ScriptedModel(searcher, fail_rate=0.35, garbage_rate=0.2, seed=5)
    with serve_app(make_app(faulty)) as base, solver(f"{base}/v1", max_retries=1, concurrency=8) as s:
        result = evaluate_solver(s, {"nq": items}, tool(), progress=False, batch_size=16)
        trajs = s.answer([it.question for it in items], tool())
    st = s.stats
    assert result["run"]["questions"] == 30
    detail = result["run"]["agent_detail"]  # the counters reach score.json, the key never does
    assert detail["stats"]["calls"] >= 30 and detail["api_key"] == "unset"
    assert st["failed_calls"] > 0 and st["retries"] > 0 and st["invalid_actions"] > 0  # all three happened
    assert st["requests"] == st["calls"] + st["retries"] == sum(faulty.requests.values())
    assert st["failed_trajectories"] == st["failed_calls"]  # each failure ends exactly one trajectory
    assert st["trajectories"] == 60 and st["unanswered"] >= st["failed_trajectories"]
    # a failed trajectory has no answer; every other one found the right word despite the garbage,
    # unless garbage (invalid actions, repeated searches after a correction) used up all its actions
    for it, (t,) in zip(items, trajs):
        if t.trace.failed:
            assert t.answer == "" and t.actions < 5
        elif t.answer:
            assert t.answer == it.golden_answers[0]
        else:
            assert t.actions == 5 and t.trace.invalid >= 1
    cover = result["benchmarks"]["nq"]["cover_em"]
    answered = 1 - sum(t.trace.failed for (t,) in trajs) / 30
    assert 0 < cover < 1 and 0 < answered < 1


def test_a_body_that_is_no_completion_is_retried_never_kept_as_a_reply():
    class GarbageFirst:
        name = "garbage-first"

        def __init__(self):
            self.n = 0

        def generate(self, messages, **settings):
            self.n += 1
            if self.n == 1:
                raise GarbageBody("injected")
            return ScriptedModel(searcher).generate(messages, **settings)

    with serve_app(make_app(GarbageFirst())) as base, solver(f"{base}/v1") as s:
        (traj,), = s.answer(["q"], tool())
        assert traj.answer == secret("q") and s.stats["malformed_bodies"] == 1 and s.stats["retries"] == 1
    events = []
    with serve_app(make_app(GarbageFirst())) as base, ChatClient(f"{base}/v1", "m", backoff=0.01,
                                                                 on_event=events.append) as client:
        first = client.chat([{"role": "system", "content": "s"}, {"role": "user", "content": "Question: q"}])
        assert first[0].text and "502 Bad Gateway" not in first[0].text
        assert events.count("malformed_body") == events.count("retry") == 1
    with serve_app(make_app(GarbageFirst())) as base, ChatClient(f"{base}/v1", "m", max_retries=0) as client:
        with pytest.raises(CallFailed, match="without a chat completion"):  # the caller's one bad call
            client.chat([{"role": "system", "content": "s"}, {"role": "user", "content": "Question: q"}])


def test_a_wrong_key_raises_at_once_and_never_leaks(monkeypatch):
    model = recording(searcher)
    with serve_app(make_app(model, api_key="right-key")) as base:
        url = f"{base}/v1"
        s = solver(url, api_key="wrong-key", concurrency=2)
        with pytest.raises(EndpointError) as e:
            s.answer([f"q{i}" for i in range(8)], tool())
        assert "401" in str(e.value) and "SELFEVO_API_KEY" in str(e.value) and "wrong-key" not in str(e.value)
        assert "wrong-key" not in repr(s) and "wrong-key" not in json.dumps(s.describe())
        assert s.stats["retries"] == 0 and s.stats["requests"] <= 8 and model.calls == []
        # through the registry: the key from the environment, checked before any work
        monkeypatch.setenv("SELFEVO_API_KEY", "wrong-key")
        with pytest.raises(ValueError, match="401"):
            load_agent(f"remote:scripted@{url}", corpus=None)
        monkeypatch.setenv("SELFEVO_API_KEY", "right-key")
        good = load_agent(f"remote:scripted@{url}", corpus=None)
        assert good.describe()["api_key"] == "set" and "right-key" not in json.dumps(good.describe())
        (traj,), = good.answer(["q"], tool())
        assert traj.answer == secret("q")
        # a wrong path is a 404, also at once
        with pytest.raises(EndpointError, match="404"):
            solver(base, api_key="right-key").answer(["q"], tool())
    with pytest.raises(ValueError, match="cannot connect"):  # the server is gone
        load_agent(f"remote:scripted@{url}")


def test_credentials_in_the_endpoint_url_are_never_shown_or_written():
    """`https://user:KEY@host/v1` (httpx sends it as basic auth) was written as typed into the agent's
    name and score.json's agent_detail, and quoted by errors; the key from the environment never is."""
    assert shown_url("https://user:k3y@host:8000/v1") == "https://***@host:8000/v1"
    assert shown_url("https://tok@host/v1") == "https://***@host/v1"
    assert shown_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/v1"
    assert shown_url("remote:org/m@https://u:k@h/v1") == "remote:org/m@https://***@h/v1"  # score.json's run.agent
    model = recording(searcher)
    with serve_app(make_app(model, api_key="right-key")) as base:  # refuses the basic auth: a 401
        s = solver(base.replace("://", "://user:url-secret@") + "/v1", concurrency=1)
        with pytest.raises(EndpointError) as e:
            s.answer(["q"], tool())
        assert "401" in str(e.value) and "url-secret" not in str(e.value)
        shown = s.name + repr(s) + repr(s.client) + json.dumps(s.describe())
        assert "url-secret" not in shown and "***@" in s.name and model.calls == []


def test_remote_spec():
    assert parse_remote_spec("qwen@http://127.0.0.1:8000/v1") == ("qwen", "http://127.0.0.1:8000/v1")
    assert parse_remote_spec("Qwen/Qwen3-4B@https://api.example/v1") == ("Qwen/Qwen3-4B", "https://api.example/v1")
    for bad in ("qwen", "@http://h/v1", "qwen@ftp://h"):
        with pytest.raises(ValueError, match="MODEL@URL"):
            load_agent(f"remote:{bad}")


# ------------------------------------------------------------------ the CLI


def titled(messages) -> str:
    """Searches the question, then answers with the title of the first page found."""
    found = re.search(r"Doc 1 \(Title: (.*?)\)", messages[-1]["content"])
    if messages[-1]["content"].startswith("<information>") and found:
        return f"<answer> {found.group(1)} </answer>"
    return f"<search> {question_of(messages)} </search>"


@pytest.mark.skipif(not QA_DIR.is_dir(), reason="shared QA data not present")
def test_selfevo_eval_with_a_remote_agent(tmp_path, monkeypatch):
    monkeypatch.delenv("SELFEVO_API_KEY", raising=False)
    model = recording(titled)
    out = tmp_path / "ev"
    with serve_app(make_app(model)) as base:
        spec = f"remote:scripted@{base}/v1"
        res = CliRunner().invoke(app, ["eval", "--data-dir", str(QA_DIR), "--corpus",
                                       str(CORPUS), "--agent", spec,
                                       "--out", str(out), "--limit", "2"])
    assert res.exit_code == 0, res.output
    score = json.loads((out / "score.json").read_text())
    assert score["run"]["agent"] == spec and score["run"]["questions"] == 14 == score["run"]["searches"]
    assert len(score["benchmarks"]) == 7
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 14 and len(model.calls) == 28
    seen = {c["messages"][1]["content"]: c["messages"][-1]["content"] for c in model.calls if len(c["messages"]) == 4}
    for row in rows:
        assert row["searches"] == [row["question"].strip()] and row["prediction"]
        # the prediction is the first title the retriever gave the model for this question
        assert f"Doc 1 (Title: {row['prediction']})" in seen[f"Question: {row['question'].strip()}"]


# ------------------------------------------------------------------ a real model


@pytest.mark.slow
def test_transformers_model_honours_stop():
    from selfevo.agents.lm.model import load_chat_model

    try:
        model = load_chat_model("smollm2", threads=1, max_new_tokens=40)
    except (FileNotFoundError, ImportError, OSError) as e:
        pytest.skip(str(e))
    msgs = [{"role": "user", "content": "Write two sentences about the sea."}]
    full = model.generate(msgs, max_tokens=40)[0].text
    words = full.split()
    assert len(words) > 6, full
    stop = " " + words[4]  # a string that occurs in the greedy reply, mid-way
    cut = model.generate(msgs, max_tokens=40, stop=[stop, "never-occurs-xyz"])[0]
    assert cut.text == full[:full.find(stop)] and cut.finish_reason == "stop"
    assert stop not in cut.text and cut.completion_tokens < model.generate(msgs, max_tokens=40)[0].completion_tokens


@pytest.mark.slow
def test_msv_with_the_source_shows_a_served_solver_what_the_loops_solver_sees(smollm2_path):
    """MSV's "with the source" samples: engine-run's RemoteSolver (admit.py) must show the same
    first lm.doc_tokens tokens of the source as the loop's LMSolver, not the whole document."""
    from selfevo.agents.lm.agents import LMSolver
    from selfevo.agents.lm.config import LMConfig
    from selfevo.agents.lm.policy import LMPolicy
    from selfevo.agents.remote import RemoteSolver
    from selfevo.integrations.engine import _truncator
    from selfevo.records import Document
    from selfevo.search.bm25 import BM25Index
    from selfevo.search.tool import SearchTool

    doc = Document("d0", "Long page", " ".join(f"word{i}" for i in range(2000)))
    tool, seen = SearchTool(BM25Index.build([doc])), {}
    cfg = LMConfig(model=str(smollm2_path), threads=1)
    policy = LMPolicy(cfg)
    policy.generate = lambda name, convs, **kw: (seen.setdefault("loop", convs[0][-1]["content"]),
                                                 [("<answer> x </answer>", "stop")] * len(convs))[1]
    LMSolver(policy, "main").answer(["Q?"], tool, greedy=False, n=1, seed=0, contexts=[doc])
    remote = RemoteSolver("http://127.0.0.1:9/v1", "main", context=_truncator(str(smollm2_path), cfg.doc_tokens))
    remote._generate = lambda convs, seed, greedy, streak, stop, rows: (
        seen.setdefault("engine", convs[0][-1]["content"]), [("<answer> x </answer>", "stop")] * len(convs))[1]
    remote.answer(["Q?"], tool, greedy=False, n=1, seed=0, contexts=[doc])
    assert seen["engine"] == seen["loop"]
    assert "word1999" not in seen["engine"]


@pytest.mark.skipif(not QA_DIR.is_dir(), reason="shared QA data not present")
def test_selfevo_eval_remote_base_url_without_v1_is_one_line_error(tmp_path):
    """A base URL without /v1 ends `selfevo eval` with one line, exit 2, not a traceback, and now at the
    probe, before any indexing: GET /models there is a 404, which passed for "no /models route", so
    the first chat call's 404 stopped it, after the index was built (a helper's review)."""
    with serve_app(make_app(recording(titled))) as base:
        res = CliRunner().invoke(app, ["eval", "--data-dir", str(QA_DIR), "--corpus", str(CORPUS),
                                       "--agent", f"remote:scripted@{base}", "--out", str(tmp_path / "ev"),
                                       "--limit", "1"])
    assert res.exit_code == 2, res.output
    said = " ".join(res.output.split())
    assert "error:" in said and "give the OpenAI base URL" in said and "Traceback" not in said
    assert not (tmp_path / "ev" / "score.json").exists() and not (tmp_path / "ev" / "bm25-index").exists()


def test_a_redirecting_endpoint_is_refused_at_once():
    """A redirect (http -> https, a moved proxy) was not followed, and its empty body was read as a
    200 "no chat completion": the probe passed, every call was retried as malformed and the
    evaluation finished with every question scored wrong (exit 0); the judge cached each call as a
    malformed reply, which a rerun with the right URL served again. Now an EndpointError at once."""
    from fastapi import FastAPI
    from fastapi.responses import RedirectResponse

    moved = FastAPI()

    @moved.api_route("/{path:path}", methods=["GET", "POST"])
    def redirect(path: str):
        return RedirectResponse(f"https://127.0.0.1:1/{path}", status_code=307)

    with serve_app(moved) as base:
        url = f"{base}/v1"
        with pytest.raises(ValueError, match="307"):  # the probe, before any work
            load_agent(f"remote:scripted@{url}")
        s = solver(url)
        with pytest.raises(EndpointError, match="redirected to https://127.0.0.1:1/v1/chat/completions"):
            s.answer(["q"], tool())
        assert s.stats["requests"] == 1 and s.stats["retries"] == 0
        with ChatClient(url, "judge") as judge_client, pytest.raises(EndpointError, match="307"):
            judge_client.complete([{"role": "user", "content": "hi"}])


def test_the_timeout_bounds_a_reply_trickled_in():
    """httpx's timeout bounds each read: a server sending its reply a few bytes at a time (a stuck
    proxy's keep-alive) held a call with timeout=1 for as long as it kept trickling. The timeout now
    bounds the whole call (a timeout, retried, then CallFailed)."""
    reply = json.dumps({"choices": [{"message": {"content": "<answer> x </answer>"}}]}).encode()
    trickler = trickling_app(reply, {"/v1/chat/completions": "POST", "/v1/models": "GET"}, 4, 0.25)  # ~4 s in all
    with serve_app(trickler) as base:
        client = ChatClient(f"{base}/v1", "m", timeout=1.0, max_retries=0)
        start = time.monotonic()
        with pytest.raises(CallFailed, match="ReadTimeout"):
            client.complete([{"role": "user", "content": "hi"}])
        assert time.monotonic() - start < 3.5  # ~1.25 s; the whole trickle, ~4 s (slack for a loaded machine)
        start = time.monotonic()  # the start-up probe too
        with pytest.raises(EndpointError, match="ReadTimeout"):
            client.check()
        assert time.monotonic() - start < 3.5
        # a reply that arrives in time reads as before
        assert ChatClient(f"{base}/v1", "m", timeout=30.0).complete([{"role": "user", "content": "hi"}]) == \
            "<answer> x </answer>"


def _mock(client: ChatClient, replies) -> list[httpx.Request]:
    """Route `client` to a transport answering with `replies` in turn (a response, an exception to
    raise, or a function making either: the last is repeated); returns the requests it saw."""
    seen: list[httpx.Request] = []

    def reply(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        r = replies[min(len(seen), len(replies)) - 1]
        r = r() if callable(r) else r
        if isinstance(r, Exception):
            raise r
        return r

    client._http = httpx.Client(transport=httpx.MockTransport(reply))
    return seen


def _ok(text: str = "ok") -> httpx.Response:
    body = {"choices": [{"message": {"content": text}, "finish_reason": "stop"}]}
    return httpx.Response(200, stream=httpx.ByteStream(json.dumps(body).encode()))  # the client streams


def _error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, stream=httpx.ByteStream(json.dumps({"error": {"message": message}}).encode()))


HI = [{"role": "user", "content": "hi"}]


def test_a_malformed_key_or_url_is_refused_up_front_and_the_key_is_never_shown(monkeypatch):
    """A key with a trailing space or a carriage return (from a file) made httpx refuse the header
    with an error quoting it whole, which reached the CLI's error line and the judge's verdicts
    (judgements.jsonl); a mistyped port was a traceback."""
    from selfevo.audit.llm_judge import JudgeError, LLMJudge

    for key in ("sk-SECRET-0123 ", "sk-SECRET-0123\r", "sk-SECRET\t0123"):
        with pytest.raises(EndpointError, match="SELFEVO_API_KEY: the API key holds whitespace") as e:
            ChatClient("http://127.0.0.1:8000/v1", "m", api_key=key)
        assert "SECRET" not in str(e.value)
        monkeypatch.setenv("SELFEVO_API_KEY", key)
        with pytest.raises(ValueError, match="whitespace or control characters") as e:
            load_agent("remote:m@http://127.0.0.1:8000/v1", corpus=None)
        assert "SECRET" not in str(e.value)
        with pytest.raises(JudgeError, match="SELFEVO_JUDGE_API_KEY: the API key holds whitespace"):
            LLMJudge("http://127.0.0.1:8000/v1", "m", api_key=key)
    monkeypatch.delenv("SELFEVO_API_KEY")
    with pytest.raises(EndpointError, match="a character that is not ASCII") as e:  # not "whitespace"
        ChatClient("http://127.0.0.1:8000/v1", "m", api_key="sk-SECRET…0123")
    assert "SECRET" not in str(e.value)
    for url in ("http://127.0.0.1:80x1/v1", "http://[::1/v1"):  # a one-line error, not a traceback
        with pytest.raises(ValueError, match=re.escape(f"{url}: not a valid URL (Invalid port")):
            load_agent(f"remote:m@{url}", corpus=None)
    with pytest.raises(EndpointError, match=r"not an http\(s\) URL with a host"):
        ChatClient("127.0.0.1:8000/v1", "m")
    # an error text that quotes the key (a transport error naming a header) is scrubbed of it
    client = ChatClient("http://fake/v1", "m", api_key="sk-SECRET-0123", max_retries=0)
    _mock(client, [httpx.ConnectError("refused: Bearer sk-SECRET-0123")])
    with pytest.raises(CallFailed) as e:
        client.complete(HI)
    assert "sk-SECRET" not in str(e.value) and "Bearer ***" in str(e.value)
    with pytest.raises(EndpointError) as e:
        client.check()
    assert "sk-SECRET" not in str(e.value) and "Bearer ***" in str(e.value)


def test_a_base_url_with_a_query_is_refused_and_a_surrogate_in_a_message_is_sent():
    """`…/v1?api-version=1` became `…/v1?api-version=1/chat/completions`; a lone surrogate in a message
    was a bare UnicodeEncodeError before anything was sent (a helper's review)."""
    for url in ("http://h:8000/v1?api-version=2024", "http://h:8000/v1#x"):
        with pytest.raises(EndpointError, match="a base URL takes no query or fragment"):
            ChatClient(url, "m")
    client = ChatClient("http://fake/v1", "m", max_retries=0)
    seen = _mock(client, [_ok("fine")])
    assert client.complete([{"role": "user", "content": "a\ud800b"}]) == "fine"
    assert json.loads(seen[0].content)["messages"][0]["content"] == "a\ufffdb"


def test_the_probe_asks_a_busy_endpoint_again():
    """One 503 on GET /models read as "lists no models": a judge's whole cache was then not used, the
    rerun paid again for every call, without a word (a helper's review). A busy reply is asked again;
    busy through every try, the probe says so."""
    listed = httpx.Response(200, stream=httpx.ByteStream(json.dumps({"data": [{"id": "judge"}]}).encode()))
    client = ChatClient("http://fake/v1", "judge", max_retries=2, backoff=0.01)
    seen = _mock(client, [_error(503, "loading"), _error(429, "slow down"), listed])
    assert client.check() == ["judge"] and len(seen) == 3
    client = ChatClient("http://fake/v1", "judge", max_retries=1, backoff=0.01)
    seen = _mock(client, [lambda: _error(503, "loading")])
    with pytest.warns(UserWarning, match=r"fake/v1/models answered HTTP 503 to 2 tries: read as listing no models"):
        assert client.check() == []
    assert len(seen) == 2
    client = ChatClient("http://fake/v1", "judge", max_retries=3, backoff=0.01)
    seen = _mock(client, [_error(404, "no route")])  # no /models route: no model listed, at once
    assert client.check() == [] and len(seen) == 1


def test_what_is_retried_and_what_the_server_said():
    events: list[str] = []
    client = ChatClient("http://fake/v1", "m", backoff=0.001, on_event=events.append)
    # a proxy's request timeout or a conflict is retried (as openai-python does)
    for status in (408, 409):
        seen = _mock(client, [httpx.Response(status, stream=httpx.ByteStream(b"")), _ok()])
        assert client.complete(HI) == "ok" and len(seen) == 2
    # a body that does not decode as its Content-Encoding says (a proxy's fault) is a malformed
    # reply, retried, not an uncaught DecodingError
    seen = _mock(client, [httpx.Response(200, headers={"Content-Encoding": "gzip"},
                                         stream=httpx.ByteStream(b"not gzip at all")), _ok()])
    assert client.complete(HI) == "ok" and len(seen) == 2 and events.count("malformed_body") == 1
    # any other 4xx: not retried, and the server's reason is in the error
    seen = _mock(client, [_error(400, "Unsupported parameter: 'stop'")])
    with pytest.raises(CallFailed, match=r"HTTP 400 \(not retried\): Unsupported parameter: 'stop'"):
        client.complete(HI)
    assert len(seen) == 1
    _mock(client, [_error(403, "Your input was flagged by moderation")])
    with pytest.raises(EndpointError, match="HTTP 403: Your input was flagged by moderation"):
        client.complete(HI)


def test_failed_calls_are_warned_with_the_servers_reason(caplog):
    s = solver("http://fake/v1", max_retries=0)
    _mock(s.client, [lambda: _error(400, "Unsupported parameter: 'stop'")])
    with caplog.at_level("WARNING", logger="selfevo.agents.remote"):
        (t1,), (t2,) = s.answer(QUESTIONS, tool())
    assert t1.trace.failed and t2.trace.failed and s.stats["failed_calls"] == 2
    assert "2 call(s) failed for good; their trajectories have no answer (last: HTTP 400 (not retried): " \
           "Unsupported parameter: 'stop')" in caplog.text
    # every call failing (a dead server, a parameter the endpoint refuses): the evaluation stops with
    # the server's reason instead of scoring every remaining question as unanswered, exit 0
    s = solver("http://fake/v1", max_retries=0, max_failed_in_a_row=5, concurrency=1)  # 5 exactly
    seen = _mock(s.client, [lambda: _error(400, "Unsupported parameter: 'stop'")])
    with pytest.raises(EndpointError, match=r"5 calls in a row failed for good \(last: HTTP 400 \(not retried\): "
                                            r"Unsupported parameter: 'stop'\); the endpoint is not answering"):
        s.answer([f"q{i}" for i in range(20)], tool())
    assert len(seen) == 5  # the rest were not sent
    # a reply between failures resets the count
    s = solver("http://fake/v1", max_retries=0, max_failed_in_a_row=2, concurrency=1)
    _mock(s.client, [lambda: _error(400, "no"), lambda: _ok("<answer> x </answer>")] * 3)
    assert [t.answer for (t,) in s.answer(["a", "b", "c"], tool())] == ["", "x", ""]


def test_a_stopping_caller_is_not_held_by_the_retries_of_calls_in_flight():
    """On Ctrl-C (or an endpoint error) the calls in flight went through all their retries before
    the evaluation could stop: with the defaults about 10 minutes. They now make no further attempt."""
    s = solver("http://fake/v1", max_retries=50, concurrency=2, backoff=0.05)

    def reply(request: httpx.Request) -> httpx.Response:
        if b"refuse me" in request.content:
            time.sleep(0.2)  # the other call is retrying by then
            return _error(403, "flagged")
        return httpx.Response(503, stream=httpx.ByteStream(b""))

    s.client._http = httpx.Client(transport=httpx.MockTransport(reply))
    start = time.monotonic()
    with pytest.raises(EndpointError, match="flagged"):
        s.answer(["refuse me", "retry me"], tool())
    assert time.monotonic() - start < 3  # 50 retries with backoff would take minutes
    assert s.stats["retries"] < 20


def test_sigterm_does_not_wait_out_the_calls_in_flight():
    """SIGTERM (or Ctrl-C) of an evaluation whose endpoint had stopped answering waited for the calls in
    flight to time out (120 s by default; 60 here): the pool's threads are joined at exit. Now at once."""
    with silent_endpoint() as (url, asked):
        took = stopped_within(f"""if True:
            from selfevo.agents.remote import RemoteSolver
            from selfevo.experiments import terminate_raises
            from selfevo.search.tool import SearchTool
            with terminate_raises():
                RemoteSolver({url + "/v1"!r}, "m", timeout=60).answer(["q1", "q2"], SearchTool(object()))
            """, asked, signal.SIGTERM)
    assert took < 15


def test_a_servers_synonyms_for_stop_close_the_action_as_stop_does():
    """Old TGI ends a reply with finish_reason "eos_token" (or "stop_sequence" at a stop string):
    read as anything but "stop", the `<search>` its stop string ended was left open, an invalid
    action, so every search from such a server was lost."""
    from selfevo.agents.lm.protocol import close_action, parse_action

    for sent, read in (("eos_token", "stop"), ("stop_sequence", "stop"), (None, "stop"), ("length", "length"),
                       ("content_filter", "content_filter")):
        body = {"choices": [{"message": {"content": "<search> q1 "}, "finish_reason": sent}]}
        client = ChatClient("http://fake/v1", "m", max_retries=0)
        _mock(client, [httpx.Response(200, stream=httpx.ByteStream(json.dumps(body).encode()))])
        (choice,) = client.chat(HI)
        assert choice.finish_reason == read, sent
        action = parse_action(close_action(choice.text, choice.finish_reason))
        assert (action.kind == "search") == (read == "stop"), sent


def test_a_key_quoted_by_the_server_is_never_shown():
    """The texts built from an error reply (401/403, 404, another 4xx) were not scrubbed: a server
    or proxy that quotes the key it refuses had it printed by `selfevo eval` and logged."""
    key = "sk-live-SECRET1234567890"
    client = ChatClient("http://fake/v1", "m", api_key=key, max_retries=0)
    long = "x" * 190 + key  # cut at 200 characters, a scrub after the cut would miss half the key
    for status, exc in ((401, EndpointError), (403, EndpointError), (404, EndpointError), (400, CallFailed),
                        (422, CallFailed)):
        for said in (f"Incorrect API key provided: {key}", long):
            _mock(client, [_error(status, said)])
            with pytest.raises(exc) as e:
                client.complete(HI)
            assert "SECRET" not in str(e.value) and f"HTTP {status}" in str(e.value), (status, str(e.value))
    _mock(client, [httpx.Response(400, stream=httpx.ByteStream(f"<html>bad key {key}</html>".encode()))])
    with pytest.raises(CallFailed, match=r"bad key \*\*\*") as e:  # a body that is no JSON error
        client.complete(HI)
    _mock(client, [_error(401, f"Incorrect API key provided: {key}")])
    with pytest.raises(EndpointError, match=r"provided: \*\*\*") as e:  # the probe
        client.check()
    assert "SECRET" not in str(e.value)


def test_a_retried_failure_says_what_the_server_said():
    """A call that failed for good on a 429 or 5xx said only "_Retryable: HTTP 500": the server's
    reason, which the README promises in the warning and in the stop after 16 failures, was dropped."""
    key = "sk-live-SECRET1234567890"
    client = ChatClient("http://fake/v1", "m", api_key=key, max_retries=1, backoff=0.001)
    for status in (429, 500, 503):
        _mock(client, [lambda status=status: _error(status, f"overloaded, key {key}")])
        with pytest.raises(CallFailed) as e:
            client.complete(HI)
        assert str(e.value) == f"HTTP {status}: overloaded, key ***", str(e.value)
    _mock(client, [lambda: httpx.Response(502, stream=httpx.ByteStream(b""))])
    with pytest.raises(CallFailed) as e:
        client.complete(HI)
    assert str(e.value) == "HTTP 502"
    _mock(client, [httpx.ConnectError("refused")])
    with pytest.raises(CallFailed, match="^ConnectError: refused$"):
        client.complete(HI)
    # a proxy's HTML page is said by its title, on one line (the warning and the stop are one line)
    page = ("<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway</h1>"
            "</center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n")
    _mock(client, [lambda: httpx.Response(502, stream=httpx.ByteStream(page.encode()))])
    with pytest.raises(CallFailed) as e:
        client.complete(HI)
    assert str(e.value) == "HTTP 502: 502 Bad Gateway"
    _mock(client, [lambda: httpx.Response(503, stream=httpx.ByteStream(b"upstream\n  connect error &amp; reset"))])
    with pytest.raises(CallFailed) as e:
        client.complete(HI)
    assert str(e.value) == "HTTP 503: upstream connect error & reset"


def test_a_call_waiting_to_retry_stops_when_its_caller_does():
    """The stop flag was read only after an attempt failed: a call sleeping out a Retry-After
    slept it out and made one more attempt. And the solver waited on its rows in order, so an
    endpoint error of a later row waited for an earlier row's Retry-After."""
    client = ChatClient("http://fake/v1", "m", max_retries=4, backoff=0.01)
    seen = _mock(client, [httpx.Response(429, headers={"Retry-After": "20"}, stream=httpx.ByteStream(b""))])
    stopped = threading.Event()
    threading.Timer(0.3, stopped.set).start()
    start = time.monotonic()
    with pytest.raises(CallFailed, match="HTTP 429"):
        client.complete(HI, stopped=stopped)
    assert time.monotonic() - start < 3 and len(seen) == 1

    s = solver("http://fake/v1", max_retries=4, concurrency=2, backoff=0.01)

    def reply(request: httpx.Request) -> httpx.Response:
        if b"refuse me" in request.content:
            time.sleep(0.3)  # the other call is waiting out its Retry-After by then
            return _error(401, "key revoked")
        return httpx.Response(429, headers={"Retry-After": "20"}, stream=httpx.ByteStream(b""))

    s.client._http = httpx.Client(transport=httpx.MockTransport(reply))
    start = time.monotonic()
    with pytest.raises(EndpointError, match="key revoked"):
        s.answer(["wait me", "refuse me"], tool())
    assert time.monotonic() - start < 3


def test_a_batch_that_stops_ends_its_own_retries_not_another_threads():
    """The stop flag was one per client: a batch failing on one thread (an endpoint error) ended the
    retries of another thread's batch on the same solver, whose call then failed for good (its
    question left unanswered), and a batch starting cleared the flag of one stopping."""
    s = solver("http://fake/v1", max_retries=3, concurrency=1, backoff=0.01)
    waited = threading.Event()

    def reply(request: httpx.Request) -> httpx.Response:
        if b"refuse me" in request.content:
            waited.wait(5)  # the other batch's call is waiting to retry by now
            return _error(401, "key revoked")
        if not waited.is_set():
            waited.set()
            return httpx.Response(429, headers={"Retry-After": "1"}, stream=httpx.ByteStream(b""))
        return _ok("<answer> Paris </answer>")

    s.client._http = httpx.Client(transport=httpx.MockTransport(reply))
    out, errors = {}, []

    def run(q: str) -> None:
        try:
            out[q] = s.answer([q], tool())[0][0].answer
        except EndpointError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=run, args=(q,)) for q in ("wait me", "refuse me")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(errors) == 1 and "key revoked" in errors[0]
    assert out == {"wait me": "Paris"}  # before: "" (its retry stopped by the other batch's error)


@pytest.mark.parametrize("reply, kind, content", [
    ("<think>x</think><search> a <answer> b </search> more", "search", "a <answer> b"),
    ("<answer> Paris <search> capital </answer> more", "answer", "Paris <search> capital"),
])
def test_a_server_that_names_its_stop_string_gets_the_action_a_local_backend_reads(reply, kind, content):
    """An OpenAI-compatible server drops the stop string, and the text alone cannot tell which one
    ended a reply that opened both tags: `close_action` guesses the tag opened last, which misreads
    these two. A server that names it (vLLM's and serve-model's `stop_reason`) is read exactly."""
    from selfevo.agents.lm.protocol import cut_at_stop, parse_action

    local = parse_action(cut_at_stop(reply))  # a local backend keeps the stop string
    assert (local.kind, local.content) == (kind, content)
    with serve_app(make_app(ScriptedModel(lambda messages: reply, name="scripted"))) as base:
        (traj,), = solver(f"{base}/v1", max_actions=1).answer(["q"], tool())
    first = parse_action(traj.trace.messages[2]["content"])
    assert (first.kind, first.content) == (kind, content)


def _body(obj_or_bytes) -> httpx.Response:
    raw = obj_or_bytes if isinstance(obj_or_bytes, bytes) else json.dumps(obj_or_bytes).encode()
    return httpx.Response(200, stream=httpx.ByteStream(raw))


def test_content_parts_are_the_reply_and_content_that_is_no_text_is_no_reply():
    """A message whose content is a list of parts (Mistral's API) was read as "", as was content of
    any other type (a number, an object): the question scored wrong, the judge cached an empty verdict."""
    events: list[str] = []
    client = ChatClient("http://fake/v1", "m", backoff=0.001, on_event=events.append)
    parts = [{"type": "thinking", "thinking": [{"type": "text", "text": "hmm"}]},
             {"type": "text", "text": "<answer> Paris"}, {"type": "text", "text": " </answer>"}]
    _mock(client, [_body({"choices": [{"message": {"content": parts}, "finish_reason": "stop"}]})])
    assert client.complete(HI) == "<answer> Paris </answer>"
    # null content (a tool call, a reasoning model that ran out of tokens thinking) is an empty reply
    _mock(client, [_body({"choices": [{"message": {"content": None}, "finish_reason": "length"}]})])
    assert client.chat(HI)[0].text == "" and events.count("malformed_body") == 0
    for content in (42, {"text": "x"}, [1, 2], [{"type": "text", "text": 7}]):
        seen = _mock(client, [_body({"choices": [{"message": {"content": content}}]}), _ok("fine")])
        assert client.complete(HI) == "fine" and len(seen) == 2  # retried, like any 200 that is no completion
    assert events.count("malformed_body") == 4


def test_a_body_nested_past_the_parsers_limit_is_a_malformed_reply_not_a_traceback():
    """json raises RecursionError (no ValueError) on it: it escaped the client and ended the evaluation."""
    deep = b"[" * 100_000 + b"]" * 100_000
    client = ChatClient("http://fake/v1", "m", backoff=0.001)
    seen = _mock(client, [_body(deep), _ok()])
    assert client.complete(HI) == "ok" and len(seen) == 2
    _mock(client, [lambda: httpx.Response(500, stream=httpx.ByteStream(deep))])  # read for its reason
    with pytest.raises(CallFailed, match="HTTP 500"):
        client.complete(HI)
    _mock(client, [_body(deep)])
    assert client.check() == []  # the probe's /models list


def test_an_error_in_a_200_is_quoted_when_the_call_fails():
    """A proxy answering 200 with `{"error": {...}}` failed as "HTTP 200 without a chat completion",
    without the reason the warning and the stop after 16 failures promise."""
    client = ChatClient("http://fake/v1", "m", max_retries=1, backoff=0.001, api_key="sk-SECRET-1")
    _mock(client, [lambda: _body({"error": {"message": "quota exceeded for key sk-SECRET-1"}})])
    with pytest.raises(CallFailed, match=r"HTTP 200 without a chat completion: quota exceeded for key \*\*\*$"):
        client.complete(HI)


def test_a_lone_surrogate_in_a_reply_is_replaced_so_the_reply_can_be_written(tmp_path):
    """JSON can escape half a surrogate pair ("\\ud83d"): the text came through as such and failed every
    later write of it (UnicodeEncodeError): the LLM judge's cache line was a traceback ending the audit."""
    from selfevo.audit.llm_judge import LLMJudge

    content = '{"reference": "1908", "quote": "He was born in 1908. \ud83d"}'  # a real lone surrogate
    reply = {"model": "judge\ud83d", "choices": [{"message": {"content": content}, "finish_reason": "stop"}]}
    raw = json.dumps(reply).encode()  # ensure_ascii: the lone surrogate as the escape \ud83d
    assert b"\\ud83d" in raw
    client = ChatClient("http://fake/v1", "m")
    _mock(client, [lambda: _body(raw)])
    (choice,) = client.chat(HI)
    assert choice.text.endswith("1908. \ufffd\"}") and choice.model == "judge\ufffd"
    assert choice.text.encode("utf-8")  # writable
    _mock(client, [lambda: _error(400, "cannot tokenize \ud83d")])  # an error quoting it: printed, logged
    with pytest.raises(CallFailed) as e:
        client.complete(HI)
    assert str(e.value).endswith("cannot tokenize \ufffd")

    item = {"question": "In which year was Yeir Rukreist born?", "adopted_label": "1908", "responses": ["1908"] * 5,
            "sources": [{"id": "d1", "text": "Yeir Rukreist is a person. He was born in 1908."}]}
    judge = LLMJudge("http://fake/v1", "judge", cache_path=tmp_path / "cache.jsonl", backoff=0.001)
    _mock(judge.client, [lambda: _body(raw)])
    (verdict,) = judge.judge([item])
    assert verdict.resolved is False and "quote not found" in verdict.reason  # the quote is not the source's
    assert (tmp_path / "cache.jsonl").read_text(encoding="utf-8").count("\n") == 1


def test_a_reply_larger_than_the_bound_fails_its_call_at_once():
    """A reply's time was bounded, not its size: a server sending hundreds of MB filled memory before the
    reply failed to parse (a review's 400 MB reply: 1.8 GB). Past `max_reply_bytes` the call fails, not
    retried (the same request gets the same reply), and the start-up probe says so too."""
    events: list[str] = []
    client = ChatClient("http://fake/v1", "m", backoff=0.001, on_event=events.append)
    client.max_reply_bytes = 1000
    seen = _mock(client, [_ok("x" * 2000), _ok()])
    with pytest.raises(CallFailed, match=r"larger than 1,000 bytes \(not retried\)"):
        client.complete(HI)
    assert len(seen) == 1 and events.count("malformed_body") == 1
    assert client.complete(HI) == "ok"  # the next, small, reply reads
    _mock(client, [_body({"data": [{"id": "m" * 2000}]})])
    with pytest.raises(EndpointError, match="larger than 1,000 bytes"):
        client.check()


# ------------------------------------------------------------------ mutation-sweep additions


class _NoWait(threading.Event):
    """A `stopped` event that records each wait before a retry instead of sleeping it."""

    def __init__(self):
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return False


def test_a_retry_after_past_the_cap_waits_only_the_cap():
    from selfevo.search.client import MAX_WAIT_S

    client = ChatClient("http://fake/v1", "m", backoff=0.001)
    seen = _mock(client, [httpx.Response(429, headers={"Retry-After": "86400"}, stream=httpx.ByteStream(b"")),
                          _ok()])
    stopped = _NoWait()
    assert client.chat(HI, stopped=stopped)[0].text == "ok" and len(seen) == 2
    assert stopped.waits == [MAX_WAIT_S]


def test_a_negative_retry_count_is_refused():
    with pytest.raises(ValueError, match="max_retries"):
        ChatClient("http://fake/v1", "m", max_retries=-1)
    ChatClient("http://fake/v1", "m", max_retries=0).close()


def test_a_300_is_refused_at_once_like_any_redirect():
    client = ChatClient("http://fake/v1", "m", backoff=0.001)
    seen = _mock(client, [httpx.Response(300, headers={"Location": "http://other/v1"}, stream=httpx.ByteStream(b"")),
                          _ok()])
    with pytest.raises(EndpointError, match="HTTP 300, redirected to http://other/v1"):
        client.complete(HI)
    assert len(seen) == 1


def test_json_mode_asks_for_a_json_object_and_a_call_may_turn_it_off():
    client = ChatClient("http://fake/v1", "m", json_mode=True)
    assert client.body(HI)["response_format"] == {"type": "json_object"}
    assert "response_format" not in client.body(HI, json_mode=False)
    assert "response_format" not in ChatClient("http://fake/v1", "m").body(HI)


def test_a_completion_with_no_choices_is_retried_not_an_empty_reply():
    events: list[str] = []
    client = ChatClient("http://fake/v1", "m", backoff=0.001, on_event=events.append)
    seen = _mock(client, [_body({"choices": []}), _ok()])
    assert client.complete(HI) == "ok" and len(seen) == 2 and events.count("malformed_body") == 1


def test_the_clients_timeout_is_the_http_timeout_of_every_read():
    """httpx's own default (5 s a read) must not cut a generation the caller gives 120 s (nor wait
    5 s for a server the caller gives 0.5 s): each connect and read waits the client's timeout."""
    for timeout in (0.5, 120.0):
        with ChatClient("http://fake/v1", "m", timeout=timeout) as client:
            assert client._http.timeout == httpx.Timeout(timeout)


def test_a_url_given_with_its_chat_route_is_the_base_url():
    client = ChatClient("http://fake/v1/chat/completions/", "m", max_retries=0)
    seen = _mock(client, [_ok()])
    assert client.complete(HI) == "ok" and str(seen[0].url) == "http://fake/v1/chat/completions"
    assert client.base_url == "http://fake/v1"


def test_what_the_server_said_is_cut_to_200_characters():
    client = ChatClient("http://fake/v1", "m", max_retries=0)
    _mock(client, [_error(400, "x" * 5000)])
    with pytest.raises(CallFailed) as e:
        client.complete(HI)
    assert str(e.value) == "HTTP 400 (not retried): " + "x" * 200


def test_a_probe_answered_with_an_error_lists_no_models_whatever_its_body():
    client = ChatClient("http://fake/v1", "m", max_retries=0)
    body = json.dumps({"data": [{"id": "m"}], "error": {"message": "no such route"}}).encode()
    _mock(client, [httpx.Response(404, stream=httpx.ByteStream(body))])
    assert client.check() == []


def test_remote_settings_are_checked_and_the_model_ends_at_the_first_at_http():
    with pytest.raises(ValueError, match="max_actions"):
        RemoteSolver("http://fake/v1", "m", max_actions=0)
    assert parse_remote_spec("m@http://h/v1@http://x") == ("m", "http://h/v1@http://x")
    with pytest.raises(ValueError, match="n must be >= 1"):
        solver("http://fake/v1").answer(["a"], tool(), n=0)


def test_the_failure_that_completes_the_streak_stops_the_batch_even_as_its_last_call():
    s = solver("http://fake/v1", max_retries=0, max_failed_in_a_row=3, concurrency=1)
    seen = _mock(s.client, [lambda: _error(400, "no")])
    with pytest.raises(EndpointError, match="3 calls in a row failed for good"):
        s.answer(["a", "b", "c"], tool())
    assert len(seen) == 3


def test_an_error_in_vllms_shape_is_quoted():
    client = ChatClient("http://fake/v1", "m", max_retries=0)
    _mock(client, [httpx.Response(400, stream=httpx.ByteStream(json.dumps({"message": "bad request"}).encode()))])
    with pytest.raises(CallFailed) as e:
        client.complete(HI)
    assert str(e.value) == "HTTP 400 (not retried): bad request"


def test_the_probe_asks_again_after_a_timeout():
    listed = _body({"data": [{"id": "judge"}]})
    client = ChatClient("http://fake/v1", "judge", max_retries=1, backoff=0.001)
    seen = _mock(client, [httpx.ReadTimeout("slow"), listed])
    assert client.check() == ["judge"] and len(seen) == 2


def test_a_server_without_v1_routes_either_is_not_told_to_add_v1():
    """The "…/v1" hint is given only when {url}/v1/models answers as a model list does."""
    client = ChatClient("http://fake", "m", max_retries=0)
    not_found = lambda: httpx.Response(404, stream=httpx.ByteStream(b'{"detail": "Not Found"}'))  # noqa: E731
    seen = _mock(client, [not_found])
    assert client.check() == [] and [r.url.path for r in seen] == ["/models", "/v1/models"]


def test_settings_of_the_request_body():
    """An empty finish_reason is "stop"; a lone stop string is one stop string; `n` is sent."""
    from selfevo.agents.chat_client import openai_finish_reason

    assert openai_finish_reason("") == "stop" and openai_finish_reason(None) == "stop"
    client = ChatClient("http://fake/v1", "m", stop="</search>")
    assert client.body(HI)["stop"] == ["</search>"] and client.body(HI, n=3)["n"] == 3
    assert client.body(HI, stop="</answer>")["stop"] == ["</answer>"]


def test_a_source_is_shown_as_the_context_callable_makes_it():
    """`context` is what a source shown with a question becomes (the loop's solver's first tokens)."""
    s = solver("http://fake/v1", context=lambda text: f"FIRST TOKENS OF {len(text)} CHARACTERS")
    seen = _mock(s.client, [_ok("<answer> x </answer>")])
    s.answer(["q"], tool(), contexts=[Document("p1", "Zebra page", "The secret word is zebra.")])
    opening = json.loads(seen[0].content)["messages"][1]["content"]
    assert "FIRST TOKENS OF" in opening and "zebra" not in opening


def test_the_wait_before_a_retry_has_jitter_on_top_of_the_exponential_backoff():
    client = ChatClient("http://fake/v1", "m", backoff=1.0)
    _mock(client, [_error(503, "busy"), _error(503, "busy"), _ok()])
    stopped = _NoWait()
    assert client.chat(HI, stopped=stopped)[0].text == "ok"
    assert 1.0 < stopped.waits[0] < 2.0 and 2.0 < stopped.waits[1] < 3.0  # 1, 2 (backoff), + uniform(0, 1)


def test_credentials_behind_an_upper_case_scheme_are_hidden_too():
    """A URL's scheme is case-insensitive (`HTTPS://user:KEY@host` works as well): its key is hidden as well."""
    assert shown_url("HTTPS://user:k3y@host/v1") == "HTTPS://***@host/v1"
    assert shown_url("remote:m@Http://u:k@h:8000/v1") == "remote:m@Http://***@h:8000/v1"


# ------------------------------------------------------------------ the scripted model


def test_an_empty_stop_string_stops_nothing_and_the_earliest_stop_wins():
    assert cut_before_stop("abc", ["", "c"]) == ("ab", "c")
    assert cut_before_stop("abc", [""]) == ("abc", None)
    [c] = ScriptedModel(lambda messages: "one two. three").generate([{"role": "user", "content": "q"}], stop=[""])
    assert (c.text, c.finish_reason, c.stop_reason) == ("one two. three", "stop", None)


def test_the_prompt_digest_is_the_sha256_of_its_canonical_utf8_json():
    """Clients compute it too (and a judge cache keys replies by it): non-ASCII text is hashed as UTF-8, not
    as \\u escapes, and only role and content count."""
    canon = '[{"content":"Zürich — 東京","role":"user"}]'
    assert messages_digest([{"role": "user", "content": "Zürich — 東京", "name": "x"}]) == hashlib.sha256(
        canon.encode("utf-8")).hexdigest()


def test_the_echo_script_replies_with_the_last_user_message():
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "first"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "last"}]
    assert echo_script(chat) == "last" and echo_script(chat[:1]) == ""


def test_the_scripted_model_refuses_rates_outside_zero_to_one_and_a_negative_delay():
    for field, bad in (("fail_rate", 1.5), ("garbage_rate", -0.1), ("slow_rate", 2.0)):
        with pytest.raises(ValueError, match=rf"^{field}: must be in \[0, 1\], got {bad}$"):
            ScriptedModel(echo_script, **{field: bad})
    with pytest.raises(ValueError, match=r"fail_rate \+ garbage_rate must be at most 1"):
        ScriptedModel(echo_script, fail_rate=0.6, garbage_rate=0.5)
    with pytest.raises(ValueError, match="delay: must be >= 0, got -0.5"):
        ScriptedModel(echo_script, delay=-0.5)
    ScriptedModel(echo_script, fail_rate=0.5, garbage_rate=0.5, slow_rate=1.0, delay=0.0)  # the edges are taken


def test_the_scripted_model_counts_words_as_tokens_and_cuts_at_the_budget():
    model = ScriptedModel(lambda messages: "a b c. d e")
    msgs = [{"role": "system", "content": "two words"}, {"role": "user", "content": "three more words"}]
    [c] = model.generate(msgs, max_tokens=5)  # exactly the budget: whole, "stop"
    assert (c.text, c.finish_reason, c.prompt_tokens, c.completion_tokens, c.stop_reason) == (
        "a b c. d e", "stop", 5, 5, None)
    [c] = model.generate(msgs, max_tokens=2)
    assert (c.text, c.finish_reason, c.completion_tokens, c.stop_reason) == ("a b", "length", 2, None)
    [c] = model.generate(msgs, max_tokens=2, stop=["d"])  # "a b c. " is still over the budget: no stop reached
    assert (c.text, c.finish_reason, c.completion_tokens, c.stop_reason) == ("a b", "length", 2, None)
    got = model.generate(msgs, max_tokens=9, stop=[" d"], n=3)
    assert [(c.text, c.finish_reason, c.completion_tokens, c.stop_reason) for c in got] == [
        ("a b c.", "stop", 3, " d")] * 3


def test_injected_faults_are_both_429s_and_500s_about_three_to_seven():
    model = ScriptedModel(echo_script, fail_rate=1.0, seed=3)
    statuses = []
    for i in range(300):
        with pytest.raises(ModelFault) as e:
            model.generate([{"role": "user", "content": f"q{i}"}])
        statuses.append(e.value.status)
    assert set(statuses) == {429, 500} and 0.2 < statuses.count(429) / 300 < 0.4
    assert dict(model.faults) == {"429": statuses.count(429), "500": statuses.count(500)} and not model.served


def test_a_scripted_spec_loads_a_registered_script_under_its_spec_name():
    scripts = {"shout": lambda: lambda messages: "HI"}
    model = load_chat_model("scripted:shout", scripts=scripts, fail_rate=0.5)
    assert model.name == "scripted:shout" and model.fail_rate == 0.5
    assert load_chat_model("scripted:echo").name == "scripted:echo"
    with pytest.raises(ValueError, match=r"unknown script 'nope' \(known: echo, shout\)"):
        load_chat_model("scripted:nope", scripts=scripts)
    assert ScriptedModel(scripts["shout"]()).generate([{"role": "user", "content": "q"}])[0].text == "HI"


def test_a_solver_without_a_worker_is_refused_up_front():
    """concurrency 0 is refused when the solver is made, naming the setting, not at the first batch
    (where the thread pool would refuse it with its own words, after an index was built)."""
    with pytest.raises(ValueError, match="concurrency: must be >= 1, got 0"):
        RemoteSolver("http://fake/v1", "m", concurrency=0)


def test_a_row_that_ends_early_changes_no_other_rows_seeds():
    """A call's seed comes from its conversation's place in the batch, not among those still running:
    a question answered at its first action leaves the seeds of every other question's calls as they were."""
    def quick_or_search(messages):
        return "<answer> now </answer>" if "quick" in question_of(messages) else searcher(messages)

    model = recording(quick_or_search)

    def seeds(questions):
        model.calls.clear()
        with solver(url) as s:
            s.answer(questions, tool(), greedy=False, seed=5)
        return {(question_of(c["messages"]), len(c["messages"])): c["seed"] for c in model.calls}

    with serve_app(make_app(model)) as base:
        url = f"{base}/v1"
        both_search = seeds(["slow a", "slow b"])
        first_ends = seeds(["quick a", "slow b"])
    assert len(both_search) == 4 and len(first_ends) == 3  # b's two actions; a's one or two
    assert both_search[("slow b", 2)] == first_ends[("slow b", 2)]
    assert both_search[("slow b", 4)] == first_ends[("slow b", 4)]


def test_a_client_without_a_key_sends_no_authorization_header(monkeypatch):
    """No key (none given, or SELFEVO_API_KEY set but empty) sends no Authorization header at all: a
    "Bearer None" is a key that a server or proxy checking any key it is sent refuses."""
    seen = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        seen.append(request.headers.get("authorization"))
        return {"model": "m", "choices": [{"message": {"content": "<answer> x </answer>"}, "finish_reason": "stop"}]}

    monkeypatch.setenv("SELFEVO_API_KEY", "")
    with serve_app(app) as base:
        with ChatClient(f"{base}/v1", "m") as client:
            assert client.complete(HI) == "<answer> x </answer>"
        with solver(f"{base}/v1") as s:
            assert s.answer(["q"], tool())[0][0].answer == "x"
            assert s.describe()["api_key"] == "unset"
        with ChatClient(f"{base}/v1", "m", api_key="k3y") as client:
            client.complete(HI)
    assert seen == [None, None, "Bearer k3y"]


def test_every_servers_word_for_stop_is_read_as_stop_and_other_reasons_are_kept():
    """TGI's "eos_token" / "stop_sequence", "eos" and Anthropic-style "end_turn" all mean the model stopped
    by itself: read otherwise, the action a stop string ended stays open (an invalid action)."""
    said = ["eos_token", "eos", "stop_sequence", "end_turn", "stop", "length", "tool_calls", "content_filter"]
    assert [openai_finish_reason(r) for r in said] == ["stop"] * 5 + ["length", "tool_calls", "content_filter"]


def test_a_transport_error_is_named_by_its_class_and_its_text_when_it_has_one():
    """The CallFailed of a transport error reads "ReadTimeout" when httpx gives no text, not "ReadTimeout: ",
    and "ConnectError: <text>" when it does."""
    for raised, said in ((httpx.ReadTimeout(""), "ReadTimeout"),
                         (httpx.ConnectError("connection refused"), "ConnectError: connection refused")):
        client = ChatClient("http://fake/v1", "m", max_retries=0)
        _mock(client, [raised])
        with pytest.raises(CallFailed) as failed:
            client.chat(HI)
        assert str(failed.value) == said


def test_the_exponential_backoff_stops_growing_at_max_backoff():
    """backoff 1 s doubles each retry (1, 2, 4, ...) up to max_backoff (3 s here), then jitter of up to
    `backoff` on top: the 5th wait is 3-4 s, not 16-17."""
    client = ChatClient("http://fake/v1", "m", max_retries=5, backoff=1.0, max_backoff=3.0)
    _mock(client, [lambda: _error(503, "busy")] * 5 + [_ok()])
    stopped = _NoWait()
    assert client.chat(HI, stopped=stopped)[0].text == "ok"
    assert len(stopped.waits) == 5
    assert 1.0 <= stopped.waits[0] <= 2.0 and all(3.0 <= w <= 4.0 for w in stopped.waits[2:])


def test_a_425_and_a_429_are_retried_like_the_other_busy_replies():
    """"Too early" (425) and rate limiting (429) are asked again, as 408, 409 and 5xx are (openai-python
    does so too): read as any other 4xx, one call failed for good and its question scored wrong."""
    for status in (425, 429):
        client = ChatClient("http://fake/v1", "m", backoff=0.001)
        seen = _mock(client, [httpx.Response(status, stream=httpx.ByteStream(b"")), _ok()])
        assert client.complete(HI) == "ok" and len(seen) == 2, status


def test_a_content_part_without_a_type_is_text():
    """A list of content parts whose parts carry no "type" is read as text parts (the type defaults to
    text), in order; a part of another type is left out."""
    client = ChatClient("http://fake/v1", "m", max_retries=0)
    parts = [{"text": "<answer> Paris"}, {"type": "reasoning", "text": "hmm"}, {"text": " </answer>"}]
    _mock(client, [_body({"choices": [{"message": {"content": parts}, "finish_reason": "stop"}]})])
    assert client.complete(HI) == "<answer> Paris </answer>"


def test_a_misspelt_setting_of_a_request_body_is_refused_naming_it():
    """`body` takes only the client's settings: a misspelt one is a TypeError naming it, not a setting
    silently dropped (a "temprature" the server never sees)."""
    client = ChatClient("http://fake/v1", "m")
    with pytest.raises(TypeError, match="unknown chat settings: temprature"):
        client.body(HI, temprature=0.5)
    assert client.body(HI, temperature=0.5)["temperature"] == 0.5


def test_only_a_stop_string_of_the_protocol_is_put_back_and_only_when_the_reply_stopped():
    """The action gets back the stop string a server names only when it is one of the protocol's own
    ("</search>", "</answer>") and the reply stopped: a server-side stop string ("<|im_end|>") is not put
    into the answer, and a reply cut by its length stays cut."""
    for stop_reason, finish_reason, content, answer in (("<|im_end|>", "stop", "<answer> Paris </answer>", "Paris"),
                                                        ("</answer>", "length", "<answer> Paris ", "")):
        s = solver("http://fake/v1", max_actions=1, max_retries=0)
        _mock(s.client, [_body({"choices": [{"message": {"content": "<answer> Paris "}, "finish_reason": finish_reason,
                                             "stop_reason": stop_reason}]})])
        (traj,), = s.answer(["q"], tool())
        assert (traj.trace.messages[2]["content"], traj.answer) == (content, answer), stop_reason


def test_a_batch_runs_on_at_most_concurrency_threads(monkeypatch):
    """`concurrency` bounds the calls a batch has in flight (a hosted API's rate limit, a server's
    slots): the pool is never larger, nor larger than the batch."""
    import selfevo.agents.remote as remote

    sizes: list[int] = []

    class Pool(remote.DaemonThreads):
        def __init__(self, max_workers, **kw):
            sizes.append(max_workers)
            super().__init__(max_workers, **kw)

    monkeypatch.setattr(remote, "DaemonThreads", Pool)
    s = solver("http://fake/v1", concurrency=2, max_retries=0)
    _mock(s.client, [lambda: _ok("<answer> x </answer>")])
    assert [t.answer for (t,) in s.answer([f"q{i}" for i in range(5)], tool())] == ["x"] * 5
    s = solver("http://fake/v1", concurrency=8, max_retries=0)
    _mock(s.client, [lambda: _ok("<answer> x </answer>")])
    assert s.answer(["q"], tool())[0][0].answer == "x"
    assert sizes == [2, 1]


def test_a_probe_reply_that_does_not_decode_is_an_endpoint_error_not_a_traceback():
    """A /models reply whose body does not decode as its Content-Encoding says (a proxy's fault) stops the
    start-up check with one line naming the URL, as a refused connection does, not an httpx traceback."""
    client = ChatClient("http://fake/v1", "m", max_retries=0)
    _mock(client, [httpx.Response(200, headers={"Content-Encoding": "gzip"}, stream=httpx.ByteStream(b"not gzip"))])
    with pytest.raises(EndpointError, match=r"^http://fake/v1/models: a reply body that does not decode as its "
                                            "Content-Encoding says"):
        client.check()


def test_sixteen_failed_calls_in_a_row_stop_a_batch_by_default():
    """The documented default (README, docs/judge.md): 16 calls failing for good with no reply between stop
    the evaluation, naming the URL; the calls after them are not sent."""
    s = solver("http://fake/v1", max_retries=0, concurrency=1)
    seen = _mock(s.client, [lambda: _error(400, "no")])
    with pytest.raises(EndpointError, match=r"^http://fake/v1: 16 calls in a row failed for good \(last: HTTP 400"):
        s.answer([f"q{i}" for i in range(20)], tool())
    assert len(seen) == 16


def test_a_refused_key_sends_none_of_the_calls_still_queued():
    """A 401 ends the batch: the calls queued behind it are not sent (each would be refused the same way,
    and a hosted API may count them). Before, only the pool's cancelling stopped them, once the batch's own
    thread woke: 1 or 2 were sent on Python 3.11, all 20 on 3.13 (its one worker took them first), and more
    than 1 in each of 3 runs on 3.11 with the threads switching every microsecond."""
    for _ in range(10):
        s = solver("http://fake/v1", max_retries=0, concurrency=1)
        seen = _mock(s.client, [lambda: _error(401, "key revoked")])
        with pytest.raises(EndpointError, match="HTTP 401: key revoked"), frequent_thread_switches():
            s.answer([f"q{i}" for i in range(20)], tool())
        assert len(seen) == 1


def test_the_stats_count_a_reply_cut_by_its_length_as_truncated_not_invalid():
    """A reply cut at max_tokens after a whole action is a truncated trajectory, not an invalid action: the
    two counts in `describe()["stats"]` tell a too small max_tokens from a model that ignores the protocol."""
    s = solver("http://fake/v1", max_actions=1, max_retries=0)
    _mock(s.client, [_body({"choices": [{"message": {"content": "<answer> x </answer> and so"},
                                         "finish_reason": "length"}]})])
    (t,), = s.answer(["q"], tool())
    assert t.answer == "x"
    stats = s.describe()["stats"]
    assert (stats["truncated_trajectories"], stats["invalid_actions"], stats["unanswered"]) == (1, 0, 0)


def test_a_timed_out_call_is_counted_as_a_timeout_and_a_retry():
    """The records count the timeouts of an evaluation's calls (a too small --timeout shows there)."""
    s = solver("http://fake/v1", max_actions=1)
    _mock(s.client, [httpx.ReadTimeout("slow"), _ok("<answer> x </answer>")])
    (t,), = s.answer(["q"], tool())
    assert t.answer == "x"
    assert (s.stats["timeouts"], s.stats["retries"], s.stats["requests"], s.stats["replies"]) == (1, 1, 2, 1)


def test_a_remote_spec_with_whitespace_around_it_is_read_without_it():
    """A spec pasted with a space or read from a file with its newline is the same spec, not an error."""
    assert parse_remote_spec("  qwen@http://127.0.0.1:8000/v1\n") == ("qwen", "http://127.0.0.1:8000/v1")


def test_an_interrupt_while_the_chat_server_starts_stops_it(monkeypatch):
    """`running`'s start-up wait sat outside its cleanup: a Ctrl-C there (or its time-out) left the model
    served on a thread for the rest of the process."""
    import types

    from selfevo.agents.lm import server as chat_server

    release = threading.Event()

    @contextlib.asynccontextmanager
    async def started_once_released(app):  # (uvicorn could start before the wait's first look, under load)
        while not release.is_set():
            await asyncio.sleep(0.01)
        yield

    def interrupted(seconds):
        release.set()
        raise KeyboardInterrupt

    before = set(threading.enumerate())
    monkeypatch.setattr(chat_server, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=interrupted))
    with pytest.raises(KeyboardInterrupt), chat_server.running(FastAPI(lifespan=started_once_released)):
        raise AssertionError("served before the start-up wait was interrupted")
    assert set(threading.enumerate()) <= before
