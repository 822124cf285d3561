"""The language-model backend on the real SmolLM2-135M-Instruct (offline, CPU): policy-gradient
steps move the right parameters the right way, checkpoints round-trip, and `selfevo evolve
--backend lm` runs CrossFit end to end on the real corpus, resumably, with the sim backend's schema.
Slow: one converted model shared by the session, tiny schedules."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from _shared import CORPUS
from typer.testing import CliRunner

from selfevo.agents.lm.protocol import solver_messages

TINY = Path(__file__).resolve().parents[1] / "configs" / "lm-tiny.toml"

pytestmark = pytest.mark.slow
# where the real-model tests run: cpu here and in CI; benchmarks/gpu_check.sh sets cuda on a GPU machine
DEVICE = os.environ.get("SELFEVO_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def policy(smollm2_path, tmp_path_factory):
    from selfevo.agents.lm.config import LMConfig
    from selfevo.agents.lm.policy import LMPolicy

    return LMPolicy(LMConfig(model=str(smollm2_path), device=DEVICE, threads=2, lr=1e-3, max_new_tokens=16),
                    store=tmp_path_factory.mktemp("store"))


CONVERSATION = [*solver_messages("Who wrote Hamlet?"),
                {"role": "assistant", "content": "<think>I know this.</think><answer> William Shakespeare </answer>"}]


def test_masks_on_the_real_tokenizer_train_only_the_assistant_tokens(policy):
    [(ids, mask)] = policy.encode(CONVERSATION)  # ChatML is prefix-stable: one sequence
    tok = policy.tokenizer
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == CONVERSATION[-1]["content"]
    [(ids_p, mask_p)] = policy.encode(CONVERSATION, mask_final_answer=True)
    # the answer is masked, and so is a token straddling its edge ("</think><" may be one token)
    assert ids_p == ids and tok.decode([i for i, m in zip(ids_p, mask_p) if m]) in (
        "<think>I know this.</think>", "<think>I know this.</think")
    assert "answer" not in tok.decode([i for i, m in zip(ids_p, mask_p) if m])


def test_the_policy_runs_on_the_requested_device(policy):
    policy.new("placed")
    assert {p.device.type for p in policy.base.parameters()} == {DEVICE.split(":")[0]}
    assert {p.device.type for _, p in policy.parameters("placed")} == {DEVICE.split(":")[0]}


def test_a_rewarded_sequence_gains_probability_and_nothing_else_moves(policy):
    policy.new("up")
    policy.new("down")
    policy.new("bystander")
    seq = policy.encode(CONVERSATION)
    before = {n: policy.sequence_logprob(n, seq) for n in (None, "up", "down", "bystander")}
    assert len(set(round(v, 5) for v in before.values())) == 1  # fresh adapters = the base model
    frozen = {n: p.detach().clone() for n, p in policy.parameters("bystander")}
    for _ in range(2):
        stats_up = policy.update("up", [seq], [1.0])
        policy.update("down", [seq], [-1.0])
    assert stats_up["trained_sequences"] == 1 and stats_up["trained_tokens"] == sum(seq[0][1]) - seq[0][1][0]
    after = {n: policy.sequence_logprob(n, seq) for n in (None, "up", "down", "bystander")}
    assert after["up"] > before["up"] + 0.05
    assert after["down"] < before["down"] - 0.05
    assert after[None] == pytest.approx(before[None], abs=1e-6)  # the base stays frozen
    assert after["bystander"] == pytest.approx(before["bystander"], abs=1e-6)
    assert all((p == frozen[n]).all() for n, p in policy.parameters("bystander"))
    # a zero advantage is no signal: no step is taken
    moved = {n: p.detach().clone() for n, p in policy.parameters("up")}
    assert policy.update("up", [seq], [0.0])["trained_sequences"] == 0
    assert all((p == moved[n]).all() for n, p in policy.parameters("up"))


TWO_ACTIONS = [*solver_messages("Who wrote Hamlet?"),
               {"role": "assistant", "content": "<search> Hamlet author </search>"},
               {"role": "user", "content": "<information>Doc 1 (Title: Hamlet) Hamlet is a play by William "
                                           "Shakespeare.</information>"},
               {"role": "assistant", "content": "<think>It says so.</think><answer> William Shakespeare </answer>"}]


def test_a_trajectory_trained_one_sequence_an_action_takes_the_step_of_the_whole_chat(policy):
    """A chat template that is not prefix-stable (Qwen3's) trains each action as its own sequence,
    its generation prompt then its text. On SmolLM2's ChatML both ways see the same contexts, so
    Equation (1)'s loss, gradient and step must agree: each row divided by its trajectory's trained
    tokens, G counting trajectories (divided by its own tokens, each action would weigh as a trajectory)."""
    from selfevo.agents.lm.rl import encode_trajectory

    real = policy.tokenizer.apply_chat_template
    whole = [policy.encode(c) for c in (TWO_ACTIONS, CONVERSATION)]
    # a render that never matches the generation prompt forces one sequence an action
    parts = [encode_trajectory(policy.tokenizer, c, render=lambda ms: "#" + real(list(ms), tokenize=False),
                               prompt=policy.render) for c in (TWO_ACTIONS, CONVERSATION)]
    assert [len(w) for w in whole] == [1, 1] and [len(p) for p in parts] == [2, 1]
    assert policy.sequence_logprob(None, parts[0]) == pytest.approx(policy.sequence_logprob(None, whole[0]), abs=1e-4)
    policy.new("as-whole")
    policy.new("by-action", like="as-whole")
    try:
        a = policy.update("as-whole", whole, [1.0, -0.5])
        b = policy.update("by-action", parts, [1.0, -0.5])
        assert (a["trained_sequences"], a["trained_rows"], b["trained_sequences"], b["trained_rows"]) == (2, 2, 2, 3)
        assert a["trained_tokens"] == b["trained_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        for w, p in zip(whole, parts):
            assert policy.sequence_logprob("by-action", p) == pytest.approx(policy.sequence_logprob("as-whole", w),
                                                                            abs=1e-4)
    finally:
        policy.drop("as-whole")
        policy.drop("by-action")


def test_checkpoint_round_trip_restores_weights_and_optimizer(policy, smollm2_path):
    from selfevo.agents.lm.config import LMConfig
    from selfevo.agents.lm.policy import LMPolicy

    policy.new("ck")
    seq = policy.encode(CONVERSATION)
    policy.update("ck", [seq], [1.0])
    ref = policy.save("ck")
    assert (policy.store / ref["file"]).exists() and ref["steps"] == 1
    other = LMPolicy(policy.cfg, store=policy.store)
    other.load("ck", ref)
    assert other.sequence_logprob("ck", seq) == pytest.approx(policy.sequence_logprob("ck", seq), abs=1e-6)
    # the next step from the restored optimizer equals the next step of the original
    policy.update("ck", [seq], [1.0])
    other.update("ck", [seq], [1.0])
    assert other.sequence_logprob("ck", seq) == pytest.approx(policy.sequence_logprob("ck", seq), abs=1e-5)
    # a corrupted file is refused
    bad = dict(ref, sha256="0" * 64)
    with pytest.raises(ValueError, match="checksum"):
        other.load("ck", bad)
    del LMConfig


def test_snapshots_are_frozen_copies(policy):
    from selfevo.agents.lm.agents import LMSolver

    solver = LMSolver.trainable(policy, "s")
    seq = policy.encode(CONVERSATION)
    policy.update("s", [seq], [1.0])
    snap = solver.snapshot("s@r1")
    assert policy.sequence_logprob("s@r1", seq) == pytest.approx(policy.sequence_logprob("s", seq), abs=1e-6)
    policy.update("s", [seq], [1.0])
    assert policy.sequence_logprob("s@r1", seq) < policy.sequence_logprob("s", seq)
    with pytest.raises(RuntimeError, match="frozen"):
        snap.update([])


def test_full_fine_tuning_moves_the_same_way(smollm2_path):
    from selfevo.agents.lm.config import LMConfig
    from selfevo.agents.lm.policy import LMPolicy

    full = LMPolicy(LMConfig(model=str(smollm2_path), adapter="full", device=DEVICE, threads=2, lr=1e-5))
    full.new("p")
    seq = full.encode(CONVERSATION)
    before = full.sequence_logprob("p", seq)
    full.update("p", [seq], [1.0])
    assert full.sequence_logprob("p", seq) > before
    assert full.sequence_logprob(None, seq) == pytest.approx(before, abs=1e-6)


def test_batched_generation_answers_every_row(policy):
    from selfevo.agents.lm.protocol import STOP_STRINGS

    convs = [solver_messages(q) for q in ("Who wrote Hamlet?", "What is the capital of France?", "Who painted it?")]
    out = policy.generate(None, convs, greedy=True, seed=None, max_new_tokens=12)
    assert len(out) == 3 and all(f in ("stop", "length") for _, f in out)
    # greedy is deterministic, and a row's reply does not depend on its batch mates
    again = policy.generate(None, convs[:1], greedy=True, seed=None, max_new_tokens=12)
    assert again[0][0].split()[:3] == out[0][0].split()[:3]
    assert all(not any(s in t[:-len(s)] for s in STOP_STRINGS) for t, _ in out)  # cut after the first stop


# ------------------------------------------------------------------ evolve end to end


def _keys(obj):
    return sorted(obj)


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory):
    from selfevo.config import load_config
    from selfevo.evolve import evolve
    from selfevo.runs import RunDir

    path = tmp_path_factory.mktemp("sim") / "run"
    cfg = load_config(None, ["world.name=small", "loop.rounds=2", "loop.admit_per_round=40",
                             "loop.proposer_steps=2", "loop.solver_steps=2", "treatment=crossfit"])
    evolve(cfg, path, progress=False)
    return RunDir(path)


@pytest.fixture(scope="module")
def lm_run(smollm2_path, tmp_path_factory):
    from selfevo.cli import app

    out = tmp_path_factory.mktemp("lm") / "run"
    # the audit's judge (the base model on loopback) resolves nothing at 135M, whatever its budget: a
    # short one keeps the LLM-judge path under test (the audit took 83 s instead of 549 s on 2026-12-01)
    result = CliRunner().invoke(app, ["evolve", "--config", str(TINY), "--backend", "lm", "--model", "smollm2-135m",
                                      "--corpus", str(CORPUS), "--treatment", "crossfit", "--out", str(out),
                                      "--set", "lm.judge_max_tokens=64"])
    assert result.exit_code == 0, result.output
    return out


def test_evolve_lm_crossfit_writes_the_sim_schema(lm_run, sim_run):
    from selfevo.runs import RunDir

    run = RunDir(lm_run)
    assert run.manifest()["status"] == "complete" and run.manifest()["rounds_completed"] == 2
    cfg = run.config()
    assert cfg["backend"] == "lm" and cfg["treatment"] == "crossfit" and cfg["data"]["qa_dir"].endswith("qa")
    steps, sim_steps = run.steps(), sim_run.steps()
    assert [(s["round"], s["kind"]) for s in steps] == [(1, "proposer"), (1, "solver"), (2, "proposer"), (2, "solver")]
    for kind in ("proposer", "solver"):
        ref = next(s for s in sim_steps if s["kind"] == kind and s["items"])
        for st in (s for s in steps if s["kind"] == kind):
            assert set(_keys(st)) - {"malformed"} == set(_keys(ref))
            for it in st["items"]:
                assert _keys(it) == _keys(ref["items"][0])
                assert len(it["responses"]) == 5
    # every proposal is accounted for: graded, or malformed with its rule
    for st in (s for s in steps if s["kind"] == "proposer"):
        assert len(st["items"]) + len(st.get("malformed", [])) == 8
        assert all(m["format_error"] and m["reward"] == -0.5 for m in st.get("malformed", []))
        assert all(isinstance(m["text"], str) for m in st.get("malformed", []))  # what the model wrote
    # CrossFit: round 2's graders are the aux solvers of the other fold
    graded = next(s for s in steps if s["round"] == 2 and s["kind"] == "proposer")["items"]
    assert graded  # else the routing below is never checked
    for it in graded:
        assert it["grader"]["id"] == f"aux-{1 - it['fold']}@r1"
        assert it["fold"] not in it["grader"]["trained_on"]["folds"]
    audit, sim_audit = (json.loads((p / "audit" / "metrics.json").read_text()) for p in (lm_run, sim_run.path))
    assert audit["judge"] == "llm:smollm2-135m"
    # as `selfevo audit` writes it: the judge's settings and calls, a line per item judged, the call cache
    judge = json.loads((lm_run / "audit" / "judge.json").read_text())
    assert judge["judge"] == audit["judge"] and judge["summary"]["requests"] > 0
    assert judge["cache"] == str(lm_run / "audit" / "cache.jsonl") and (lm_run / "audit" / "cache.jsonl").stat().st_size
    rows = [json.loads(x) for x in (lm_run / "audit" / "judgements.jsonl").read_text().splitlines()]
    assert rows and all("resolved" in r and "reason" in r for r in rows)
    assert _keys(audit) == _keys(sim_audit) and _keys(audit["rounds"][0]) == _keys(sim_audit["rounds"][0])
    for r in range(3):
        ev, sim_ev = (json.loads((p / "eval" / f"round-{r}.json").read_text()) for p in (lm_run, sim_run.path))
        assert _keys(ev) == _keys(sim_ev) and ev["run"]["questions"] == 7  # one per benchmark
        assert 0.0 <= ev["macro"]["cover_em"] <= 1.0
    compute = json.loads((lm_run / "compute.json").read_text())
    assert compute["updates"]["proposer"] == 2
    assert compute["updates"].get("main", 0) >= 1  # some proposal was admitted and trained the solver
    assert any(k.startswith("aux-") for k in compute["updates"])  # and an auxiliary solver (CrossFit)
    tensors = list((lm_run / "checkpoints" / "tensors").glob("*.safetensors"))
    assert {p.name.split("-")[0] for p in tensors} >= {"main", "proposer", "aux"}
    ck = json.loads((lm_run / "checkpoints" / "round-2.json").read_text())
    assert ck["main"]["policy"]["file"] in {p.name for p in tensors}
    # a step checkpoint every step (the lm default), each replacing the one before: the tensor files
    # left are the round checkpoints' (the steps' were removed as they were replaced)
    from selfevo.runs import tensor_files

    rounds = [json.loads(p.read_text()) for p in (lm_run / "checkpoints").glob("round-*.json")]
    assert {p.name for p in tensors} == set().union(*map(tensor_files, rounds))
    assert not (lm_run / "checkpoints" / "step.json").exists()


def test_evolve_audits_a_corpus_run_with_the_judge_it_is_given(lm_run, tmp_path, monkeypatch):
    """`evolve(cfg, out, judge=J)` from Python: a corpus run is audited by J, not by the base model served on
    loopback (the default judge, which the lm_run fixture's audit runs). A finished run resumed only audits
    again, so the run's records are the fixture's, judged anew; here by a judge that calls every label wrong."""
    import shutil

    from selfevo import evolve as evolve_module
    from selfevo.audit import Verdict
    from selfevo.config import config_from_dict
    from selfevo.runs import RunDir

    out = tmp_path / "run"
    shutil.copytree(lm_run, out)
    before = (out / "records" / "steps.jsonl").read_bytes()

    def no_default_judge(*args, **kwargs):
        raise AssertionError("the default judge was made though a judge was given")

    monkeypatch.setattr(evolve_module, "default_judge", no_default_judge)
    seen = []

    class LabelsAreWrong:
        name = "labels-are-wrong"

        def judge(self, items):
            seen.extend(items)
            return [Verdict(True, False, tuple(False for _ in it["responses"]), ()) for it in items]

    run = evolve_module.evolve(config_from_dict(RunDir(lm_run).config()), out, resume=True, progress=False,
                               judge=LabelsAreWrong())
    assert run.manifest()["status"] == "complete" and (out / "records" / "steps.jsonl").read_bytes() == before
    audit = json.loads((out / "audit" / "metrics.json").read_text())
    assert audit["judge"] == "labels-are-wrong"
    steps = run.steps()
    assert len(seen) == sum(len(s["items"]) for s in steps) > 0  # every item of every step, in one call
    for r in audit["rounds"]:  # nothing is right: no agreement is true, every agreement is false
        assert r["T_P"] == 0.0 and r["T_S"] == 0.0 and r["coverage"] == 1.0
        assert r["F"] == pytest.approx(r["A"])


@pytest.mark.parametrize("crash_in", ["round-2-solver-step", "round-1-aux-1"])
def test_evolve_lm_resumes_after_a_crash_to_the_same_records(lm_run, tmp_path, monkeypatch, crash_in):
    """Generation on CPU is deterministic at a fixed thread count: a run killed in round 2's solver
    step, resumed from the step checkpoint after round 2's proposer step (the lm backend's default,
    a step checkpoint every step), or killed in round 1's second auxiliary solver's training, resumed
    from the step checkpoint after the first one's (which is not trained again), writes what the
    uninterrupted run wrote, and its checkpoints name the same policy files."""
    from selfevo.agents.lm.agents import LMSolver
    from selfevo.config import config_from_dict
    from selfevo.evolve import evolve
    from selfevo.loop.engine import Loop
    from selfevo.runs import RunDir, tensor_files

    cfg = config_from_dict(json.loads((lm_run / "config.json").read_text()))
    if crash_in == "round-2-solver-step":
        original_step = Loop.solver_step

        def crash(self, st, *a, **k):
            if st.round == 2:
                raise RuntimeError("simulated crash")
            return original_step(self, st, *a, **k)

        monkeypatch.setattr(Loop, "solver_step", crash)
    else:
        original_update = LMSolver.update

        def crash(self, groups):
            if self.name == "aux-1":
                raise RuntimeError("simulated crash")
            return original_update(self, groups)

        monkeypatch.setattr(LMSolver, "update", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        evolve(cfg, tmp_path / "run", progress=False, audit=False)
    monkeypatch.undo()
    run = RunDir(tmp_path / "run")
    state = json.loads(run.step_checkpoint_path.read_text())
    if crash_in == "round-2-solver-step":
        assert run.manifest()["rounds_completed"] == 1 and "aux_trained" not in state
    else:
        assert run.manifest()["rounds_completed"] == 0 and state["aux_trained"] == 1
    proposed, trained, original_propose, original_update = [], [], Loop.proposer_step, LMSolver.update

    def counted(self, st, *a, **k):
        proposed.append(st.round)
        return original_propose(self, st, *a, **k)

    def updated(self, groups):
        trained.append(self.name)
        return original_update(self, groups)

    monkeypatch.setattr(Loop, "proposer_step", counted)
    monkeypatch.setattr(LMSolver, "update", updated)
    evolve(cfg, tmp_path / "run", resume=True, progress=False, audit=False)
    if crash_in == "round-2-solver-step":
        assert proposed == []  # round 2's proposer step is not redone
    else:
        assert proposed == [2] and trained.count("aux-0") == 0 and "aux-1" in trained
    for f in ("records/steps.jsonl", "eval/round-1.json", "eval/round-2.json", "eval/round-2.predictions.jsonl"):
        assert (tmp_path / "run" / f).read_bytes() == (lm_run / f).read_bytes(), f
    # the same weights and moments in the same bytes: the same content-addressed files
    for r in (1, 2):
        ref, got = (json.loads((p / "checkpoints" / f"round-{r}.json").read_text()) for p in (lm_run, tmp_path / "run"))
        assert tensor_files(got) == tensor_files(ref) and len(tensor_files(ref)) == 4  # proposer, main, 2 aux
    # and nothing else: the step checkpoints' files that no round checkpoint kept are gone
    kept = set().union(*(tensor_files(json.loads(p.read_text())) for p in run.path.glob("checkpoints/round-*.json")))
    assert {p.name for p in run.tensors_dir.iterdir()} == kept and not run.step_checkpoint_path.exists()


# ------------------------------------------------------------------ the replay bank on a language model


class _LabelsAreRight:
    """A judge that calls every adopted label right (so no agreement can be false), keeping what it saw."""

    name = "labels-are-right"

    def __init__(self):
        self.seen = []

    def judge(self, items):
        from selfevo.audit import Verdict
        from selfevo.evaluate import answers_match

        self.seen.extend(items)
        return [Verdict(True, True, tuple(answers_match(r, it["adopted_label"]) for r in it["responses"]),
                        (it["adopted_label"],)) for it in items]


def test_replay_of_a_language_model_run_on_a_real_corpus(lm_run, tmp_path, monkeypatch):
    """`selfevo replay` on a bank of an lm run: the feedback solvers are fresh adapters on the run's
    base model trained by GRPO on the bank's labels, and the metrics follow the judge given (a real
    corpus has no exact truth; here a judge that calls every adopted label right, so no agreement
    can be false)."""
    from selfevo.evaluate import answers_match
    from selfevo.replay import Bank, ReplayError, ReplaySettings, _ctx, build_bank, run_replay

    bank = build_bank([lm_run], size=1000, min_round=1, allow_fewer=True)
    assert bank.backend == "lm" and bank.corpus == str(CORPUS) and bank.lm["model"] == "smollm2-135m"
    assert len(bank.items) >= 4 and all(it.source_id in it.source_ids for it in bank.items)
    assert Bank.load(bank.save(tmp_path / "bank.json")).to_json() == bank.to_json()
    settings = ReplaySettings(updates=2, rollouts=2, samples=2)
    with pytest.raises(ReplayError, match="no exact truth"):
        run_replay(bank, "coupled", seeds=1, settings=settings)

    judge = _LabelsAreRight()
    seen = judge.seen
    res = run_replay(bank, "coupled,full-data", seeds=1, settings=settings, workers=2, judge=judge)
    assert set(res["conditions"]) == {"coupled", "full-data"}
    assert res["invariants"]["updates"] == {"coupled": {"all": 2}, "full-data": {"all-b": 2}}
    for entry in (*res["conditions"].values(), res["reference"]["base"]):
        assert entry["F"]["mean"] == 0.0 and entry["L"]["mean"] == 0.0
        assert entry["solver_truth"]["mean"] == entry["A"]["mean"]  # truth is agreement with a right label
        assert 0.0 <= entry["A"]["mean"] <= 1.0
    assert res["bank"]["T_P"] == 1.0 and res["judge"] == "labels-are-right"
    # the judge saw each bank item's sources (an LLM judge reads them); every adapter was freed
    assert {tuple(it["source_ids"]) for it in seen} == {it.source_ids for it in bank.items}
    assert _ctx().policy.names() == []

    # the command, judged by an LLM judge over HTTP (a scripted one: a 135M model resolves nothing),
    # its calls cached in OUT; the same settings reuse the loaded model
    from selfevo.agents.lm.model import ScriptedModel
    from selfevo.agents.lm.server import make_app, running
    from selfevo.audit.scripted import ScriptedJudge, sentences
    from selfevo.cli import app

    docs = {it.source_id: _ctx().documents[it.source_id].contents for it in bank.items}  # read once, above
    key = {}
    for it in bank.items:  # the label where a source sentence states it, else some other word of one
        quotable = [q for q in sentences(docs[it.source_id]) if len(q.split()) <= 100]
        quote = next((q for q in quotable if answers_match(q, it.label)), quotable[0])
        key[it.question] = {"reference": it.label if answers_match(quote, it.label) else quote.split()[0],
                            "quote": quote}
    out = tmp_path / "replay"
    with running(make_app(ScriptedModel(ScriptedJudge(key), name="judge"))) as url:
        result = CliRunner().invoke(app, ["replay", "run", "--bank", str(tmp_path / "bank.json"), "--conditions",
                                          "coupled", "--seeds", "1", "--updates", "2", "--rollouts", "2",
                                          "--samples", "2", "--out", str(out), "--judge-url", url,
                                          "--judge-model", "judge"])
    assert result.exit_code == 0, result.output
    res = json.loads((out / "results.json").read_text())
    assert res["judge"] == "llm:judge" and set(res["conditions"]) == {"coupled"}
    # graded by what the judge resolved: coverage and truth are the judge's, the same for every grader
    assert res["bank"]["coverage"] > 0 and res["bank"]["T_P"] is not None
    assert res["conditions"]["coupled"]["coverage"]["mean"] == res["bank"]["coverage"]
    assert res["bank"]["backend"] == "lm" and res["bank"]["corpus"] == str(CORPUS)
    assert (out / "judge-cache.jsonl").stat().st_size > 0 and (out / "replay.png").exists()

    # without --judge-url, a corpus bank is graded as `evolve` audits a corpus run: by the runs' base
    # model served on loopback (selfevo.evolve.default_judge, which the lm_run fixture's audit runs)
    import contextlib

    from selfevo import evolve as evolve_module
    from selfevo.replay import replay_judge

    made = []

    @contextlib.contextmanager
    def base_model_judge(cfg, env, cache_path=None, progress=False):
        made.append((cfg.lm.model, cfg.data.corpus, len(env.documents), cache_path))
        yield "the base model's judge"

    monkeypatch.setattr(evolve_module, "default_judge", base_model_judge)
    with replay_judge(bank, cache_path=tmp_path / "cache.jsonl") as judge:
        assert judge == "the base model's judge"
    assert made == [("smollm2-135m", str(CORPUS), len(_ctx().documents), tmp_path / "cache.jsonl")]


def test_eval_of_a_runs_saved_policy_answers_as_the_run_evaluated_it(lm_run, tmp_path):
    """README's `selfevo eval --agent lm:smollm2-135m@RUN/checkpoints/tensors/main-<hash>.safetensors`:
    the main solver a run saved after round 2, evaluated on its own with the run's generation settings,
    gives the answers the run's own round-2 evaluation gave (greedy, the same questions). At this size
    they are also the base model's (one small update): that the agent is the file's policy, not the base,
    is test_lm_logic.py's test_an_lm_agent_with_a_policy_file_is_that_policy_frozen."""
    from selfevo.cli import app

    def answers(path: Path) -> dict:
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        return {(r["benchmark"], r["id"]): r["prediction"] for r in rows}

    cfg = json.loads((lm_run / "config.json").read_text())
    main = json.loads((lm_run / "checkpoints" / "round-2.json").read_text())["main"]["policy"]["file"]
    adapter = lm_run / "checkpoints" / "tensors" / main
    settings = [x for k in ("max_actions", "max_new_tokens", "threads") for x in ("--lm-set", f"{k}={cfg['lm'][k]}")]
    result = CliRunner().invoke(app, ["eval", "--agent", f"lm:smollm2-135m@{adapter}", "--data-dir",
                                      cfg["data"]["qa_dir"], "--corpus", str(CORPUS), "--limit",
                                      str(cfg["data"]["eval_limit"]), *settings, "--out", str(tmp_path / "eval")])
    assert result.exit_code == 0, result.output
    got = answers(tmp_path / "eval" / "predictions.jsonl")
    assert got == answers(lm_run / "eval" / "round-2.predictions.jsonl") and len(got) == 7
    assert json.loads((tmp_path / "eval" / "score.json").read_text())["run"]["agent"] == f"lm:smollm2-135m@{adapter}"


def test_sampled_replies_that_end_early_are_not_length(smollm2_path):
    """n > 1 samples come back padded to the longest row: a reply that ended at EOS or a stop
    string is finish_reason "stop" with its own token count, whatever the other rows did."""
    from selfevo.agents.lm.model import TransformersChatModel

    m = TransformersChatModel(smollm2_path, threads=1)
    msgs = [{"role": "user", "content": "Name one colour. Answer with one word."}]
    seen_short = seen_long = False
    for seed in range(6):
        for c in m.generate(msgs, temperature=1.0, top_p=1.0, max_tokens=10, n=4, seed=seed, stop=["."]):
            tokens = len(m.tokenizer(c.text, add_special_tokens=False)["input_ids"])
            assert c.completion_tokens <= 10
            if c.finish_reason == "length":
                seen_long = True
                assert c.completion_tokens == 10 and tokens >= 9  # it really ran out of budget
            else:
                seen_short |= c.completion_tokens < 10
        if seen_short and seen_long:
            break
    assert seen_short and seen_long  # the case: early and budget-bound rows in one batch


def test_chat_server_refuses_a_seed_torch_cannot_take_and_a_prompt_past_the_context(smollm2_path):
    """'Every bad request is a 4xx, never a 500': a seed outside torch.manual_seed's range is a 422
    (a 500 would be retried by every client as a server fault), the edges of the range work; a
    prompt that fills the model's context is a 400."""
    from fastapi.testclient import TestClient

    from selfevo.agents.lm.model import TransformersChatModel
    from selfevo.agents.lm.server import make_app

    model = TransformersChatModel(smollm2_path, threads=1)
    client = TestClient(make_app(model), raise_server_exceptions=False)
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0.8}
    for seed in (2**64, -(2**63) - 1, 10**30):
        assert client.post("/v1/chat/completions", json={**body, "seed": seed}).status_code == 422
    for seed in (0, -1, 2**64 - 1, -(2**63)):
        assert client.post("/v1/chat/completions", json={**body, "seed": seed}).status_code == 200
    # the model's context: a prompt that fills it is a 400 (a review's 9,031-token prompt on SmolLM2's
    # 8,192 positions was a 200 after 31.8 s of prefill under the lock); a reply past it is cut short
    n_prompt = client.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
    model.model.config.max_position_embeddings = n_prompt + 3  # a small context: no long prefill here
    r = client.post("/v1/chat/completions", json={**body, "temperature": 0.0, "max_tokens": 50})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    long = {**body, "messages": [{"role": "user", "content": "Say hi, please, now."}]}
    r = client.post("/v1/chat/completions", json=long)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith(f"this model's maximum context length is {n_prompt + 3} tokens")


def test_a_policy_file_of_another_lora_rank_is_a_clear_error(smollm2_path, tmp_path):
    """LoRA parameter names carry no rank, so a file saved with lm.lora_r = 8 passes the name check
    where lm.lora_r = 16: it must be the ValueError naming lm.lora_* (which `selfevo eval` reports
    in one line), not torch's RuntimeError from copy_ (a traceback)."""
    from safetensors.torch import load, save

    from selfevo.agents.lm.config import LMConfig
    from selfevo.agents.lm.policy import LMPolicy

    saver = LMPolicy(LMConfig(model=str(smollm2_path), lora_r=8, threads=1), store=tmp_path)
    saver.new("main")
    ref = saver.save("main")
    loader = LMPolicy(LMConfig(model=str(smollm2_path), lora_r=16, threads=1))
    path = tmp_path / ref["file"]
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: .*lm\.lora_r: '8' in the file, '16' here"):
        loader.load_file("evaluated", path)
    # a file from before policy files recorded lm.lora_r: the shape check still names it
    old = tmp_path / "old.safetensors"
    old.write_bytes(save(load(path.read_bytes()), metadata={"name": "main", "adapter": "lora", "steps": "0",
                                                            "has_optimizer": "False"}))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(old))}: .*another shape.*lm\.lora_r"):
        loader.load_file("evaluated", old)


def test_a_policy_file_records_the_settings_its_weights_mean_and_errors_name_it(policy, smollm2_path, tmp_path):
    """Another lm.lora_alpha (or a subset of lm.lora_targets, or another base model) fits the file's
    names and shapes and would silently be another function: a policy file records the base model,
    lm.lora_r/alpha/targets and dtype, and loading it under others is refused naming the field and
    the file. A file saved before they were recorded loads as before; a file that is no policy file
    is refused naming it."""
    import torch
    from safetensors.torch import load, save

    from selfevo.agents.lm.config import LMConfig
    from selfevo.agents.lm.policy import LMPolicy

    policy.new("fit")
    path = policy.store / policy.save("fit")["file"]
    blob = path.read_bytes()
    meta = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])["__metadata__"]
    assert {k: v for k, v in meta.items() if k not in ("name", "steps", "has_optimizer")} == {
        "model": smollm2_path.name, "adapter": "lora", "dtype": "float32", "lora_r": "16", "lora_alpha": "32",
        "lora_targets": "k_proj,o_proj,q_proj,v_proj"}
    other = LMPolicy(LMConfig(model=str(smollm2_path), device=DEVICE, threads=2, lora_alpha=16))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: .*lm\.lora_alpha: '32' in the file, '16' here"):
        other.load_file("evaluated", path)
    assert "evaluated" not in other.names()  # refused before anything was made
    tensors = load(blob)
    old = tmp_path / "old.safetensors"
    old.write_bytes(save(tensors, metadata={k: meta[k] for k in ("name", "adapter", "steps", "has_optimizer")}))
    other.load_file("evaluated", old)  # as before: nothing recorded, nothing checked
    for field, value in (("model", "Qwen3.5-4B"), ("lora_targets", "q_proj,v_proj")):
        f = tmp_path / f"{field}.safetensors"
        f.write_bytes(save(tensors, metadata={**meta, field: value}))
        with pytest.raises(ValueError, match=rf"^{re.escape(str(f))}: .*lm\.{field}: '{value}' in the file"):
            policy.load_file("evaluated", f)
    f = tmp_path / "bad.safetensors"
    for content, why in ((b"not a safetensors file", "not a safetensors policy file"),
                         (save({"junk": torch.zeros(2)}), "not a selfevo policy file")):
        f.write_bytes(content)
        with pytest.raises(ValueError, match=rf"^{re.escape(str(f))}: {why}"):
            policy.load_file("evaluated", f)


def test_sampled_chat_replies_have_no_top_k_cut(smollm2_path):
    """The chat model (engine-run's local graders, `serve-model`) samples as LMPolicy does, with
    temperature and top-p only; transformers otherwise cuts to the 50 likeliest tokens. At a
    temperature that flattens the distribution a sampled first token falls outside those 50 (each
    draw with p ~ 1 - 50/49,152), which the cut never allows."""
    import torch

    from selfevo.agents.lm.model import TransformersChatModel

    m = TransformersChatModel(smollm2_path, threads=1)
    msgs = [{"role": "user", "content": "Say hi."}]
    real, outputs = m.model.generate, []

    def recording(**kwargs):
        outputs.append(real(**kwargs))
        return outputs[-1]
    m.model.generate = recording
    m.generate(msgs, temperature=50.0, top_p=1.0, max_tokens=1, n=8, seed=0)
    prompt = m.tokenizer(m.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                         return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        top50 = set(m.model(**prompt).logits[0, -1].topk(50).indices.tolist())
    first = outputs[0][:, prompt["input_ids"].shape[1]].tolist()
    assert len(first) == 8 and not set(first) <= top50


def test_a_new_adapter_is_initialised_from_the_run_seed_and_its_name(policy):
    """Every seed of a treatment started from the same LoRA A matrices (seeded by the name alone):
    the run seed now enters. And the first adapter a process made drew after the placeholder's
    initialisation, so the same name and seed gave another adapter depending on what came first."""
    def lora_a(seed: int) -> list:
        policy.seed = seed
        policy.new("init-probe")
        out = [p.detach().clone() for n, p in policy.parameters("init-probe") if "lora_A" in n]
        policy.drop("init-probe")
        return out

    try:
        zero, one, again = lora_a(0), lora_a(1), lora_a(0)
    finally:
        policy.seed = 0
    assert all((a == b).all() for a, b in zip(zero, again, strict=True))
    assert not all((a == b).all() for a, b in zip(zero, one, strict=True))


def test_lora_dropout_draws_the_same_masks_whatever_ran_before(policy, smollm2_path):
    """Dropout drew from torch's global random state, so a policy's step depended on what the
    process had drawn before (a replay study's job order, a resume): now seeded by policy and step."""
    import torch

    from selfevo.agents.lm.config import LMConfig
    from selfevo.agents.lm.policy import LMPolicy

    dropping = LMPolicy(LMConfig(model=str(smollm2_path), device=DEVICE, threads=2, lr=1e-3, lora_dropout=0.5))
    seq = dropping.encode(CONVERSATION)

    def trained(p, global_seed: int) -> list:
        p.new("dropout-probe")
        torch.manual_seed(global_seed)
        for _ in range(2):
            p.update("dropout-probe", [seq], [1.0])
        out = [q.detach().clone() for _, q in p.parameters("dropout-probe")]
        p.drop("dropout-probe")
        return out

    first = trained(dropping, 1)
    assert all((a == b).all() for a, b in zip(first, trained(dropping, 2), strict=True))
    # the dropout is real: the same adapter (same seed and name) trained without it moves otherwise
    assert not all((a == b).all() for a, b in zip(first, trained(policy, 1), strict=True))


def test_a_policy_unchanged_since_its_last_save_is_not_serialised_again(policy, monkeypatch):
    """A step checkpoint saves both policies after every step, and a step trains one: the other's
    weights and moments (510 MB at 4B) were serialised and hashed again to find its file there."""
    import safetensors.torch

    policy.new("saved-probe")
    try:
        first = policy.save("saved-probe")
        calls, real = [], safetensors.torch.save
        monkeypatch.setattr(safetensors.torch, "save", lambda *a, **k: calls.append(1) or real(*a, **k))
        assert policy.save("saved-probe") == first and calls == []
        policy.update("saved-probe", [policy.encode(CONVERSATION)], [1.0])
        second = policy.save("saved-probe")
        assert second["file"] != first["file"] and second["steps"] == 1 and calls == [1]
        (policy.store / second["file"]).unlink()  # a file gone from the store is written again
        assert policy.save("saved-probe") == second and calls == [1, 1]
        assert (policy.store / second["file"]).exists()
    finally:
        policy.drop("saved-probe")


def test_a_loaded_policy_saves_again_as_the_same_file(policy):
    """A policy whose optimizer had no state yet (its update had nothing to train: an auxiliary
    solver's, say) was loaded without one and saved again as another file: a resumed run's
    checkpoints named other files than an uninterrupted run's."""
    policy.new("reload-probe")
    try:
        for advantage in (0.0, 1.0):  # an optimizer with no state, then one with moments
            policy.update("reload-probe", [policy.encode(CONVERSATION)], [advantage])
            saved = policy.save("reload-probe")
            policy.load("reload-probe", saved)
            assert policy.save("reload-probe") == saved
    finally:
        policy.drop("reload-probe")


def test_replay_of_a_language_model_bank_through_a_retriever_server(lm_run, tmp_path, monkeypatch):
    """`replay run --retriever-url` (for a bank of runs that searched through a /retrieve server, whose
    config names no index): the feedback solvers search through the server (asked once before anything
    loads), the corpus's documents come from its store, and no index is opened or built here; the results
    are those of the replay searching the same BM25 index in process, and its journal rows are another
    study's (the jobs run again, not taken from that replay's rows)."""
    from _shared import corpus_served_elsewhere

    from selfevo.replay import OtherStudyJournal, ReplaySettings, _ctx, build_bank, run_replay
    from selfevo.search.bm25 import BM25Index
    from selfevo.search.client import RetrieverClient

    bank = build_bank([lm_run], size=1000, min_round=1, allow_fewer=True)
    settings, journal = ReplaySettings(updates=2, rollouts=2, samples=2), tmp_path / "jobs.jsonl"
    here = run_replay(bank, "coupled", seeds=1, settings=settings, judge=_LabelsAreRight(), journal=journal)

    with corpus_served_elsewhere(monkeypatch, tmp_path / "cache") as (url, searched):
        with pytest.raises(OtherStudyJournal, match="searched in process → through a /retrieve server"):
            run_replay(bank, "coupled", seeds=1, settings=settings, judge=_LabelsAreRight(), journal=journal,
                       retriever_url=f"{url}/retrieve")
        served = run_replay(bank, "coupled", seeds=1, settings=settings, judge=_LabelsAreRight(),
                            journal=tmp_path / "served.jsonl", retriever_url=f"{url}/retrieve")
        # the 135M model writes no search of its own here (the server is asked the probe alone), so the
        # feedback solvers' tool is asked directly: its hits are the in-process index's
        tool = _ctx().tool
        assert isinstance(tool.retriever, RetrieverClient) and searched == ["probe"]
        questions = [it.question for it in bank.items]
        in_process = BM25Index.from_corpus_file(CORPUS).retrieve(questions, topk=tool.topk)
        assert [[(h.document.id, h.document.contents) for h in hits] for hits in tool.lookup(questions)] == \
            [[(h.document.id, h.document.contents) for h in hits] for hits in in_process]
        assert searched[1:] == list(dict.fromkeys(questions))
    assert served["conditions"] == here["conditions"] and served["reference"] == here["reference"]
    assert (tmp_path / "cache" / "corpora").is_dir()  # the documents' store
