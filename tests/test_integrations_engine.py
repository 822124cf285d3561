"""`selfevo engine-run` for real on CPU: a TRL GRPO run with SmolLM2-135M through every phase
(proposer with graded frontier rewards, admission, main solver, evaluation, audit), its resume at
phase granularity, the environment mask of the TRL rollout, and the verl phase that needs GPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from selfevo.cli import app

pytestmark = pytest.mark.slow
TINY = Path(__file__).resolve().parents[1] / "configs" / "trl-tiny.toml"


@pytest.fixture(scope="module")
def trl_run(smollm2_path, tmp_path_factory):
    pytest.importorskip("trl")
    out = tmp_path_factory.mktemp("engine") / "run"
    result = CliRunner().invoke(app, ["engine-run", "--engine", "trl", "--config", str(TINY), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out, result.output


def _lines(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_trl_engine_run_leaves_the_evolve_layout(trl_run):
    out, output = trl_run
    for name in ("config.json", "manifest.json", "folds.json", "records/steps.jsonl", "eval/round-0.json",
                 "eval/round-1.json", "compute.json", "checkpoints/round-1.json", "audit/metrics.json"):
        assert (out / name).exists(), name
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    steps = _lines(out / "records/steps.jsonl")
    assert [(s["kind"], s["step"], s["step_in_round"]) for s in steps] == [("proposer", 1, 1), ("solver", 2, 2)]
    prop, solver = steps
    # 2 prompts x 2 completions: every proposal is graded (5 samples each) or recorded malformed
    assert len(prop["items"]) + len(prop.get("malformed", [])) == 4
    for it in prop["items"]:
        assert len(it["responses"]) == 5 and it["grader"]["id"] == "main@r0" and it["admitted"]
    # the main solver's step trains on the admitted questions, each with its 2 rollouts
    assert {it["item_id"] for it in solver["items"]} == {it["item_id"] for it in prop["items"] if it["admitted"]}
    for it in solver["items"]:
        assert len(it["responses"]) == 2 and it["reward"] == it["k"] / 2
    compute = json.loads((out / "compute.json").read_text())
    assert compute["updates"] == {"proposer": 1, "main": 1}
    assert compute["generations"]["proposer"] == 4 and compute["generations"]["grader"] == 5 * len(prop["items"])
    # the evaluation of the base model and of round 1: one trajectory a question
    evals = [json.loads((out / f"eval/round-{r}.json").read_text())["run"]["questions"] for r in (0, 1)]
    assert compute["generations"]["evaluation"] == sum(evals) > 0
    audit = json.loads((out / "audit/metrics.json").read_text())
    assert audit["judge"] == "oracle" and audit["rounds"][0]["admitted"] == len(prop["items"])
    for role in ("proposer", "main"):
        assert (out / "models" / role / "round-1" / "config.json").exists()
    assert "main solver macro Cover-EM by round: r0" in output


def test_trl_engine_run_resumes_at_phase_granularity(trl_run):
    out, _ = trl_run
    steps_before = (out / "records/steps.jsonl").read_text()
    again = CliRunner().invoke(app, ["engine-run", "--engine", "trl", "--config", str(TINY), "--out", str(out)])
    assert again.exit_code == 2 and "pass --resume" in again.output
    # a kill after the main solver's phase: the log lost r1/eval and audit
    log = out / "engine" / "phases.jsonl"
    entries = _lines(log)
    log.write_text("".join(json.dumps(e) + "\n" for e in entries if e["phase"] not in ("r1/eval", "audit")))
    result = CliRunner().invoke(app, ["engine-run", "--engine", "trl", "--config", str(TINY), "--out", str(out),
                                      "--resume"])
    assert result.exit_code == 0, result.output
    for done in ("r0/eval", "r1/proposer", "r1/admit", "r1/main"):
        assert f"{done}: done, skipped" in result.output
    assert "r1/eval: running" in result.output and "audit: running" in result.output
    assert (out / "records/steps.jsonl").read_text() == steps_before
    assert [e["phase"] for e in _lines(log)][-2:] == ["r1/eval", "audit"]


def _solver_job(tmp_path: Path, smollm2_path, name: str, steps: int, questions: int) -> dict:
    """A main-solver TRL job as engine.py writes one: LoRA on SmolLM2, 2 questions a step, one pass
    over the admitted questions (topped up to fill the last step), 2 rollouts each, a checkpoint
    every step, its solver step records staged under tmp_path/name."""
    from selfevo._io import write_jsonl
    from selfevo.integrations.datasets import one_pass, solver_rows
    from selfevo.loop.folds import FoldAssignment

    folds = FoldAssignment(2, 0, "source", {"d0": 0, "d1": 1})
    qa = [("Where is Beta?", "sea"), ("What is Alpha?", "river"), ("Where is Gamma?", "hill"),
          ("What is Delta?", "lake")][:questions]
    items = [{"item_id": f"r1-s1-{i}", "question": q, "adopted_label": a, "source_id": f"d{i % 2}", "fold": i % 2,
              "hops": 1} for i, (q, a) in enumerate(qa)]
    d = tmp_path / name
    d.mkdir()
    write_jsonl(d / "rows.jsonl", one_pass(solver_rows(items, folds, 1), 2 * steps, seed=0))
    return {"kind": "solver", "model": str(smollm2_path), "out": str(d / "models" / "main" / "round-1"),
            "rows": str(d / "rows.jsonl"), "steps": steps, "prompts_per_step": 2, "generations": 2, "lr": 1e-3,
            "max_grad_norm": 1.0, "seed": 0, "dtype": "float32", "device": "cpu", "threads": 1,
            "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "targets": ["q_proj", "v_proj"]},
            "rollout": {"max_actions": 2, "max_new_tokens": 8, "max_tokens": 512, "temperature": 0.8,
                        "top_p": 0.95, "scaffold": False, "search": True, "backend": "hf"},
            "search": {"retriever_url": "", "topk": 1, "max_calls": 1},
            "reward": {"records_path": str(d / "solver-steps.jsonl"), "round": 1, "step_base": 1,
                       "first_step_in_round": 2, "grader": {"id": "main", "trained_on": {"folds": [0, 1],
                                                                                         "rounds": [1]}}},
            "grpo": {}, "save_steps": 1}


def test_a_killed_trl_phase_goes_on_from_its_checkpoint_as_if_never_killed(smollm2_path, tmp_path, monkeypatch):
    """engine.save_steps: a TRL phase killed in its step 2 (its records for step 2 staged, its
    checkpoint at step 1) is resumed from that checkpoint, its step-2 records cut and made again; it
    ends with the records and weights of the same job run without a kill. 3 questions in steps of
    2 are one pass of 4 rows (as 3 rows they were two passes of TRL's sampler, reshuffled with a
    random state no checkpoint holds: the resumed step 2 trained another batch). Killed while saving
    the model, after its last checkpoint, it resumes to no further update. The resumed trainer
    checkpoints as the job now says, not as the checkpoint's trainer_state.json said."""
    pytest.importorskip("trl")
    from safetensors.torch import load_file

    from selfevo.integrations import rewards, trl_job
    from selfevo.records import Document
    from selfevo.search.bm25 import BM25Index
    from selfevo.search.tool import SearchTool

    tool = SearchTool(BM25Index.build([Document("d0", "Beta", "Beta is a city by the sea."),
                                       Document("d1", "Alpha", "Alpha is a town on a river.")]), topk=1, max_calls=1)
    real, calls, kill_in = rewards.TRLSolverReward.__call__, [], {"step": None}

    def reward_by_length(self, prompts, completions, *args, **kwargs):
        """The real reward stages the step records. In 8 tokens the tiny model writes no answer, so
        its reward is 0 everywhere and nothing would train: the reward returned here follows what was
        sampled, so equal weights at the end mean the same samples too."""
        real(self, prompts, completions, *args, **kwargs)
        calls.append(self.calls)
        if self.calls == kill_in["step"]:
            raise KeyboardInterrupt("killed")  # the step's records are staged, its update never happens
        return [float(len(str(c)) % 2) for c in completions]

    monkeypatch.setattr(rewards.TRLSolverReward, "__call__", reward_by_length)
    real_save, saved_with = trl_job._save, []

    def save(trainer, job):
        saved_with.append(trainer.state.save_steps)
        if job.get("kill_in_save"):
            raise KeyboardInterrupt("killed while saving")
        real_save(trainer, job)
    monkeypatch.setattr(trl_job, "_save", save)
    whole = trl_job.resume(_solver_job(tmp_path, smollm2_path, "whole", 2, questions=3))
    assert whole["start_step"] == 0 and trl_job.run_job(whole, tool=tool)["steps"] == 2

    job = _solver_job(tmp_path, smollm2_path, "killed", 2, questions=3)
    kill_in["step"] = 2
    with pytest.raises(KeyboardInterrupt):
        trl_job.run_job(trl_job.resume(job), tool=tool)
    staged = Path(job["reward"]["records_path"])
    assert [json.loads(line)["step_in_round"] for line in staged.read_text().splitlines()] == [2, 3]
    assert trl_job.last_checkpoint(job["out"])[1] == 1

    again = trl_job.resume(job)
    assert again["start_step"] == 1 and again["resume_from"].endswith("checkpoint-1")
    assert [json.loads(line)["step_in_round"] for line in staged.read_text().splitlines()] == [2]
    kill_in["step"], calls[:] = None, []
    assert trl_job.run_job({**again, "save_steps": 2}, tool=tool)["steps"] == 2
    assert calls == [2] and saved_with[-1] == 2  # step 2 only; checkpoints as the job says now
    assert staged.read_text() == Path(whole["reward"]["records_path"]).read_text()
    base, a, b = (load_file(str(Path(d) / "model.safetensors")) for d in (smollm2_path, whole["out"], job["out"]))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert any(not a[k].equal(base[k]) for k in a)  # the job trained
    # the checkpoints outlive the saved model (the engine drops them once the phase is logged): a kill
    # before that resumes to no update and the same model, not to the phase trained again
    done = trl_job.resume(whole)
    assert done["start_step"] == 2 and trl_job.run_job(done, tool=tool)["steps"] == 2 and calls == [2]
    assert all(a[k].equal(v) for k, v in load_file(str(Path(whole["out"]) / "model.safetensors")).items())

    late = {**_solver_job(tmp_path, smollm2_path, "killed-saving", 2, questions=3), "kill_in_save": True}
    with pytest.raises(KeyboardInterrupt):
        trl_job.run_job(trl_job.resume(late), tool=tool)
    last = trl_job.resume({**late, "kill_in_save": False})
    assert last["start_step"] == 2 and last["resume_from"].endswith("checkpoint-2")
    calls[:] = []
    assert trl_job.run_job(last, tool=tool)["steps"] == 2 and calls == []  # no update past the last checkpoint
    assert Path(late["reward"]["records_path"]).read_text() == Path(whole["reward"]["records_path"]).read_text()
    c = load_file(str(Path(late["out"]) / "model.safetensors"))
    assert all(a[k].equal(c[k]) for k in a)


def test_trl_rollout_masks_observations(smollm2_path):
    """The env_mask TRL multiplies into the loss: only the policy's own actions are trained."""
    from transformers import AutoTokenizer

    from selfevo.integrations.trl_env import SearchRollout
    from selfevo.records import Document
    from selfevo.search.bm25 import BM25Index
    from selfevo.search.tool import SearchTool

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tool = SearchTool(BM25Index.build([Document("d1", "Beta", "Beta is a city by the sea.")]), topk=1, max_calls=2)
    replies = iter([("<think>look it up</think><search> Beta </search>", "stop"),
                    ("<answer> the sea </answer>", "stop")])
    ro = SearchRollout(tool, role="solver", max_actions=3)
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "Question: Where is Beta?"}]
    rollouts = ro.rollouts([prompt], lambda convs, seed: [next(replies)], seed=0)
    out = ro.encode(tok, [prompt], rollouts)
    ids, mask = out["completion_ids"][0], out["env_mask"][0]
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    untrained = tok.decode([t for t, m in zip(ids, mask) if not m])
    assert "<search> Beta </search>" in trained and "<answer> the sea </answer>" in trained
    assert "<information>" not in trained and "Beta is a city" in untrained and "<information>" in untrained
    assert tok.decode(out["prompt_ids"][0]).endswith("<|im_start|>assistant\n")
    assert "Where is Beta?" in tok.decode(out["prompt_ids"][0]) and "Where is Beta?" not in tok.decode(ids)
    assert ids[-1] == tok.eos_token_id and out["answer"] == ["the sea"] and out["read"] == [["d1"]]
    # SmolLM2's ChatML is prefix-stable: the append-only rendering TRL generates from is the template's own
    from selfevo.agents.lm.rl import append_only, template_of

    chat = rollouts[0].messages
    assert all(append_only(template_of(tok))(chat[:k], gen) == template_of(tok)(chat[:k], gen)
               for k in range(1, len(chat) + 1) for gen in (False, True))
    # the proposer's final <answer> is its label, not trained (rl.encode_conversation)
    prop = SearchRollout(tool, role="proposer", max_actions=1)
    final = "<question> Where is Beta? </question> <answer> sea </answer>"
    pr = prop.rollouts([prompt], lambda convs, seed: [(final, "stop")], seed=0)
    enc = prop.encode(tok, [prompt], pr)
    kept = tok.decode([t for t, m in zip(enc["completion_ids"][0], enc["env_mask"][0]) if m])
    assert "Where is Beta?" in kept and "sea" not in kept and enc["final"] == [final]


def test_verl_phase_writes_its_launch_and_says_what_is_missing(smollm2_path, tmp_path):
    """On a machine without verl or GPUs the verl proposer phase writes everything a GPU node runs
    (parquet, tool and agent-loop YAML, reward shim and settings, the launch script) and stops with
    a message naming what is missing and where the script is."""
    from selfevo.agents.lm.server import running
    from selfevo.integrations.datasets import read_verl
    from selfevo.integrations.engine import EngineRun, EngineUnavailable, load_engine_config, verl_missing
    from selfevo.search.server import make_app

    if not verl_missing():
        pytest.skip("verl and GPUs are present: the phase would really train")
    from selfevo.evolve import environment

    index = environment(load_engine_config(TINY).run).index
    with running(make_app(index)) as url:
        retrieve = f"engine.retriever_url={url.removesuffix('/v1')}/retrieve"
        # the tiny config's proposer scaffold cannot run under verl (refused by name), nor its LoRA adapter: off here
        ecfg = load_engine_config(TINY, ["engine.engine=verl", retrieve, "lm.proposer_scaffold=false",
                                         "lm.adapter=full"], engine="verl")
        er = EngineRun(ecfg, tmp_path / "run2", log=lambda m: None)
        with pytest.raises(EngineUnavailable, match=r"r1/proposer: verl training needs .*proposer\.verl\.sh"):
            er.proposer(1)
    eng = tmp_path / "run2" / "engine"
    rows = read_verl(eng / "round-1" / "proposer.parquet")
    assert len(rows) == 2 and rows[0]["data_source"] == "selfevo_proposer"
    settings = json.loads((eng / "round-1" / "reward-settings.json").read_text())
    assert [g["role"] for g in settings["graders"]] == ["main"] and settings["graders"][0]["name"] == "main@r0"
    script = (eng / "round-1" / "proposer.verl.sh").read_text()
    assert "verl.trainer.main_ppo" in script and "selfevo_settings=" in script and "verl.model_merger" in script
    assert (eng / "verl_reward.py").read_text().count("compute_score") >= 1
    assert (eng / "verl-tool.yaml").exists() and (eng / "verl-agent-loop.yaml").exists()


def test_msv_admission_phase_with_a_served_model(smollm2_path, tmp_path):
    """engine-run's admit phase under MSV: the main solver (the base model, served on loopback) is
    sampled 3 times with the source and 3 without for a staged proposal; the decisions and their
    samples land in the proposer step records."""
    from selfevo._io import append_jsonl
    from selfevo.evaluate import answers_match
    from selfevo.integrations.engine import EngineRun, load_engine_config

    ecfg = load_engine_config(TINY, ["treatment=msv"], engine="trl")
    er = EngineRun(ecfg, tmp_path / "run", log=lambda m: None)
    docs = er.pool[:1]
    append_jsonl(er.round_dir(1) / "proposer-items.jsonl", [{"round": 1, "step_in_round": 1, "item": {
        "item_id": f"r1-s1-{i}", "source_id": d.id, "source_ids": [d.id], "fold": er.folds.of(d.id),
        "source_folds": [er.folds.of(d.id)], "hops": 1, "question": f"What is {d.title}?", "draft_label": d.title,
        "adopted_label": d.title, "admitted": False, "responses": [], "k": 0, "reward": 0.0, "grader": {}}}
        for i, d in enumerate(docs)])
    out = er.admit(1)
    assert out["candidates"] == 1 and out["generations"] == {"msv": 6}
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "records" / "steps.jsonl").read_text().splitlines()]
    for it in record["items"]:
        adm = it["admission"]
        assert len(adm["with_source"]) == 3 and len(adm["without_source"]) == 3
        both = adm["majority_with"] is not None and adm["majority_without"] is not None
        # the rule: both majorities exist and match (under the loop's matcher); the majority is adopted
        assert it["admitted"] == (both and answers_match(adm["majority_with"], adm["majority_without"]))
        if it["admitted"]:
            assert it["adopted_label"] == adm["majority_with"]
    assert out["admitted"] == sum(it["admitted"] for it in record["items"])


def test_trl_engine_run_on_a_corpus_searched_through_a_retriever_server(smollm2_path, tmp_path, monkeypatch):
    """engine-run on a real corpus with `engine.retriever_url` and no `[data] index`: no index is built here
    (the server answers the searches: it is asked before the run starts), the corpus's documents are
    read from a store on disk made once (`corpus_store`, in selfevo's cache), and the audit is the one
    `evolve` gives a corpus run, the LLM judge over the base model on loopback, reading each item's source
    from that store. Seed 2: the 135M model writes one well-formed proposal (its other three are cut or
    too long), so the judge has items."""
    from _shared import CORPUS, QA_DIR, corpus_served_elsewhere

    from selfevo._io import file_sha256

    config = tmp_path / "corpus-tiny.toml"  # trl-tiny.toml without its world, which a corpus run refuses
    config.write_text(TINY.read_text().replace('[world]\nname = "small"\n', ""))
    out = tmp_path / "run"
    with corpus_served_elsewhere(monkeypatch, tmp_path / "cache") as (url, searched):
        result = CliRunner().invoke(app, ["engine-run", "--engine", "trl", "--config", str(config), "--out", str(out),
                                          "--set", f"data.corpus={CORPUS}", "--set", f"data.qa_dir={QA_DIR}",
                                          "--set", f"engine.retriever_url={url}/retrieve", "--set", "seed=2",
                                          "--set", "lm.judge_max_tokens=64"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["corpus_sha256"] == file_sha256(CORPUS) and manifest["index"] is None
    # the server was asked before anything was written (the probe); the 135M model writes no search of its own
    # at this scale, so the run's searches, through the client to that server, are not exercised here
    assert searched[:1] == ["probe"]
    store = tmp_path / "cache" / "corpora" / file_sha256(CORPUS)
    assert sorted(p.name for p in store.iterdir()) == ["docs.jsonl", "docs.offsets.npy", "sources.json"]
    assert [r["path"] for r in json.loads((store / "sources.json").read_text())] == [str(Path(CORPUS).resolve())]
    items = [it for s in _lines(out / "records/steps.jsonl") for it in s["items"]]
    assert items  # else nothing below is judged
    judge = json.loads((out / "audit" / "judge.json").read_text())
    assert judge["judge"] == json.loads((out / "audit" / "metrics.json").read_text())["judge"] == "llm:smollm2-135m"
    assert judge["summary"]["items"] == len(items) and judge["summary"]["requests"] >= 1
    rows = _lines(out / "audit" / "judgements.jsonl")
    assert [r["source_ids"] for r in rows] == [it["source_ids"] for it in items]

    # `selfevo audit RUN --judge llm` afterwards (a stronger judge, as docs/lm.md says): the run is audited as
    # it ran, its documents read from the store, no index built (it would index all of wiki-18 for a judge
    # that reads a few pages); each item's source reaches the judge
    from selfevo.agents.lm.model import ScriptedModel
    from selfevo.agents.lm.server import make_app as chat_app
    from selfevo.agents.lm.server import running
    from selfevo.corpus import read_corpus

    prompts = []

    def judge_script(messages):
        prompts.append(next(m["content"] for m in messages if m["role"] == "user"))
        return "{}"  # no reference: every item unresolved, which is not what is checked

    with running(chat_app(ScriptedModel(judge_script, name="judge"))) as judge_url:
        result = CliRunner().invoke(app, ["audit", str(out), "--judge", "llm", "--judge-url", judge_url,
                                          "--judge-model", "judge", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "audit" / "llm" / "metrics.json").read_text())["judge"] == "llm:judge"
    text = {d.id: d.text for d in read_corpus(CORPUS) if d.id in {s for it in items for s in it["source_ids"]}}
    assert text and all(any(t[:200] in p for p in prompts) for t in text.values())

    # `selfevo replay build` from the run: its connected groups walk the documents, read from the store (no
    # index built); the bank holds the run's admitted proposal
    from selfevo.replay import build_bank

    bank = build_bank([out], size=10, min_round=1, allow_fewer=True)
    admitted = [it for s in _lines(out / "records/steps.jsonl") if s["kind"] == "proposer"
                for it in s["items"] if it["admitted"]]
    assert admitted and [(it.question, it.source_id) for it in bank.items] == \
        [(it["question"], it["source_id"]) for it in admitted]
