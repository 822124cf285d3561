"""Defects of the TRL/verl reward glue and the remote solver that earlier reviews listed as known and
left alone: a TRL rows file missing a field, verl's batch grading seeded by a batch's first item,
a remote solver's failure count shared by the batches of several threads, and an auxiliary solver
with nothing to train on passed over in silence."""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest

from selfevo.agents import remote as remote_mod
from selfevo.agents.base import Trajectory
from selfevo.agents.chat_client import EndpointError
from selfevo.agents.remote import RemoteSolver
from selfevo.corpus import DataError
from selfevo.integrations.rewards import compute_score, compute_score_batch, reward_settings
from selfevo.integrations.routing import Grader
from selfevo.loop.folds import FoldAssignment
from selfevo.loop.schedule import derive_seed
from selfevo.records import Document
from selfevo.search.tool import Hit, SearchTool

FOLDS = FoldAssignment(2, 0, "source", {"d0": 0, "d1": 1}, {})


# ---------------------------------------------------------------- TRL rows


def test_a_trl_row_missing_a_field_is_named_by_file_line_and_field(tmp_path):
    """A hand-written rows file whose second row has no `hops`: a bare KeyError('hops') from the
    dataset builder, naming neither file nor line."""
    pytest.importorskip("trl")
    from selfevo._io import write_jsonl
    from selfevo.integrations.datasets import solver_rows
    from selfevo.integrations.trl_job import run_job

    items = [{"item_id": f"i{n}", "question": f"q{n}?", "adopted_label": "a", "draft_label": "a", "source_id": "d0",
              "fold": 0, "hops": 1} for n in range(2)]
    rows = solver_rows(items, FOLDS, 1)
    del rows[1]["hops"]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = {"kind": "solver", "model": str(tmp_path / "no-model"), "rows": str(tmp_path / "rows.jsonl"), "steps": 1,
           "prompts_per_step": 2, "processes": 1, "search": {"retriever_url": "http://127.0.0.1:9/retrieve"},
           "out": str(tmp_path / "out"), "generations": 2, "lr": 1e-6, "rollout": {}, "reward": {"round": 1}}
    with pytest.raises(DataError, match=r"rows\.jsonl:2: missing field\(s\) 'hops' "):
        run_job(job)


# ---------------------------------------------------------------- verl batch grading


class _SeededSolver:
    """Stands in for RemoteSolver: seeds each sample by the batch seed and its row, as the remote
    solver does, and answers by that seed."""

    calls: list[tuple[list[str], int]] = []

    def __init__(self, url, model, **_):
        pass

    def answer(self, questions, tool, *, greedy, n, seed):
        _SeededSolver.calls.append((list(questions), seed))
        return [[Trajectory(answer="sea" if derive_seed(seed, "row", q * n + s) % 2 else "land") for s in range(n)]
                for q in range(len(questions))]

    def close(self):
        pass


def test_verl_batch_grades_an_item_as_it_is_graded_alone(tmp_path, monkeypatch):
    """compute_score_batch seeded a grader's batch by its first item: the same proposal drew other
    samples (another k, another reward) graded alone or beside another one."""
    monkeypatch.setattr(remote_mod, "RemoteSolver", _SeededSolver)
    _SeededSolver.calls = []
    graders = {"main": Grader("main", "http://127.0.0.1:9/v1", "main", "main@r0", (), ())}
    settings = reward_settings(tmp_path / "s.json", treatment="coupled", round=1, folds=FOLDS, graders=graders,
                               items_path=tmp_path / "items.jsonl", retriever_url="http://127.0.0.1:9", samples=8)
    a = "<question> Where is Alpha? </question> <answer> sea </answer>"
    b = "<question> Where is Beta? </question> <answer> sea </answer>"
    info = {"source_id": "d1", "hops": 1}
    alone = compute_score("selfevo_proposer", b, {"target": []}, info, selfevo_settings=str(settings))
    batch = compute_score_batch(["selfevo_proposer"] * 2, [a, b], [{"target": []}] * 2, [info, info],
                                selfevo_settings=str(settings))
    calls = _SeededSolver.calls
    assert [q for q, _ in calls] == [["Where is Beta?"], ["Where is Alpha?"], ["Where is Beta?"]]
    assert calls[2][1] == calls[0][1]  # graded alone in the batch too, with its own seed
    assert batch[1] == alone
    staged = [json.loads(line)["item"] for line in (tmp_path / "items.jsonl").read_text().splitlines()]
    assert staged[0]["question"] == staged[2]["question"] == "Where is Beta?"
    assert staged[0]["responses"] == staged[2]["responses"]
    assert staged[1]["responses"] != staged[2]["responses"]  # batch mates still draw their own samples


# ---------------------------------------------------------------- a remote solver shared across threads


class _Pages:
    def retrieve(self, queries, topk=3):
        return [[Hit(Document(f"p{k}", "P", "page"), 1.0) for k in range(topk)] for _ in queries]


def _reply(status: int, text: str) -> httpx.Response:
    body = ({"choices": [{"message": {"content": text}, "finish_reason": "stop"}]} if status == 200
            else {"error": {"message": text}})
    return httpx.Response(status, stream=httpx.ByteStream(json.dumps(body).encode()))


def test_a_batch_starting_on_another_thread_does_not_undo_a_failing_batchs_stop():
    """verl's reward calls share one RemoteSolver across threads. A batch starting reset the one
    failure count: a batch whose every call failed went on past `max_failed_in_a_row` (here 3) while
    another thread began grading."""
    s = RemoteSolver("http://fake/v1", "m", max_retries=0, backoff=0.001, concurrency=1, max_failed_in_a_row=3)
    dead_calls, b_sent, a_done = [], threading.Event(), threading.Event()
    b_result: list = []
    b_thread = threading.Thread(target=lambda: b_result.append(s.answer(["alive?"], SearchTool(_Pages()))))

    def reply(request: httpx.Request) -> httpx.Response:
        if b"alive?" in request.content:
            b_sent.set()
            a_done.wait(10)  # B's call is in flight until A has stopped
            return _reply(200, "<answer> yes </answer>")
        dead_calls.append(request)
        if len(dead_calls) == 3:  # A has failed twice: B starts its batch before A's third failure
            b_thread.start()
            assert b_sent.wait(10)
        return _reply(400, "refused")

    s.client._http = httpx.Client(transport=httpx.MockTransport(reply))
    try:
        with pytest.raises(EndpointError, match="3 calls in a row failed for good"):
            s.answer([f"dead {i}" for i in range(10)], SearchTool(_Pages()))
    finally:
        a_done.set()
        b_thread.join(10)
    assert len(dead_calls) == 3  # A stopped at its own third failure in a row
    assert [[t.answer for t in ts] for ts in b_result[0]] == [["yes"]]  # B is not stopped by A's failures



# ---------------------------------------------------------------- an aux phase with nothing to train on


def test_an_engine_aux_phase_with_no_rows_says_its_solver_grades_untrained(tmp_path):
    # before: the phase logged {"trained": false} in the phase log and said nothing
    from selfevo.integrations import engine as eng

    cfg = {"backend": "lm", "treatment": "crossfit", "world": {"name": "small"},
           "loop": {"rounds": 2, "proposer_steps": 2, "solver_steps": 3, "admit_per_round": 10, "source_docs": 40},
           "engine": {"retriever_url": "http://127.0.0.1:9/retrieve"}}
    said = []
    run = eng.EngineRun(eng.engine_config_from_dict(cfg, engine="trl"), tmp_path, log=said.append)
    run._admitted_rows = lambda r: [{"fold": 0, "source_folds": [0]}]  # fold 0's only
    assert run.aux(1, "aux-1") == {"trained": False}
    assert said == ["  warning: round 1: auxiliary solver aux-1 had no admitted question to train on; it grades "
                    "round 2 untrained, as the base model"]


# ---------------------------------------------------------------- what an overhead ratio counts


def test_an_engine_runs_audit_is_not_counted_as_training(tmp_path):
    """engine-run counted its audit phase's seconds (a judge over every item, or a cache's seconds) in
    compute.json, and `compare` read them as training: every overhead ratio moved with the judge."""
    from selfevo.integrations.engine import AUDIT_PHASE, PhaseLog
    from selfevo.report.compare import training_cost

    log = PhaseLog(tmp_path / "phases.jsonl")
    for phase, seconds in (("r0/eval", 100.0), ("r1/proposer", 1000.0), ("r1/main", 1000.0), ("r1/aux-0", 500.0),
                           (AUDIT_PHASE, 3000.0)):
        log.add({"phase": phase, "round": 1, "seconds": seconds})
    compute = log.compute()
    assert "audit" not in compute["seconds"] and training_cost(compute)[1] == 2500.0
    older = {**compute, "seconds": {**compute["seconds"], "audit": 3000.0}}  # an engine run of an earlier version
    assert training_cost(older)[1] == 2500.0


def test_an_aux_solvers_checkpoint_write_is_not_counted_as_its_training(tmp_path, monkeypatch):
    """The write of the step checkpoint after each auxiliary solver's training was timed as "aux": CrossFit's
    overhead alone, where no other arm's checkpoint writes are counted."""
    import time

    from selfevo.config import load_config
    from selfevo.evolve import evolve
    from selfevo.runs import RunDir

    write = RunDir.step_checkpoint

    def slow(self, state):
        time.sleep(0.5)
        write(self, state)

    monkeypatch.setattr(RunDir, "step_checkpoint", slow)
    cfg = load_config(None, ["treatment=crossfit", "world.name=small", "loop.rounds=2", "loop.proposer_steps=2",
                             "loop.solver_steps=2", "loop.admit_per_round=20"])
    evolve(cfg, tmp_path / "run", progress=False, step_checkpoints=1)
    compute = json.loads((tmp_path / "run" / "compute.json").read_text())
    assert compute["seconds"]["aux"] < 0.5  # two aux checkpoints (1 s of sleep) were counted before


# ---------------------------------------------------------------- MSV over a served model that fails


def test_msv_over_a_failing_endpoint_stops_the_phase_rather_than_rejecting_proposals():
    """A call that failed for good came back as an empty answer, MSV found no majority and rejected the
    proposal: admitted questions lost to a server's outage, the run going on with exit 0."""
    from types import SimpleNamespace

    from selfevo.integrations.admit import msv_filter
    from selfevo.integrations.rewards import GradingFailed

    doc = Document("d1", "Alpha", "Alpha is a river.")
    item = {"question": "What is Alpha?", "draft_label": "river", "source_id": "d1", "source_ids": ["d1"], "hops": 1}

    class Served:
        def __init__(self, failing):
            self.failing = failing

        def answer(self, questions, tool, n=1, **kw):
            return [[Trajectory(answer="" if self.failing and i == 0 else "river",
                                trace=SimpleNamespace(failed=self.failing and i == 0)) for i in range(n)]
                    for _ in questions]

    tool = SearchTool(_Pages())
    assert [d.admitted for d in msv_filter([item], Served(False), {"d1": doc}, tool, seed=0)] == [True]
    with pytest.raises(GradingFailed, match="MSV: 1 of 3 samples"):
        msv_filter([item], Served(True), {"d1": doc}, tool, seed=0)


# ---------------------------------------------------------------- [engine] fields checked when read


@pytest.mark.parametrize("engine, named", [
    ({"retriever_url": "127.0.0.1:8000/retrieve"}, "engine.retriever_url: expected http(s)://"),
    ({"retriever_url": "http://127.0.0.1:8000/retrieve", "launcher": 'accelerate launch --config_file "x'},
     "engine.launcher: No closing quotation"),
    ({"engine": "verl", "retriever_url": "http://127.0.0.1:8000/retrieve", "verl": {"actor_rollout_ref.rollout.n": 2}},
     "engine.verl.actor_rollout_ref.rollout.n: set by the engine"),
    ({"engine": "verl", "retriever_url": "http://127.0.0.1:8000/retrieve",
      "verl": {"reward.custom_reward_function.path": "/tmp/other.py"}}, "engine.verl.reward.custom_reward_function"),
    ({"trl": {"ignore_data_skip": True}}, "engine.trl.ignore_data_skip: pinned"),
])
def test_engine_settings_that_would_fail_late_or_replace_the_engines_own_are_refused_when_read(engine, named):
    """A URL without a scheme, a launcher with an open quote failed only after r0/eval; an [engine.verl] key
    replaced the group size, step count or reward the engine sets (a helper's review)."""
    from selfevo.config import ConfigError
    from selfevo.integrations.engine import engine_config_from_dict

    cfg = {"backend": "lm", "treatment": "coupled", "world": {"name": "small"},
           "lm": {"proposer_scaffold": False, "adapter": "full"}, "engine": engine}
    with pytest.raises(ConfigError, match=re.escape(named)):
        engine_config_from_dict(cfg)
    free = {"engine": "verl", "retriever_url": "http://127.0.0.1:8000/retrieve",
            "verl": {"trainer.logger": ["console", "wandb"], "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,
                     "trainer": {"nnodes": 2}}}  # (a TOML table's dotted keys nest: read as dotted keys)
    ecfg = engine_config_from_dict({**cfg, "engine": free})  # where it logs, how it shares the GPU: the user's
    assert ecfg.engine.verl["trainer.nnodes"] == 2
    nested = {**free, "verl": {"actor_rollout_ref": {"rollout": {"n": 2}}}}
    with pytest.raises(ConfigError, match=re.escape("engine.verl.actor_rollout_ref.rollout.n: set by the engine")):
        engine_config_from_dict({**cfg, "engine": nested})


def test_engine_run_refuses_folds_left_empty_before_writing_anything(tmp_path):
    """`evolve` refuses a treatment that leaves a fold without source documents; engine-run created the run,
    trained round 1 and graded round 2 with auxiliary solvers that never trained."""
    from selfevo.config import ConfigError
    from selfevo.integrations import engine as eng

    cfg = {"backend": "lm", "treatment": "crossfit-k30", "world": {"name": "small"},
           "loop": {"rounds": 2, "proposer_steps": 2, "solver_steps": 30, "admit_per_round": 10, "source_docs": 40},
           "engine": {"retriever_url": "http://127.0.0.1:9/retrieve"}}
    with pytest.raises(ConfigError, match="leaves fold"):
        eng.EngineRun(eng.engine_config_from_dict(cfg, engine="trl"), tmp_path / "run", log=print)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- a remote call's seed


def test_a_remote_calls_seed_is_its_rows_not_its_place_among_the_rows_still_running():
    """Per-call seeds were derived from a conversation's place among those still running: a row whose call
    failed for good (or that answered early) changed the seeds of every later row of its batch."""
    def seeds_of_turn_2(failing: bool) -> dict[str, int]:
        calls: dict[str, list[int]] = {}

        def reply(request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content)
            question = body["messages"][1]["content"].rsplit("Question: ", 1)[-1].strip()
            calls.setdefault(question, []).append(body["seed"])
            if failing and question.startswith("q0"):
                return _reply(400, "refused")
            return _reply(200, "<search> x </search>" if len(calls[question]) == 1 else "<answer> a </answer>")

        s = RemoteSolver("http://fake/v1", "m", max_retries=0, backoff=0.001, concurrency=1)
        s.client._http = httpx.Client(transport=httpx.MockTransport(reply))
        s.answer(["q0", "q1", "q2"], SearchTool(_Pages()), greedy=False, n=1, seed=5)
        return {q: seeds[1] for q, seeds in calls.items() if len(seeds) > 1}

    alive, failed = seeds_of_turn_2(False), seeds_of_turn_2(True)
    assert set(failed) == {"q1", "q2"} and failed == {q: alive[q] for q in failed}
