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
        ecfg = load_engine_config(TINY, ["engine.engine=verl", retrieve], engine="verl")
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
        assert it["admitted"] == (adm["majority_with"] is not None and adm["majority_without"] is not None
                                  and it["adopted_label"] == adm["majority_with"])
    assert out["admitted"] == sum(it["admitted"] for it in record["items"])
