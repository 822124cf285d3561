"""selfevo.integrations on CPU, without training: routing by lineage, the rewards in TRL's and verl's
calling conventions against real loopback grader endpoints, datasets as the libraries load them,
admission (MSV included) and the verl configs."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import itertools
import json
import os
import random
import re
import runpy
import shlex
import shutil
import stat
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from selfevo._io import append_jsonl, write_jsonl
from selfevo.agents.base import Proposal, Trajectory
from selfevo.agents.lm.model import ScriptedModel, model_identity
from selfevo.agents.lm.protocol import format_information, proposer_messages, solver_messages, solver_question
from selfevo.agents.lm.server import make_app, running
from selfevo.algos import frontier_reward
from selfevo.integrations import trl_env, trl_job
from selfevo.integrations.admit import (
    admit_round,
    commit_records,
    merge_step_records,
    msv_filter,
    read_staged,
    trim_staged,
)
from selfevo.integrations.datasets import (
    aux_training_sets,
    one_pass,
    proposer_rows,
    read_verl,
    solver_rows,
    to_trl,
    write_verl,
)
from selfevo.integrations.rewards import (
    FrontierReward,
    GradingFailed,
    ProposalSample,
    TRLFrontierReward,
    TRLSolverReward,
    compute_score,
    compute_score_batch,
    extract_answer,
    reward_settings,
)
from selfevo.integrations.routing import Grader, RoutingError, aux_roles, grader_role, item_fold, route
from selfevo.integrations.trl_job import (
    _save,
    _save_as_the_job_says,
    grpo_args,
    job_tool,
    last_checkpoint,
    trainer_dir,
)
from selfevo.integrations.verl_launch import (
    FREE_VERL,
    SETTINGS_KEY,
    VerlPhase,
    merge_command,
    phase_overrides,
    phase_script,
    pinned_verl,
    write_reward_shim,
)
from selfevo.integrations.verl_search import search_response, tool_config
from selfevo.loop.admission import Decision
from selfevo.loop.feedback import AuxFeedback, CoupledFeedback
from selfevo.loop.folds import FoldAssignment
from selfevo.loop.schedule import derive_seed
from selfevo.loop.treatments import parse_treatment
from selfevo.records import Document
from selfevo.search.bm25 import BM25Index
from selfevo.search.server import make_app as retriever_app
from selfevo.search.tool import SearchTool

DOCS = [Document("d0", "Alpha", "Alpha is a river in the north."), Document("d1", "Beta", "Beta is a city by the sea."),
        Document("d2", "Gamma", "Gamma was founded by Alpha settlers."), Document("d3", "Delta", "Delta is a delta.")]
FOLDS = FoldAssignment(2, 0, "connected", {"d0": 0, "d1": 1, "d2": 0, "d3": 1}, {"d0": "d0", "d2": "d0"})
HAVE_VERL = importlib.util.find_spec("verl") is not None


@pytest.fixture(scope="module")
def tool():
    return SearchTool(BM25Index.build(DOCS), topk=2, max_calls=2)


# ---------------------------------------------------------------- routing


class _Stub:
    def __init__(self, name):
        self.name, self.lineage = name, {}

    def snapshot(self, name=None):
        return _Stub(name)


class _Item:
    def __init__(self, fold, source_ids):
        self.fold = fold
        self.proposal = type("P", (), {"source_ids": tuple(source_ids)})()


@pytest.mark.parametrize("treatment", ["coupled", "crossfit", "crossfit-connected", "crossfit-k3", "same-source",
                                       "full-data", "question-split", "half-budget"])
def test_grader_role_is_the_loops_rule(treatment):
    """The endpoint routing and `loop.feedback` choose the same grader for every fold, lineage and round."""
    t = parse_treatment(treatment)
    folds = FoldAssignment(t.k, 0, t.grouping, {f"s{i}": i % t.k for i in range(6)})
    if t.feedback == "coupled":
        rule = CoupledFeedback(folds)
    else:
        opts = {"crossfit": {}, "half-budget": {"budget": 0.5}, "same-source": {"grades": "own-fold"},
                "full-data": {"trains": "everything", "grades": "full"}, "question-split": {"split": "question"}}
        rule = AuxFeedback(t.name, folds, _Stub, 25, 5, lineage_aware=t.grouping == "connected", **opts[t.feedback])
    rnd = random.Random(0)
    for r in (1, 2, 3):
        rule.begin_round(r, _Stub("main"))
        for _ in range(30):
            sources = rnd.sample(sorted(folds.folds), rnd.randint(1, 3))
            item = _Item(rnd.randrange(t.k), sources)
            touched = folds.lineage(sources) if t.grouping == "connected" else {item.fold}
            role, _ = grader_role(t, r, item.fold, touched)
            assert rule.grader_for(item).name.split("@")[0] == role


def test_question_split_folds_questions_not_proposals():
    """The question-level control: a question asked again (another proposal, another source id,
    other case or spacing) lands in the fold it had, in the loop and at the endpoint alike, while
    questions from one source land in both folds."""
    folds = FoldAssignment(2, 0, "source", {"s0": 0, "s1": 1})
    rule = AuxFeedback("question-split", folds, _Stub, 25, 5, split="question")
    questions = [f"Where was Person {i} born?" for i in range(40)]
    got = []
    for q in questions:
        fold = rule.item_fold(Proposal(q, "x", "s0", ("s0",), 1))
        again = Proposal("  " + q.upper().replace(" ", "  "), "y", "s1", ("s1",), 1)
        assert rule.item_fold(again) == fold
        assert item_fold("question-split", folds, "s0", q) == fold
        got.append(fold)
    assert set(got) == {0, 1}
    assert item_fold("crossfit", folds, "s1", questions[0]) == 1  # CrossFit: the source's fold


def _seeded_grader(name: str, calls: list, answers):
    """A loopback grader whose i-th reply answers answers(i, question) (concurrency 1: calls in row order)."""
    lock = threading.Lock()

    def script(messages):
        question = messages[-1]["content"].rsplit("Question: ", 1)[-1]
        with lock:
            i = len(calls)
            calls.append(question)
        return f"<answer> {answers(i, question)} </answer>"
    return ScriptedModel(script, name=name)


def _graders(urls_and_lineage):
    return {role: Grader(role, url, role, f"{role}@r1", folds, (1,)) for role, (url, folds) in urls_and_lineage.items()}


REMOTE = {"concurrency": 1, "max_actions": 1, "max_tokens": 32, "max_retries": 0}


def test_frontier_reward_routes_each_fold_to_the_other_folds_grader(tool, tmp_path):
    """Two aux graders on real loopback endpoints, each answering with its identity twice in five
    (so k = 2 when the draft label names the grader): a fold-0 question is graded by aux-1 only,
    a fold-1 question by aux-0 only, and the reward is f(k) of the responses recorded."""
    calls0, calls1 = [], []
    aux0 = _seeded_grader("aux-0", calls0, lambda i, q: "zero" if i % 5 < 2 else "none")
    aux1 = _seeded_grader("aux-1", calls1, lambda i, q: "one" if i % 5 < 2 else "none")
    with running(make_app(aux0)) as url0, running(make_app(aux1)) as url1:
        graders = _graders({"aux-0": (url0, (0,)), "aux-1": (url1, (1,)), "main": (url0, (0, 1))})
        reward = FrontierReward(treatment="crossfit", round=2, folds=FOLDS, graders=graders, tool=tool,
                                items_path=tmp_path / "items.jsonl", remote=REMOTE, step_base=43)
        trl = TRLFrontierReward(reward)
        completions = [[{"role": "assistant", "content": "<question> Which river is in the north? </question> "
                                                         "<answer> one </answer>"}],
                       [{"role": "assistant", "content": "<question> What city is by the sea? </question> "
                                                         "<answer> one </answer>"}],
                       [{"role": "assistant", "content": "<question> no question here"}]]
        rewards = trl([[]] * 3, completions, source_id=["d0", "d1", "d3"], hops=[1, 1, 2])
        reward.close()
    # d0 (fold 0) -> aux-1, which says "one" twice: k=2; d1 (fold 1) -> aux-0, never "one": k=0
    assert rewards == [frontier_reward(2), 0.0, -0.5]
    assert calls1 == ["Which river is in the north?"] * 5 and calls0 == ["What city is by the sea?"] * 5
    staged = read_staged(tmp_path / "items.jsonl")
    items = [r["item"] for r in staged if "item" in r]
    assert [it["grader"]["id"] for it in items] == ["aux-1@r1", "aux-0@r1"]
    for it in items:  # the rule the issue names: never a grader whose lineage includes the item's fold
        assert it["fold"] not in it["grader"]["trained_on"]["folds"]
        assert it["k"] == sum(z == it["draft_label"] for z in it["responses"])
        assert it["reward"] == frontier_reward(it["k"])
    assert items[0]["item_id"] == "r2-s44-0" and items[0]["responses"].count("one") == 2
    malformed = [r["malformed"] for r in staged if "malformed" in r]
    # no closed <answer>: no answer action, so no final question (the loop's reason for such a rollout)
    assert malformed[0]["format_error"] == "no final question" and malformed[0]["reward"] == -0.5


def test_the_frontier_reward_over_served_graders_counts_its_samples(tool, tmp_path):
    """FrontierReward pays f(k) over its own sample count: 2 of 3 samples agreeing pays 1/2 (over the
    paper's 5 it would pay 3/4)."""
    calls = []
    aux1 = _seeded_grader("aux-1", calls, lambda i, q: "one" if i % 3 < 2 else "none")
    with running(make_app(aux1)) as url:
        graders = _graders({"aux-0": (url, (0,)), "aux-1": (url, (1,)), "main": (url, (0, 1))})
        reward = FrontierReward(treatment="crossfit", round=2, folds=FOLDS, graders=graders, tool=tool,
                                items_path=tmp_path / "items.jsonl", remote=REMOTE, samples=3)
        rewards = TRLFrontierReward(reward)([[]], [[{"role": "assistant", "content": "<question> Which river is "
                                                     "in the north? </question> <answer> one </answer>"}]],
                                            source_id=["d0"], hops=[1])
        reward.close()
    assert len(calls) == 3 and rewards == [frontier_reward(2, 3)] == [0.5]


def test_a_grader_trained_on_the_questions_fold_is_refused(tool, tmp_path):
    graders = _graders({"aux-0": ("http://127.0.0.1:9/v1", (0,)), "aux-1": ("http://127.0.0.1:9/v1", (0, 1))})
    with pytest.raises(RoutingError, match="aux-1@r1 trained on fold"):
        route("crossfit", 2, 0, {0}, graders)
    with pytest.raises(RoutingError, match="no such grader"):
        route("crossfit", 2, 0, {0}, {"aux-0": graders["aux-0"]})
    # same-source is the control that grades with the own fold on purpose: allowed
    assert route("same-source", 2, 0, {0}, graders).grader.role == "aux-0"
    # K = 3, a question of fold 0 that read a fold-1 page: its grader (aux-2) must not have trained on
    # fold 1 either, not only not on the question's own fold (a check of {0} alone passed aux-2 here)
    three = _graders({"aux-0": ("http://127.0.0.1:9/v1", (0,)), "aux-1": ("http://127.0.0.1:9/v1", (1,)),
                      "aux-2": ("http://127.0.0.1:9/v1", (1, 2))})
    with pytest.raises(RoutingError, match="aux-2@r1 trained on fold"):
        route("crossfit-connected-k3", 2, 0, {0, 1}, three)
    three["aux-2"] = _graders({"aux-2": ("http://127.0.0.1:9/v1", (2,))})["aux-2"]
    routed = route("crossfit-connected-k3", 2, 0, {0, 1}, three)
    assert routed.grader.role == "aux-2" and not routed.fallback


def test_connected_grouping_routes_by_every_page_read(tool, tmp_path):
    """crossfit-connected: a question from a fold-1 source that read a fold-0 page touches both
    folds (the loop's fallback, recorded); one that read only fold-1 pages goes to aux-0."""
    calls0, calls1 = [], []
    with running(make_app(_seeded_grader("aux-0", calls0, lambda i, q: "x"))) as url0, \
            running(make_app(_seeded_grader("aux-1", calls1, lambda i, q: "x"))) as url1:
        graders = _graders({"aux-0": (url0, (0,)), "aux-1": (url1, (1,))})
        reward = FrontierReward(treatment="crossfit-connected", round=3, folds=FOLDS, graders=graders, tool=tool,
                                items_path=tmp_path / "items.jsonl", remote=REMOTE)
        text = "<question> Where is Beta? </question> <answer> sea </answer>"
        reward.score([ProposalSample(text, "d1", 1, ("d3",)), ProposalSample(text, "d1", 1, ("d0",))], step=1)
        reward.close()
    a, b = [r["item"] for r in read_staged(tmp_path / "items.jsonl")]
    assert a["source_folds"] == [1] and a["grader"]["id"] == "aux-0@r1" and "routing" not in a
    assert b["source_folds"] == [0, 1] and b["routing"] == {"fallback": True, "touched": [0, 1]}


def test_coupled_grades_everything_with_the_main_solver(tool, tmp_path):
    calls = []
    with running(make_app(_seeded_grader("main", calls, lambda i, q: "sea"))) as url:
        reward = FrontierReward(treatment="msv+coupled", round=2, folds=FOLDS,
                                graders=_graders({"main": (url, (0, 1))}), tool=tool,
                                items_path=tmp_path / "i.jsonl", remote=REMOTE)
        from selfevo.integrations.rewards import ProposalSample

        out = reward.score([ProposalSample("<question> Where is Beta? </question> <answer> sea </answer>", s, 1)
                            for s in ("d0", "d1")], step=1)
        reward.close()
    assert out == [0.0, 0.0] and len(calls) == 10  # k = 5: a question every sample gets right pays nothing


# ---------------------------------------------------------------- solver reward, verl convention


def test_solver_reward_trl_and_records(tmp_path):
    rf = TRLSolverReward(tmp_path / "steps.jsonl", round=1, step_base=0, first_step_in_round=19,
                         grader={"id": "main", "trained_on": {"folds": [], "rounds": []}})
    # a question holding the prefix itself was recorded from its second "Question: " on (a helper's review)
    quiz = "Who hosted the show whose catchphrase is 'Question: who dares?'"
    prompts = [solver_messages("Where is Beta?")] * 2 + [solver_messages(quiz)] * 2
    completions = ["<search> beta </search>\n<information>Doc 1 <answer> decoy </answer></information>"
                   "<answer> The sea </answer>", [{"role": "assistant", "content": "<answer> land </answer>"}],
                   "no answer at all", [{"role": "assistant", "content": "<answer> a river! </answer>"}]]
    cols = {"item_id": ["a", "a", "b", "b"], "source_id": ["d1", "d1", "d0", "d0"],
            "source_ids": [["d1"]] * 2 + [["d0"]] * 2, "fold": [1, 1, 0, 0], "source_folds": [[1]] * 2 + [[0]] * 2,
            "hops": [1] * 4, "draft_label": ["sea"] * 2 + ["river"] * 2}
    assert rf(prompts, completions, label=["sea", "sea", "river", "river"], **cols) == [1.0, 0.0, 0.0, 1.0]
    (record,) = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert record["kind"] == "solver" and record["step"] == 19 and record["step_in_round"] == 19
    assert [(it["item_id"], it["question"], it["k"], it["reward"]) for it in record["items"]] == \
        [("a", "Where is Beta?", 1, 0.5), ("b", quiz, 1, 0.5)]
    rendered = "<|im_start|>system\n...<|im_end|>\n<|im_start|>user\nQuestion: " + quiz  # a prompt as text
    assert solver_question(rendered) == quiz


def test_verl_compute_score_solver_rows():
    gt = {"target": ["Stratford-upon-Avon"]}
    assert compute_score("selfevo_solver", "<think>x</think><answer> stratford upon avon </answer>", gt) == 0.0
    assert compute_score("selfevo_solver", "<answer> Stratford-upon-Avon. </answer>", gt) == 1.0
    assert extract_answer("<answer> a </answer> then <answer> b </answer>") == "a"
    with pytest.raises(ValueError, match="unknown data_source"):
        compute_score("nq", "<answer> x </answer>", gt)
    with pytest.raises(ValueError, match="selfevo_settings"):
        compute_score("selfevo_proposer", "<question> q </question> <answer> a </answer>", None, {"source_id": "d0"})


def test_the_solver_reward_reads_the_answer_as_the_rollout_does(tool):
    """Two answers in the last turn: the rollout takes the first (`protocol.parse_action`, the action
    ends at its first </answer>), and so does the reward, in verl's string and TRL's chat form."""
    from selfevo.agents.lm.rollout import run_rollouts

    turns = ["<think>look it up</think> <search> Beta </search>",
             "<think>got it</think> <answer> Beta city </answer> or maybe <answer> Gamma </answer>"]
    (ro,) = run_rollouts([[{"role": "user", "content": "Question: what is Beta?"}]], tool,
                         lambda convs, seed: [(turns[len(convs[0]) // 2], "stop")])  # 1 message, then 3
    assert ro.searches == ["Beta"] and ro.answer == "Beta city"
    assert extract_answer(ro.messages[1:]) == ro.answer  # chat: the last assistant turn
    text = "".join(m["content"] for m in ro.messages[1:])  # verl: one decoded response string
    assert "</information>" in text and extract_answer(text) == ro.answer
    assert compute_score("selfevo_solver", text, {"target": ["Beta city"]}) == 1.0
    assert compute_score("selfevo_solver", text, {"target": ["Gamma"]}) == 0.0
    assert TRLSolverReward()([None], [ro.messages[1:]], label=["beta city"]) == [1.0]
    # a last turn that searches first gives no answer, as in the rollout
    assert extract_answer("<search> x </search> <answer> y </answer>") == ""


def test_the_solver_reward_reads_a_whole_trajectory_in_one_assistant_message():
    """TRL decodes a rollout_func's completion_ids (actions and <information> observations) into ONE
    assistant message; without the rollout's `answer` column the reward must read it as the string
    form (and verl) read it, not stop at the first <search>."""
    traj = ("<search> beta </search>\n\n<information>Doc 1 (Title: Beta) Beta is a city by the sea.</information>"
            "\n\n<answer> sea </answer>")
    assert TRLSolverReward()([None], [traj], label=["sea"]) == [1.0]
    assert TRLSolverReward()([None], [[{"role": "assistant", "content": traj}]], label=["sea"]) == [1.0]
    assert extract_answer([{"role": "assistant", "content": traj}]) == extract_answer(traj) == "sea"
    assert compute_score("selfevo_solver", traj, {"target": ["sea"]}) == 1.0


def test_verl_compute_score_proposer_through_retriever_and_graders(tmp_path):
    """verl's convention end to end: settings JSON, a /retrieve server for the graders' searches, the
    graders on loopback; the pages the proposer read (extra_info.selfevo_read) decide the lineage."""
    index = BM25Index.build(DOCS)
    calls = []

    def answers(i, q):
        return "sea" if i % 5 < 3 else "land"
    with running(retriever_app(index)) as rurl, running(make_app(_seeded_grader("g", calls, answers))) as gurl:
        graders = _graders({"aux-0": (gurl, (0,)), "aux-1": (gurl, (1,))})
        settings = reward_settings(tmp_path / "s.json", treatment="crossfit", round=2, folds=FOLDS, graders=graders,
                                   items_path=tmp_path / "items.jsonl", retriever_url=rurl.removesuffix("/v1"),
                                   remote=REMOTE)
        sol = ("<search> beta </search>\n<information>Doc 1 (Title: Beta) …</information>\n"
               "<question> Where is Beta? </question> <answer> sea </answer>")
        one = compute_score("selfevo_proposer", sol, {"target": []}, {"source_id": "d1", "hops": 1,
                                                                      "selfevo_read": ["d1"]},
                            selfevo_settings=str(settings))
        batch = compute_score_batch(["selfevo_proposer", "selfevo_solver"], [sol, "<answer> sea </answer>"],
                                    [{"target": []}, {"target": ["sea"]}],
                                    [{"source_id": "d0", "hops": 2}, {}], selfevo_settings=str(settings))
    assert one == frontier_reward(3) and batch == [frontier_reward(3), 1.0]
    items = [r["item"] for r in read_staged(tmp_path / "items.jsonl")]
    assert [it["step_in_round"] if "step_in_round" in it else None for it in items] == [None, None]
    assert [(it["source_id"], it["grader"]["id"]) for it in items] == [("d1", "aux-0@r1"), ("d0", "aux-1@r1")]
    assert items[0]["item_id"].startswith("r2-v-")


def test_verl_identical_proposals_are_distinct_items(tmp_path):
    """verl's per-sample compute_score: two of a prompt's rollout.n samples with the same text are two
    items with two ids (a repeated id makes a replay bank built from the run unloadable)."""
    index = BM25Index.build(DOCS)
    with running(retriever_app(index)) as rurl, \
            running(make_app(_seeded_grader("g", [], lambda i, q: "sea" if i % 5 < 2 else "land"))) as gurl:
        settings = reward_settings(tmp_path / "s.json", treatment="coupled", round=1, folds=FOLDS,
                                   graders=_graders({"main": (gurl, ())}), items_path=tmp_path / "items.jsonl",
                                   retriever_url=rurl.removesuffix("/v1"), remote=REMOTE)
        sol = "<question> Where is Beta? </question> <answer> sea </answer>"
        for _ in range(2):
            assert compute_score("selfevo_proposer", sol, {"target": []}, {"source_id": "d1", "hops": 1},
                                 selfevo_settings=str(settings)) == frontier_reward(2)
    staged = read_staged(tmp_path / "items.jsonl")
    _, admitted = admit_round(staged, round=1, step_base=0, proposer_steps=1, budget=10, seed=0)
    ids = [it["item_id"] for it in admitted]
    assert len(ids) == 2 and len(set(ids)) == 2 and all(i.startswith("r1-v-") for i in ids)


# ---------------------------------------------------------------- datasets


def test_proposer_rows_are_seeded_and_carry_lineage():
    a = proposer_rows(DOCS, FOLDS, 2, 8, seed=3, truncate=lambda s: s[:20])
    assert a == proposer_rows(DOCS, FOLDS, 2, 8, seed=3, truncate=lambda s: s[:20])
    assert a != proposer_rows(DOCS, FOLDS, 3, 8, seed=3, truncate=lambda s: s[:20])
    for row in a:
        assert row["fold"] == FOLDS.of(row["source_id"]) and row["round"] == 2 and 1 <= row["hops"] <= 4
        assert row["group"] == FOLDS.groups.get(row["source_id"], row["source_id"])
        assert row["prompt"][0]["role"] == "system" and f"{row['hops']} reasoning hop" in row["prompt"][0]["content"]
        assert len(row["prompt"][1]["content"].split("<document>\n")[1].split("\n</document>")[0]) <= 20


def _admitted():
    return [{"item_id": f"r1-s{i}-0", "question": f"Q{i}?", "adopted_label": f"a{i}", "draft_label": f"d{i}",
             "source_id": s, "source_ids": ids, "fold": FOLDS.of(s), "hops": 1}
            for i, (s, ids) in enumerate([("d0", ["d0"]), ("d1", ["d1", "d0"]), ("d2", ["d2"]), ("d3", ["d3"])])]


@pytest.mark.parametrize("dtype, extra, bf16, fp16", [
    ("float32", {}, False, False), ("bfloat16", {}, True, False), ("float16", {}, False, True),
    ("float32", {"bf16": True}, True, False)])
def test_trl_mixed_precision_follows_the_job_dtype(tmp_path, dtype, extra, bf16, fp16):
    """TRL's GRPOConfig defaults to bf16 autocast; a float32 job must train in float32 (on a CPU
    without bf16 units the autocast also made the tiny engine run 3x slower). An explicit
    `[engine.trl] bf16` still wins."""
    pytest.importorskip("trl")
    from selfevo.integrations.trl_job import grpo_args

    job = {"generations": 2, "prompts_per_step": 2, "out": str(tmp_path / "m"), "steps": 1, "lr": 1e-4,
           "rollout": {}, "dtype": dtype, "grpo": extra}
    args = grpo_args(job)
    assert (args.bf16, args.fp16) == (bf16, fp16)
    assert args.model_init_kwargs == {"dtype": dtype}


def test_proposer_scaffold_forces_both_tags(tool):
    """`protocol.scaffolded`, the one scaffold of LMProposer and the TRL rollout: a reply started
    "<question>" and stopped at its end, then continued from "… </question> <answer>" to the answer."""
    from selfevo.agents.lm.protocol import parse_proposal, scaffolded
    from selfevo.integrations.trl_env import SearchRollout

    calls = []

    seeds = []

    def gen(convs, seed, prefix=None, stops=()):
        calls.append((list(prefix), tuple(stops)))
        seeds.append(seed)
        tail = " Who founded Gamma?\n" if len(calls) % 2 else " Alpha settlers\n"  # the question, then the answer
        return [(p + tail, "stop") for p in prefix]

    convs = [[{"role": "user", "content": "doc"}]]
    ((text, finish),) = scaffolded(gen)(convs, 0)
    # the answer sampled with numbers of its own, not the question's again (a helper's review)
    assert seeds[0] == 0 and seeds[1] not in (0, None)
    assert calls == [(["<question>"], ("</question>", "\n")),
                     (["<question> Who founded Gamma?</question> <answer>"], ("</answer>", "\n"))]
    assert (text, finish) == ("<question> Who founded Gamma?</question> <answer> Alpha settlers</answer>", "stop")
    assert parse_proposal(text) == ("Who founded Gamma?", "Alpha settlers")
    (ro,) = SearchRollout(tool, role="proposer", scaffold=True).rollouts(convs, gen, seed=0)
    assert ro.final == text and ro.actions == 1


def test_a_scaffolded_question_or_answer_cut_at_the_token_limit_is_malformed():
    """A question cut mid-tag ("… born? </question", finish "length") was taken whole, stray tag and
    all, then graded and admitted (a helper's TRL smoke run trained on one); an answer cut short was
    closed as if whole. Both now stay unclosed: no proposal, and the cut question is not continued."""
    from selfevo.agents.lm.protocol import read_proposal, scaffolded

    calls = []

    def gen(convs, seed, prefix=None, stops=()):
        calls.append(list(prefix))
        if len(calls) == 1:  # the questions: the first cut at the token limit, the second whole
            return [(prefix[0] + " What time was Cael Cepyr born? </question", "length"),
                    (prefix[1] + " Who founded Gamma?</question>", "stop")]
        return [(prefix[0] + " Alpha settl", "length")]  # the second's answer: cut too

    convs = [[{"role": "user", "content": "doc"}]] * 2
    out = scaffolded(gen)(convs, 0)
    assert calls[1] == ["<question> Who founded Gamma?</question> <answer>"]  # only the whole question goes on
    assert out == [("<question> What time was Cael Cepyr born? </question", "length"),
                   ("<question> Who founded Gamma?</question> <answer> Alpha settl", "length")]
    assert all(read_proposal(text)[2] is not None for text, _ in out)  # malformed, both


def test_trl_job_rows_are_read_with_file_and_line_errors(tmp_path):
    from selfevo.corpus import DataError
    from selfevo.integrations.trl_job import _rows

    path = tmp_path / "main.rows.jsonl"
    path.write_bytes(b'{"item_id": "a"}\n\n{"item_id": "b"}\n')
    assert _rows(str(path)) == [{"item_id": "a"}, {"item_id": "b"}]
    for bad, why in [(b'{"item_id": "b"', "malformed JSON"), (b'["b"]', "expected a JSON object"),
                     (b'{"item_id": "caf\xe9"}', "invalid UTF-8")]:
        path.write_bytes(b'{"item_id": "a"}\n' + bad + b"\n")
        with pytest.raises(DataError, match=rf"main\.rows\.jsonl:2: {why}"):
            _rows(str(path))
    path.write_bytes(b'{"item_id": "a"}\n{"item_id": "b"')  # no torn-tail rule: a last line is a row too
    with pytest.raises(DataError, match=r"main\.rows\.jsonl:2: malformed JSON"):
        _rows(str(path))
    with pytest.raises(DataError, match=r"nope\.jsonl: file not found"):
        _rows(str(tmp_path / "nope.jsonl"))


def test_trl_dataset_loads_with_datasets_and_splits_by_fold(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = solver_rows(_admitted(), FOLDS, 1)
    ds = to_trl(rows)
    assert isinstance(ds, datasets.Dataset) and len(ds) == 4
    assert {"prompt", "source_id", "fold", "round", "group", "label", "item_id", "source_folds"} <= set(ds.column_names)
    ds.save_to_disk(tmp_path / "ds")
    back = datasets.load_from_disk(str(tmp_path / "ds"))
    assert back[1]["prompt"][-1] == {"role": "user", "content": "Question: Q1?"}
    assert back[1]["source_folds"] == [0, 1] and back[1]["label"] == "a1" and back[2]["group"] == "d0"
    from trl.data_utils import is_conversational

    assert is_conversational(back[0])
    sets = aux_training_sets(rows, ["aux-0", "aux-1"])
    assert [r["item_id"] for r in sets["aux-0"]] == ["r1-s0-0", "r1-s2-0"]
    assert [r["item_id"] for r in sets["aux-1"]] == ["r1-s1-0", "r1-s3-0"]
    # lineage-aware (connected): a question that read a fold-0 page trains neither aux solver
    aware = aux_training_sets(rows, ["aux-0", "aux-1"], lineage_aware=True)
    assert [r["item_id"] for r in aware["aux-1"]] == ["r1-s3-0"]
    assert len(aux_training_sets(rows, ["aux-all"])["aux-all"]) == 4


def test_verl_parquet_has_search_r1s_layout(tmp_path):
    import pyarrow.parquet as pq

    rows = solver_rows(_admitted(), FOLDS, 1) + proposer_rows(DOCS, FOLDS, 1, 2, seed=0)
    path = write_verl(rows, tmp_path / "train.parquet")
    table = pq.read_table(path)
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info", "agent_name"]
    back = read_verl(path)
    assert back[0]["data_source"] == "selfevo_solver" and back[0]["prompt"][-1]["content"] == "Question: Q0?"
    assert back[0]["reward_model"] == {"style": "rule", "ground_truth": {"target": ["a0"]}}
    assert back[1]["extra_info"]["source_folds"] == [0, 1] and back[1]["extra_info"]["fold"] == 1
    assert back[1]["extra_info"]["question"] == "Q1?" and back[3]["extra_info"]["index"] == 3
    assert back[4]["data_source"] == "selfevo_proposer" and back[4]["reward_model"]["ground_truth"]["target"] == []
    assert {r["agent_name"] for r in back} == {"search_r1_agent"}


@pytest.mark.skipif(not HAVE_VERL, reason="verl is not installed (its imports need deps selfevo does not ship)")
def test_verl_loads_the_parquet_with_its_own_dataset_class(tmp_path, smollm2_path):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    path = write_verl(solver_rows(_admitted(), FOLDS, 1), tmp_path / "train.parquet")
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ds = RLHFDataset([str(path)], tok, OmegaConf.create({"max_prompt_length": 512, "return_raw_chat": True,
                                                         "filter_overlong_prompts": False,
                                                         "cache_dir": str(tmp_path / "cache")}))
    assert len(ds) == 4
    row = ds[1]
    assert row["raw_prompt"][-1]["content"] == "Question: Q1?" and row["data_source"] == "selfevo_solver"
    assert list(row["extra_info"]["source_folds"]) == [0, 1]
    assert row["index"] == 1


# ---------------------------------------------------------------- admission


def _staged(n_steps=2, per=3):
    rows = []
    for s, i in itertools.product(range(1, n_steps + 1), range(per)):
        rows.append({"round": 1, "step_in_round": s, "item": {
            "item_id": f"r1-s{s}-{i}", "source_id": DOCS[i].id, "source_ids": [DOCS[i].id],
            "fold": FOLDS.of(DOCS[i].id),
            "source_folds": [FOLDS.of(DOCS[i].id)], "hops": 1, "question": f"Where is {DOCS[i].title}?",
            "draft_label": DOCS[i].title, "adopted_label": DOCS[i].title, "admitted": False, "responses": [],
            "k": 0, "reward": 0.0, "grader": {}}})
    rows.append({"round": 1, "step_in_round": 2, "malformed": {"item_id": "r1-s2-9", "reward": -0.5}})
    return rows


def test_admit_round_caps_the_budget_in_step_order(tmp_path):
    records, admitted = admit_round(_staged(), round=1, step_base=0, proposer_steps=2, budget=4, seed=0)
    assert [r["step"] for r in records] == [1, 2] and [r["kind"] for r in records] == ["proposer"] * 2
    assert [it["item_id"] for it in admitted] == ["r1-s1-0", "r1-s1-1", "r1-s1-2", "r1-s2-0"]
    assert records[1]["items"][1]["admission"] == {"over_budget": True} and not records[1]["items"][1]["admitted"]
    assert records[1]["malformed"] == [{"item_id": "r1-s2-9", "reward": -0.5}] and records[1]["stats"]["malformed"] == 1
    # verl items carry no step: they are cut into proposer_steps runs in arrival order
    unstepped = [{**r, "step_in_round": None} for r in _staged()]
    recs, _ = admit_round(unstepped, round=1, step_base=0, proposer_steps=2, budget=99, seed=0)
    assert [len(r["items"]) + len(r.get("malformed", [])) for r in recs] == [4, 3]


def test_admission_does_not_depend_on_the_order_processes_staged_a_step_in():
    """With engine.train_processes > 1 each process appends its share of a step when it finishes:
    the step's items (and malformed rows) are decided and capped by item_id, numbers compared as
    numbers (p0-2 before p0-10), whatever order they were staged in."""
    items = [r for r in _staged(1, 3) if "item" in r] * 4
    shares = [[{**r, "item": {**r["item"], "item_id": f"r1-s1-p{rank}-{i}"}} for i, r in enumerate(items)]
              for rank in (0, 1)]
    bad = [{"round": 1, "step_in_round": 1, "malformed": {"item_id": f"r1-s1-p{rank}-99", "reward": -0.5}}
           for rank in (0, 1)]
    runs = [admit_round(rows, round=1, step_base=0, proposer_steps=1, budget=13, seed=0)
            for rows in (shares[0] + bad + shares[1], shares[1] + bad[::-1] + shares[0][::-1])]
    assert runs[0] == runs[1]
    records, admitted = runs[0]
    assert [it["item_id"] for it in admitted] == [f"r1-s1-p0-{i}" for i in range(12)] + ["r1-s1-p1-0"]
    assert [m["item_id"] for m in records[0]["malformed"]] == ["r1-s1-p0-99", "r1-s1-p1-99"]


def test_msv_filter_over_a_served_model(tmp_path, tool):
    """MSV as a data filter: the model, served on loopback, answers 'sea' with the source and
    'land' without for Beta (rejected), and 'river' both ways for Alpha (admitted, relabelled)."""
    def script(messages):
        user = messages[-1]["content"]
        if "Beta" in user:
            return "<answer> sea </answer>" if "<document>" in user else "<answer> land </answer>"
        return "<answer> the River </answer>"
    with running(make_app(ScriptedModel(script))) as url:
        from selfevo.agents.remote import RemoteSolver

        with RemoteSolver(url, "scripted", **REMOTE) as model:
            items = [r["item"] for r in _staged(1, 2) if "item" in r]
            decisions = msv_filter(items, model, {d.id: d for d in DOCS}, tool, seed=0)
            records, admitted = admit_round(_staged(1, 2), round=1, step_base=0, proposer_steps=1, budget=9, seed=0,
                                            decide=lambda its, s: msv_filter(its, model, {d.id: d for d in DOCS},
                                                                             tool, s))
    assert [d.admitted for d in decisions] == [True, False]
    assert decisions[0].label == "the River" and decisions[0].detail["majority_without"] == "the River"
    assert [it["adopted_label"] for it in admitted] == ["the River"] and admitted[0]["draft_label"] == "Alpha"
    assert records[0]["items"][1]["admission"]["with_source"] == ["sea"] * 3


def test_commit_records_replaces_what_a_killed_attempt_left(tmp_path):
    path = tmp_path / "steps.jsonl"
    first = [{"round": 1, "kind": "proposer", "step": 1}, {"round": 1, "kind": "solver", "step": 2}]
    commit_records(path, first[:1], 1, "proposer")
    commit_records(path, first[1:], 1, "solver")
    commit_records(path, [{"round": 1, "kind": "solver", "step": 2, "again": True}], 1, "solver")  # a rerun
    with open(path, "a") as fh:
        fh.write('{"round": 2, "kind": "prop')  # a torn line from a kill
    commit_records(path, [{"round": 2, "kind": "proposer", "step": 3}], 2, "proposer")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [first[0], {"round": 1, "kind": "solver", "step": 2, "again": True},
                    {"round": 2, "kind": "proposer", "step": 3}]


def test_one_pass_is_every_row_then_seeded_top_ups_or_a_seeded_subset():
    """A TRL job trains exactly one pass (steps × prompts rows): every row, then draws from them to
    fill the last batches, each row at most once a draw; or, for fewer updates than rows fill, a
    seeded subset in order."""
    rows = [{"item_id": f"q{i}"} for i in range(10)]
    ids = lambda rs: [r["item_id"] for r in rs]  # noqa: E731
    filled = one_pass(rows, 12, seed=5)
    assert ids(filled[:10]) == ids(rows) and len(filled) == 12 and len(set(ids(filled[10:]))) == 2
    assert filled == one_pass(rows, 12, seed=5) and filled != one_pass(rows, 12, seed=6)
    assert all(i.endswith("#2") for i in ids(filled[10:]))  # a copy is its own item (the solver records)
    many = one_pass(rows[:3], 8, seed=1)  # more than a draw of all 3: each draw holds each row once
    assert ids(many[:3]) == ["q0", "q1", "q2"] and sorted(ids(many[3:6])) == ["q0#2", "q1#2", "q2#2"]
    assert len(many) == 8 and {i[:2] for i in ids(many[6:])} <= {"q0", "q1", "q2"}
    assert all(i.endswith("#3") for i in ids(many[6:])) and len(set(ids(many))) == 8
    assert one_pass(rows, 10, seed=0) == rows
    half = one_pass(rows, 4, seed=2)
    assert len(half) == 4 and ids(half) == sorted(set(ids(half)), key=ids(rows).index)  # a subset, in order
    with pytest.raises(ValueError, match="no rows"):
        one_pass([], 4, seed=0)


def test_trim_staged_drops_torn_rows_anywhere_and_names_a_row_without_its_step(tmp_path):
    """Several processes append to one staging file: one killed mid-write leaves a torn line that
    another's later row may follow. Resuming from the checkpoint of step 2 keeps steps 1-2, drops
    the torn line and everything later, and ends the file with a newline; a row without its step is
    an error naming file and line."""
    from selfevo.runs import RunError

    path = tmp_path / "solver-steps.jsonl"
    reward = {"records_path": str(path), "first_step_in_round": 3}

    def row(step, who):
        return json.dumps({"step_in_round": step, "who": who})
    kept = "\n".join([row(3, "a"), row(3, "b"), row(4, "a"), row(4, "b")])
    path.write_text("\n".join([kept, row(5, "a")[:9], row(5, "b"), row(6, "b")]))
    trim_staged(reward, 2)
    assert path.read_text() == kept + "\n"
    path.write_text(kept)  # a whole last row whose newline a kill cut: ended, or the next append glues on
    trim_staged(reward, 2)
    assert path.read_text() == kept + "\n"
    path.write_text(row(3, "a") + "\n" + json.dumps({"who": "b"}) + "\n")
    with pytest.raises(RunError, match=r"solver-steps\.jsonl:2: a staged row without an integer step_in_round"):
        trim_staged(reward, 1)
    trim_staged(reward, 0)  # the phase starts over: nothing staged
    assert not path.exists()


# ---------------------------------------------------------------- verl configs


def test_verl_tool_and_agent_configs(tmp_path):
    import yaml

    from selfevo.integrations.verl_search import agent_loop_config, parse_search_call, tool_config, write_yaml

    write_yaml(tool_config("http://127.0.0.1:8000/retrieve", topk=3, max_calls=5), tmp_path / "tool.yaml")
    write_yaml(agent_loop_config(), tmp_path / "agent.yaml")
    tools = yaml.safe_load((tmp_path / "tool.yaml").read_text())["tools"]
    assert tools[0]["class_name"] == "selfevo.integrations.verl_search.SearchR1Tool"
    assert tools[0]["config"] == {"type": "native", "retrieval_service_url": "http://127.0.0.1:8000/retrieve",
                                  "topk": 3, "max_calls": 5, "timeout": 60.0}  # past the server's 30 s limit
    assert tools[0]["tool_schema"]["function"]["name"] == "search"
    assert tools[0]["tool_schema"]["function"]["parameters"]["required"] == ["query"]
    assert yaml.safe_load((tmp_path / "agent.yaml").read_text()) == [
        {"name": "search_r1_agent", "_target_": "selfevo.integrations.verl_search.SearchR1AgentLoop"}]
    assert parse_search_call("<think>hm</think><search> Beta city </search> trailing") == \
        ("<think>hm</think><search> Beta city </search>", "Beta city")
    assert parse_search_call("<answer> sea </answer>")[1] is None


def _phase(tmp_path):
    from selfevo.integrations.verl_launch import VerlPhase

    return VerlPhase(name="r2-aux-0", model="/models/main", train_files=str(tmp_path / "t.parquet"),
                     out=str(tmp_path / "out"), ckpt_dir=str(tmp_path / "ckpt"), steps=25, prompts_per_step=64, n=5,
                     lr=1e-6, tool_config="/t.yaml", agent_loop_config="/a.yaml", reward_file="/r.py",
                     settings="/s.json", gpus=8, extra={"actor_rollout_ref.rollout.gpu_memory_utilization": 0.5})


def test_verl_launch_script(tmp_path):
    import shlex

    from selfevo.integrations.verl_launch import phase_overrides, phase_script

    overrides = dict(o.split("=", 1) for o in phase_overrides(_phase(tmp_path)))
    assert overrides["algorithm.adv_estimator"] == "grpo" and overrides["actor_rollout_ref.rollout.n"] == "5"
    assert overrides["trainer.total_training_steps"] == "25" and overrides["data.train_batch_size"] == "64"
    assert overrides["actor_rollout_ref.rollout.multi_turn.format"] == "search_r1"
    assert overrides["+reward.custom_reward_function.reward_kwargs.selfevo_settings"] == "/s.json"
    assert overrides["actor_rollout_ref.rollout.gpu_memory_utilization"] == "0.5"
    # an extra of a phase made by hand replaced the method's settings (rollout.n=8 for the group of 5); an
    # [engine.verl] table is refused at its reading, this at the phase
    with pytest.raises(ValueError, match="extra: actor_rollout_ref.rollout.n is set by the engine"):
        phase_overrides(dataclasses.replace(_phase(tmp_path), extra={"actor_rollout_ref.rollout.n": 8}))
    free = dataclasses.replace(_phase(tmp_path), extra={"trainer.logger": "['console','wandb']"})
    assert "trainer.logger=['console','wandb']" in phase_overrides(free)
    script = phase_script(_phase(tmp_path), tmp_path / "job.sh").read_text()
    lines = script.replace("\\\n", "").splitlines()
    train = shlex.split(next(line for line in lines if "verl.trainer.main_ppo" in line))
    assert train[:3] == ["python3", "-m", "verl.trainer.main_ppo"] and "trainer.logger=[console]" in train
    assert f"--local_dir {tmp_path}/ckpt/global_step_25/actor" in script and "set -euo pipefail" in script
    # a phase starts over: a killed attempt's checkpoints are cleared, and verl does not go on from them
    assert overrides["trainer.resume_mode"] == "disable"
    assert lines.index(f"rm -rf {tmp_path}/ckpt") < next(i for i, line in enumerate(lines) if "main_ppo" in line)


@pytest.mark.skipif(not HAVE_VERL, reason="verl is not installed (its imports need deps selfevo does not ship)")
def test_verl_accepts_the_overrides_and_runs_the_tool_and_parser(tmp_path):
    """verl's own config tree (Hydra compose) accepts every override; the tool answers from a real
    /retrieve server and keeps its budget and lineage; the parser turns <search> into a call."""
    import asyncio
    import os

    import verl
    from hydra import compose, initialize_config_dir

    from selfevo.integrations import verl_search
    from selfevo.integrations.verl_launch import phase_overrides

    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=phase_overrides(_phase(tmp_path)))
    assert cfg.reward.custom_reward_function.reward_kwargs.selfevo_settings == "/s.json"
    assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "search_r1_agent"

    class Agent:
        extra_fields: dict = {}

    with running(retriever_app(BM25Index.build(DOCS))) as url:
        tool = verl_search.SearchR1Tool({"retrieval_service_url": url.removesuffix("/v1") + "/retrieve",
                                         "topk": 2, "max_calls": 1, "type": "native"})
        agent = Agent()
        resp, score, _ = asyncio.run(tool.execute("i", {"query": "Beta city"}, agent_data=agent))
        spent, _, _ = asyncio.run(tool.execute("i", {"query": "Alpha"}, agent_data=agent))
    assert resp.text.startswith("<information>Doc 1 (Title: Beta)") and score == 0.0
    assert agent.extra_fields["selfevo_read"][0] == "d1" and "budget is spent" in spent.text

    class Tok:
        def decode(self, ids):
            return "<search> Beta </search> extra"
    parser = verl_search.SearchR1ToolParser(Tok())
    content, calls = asyncio.run(parser.extract_tool_calls([1, 2]))
    assert content == "<search> Beta </search>" and json.loads(calls[0].arguments) == {"query": "Beta"}


# ---------------------------------------------------------------- recipes


RECIPES = ["trl-qwen3.5-4b.toml", "trl-qwen3.5-9b.toml", "verl-qwen3.5-4b.yaml", "verl-qwen3.5-9b.yaml"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipes_hold_the_papers_schedule(name):
    from pathlib import Path

    from selfevo.integrations.engine import load_engine_config

    path = Path(__file__).resolve().parents[1] / "configs" / name
    ecfg = load_engine_config(path, engine=name.split("-")[0])
    loop, spec = ecfg.run.loop, ecfg.engine
    assert (loop.rounds, loop.proposer_steps, loop.solver_steps, loop.admit_per_round, loop.grader_samples) == \
        (3, 18, 25, 1600, 5)
    assert ecfg.run.treatment == "crossfit" and spec.solver_generations == 5
    assert spec.proposer_prompts * spec.proposer_generations * loop.proposer_steps >= loop.admit_per_round
    assert (ecfg.run.lm.max_actions, ecfg.run.lm.max_new_tokens, ecfg.run.lm.temperature, ecfg.run.lm.top_p) == \
        (5, 512, 0.8, 0.95)
    assert spec.proposer_prompts % spec.train_processes == 0 and spec.retriever_url.endswith("/retrieve")
    assert ("4B" in ecfg.run.lm.model) == ("4b" in name)


def test_engine_config_errors_name_the_field(tmp_path):
    from selfevo.config import ConfigError
    from selfevo.integrations.engine import load_engine_config

    path = tmp_path / "c.toml"
    path.write_text('backend = "lm"\n[engine]\nengine = "trl"\nsolver_generations = 1\n')
    with pytest.raises(ConfigError, match="engine.solver_generations"):
        load_engine_config(path)
    path.write_text('backend = "lm"\n[engine]\nbogus = 1\n')
    with pytest.raises(ConfigError, match="engine.bogus"):
        load_engine_config(path)
    # no quiet conversion: `true` was a checkpoint after every update, "8100" a port
    for line, field in (("save_steps = true", "save_steps"), ('grader_port = "8100"', "grader_port"),
                        ("grader_concurrency = 2.0", "grader_concurrency")):
        path.write_text(f'backend = "lm"\n[engine]\n{line}\n')
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: engine.{field}: "):  # the file set it
            load_engine_config(path)
    for value in ("nan", "inf"):  # pydantic said of a NaN "should be less than 1"
        path.write_text(f'backend = "lm"\n[engine]\ngrader_gpu_memory = {value}\n')
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: engine\.grader_gpu_memory: must be finite, "
                                              rf"got {value}$"):
            load_engine_config(path)
    path.write_text('backend = "lm"\n[engin]\nengine = "trl"\n')  # the known tables include engine
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: engin: unknown field \(known: engine, "):
        load_engine_config(path)
    path.write_text('backend = "lm"\n[engine]\nengine = "verl"\n')
    with pytest.raises(ConfigError, match="retriever_url"):
        load_engine_config(path, engine="verl")
    with pytest.raises(ConfigError, match="--engine says 'trl'"):
        load_engine_config(path, engine="trl")
    path.write_text('[engine]\nengine = "trl"\n')
    with pytest.raises(ConfigError, match='backend = "lm"'):
        load_engine_config(path)
    # refused by the first TRL job (after r0/eval, as a traceback), and no resume could change it
    path.write_text('backend = "lm"\n[engine]\nengine = "trl"\ntrain_processes = 2\n')
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: engine\.train_processes: 2 processes need a "):
        load_engine_config(path)
    load_engine_config(path, ["engine.launcher=accelerate launch", "engine.retriever_url=http://127.0.0.1:9/retrieve"])
    # verl was handed neither the LoRA settings nor the clip: each a setting verl ran without
    url = 'retriever_url = "http://127.0.0.1:9/retrieve"\n'
    path.write_text(f'backend = "lm"\n[engine]\nengine = "verl"\n{url}')
    with pytest.raises(ConfigError, match=rf'^{re.escape(str(path))}: lm\.adapter: verl trains and merges full models'):
        load_engine_config(path, engine="verl")
    with pytest.raises(ConfigError, match=r"^lm\.max_grad_norm: verl clips by its own setting.*\(set by --set\)$"):
        load_engine_config(path, ["lm.adapter=full", "lm.max_grad_norm=0.25"], engine="verl")
    load_engine_config(path, ["lm.adapter=full"], engine="verl")


def test_a_misspelt_engine_field_lists_the_known_ones_as_the_other_tables_do(tmp_path):
    """pydantic said only "Extra inputs are not permitted"; `loop.rouns` lists the known fields."""
    from selfevo.config import ConfigError, load_config
    from selfevo.integrations.engine import EngineSpec, load_engine_config

    with pytest.raises(ConfigError, match=r"^loop\.rouns: unknown field \(known: rounds, "):
        load_config(None, ["loop.rouns=3"])
    path = tmp_path / "c.toml"
    path.write_text('backend = "lm"\n[engine]\nengine = "trl"\n')
    with pytest.raises(ConfigError) as err:
        load_engine_config(path, ["engine.grader=vllm"])
    assert str(err.value) == (f"engine.grader: unknown field (known: {', '.join(EngineSpec.model_fields)}) "
                              "(set by --set)")
    assert "graders" in str(err.value) and "verl_max_response_length" in str(err.value)


def test_every_engine_field_is_documented_with_its_default():
    """The recipes set [engine] fields (verl_gpus, proposer_prompts, ...) that no page described."""
    from selfevo.integrations.engine import EngineSpec

    doc = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", doc, flags=re.M))
    for name, field in EngineSpec.model_fields.items():
        default = field.get_default(call_default_factory=True)
        assert rows.get(name, "").strip("`") == json.dumps(default), name


def test_engine_config_engine_not_a_table_names_the_field(tmp_path):
    """A top-level `engine = "trl"` (or `--set engine=verl`) is a ConfigError naming `engine`, not a
    ValueError from dict()."""
    from selfevo.config import ConfigError
    from selfevo.integrations.engine import load_engine_config

    path = tmp_path / "c.toml"
    path.write_text('backend = "lm"\nengine = "trl"\n')
    with pytest.raises(ConfigError, match=r"engine: expected a table"):
        load_engine_config(path)
    path.write_text('backend = "lm"\n[engine]\nengine = "trl"\n')
    with pytest.raises(ConfigError, match=r"engine: expected a table"):
        load_engine_config(path, ["engine=verl"])
    path.write_text('backend = "lm"\n')
    assert load_engine_config(path).engine.engine == "trl"  # no [engine] table: the defaults


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_engine_config_file_errors_name_the_file(tmp_path, suffix):
    """Read as config.read_toml reads a run config: bad bytes, a missing file and bad syntax are one
    ConfigError naming the file; a YAML file reads the same tables; --set applies as load_config's."""
    from selfevo.config import ConfigError
    from selfevo.integrations.engine import load_engine_config

    path = tmp_path / f"c{suffix}"
    data = b'backend = "lm"\n# caf\xe9\n' if suffix == ".toml" else b"backend: lm\n# caf\xe9\n"
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: invalid UTF-8 at byte {data.index(0xe9)}$"):
        load_engine_config(path)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path / ('nope' + suffix)))}: cannot read"):
        load_engine_config(tmp_path / f"nope{suffix}")
    path.write_text('backend = "lm"\n[engine\n' if suffix == ".toml" else "backend: [lm\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: "):
        load_engine_config(path)
    path.write_text('backend = "lm"\n[engine]\nsolver_generations = 3\n' if suffix == ".toml"
                    else "backend: lm\nengine:\n  solver_generations: 3\n")
    ecfg = load_engine_config(path, ["engine.msv_samples=2", "loop.rounds=2"])
    assert (ecfg.engine.solver_generations, ecfg.engine.msv_samples, ecfg.run.loop.rounds) == (3, 2, 2)
    # the sim loop's knob would be ignored here: refused, naming the engine's
    with pytest.raises(ConfigError, match=r"loop.msv_samples: engine-run samples engine.msv_samples \(2\)"):
        load_engine_config(path, ["engine.msv_samples=2", "loop.msv_samples=5"])


@pytest.mark.skipif(not HAVE_VERL, reason="verl is not installed (its imports need deps selfevo does not ship)")
@pytest.mark.parametrize("name", ["verl-qwen3.5-4b.yaml", "verl-qwen3.5-9b.yaml"])
def test_verl_accepts_the_recipes_overrides(name, tmp_path):
    import os
    from pathlib import Path

    import verl
    from hydra import compose, initialize_config_dir

    from selfevo.integrations.engine import load_engine_config
    from selfevo.integrations.verl_launch import VerlPhase, phase_overrides

    ecfg = load_engine_config(Path(__file__).resolve().parents[1] / "configs" / name, engine="verl")
    spec = ecfg.engine
    phase = VerlPhase(name="r1-main", model=ecfg.run.lm.model, train_files="/t.parquet", out="/o", ckpt_dir="/c",
                      steps=25, prompts_per_step=66, n=spec.solver_generations, lr=ecfg.run.lm.lr,
                      tool_config="/t.yaml", agent_loop_config="/a.yaml", reward_file="/r.py",
                      max_prompt_length=spec.verl_max_prompt_length,
                      max_response_length=spec.verl_max_response_length, gpus=spec.verl_gpus, extra=spec.verl)
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=phase_overrides(phase))
    assert cfg.trainer.n_gpus_per_node == 6 and cfg.actor_rollout_ref.rollout.n == 5
    assert cfg.actor_rollout_ref.rollout.gpu_memory_utilization == 0.5
    assert (66 * 5) % cfg.trainer.n_gpus_per_node == 0


# ---------------------------------------------------------------- the orchestrator, engine faked


def _stage_proposals(items_path, r: int, rows: list[dict], per_step: int) -> None:
    """What the proposer reward stages: every prompt becomes one graded, well-formed proposal."""
    from selfevo._io import append_jsonl

    append_jsonl(items_path, [{"round": r, "step_in_round": 1 + i // per_step, "item": {
        "item_id": f"r{r}-{i}", "source_id": row["source_id"], "source_ids": row["source_ids"],
        "fold": row["fold"], "source_folds": row["source_folds"], "hops": row["hops"],
        "question": f"q{i}", "draft_label": f"a{i}", "adopted_label": f"a{i}", "admitted": False,
        "responses": ["x"] * 5, "k": 0, "reward": 0.0, "grader": {}}} for i, row in enumerate(rows)])


def _fake_services(monkeypatch) -> None:
    """What the orchestrator's tests fake of the engine's services: prompts cut by no tokenizer, and models
    served nowhere (each grader a URL of a closed loopback port, which a faked job never calls)."""
    import contextlib

    from selfevo.integrations import engine as eng

    monkeypatch.setattr(eng, "_truncator", lambda path, n: (lambda text: text))

    @contextlib.contextmanager
    def fake_serving(self, models):
        yield {role: (f"http://127.0.0.1:9/{role}/v1", name) for role, (path, name) in models.items()}
    monkeypatch.setattr(eng.EngineRun, "serving", fake_serving)


class _FakeEngine:
    """Stands in for TRL: 'trains' by writing a model directory, stages what the rewards would."""

    def __init__(self, run):
        self.run, self.jobs = run, []

    def train(self, name, kind, role, r, rows, steps, prompts_per_step, generations, reward):
        self.jobs.append({"name": name, "role": role, "round": r, "rows": rows, "steps": steps,
                          "per_step": prompts_per_step, "reward": reward})
        out = self.run.run.path / "models" / role / f"round-{r}"
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")
        if kind == "proposer":
            _stage_proposals(reward["items_path"], r, rows, prompts_per_step)
        return {"steps": steps, "completions": steps * prompts_per_step * generations}


@pytest.mark.parametrize("treatment", ["crossfit", "half-budget"])
def test_engine_run_phases_lineage_and_resume(treatment, tmp_path, monkeypatch):
    """Two rounds with the engine faked: the phases run in the paper's order (aux solvers only
    before the last round), each aux solver trains on its fold alone with its budget, round 2's
    graders are the aux solvers with that lineage, and a rerun skips every finished phase."""

    from selfevo.integrations import engine as eng

    _fake_services(monkeypatch)
    monkeypatch.setattr(eng.EngineRun, "evaluate", lambda self, r: {"macro_cover_em": 0.0})
    cfg = {"backend": "lm", "treatment": treatment, "world": {"name": "small"},
           "loop": {"rounds": 2, "proposer_steps": 2, "solver_steps": 3, "admit_per_round": 10, "source_docs": 40},
           "engine": {"proposer_generations": 2, "proposer_prompts": 6}}
    ecfg = eng.engine_config_from_dict(cfg, engine="trl")
    run = eng.EngineRun(ecfg, tmp_path / "run", log=lambda m: None)
    fake = _FakeEngine(run)
    monkeypatch.setattr(run, "train", fake.train)
    monkeypatch.setattr(run, "audit", lambda: {"audit": "skipped"})
    run.run_all()
    names = [e["phase"] for e in run.phases.entries.values()]
    assert names == ["r0/eval", "r1/proposer", "r1/admit", "r1/main", "r1/aux-0", "r1/aux-1", "r1/eval",
                     "r2/proposer", "r2/admit", "r2/main", "r2/eval", "audit"]
    jobs = {j["name"]: j for j in fake.jobs}
    # 12 proposals a round, the budget admits 10; the main solver sees all 10, each aux its fold's
    assert len(jobs["r1/main"]["rows"]) == 10 and jobs["r1/main"]["steps"] == 3
    for j in (0, 1):
        rows = jobs[f"r1/aux-{j}"]["rows"]
        assert rows and all(r["fold"] == j for r in rows)
        # every update of its budget trains (as the main solver's 3), at the full budget's batch size
        assert jobs[f"r1/aux-{j}"]["per_step"] == math_ceil(len(rows), 3)
        assert jobs[f"r1/aux-{j}"]["steps"] == (3 if treatment == "crossfit" else (2, 1)[j])
    # round 1 is graded by the base model; round 2 by the aux solvers, each with its lineage
    assert [g["name"] for g in jobs["r1/proposer"]["reward"]["graders"]] == ["main@r0"]
    graders = {g["role"]: g for g in jobs["r2/proposer"]["reward"]["graders"]}
    assert sorted(graders) == ["aux-0", "aux-1"]
    assert graders["aux-0"]["folds"] == [0] and graders["aux-1"]["folds"] == [1] and graders["aux-0"]["rounds"] == [1]
    steps = [json.loads(line) for line in (tmp_path / "run" / "records" / "steps.jsonl").read_text().splitlines()]
    assert [(s["round"], s["kind"]) for s in steps] == [(1, "proposer")] * 2 + [(2, "proposer")] * 2
    assert sum(it["admitted"] for s in steps[:2] for it in s["items"]) == 10
    compute = json.loads((tmp_path / "run" / "compute.json").read_text())
    assert compute["updates"]["main"] == 6 and compute["generations"]["proposer"] == 2 * 2 * 6 * 2
    # rerun: everything is done
    again = eng.EngineRun(ecfg, tmp_path / "run", resume=True, log=lambda m: None)
    fake2 = _FakeEngine(again)
    monkeypatch.setattr(again, "train", fake2.train)
    again.run_all()
    assert fake2.jobs == []
    with pytest.raises(Exception, match="pass --resume"):
        eng.EngineRun(ecfg, tmp_path / "run", log=lambda m: None)


def math_ceil(a, b):
    return -(-a // b)


def test_an_engine_evaluation_killed_part_way_goes_on_from_the_answers_given(tmp_path, monkeypatch):
    """A kill during `engine-run`'s evaluation of a served model keeps the answers given: the resumed
    phase asks only the rest and writes what a run never killed writes; killed after the evaluation
    was written, it asks nothing again; a model whose files changed since is asked everything again.
    Before, the phase restarted whole (hours for 1,325 questions)."""
    import contextlib
    import functools

    import selfevo.evaluate as ev
    from selfevo.agents.remote import RemoteSolver
    from selfevo.integrations import engine as eng

    asked = []

    def script(messages):
        question = messages[-1]["content"]
        asked.append(question)
        return f"<answer> {len(question) % 7} </answer>"

    monkeypatch.setattr(ev, "evaluate_solver", functools.partial(ev.evaluate_solver, batch_size=2))
    with running(make_app(ScriptedModel(script))) as url:
        @contextlib.contextmanager
        def serving(self, models):
            yield {role: (url, name) for role, (_, name) in models.items()}
        monkeypatch.setattr(eng.EngineRun, "serving", serving)

        def make(out):
            cfg = {**ENGINE_CFG, "data": {"eval_limit": 3}}
            run = eng.EngineRun(eng.engine_config_from_dict(cfg, engine="trl"), out, log=lambda m: None)
            model = out / "models" / "main" / "round-1"
            model.mkdir(parents=True)
            (model / "config.json").write_text("{}")
            return run, model

        whole, _ = make(tmp_path / "whole")
        whole.evaluate(1)
        everything = len(asked)
        # named without the loopback port it was served on (the eval file differed from run to run)
        assert json.loads((tmp_path / "whole" / "eval" / "round-1.json").read_text())["run"]["agent"] == \
            "remote:main@r1 (served)"
        assert everything >= 6  # several batches of 2

        run, model = make(tmp_path / "killed")
        answer, calls = RemoteSolver.answer, []

        def killed_at_the_third_batch(self, *a, **k):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return answer(self, *a, **k)
        monkeypatch.setattr(RemoteSolver, "answer", killed_at_the_third_batch)
        asked.clear()
        with pytest.raises(KeyboardInterrupt):
            run.evaluate(1)
        assert len(asked) == 4 and run.run.eval_partial_path(1).exists()
        monkeypatch.setattr(RemoteSolver, "answer", answer)
        asked.clear()
        run.evaluate(1)
        assert len(asked) == everything - 4  # only the questions not answered before the kill
        for name in ("eval/round-1.json", "eval/round-1.predictions.jsonl"):
            assert (tmp_path / "killed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
        assert not run.run.eval_partial_path(1).exists()  # removed with the round's checkpoint
        # killed after that, before the phase was logged: nothing is asked again
        asked.clear()
        assert run.evaluate(1) == whole.evaluate(1) and asked == []

        # killed after the evaluation's files, inside the round's checkpoint (its file written, not the
        # manifest's round): nothing asked again, and the checkpoint is made whole
        run, model = make(tmp_path / "unrecorded")
        write_manifest = run.run._write_manifest

        def killed(*a, **k):
            raise KeyboardInterrupt
        monkeypatch.setattr(run.run, "_write_manifest", killed)
        with pytest.raises(KeyboardInterrupt):
            run.evaluate(1)
        assert run.run.checkpoint_path(1).exists() and run.run.eval_partial_path(1).exists()
        monkeypatch.setattr(run.run, "_write_manifest", write_manifest)
        asked.clear()
        run.evaluate(1)
        assert asked == [] and not run.run.eval_partial_path(1).exists()  # before: all 21 asked again
        assert run.run.manifest()["rounds_completed"] == 1

        # killed during it, then the model's files change (retrained): its answers before are not kept
        run, model = make(tmp_path / "retrained")
        monkeypatch.setattr(RemoteSolver, "answer", killed_at_the_third_batch)
        calls.clear()
        with pytest.raises(KeyboardInterrupt):
            run.evaluate(1)
        monkeypatch.setattr(RemoteSolver, "answer", answer)
        (model / "model.safetensors").write_bytes(b"retrained")
        asked.clear()
        with pytest.warns(UserWarning, match="started over"):
            run.evaluate(1)
        assert len(asked) == everything


def test_a_hub_model_is_told_apart_by_the_revision_its_cache_holds(tmp_path, monkeypatch):
    """The round-0 evaluation's answers are kept across a kill only for the model that gave them. A
    hub id was keyed by its name: a download of a new revision between the kill and the resume mixed
    the two revisions' answers. It is now keyed by the cached snapshot's files, as a directory is."""
    import huggingface_hub.constants

    from selfevo.agents.lm.model import model_identity

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--model"

    def cache(revision: str, weights: bytes) -> None:  # the layout a download leaves
        (repo / "blobs").mkdir(parents=True, exist_ok=True)
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True)
        for name, content in (("config.json", b"{}"), ("model.safetensors", weights)):
            blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
            blob.write_bytes(content)
            (snapshot / name).symlink_to(blob)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)

    assert model_identity("org/model") == "org/model"  # nothing cached: its name, as before
    assert model_identity("not a repo id!") == "not a repo id!"
    cache("a" * 40, b"first")
    first = model_identity("org/model")
    assert first != "org/model" and model_identity("org/model") == first
    assert first == model_identity(str(repo / "snapshots" / ("a" * 40)))  # as the directory itself
    cache("b" * 40, b"second revision")
    assert model_identity("org/model") not in (first, "org/model")


def test_engine_jobs_are_one_pass_and_a_resume_may_turn_the_audit_on(tmp_path, monkeypatch):
    """The TRL jobs the engine writes (the real `train`, the job itself faked) train one pass over
    exactly steps × prompts rows holding every question they are given; an audit skipped with
    engine.audit = "none" is not logged as done, so the run resumed with "auto" audits."""
    import copy

    from selfevo.integrations import engine as eng
    from selfevo.integrations import trl_job

    _fake_services(monkeypatch)
    monkeypatch.setattr(eng.EngineRun, "evaluate", lambda self, r: {"macro_cover_em": 0.0})
    monkeypatch.setattr(eng.EngineRun, "audit", lambda self: {"audit": "oracle", "rounds": 2})
    jobs = {}

    def fake_job(job, tool=None):
        rows = trl_job._rows(job["rows"])
        jobs[job["out"]] = (job, rows)
        (trl_job.trainer_dir(job["out"]) / "checkpoint-1").mkdir(parents=True)  # kept until the phase is logged
        verl_ckpt = Path(job["rows"]).parent / f"{Path(job['out']).parent.name}.verl-ckpt"  # what a verl phase keeps
        (verl_ckpt / f"global_step_{job['steps']}").mkdir(parents=True)
        Path(job["out"]).mkdir(parents=True)
        (Path(job["out"]) / "config.json").write_text("{}")
        if job["kind"] == "proposer":
            _stage_proposals(job["reward"]["items_path"], job["reward"]["round"], rows, job["prompts_per_step"])
        return {"steps": job["steps"], "completions": job["steps"] * job["prompts_per_step"] * job["generations"]}
    monkeypatch.setattr(trl_job, "run_job", fake_job)
    cfg = copy.deepcopy(ENGINE_CFG)
    cfg["engine"]["audit"] = "none"
    said = []
    eng.EngineRun(eng.engine_config_from_dict(copy.deepcopy(cfg), engine="trl"), tmp_path / "run",
                  log=said.append).run_all()
    admitted = {it["item_id"] for it in map(json.loads, (tmp_path / "run/engine/round-1/admitted.jsonl").open())}
    main, main_rows = next(v for k, v in jobs.items() if k.endswith("main/round-1"))
    assert len(admitted) == 10 and main["steps"] == 3 and main["prompts_per_step"] == 4 and len(main_rows) == 12
    assert {r["item_id"] for r in main_rows[:10]} == admitted  # all 10 once, 2 drawn again to fill step 3
    assert {r["item_id"].removesuffix("#2") for r in main_rows[10:]} <= admitted and len({
        r["item_id"] for r in main_rows}) == 12
    for j in (0, 1):
        aux, rows = next(v for k, v in jobs.items() if k.endswith(f"aux-{j}/round-1"))
        assert len(rows) == aux["steps"] * aux["prompts_per_step"] and {r["fold"] for r in rows} == {j}
    assert "audit: engine.audit = none, skipped" in said and "audit" not in _phase_names(tmp_path / "run")
    left = lambda: sorted([*(tmp_path / "run").glob("models/*/.trainer-*"),  # noqa: E731
                           *(tmp_path / "run").glob("engine/round-*/*.verl-ckpt")])
    assert len(jobs) == 6 and left() == []  # each phase's checkpoints dropped once it was logged
    (trl_job.trainer_dir(main["out"]) / "checkpoint-3").mkdir(parents=True)  # killed before dropping them
    cfg["engine"]["audit"] = "auto"
    eng.EngineRun(eng.engine_config_from_dict(copy.deepcopy(cfg), engine="trl"), tmp_path / "run", resume=True,
                  log=said.append).run_all()
    assert "resuming with engine.audit 'none' -> 'auto'" in said and "audit: running" in said
    assert _phase_names(tmp_path / "run")[-1] == "audit" and len(jobs) == 6  # no phase trained again
    assert left() == []


def test_a_trl_phase_killed_part_way_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """With engine.save_steps, a TRL phase killed after a checkpoint goes on from it when the run is
    resumed: the job is given the checkpoint and its step, what it staged for the steps before it is kept
    (the rest dropped), and the run says so."""
    import copy

    from selfevo.integrations import engine as eng
    from selfevo.integrations import trl_job

    _fake_services(monkeypatch)
    monkeypatch.setattr(eng.EngineRun, "evaluate", lambda self, r: {"macro_cover_em": 0.0})
    monkeypatch.setattr(eng.EngineRun, "audit", lambda self: {"audit": "oracle", "rounds": 2})
    started = []

    def killed_after_step_1(job, tool=None):
        started.append(job)
        if job["start_step"]:
            raise KeyboardInterrupt  # killed again before it staged anything
        rows = trl_job._rows(job["rows"])
        _stage_proposals(job["reward"]["items_path"], job["reward"]["round"], rows, job["prompts_per_step"])
        ckpt = trl_job.trainer_dir(job["out"]) / "checkpoint-1"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
        raise KeyboardInterrupt  # killed during step 2, after step 1's checkpoint
    monkeypatch.setattr(trl_job, "run_job", killed_after_step_1)
    cfg = copy.deepcopy(ENGINE_CFG)
    cfg["engine"]["save_steps"] = 1
    with pytest.raises(KeyboardInterrupt):
        eng.EngineRun(eng.engine_config_from_dict(copy.deepcopy(cfg), engine="trl"), tmp_path / "run",
                      log=lambda m: None).run_all()
    first = started[0]
    assert first["start_step"] == 0 and first["resume_from"] is None and first["save_steps"] == 1
    items = Path(first["reward"]["items_path"])
    assert {json.loads(line)["step_in_round"] for line in items.read_text().splitlines()} == {1, 2}
    said = []
    with pytest.raises(KeyboardInterrupt):
        eng.EngineRun(eng.engine_config_from_dict(copy.deepcopy(cfg), engine="trl"), tmp_path / "run", resume=True,
                      log=said.append).run_all()
    again = started[1]
    ckpt = trl_job.trainer_dir(first["out"]) / "checkpoint-1"
    assert again["out"] == first["out"] and again["start_step"] == 1 and again["resume_from"] == str(ckpt)
    assert f"  r1/proposer: resuming from {ckpt} (1 of 2 steps done)" in said
    # the job file a launcher reads says the same; step 1's staged proposals kept, step 2's dropped
    assert json.loads((tmp_path / "run/engine/round-1/proposer.job.json").read_text())["start_step"] == 1
    assert {json.loads(line)["step_in_round"] for line in items.read_text().splitlines()} == {1}


def _phase_names(run):
    return [json.loads(line)["phase"] for line in (run / "engine" / "phases.jsonl").read_text().splitlines()]


def test_a_trl_job_refuses_another_process_count_or_not_one_pass(tmp_path, monkeypatch):
    """Before anything loads: a job launched as more processes than it was written for (the process
    index seeds sampling and names items), or whose rows are not one pass of its steps."""
    pytest.importorskip("trl")
    from selfevo._io import write_jsonl
    from selfevo.integrations.trl_job import run_job

    write_jsonl(tmp_path / "rows.jsonl", solver_rows(_admitted(), FOLDS, 1))
    job = {"kind": "solver", "model": str(tmp_path / "no-model"), "rows": str(tmp_path / "rows.jsonl"), "steps": 2,
           "prompts_per_step": 2, "processes": 2, "search": {"retriever_url": "http://127.0.0.1:9/retrieve"}}
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="written for 2 training processes .*launched as 4"):
        run_job(job)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="has 4 rows; a job trains one pass of 3 steps × 2 prompts"):
        run_job({**job, "steps": 3})


def test_step_records_of_several_processes_merge():
    from selfevo.integrations.admit import merge_step_records

    def rec(step, ids, k):
        return {"round": 1, "step": step, "kind": "solver", "stats": {"reward": 0.0},
                "items": [{"item_id": i, "k": k, "responses": ["a"] * 5} for i in ids]}
    merged = merge_step_records([rec(20, ["a"], 5), rec(20, ["b"], 0), rec(19, ["c"], 1)])
    assert [(r["step"], [it["item_id"] for it in r["items"]]) for r in merged] == [(19, ["c"]), (20, ["a", "b"])]
    assert merged[1]["stats"]["reward"] == 0.5


ENGINE_CFG = {"backend": "lm", "treatment": "crossfit", "world": {"name": "small"},
              "loop": {"rounds": 2, "proposer_steps": 2, "solver_steps": 3, "admit_per_round": 10, "source_docs": 40},
              "engine": {"proposer_generations": 2, "proposer_prompts": 6}}


def test_engine_resume_checks_the_saved_run_as_evolve_does(tmp_path, monkeypatch):
    """Resume reads the run directory with RunDir's checking readers: a difference is named by
    field (engine.json's too), a field added since the run was made reads as its default, other
    software is warned, and a damaged folds.json is an error naming it."""
    import copy

    from selfevo.integrations import engine as eng
    from selfevo.runs import RunError

    def make(cfg, resume=True):
        return eng.EngineRun(eng.engine_config_from_dict(copy.deepcopy(cfg), engine="trl"), tmp_path / "run",
                             resume=resume, log=lambda m: None)

    first = make(ENGINE_CFG, resume=False)
    assert make(ENGINE_CFG).folds == first.folds
    other = copy.deepcopy(ENGINE_CFG)
    other["loop"]["rounds"], other["engine"]["solver_generations"] = 3, 4
    with pytest.raises(RunError, match=r"fields: loop\.rounds, engine\.solver_generations\)"):
        make(other)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    del saved["lm"]["format_penalty"]  # as a selfevo from before the field existed wrote it
    (tmp_path / "run" / "config.json").write_text(json.dumps(saved))
    make(ENGINE_CFG)
    changed = copy.deepcopy(ENGINE_CFG)
    changed["lm"] = {"format_penalty": 0.25}
    with pytest.raises(RunError, match=r"fields: lm\.format_penalty\)"):
        make(changed)
    engine_json = tmp_path / "run" / "engine" / "engine.json"
    saved = json.loads(engine_json.read_text())
    del saved["save_steps"]  # engine.json too
    engine_json.write_text(json.dumps(saved))
    make(ENGINE_CFG)
    # where it runs may change (a preempted run resumed on another node), what it computes may not
    moved = {**ENGINE_CFG, "engine": {**ENGINE_CFG["engine"], "save_steps": 5, "grader_gpus": "0,1",
                                      "grader_port": 9100, "train_gpus": "2,3"}}
    said = []
    eng.EngineRun(eng.engine_config_from_dict(copy.deepcopy(moved), engine="trl"), tmp_path / "run", resume=True,
                  log=said.append)
    assert said == ["resuming with engine.grader_gpus '' -> '0,1', engine.grader_port 8100 -> 9100, "
                    "engine.save_steps 0 -> 5, engine.train_gpus '' -> '2,3'"]
    assert json.loads(engine_json.read_text())["grader_port"] == 9100  # engine.json says where it runs now
    for field, value in (("retriever_url", "http://127.0.0.1:8000/retrieve"), ("proposer_generations", 4),
                         ("trl", {"bf16": True})):
        with pytest.raises(RunError, match=rf"fields: engine\.{field}"):  # the run's own index -> a server
            make({**moved, "engine": {**moved["engine"], field: value}})
    served = {**ENGINE_CFG, "engine": {**ENGINE_CFG["engine"], "retriever_url": "http://10.0.0.1:8000/retrieve"}}
    eng.EngineRun(eng.engine_config_from_dict(copy.deepcopy(served), engine="trl"), tmp_path / "served",
                  log=lambda m: None)
    elsewhere = {**served, "engine": {**served["engine"], "retriever_url": "http://10.0.0.2:8000/retrieve"}}
    eng.EngineRun(eng.engine_config_from_dict(copy.deepcopy(elsewhere), engine="trl"), tmp_path / "served",
                  resume=True, log=said.append)  # a server may move
    assert said[-1] == ("resuming with engine.retriever_url 'http://10.0.0.1:8000/retrieve' -> "
                        "'http://10.0.0.2:8000/retrieve'")
    # the software it runs under may change too, but not unsaid (as evolve's resume)
    from selfevo._software import SoftwareChanged, software

    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["software"] == software()
    monkeypatch.setattr("selfevo.runs.software", lambda: {**software(), "trl": "0.1"})
    with pytest.warns(SoftwareChanged, match=r"trl .* → 0\.1"):
        make(ENGINE_CFG)
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["software_resumed"][0]["software"]["trl"] \
        == "0.1"
    monkeypatch.undo()
    (tmp_path / "run" / "folds.json").write_text('{"k": 2}')
    with pytest.raises(RunError, match=r"folds\.json: field 'seed' is missing"):
        make(ENGINE_CFG)


def test_a_run_killed_while_it_is_created_can_be_started_or_resumed(tmp_path, monkeypatch):
    """engine.json is written before the manifest that makes the run exist: killed just before the
    manifest, the run starts afresh; killed just after it, it resumes (engine.json was once written
    last, and such a run could neither resume, for the missing engine.json, nor start again)."""
    import copy

    from selfevo.integrations import engine as eng
    from selfevo.runs import RunDir

    real = RunDir.create

    def make(resume=False):
        return eng.EngineRun(eng.engine_config_from_dict(copy.deepcopy(ENGINE_CFG), engine="trl"), tmp_path / "run",
                             resume=resume, log=lambda m: None)

    def killed_before(self, config):
        raise KeyboardInterrupt("killed")

    def killed_after(self, config):
        real(self, config)
        raise KeyboardInterrupt("killed")
    for kill, resume in ((killed_before, False), (killed_after, True)):
        monkeypatch.setattr(RunDir, "create", kill)
        with pytest.raises(KeyboardInterrupt):
            make()
        monkeypatch.setattr(RunDir, "create", real)
        assert make(resume=resume).folds is not None
        shutil.rmtree(tmp_path / "run")


def test_engine_keeps_the_cuda_device_asked_for(tmp_path, monkeypatch):
    """lm.device reaches the training job and the local grader server resolved as the loop's policy
    resolves it (cuda:1 once became plain "cuda", i.e. cuda:0); in-process TRL, which trains on
    cuda:0 whatever it is asked, refuses cuda:1 by name; no GPU needed."""
    import contextlib
    import copy

    import torch

    import selfevo.agents.lm.model as lm_model
    import selfevo.agents.lm.server as lm_server
    import selfevo.integrations.trl_job as trl_job
    from selfevo.config import ConfigError
    from selfevo.integrations import engine as eng

    cfg = copy.deepcopy(ENGINE_CFG)
    run = eng.EngineRun(eng.engine_config_from_dict(cfg, engine="trl"), tmp_path / "run", log=lambda m: None)
    jobs, served = [], []
    monkeypatch.setattr(trl_job, "run_job", lambda job, tool=None: jobs.append(job) or {"steps": 0, "completions": 0})
    monkeypatch.setattr(lm_model, "TransformersChatModel", lambda path, **kw: served.append(kw["device"]))
    monkeypatch.setattr(lm_server, "make_app", lambda model, max_n: None)
    monkeypatch.setattr(lm_server, "running", lambda app: contextlib.nullcontext("http://127.0.0.1:9/v1"))
    for available, device, want in [(True, "cuda:0", "cuda:0"), (True, "auto", "cuda"), (False, "auto", "cpu"),
                                    (False, "cpu", "cpu")]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        run.cfg = eng.engine_config_from_dict({**cfg, "lm": {"device": device}}, engine="trl").run
        run.train("r1/main", "solver", "main", 1, [{"item_id": "q0"}], 3, 2, 5, {"records_path": None, "round": 1})
        with run.serving({"main": ("/models/main", "main@r0")}):
            pass
        assert (jobs[-1]["device"], served[-1]) == (want, want)
    with pytest.raises(ConfigError, match=r"lm.device: cuda:1: TRL training in this process always uses cuda:0; "
                                          r"start engine-run with CUDA_VISIBLE_DEVICES=1"):
        eng.engine_config_from_dict({**cfg, "lm": {"device": "cuda:1"}}, engine="trl")
    launched = {**cfg, "lm": {"device": "cuda:1"},
                "engine": {**cfg["engine"], "launcher": "python", "retriever_url": "http://127.0.0.1:9/retrieve"}}
    run.cfg = eng.engine_config_from_dict(launched, engine="trl").run  # a launched job may name its GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with run.serving({"main": ("/models/main", "main@r0")}):
        pass
    assert served[-1] == "cuda:1"  # the local grader server runs in this process, on the GPU asked for
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    no_gpu = eng.engine_config_from_dict({**cfg, "lm": {"device": "cuda:0"}}, engine="trl")
    with pytest.raises(ConfigError, match="lm.device: cuda:0 asked for, but no CUDA GPU"):
        eng.EngineRun(no_gpu, tmp_path / "other", log=lambda m: None)  # at start, before any work
    assert not (tmp_path / "other").exists()


def test_a_failed_grader_call_is_an_error_not_a_wrong_answer(tmp_path):
    """A grader that answers the draft label every time gives k = 5 and reward 0; when some of its
    calls fail for good, the proposal must not be paid for the outage (k = 3 -> f = 0.5): the
    batch is an error and nothing of it is staged for admission or the audit."""
    tool = SearchTool(BM25Index.build(DOCS[:2]), topk=2, max_calls=2)
    folds = FoldAssignment(2, 0, "source", {"d0": 0, "d1": 1})
    text = "<question> Where is Beta? </question> <answer> sea </answer>"
    remote = {"concurrency": 1, "max_actions": 1, "max_tokens": 32, "max_retries": 0}
    model = ScriptedModel(lambda m: "<answer> sea </answer>", name="main", fail_rate=0.5, seed=3)
    with running(make_app(model)) as url:
        reward = FrontierReward(treatment="coupled", round=1, folds=folds,
                                graders={"main": Grader("main", url, "main")}, tool=tool,
                                items_path=tmp_path / "items.jsonl", remote=remote)
        with pytest.raises(GradingFailed, match="failed after retries"):
            reward.score([ProposalSample(text, "d1", 1)], step=1)
        reward.close()
    assert sum(model.faults.values()) > 0  # the case: some calls did fail
    assert not (tmp_path / "items.jsonl").exists() or read_staged(tmp_path / "items.jsonl") == []


def test_engine_run_refuses_a_run_another_process_is_writing(tmp_path, monkeypatch):
    """Like `evolve`: a second writer of one run directory is refused before it writes anything."""
    from selfevo.integrations import engine as eng
    from selfevo.runs import RunDir, RunError

    def started(*a, **k):  # past the lock: the run would start (a model load, training)
        raise AssertionError("a second writer started the run")
    monkeypatch.setattr(eng, "EngineRun", started)

    cfg = {"backend": "lm", "treatment": "crossfit", "world": {"name": "small"}}
    ecfg = eng.engine_config_from_dict(cfg, engine="trl")
    with RunDir(tmp_path / "run").lock(), pytest.raises(RunError, match="another process is writing this run"):
        eng.engine_run(ecfg, tmp_path / "run", resume=True, log=lambda m: None)
    assert not (tmp_path / "run").exists()


def test_engine_resume_is_held_to_the_world_or_corpus_it_was_made_on(tmp_path, monkeypatch):
    """engine-run recorded no world or corpus fingerprint, so a resume (and the audit, replay and report
    after it) went on over a world directory remade, or a corpus rewritten, since: as evolve's runs are
    held to theirs, these are now, and a resume (evolve's too) to the QA set its rounds were evaluated on.
    A corpus searched through a server is read from its store in selfevo's cache (a copy per file
    content); a cache where none can be written is a ConfigError naming it, before the run is made."""
    import copy

    from selfevo import evolve
    from selfevo.config import ConfigError, config_from_dict
    from selfevo.integrations import engine as eng
    from selfevo.runs import RunDir, RunError
    from selfevo.world import WorldConfig, make_world, save_world

    def make(cfg, out, resume):
        return eng.EngineRun(eng.engine_config_from_dict(copy.deepcopy(cfg), engine="trl"), out, resume=resume,
                             log=lambda m: None)

    world = tmp_path / "world"
    save_world(make_world(WorldConfig(size="small", seed=0)), world)
    on_dir = {**ENGINE_CFG, "world": {"name": str(world)}}
    make(on_dir, tmp_path / "run", resume=False)
    assert RunDir(tmp_path / "run").manifest()["world_sha256"]
    make(on_dir, tmp_path / "run", resume=True)
    shutil.rmtree(world)
    save_world(make_world(WorldConfig(size="small", seed=1)), world)  # remade under the same path
    with pytest.raises(RunError, match="the world directory has changed"):
        make(on_dir, tmp_path / "run", resume=True)
    # a corpus searched through a /retrieve server (no index here): the file's sha256
    qa = tmp_path / "qa"
    qa.mkdir()
    (qa / "nq.jsonl").write_text(json.dumps({"id": "1", "question": "Where is Beta?", "golden_answers": ["x"]})
                                 + "\n")
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"id": f"d{i}", "contents": f'"Page {i}"\nPage {i} is a page about topic {i}.'} for i in range(60)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    on_corpus = {**{k: v for k, v in ENGINE_CFG.items() if k != "world"},
                 "data": {"corpus": str(corpus), "qa_dir": str(qa)},
                 "engine": {**ENGINE_CFG["engine"], "retriever_url": "http://127.0.0.1:9/retrieve"}}
    cache = tmp_path / "cache"
    monkeypatch.setattr(evolve, "cache_root", lambda: cache)  # read when called: `cache` is reassigned below
    make(on_corpus, tmp_path / "served", resume=False)
    made = RunDir(tmp_path / "served").manifest()
    assert made["corpus_sha256"] and made["index"] is None and made["qa_sha256"]
    assert [p.name for p in (cache / "corpora").iterdir()] == [made["corpus_sha256"]]
    cache = tmp_path / "a-file"  # no directory can be made under a file
    cache.write_text("")
    with pytest.raises(ConfigError, match=rf"a-file/corpora: cannot write the store of {corpus}'s documents"):
        make(on_corpus, tmp_path / "unwritable", resume=False)
    assert not (tmp_path / "unwritable").exists()
    cache = tmp_path / "cache"
    question = (qa / "nq.jsonl").read_text()
    (qa / "nq.jsonl").write_text(question.replace("Beta", "Gamma"))  # the rounds to come: other questions
    with pytest.raises(RunError, match="the QA files have changed"):
        make(on_corpus, tmp_path / "served", resume=True)
    (qa / "nq.jsonl").write_text(question)
    make(on_corpus, tmp_path / "served", resume=True)
    # what checks such a run with no index in hand (an audit, `replay build`) builds none: the file's hash
    served_run = RunDir(tmp_path / "served")
    served_cfg = config_from_dict(served_run.config())

    def no_index(*args, **kwargs):
        raise AssertionError("an index was built to check a run that searched through a server")

    monkeypatch.setattr(evolve, "_corpus_index", no_index)
    evolve.check_world(served_run, served_cfg)
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows[::-1]))
    with pytest.raises(RunError, match="the corpus has changed"):
        evolve.check_world(served_run, served_cfg)
    with pytest.raises(RunError, match="the corpus has changed"):
        make(on_corpus, tmp_path / "served", resume=True)
    # refused before the rewritten file was copied into a store of its own
    assert [p.name for p in (cache / "corpora").iterdir()] == [made["corpus_sha256"]]


def test_engine_resume_removes_what_a_kill_left_inside_an_atomic_write(tmp_path):
    """As `evolve --resume` (RunDir.open_for_resume): the temp files of atomic writes a kill left are
    removed, anywhere in the run directory, once the resume is accepted (a refused one touches
    nothing)."""
    import copy

    from selfevo.integrations import engine as eng
    from selfevo.runs import RunError

    def make(cfg, resume=True):
        return eng.EngineRun(eng.engine_config_from_dict(copy.deepcopy(cfg), engine="trl"), tmp_path / "run",
                             resume=resume, log=lambda m: None)

    make(ENGINE_CFG, resume=False)
    temps = [tmp_path / "run" / ".manifest.json.k1ll3d00.tmp",
             tmp_path / "run" / "engine" / "round-1" / ".admitted.jsonl.abcd1234.tmp"]
    for t in temps:
        t.parent.mkdir(parents=True, exist_ok=True)
        t.write_text("half a file")
    with pytest.raises(RunError, match="config differs"):
        make({**ENGINE_CFG, "seed": 5})
    assert all(t.exists() for t in temps)
    make(ENGINE_CFG)
    assert not any(t.exists() for t in temps)


def test_vllm_graders_sample_with_vllms_defaults_not_the_models(tmp_path, monkeypatch):
    """`vllm serve` by default takes sampling defaults (Qwen's top_k=20, for one) from the model's
    generation_config.json; graders must sample at lm.temperature and lm.top_p only, as the loop's
    do, so the command asks for vLLM's neutral defaults."""
    from selfevo.integrations import engine as eng

    started = []

    class Exited:  # the command line is what is under test: the server "exits" at once
        returncode = 1

        def poll(self):
            return 1

    @contextlib.contextmanager
    def running(cmd, env=None, grace=60.0):
        started.append(cmd)
        yield Exited()

    monkeypatch.setattr(eng.shutil, "which", lambda name: "/opt/bin/vllm")
    monkeypatch.setattr(eng, "_cuda", lambda: True)
    monkeypatch.setattr(eng._proc, "running", running)
    with pytest.raises(eng.EngineUnavailable, match="exited with 1"):
        next(eng._vllm_server("/models/main", "main@r0", 8100, "6", 0.4, lambda m: None))
    cmd = started[0]
    assert cmd[:3] == ["/opt/bin/vllm", "serve", "/models/main"]
    assert cmd[cmd.index("--generation-config") + 1] == "vllm" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    # a port a server left by a killed run still holds (it would answer /health for the new one): refused
    import socket

    with socket.socket() as leftover:
        leftover.bind(("127.0.0.1", 0))
        leftover.listen()
        port = leftover.getsockname()[1]
        with pytest.raises(eng.EngineUnavailable, match=f"127.0.0.1:{port} is in use .*pgrep -af 'vllm serve'"):
            next(eng._vllm_server("/models/main", "main@r0", port, "6", 0.4, lambda m: None))
    assert len(started) == 1  # refused before anything was started


def test_trl_settings_are_checked_when_the_config_is_read(monkeypatch):
    """What the first TRL job refused only after r0/eval, as a traceback, is a ConfigError naming the
    field when the config is read: an [engine.trl] key GRPOConfig does not take, rollout_backend =
    "vllm" without engine.trl.use_vllm (TRL then builds no vLLM engine) or with the proposer scaffold
    (written with transformers). Without trl installed the keys are left to the job."""
    import sys

    from selfevo.config import ConfigError
    from selfevo.integrations.engine import engine_config_from_dict

    base = {"backend": "lm", "world": {"name": "small"}}

    def read(trl=None, lm=None, **engine):
        return engine_config_from_dict({**base, "lm": lm or {}, "engine": {**engine, "trl": trl or {}}}, engine="trl")

    with pytest.raises(ConfigError, match=r'^engine\.rollout_backend: "vllm" needs engine\.trl\.use_vllm = true$'):
        read(rollout_backend="vllm")
    with pytest.raises(ConfigError, match=r"^engine\.rollout_backend: .*lm\.proposer_scaffold"):
        read({"use_vllm": True}, {"proposer_scaffold": True}, rollout_backend="vllm")
    assert read(lm={"proposer_scaffold": True}).engine.rollout_backend == "hf"
    monkeypatch.setitem(sys.modules, "trl", None)  # trl not installed: import trl raises ImportError
    assert read({"gradient_checkpoitning": True}).engine.trl == {"gradient_checkpoitning": True}
    monkeypatch.undo()
    pytest.importorskip("trl")
    with pytest.raises(ConfigError, match=r"^engine\.trl\.gradient_checkpoitning: not a field of TRL's GRPOConfig "
                                          r"\(did you mean gradient_checkpointing\?\)$"):
        read({"bf16": True, "gradient_checkpoitning": True})
    recipe = {"bf16": True, "gradient_checkpointing": True, "use_vllm": True, "vllm_mode": "colocate",
              "vllm_gpu_memory_utilization": 0.3, "vllm_tensor_parallel_size": 1}  # configs/trl-qwen3.5-4b.toml's
    assert read(recipe, rollout_backend="vllm").engine.trl == recipe


# ---------------------------------------------------------------- review fixes (rewards, data, engine checks)


@pytest.mark.parametrize("replies, answer", [
    # search.max_calls = 1 < max_actions: the second search is refused with the bare budget-spent note
    (["<search> Beta </search>", "<search> Beta sea </search>", "<answer> sea </answer>"], "sea"),
    # an invalid action gets the bare corrective message
    (["I wonder.", "<answer> sea </answer>"], "sea")])
def test_the_reward_reads_the_answer_after_a_budget_spent_or_corrective_observation(replies, answer):
    """The budget-spent note and the corrective message carry no </information> (and quote <answer>,
    <search> tags): the reward still reads the last action after them, as the rollout does, in verl's
    decoded string and in a whole trajectory handed back as one assistant message."""
    from selfevo.agents.lm.rollout import run_rollouts

    tool = SearchTool(BM25Index.build(DOCS), topk=1, max_calls=1)
    it = iter(replies)
    (ro,) = run_rollouts([[{"role": "user", "content": "Question: Where is Beta?"}]], tool,
                         lambda convs, seed: [(next(it), "stop") for _ in convs], max_actions=len(replies))
    assert ro.answer == answer and ro.final == replies[-1]
    text = "\n".join(m["content"] for m in ro.messages[1:])  # verl: one decoded response string
    assert extract_answer(text) == answer and compute_score("selfevo_solver", text, {"target": [answer]}) == 1.0
    assert extract_answer([{"role": "assistant", "content": text}]) == answer
    assert TRLSolverReward()([None], [ro.messages[1:]], label=[answer]) == [1.0]


class _CaptureReward(FrontierReward):
    """Records what the TRL wrapper hands the frontier reward (no graders)."""

    def __init__(self):
        self.seen = []

    def score(self, batch, step=None):
        self.seen.extend(batch)
        return [0.0] * len(batch)


def test_trl_frontier_reward_without_final_reads_the_last_turn():
    """Without the rollout's `final` column the proposal is the last assistant turn, as the loop's
    proposer reads it -- not the first <question> of every turn joined with a later <answer>."""
    traj = [{"role": "assistant", "content": "<question> Who founded Gamma? </question>"},
            {"role": "user", "content": "My previous action is invalid. Let me try again."},
            {"role": "assistant", "content": "<question> Which river lies in the north? </question> <answer> Alpha "
                                             "</answer>"}]
    cap = _CaptureReward()
    TRLFrontierReward(cap)([[]], [traj], source_id=["d0"], hops=[1])
    TRLFrontierReward(cap)([[]], [traj], source_id=["d0"], hops=[1], final=["<question> q? </question> <answer> a "
                                                                            "</answer>"])
    assert [s.text for s in cap.seen] == [traj[-1]["content"], "<question> q? </question> <answer> a </answer>"]


@pytest.mark.parametrize("ground_truth", [None, {}, {"target": []}, {"target": [""]}, {"answer": ["sea"]},
                                          {"ground_truth": {"target": ["sea"]}}])
def test_verl_solver_row_without_a_label_is_an_error_not_a_zero(ground_truth):
    with pytest.raises(ValueError, match=r"selfevo_solver row needs ground_truth\.target.*got ground_truth="):
        compute_score("selfevo_solver", "<answer> sea </answer>", ground_truth, {})
    with pytest.raises(ValueError, match=r"ground_truth\.target"):
        compute_score_batch(["selfevo_solver"], ["<answer> sea </answer>"], [ground_truth], [{}])


def test_verl_solver_row_labels_as_verl_hands_them():
    import numpy as np

    for gt in ({"target": ["sea"]}, {"target": np.array(["sea"], dtype=object)}, "sea"):
        assert compute_score("selfevo_solver", "<answer> sea </answer>", gt, {}) == 1.0
    # several labels (golden answers of one's own, any of them right to Search-R1) were scored against the first
    for gt in ({"target": ["ocean", "sea"]}, {"target": np.array(["ocean", "sea"], dtype=object)}):
        with pytest.raises(ValueError, match=r"scored against its one adopted label; got 2 in ground_truth\.target"):
            compute_score("selfevo_solver", "<answer> sea </answer>", gt, {})


@pytest.mark.parametrize("extra_info, field", [(None, "source_id"), ({"hops": 1}, "source_id"),
                                               ({"source_id": "d0"}, "hops"), ({"source_id": "d0", "hops": None},
                                                                               "hops")])
def test_verl_proposer_row_without_its_lineage_names_the_field(extra_info, field, tmp_path):
    """A proposer row's source and hop count are its lineage in the records: no KeyError, no default
    hops = 1; the settings are not even read."""
    sol = "<question> Where is Beta? </question> <answer> sea </answer>"
    with pytest.raises(ValueError, match=rf"selfevo_proposer row needs extra_info\.{field} "):
        compute_score("selfevo_proposer", sol, {"target": []}, extra_info, selfevo_settings=str(tmp_path / "no.json"))
    with pytest.raises(ValueError, match=rf"extra_info\.{field} "):
        compute_score_batch(["selfevo_proposer"], [sol], [{"target": []}], [extra_info],
                            selfevo_settings=str(tmp_path / "no.json"))


def test_a_top_up_copy_is_its_own_item_in_the_solver_record(tmp_path):
    """one_pass's top-up copies carry their own id (`#2`: the second draw) and the row's lineage, so a
    row and its copy in one batch are two items of G responses each, as the loop records them."""
    rows = solver_rows(_admitted(), FOLDS, 1)
    filled = one_pass(rows, 6, seed=0)
    copy = filled[4]
    orig = next(r for r in rows if copy["item_id"] == r["item_id"] + "#2")
    assert {k: v for k, v in copy.items() if k != "item_id"} == {k: v for k, v in orig.items() if k != "item_id"}
    batch = [orig] * 2 + [copy] * 2  # G = 2 each
    cols = {k: [r[k] for r in batch] for k in ("item_id", "source_id", "source_ids", "fold", "source_folds", "hops",
                                                "draft_label")}
    rf = TRLSolverReward(tmp_path / "steps.jsonl", round=1, first_step_in_round=3)
    label = orig["label"]
    rf([r["prompt"] for r in batch], [f"<answer> {label} </answer>", "<answer> x </answer>"] * 2,
       label=[label] * 4, **cols)
    (record,) = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [(it["item_id"], it["source_id"], it["fold"], len(it["responses"]), it["k"]) for it in record["items"]] == \
        [(orig["item_id"], orig["source_id"], orig["fold"], 2, 1), (copy["item_id"], orig["source_id"], orig["fold"],
                                                                     2, 1)]


@pytest.mark.parametrize("field", ["gradient_accumulation_steps", "steps_per_generation", "num_iterations",
                                   "generation_batch_size", "max_steps", "per_device_train_batch_size",
                                   "num_generations", "seed", "temperature", "save_steps", "remove_unused_columns"])
def test_engine_trl_refuses_what_the_job_pins(field, tmp_path):
    """GRPOConfig fields the job sets itself (one generation batch = one update = one reward call; one
    pass over steps × prompts rows; selfevo's own settings) are refused by name when the config is read
    (without importing trl), and by a hand-written job."""
    from selfevo.config import ConfigError
    from selfevo.integrations.engine import engine_config_from_dict
    from selfevo.integrations.trl_job import PINNED_GRPO

    cfg = {"backend": "lm", "world": {"name": "small"}, "engine": {"trl": {"bf16": True, field: 2}}}
    with pytest.raises(ConfigError, match=rf"^engine\.trl\.{field}: {re.escape(PINNED_GRPO[field])}"):
        engine_config_from_dict(cfg, engine="trl")
    pytest.importorskip("trl")
    from selfevo.integrations.trl_job import grpo_args

    job = {"generations": 2, "prompts_per_step": 2, "out": str(tmp_path / "m"), "steps": 1, "lr": 1e-4,
           "rollout": {}, "grpo": {field: 2}}
    with pytest.raises(ValueError, match=rf"^trl job: grpo\.{field}: "):
        grpo_args(job)


def verl_phase_stand_ins(monkeypatch):
    """An engine-run's verl phase up to its files, with no model, server or verl: the phase then stops
    with EngineUnavailable after writing its rows and script."""

    from selfevo.integrations import engine as eng

    _fake_services(monkeypatch)
    monkeypatch.setattr(eng, "verl_missing", lambda: "verl")


def test_verl_refuses_the_scaffold_and_keeps_a_non_searching_proposer_to_one_action(tmp_path, monkeypatch):
    """verl's agent loop cannot force the scaffold's prefixes: refused by name. A proposer that may not
    search (lm.proposer_search = false) gets one action and no tool, as the loop's; the solvers keep both."""
    from selfevo.config import ConfigError
    from selfevo.integrations import engine as eng

    cfg = {**ENGINE_CFG, "engine": {**ENGINE_CFG["engine"], "retriever_url": "http://127.0.0.1:9/retrieve"},
           "lm": {"max_actions": 4, "adapter": "full"}}
    with pytest.raises(ConfigError, match=r"^lm\.proposer_scaffold: verl"):
        eng.engine_config_from_dict({**cfg, "lm": {"proposer_scaffold": True}}, engine="verl")
    verl_phase_stand_ins(monkeypatch)

    def proposer_script(search: bool, out: Path) -> str:
        ecfg = eng.engine_config_from_dict({**cfg, "lm": {**cfg["lm"], "proposer_search": search}}, engine="verl")
        with pytest.raises(eng.EngineUnavailable):
            eng.EngineRun(ecfg, out, log=lambda m: None).proposer(1)
        return (out / "engine" / "round-1" / "proposer.verl.sh").read_text()

    alone = proposer_script(False, tmp_path / "alone")
    assert "multi_turn.max_assistant_turns=1 " in alone and "multi_turn.tool_config_path=null " in alone
    searching = proposer_script(True, tmp_path / "searching")
    assert "multi_turn.max_assistant_turns=4 " in searching
    assert f"multi_turn.tool_config_path={tmp_path / 'searching' / 'engine' / 'verl-tool.yaml'} " in searching


def test_the_frontier_reward_refuses_one_grader_sample(tool, tmp_path):
    """f(k) with one sample pays 0 for every proposal (as loop.grader_samples = 1, refused by name):
    in FrontierReward, in reward_settings and in a hand-written settings file a verl worker reads."""
    graders = _graders({"main": ("http://127.0.0.1:9/v1", ())})
    kw = dict(treatment="coupled", round=1, folds=FOLDS, graders=graders, items_path=tmp_path / "items.jsonl")
    for bad in (1, 0, True):
        with pytest.raises(ValueError, match=r"^FrontierReward\.samples: must be >= 2 "):
            FrontierReward(tool=tool, samples=bad, **kw)
    with pytest.raises(ValueError, match=r"^reward_settings\.samples: must be >= 2 "):
        reward_settings(tmp_path / "s.json", retriever_url="http://127.0.0.1:9", samples=1, **kw)
    path = reward_settings(tmp_path / "s.json", retriever_url="http://127.0.0.1:9", samples=2, **kw)
    path.write_text(path.read_text().replace('"samples": 2', '"samples": 1'))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: samples: must be >= 2 "):
        compute_score("selfevo_proposer", "<question> q? </question> <answer> a </answer>", {"target": []},
                      {"source_id": "d0", "hops": 1}, selfevo_settings=str(path))


def _fake_engine_run(monkeypatch, out: Path, resume: bool = False):
    """An EngineRun of ENGINE_CFG with TRL, the graders, evaluation and audit faked (`_FakeEngine`)."""
    import copy

    from selfevo.integrations import engine as eng

    _fake_services(monkeypatch)
    monkeypatch.setattr(eng.EngineRun, "evaluate", lambda self, r: {"macro_cover_em": 0.0})
    monkeypatch.setattr(eng.EngineRun, "audit", lambda self: {"audit": "skipped"})
    run = eng.EngineRun(eng.engine_config_from_dict(copy.deepcopy(ENGINE_CFG), engine="trl"), out, resume=resume,
                        log=lambda m: None)
    fake = _FakeEngine(run)
    run.train = fake.train
    return run, fake


@pytest.mark.parametrize("damage", ["phases-line", "phases-field", "steps-line"])
def test_engine_resume_refuses_a_damaged_phase_or_step_log_before_any_phase(damage, tmp_path, monkeypatch):
    """A line of engine/phases.jsonl or records/steps.jsonl damaged before the last (no kill does that) is
    a RunError naming file and line when the resume starts: it was a ValueError (a traceback from
    engine-run) and, in the step log, found only when a phase committed its records, after the phases
    before it had trained again."""
    from selfevo.runs import RunError

    run, _ = _fake_engine_run(monkeypatch, tmp_path / "run")
    run.run_all()
    phases = tmp_path / "run" / "engine" / "phases.jsonl"
    lines = phases.read_text().splitlines()
    if damage == "steps-line":  # killed in r2/admit: the phases before it are done, r2/admit not
        phases.write_text("\n".join(lines[:lines.index(next(x for x in lines if '"r2/admit"' in x))]) + "\n")
        steps = tmp_path / "run" / "records" / "steps.jsonl"
        rows = steps.read_text().splitlines()
        steps.write_text("\n".join([rows[0][:40], *rows[1:]]) + "\n")
        where = r"records/steps\.jsonl:1: corrupt log line"
    elif damage == "phases-line":
        phases.write_text("\n".join([lines[0], lines[1][:30], *lines[2:]]) + "\n")
        where = r"engine/phases\.jsonl:2: corrupt log line"
    else:
        entry = json.loads(lines[4])
        del entry["trained_on"]["folds"]
        phases.write_text("\n".join([*lines[:4], json.dumps(entry), *lines[5:]]) + "\n")
        where = r"engine/phases\.jsonl:5: trained_on: field 'folds' is missing"
    with pytest.raises(RunError, match=where):
        again, fake = _fake_engine_run(monkeypatch, tmp_path / "run", resume=True)
        again.run_all()
    # a torn last line is a kill's: cut, and the run goes on
    if damage == "phases-line":
        phases.write_text("\n".join([*lines[:-1], lines[-1][:25]]))
        again, fake = _fake_engine_run(monkeypatch, tmp_path / "run", resume=True)
        again.run_all()
        assert fake.jobs == [] and json.loads(phases.read_text().splitlines()[-1])["phase"] == "audit"


def test_engine_resume_refuses_a_folds_file_its_config_does_not_make(tmp_path, monkeypatch):
    """engine-run --resume reads folds.json through evolve's check: a fold outside 0..k-1 was a
    ValueError (a traceback) before any phase, and a fold file of another seed ran on."""
    from selfevo.runs import RunError

    run, _ = _fake_engine_run(monkeypatch, tmp_path / "run")
    run.run_all()
    path = tmp_path / "run" / "folds.json"
    good = json.loads(path.read_text())
    for field, value, where in (("folds", {d: 7 for d in good["folds"]}, r"folds\.json: .*fold"),
                                ("seed", good["seed"] + 1, r"folds\.json: field 'seed'")):
        path.write_text(json.dumps({**good, field: value}))
        with pytest.raises(RunError, match=where):
            _fake_engine_run(monkeypatch, tmp_path / "run", resume=True)


@pytest.mark.parametrize("replies, max_actions", [
    (["<search> Alpha </search>"], 1),  # a proposer that does not search, whose one action is a search
    (["<question> Where is Alpha? </question>", "<search> Beta </search>"], 2),  # invalid, then a search
    (["<search> Alpha </search> <question> Where is Alpha? </question> <answer> north </answer>"], 1),
])
def test_a_proposer_that_never_answered_is_recorded_as_the_loop_records_it(replies, max_actions, tool, tmp_path):
    """A proposer rollout that ends without an answer action is "no final question" in the loop
    (`LMProposer.propose`: its Rollout.final is ''). The rewards read the same rollout -- TRL's
    `final` column, or verl's decoded response cut to its last turn as verl's agent loop ends it --
    as the same malformed proposal: -format_penalty, and the loop's reason (they said "empty question")."""
    from selfevo.agents.lm.protocol import check_proposal, parse_proposal, parse_proposer_action, proposer_messages
    from selfevo.agents.lm.rollout import run_rollouts

    it = iter(replies)
    [ro] = run_rollouts([proposer_messages("Alpha is a river in the north.", 1)], tool,
                        lambda convs, seed: [(next(it), "stop") for _ in convs], max_actions=max_actions,
                        parse=parse_proposer_action)
    loop_error = "no final question" if not ro.final else check_proposal(*parse_proposal(ro.final))  # the loop's rule
    assert loop_error == "no final question"
    graders = _graders({"main": ("http://127.0.0.1:9/v1", ())})  # never called: nothing is graded
    reward = FrontierReward(treatment="coupled", round=1, folds=FOLDS, graders=graders, tool=tool,
                            items_path=tmp_path / "items.jsonl", format_penalty=0.25)
    assert TRLFrontierReward(reward)([[]], [ro.messages[2:]], source_id=["d0"], hops=[1], final=[ro.final],
                                     read=[ro.read]) == [-0.25]
    # verl: the agent loop ends at its turn budget without running the last action's search
    verl_text = "".join(m["content"] for m in ro.messages[2:] if m["role"] == "assistant"
                        or m is not ro.messages[-1])
    path = reward_settings(tmp_path / "s.json", treatment="coupled", round=1, folds=FOLDS, graders=graders,
                           items_path=tmp_path / "items.jsonl", retriever_url="http://127.0.0.1:9", format_penalty=0.25)
    assert compute_score("selfevo_proposer", verl_text, {"target": []}, {"source_id": "d0", "hops": 1},
                         selfevo_settings=str(path)) == -0.25
    staged = read_staged(tmp_path / "items.jsonl")
    assert [r["malformed"]["format_error"] for r in staged] == [loop_error] * 2
    assert all(r["malformed"]["question"] == "" and r["malformed"]["draft_label"] == "" for r in staged)
    assert all(r["malformed"]["text"] for r in staged)  # what the model wrote, as the loop's records keep it
    if len(replies) == 1 and "<answer>" in replies[0]:  # a reply not cut at its first stop string: still a search
        assert compute_score("selfevo_proposer", replies[0], {"target": []}, {"source_id": "d0", "hops": 1},
                             selfevo_settings=str(path)) == -0.25


def test_compute_json_holds_the_last_phase_after_a_kill_before_it_was_rewritten(tmp_path, monkeypatch):
    """A phase is logged, then compute.json is rewritten from the log. Killed between the two at the
    last phase (the last evaluation, with engine.audit = "none": the audit is not counted), the resume
    found every phase done and left compute.json without it."""
    from selfevo.integrations import engine as eng

    counted = {"macro_cover_em": 0.0, "generations": {"evaluation": 10}}  # the fake's evaluation, counted
    run, _ = _fake_engine_run(monkeypatch, tmp_path / "run")
    monkeypatch.setattr(eng.EngineRun, "evaluate", lambda self, r: counted)
    run.spec = run.spec.model_copy(update={"audit": "none"})
    last = f"r{run.cfg.loop.rounds}/eval"
    real = eng.write_json

    def killed_after_the_last_phase_is_logged(path, obj):
        if Path(path).name == "compute.json" and run.phases.get(last):
            raise KeyboardInterrupt("killed")
        real(path, obj)
    monkeypatch.setattr(eng, "write_json", killed_after_the_last_phase_is_logged)
    with pytest.raises(KeyboardInterrupt):
        run.run_all()
    monkeypatch.setattr(eng, "write_json", real)
    before = json.loads((tmp_path / "run" / "compute.json").read_text())
    again, fake = _fake_engine_run(monkeypatch, tmp_path / "run", resume=True)
    monkeypatch.setattr(eng.EngineRun, "evaluate", lambda self, r: counted)
    again.spec = again.spec.model_copy(update={"audit": "none"})
    again.run_all()
    compute = json.loads((tmp_path / "run" / "compute.json").read_text())
    assert fake.jobs == [] and compute == again.phases.compute() != before


# Tests of a mutation sweep of the training-engine path (forty-first session): each passes on the code
# and fails on the mutant its docstring names.

# =====================================================================================================
# -- rewards and routing
# =====================================================================================================


class _FakeGrader:
    """Stands in for a served grader's RemoteSolver (FrontierReward._solver caches one per role): answers
    each question with `answers(question, n)`; `failed` marks the i-th sample of every question as a call
    that failed for good after retries (what RemoteSolver's trace says). Each call's questions, seed and
    search tool are kept."""

    def __init__(self, answers, failed=()):
        self.answers, self.failed, self.calls, self.seeds, self.tools = answers, set(failed), [], [], []

    def answer(self, questions, tool, *, greedy=True, n=1, seed=None, contexts=None):
        self.calls.append(list(questions))
        self.seeds.append(seed)
        self.tools.append(tool)
        return [[Trajectory(a, trace=SimpleNamespace(failed=i in self.failed))
                 for i, a in enumerate(self.answers(q, n))]
                for q in questions]

    def close(self):
        pass


def _reward_with(graders: dict, tmp_path, **kw) -> FrontierReward:
    """A FrontierReward whose graders are `_FakeGrader`s (role -> fake), each with an unreachable URL."""
    served = {role: Grader(role, "http://127.0.0.1:9/v1", role, f"{role}@r1", (int(role[-1]),) if role[-1].isdigit()
                           else (0, 1), (1,)) for role in graders}
    kw = {"treatment": "crossfit", "round": 2, "folds": FOLDS,
          "tool": SearchTool(BM25Index.build(DOCS), topk=2, max_calls=2),
          **kw}
    reward = FrontierReward(graders=served, items_path=tmp_path / "items.jsonl", **kw)
    reward._solvers.update(graders)
    return reward


def test_question_split_grades_a_question_by_the_fold_of_the_question(tool, tmp_path):
    """question-split (the control): the cross-fitting fold of a graded proposal is its question's
    (`item_fold`), not its source's or its label's, and it is graded by the other fold's aux solver with
    no fallback. Mutants: item_fold from the label / from folds.of(source) (rewards.py:167), touched
    folds from the source's fold (rewards.py:168)."""
    folds = FoldAssignment(2, 0, "source", {"d0": 0, "d1": 1})
    questions = [f"Where was Person {i} born?" for i in range(12)]
    qfolds = [item_fold("question-split", folds, "d0", q) for q in questions]
    assert set(qfolds) == {0, 1}  # one source, questions in both folds
    fakes = {"aux-0": _FakeGrader(lambda q, n: ["x"] * n), "aux-1": _FakeGrader(lambda q, n: ["x"] * n)}
    reward = _reward_with(fakes, tmp_path, treatment="question-split", folds=folds)
    reward.score([ProposalSample(f"<question> {q} </question> <answer> sea </answer>", "d0", 1) for q in questions],
                 step=1)
    items = [r["item"] for r in read_staged(tmp_path / "items.jsonl")]
    assert [it["fold"] for it in items] == qfolds
    assert [it["grader"]["id"] for it in items] == [f"aux-{1 - f}@r1" for f in qfolds]
    assert all("routing" not in it for it in items)  # never the every-fold-touched fallback
    assert fakes["aux-1"].calls == [[q for q, f in zip(questions, qfolds) if f == 0]]


def test_round_one_is_graded_by_the_main_solver_under_crossfit(tmp_path):
    """Round 1 is shared by every arm: a CrossFit reward of round 1, with only the main solver served,
    grades every fold with it. Mutant: route with round >= 2 (rewards.py:169) -> RoutingError (no aux)."""
    main = _FakeGrader(lambda q, n: ["sea"] * 2 + ["land"] * (n - 2))
    reward = _reward_with({"main": main}, tmp_path, treatment="crossfit", round=1)
    text = "<question> Where is Beta? </question> <answer> sea </answer>"
    assert reward.score([ProposalSample(text, "d0", 1), ProposalSample(text, "d1", 1)], step=1) == \
        [frontier_reward(2)] * 2
    items = [r["item"] for r in read_staged(tmp_path / "items.jsonl")]
    assert [it["grader"]["id"] for it in items] == ["main@r1"] * 2 and len(main.calls) == 1


def test_one_failed_grader_sample_is_an_error_not_a_wrong_answer(tmp_path):
    """A single sample of five that failed after retries is a GradingFailed, not a wrong answer (k = 4 ->
    f = 0.25 paid for the outage), and nothing is staged. Mutant: `if failed > 1` (rewards.py:186); the
    existing test's grader fails about half its calls, so it cannot tell."""
    main = _FakeGrader(lambda q, n: ["sea"] * n, failed={3})
    reward = _reward_with({"main": main}, tmp_path, treatment="coupled", round=2)
    with pytest.raises(GradingFailed, match="1 of 5 samples"):
        reward.score([ProposalSample("<question> Where is Beta? </question> <answer> sea </answer>", "d1", 1)], step=1)
    assert not (tmp_path / "items.jsonl").exists()


def test_a_graded_items_pages_start_with_its_source_as_the_loops_do(tmp_path):
    """source_ids is the source first, then the pages read (deduplicated), as `LMProposer.propose`
    writes a Proposal's. Mutant: read pages first (rewards.py:166)."""
    reward = _reward_with({"main": _FakeGrader(lambda q, n: ["x"] * n)}, tmp_path, treatment="coupled")
    text = "<question> Where is Beta? </question> <answer> sea </answer>"
    reward.score([ProposalSample(text, "d1", 1, ("d0", "d1", "d3"))], step=1)
    (row,) = read_staged(tmp_path / "items.jsonl")
    assert row["item"]["source_ids"] == ["d1", "d0", "d3"] and row["item"]["source_id"] == "d1"


def test_trl_frontier_reward_carries_the_rollouts_pages_and_hops_into_the_item(tmp_path):
    """TRL hands the rollout's `read` pages and the row's `hops` as columns: they are the item's lineage
    (and, connected, its routing). Mutants: read dropped (rewards.py:246), hops = 1 (rewards.py:246)."""
    fakes = {"aux-0": _FakeGrader(lambda q, n: ["x"] * n), "aux-1": _FakeGrader(lambda q, n: ["x"] * n)}
    reward = _reward_with(fakes, tmp_path, treatment="crossfit-connected", round=3)
    completions = [[{"role": "assistant", "content": "<question> Where is Beta? </question> <answer> sea </answer>"}]]
    TRLFrontierReward(reward)([[]], completions * 2, source_id=["d1", "d1"], hops=[3, 2],
                              read=[["d1", "d0"], ["d3"]])
    a, b = [r["item"] for r in read_staged(tmp_path / "items.jsonl")]
    assert (a["source_ids"], a["source_folds"], a["hops"]) == (["d1", "d0"], [0, 1], 3)
    assert a["routing"] == {"fallback": True, "touched": [0, 1]}
    assert (b["source_ids"], b["source_folds"], b["hops"], b["grader"]["id"]) == (["d1", "d3"], [1], 2, "aux-0@r1")


def test_trl_solver_reward_scores_the_rollouts_own_answer(tmp_path):
    """With the rollout's `answer` column (trl_env.SearchRollout) the reward scores that answer, not a
    re-reading of the decoded completion (cut at max_tokens, or rendered with template tokens, it can
    lose the answer the rollout ended on). Mutant: always extract_answer(completion) (rewards.py:265)."""
    assert TRLSolverReward()([None, None], ["<search> cut at the token lim", "<answer> land </answer>"],
                             label=["sea", "sea"], answer=["sea", "sea"]) == [1.0, 1.0]


def test_solver_step_records_carry_each_items_lineage_and_the_global_step(tmp_path):
    """TRLSolverReward's step record: each item's own source, fold and draft label (the admitted row's,
    not the batch's first row's nor the adopted label), and step = step_base + step in round (round 2
    of 43 steps: 43 + 19 = 62). Mutants: step = step_in_round (rewards.py:289); source_id / fold from
    row 0 (rewards.py:281-282); draft_label = the adopted label (rewards.py:284)."""
    rows = solver_rows(_admitted(), FOLDS, 2)[:2]  # d0 (fold 0) and d1 (fold 1, read d0); draft d_i, label a_i
    batch = [rows[0]] * 2 + [rows[1]] * 2
    cols = {k: [r[k] for r in batch] for k in ("item_id", "source_id", "source_ids", "fold", "source_folds", "hops",
                                                "draft_label")}
    rf = TRLSolverReward(tmp_path / "steps.jsonl", round=2, step_base=43, first_step_in_round=19)
    rf([r["prompt"] for r in batch], ["<answer> a0 </answer>", "x", "<answer> a1 </answer>", "<answer> a1 </answer>"],
       label=[r["label"] for r in batch], **cols)
    (record,) = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert (record["round"], record["step"], record["step_in_round"]) == (2, 62, 19)
    assert [(it["source_id"], it["source_ids"], it["fold"], it["source_folds"], it["draft_label"], it["adopted_label"],
             it["k"]) for it in record["items"]] == [("d0", ["d0"], 0, [0], "d0", "a0", 1),
                                                     ("d1", ["d1", "d0"], 1, [0, 1], "d1", "a1", 2)]


def test_verl_proposer_rows_carry_the_pages_read_and_hops_into_the_item(tmp_path):
    """verl's compute_score: extra_info.selfevo_read (the pages the agent loop's searches returned) and
    extra_info.hops are the item's lineage; under crossfit-connected a read page of the other fold
    makes the question touch both folds (the recorded fallback). Mutants: read dropped (rewards.py:361),
    hops = 1 (rewards.py:362)."""
    with running(make_app(_seeded_grader("g", [], lambda i, q: "sea" if i % 5 < 2 else "land"))) as gurl:
        settings = reward_settings(tmp_path / "s.json", treatment="crossfit-connected", round=2, folds=FOLDS,
                                   graders=_graders({"aux-0": (gurl, (0,)), "aux-1": (gurl, (1,))}),
                                   items_path=tmp_path / "items.jsonl", retriever_url="http://127.0.0.1:9",
                                   remote=REMOTE)
        sol = "<question> Where is Beta? </question> <answer> sea </answer>"
        assert compute_score("selfevo_proposer", sol, {"target": []},
                             {"source_id": "d1", "hops": 3, "selfevo_read": ["d1", "d0"]},
                             selfevo_settings=str(settings)) == frontier_reward(2)
    (row,) = read_staged(tmp_path / "items.jsonl")
    it = row["item"]
    assert (it["source_ids"], it["source_folds"], it["hops"]) == (["d1", "d0"], [0, 1], 3)
    assert it["routing"] == {"fallback": True, "touched": [0, 1]}


# =====================================================================================================
# -- admission (admit.py)
# =====================================================================================================


def test_admission_step_records_number_steps_as_the_loop_and_seed_each_step_by_its_global_step():
    """Round 2 of a 43-step round: the proposer records are steps 44 and 45 (step_in_round 1 and 2), and
    the admission rule of each step is seeded as the loop's (`derive_seed(seed, round, step, "admit")`,
    the global step). Mutants: step = step_in_round, step_in_round = step, step off by one
    (admit.py:130, 146), seeded by the step in round (admit.py:132)."""
    staged = [{**r, "round": 2} for r in _staged()]
    seeds = []

    def decide(items, seed):
        seeds.append(seed)
        return [Decision(True, it["draft_label"]) for it in items]
    records, _ = admit_round(staged, round=2, step_base=43, proposer_steps=2, budget=99, seed=7, decide=decide)
    assert [(r["round"], r["step"], r["step_in_round"]) for r in records] == [(2, 44, 1), (2, 45, 2)]
    assert seeds == [derive_seed(7, 2, 44, "admit"), derive_seed(7, 2, 45, "admit")]


def test_admission_step_stats_are_the_steps_own():
    """A proposer record's stats, as the loop's: reward = the mean over every proposal of the step,
    malformed ones (-format_penalty) included; admitted = the step's own admissions, not the round's so
    far. Mutants: malformed rewards left out of the mean (admit.py:141); admitted = len(round's admitted)
    (admit.py:145)."""
    staged = _staged()
    for row in staged:
        if "item" in row:
            row["item"]["reward"] = 0.75
    records, admitted = admit_round(staged, round=1, step_base=0, proposer_steps=2, budget=4, seed=0)
    assert [r["stats"]["admitted"] for r in records] == [3, 1] and len(admitted) == 4
    assert records[0]["stats"]["reward"] == 0.75
    assert records[1]["stats"]["reward"] == pytest.approx((3 * 0.75 - 0.5) / 4)


def test_an_admission_without_detail_records_none_and_an_over_budget_one_keeps_its_rules_label():
    """As the loop's item records: no `admission` field where the rule said nothing (Dr. Zero admits all),
    and an admitted-then-capped MSV item keeps the label the rule adopted (Candidate.label is the
    decision's label). Mutants: `admission: {}` always (admit.py:137); the draft label for every item
    not admitted (admit.py:136)."""
    records, _ = admit_round(_staged(1, 3), round=1, step_base=0, proposer_steps=1, budget=9, seed=0)
    assert all("admission" not in it for it in records[0]["items"])

    def msv_like(items, seed):  # what MSV decides: the matched majority replaces the draft label
        return [Decision(True, "majority", {"majority_with": "majority"}) for _ in items]
    records, admitted = admit_round(_staged(1, 3), round=1, step_base=0, proposer_steps=1, budget=2, seed=0,
                                    decide=msv_like)
    capped = records[0]["items"][2]
    assert not capped["admitted"] and capped["admission"]["over_budget"] is True
    assert capped["adopted_label"] == "majority" and capped["draft_label"] != "majority"


def test_commit_records_drops_every_later_round_a_killed_attempt_left(tmp_path):
    """Recommitting round 1's proposer records drops everything of later rounds, of any kind (a rerun of
    round 1 invalidates them). Mutant: later rounds' records of another kind kept (admit.py:173)."""
    from selfevo.integrations.admit import commit_records

    path = tmp_path / "steps.jsonl"
    commit_records(path, [{"round": 1, "kind": "proposer", "step": 1}], 1, "proposer")
    commit_records(path, [{"round": 1, "kind": "solver", "step": 2}], 1, "solver")
    commit_records(path, [{"round": 2, "kind": "solver", "step": 4}], 2, "solver")
    commit_records(path, [{"round": 1, "kind": "proposer", "step": 1, "again": True}], 1, "proposer")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"round": 1, "kind": "solver", "step": 2},
                    {"round": 1, "kind": "proposer", "step": 1, "again": True}]


def test_msv_filter_samples_as_many_times_as_it_is_told_and_reads_the_source_page(tool):
    """msv_filter honours engine.msv_samples (5 with the source, 5 without; a strict majority of 3) and
    gives the model the proposal's *source* page (source_id), not another page it read. Mutants: MSV's
    default 3 samples whatever `samples` says (admit.py:116); the context from source_ids[-1] (admit.py:118)."""
    def script(messages):
        user = messages[-1]["content"]
        if "<document>" in user:
            return "<answer> river </answer>" if "Alpha is a river" in user else "<answer> sea </answer>"
        return "<answer> sea </answer>"
    item = {**[r["item"] for r in _staged(1, 2) if "item" in r][1], "source_ids": ["d1", "d0"]}  # Beta, read Alpha
    assert item["source_id"] == "d1"
    with running(make_app(ScriptedModel(script))) as url:
        from selfevo.agents.remote import RemoteSolver

        with RemoteSolver(url, "scripted", **REMOTE) as model:
            (d,) = msv_filter([item], model, {x.id: x for x in DOCS}, tool, seed=0, samples=5)
    assert d.detail["with_source"] == ["sea"] * 5 and d.detail["without_source"] == ["sea"] * 5
    assert d.admitted and d.label == "sea"


def test_a_single_message_completion_is_read_as_its_content():
    """TRL may hand a completion as one message dict: its content is the trajectory. Mutant: a Mapping
    read as '' (rewards.py:74-75)."""
    from selfevo.integrations.rewards import extract_answer, final_turn

    msg = {"role": "assistant",
           "content": "<search> beta </search>\n<information>x</information>\n<answer> sea </answer>"}
    assert final_turn(msg) == "\n<answer> sea </answer>" and extract_answer(msg) == "sea"


def test_a_malformed_proposal_records_what_it_said_as_the_loop_does(tmp_path):
    """A proposal that breaks a format rule (the answer inside its question) is -format_penalty, never
    graded, and its malformed record keeps the question and draft label it wrote, as the loop's
    `malformed_record(question=p.question, draft_label=p.draft_label, ...)`. Mutant: blank question and
    label in the record (rewards.py:162-164)."""
    main = _FakeGrader(lambda q, n: ["sea"] * n)
    reward = _reward_with({"main": main}, tmp_path, treatment="coupled", format_penalty=0.25)
    text = "<question> Where is the sea? </question> <answer> sea </answer>"
    assert reward.score([ProposalSample(text, "d1", 2)], step=1) == [-0.25] and main.calls == []
    (row,) = read_staged(tmp_path / "items.jsonl")
    m = row["malformed"]
    assert (m["question"], m["draft_label"], m["format_error"], m["hops"], m["reward"]) == \
        ("Where is the sea?", "sea", "answer in question", 2, -0.25)


# =====================================================================================================
# -- datasets
# =====================================================================================================


def test_proposer_rows_draw_sources_at_random_and_hops_in_dr_zeros_ratio():
    """The proposer prompts draw a source from the pool and a hop count 1..4 in Dr. Zero's 4:3:2:1
    ratio, as `LMProposer.propose` does, afresh each round. Mutants: hops always 1 (datasets.py:59); sources
    taken in turn (datasets.py:58); the round left out of the seed (datasets.py:57)."""
    from collections import Counter

    rows = proposer_rows(DOCS, FOLDS, 1, 400, seed=0)
    hops = Counter(r["hops"] for r in rows)
    assert set(hops) == {1, 2, 3, 4} and hops[1] > hops[2] > hops[3] > hops[4]
    assert [r["source_id"] for r in rows[:8]] != [d.id for d in DOCS] * 2  # not round robin
    assert len({r["source_id"] for r in rows}) == len(DOCS)
    # each round draws its own prompts (the existing `a != round 3` held on the round field alone)
    later = proposer_rows(DOCS, FOLDS, 2, 400, seed=0)
    assert [(r["source_id"], r["hops"]) for r in later] != [(r["source_id"], r["hops"]) for r in rows]


def test_solver_rows_keep_the_items_cross_fitting_fold():
    """Under question-split an item's fold is its question's, which may differ from its source's: the
    solver row (and so which aux solver trains on it) keeps the item's fold, and its hops. Mutants: the
    row's fold recomputed from the source (datasets.py:69 or :41); hops = 1 (datasets.py:69)."""
    items = [{**it, "fold": 1 - it["fold"], "hops": 3} for it in _admitted()]  # question folds opposite the sources'
    rows = solver_rows(items, FOLDS, 1)
    assert [r["fold"] for r in rows] == [it["fold"] for it in items] and {r["hops"] for r in rows} == {3}
    sets = aux_training_sets(rows, ["aux-0", "aux-1"])
    assert [r["item_id"] for r in sets["aux-0"]] == [it["item_id"] for it in items if it["fold"] == 0]


def test_trl_rows_hold_every_lineage_column_the_rewards_read():
    """The TRL dataset carries every lineage column: TRLSolverReward's records read source_ids,
    draft_label and hops from them (missing, the main phase fails after its first generation). Mutants:
    draft_label / source_ids / hops left out of the columns (datasets.py:34-35, :123)."""
    pytest.importorskip("datasets")
    from selfevo.integrations.datasets import LINEAGE

    rows = solver_rows(_admitted(), FOLDS, 1)
    ds = to_trl(rows)
    assert set(ds.column_names) == {"prompt", "item_id", "role", "source_id", "source_ids", "fold", "source_folds",
                                    "group", "round", "hops", "label", "draft_label"} == {"prompt", *LINEAGE}
    assert ds[1]["draft_label"] == "d1" and ds[1]["source_ids"] == ["d1", "d0"] and ds[1]["hops"] == 1


def test_verl_rows_carry_the_lineage_compute_score_reads(tmp_path):
    """verl hands extra_info to compute_score: a proposer row's source_id and hops are its proposal's
    lineage (and its routing); a solver row keeps its item id and draft label. Mutants: extra_info.source_id
    from another page, hops = 1, item_id blank, draft_label = the adopted label (datasets.py:153-156)."""
    items = [{**_admitted()[1], "hops": 3}]
    prop = proposer_rows(DOCS, FOLDS, 1, 30, seed=0)
    prop = [r for r in prop if r["hops"] > 1][:1]
    back = read_verl(write_verl(solver_rows(items, FOLDS, 1) + prop, tmp_path / "t.parquet"))
    s, p = back[0]["extra_info"], back[1]["extra_info"]
    assert (s["item_id"], s["source_id"], s["source_ids"], s["hops"], s["draft_label"]) == \
        ("r1-s1-0", "d1", ["d1", "d0"], 3, "d1")
    assert (p["item_id"], p["source_id"], p["hops"]) == (prop[0]["item_id"], prop[0]["source_id"], prop[0]["hops"])


# =====================================================================================================
# tests/test_integrations.py (or test_lm_known.py)  -- trl_env (the TRL rollout)
# =====================================================================================================


def test_a_proposer_rollout_that_may_not_search_gets_one_action(tool):
    """lm.proposer_search = false, or the scaffold (which offers no search): the TRL rollout, as the loop's
    proposer, gets one action; a search or a question cut at the token limit is then "no final question",
    not a retry. Mutants: max_actions whatever `searching` (trl_env.py:262); searching = search alone,
    ignoring the scaffold (trl_env.py:260)."""
    from selfevo.integrations.trl_env import SearchRollout

    convs = [[{"role": "user", "content": "doc"}]]
    replies = iter(["<search> Alpha </search>", "<question> Where is Alpha? </question> <answer> north </answer>"])
    (ro,) = SearchRollout(tool, role="proposer", search=False).rollouts(
        convs, lambda cs, seed: [(next(replies), "stop") for _ in cs], seed=0)
    assert ro.actions == 1 and ro.final == ""

    def cut(cs, seed, prefix=None, stops=()):  # every question cut at the token limit
        return [(p + " Where is Alp", "length") for p in prefix]
    (ro,) = SearchRollout(tool, role="proposer", scaffold=True, search=True).rollouts(convs, cut, seed=0)
    assert ro.actions == 1 and ro.final == ""


def test_the_trl_rollout_cuts_a_completion_and_its_mask_at_max_tokens(smollm2_path, tool):
    """A completion longer than engine max_tokens is cut, ids and env_mask alike (TRL zips them). Mutant:
    the ids not cut (trl_env.py:289)."""
    from transformers import AutoTokenizer

    from selfevo.integrations.trl_env import SearchRollout

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    replies = iter([("<search> Beta </search>", "stop"), ("<answer> the sea </answer>", "stop")])
    ro = SearchRollout(tool, role="solver", max_actions=3, max_tokens=7)
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "Question: Where is Beta?"}]
    out = ro.encode(tok, [prompt], ro.rollouts([prompt], lambda convs, seed: [next(replies)], seed=0))
    assert len(out["completion_ids"][0]) == len(out["env_mask"][0]) == 7 and out["answer"] == ["the sea"]


def test_the_trl_proposer_rows_forward_the_rollouts_final_action_not_its_last_message(smollm2_path, tool):
    """A proposer that never gave a final question forwards final '' (the reward pays it as "no final
    question"), though its last assistant message has text. Mutant: `final` read from the last assistant
    message instead of `Rollout.final` (a sweep's survivor)."""
    from transformers import AutoTokenizer

    from selfevo.integrations.trl_env import SearchRollout

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    prompt = [{"role": "user", "content": "doc"}]
    prop = SearchRollout(tool, role="proposer", search=False)
    (ro,) = prop.rollouts([prompt], lambda cs, seed: [("<search> Alpha </search>", "stop") for _ in cs], seed=0)
    assert ro.final == "" and ro.messages[-1]["role"] == "assistant" and ro.messages[-1]["content"]
    assert prop.encode(tok, [prompt], [ro])["final"] == [""]


def test_each_training_process_samples_its_own_rollouts(monkeypatch, tool):
    """Data-parallel processes generate their own rows: the rollout seed differs by process index (else
    every process samples the same numbers), and by step. Mutant: the process left out of the seed
    (trl_env.py:249)."""
    seeds = []
    _rollout_without_a_model(monkeypatch, rollouts=lambda self, starts, gen, seed: seeds.append(seed) or [])
    for process in (0, 1):
        trl_env.SearchRollout(tool, seed=3)([], _trl_trainer(process, 5))
    trl_env.SearchRollout(tool, seed=3)([], _trl_trainer(0, 6))
    assert len(set(seeds)) == 3


def _rollout_without_a_model(monkeypatch, template_of=lambda tok, **kw: None,
                             rollouts=lambda self, starts, gen, seed: []):
    """SearchRollout's call with its template, generator, rollouts and encoding stubbed: what is left is how
    it reads the trainer."""
    monkeypatch.setattr(trl_env, "template_of", template_of)
    monkeypatch.setattr(trl_env, "append_only", lambda template: None)
    monkeypatch.setattr(trl_env.SearchRollout, "_generator", lambda self, trainer, tok, render: None)
    monkeypatch.setattr(trl_env.SearchRollout, "rollouts", rollouts)
    monkeypatch.setattr(trl_env.SearchRollout, "encode", lambda self, tok, prompts, rollouts, render=None: {})


def _trl_trainer(process: int = 0, step: int = 1, tok=None, **args):
    """The parts of a TRL trainer a rollout reads: its tokenizer, process index, step and GRPO args."""
    return SimpleNamespace(processing_class=tok, accelerator=SimpleNamespace(process_index=process),
                           state=SimpleNamespace(global_step=step), args=SimpleNamespace(**args))


# =====================================================================================================
# -- engine.py's admit phase (the orchestrator, engine faked)
# =====================================================================================================


def test_the_engines_msv_admission_samples_engine_msv_samples_times(tmp_path, monkeypatch):
    """engine.msv_samples reaches the MSV filter, and the phase counts 2 x msv_samples generations a
    well-formed candidate. Mutants: msv_filter called without it (engine.py:701: MSV's default 3);
    the count fixed at 6 (engine.py:706)."""
    import copy

    from test_integrations import ENGINE_CFG, _stage_proposals

    import selfevo.agents.remote as remote
    from selfevo.integrations import engine as eng

    _fake_services(monkeypatch)

    class Unserved:  # the main solver's endpoint: never called, msv_filter is faked
        def __init__(self, *a, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr(remote, "RemoteSolver", Unserved)
    seen = []

    def msv(items, model, docs, tool, seed, samples=3):
        seen.append(samples)
        return [Decision(True, it["draft_label"]) for it in items]
    monkeypatch.setattr(eng, "msv_filter", msv)
    cfg = copy.deepcopy(ENGINE_CFG)
    cfg["treatment"], cfg["engine"]["msv_samples"] = "msv", 5
    run = eng.EngineRun(eng.engine_config_from_dict(cfg, engine="trl"), tmp_path / "run", log=lambda m: None)
    _stage_proposals(run.round_dir(1) / "proposer-items.jsonl", 1, proposer_rows(run.pool, run.folds, 1, 4, seed=0), 2)
    out = run.admit(1)
    assert seen == [5, 5] and out["candidates"] == 4 and out["generations"] == {"msv": 2 * 5 * 4}


def test_engine_round_two_proposer_records_and_items_carry_the_global_step(tmp_path, monkeypatch):
    """Round 2 of 2 proposer + 3 solver steps: its proposer step records are steps 6 and 7, as the loop's
    schedule numbers them, and its reward's item ids start from step_base 5 (r2-s6-0...). Mutants: the admit
    phase's step_base 0 (engine.py:690); the reward's step_base 0 (engine.py:678)."""
    from test_integrations import _fake_engine_run

    run, fake = _fake_engine_run(monkeypatch, tmp_path / "run")
    run.run_all()
    steps = [json.loads(line) for line in (tmp_path / "run" / "records" / "steps.jsonl").read_text().splitlines()]
    assert [(s["round"], s["step"], s["step_in_round"]) for s in steps if s["kind"] == "proposer"] == \
        [(1, 1, 1), (1, 2, 2), (2, 6, 1), (2, 7, 2)]
    assert [j["reward"]["step_base"] for j in fake.jobs if j["role"] == "proposer"] == [0, 5]


def test_an_engine_key_at_the_top_level_is_blamed_where_it_was_set_under_the_engine_option(tmp_path):
    """`engine-run --engine trl` (the CLI always passes --engine) over a config with a top-level
    `engine = "trl"` said "engine: expected a table ..." without the file, and `--set engine=verl` without
    "(set by --set)": blame took the `engine` table for the option's engine.engine."""
    from selfevo.config import ConfigError
    from selfevo.integrations.engine import load_engine_config

    path = tmp_path / "c.toml"
    path.write_text('backend = "lm"\nengine = "trl"\n')
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: engine: expected a table"):
        load_engine_config(path, engine="trl")
    path.write_text('backend = "lm"\n')
    with pytest.raises(ConfigError, match=r"^engine: expected a table .*\(set by --set\)$"):
        load_engine_config(path, ["engine=verl"], engine="trl")


# Tests of a mutation sweep of engine.py (forty-second session): each passes on the code and fails on the
# mutant its docstring names.


def test_computed_setting_keeps_whether_a_server_was_searched_not_which():
    """`report`/`compare` pool and pair engine runs by computed_setting: a retriever server's address, TRL's
    logging keys and where a run executed are not what it computed (mutants: the URL kept as is; the
    [engine.trl] table kept whole)."""
    from selfevo.integrations.engine import computed_setting

    base = {"engine": "trl", "solver_generations": 5, "grader_port": 8100, "retriever_url": "http://10.0.0.1:8000/r",
            "trl": {"bf16": True, "report_to": "wandb", "run_name": "a"}}
    moved = {**base, "grader_port": 9100, "retriever_url": "http://10.0.0.2:8000/r",
             "trl": {"bf16": True, "report_to": "none", "run_name": "b"}}
    assert computed_setting(base) == computed_setting(moved) == {
        "engine": "trl", "solver_generations": 5, "retriever_url": True, "trl": {"bf16": True}}
    assert computed_setting({**base, "retriever_url": ""})["retriever_url"] is False  # its own index: what
    assert computed_setting({**base, "trl": {"bf16": False}}) != computed_setting(base)


def test_graders_of_one_model_share_a_server_and_each_vllm_server_gets_its_port_and_gpu(tmp_path, monkeypatch):
    """`serving`: roles whose model directory is the same share one server (and its name); with
    graders = "vllm" server i listens on grader_port + i on the i-th of grader_gpus (mutants: a server per
    role; every server on grader_port; every server on the first GPU)."""
    import copy

    from selfevo.integrations import engine as eng

    cfg = copy.deepcopy(ENGINE_CFG)
    cfg["engine"] = {**cfg["engine"], "graders": "vllm", "grader_gpus": "6,7", "grader_port": 9000}
    run = eng.EngineRun(eng.engine_config_from_dict(cfg, engine="trl"), tmp_path / "run", log=lambda m: None)
    started = []

    def fake_vllm(path, name, port, gpus, memory, say):
        started.append((path, name, port, gpus, memory))
        yield f"http://127.0.0.1:{port}/v1"
    monkeypatch.setattr(eng, "_vllm_server", fake_vllm)
    with run.serving({"aux-0": ("/m/aux-0", "aux-0@r1"), "aux-1": ("/m/aux-1", "aux-1@r1")}) as served:
        assert served == {"aux-0": ("http://127.0.0.1:9000/v1", "aux-0@r1"),
                          "aux-1": ("http://127.0.0.1:9001/v1", "aux-1@r1")}
    assert started == [("/m/aux-0", "aux-0@r1", 9000, "6", 0.4), ("/m/aux-1", "aux-1@r1", 9001, "7", 0.4)]
    started.clear()
    with run.serving({"aux-0": ("/m/base", "aux-0@r1"), "aux-1": ("/m/base", "aux-1@r1")}) as served:
        assert served["aux-0"] == served["aux-1"] == ("http://127.0.0.1:9000/v1", "aux-0@r1")
    assert len(started) == 1
    # numbered by server, not by role: two untrained aux solvers on the base model and a third trained one
    # put two servers on 9000 and 9002, both on GPU 6, while GPU 7 stayed idle
    started.clear()
    with run.serving({"aux-0": ("/m/base", "aux-0@r1"), "aux-1": ("/m/base", "aux-1@r1"),
                      "aux-2": ("/m/aux-2", "aux-2@r1")}) as served:
        assert served["aux-2"] == ("http://127.0.0.1:9001/v1", "aux-2@r1")
    assert [(port, gpu) for _, _, port, gpu, _ in started] == [(9000, "6"), (9001, "7")]


def test_the_engines_graders_sample_at_lm_temperature_and_top_p(tmp_path):
    """The remote solvers (graders, MSV, evaluation) are told lm.temperature and lm.top_p, each as
    itself (mutant: the two swapped), with the grader concurrency and the token and action limits."""
    import copy

    from selfevo.integrations import engine as eng

    cfg = copy.deepcopy(ENGINE_CFG)
    cfg["lm"] = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 64, "max_actions": 3}
    cfg["engine"] = {**cfg["engine"], "grader_concurrency": 3}
    run = eng.EngineRun(eng.engine_config_from_dict(cfg, engine="trl"), tmp_path / "run", log=lambda m: None)
    assert run.remote_options() == {"max_tokens": 64, "max_actions": 3, "concurrency": 3, "temperature": 0.7,
                                    "top_p": 0.9}


def test_a_round_model_directory_without_its_config_is_not_the_rounds_model(tmp_path):
    """model_dir: a role's model after a round is a directory with config.json (what a whole save leaves),
    else the round before's, else the base model: a kill while saving leaves the directory without it
    (mutant: any directory counts). A round-1 model is found from round 1 on (mutant: the search stops
    before round 1)."""
    import copy

    from selfevo.integrations import engine as eng

    run = eng.EngineRun(eng.engine_config_from_dict(copy.deepcopy(ENGINE_CFG), engine="trl"), tmp_path / "run",
                        log=lambda m: None)
    base = run.base_model()
    models = tmp_path / "run" / "models" / "main"
    (models / "round-1").mkdir(parents=True)  # killed while saving round 1's model
    assert run.model_dir("main", 1) == run.model_dir("main", 2) == base
    (models / "round-1" / "config.json").write_text("{}")
    (models / "round-2").mkdir()
    assert run.model_dir("main", 1) == run.model_dir("main", 2) == str(models / "round-1")
    assert run.model_dir("main", 0) == base


def test_a_resumed_phase_trains_from_the_model_before_its_round(tmp_path, monkeypatch):
    """A phase killed after its job saved the round's model but before it was logged runs its job again
    (trl_job.resume goes on from the checkpoint): the job starts from the model of the round before,
    not from the round's own half-finished one (mutant: model_dir(role, r)). The job carries the
    [engine] settings it runs with: engine.trl, save_steps, train_processes, and the scaffold for the
    proposer only (mutants: each dropped; a scaffolded solver)."""
    import copy

    from selfevo.integrations import engine as eng

    cfg = copy.deepcopy(ENGINE_CFG)
    cfg["lm"] = {"proposer_scaffold": True}
    cfg["engine"] = {**cfg["engine"], "trl": {"warmup_steps": 1}, "save_steps": 2, "train_processes": 2,
                     "launcher": "python", "retriever_url": "http://127.0.0.1:9/retrieve"}
    run = eng.EngineRun(eng.engine_config_from_dict(cfg, engine="trl"), tmp_path / "run", log=lambda m: None)
    out = tmp_path / "run" / "models" / "main" / "round-1"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")  # saved, then killed before r1/main was logged
    ran = []
    monkeypatch.setattr(eng._proc, "run", lambda cmd, env=None: ran.append((cmd, env)))

    def result(path):
        return {"steps": 3, "completions": 0}
    monkeypatch.setattr(eng, "read_json", result)
    rows = [{"item_id": f"q{i}"} for i in range(4)]
    for kind in ("solver", "proposer"):
        role = "main" if kind == "solver" else "proposer"
        run.train(f"r1/{role}", kind, role, 1, rows, 2, 2, 5, {"records_path": None, "round": 1})
        job = json.loads((tmp_path / "run" / "engine" / "round-1" / f"{role}.job.json").read_text())
        assert job["model"] == run.base_model() and job["out"] == str(tmp_path / "run" / "models" / role / "round-1")
        assert (job["grpo"], job["save_steps"], job["processes"]) == ({"warmup_steps": 1}, 2, 2)
        assert job["rollout"]["scaffold"] is (kind == "proposer")
    assert [cmd[-3:] for cmd, _ in ran] == [["-m", "selfevo.integrations.trl_job", str(
        tmp_path / "run" / "engine" / "round-1" / f"{role}.job.json")] for role in ("main", "proposer")]


def test_a_launched_job_runs_on_engine_train_gpus(tmp_path, monkeypatch):
    """engine.train_gpus: the CUDA_VISIBLE_DEVICES of a training job run under engine.launcher (mutant:
    the launcher started with this process's environment)."""
    import copy

    from selfevo.integrations import engine as eng

    cfg = copy.deepcopy(ENGINE_CFG)
    cfg["engine"] = {**cfg["engine"], "launcher": "accelerate launch", "train_gpus": "2,3",
                     "retriever_url": "http://127.0.0.1:9/retrieve"}
    run = eng.EngineRun(eng.engine_config_from_dict(cfg, engine="trl"), tmp_path / "run", log=lambda m: None)
    ran = []
    monkeypatch.setattr(eng._proc, "run", lambda cmd, env=None: ran.append((cmd, env)))
    monkeypatch.setattr(eng, "read_json", lambda path: {"steps": 2, "completions": 0})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    run.train("r1/main", "solver", "main", 1, [{"item_id": "q0"}], 2, 1, 5, {"records_path": None, "round": 1})
    [(cmd, env)] = ran
    assert cmd[:2] == ["accelerate", "launch"] and env["CUDA_VISIBLE_DEVICES"] == "2,3"


@pytest.mark.parametrize("processes, prompts", [(1, 3), (2, 4)])
def test_the_proposer_fills_the_steps_proposals_in_groups_rounded_up_to_the_processes(processes, prompts, tmp_path,
                                                                                     monkeypatch):
    """engine.proposer_prompts = 0: a proposer update has enough prompts of proposer_generations
    completions to write loop.proposals_per_step proposals (10 admitted over 2 steps: 5, in groups of 2:
    3 prompts), rounded up to a multiple of the training processes (mutants: rounded down; not rounded
    to the processes); its job covers the proposer steps with that many prompts each."""
    import copy

    from selfevo.integrations import engine as eng

    cfg = copy.deepcopy(ENGINE_CFG)
    cfg["engine"] = {"proposer_generations": 2, "proposer_prompts": 0, "train_processes": processes}
    if processes > 1:
        cfg["engine"].update(launcher="accelerate launch", retriever_url="http://127.0.0.1:9/retrieve")
    _fake_services(monkeypatch)
    run = eng.EngineRun(eng.engine_config_from_dict(cfg, engine="trl"), tmp_path / "run", log=lambda m: None)
    fake = _FakeEngine(run)
    run.train = fake.train
    out = run.proposer(1)
    [job] = fake.jobs
    assert out["prompts_per_step"] == job["per_step"] == prompts and len(job["rows"]) == 2 * prompts
    assert out["generations"] == {"proposer": 2 * prompts * 2, "grader": 2 * prompts * 5}


def test_a_logged_phase_drops_its_own_checkpoints_and_nothing_beside_another_model(tmp_path):
    """Once a training phase is logged its TRL and verl checkpoints go; a model directory outside the
    run's models/ (the base model, where a job left no model of its own) keeps what lies beside it
    (mutant: the is_relative_to guard dropped)."""
    import copy

    from selfevo.integrations import engine as eng
    from selfevo.integrations.trl_job import trainer_dir

    run = eng.EngineRun(eng.engine_config_from_dict(copy.deepcopy(ENGINE_CFG), engine="trl"), tmp_path / "run",
                        log=lambda m: None)
    base = tmp_path / "hub" / "base-model"
    (trainer_dir(base) / "checkpoint-1").mkdir(parents=True)  # another user's job beside the base model
    run._drop_checkpoints({"phase": "r1/proposer", "round": 1, "model": str(base)})
    assert (trainer_dir(base) / "checkpoint-1").exists()
    own = tmp_path / "run" / "models" / "main" / "round-1"
    (trainer_dir(own) / "checkpoint-3").mkdir(parents=True)
    (run._verl_ckpt_dir("main", 1) / "global_step_3").mkdir(parents=True)
    run._drop_checkpoints({"phase": "r1/main", "round": 1, "model": str(own)})
    assert not trainer_dir(own).exists() and not run._verl_ckpt_dir("main", 1).exists()


def test_a_round_checkpoint_holds_each_solvers_models_and_lineage_after_the_round(tmp_path, monkeypatch):
    """r{r}/eval writes checkpoints/round-r.json with each role's model and lineage after round r, the
    aux solvers' included (mutant: the lineage before the round), and logs the evaluation's macro
    Cover-EM and one generation a question (mutant: a constant count)."""
    from selfevo.integrations import engine as eng

    real_evaluate = eng.EngineRun.evaluate
    run, _ = _fake_engine_run(monkeypatch, tmp_path / "run")
    monkeypatch.setattr(eng.EngineRun, "evaluate", real_evaluate)
    monkeypatch.setattr(eng.EngineRun, "_evaluate", lambda self, r: {"macro": {"cover_em": 0.25 * r},
                                                                   "run": {"questions": 7}})
    run.run_all()
    trained = {e["trained_on"]["role"]: e["trained_on"] for e in run.phases.entries.values()
               if e["round"] == 1 and "trained_on" in e}
    assert sorted(trained) == ["aux-0", "aux-1", "main"]
    ckpt = json.loads((tmp_path / "run" / "checkpoints" / "round-1.json").read_text())
    assert ckpt["lineage"] == {role: {"folds": t["folds"], "rounds": [1]} for role, t in trained.items()}
    assert ckpt["models"] == {role: str(tmp_path / "run" / "models" / role / "round-1")
                              for role in ("proposer", "main", "aux-0", "aux-1")}
    assert not (tmp_path / "run" / "checkpoints" / "round-0.json").exists()  # r0/eval is no round (mutant: r >= 0)
    two = json.loads((tmp_path / "run" / "checkpoints" / "round-2.json").read_text())
    assert two["lineage"]["main"]["rounds"] == [1, 2] and two["lineage"]["aux-0"]["rounds"] == [1]
    assert two["models"]["aux-0"].endswith("aux-0/round-1")  # no aux solver trains in the last round
    evals = [run.phases.get(f"r{r}/eval") for r in (0, 1, 2)]
    assert [e["macro_cover_em"] for e in evals] == [0.0, 0.25, 0.5]
    assert json.loads((tmp_path / "run" / "compute.json").read_text())["generations"]["evaluation"] == 3 * 7


def test_a_resume_reads_an_engine_field_older_engine_json_lacks_as_its_default(tmp_path):
    """engine.json written before a field existed: the field reads as its default, so a resume keeping
    the default is no difference (mutant: with_new_defaults dropped -- a field of what the run computes
    refused), and one moving a where-field says it moves from the default (mutant: from None)."""
    import copy

    from selfevo.integrations import engine as eng

    said = []

    def make(cfg, resume=True):
        return eng.EngineRun(eng.engine_config_from_dict(copy.deepcopy(cfg), engine="trl"), tmp_path / "run",
                             resume=resume, log=said.append)

    make(ENGINE_CFG, resume=False)
    engine_json = tmp_path / "run" / "engine" / "engine.json"
    saved = json.loads(engine_json.read_text())
    del saved["msv_samples"], saved["save_steps"]  # as a selfevo from before these fields wrote it
    engine_json.write_text(json.dumps(saved))
    make(ENGINE_CFG)
    assert said == []
    make({**ENGINE_CFG, "engine": {**ENGINE_CFG["engine"], "save_steps": 5}})
    assert said == ["resuming with engine.save_steps 0 -> 5"]


def test_engine_config_errors_of_engine_engine_and_of_an_empty_yaml_file(tmp_path):
    """--engine against the config's engine is --engine's error, named by the field alone (blame's
    `given`; mutant: blamed on the file); an empty YAML file reads as no tables, so the error is the
    backend's (mutant: "expected a table")."""
    from selfevo.config import ConfigError
    from selfevo.integrations.engine import load_engine_config

    path = tmp_path / "c.toml"
    path.write_text('backend = "lm"\n[engine]\nengine = "verl"\n')
    with pytest.raises(ConfigError, match=r"^engine\.engine: the config says 'verl', --engine says 'trl'$"):
        load_engine_config(path, engine="trl")
    empty = tmp_path / "c.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=rf'^{re.escape(str(empty))}: backend: engine-run trains language models'):
        load_engine_config(empty)


@pytest.mark.parametrize("text, said", [
    # a key given twice: YAML's loader kept the last, silently (TOML refuses it)
    ("seed: 1\nseed: 7\n", ": duplicate key 'seed' (at line 2, column 1)"),
    ("backend: lm\nengine:\n  engine: trl\n  engine: verl\n", ": duplicate key 'engine' (at line 4, column 3)"),
    # a syntax error: one line naming the file, not PyYAML's seven naming "<unicode string>"
    ("backend: lm\nworld: {name: small\n", ": expected ',' or '}', but got '<stream end>' (at line 3, column 1)"),
    ("? [a]\n: 1\n", ": found unhashable key (at line 1, column 3)"),
    ("backend: lm\nbase: &b {grader_port: 8200}\nengine:\n  <<: *b\n  grader_port: 8300\n  grader_port: 8400\n",
     ": duplicate key 'grader_port' (at line 6, column 3)"),  # a merge key is no key of its own
])
def test_a_yaml_engine_config_that_yaml_would_misread_is_named_by_file_and_line(tmp_path, text, said):
    from selfevo.config import ConfigError
    from selfevo.integrations.engine import load_engine_config

    path = tmp_path / "e.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_engine_config(path)
    assert str(e.value) == f"{path}{said}"


def test_a_yaml_engine_config_merges_anchors_as_yaml_does(tmp_path):
    """The duplicate-key check left merge keys (`<<: *anchor`) to the loader: they were refused once ("could
    not determine a constructor"); a key of the mapping's own still overrides a merged one."""
    from selfevo.integrations.engine import load_engine_config

    path = tmp_path / "e.yaml"
    path.write_text("backend: lm\nbase: &b {grader_port: 8200, grader_concurrency: 4}\n"
                    "engine:\n  <<: *b\n  grader_port: 8300\n")
    with pytest.raises(Exception, match="base: unknown field"):  # (the anchor's own table is no config table)
        load_engine_config(path)
    path.write_text("backend: lm\nengine:\n  <<: [{grader_port: 8200}, {grader_concurrency: 4}]\n"
                    "  grader_port: 8300\n")
    spec = load_engine_config(path).engine
    assert (spec.grader_port, spec.grader_concurrency) == (8300, 4)


@pytest.mark.parametrize("field", ["proposer_generations", "solver_generations", "msv_samples"])
def test_the_engines_own_sample_counts_are_capped_as_the_loops_are(tmp_path, field):
    from selfevo.config import ConfigError
    from selfevo.integrations.engine import load_engine_config

    path = tmp_path / "e.toml"
    path.write_text(f'backend = "lm"\n[engine]\n{field} = 1001\n')
    with pytest.raises(ConfigError, match=rf"engine\.{field}: Input should be less than or equal to 1000"):
        load_engine_config(path)


def test_the_engine_option_sets_the_engine_a_config_leaves_unsaid():
    """`--engine verl` over a config without engine.engine runs verl (mutant: the option dropped, the
    default "trl" kept)."""
    from selfevo.config import ConfigError
    from selfevo.integrations.engine import engine_config_from_dict

    cfg = {"backend": "lm", "lm": {"adapter": "full", "proposer_scaffold": False},
           "engine": {"retriever_url": "http://127.0.0.1:9/retrieve"}}
    assert engine_config_from_dict(cfg, engine="verl").engine.engine == "verl"
    assert engine_config_from_dict(cfg).engine.engine == "trl"
    with pytest.raises(ConfigError, match=r"^engine\.retriever_url: verl's search tool"):
        engine_config_from_dict({"backend": "lm", "lm": {"adapter": "full", "proposer_scaffold": False}},
                                engine="verl")


def test_a_launched_trl_job_needs_a_retriever_server_when_the_config_is_read():
    """engine.launcher runs the job in other processes, which search through a /retrieve server: a
    launcher without engine.retriever_url is refused by field when read (mutant: the check dropped)."""
    from selfevo.config import ConfigError
    from selfevo.integrations.engine import engine_config_from_dict

    with pytest.raises(ConfigError, match=r"^engine\.retriever_url: a launched TRL job searches through a /retrieve"):
        engine_config_from_dict({"backend": "lm", "engine": {"launcher": "accelerate launch"}}, engine="trl")
    ecfg = engine_config_from_dict({"backend": "lm", "engine": {"launcher": "accelerate launch",
                                                               "retriever_url": "http://127.0.0.1:9/retrieve"}})
    assert ecfg.engine.launcher == "accelerate launch"


@pytest.mark.parametrize("field, value, said", [
    ("round", None, r"engine/phases\.jsonl:3: field 'round' is missing"),
    ("phase", 3, r"engine/phases\.jsonl:3: field 'phase' should be"),
    ("seconds", "12.5", r"engine/phases\.jsonl:3: field 'seconds' should be"),
    ("updates", [1], r"engine/phases\.jsonl:3: field 'updates' should be"),
])
def test_a_phase_log_entry_without_its_fields_is_refused_naming_file_and_line(field, value, said, tmp_path,
                                                                             monkeypatch):
    """Every field resume reads of a phase log entry is checked when the log is opened: a missing round
    or phase, a seconds or updates of the wrong type is a RunError naming file and line before any
    phase, not a KeyError or TypeError from compute.json's sums or the lineage (mutants: the required
    fields unchecked; the optional ones unchecked)."""
    from selfevo.runs import RunError

    run, _ = _fake_engine_run(monkeypatch, tmp_path / "run")
    run.run_all()
    phases = tmp_path / "run" / "engine" / "phases.jsonl"
    lines = phases.read_text().splitlines()
    entry = json.loads(lines[2])
    if value is None:
        del entry[field]
    else:
        entry[field] = value
    phases.write_text("\n".join([*lines[:2], json.dumps(entry), *lines[3:]]) + "\n")
    with pytest.raises(RunError, match=said):
        _fake_engine_run(monkeypatch, tmp_path / "run", resume=True)


def test_the_main_solvers_phase_numbers_its_steps_after_the_proposers_and_records_every_fold_it_read(
        tmp_path, monkeypatch):
    """r{r}/main: its job's solver records start after the round's proposer steps, at the run's global
    step (mutant: first_step_in_round one early); each step has ceil(rows / steps) questions rounded up
    to a multiple of the training processes (mutant: not rounded); its lineage is every fold its
    questions' pages came from, not only the questions' own folds (mutant: x["fold"])."""
    import copy

    from selfevo._io import write_jsonl
    from selfevo.integrations import engine as eng

    cfg = copy.deepcopy(ENGINE_CFG)
    cfg["engine"] = {**cfg["engine"], "train_processes": 2, "launcher": "accelerate launch",
                     "retriever_url": "http://127.0.0.1:9/retrieve"}
    run = eng.EngineRun(eng.engine_config_from_dict(cfg, engine="trl"), tmp_path / "run", log=lambda m: None)
    fake = _FakeEngine(run)
    run.train = fake.train
    a = next(d for d in run.pool if run.folds.of(d.id) == 0)
    b = next(d for d in run.pool if run.folds.of(d.id) == 1)
    write_jsonl(run.round_dir(2) / "admitted.jsonl", [
        {"item_id": f"r2-s6-{i}", "question": f"Q{i}?", "adopted_label": "x", "draft_label": "x", "source_id": a.id,
         "source_ids": [a.id, b.id] if i == 0 else [a.id], "fold": 0, "hops": 2 if i == 0 else 1} for i in range(7)])
    out = run.main(2)
    [job] = fake.jobs
    assert len(job["rows"]) == 7 and job["steps"] == 3 and job["per_step"] == 4  # ceil(7 / 3) = 3 -> 4
    assert (job["reward"]["round"], job["reward"]["step_base"], job["reward"]["first_step_in_round"]) == (2, 5, 3)
    assert out["trained_on"] == {"role": "main", "folds": [0, 1], "rounds": [2]}


def test_a_main_phase_with_nothing_admitted_records_its_empty_solver_steps_as_the_loop(tmp_path):
    """Nothing admitted: no training, and the round's solver steps are recorded empty, numbered after the
    proposer steps at the run's global step (mutant: numbered one early)."""
    import copy

    from selfevo._io import write_jsonl
    from selfevo.integrations import engine as eng

    run = eng.EngineRun(eng.engine_config_from_dict(copy.deepcopy(ENGINE_CFG), engine="trl"), tmp_path / "run",
                        log=lambda m: None)
    write_jsonl(run.round_dir(2) / "admitted.jsonl", [])
    assert run.main(2) == {"trained": False}
    steps = [json.loads(line) for line in (tmp_path / "run" / "records" / "steps.jsonl").read_text().splitlines()]
    assert [(s["round"], s["step"], s["step_in_round"], s["kind"], s["items"]) for s in steps] == [
        (2, 8, 3, "solver", []), (2, 9, 4, "solver", []), (2, 10, 5, "solver", [])]


def test_a_verl_proposer_phase_starts_over_without_what_a_killed_attempt_staged(tmp_path, monkeypatch):
    """verl's rewards stage items without their step, so a verl phase cannot go on from a checkpoint:
    what a killed attempt staged is discarded before the phase runs again (mutant: kept, and admitted
    with the new attempt's proposals)."""
    from selfevo._io import append_jsonl
    from selfevo.integrations import engine as eng

    verl_phase_stand_ins(monkeypatch)
    cfg = {**ENGINE_CFG, "engine": {**ENGINE_CFG["engine"], "retriever_url": "http://127.0.0.1:9/retrieve"},
           "lm": {"adapter": "full"}}
    run = eng.EngineRun(eng.engine_config_from_dict(cfg, engine="verl"), tmp_path / "run", log=lambda m: None)
    items = run.round_dir(1) / "proposer-items.jsonl"
    append_jsonl(items, [{"round": 1, "step_in_round": None, "item": {"item_id": "r1-v-killed"}}])
    with pytest.raises(eng.EngineUnavailable):
        run.proposer(1)
    assert read_staged(items) == []


def test_an_engine_run_that_ran_every_phase_is_complete(tmp_path, monkeypatch):
    """run_all marks the run complete after its last phase (mutant: never), as `evolve` does; a resume
    of a complete run runs no phase."""
    run, _ = _fake_engine_run(monkeypatch, tmp_path / "run")
    run.run_all()
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["status"] == "complete"
    again, fake = _fake_engine_run(monkeypatch, tmp_path / "run", resume=True)
    again.run_all()
    assert fake.jobs == [] and json.loads((tmp_path / "run" / "manifest.json").read_text())["status"] == "complete"


def test_an_engine_run_is_not_started_among_a_directorys_other_files(tmp_path):
    """--out naming a directory of other files (a user's config.json, a world) is refused before anything
    is written, as `evolve` refuses it (mutant: RunDir.check_new dropped)."""
    import copy

    from selfevo.integrations import engine as eng
    from selfevo.runs import RunError

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(RunError, match="notes.txt"):
        eng.EngineRun(eng.engine_config_from_dict(copy.deepcopy(ENGINE_CFG), engine="trl"), out, log=lambda m: None)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_compute_json_counts_every_logged_phase_when_a_later_phase_is_killed(tmp_path, monkeypatch):
    """Each phase rewrites compute.json once it is logged: a run killed in r1/admit has compute.json with
    r1/proposer's updates and generations (mutant: written before the phase was logged, so each phase's
    numbers arrive only with the next one)."""
    run, _ = _fake_engine_run(monkeypatch, tmp_path / "run")

    def killed():
        raise KeyboardInterrupt("killed")
    monkeypatch.setattr(run, "admit", lambda r: killed())
    with pytest.raises(KeyboardInterrupt):
        run.run_all()
    compute = json.loads((tmp_path / "run" / "compute.json").read_text())
    assert compute == run.phases.compute() and compute["updates"] == {"proposer": 2}


def test_a_verl_phase_counts_its_rollouts_and_checkpoints_under_its_own_round(tmp_path, monkeypatch):
    """A verl training phase run to its end reports steps × prompts × group size completions for
    compute.json (mutant: without the group size), and its script checkpoints where `_drop_checkpoints`
    removes them once the phase is logged: engine/round-r/<role>.verl-ckpt (mutant: the round before's)."""
    from selfevo.integrations import engine as eng

    verl_phase_stand_ins(monkeypatch)
    monkeypatch.setattr(eng, "verl_missing", lambda: "")
    ran = []
    monkeypatch.setattr(eng._proc, "run", lambda cmd, env=None: ran.append(cmd))
    cfg = {**ENGINE_CFG, "engine": {**ENGINE_CFG["engine"], "retriever_url": "http://127.0.0.1:9/retrieve"},
           "lm": {"adapter": "full"}}
    run = eng.EngineRun(eng.engine_config_from_dict(cfg, engine="verl"), tmp_path / "run", log=lambda m: None)
    rows = solver_rows([{"item_id": f"r2-s6-{i}", "question": f"Q{i}?", "adopted_label": "x", "draft_label": "x",
                         "source_id": d.id, "source_ids": [d.id], "fold": run.folds.of(d.id), "hops": 1}
                        for i, d in enumerate(run.pool[:4])], run.folds, 2)
    assert run.train("r2/main", "solver", "main", 2, rows, 2, 3, 5, {"records_path": None, "round": 2}) == \
        {"steps": 2, "completions": 2 * 3 * 5}
    [cmd] = ran
    script = Path(cmd[-1]).read_text()
    assert str(run._verl_ckpt_dir("main", 2)) in script and str(run._verl_ckpt_dir("main", 1)) not in script


@pytest.mark.parametrize("engine_table", [
    {"graders": "vllm"},  # in-process TRL trains here
    {"launcher": "accelerate launch", "retriever_url": "http://127.0.0.1:9/retrieve"},  # the local graders serve here
])
def test_a_device_this_machine_lacks_is_refused_at_start_when_either_part_runs_here(engine_table, tmp_path,
                                                                                   monkeypatch):
    """lm.device is resolved before anything is written when the graders are served in this process or
    TRL trains in it (mutant: only when both)."""
    import copy

    import torch

    from selfevo.config import ConfigError
    from selfevo.integrations import engine as eng

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = copy.deepcopy(ENGINE_CFG)
    cfg["lm"] = {"device": "cuda:0"}
    cfg["engine"] = {**cfg["engine"], **engine_table}
    with pytest.raises(ConfigError, match="lm.device: cuda:0 asked for, but no CUDA GPU"):
        eng.EngineRun(eng.engine_config_from_dict(cfg, engine="trl"), tmp_path / "run", log=lambda m: None)
    assert not (tmp_path / "run").exists()


def test_a_role_less_message_is_read_as_the_assistants_turn():
    """final_turn over chat messages: a message without a role is the policy's own (TRL's completions carry
    none for a plain generation), so its answer is read (mutant: only role == "assistant" counted)."""
    from selfevo.integrations.rewards import final_turn

    assert final_turn([{"content": "<answer> the sea </answer>"}]) == "<answer> the sea </answer>"
    assert extract_answer([{"role": "user", "content": "Q"}, {"content": "<answer> sea </answer>"}]) == "sea"


def test_item_ids_name_the_process_whenever_there_are_several(tmp_path, monkeypatch):
    """A TRL step of several processes: each process's item ids carry its rank, from 2 processes on (ids are
    unique in a run, and two processes' first items of a step would otherwise share one; mutant: only
    above 2); one process keeps the loop's ids."""
    reward = _reward_with({}, tmp_path, step_base=4)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    reward.score([ProposalSample("no proposal here", "d0", 1)], step=2)
    monkeypatch.setenv("WORLD_SIZE", "1")
    reward.score([ProposalSample("no proposal here", "d0", 1)], step=2)
    assert [r["malformed"]["item_id"] for r in read_staged(tmp_path / "items.jsonl")] == ["r2-s6-p1-0", "r2-s6-0"]


def test_a_solver_step_records_its_reward_as_the_mean_over_every_response(tmp_path):
    """The solver step record's stats.reward is the fraction of the step's responses that match, as the
    loop's: a process's share of a batch can cut a prompt's group, here items of 3 and 1 responses, 2 of 4
    matching = 0.5, not the mean of the items' k/n, (1/3 + 1) / 2 (mutant: averaged over items)."""
    rf = TRLSolverReward(tmp_path / "steps.jsonl", round=1, step_base=0, first_step_in_round=3)
    cols = {"item_id": ["a", "a", "a", "b"], "source_id": ["d1"] * 4, "source_ids": [["d1"]] * 4, "fold": [1] * 4,
            "source_folds": [[1]] * 4, "hops": [1] * 4, "draft_label": ["sea"] * 3 + ["river"]}
    rf([solver_messages("Where?")] * 4, ["<answer> sea </answer>", "<answer> land </answer>",
                                         "<answer> hill </answer>", "<answer> river </answer>"],
       label=["sea", "sea", "sea", "river"], **cols)
    (record,) = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [(it["k"], len(it["responses"])) for it in record["items"]] == [(1, 3), (1, 1)]
    assert record["stats"]["reward"] == 0.5


def test_a_trl_step_is_graded_with_the_seed_of_its_step_and_grader_name(tmp_path):
    """A TRL step's proposals are graded in one call seeded by (seed, round, step, "grade", grader name)
    (mutants: seeded without the step; by the role instead of the served grader's name)."""
    seeds = []

    class Recording(_FakeGrader):
        def answer(self, questions, tool, *, greedy=True, n=1, seed=None, contexts=None):
            seeds.append(seed)
            return super().answer(questions, tool, greedy=greedy, n=n, seed=seed, contexts=contexts)

    fakes = {"aux-0": Recording(lambda q, n: ["x"] * n), "aux-1": Recording(lambda q, n: ["x"] * n)}
    reward = _reward_with(fakes, tmp_path, seed=7)
    text = "<question> Where is Alpha? </question> <answer> north </answer>"
    for step in (1, 2):
        reward.score([ProposalSample(text, "d1", 1)], step=step)
    [role] = [role for role, fake in fakes.items() if fake.calls]
    name = reward.graders[role].name
    assert name == f"{role}@r1" and seeds == [derive_seed(7, 2, step, "grade", name) for step in (1, 2)]


def test_a_verl_reward_worker_grades_with_the_remote_options_its_settings_hold(tmp_path):
    """reward_settings carries the graders' sampling options (temperature, top_p, concurrency, limits) to
    verl's reward workers; the FrontierReward they build uses them (mutant: dropped)."""
    from selfevo.integrations.rewards import _frontier_from_settings

    remote = {"max_tokens": 64, "max_actions": 3, "concurrency": 2, "temperature": 0.7, "top_p": 0.9}
    path = reward_settings(tmp_path / "s.json", treatment="coupled", round=1, folds=FOLDS,
                           graders=_graders({"main": ("http://127.0.0.1:9/v1", ())}), items_path=tmp_path / "i.jsonl",
                           retriever_url="http://127.0.0.1:9", remote=remote)
    assert _frontier_from_settings(str(path)).remote == remote


def test_a_verl_reward_worker_reads_its_settings_again_once_they_are_rewritten(tmp_path):
    """Each phase rewrites reward-settings.json (the next round, its graders); a worker that read it before
    builds its FrontierReward again from the new file (mutant: the first one cached for good)."""
    import os

    graders = _graders({"main": ("http://127.0.0.1:9/v1", ())})
    kw = dict(treatment="coupled", folds=FOLDS, graders=graders, items_path=tmp_path / "i.jsonl",
              retriever_url="http://127.0.0.1:9")
    path = reward_settings(tmp_path / "s.json", round=1, format_penalty=0.25, **kw)
    bad = ("selfevo_proposer", "no proposal", {"target": []}, {"source_id": "d0", "hops": 1})
    assert compute_score(*bad, selfevo_settings=str(path)) == -0.25
    reward_settings(path, round=2, format_penalty=0.75, **kw)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a later write, whatever the clock's grain
    assert compute_score(*bad, selfevo_settings=str(path)) == -0.75


# ---------------------------------------------------------------- model_identity


def test_a_model_directory_rewritten_in_place_with_files_of_the_same_size_is_another_model(tmp_path):
    """A retrained model rewrites its weights at the same size: the modification time tells the two apart (the
    names and sizes alone do not); the same files with the same times are the same model."""
    model = tmp_path / "m"
    (model / "sub").mkdir(parents=True)
    weights = model / "sub" / "model.safetensors"
    weights.write_bytes(b"aaaa")
    st = weights.stat()
    first = model_identity(str(model))
    weights.write_bytes(b"bbbb")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert model_identity(str(model)) != first
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_identity(str(model)) == first


def test_a_hub_id_the_cache_knows_to_have_no_config_is_keyed_by_its_name(tmp_path, monkeypatch):
    """huggingface_hub remembers a file a repository lacks (.no_exist) and answers a sentinel object, not a
    path, for it: the id is then keyed by its name, not a TypeError."""
    import huggingface_hub.constants


    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--gone"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("c" * 40)
    (repo / ".no_exist" / ("c" * 40)).mkdir(parents=True)
    (repo / ".no_exist" / ("c" * 40) / "config.json").write_text("")
    assert model_identity("org/gone") == "org/gone"


# ---------------------------------------------------------------- verl's launch and search tool, the TRL job


def test_verl_overrides_carry_every_phase_setting_and_eq1(tmp_path):
    """Each VerlPhase field reaches its own override (mutants: model path from `out`, lr / lengths / sampling /
    GPUs replaced by the defaults, temperature and top_p crossed), Eq. (1)'s settings are as the docstring says,
    the merge writes the phase's `out`, and verl's checkpoint is saved at the step the merge reads."""

    p = VerlPhase(name="r3-main", model="/models/main", train_files="/t.parquet", out="/o", ckpt_dir="/c", steps=7,
                  prompts_per_step=12, n=3, lr=3e-6, tool_config="/t.yaml", agent_loop_config="/a.yaml",
                  reward_file="/r.py", max_prompt_length=700, max_response_length=900, temperature=0.7, top_p=0.9,
                  gpus=6)
    o = dict(x.split("=", 1) for x in phase_overrides(p))
    want = {"actor_rollout_ref.model.path": "/models/main", "actor_rollout_ref.actor.optim.lr": "3e-06",
            "data.train_files": "/t.parquet", "data.val_files": "/t.parquet", "data.max_prompt_length": "700",
            "data.max_response_length": "900", "data.return_raw_chat": "True",
            "actor_rollout_ref.rollout.temperature": "0.7", "actor_rollout_ref.rollout.top_p": "0.9",
            "trainer.n_gpus_per_node": "6", "trainer.save_freq": "7", "trainer.experiment_name": "r3-main",
            "actor_rollout_ref.actor.ppo_mini_batch_size": "12", "actor_rollout_ref.actor.ppo_epochs": "1",
            "algorithm.use_kl_in_reward": "False", "actor_rollout_ref.actor.use_kl_loss": "False",
            "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean",
            "actor_rollout_ref.rollout.multi_turn.enable": "True",
            "actor_rollout_ref.rollout.agent.agent_loop_config_path": "/a.yaml",
            "actor_rollout_ref.rollout.agent.default_agent_loop": "search_r1_agent",
            "reward.custom_reward_function.path": "/r.py", "reward.custom_reward_function.name": "compute_score"}
    assert {k: o.get(k) for k in want} == want
    cmd = merge_command(p)
    assert cmd[cmd.index("--local_dir") + 1] == "/c/global_step_7/actor" and cmd[cmd.index("--target_dir") + 1] == "/o"


def test_verl_extra_overrides_replace_the_engines_free_ones_once(tmp_path):
    """An [engine.verl] key the engine also sets (the free ones: logger, nodes, rollout engine) replaces the
    engine's value and is passed once (mutant: the engine's own overrides applied after `extra`, the user's
    setting silently dropped); a bool and a list are written as Hydra reads them."""

    extra = {"trainer.logger": ["console", "wandb"], "trainer.nnodes": 2, "actor_rollout_ref.rollout.name": "sglang",
             "actor_rollout_ref.model.enable_gradient_checkpointing": False}
    out = phase_overrides(replace(_phase(tmp_path), extra=extra))
    keys = [x.split("=", 1)[0] for x in out]
    assert len(keys) == len(set(keys))
    o = dict(x.split("=", 1) for x in out)
    assert o["trainer.logger"] == "[console,wandb]" and o["trainer.nnodes"] == "2"
    assert o["actor_rollout_ref.rollout.name"] == "sglang"
    assert o["actor_rollout_ref.model.enable_gradient_checkpointing"] == "False"


def test_verl_phase_script_exports_its_environment_quoted_and_is_executable(tmp_path):
    """engine.train_gpus reaches the script as an export before the training command, shell-quoted (mutants:
    the exports dropped; unquoted), and the script is executable (mutant: chmod dropped)."""

    path = phase_script(_phase(tmp_path), tmp_path / "job.sh", {"CUDA_VISIBLE_DEVICES": "2,3", "X": "a b;c"})
    lines = path.read_text().replace("\\\n", "").splitlines()
    train = next(i for i, line in enumerate(lines) if "verl.trainer.main_ppo" in line)
    assert lines.index("export CUDA_VISIBLE_DEVICES=2,3") < train
    assert lines.index(f"export X={shlex.quote('a b;c')}") < train
    assert path.stat().st_mode & stat.S_IXUSR


def test_the_verl_reward_shim_re_exports_selfevos_reward(tmp_path):
    """verl loads `reward.custom_reward_function.path` as a file: it must define compute_score (mutant: empty)."""

    ns = runpy.run_path(str(write_reward_shim(tmp_path / "verl_reward.py")))
    assert ns["compute_score"] is compute_score and ns["compute_score_batch"] is compute_score_batch


def test_pinned_verl_reaches_plus_prefixed_parent_and_child_keys():
    """An [engine.verl] key is refused when it replaces one of the engine's overrides: written with Hydra's "+"
    (mutant: not stripped), as a parent that would replace a whole subtree, or below one; the reward settings
    key too (mutant: left out of the pinned set). The free keys and unrelated ones pass."""

    for key in ("actor_rollout_ref.rollout.n", "+actor_rollout_ref.rollout.n", "++trainer.save_freq",
                "actor_rollout_ref.rollout.multi_turn", "reward.custom_reward_function",
                "trainer.default_local_dir.sub", SETTINGS_KEY, "+" + SETTINGS_KEY):
        assert pinned_verl(key), key
    for key in (*FREE_VERL, "actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.rollout.nx",
                "trainer.save_freq_extra"):
        assert not pinned_verl(key), key


def test_the_verl_search_response_formats_the_hits_and_returns_their_ids():
    """The tool's observation: the top `topk` passages as <information> (title, then text), and the ids of the
    pages read (mutants: topk ignored; title and text crossed; titles in place of ids). tool_config passes
    each setting it is given (mutant: topk written as its default)."""

    index = BM25Index.build(DOCS)
    text, ids = search_response(index, "Alpha", topk=1)
    (hit,) = index.retrieve(["Alpha"], topk=1)[0]
    assert ids == [hit.document.id] and text == format_information([(hit.document.title, hit.document.text)])
    text, ids = search_response(index, "Alpha", topk=2)
    assert sorted(ids) == ["d0", "d2"] and "(Title: Alpha)" in text and "(Title: Gamma)" in text
    assert search_response(index, "zzz", topk=2)[1] == []
    cfg = tool_config("http://h:1/retrieve", topk=4, max_calls=2, timeout=5.0)["tools"][0]["config"]
    assert (cfg["topk"], cfg["max_calls"], cfg["timeout"], cfg["retrieval_service_url"]) == (4, 2, 5.0,
                                                                                             "http://h:1/retrieve")


def _grpo_job(tmp_path, **kw):
    return {"generations": 2, "prompts_per_step": 4, "out": str(tmp_path / "m" / "round-1"), "steps": 7, "lr": 3e-5,
            "max_grad_norm": 0.3, "seed": 2**31 + 5, "rollout": {"max_new_tokens": 64, "temperature": 0.6,
                                                                 "top_p": 0.7}, **kw}


def test_trl_grpo_args_carry_the_job_settings(tmp_path):
    """Every job field reaches GRPOConfig (mutants: lr, grad norm, seed, completion length, temperature, top_p,
    save_steps replaced by a default; the batch not split over the processes; Eq. (1)'s beta / loss type /
    lineage columns changed; use_cpu forced); checkpoints go to trainer_dir, one kept."""
    pytest.importorskip("trl")

    a = grpo_args(_grpo_job(tmp_path, save_steps=3), world_size=2)
    assert (a.per_device_train_batch_size, a.num_generations, a.max_steps) == (4, 2, 7)
    assert (a.learning_rate, a.max_grad_norm, a.seed) == (3e-5, 0.3, 5)
    assert (a.max_completion_length, a.temperature, a.top_p) == (64, 0.6, 0.7)
    assert (a.beta, a.loss_type, a.num_iterations, a.remove_unused_columns) == (0.0, "grpo", 1, False)
    assert (a.save_strategy, a.save_steps, a.save_total_limit) == ("steps", 3, 1)
    assert a.output_dir == str(trainer_dir(tmp_path / "m" / "round-1")) and a.use_cpu is True
    b = grpo_args(_grpo_job(tmp_path, device="cuda"))
    assert b.save_strategy == "no" and b.use_cpu is False and b.per_device_train_batch_size == 8
    with pytest.raises(ValueError, match="trl job: 8 completions a step do not split over 3 processes"):
        grpo_args(_grpo_job(tmp_path), world_size=3)


def test_trl_grpo_args_under_vllm_stop_at_each_action_and_keep_the_users_kwargs(tmp_path):
    """use_vllm: colocated unless said otherwise (mutant: "server"), generation stops at each action's end
    (mutant: not set), and the user's generation_kwargs are kept and win (mutant: dropped)."""
    pytest.importorskip("trl")

    a = grpo_args(_grpo_job(tmp_path, grpo={"use_vllm": True}))
    assert a.vllm_mode == "colocate"
    assert a.generation_kwargs == {"stop": ["</search>", "</answer>"], "include_stop_str_in_output": True}
    b = grpo_args(_grpo_job(tmp_path, grpo={"use_vllm": True, "vllm_mode": "server",
                                            "generation_kwargs": {"stop": ["</x>"], "repetition_penalty": 1.1}}))
    assert b.vllm_mode == "server"
    assert b.generation_kwargs == {"stop": ["</x>"], "include_stop_str_in_output": True, "repetition_penalty": 1.1}


def test_a_trl_job_searches_with_the_callers_tool_or_its_servers_settings():
    """In process the caller's tool is used as it is, with or without a server (mutant: only with one);
    launched, the job's topk and max_calls reach the tool (mutant: the defaults); no server, no tool: refused."""

    mine = SearchTool(BM25Index.build(DOCS))
    assert job_tool({"search": {}}, mine) is mine
    t = job_tool({"search": {"retriever_url": "http://127.0.0.1:9/retrieve", "topk": 4, "max_calls": 2}})
    assert (t.topk, t.max_calls) == (4, 2)
    with pytest.raises(ValueError, match=r"search\.retriever_url"):
        job_tool({"search": {"retriever_url": ""}})


def _checkpoint(out, step, state="whole"):

    d = trainer_dir(out) / f"checkpoint-{step}"
    d.mkdir(parents=True)
    if state == "whole":
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    elif state is not None:
        (d / "trainer_state.json").write_text(state)
    return d


def test_trl_last_checkpoint_is_the_newest_whole_one(tmp_path):
    """The newest checkpoint whose trainer_state.json parses and holds a step (mutants: torn ones taken; a
    parsed state without global_step raising; the newest not preferred; names only starting "checkpoint-")."""

    out = tmp_path / "models" / "main" / "round-1"
    assert last_checkpoint(out) == (None, 0)
    for step in (1, 2, 3, 4, 6, 8, 9):
        _checkpoint(out, step)
    want = _checkpoint(out, 10)
    for step, state in [(11, "{}"), (12, None), (13, "[1]"), (14, '{"global_step": 14')]:
        _checkpoint(out, step, state)
    (trainer_dir(out) / "checkpoint-20-tmp").mkdir()
    (trainer_dir(out) / "checkpoint-20-tmp" / "trainer_state.json").write_text('{"global_step": 20}')
    assert last_checkpoint(out) == (want, 10)


def test_trl_resume_goes_on_from_the_checkpoint_or_starts_over(tmp_path):
    """With save_steps: from the newest whole checkpoint, its step the start step, what was staged for the steps
    before it kept (mutants: resume_from / start_step dropped; everything staged dropped). Without: from step 1,
    the stale checkpoints removed and nothing staged kept (mutants: the checkpoint still used; not removed)."""

    out, items = tmp_path / "models" / "proposer" / "round-1", tmp_path / "items.jsonl"
    ckpt = _checkpoint(out, 2)
    write_jsonl(items, [{"round": 1, "step_in_round": s, "item": {"item_id": f"i{s}"}} for s in (1, 2, 3)])
    job = {"out": str(out), "save_steps": 2, "reward": {"items_path": str(items)}}
    assert trl_job.resume(job) == {**job, "resume_from": str(ckpt), "start_step": 2}
    assert [json.loads(line)["step_in_round"] for line in items.read_text().splitlines()] == [1, 2]
    again = trl_job.resume({**job, "save_steps": 0})
    assert (again["resume_from"], again["start_step"]) == (None, 0)
    assert not trainer_dir(out).exists() and not items.exists()


def test_a_resumed_trl_job_checkpoints_as_the_job_says():
    """HF restores save_steps from the checkpoint's state; the job's callback puts the job's back (mutant: not)."""
    pytest.importorskip("trl")

    state = SimpleNamespace(save_steps=5)
    _save_as_the_job_says().on_train_begin(SimpleNamespace(save_steps=2), state, None)
    assert state.save_steps == 2


def test_the_trl_job_command_line_and_its_result_file(tmp_path, monkeypatch):
    """One JOB.json argument, else usage and exit 2 (mutant: two accepted); the result is written beside the job
    by rank 0 only (mutant: by every process, racing on one file)."""

    assert trl_job.main([]) == 2 and trl_job.main(["a.json", "b.json"]) == 2
    (tmp_path / "job.json").write_text(json.dumps({"steps": 1}))
    monkeypatch.setattr(trl_job, "run_job", lambda job, tool=None: {"steps": job["steps"], "completions": 4})
    monkeypatch.setenv("RANK", "1")
    assert trl_job.main([str(tmp_path / "job.json")]) == 0 and not (tmp_path / "job.result.json").exists()
    monkeypatch.setenv("RANK", "0")
    assert trl_job.main([str(tmp_path / "job.json")]) == 0
    assert json.loads((tmp_path / "job.result.json").read_text()) == {"steps": 1, "completions": 4}


def test_the_trl_job_saves_its_model_in_place_of_the_old_one(tmp_path):
    """_save writes the model and tokenizer to a temporary directory and renames it over `out`: the old model's
    files go and nothing is left beside it (mutant: copied, the temporary directory left)."""

    out = tmp_path / "models" / "main" / "round-1"
    out.mkdir(parents=True)
    (out / "stale.bin").write_text("old")
    (out.parent / ".round-1.tmp").mkdir()  # a killed save's
    (out.parent / ".round-1.tmp" / "torn.bin").write_text("x")

    def save_to(name):
        return lambda path: (Path(path).mkdir(parents=True, exist_ok=True), (Path(path) / name).write_text(name))
    acc = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None)
    trainer = SimpleNamespace(accelerator=acc, save_model=save_to("model.safetensors"),
                              processing_class=SimpleNamespace(save_pretrained=save_to("tokenizer.json")))
    _save(trainer, {"out": str(out)})
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "tokenizer.json"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["round-1"]


def test_unstepped_items_cut_into_fewer_runs_than_steps_write_no_empty_step_record():
    """verl items carry no step: 5 of them over 4 proposer steps are cut into runs of ceil(5/4) = 2, and
    the step left with nothing gets no record (not one with no items and reward 0). Mutant: the empty
    run kept (admit.py:90, `if c`)."""
    unstepped = [{**r, "step_in_round": None} for r in _staged(2, 3) if "item" in r][:5]
    records, admitted = admit_round(unstepped, round=1, step_base=0, proposer_steps=4, budget=99, seed=0)
    assert [(r["step"], len(r["items"])) for r in records] == [(1, 2), (2, 2), (3, 1)]
    assert len(admitted) == 5


def test_merged_step_records_round_the_reward_keep_a_rewardless_stat_and_leave_their_input_alone():
    """merge_step_records recomputes a step's reward as the mean k over every response, rounded as the
    loop's records are (round6); a record whose stats hold no reward gets none; the records passed in are
    not changed (each process's own log stays its share). Mutants: the reward unrounded (admit.py:163);
    a reward added to any stats (admit.py:162); the first share's record merged in place (admit.py:156)."""
    def rec(step, ids, k, stats):
        return {"round": 1, "step": step, "kind": "solver", "stats": dict(stats),
                "items": [{"item_id": i, "k": k, "responses": ["a"] * 3} for i in ids]}
    shares = [rec(7, ["a"], 1, {"reward": 0.0}), rec(7, ["b"], 0, {"reward": 0.0}), rec(8, ["c"], 2, {"n": 1})]
    before = json.loads(json.dumps(shares))
    merged = merge_step_records(shares)
    assert merged[0]["stats"]["reward"] == 0.166667  # 1 of 6 responses, to six places
    assert merged[1]["stats"] == {"n": 1}
    assert shares == before and [it["item_id"] for it in merged[0]["items"]] == ["a", "b"]


def test_read_staged_cuts_a_torn_tail_so_later_appends_read_back(tmp_path):
    """A kill mid-write leaves a torn last staged row: read_staged drops it and cuts it from the file, so
    the rows a resumed phase appends read back whole. Mutant: read without repair (admit.py:34): the next
    row is glued onto the torn one and the file no longer reads."""
    path = tmp_path / "items.jsonl"
    path.write_text(json.dumps({"step_in_round": 1, "item": {"item_id": "a"}}) + '\n{"step_in_round": 2, "it')
    assert [r["item"]["item_id"] for r in read_staged(path)] == ["a"]
    append_jsonl(path, [{"step_in_round": 2, "item": {"item_id": "b"}}])
    assert [r["item"]["item_id"] for r in read_staged(path)] == ["a", "b"]


def test_a_missing_grader_names_the_served_ones_sorted_or_none():
    """The routing error lists the graders that are served, sorted, or says none. Mutant: the names in
    the order given and nothing for none (routing.py:107)."""
    main = Grader("main", "http://127.0.0.1:9/v1", "m")
    aux0 = Grader("aux-0", "http://127.0.0.1:9/v1", "m", folds=(0,))
    with pytest.raises(RoutingError, match=re.escape("to 'aux-1', but no such grader is served (have: aux-0, main)")):
        route("crossfit", 2, 0, {0}, {"main": main, "aux-0": aux0})
    with pytest.raises(RoutingError, match=re.escape("(have: none)")):
        route("crossfit", 2, 0, {0}, {})


def test_aux_roles_are_one_per_fold_of_the_treatment_or_one_on_everything():
    """The auxiliary solvers the engine serves and trains: K of them (crossfit-k3: 3), aux-all for the
    full-data control, none for coupled. Mutant: K = 2 whatever the treatment (routing.py:74)."""
    assert aux_roles("crossfit-k3") == ["aux-0", "aux-1", "aux-2"]
    assert aux_roles("crossfit") == ["aux-0", "aux-1"]
    assert aux_roles("full-data") == ["aux-all"] and aux_roles("coupled") == []


def test_a_grader_lineage_round_trips_and_is_recorded_sorted():
    """A grader's JSON (the engine's servers file) reads back as the same grader, its name included; its
    record lineage sorts folds and rounds as `loop.feedback.lineage_of` writes them, under its name (else
    its role). Mutants: folds and rounds swapped when read (routing.py:51); the name not written
    (routing.py:45); folds unsorted (routing.py:41); the id always the role (routing.py:41)."""
    g = Grader("aux-1", "http://127.0.0.1:9/v1", "m", "aux-1@r2", (1, 0), (2, 1))
    assert Grader.from_json(json.loads(json.dumps(g.to_json()))) == g
    assert g.lineage() == {"id": "aux-1@r2", "trained_on": {"folds": [0, 1], "rounds": [1, 2]}}
    assert Grader("main", "u", "m").lineage() == {"id": "main", "trained_on": {"folds": [], "rounds": []}}


def test_a_routes_touched_folds_are_recorded_sorted():
    """The route records the folds a question touched in order (the item record's `routing.touched`), also
    where a set does not iterate sorted ({1, 8} under K = 9). Mutant: the set's own order (routing.py:114)."""
    graders = _graders({f"aux-{j}": ("http://127.0.0.1:9/v1", (j,)) for j in range(9)})
    routed = route("crossfit-connected-k9", 2, 1, {8, 1}, graders)  # CPython iterates it 8, 1
    assert routed.touched == (1, 8) and not routed.fallback and routed.grader.folds not in {(1,), (8,)}


def test_the_trl_rollout_renders_with_the_jobs_chat_template_kwargs(monkeypatch, tool):
    """GRPOConfig.chat_template_kwargs (enable_thinking=False, say) shape the text each action is generated
    from and trained on, as TRL's own generation passes them; none given, the template's defaults. Mutant:
    the kwargs dropped (trl_env.py:73)."""
    got = []
    _rollout_without_a_model(monkeypatch, template_of=lambda tok, **kw: got.append(kw))
    trl_env.SearchRollout(tool)([], _trl_trainer(chat_template_kwargs={"enable_thinking": False}))
    trl_env.SearchRollout(tool)([], _trl_trainer(chat_template_kwargs=None))
    trl_env.SearchRollout(tool)([], _trl_trainer())
    assert got == [{"enable_thinking": False}, {}, {}]


def test_a_trl_rollouts_calls_are_seeded_apart():
    """Two generations of one process at one step (a trainer may call rollout_func more than once a step)
    sample with different seeds. Mutant: the call counter never advanced (trl_env.py:70)."""
    seeds = []
    ro = trl_env.SearchRollout(SearchTool(BM25Index.build(DOCS), topk=1, max_calls=1), seed=3)
    ro.rollouts = lambda starts, gen, seed: seeds.append(seed) or []
    ro._generator = lambda trainer, tok, render: None
    ro.encode = lambda tok, prompts, rollouts, render=None: {}
    trainer = _trl_trainer(step=5, tok=SimpleNamespace(apply_chat_template=None))
    ro([], trainer)
    ro([], trainer)
    assert ro.calls == 2 and len(set(seeds)) == 2


def test_proposer_rows_offer_search_as_the_job_says_and_refuse_an_empty_pool():
    """lm.proposer_search = false: the proposer's prompt row does not offer the search tool (as the loop's
    proposer's prompt), and an empty source pool is an error, not an empty training set. Mutants: the tool
    offered whatever `search` says (datasets.py:60); an empty pool gives no rows (datasets.py:54)."""
    on, off = proposer_rows(DOCS, FOLDS, 1, 3, seed=0), proposer_rows(DOCS, FOLDS, 1, 3, seed=0, search=False)
    assert [r["source_id"] for r in on] == [r["source_id"] for r in off]
    for a, b in zip(on, off, strict=True):
        text = next(d.contents for d in DOCS if d.id == b["source_id"])
        assert b["prompt"] == proposer_messages(text, b["hops"], False) != a["prompt"]
    with pytest.raises(ValueError, match="the source pool is empty"):
        proposer_rows([], FOLDS, 1, 3, seed=0)


def test_solver_rows_without_pages_read_carry_the_source_and_the_draft_label():
    """An item with no `source_ids` (or an empty list) read its source page alone: the row's lineage is
    that page; its draft label is kept beside the adopted one. Mutants: the lineage left empty
    (datasets.py:69); the draft label dropped (datasets.py:70)."""
    items = [{k: v for k, v in _admitted()[1].items() if k != "source_ids"}, {**_admitted()[3], "source_ids": []}]
    rows = solver_rows(items, FOLDS, 1)
    assert [(r["source_ids"], r["source_folds"]) for r in rows] == [(["d1"], [1]), (["d3"], [1])]
    assert [(r["label"], r["draft_label"]) for r in rows] == [("a1", "d1"), ("a3", "d3")]


def test_empty_training_sets_are_refused_by_both_writers(tmp_path):
    """An empty training set cannot train: to_trl and write_verl refuse it (write_verl naming the file)
    rather than hand an engine nothing. Mutants: either check dropped (datasets.py:122, :169)."""
    pytest.importorskip("datasets")
    with pytest.raises(ValueError, match="to_trl: no rows"):
        to_trl([])
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'e.parquet'}: no rows")):
        write_verl([], tmp_path / "e.parquet")
    assert not (tmp_path / "e.parquet").exists()


def test_verl_rows_name_their_split_and_ability_and_a_proposer_row_no_question(tmp_path):
    """write_verl's `split` reaches every row's extra_info; a solver row is search-qa with its question, a
    proposer row question-writing with no question and no target. Mutants: split always "train"
    (datasets.py:170); one ability for both roles (datasets.py:151); the question for both (datasets.py:148)."""
    rows = solver_rows(_admitted()[:1], FOLDS, 1) + proposer_rows(DOCS, FOLDS, 1, 1, seed=0)
    back = read_verl(write_verl(rows, tmp_path / "val.parquet", split="validation"))
    assert [r["extra_info"]["split"] for r in back] == ["validation", "validation"]
    assert [(r["ability"], r["extra_info"]["question"]) for r in back] == [("search-qa", "Q0?"),
                                                                          ("question-writing", "")]
    assert back[1]["reward_model"]["ground_truth"]["target"] == []


def test_a_rows_source_folds_are_sorted_whatever_order_the_set_iterates():
    """source_folds (the lineage the aux split and verl's extra_info read) is sorted, also where the set
    of folds does not iterate sorted ({1, 8} under K = 9: CPython gives 8, 1). Mutant: the set's own order
    (datasets.py:42)."""
    folds = FoldAssignment(9, 0, "connected", {"p1": 1, "p8": 8})
    item = {"item_id": "r1-s1-0", "question": "Q?", "adopted_label": "a", "source_id": "p8", "source_ids": ["p8", "p1"],
            "fold": 8, "hops": 2}
    (row,) = solver_rows([item], folds, 1)
    assert row["source_folds"] == [1, 8]


def test_an_agents_private_trace_is_no_part_of_what_it_did():
    """Trajectory and Proposal compare by what the agent did, never by its backend-private trace (a
    rerun's trace is another object); a proposal breaks no format rule unless told, and a trajectory
    made without a count took no action. Mutants: the trace compared (base.py:22, :45); format_error
    "" by default (base.py:48); actions 1 by default (base.py:20)."""
    assert Trajectory("Paris", ["capital"], 2, trace=object()) == Trajectory("Paris", ["capital"], 2, trace=object())
    assert Trajectory("x").actions == 0 and Trajectory("x").searches == []
    p = Proposal("Q?", "a", "d0", ("d0",), 1, trace=object())
    assert p == Proposal("Q?", "a", "d0", ("d0",), 1, trace=object()) and p.format_error is None


def test_write_verl_and_trim_staged_failing_at_the_rename_leave_the_earlier_file_whole(tmp_path, monkeypatch):
    """A rewrite of the verl parquet or of a trimmed staging file that fails at its last step (the rename:
    a full disk, a kill) leaves the file a reader had before, byte for byte, and no temporary file beside it."""
    path = write_verl(solver_rows(_admitted(), FOLDS, 1), tmp_path / "train.parquet")
    staged = tmp_path / "solver-steps.jsonl"
    staged.write_text("".join(json.dumps({"step_in_round": s}) + "\n" for s in (1, 2, 3)))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def no_rename(src, dst):
        raise OSError("no space left on device")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError, match="no space left"):
        write_verl(proposer_rows(DOCS, FOLDS, 1, 2, seed=0), path)
    with pytest.raises(OSError, match="no space left"):
        trim_staged({"records_path": str(staged)}, 1)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    monkeypatch.undo()
    trim_staged({"records_path": str(staged)}, 1)
    assert staged.read_text() == json.dumps({"step_in_round": 1}) + "\n"


def test_a_trl_steps_graded_items_are_staged_under_their_step_so_a_resume_keeps_only_the_steps_done(tmp_path):
    """Each staged row of a TRL step (graded item and malformed proposal alike) carries the step within
    the round it was graded in: admission groups by it and a resumed phase trims by it. Mutant: a graded
    item staged with step_in_round None -> trim_staged refuses the log, admission cuts runs."""
    reward = _reward_with({"main": _FakeGrader(lambda q, n: ["sea"] * 2 + ["x"] * (n - 2))}, tmp_path,
                          treatment="coupled")
    good = "<question> Where is Beta? </question> <answer> sea </answer>"
    for step in (1, 2):
        reward.score([ProposalSample(good, "d1", 1), ProposalSample("<question> no answer", "d0", 1)], step=step)
    staged = read_staged(tmp_path / "items.jsonl")
    assert [(r["step_in_round"], "item" in r) for r in staged] == [(1, False), (1, True), (2, False), (2, True)]
    trim_staged({"items_path": str(tmp_path / "items.jsonl"), "first_step_in_round": 1}, 1)
    kept = read_staged(tmp_path / "items.jsonl")
    assert [r["step_in_round"] for r in kept] == [1, 1] and kept[1]["item"]["item_id"] == "r2-s1-0"


def test_a_solver_step_records_its_items_as_admitted_and_graded_by_the_untrained_main_solver_by_default(tmp_path):
    """The main solver trains only on admitted questions: its step record says so of every item, and a
    reward built without a grader lineage records the main solver with no training (what a job whose settings
    carry no `grader` writes). Mutants: admitted = False; another default grader id
   ."""
    rf = TRLSolverReward(tmp_path / "steps.jsonl", round=1)
    cols = {"item_id": ["a", "a"], "source_id": ["d1"] * 2, "source_ids": [["d1"]] * 2, "fold": [1] * 2,
            "source_folds": [[1]] * 2, "hops": [1] * 2, "draft_label": ["sea"] * 2}
    rf([solver_messages("Where is Beta?")] * 2, ["<answer> sea </answer>", "x"], label=["sea", "sea"], **cols)
    (record,) = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    (item,) = record["items"]
    assert item["admitted"] is True and item["adopted_label"] == "sea" and item["reward"] == 0.5
    assert item["grader"] == {"id": "main", "trained_on": {"folds": [], "rounds": []}}


def test_a_verl_reward_worker_builds_its_reward_with_every_setting_the_phase_wrote(tmp_path):
    """reward_settings -> the worker's FrontierReward: the graders' seed, the sample count, the round and
    step base, the format penalty and the graders' search tool limits are the phase's, none a default (a
    default seed grades every run's proposals with the same samples). Mutants: seed / topk / max_calls left
    at their defaults."""
    from selfevo.integrations.rewards import _frontier_from_settings

    graders = _graders({"aux-0": ("http://127.0.0.1:9/v1", (0,)), "aux-1": ("http://127.0.0.1:9/v1", (1,))})
    path = reward_settings(tmp_path / "s.json", treatment="crossfit", round=3, folds=FOLDS, graders=graders,
                           items_path=tmp_path / "i.jsonl", retriever_url="http://127.0.0.1:9", topk=2, max_calls=4,
                           samples=4, format_penalty=0.25, seed=11, step_base=86)
    fr = _frontier_from_settings(str(path))
    assert (fr.seed, fr.samples, fr.round, fr.step_base, fr.format_penalty) == (11, 4, 3, 86, 0.25)
    assert (fr.treatment.name, fr.graders, fr.items_path) == ("crossfit", graders, tmp_path / "i.jsonl")
    assert (fr.tool.topk, fr.tool.max_calls) == (2, 4) and (fr._tool().topk, fr._tool().max_calls) == (2, 4)


def test_a_verl_item_is_seeded_by_its_source_and_text_alone(tmp_path):
    """verl has no step: each proposal is graded alone, seeded by its content -- its source and its text --
    so it is graded alike in any batch, and the same question written from two sources is graded by
    independent samples. Mutant: the content key without the source."""
    grader = _FakeGrader(lambda q, n: ["x"] * n)
    reward = _reward_with({"main": grader}, tmp_path, treatment="coupled")
    text = "<question> Where is Alpha? </question> <answer> north </answer>"
    reward.score([ProposalSample(text, "d0", 1), ProposalSample(text, "d2", 1)])
    reward.score([ProposalSample(text, "d2", 1)])
    seeds = grader.seeds
    assert len(seeds) == 3 and seeds[0] != seeds[1] and seeds[1] == seeds[2]


def test_verl_batch_refuses_an_unknown_data_source_and_proposer_rows_without_settings(tmp_path):
    """compute_score_batch grades as compute_score does: a row of another data source is named as such (not
    graded as a proposal because its extra_info has a source), and proposer rows without
    reward_kwargs.selfevo_settings are named, not a TypeError from the settings path. Mutants: every
    non-solver row taken for a proposer; the settings check dropped."""
    sol = "<question> Where is Beta? </question> <answer> sea </answer>"
    info = {"source_id": "d1", "hops": 1}
    with pytest.raises(ValueError, match="unknown data_source 'nq'"):
        compute_score_batch(["selfevo_solver", "nq"], ["<answer> sea </answer>", sol], [{"target": ["sea"]}] * 2,
                            [{}, info], selfevo_settings=str(tmp_path / "no.json"))
    with pytest.raises(ValueError, match="compute_score_batch: proposer rows need reward_kwargs.selfevo_settings"):
        compute_score_batch(["selfevo_solver", "selfevo_proposer"], ["<answer> sea </answer>", sol],
                            [{"target": ["sea"]}, {"target": []}], [{}, info])


def test_each_grading_call_searches_with_a_tool_of_its_own_with_the_rewards_limits(tmp_path):
    """verl scores samples concurrently: each grading call gets its own SearchTool (its own call budget and
    result cache) over the reward's retriever with the reward's topk and max_calls. Mutant: every call shares
    the reward's one tool."""
    grader = _FakeGrader(lambda q, n: ["x"] * n)
    reward = _reward_with({"main": grader}, tmp_path, treatment="coupled")
    text = "<question> Where is Alpha? </question> <answer> north </answer>"
    reward.score([ProposalSample(text, "d0", 1), ProposalSample(text, "d2", 1)])
    tools = grader.tools
    assert len(tools) == 2 and len({id(t) for t in [*tools, reward.tool]}) == 3
    assert all((t.retriever, t.topk, t.max_calls) == (reward.tool.retriever, 2, 2) for t in tools)
