"""Scale-out of the language-model backend: vLLM generation (the mapping to SamplingParams, the
prompts, finish reasons, versioned LoRA exports, the clear errors where vLLM cannot run), Ray
rollout workers (the same greedy answers as one process), `selfevo eval --workers`, and the run
recipes under configs/.

What runs here: the pure mappings; the engine against a stand-in for the `vllm` module (a real
SmolLM2 policy, real peft exports, a fake LLM that records what it is asked); Ray on CPU. The one
test that drives a real vLLM engine skips unless vllm and a CUDA GPU are present."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
from _shared import QA_DIR, REPO

from selfevo.agents.lm.config import LMConfig
from selfevo.agents.lm.protocol import STOP_STRINGS, solver_messages
from selfevo.agents.lm.rl import keep_head, prompt_token_ids
from selfevo.agents.lm.vllm_engine import (
    VLLM_LORA_RANKS,
    VLLMEngine,
    check_vllm,
    finish,
    max_lora_rank,
    sampling_kwargs,
)
from selfevo.agents.lm.workers import shard_bounds
from selfevo.config import ConfigError, config_from_dict, load_config
from selfevo.loop.schedule import derive_seed

# ---------------------------------------------------------------- config


def test_generator_is_validated_and_vllm_needs_lora():
    assert LMConfig().generator == "hf"
    with pytest.raises(ValueError, match=r"^lm\.generator: must be hf or vllm"):
        LMConfig(generator="sglang")
    with pytest.raises(ValueError, match="lm.generator=vllm needs lm.adapter=lora"):
        LMConfig(generator="vllm", adapter="full")
    with pytest.raises(ConfigError, match="lm.generator=vllm needs lm.adapter=lora"):
        config_from_dict({"backend": "lm", "lm": {"generator": "vllm", "adapter": "full"}})
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="lm.vllm_gpu_memory"):
            LMConfig(vllm_gpu_memory=bad)
    assert config_from_dict({"backend": "lm", "lm": {"generator": "vllm"}}).lm.generator == "vllm"


# ---------------------------------------------------------------- pure vLLM mappings


def test_sampling_params_map_greedy_and_seeded_sampling():
    cfg = LMConfig(temperature=0.7, top_p=0.9)
    g = sampling_kwargs(cfg, greedy=True, seed=5, row=0, max_tokens=64, stops=("</search>", "</answer>"))
    assert g == {"n": 1, "max_tokens": 64, "stop": ["</search>", "</answer>"], "include_stop_str_in_output": True,
                 "skip_special_tokens": True, "temperature": 0.0, "top_p": 1.0}  # greedy: no seed, no nucleus
    s = [sampling_kwargs(cfg, greedy=False, seed=5, row=i, max_tokens=32, n=2) for i in range(3)]
    assert [x["temperature"] for x in s] == [0.7] * 3 and [x["top_p"] for x in s] == [0.9] * 3
    assert s[0]["n"] == 2 and s[0]["max_tokens"] == 32 and s[0]["stop"] == list(STOP_STRINGS)
    assert "top_k" not in s[0]  # disabled, as in the HF path (top_k=0)
    # one seed per request, derived from (seed, row): distinct rows differ, the same row repeats
    assert s[1]["seed"] == derive_seed(5, "row", 1) % 2**31
    assert len({x["seed"] for x in s}) == 3
    assert sampling_kwargs(cfg, greedy=False, seed=5, row=1, max_tokens=32)["seed"] == s[1]["seed"]
    assert "seed" not in sampling_kwargs(cfg, greedy=False, seed=None, row=0, max_tokens=8)


def test_finish_keeps_the_prefix_cuts_after_the_stop_and_maps_the_reason():
    assert finish("", "<think>x</think><search> q </search>", "stop") == (
        "<think>x</think><search> q </search>", "stop")
    # a stop string reached by the last budgeted token still stops the action
    assert finish("", "<answer> Paris </answer>", "length") == ("<answer> Paris </answer>", "stop")
    assert finish("", "<think> a long thought", "length") == ("<think> a long thought", "length")
    assert finish("", "no tags, ended at eos", "stop") == ("no tags, ended at eos", "stop")
    # the forced prefix starts the text; generation run past the stop is cut off
    assert finish("<question>", " Who? </question> more", "stop", stops=("</question>", "\n")) == (
        "<question> Who? </question>", "stop")


def test_max_lora_rank_rounds_up_to_a_rank_vllm_accepts():
    assert [max_lora_rank(r) for r in (1, 2, 8, 16, 17, 64, 300)] == [1, 8, 8, 16, 32, 64, 320]
    assert max_lora_rank(512) == 512 and VLLM_LORA_RANKS[-1] == 512
    with pytest.raises(ValueError, match="lm.lora_r"):
        max_lora_rank(513)


def test_an_action_from_a_cut_prompt_trains_on_the_ids_generation_continued(smollm2_path):
    """A cut prompt's action was first trained on the prompt and action tokenized together, the prompt part
    then cut: where a token spans the two ("assistant\\n" + "\\n\\n<answer>" makes "\\n\\n" + "\\n" in
    ChatML), one old token came back that generation had dropped. The training sequence now starts with the
    very ids `prompt_ids` gave the generator, whatever the action's first characters."""
    from transformers import AutoTokenizer

    from selfevo.agents.lm.policy import LMPolicy

    policy = object.__new__(LMPolicy)
    policy.tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    policy.cfg = LMConfig(max_prompt_tokens=300, max_train_tokens=10_000)
    passage = " ".join(f"Passage word {i} about the old tower." for i in range(60))
    chat = solver_messages("Where is the Eiffel Tower, and who built it?")
    for k in range(3):
        chat += [{"role": "assistant", "content": f"<search> tower {k} </search>"},
                 {"role": "user", "content": f"<information>{passage} (end of {k})</information>"}]
    for action in ("\n\n<answer> Paris </answer>", " <answer> Paris </answer>", "<answer> Paris </answer>"):
        conversation = [*chat, {"role": "assistant", "content": action}]
        ids, mask = policy.encode(conversation)[-1]
        seen = policy.prompt_ids([chat], [""])[0]
        assert len(seen) == 300 and ids[:300] == seen and not any(mask[:300]), repr(action)
        assert policy.tokenizer.decode([t for t, m in zip(ids, mask) if m]).strip() == action.strip()


def test_keep_head_keeps_the_head_and_the_newest_tokens():
    ids = list(range(10))
    assert keep_head(ids, 3, 10) == ids and keep_head(ids, 3, 20) == ids  # within the limit: as it is
    assert keep_head(ids, 3, 6) == [0, 1, 2, 7, 8, 9]  # the oldest after the head dropped
    assert keep_head(ids, 0, 6) == [4, 5, 6, 7, 8, 9]  # no head: plain left truncation
    assert keep_head(ids, 6, 6) == keep_head(ids, 8, 6) == [4, 5, 6, 7, 8, 9]  # a head that fills the limit: not kept


def test_a_prompt_over_the_limit_keeps_its_system_prompt_and_question(smollm2_path):
    """Cut from the left, a long search's fifth action was generated without the system prompt and
    the question (4 observations of ~450 tokens and 4 actions pass the default 4,096). Now the cut
    falls after them: the prompt keeps its head and its newest turns, up to the generation prompt.
    Under the limit the ids are the tokenizer's, the HF batch's rows without their padding."""
    from transformers import AutoTokenizer

    from selfevo.agents.lm.policy import LMPolicy

    policy = object.__new__(LMPolicy)  # its tokenizer and config are all prompt_ids reads
    policy.tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    policy.tokenizer.padding_side = "left"
    policy.cfg = LMConfig(max_prompt_tokens=300)
    passage = " ".join(f"Passage word {i} about the tower." for i in range(60))
    long = solver_messages("Where is the Eiffel Tower, and who built it?")
    for k in range(3):
        long += [{"role": "assistant", "content": f"<search> tower {k} </search>"},
                 {"role": "user", "content": f"<information>{passage} (end of {k})</information>"}]
    short = solver_messages("Who wrote Hamlet?")
    ids = policy.prompt_ids([short, long], ["", "<think>"])
    tok = policy.tokenizer
    assert ids[0] == tok(policy.render(short), add_special_tokens=False)["input_ids"]
    batch = tok([policy.render(short), policy.render(short)], padding=True, add_special_tokens=False)
    assert tok.pad({"input_ids": [ids[0]] * 2})["input_ids"] == batch["input_ids"]
    assert len(ids[1]) == 300
    text = tok.decode(ids[1])
    head = tok.apply_chat_template(long[:2], tokenize=False)
    assert text.startswith(head) and text.endswith("<|im_start|>assistant\n<think>")
    assert "(end of 2)" in text and "(end of 0)" not in text  # the newest observation, not the oldest
    cut = prompt_token_ids(tok, [policy.render(long)], 300)[0]  # no head: the plain left cut
    assert len(cut) == 300 and "Eiffel" not in tok.decode(cut)


def test_shard_bounds_are_contiguous_balanced_and_in_order():
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_bounds(2, 4) == [(0, 1), (1, 2)]  # never an empty shard
    assert shard_bounds(0, 2) == []
    for n in range(0, 30):
        for k in range(1, 6):
            b = shard_bounds(n, k)
            assert [x for a, e in b for x in range(a, e)] == list(range(n))
            sizes = [e - a for a, e in b]
            assert not sizes or max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError):
        shard_bounds(3, 0)


# ---------------------------------------------------------------- vLLM missing / no GPU


def _fake_vllm(monkeypatch, llm_calls: list | None = None):
    """A stand-in for the `vllm` package: SamplingParams and LoRARequest record their arguments."""
    vllm = types.ModuleType("vllm")
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")

    class SamplingParams:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    class LoRARequest:
        def __init__(self, lora_name, lora_int_id, lora_path):
            self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path

    vllm.SamplingParams, request.LoRARequest, vllm.lora, lora.request = SamplingParams, LoRARequest, lora, request
    for name, mod in (("vllm", vllm), ("vllm.lora", lora), ("vllm.lora.request", request)):
        monkeypatch.setitem(sys.modules, name, mod)
    return vllm


def test_missing_vllm_is_a_clear_error_naming_lm_generator(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    cfg = LMConfig(generator="vllm")
    with pytest.raises(ValueError, match=r"^lm\.generator: .*vllm package.*lm\.generator = \"hf\""):
        check_vllm(cfg)
    pytest.importorskip("torch")
    from selfevo.agents.lm.policy import LMPolicy

    # the check runs before anything is loaded: a model that does not exist is never looked up
    with pytest.raises(ValueError, match=r"^lm\.generator: "):
        LMPolicy(LMConfig(model="/nonexistent/model", generator="vllm"))


def test_vllm_without_a_cuda_gpu_is_a_clear_error(monkeypatch):
    torch = pytest.importorskip("torch")
    _fake_vllm(monkeypatch)
    with pytest.raises(ValueError, match=r"^lm\.generator: .*CUDA GPU.*lm\.device = \"cpu\""):
        check_vllm(LMConfig(generator="vllm", device="cpu"))
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=1"):
        check_vllm(LMConfig(generator="vllm", device="cuda:1"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^lm\.generator: .*torch sees none"):
        check_vllm(LMConfig(generator="vllm", device="auto"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_vllm(LMConfig(generator="vllm", device="cuda"))  # importable and a GPU: no complaint


# ---------------------------------------------------------------- the engine, with a stand-in LLM


class _Out:
    def __init__(self, text, finish_reason):
        self.outputs = [types.SimpleNamespace(text=text, finish_reason=finish_reason)]


class _FakeLLM:
    """Records each generate call; replies with `reply(prompt_ids, params)` -> (text, finish)."""

    def __init__(self, reply):
        self.reply, self.calls = reply, []

    def generate(self, prompts, params, lora_request=None, use_tqdm=True):
        self.calls.append({"prompts": prompts, "params": params, "lora": lora_request})
        return [_Out(*self.reply(p["prompt_token_ids"], sp)) for p, sp in zip(prompts, params)]


def _adapter_tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "adapter_model.safetensors")


@pytest.mark.slow
def test_engine_serves_each_policy_change_as_a_new_lora_version(smollm2_path, monkeypatch, tmp_path):
    import torch
    from peft import get_peft_model_state_dict

    from selfevo.agents.lm.policy import LMPolicy
    from selfevo.agents.lm.vllm_engine import VLLMEngine

    _fake_vllm(monkeypatch)
    cfg = LMConfig(model=str(smollm2_path), device="cpu", threads=2, lr=1e-3, max_new_tokens=16,
                   max_prompt_tokens=512)
    policy = LMPolicy(cfg)
    llm = _FakeLLM(lambda ids, sp: ("<think>hm</think><search> Hamlet </search> trailing", "stop")
                   if sp.kwargs["max_tokens"] > 4 else ("<think> cut", "length"))
    engine = VLLMEngine(policy, llm=llm, adapter_root=tmp_path / "adapters")
    # generation goes through the engine once lm.generator says vllm (the HF path is untouched)
    policy.cfg, policy._vllm = dataclasses.replace(cfg, generator="vllm"), engine
    convs = [solver_messages("Who wrote Hamlet?"), solver_messages("What is the capital of France?")]

    out = policy.generate(None, convs, greedy=True, seed=None)
    assert out == [("<think>hm</think><search> Hamlet </search>", "stop")] * 2
    call = llm.calls[-1]
    assert call["lora"] is None  # the base model: no adapter
    assert [p["prompt_token_ids"] for p in call["prompts"]] == policy.prompt_ids(convs, ["", ""])
    assert [sp.kwargs for sp in call["params"]] == [
        sampling_kwargs(cfg, greedy=True, seed=None, row=i, max_tokens=16) for i in range(2)]
    # a prefix starts the prompt and the returned text; the budget maps to max_tokens and "length"
    out = policy.generate(None, convs[:1], greedy=False, seed=3, max_new_tokens=2, prefix="<think>")
    assert out == [("<think><think> cut", "length")]
    sp = llm.calls[-1]["params"][0].kwargs
    assert sp["max_tokens"] == 2 and sp["temperature"] == cfg.temperature
    assert sp["seed"] == derive_seed(3, "row", 0) % 2**31
    assert llm.calls[-1]["prompts"][0]["prompt_token_ids"] == policy.prompt_ids(convs[:1], ["<think>"])[0]

    def exported(name):
        state = get_peft_model_state_dict(policy.peft, adapter_name=name)
        return {k: v.detach().clone() for k, v in state.items()}

    # a fresh policy is exported once, and served under the same id until it changes
    policy.new("main")
    policy.generate("main", convs, greedy=True, seed=None)
    first = llm.calls[-1]["lora"]
    assert first.lora_int_id == 1 and first.lora_name == "main#1"
    path1 = Path(first.lora_path)
    config = json.loads((path1 / "adapter_config.json").read_text())
    assert config["r"] == cfg.lora_r and sorted(config["target_modules"]) == sorted(cfg.lora_targets)
    saved = _adapter_tensors(path1)
    want = exported("main")
    assert len(saved) == len(want) > 0
    assert all(torch.equal(saved[k], want[k]) for k in want)
    policy.generate("main", convs, greedy=True, seed=None)
    assert llm.calls[-1]["lora"] is first and engine.exports == 1

    # an update changes the weights: a new version, a new id, the new weights on disk
    seq = policy.encode([*convs[0], {"role": "assistant", "content": "<answer> Shakespeare </answer>"}])
    policy.update("main", [seq], [1.0])
    policy.generate("main", convs, greedy=True, seed=None)
    second = llm.calls[-1]["lora"]
    assert second.lora_int_id == 2 and engine.exports == 2
    saved2, want2 = _adapter_tensors(Path(second.lora_path)), exported("main")
    assert all(torch.equal(saved2[k], want2[k]) for k in want2)
    assert any(not torch.equal(saved2[k], saved[k]) for k in saved)  # the step moved something
    assert not path1.exists()  # the stale version is removed

    # a snapshot (new, like=...) is a policy of its own; replacing it re-exports it
    policy.new("main@frozen", like="main")
    policy.generate("main@frozen", convs[:1], greedy=True, seed=None)
    snap = llm.calls[-1]["lora"]
    assert snap.lora_int_id == 3
    assert all(torch.equal(_adapter_tensors(Path(snap.lora_path))[k], want2[k]) for k in want2)
    policy.update("main", [seq], [1.0])
    policy.new("main@frozen", like="main")  # the next round's grader: same name, new weights
    policy.generate("main@frozen", convs[:1], greedy=True, seed=None)
    assert llm.calls[-1]["lora"].lora_int_id == 4
    # loading a saved policy into a name also counts as a change
    policy.store = tmp_path / "store"
    ref = policy.save("main")
    policy.generate("main", convs[:1], greedy=True, seed=None)
    before = llm.calls[-1]["lora"].lora_int_id
    policy.load("main", ref)
    policy.generate("main", convs[:1], greedy=True, seed=None)
    assert llm.calls[-1]["lora"].lora_int_id == before + 1
    engine.close()


# ---------------------------------------------------------------- a real vLLM engine (GPU only)


def _has_vllm_and_cuda() -> bool:
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.slow
@pytest.mark.skipif(not _has_vllm_and_cuda(), reason="needs the vllm package and a CUDA GPU")
def test_vllm_generation_matches_hf_for_the_base_and_an_updated_adapter(smollm2_path):
    """On a GPU: the vLLM path gives the HF path's greedy actions for the base model and for a
    LoRA policy after training steps (served as a new adapter version), and seeded sampling repeats."""
    from selfevo.agents.lm.policy import LMPolicy

    cfg = LMConfig(model=str(smollm2_path), device="cuda", dtype="bfloat16", generator="vllm", lr=2e-3,
                   max_new_tokens=24, max_prompt_tokens=1024, vllm_gpu_memory=0.3)
    policy = LMPolicy(cfg)

    def hf(name, convs, **kw):  # the same weights through the transformers path
        policy.cfg = dataclasses.replace(cfg, generator="hf")
        try:
            return policy.generate(name, convs, **kw)
        finally:
            policy.cfg = cfg

    questions = ["Who wrote Hamlet?", "What is the capital of France?", "Who painted the Mona Lisa?",
                 "What is the largest planet of the solar system?"]
    convs = [solver_messages(q) for q in questions]
    base_v = policy.generate(None, convs, greedy=True, seed=None)
    base_h = hf(None, convs, greedy=True, seed=None)
    assert sum(a == b for a, b in zip(base_v, base_h)) >= 3, (base_v, base_h)  # bf16 kernels may split a tie
    assert policy.generate(None, convs[:1], greedy=True, seed=None, max_new_tokens=2)[0][1] == "length"

    policy.new("main")
    target = "<think>I know it.</think><answer> Bob Marley </answer>"
    seq = policy.encode([*convs[0], {"role": "assistant", "content": target}])
    for _ in range(40):
        policy.update("main", [seq], [1.0])
    engine = policy._vllm
    trained_v = policy.generate("main", convs, greedy=True, seed=None)
    trained_h = hf("main", convs, greedy=True, seed=None)
    assert engine.exports >= 1
    assert "Bob Marley" in trained_h[0][0]  # the steps took (HF path)
    assert "Bob Marley" in trained_v[0][0]  # and vLLM serves the trained adapter, not a stale one
    assert sum(a == b for a, b in zip(trained_v, trained_h)) >= 3, (trained_v, trained_h)
    first_id = engine.lora_request("main").lora_int_id
    policy.update("main", [seq], [1.0])
    policy.generate("main", convs[:1], greedy=True, seed=None)
    assert engine.lora_request("main").lora_int_id == first_id + 1

    s1 = policy.generate("main", convs, greedy=False, seed=11)
    s2 = policy.generate("main", convs, greedy=False, seed=11)
    assert s1 == s2


# ---------------------------------------------------------------- Ray rollout workers


TINY_DOCS = [
    ("d1", "Hamlet", "Hamlet is a tragedy written by William Shakespeare around 1600."),
    ("d2", "Paris", "Paris is the capital and largest city of France."),
    ("d3", "Mona Lisa", "The Mona Lisa is a portrait painted by Leonardo da Vinci."),
    ("d4", "Jupiter", "Jupiter is the largest planet in the Solar System."),
    ("d5", "Nile", "The Nile is a river in Africa that flows through Egypt and Sudan."),
    ("d6", "Mount Everest", "Mount Everest is Earth's highest mountain above sea level."),
]
# the first one makes SmolLM2 search (greedy), so the workers' own search tools are exercised
QUESTIONS = ["Write <search> Hamlet author </search> first. Who wrote Hamlet?", "What is the capital of France?",
             "Who painted the Mona Lisa?", "Which river flows through Egypt?"]


@pytest.fixture
def tiny_corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": i, "contents": f'"{t}"\n{x}'}) + "\n" for i, t, x in TINY_DOCS))
    return path


@pytest.fixture
def ray_cpu():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.slow
def test_two_ray_workers_answer_exactly_as_one_process(smollm2_path, tiny_corpus, ray_cpu):
    import torch

    from selfevo.agents import load_agent
    from selfevo.agents.lm.agents import LMSolver
    from selfevo.agents.lm.policy import LMPolicy
    from selfevo.agents.lm.workers import RolloutWorkers
    from selfevo.search.bm25 import BM25Index
    from selfevo.search.tool import SearchTool

    options = {"device": "cpu", "threads": 1, "max_new_tokens": 16, "max_actions": 2}
    tool = SearchTool(BM25Index.from_corpus_file(tiny_corpus), topk=2, max_calls=2)
    threads = torch.get_num_threads()
    try:
        local = LMSolver(LMPolicy(LMConfig(model="smollm2-135m", **options)), "lm:smollm2-135m")
        expected = local.answer(QUESTIONS, tool, greedy=True)
    finally:
        torch.set_num_threads(threads)
    # more workers than the cluster's CPUs would wait forever: refused at once
    with pytest.raises(ValueError, match="3 rollout workers need 3 CPUs; the Ray cluster has 2 CPUs"):
        load_agent("lm:smollm2-135m", corpus=tiny_corpus, workers=3, lm_options=options)
    # `selfevo eval --agent lm:smollm2-135m --workers 2` builds exactly this
    workers = load_agent("lm:smollm2-135m", corpus=tiny_corpus, retriever_url=None, workers=2, lm_options=options)
    try:
        assert isinstance(workers, RolloutWorkers) and workers.n_workers == 2
        assert workers.name == "lm:smollm2-135m"
        got = workers.answer(QUESTIONS, tool, greedy=True, n=2)
        assert len(got) == len(QUESTIONS) and all(len(ts) == 2 for ts in got)
        for want, have in zip(expected, got):
            for t in have:
                assert (t.answer, t.searches, t.actions) == (want[0].answer, want[0].searches, want[0].actions)
                assert t.trace.messages == want[0].trace.messages
        # the trajectories really ran the protocol: one or two actions each, a search answered from
        # the worker's own index (its passages are in the conversation compared above)
        assert all(1 <= ts[0].actions <= 2 for ts in got)
        assert got[0][0].searches == ["Hamlet author"]
        assert any("<information>Doc 1 (Title: Hamlet)" in m["content"] for m in got[0][0].trace.messages)
        # the workers refuse a tool whose documents they cannot rebuild
        other = tiny_corpus.parent / "other.jsonl"
        other.write_text(tiny_corpus.read_text().replace("1600", "1601"))
        with pytest.raises(ValueError, match="not the corpus"):
            workers.answer(QUESTIONS[:1], SearchTool(BM25Index.from_corpus_file(other)))
        # a tool over a saved index: the actors open its directory, no corpus needed, nothing rebuilt
        workers.corpus = None
        saved = SearchTool(BM25Index.from_corpus_file(tiny_corpus, index_dir=tiny_corpus.parent / "idx"),
                           topk=2, max_calls=2)
        assert workers._source(saved)[:2] == ("index", str(tiny_corpus.parent / "idx"))
        got = workers.answer(QUESTIONS, saved, greedy=True)
        assert [(t[0].answer, t[0].trace.messages) for t in got] == \
            [(t[0].answer, t[0].trace.messages) for t in expected]
        with pytest.raises(ValueError, match="a retriever URL, a saved index or a corpus file"):
            workers.answer(QUESTIONS[:1], tool)  # held in memory only, and no corpus to rebuild it from
    finally:
        workers.close()


def test_workers_reject_a_policy_they_were_not_given(tmp_path):
    pytest.importorskip("ray")
    from selfevo.agents.lm.workers import RolloutWorkers

    with pytest.raises(ValueError, match="not among the adapters"):
        RolloutWorkers(LMConfig(), 2, policy_name="main")
    with pytest.raises(ValueError, match="no such policy file"):
        RolloutWorkers(LMConfig(), 2, {"main": tmp_path / "missing.safetensors"}, policy_name="main")
    with pytest.raises(ValueError, match="workers: must be >= 1"):
        RolloutWorkers(LMConfig(), 0)


def test_a_local_ray_is_not_started_with_token_authentication_off(monkeypatch):
    """The local Ray `eval --workers` starts listens on every network interface; Ray's token
    authentication is what guards it, so RAY_AUTH_MODE turning it off is refused before Ray starts.
    A cluster joined with RAY_ADDRESS is its owner's to secure."""
    ray = pytest.importorskip("ray")
    from selfevo.agents.lm.workers import RolloutWorkers

    class Started(Exception):
        pass

    started = []

    def init(**kwargs):  # stands in for ray.init: record it, go no further
        started.append(kwargs["address"])
        raise Started

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for mode in ("disabled", "Disabled", ""):  # Ray reads every value but "token" as off
        monkeypatch.setenv("RAY_AUTH_MODE", mode)
        with pytest.raises(ValueError, match=rf"^workers: RAY_AUTH_MODE='{mode}' would start a local Ray without "
                                             "token authentication"):
            RolloutWorkers(LMConfig(), 1)
    assert started == []
    for mode, address in (("token", None), (None, None), ("disabled", "10.0.0.1:6379")):
        if mode is None:
            monkeypatch.delenv("RAY_AUTH_MODE")
        else:
            monkeypatch.setenv("RAY_AUTH_MODE", mode)
        if address:
            monkeypatch.setenv("RAY_ADDRESS", address)
        with pytest.raises(Started):
            RolloutWorkers(LMConfig(), 1)
    assert started == [None, None, "10.0.0.1:6379"]


@contextlib.contextmanager
def _probe_agent(name: str):
    """A registered agent that records the context `selfevo eval` hands its factory."""
    from selfevo import agents
    from selfevo.agents.baseline import RetrievalBaseline

    seen = []

    def probe(arg, **context):
        seen.append(context)
        return RetrievalBaseline()

    agents.register_agent(name, probe)
    try:
        yield seen
    finally:
        agents._REGISTRY.pop(name, None)


def test_eval_workers_option_reaches_the_agent_factory(tmp_path, tiny_corpus):
    from typer.testing import CliRunner

    from selfevo.cli import app

    with _probe_agent("probe-workers") as seen:
        args = ["eval", "--data-dir", str(QA_DIR), "--corpus", str(tiny_corpus), "--agent", "probe-workers",
                "--limit", "1"]
        r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "a"), "--workers", "3"])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "b")])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "c"), "--workers", "-1"])
        assert r.exit_code == 2
    assert seen[0]["workers"] == 3 and seen[0]["corpus"] == tiny_corpus and seen[0]["retriever_url"] is None
    assert "workers" not in seen[1]
    assert len(seen) == 2


def test_eval_lm_set_reaches_the_agent_factory(tmp_path, tiny_corpus):
    """`selfevo eval --lm-set max_new_tokens=128` (README, docs/benchmarks.md) sets an [lm] field for
    the agent; it is not a sim run's [lm] table, which the backend check would refuse."""
    from typer.testing import CliRunner

    from selfevo.cli import app

    with _probe_agent("probe-lm-set") as seen:
        args = ["eval", "--data-dir", str(QA_DIR), "--corpus", str(tiny_corpus), "--agent", "probe-lm-set",
                "--limit", "1"]
        r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "a"), "--lm-set", "max_new_tokens=128",
                                     "--lm-set", 'device="cpu"'])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "b"), "--lm-set", "max_new_tokens=0"])
        assert r.exit_code == 2 and "lm.max_new_tokens" in r.output
    assert len(seen) == 1
    assert seen[0]["lm_options"]["max_new_tokens"] == 128 and seen[0]["lm_options"]["device"] == "cpu"
    # and score.json says so (two evaluations with other --lm-set values wrote score files alike)
    run = json.loads((tmp_path / "a" / "score.json").read_text())["run"]
    assert run["agent_settings"]["lm_options"]["max_new_tokens"] == 128


# ---------------------------------------------------------------- recipes


CONFIGS = sorted([*(REPO / "configs").glob("*.toml"), *(REPO / "configs").glob("verl-*.yaml")])


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path):
    if path.name == "demo.toml":  # a plan ([demo]) around run tables: its own loader
        from selfevo.demo import load_plan

        cfg = load_config(None, load_plan(path).overrides())
    elif path.name.startswith(("trl-", "verl-")):  # run tables plus [engine]: `selfevo engine-run`'s loader
        from selfevo.integrations.engine import load_engine_config

        cfg = load_engine_config(path).run
    else:
        cfg = load_config(path)
    assert cfg.to_json()  # resolvable into the run directory's config.json


@pytest.mark.parametrize("name", ["qwen3.5-4b.toml", "qwen3.5-9b.toml"])
def test_qwen_recipes_follow_the_paper_schedule(name):
    cfg = load_config(REPO / "configs" / name)
    assert cfg.backend == "lm"
    loop, lm = cfg.loop, cfg.lm
    assert (loop.rounds, loop.proposer_steps, loop.solver_steps) == (3, 18, 25)
    assert (loop.admit_per_round, loop.grader_samples) == (1600, 5)
    assert (lm.temperature, lm.top_p, lm.max_actions, lm.max_new_tokens, lm.doc_tokens) == (0.8, 0.95, 5, 512, 256)
    assert (lm.device, lm.dtype, lm.generator, lm.adapter) == ("cuda", "bfloat16", "vllm", "lora")
    assert (cfg.search.topk, cfg.search.max_calls) == (3, 5)
    assert lm.model == {"qwen3.5-4b.toml": "Qwen/Qwen3.5-4B", "qwen3.5-9b.toml": "Qwen/Qwen3.5-9B"}[name]
    # a whole trajectory (five actions and their observations) fits the context the engine is sized for
    assert lm.max_prompt_tokens >= 4096 and lm.max_train_tokens >= lm.max_prompt_tokens
    assert max_lora_rank(lm.lora_r) == lm.lora_r


# ---------------------------------------------------------------- the vLLM engine without a model


def test_local_ray_auth_reads_the_mode_without_case_and_local_as_no_cluster(monkeypatch):
    from selfevo.agents.lm.workers import check_local_ray_auth

    monkeypatch.setenv("RAY_AUTH_MODE", "TOKEN")
    check_local_ray_auth(None)  # Ray reads "TOKEN" as token: no complaint
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(ValueError, match="RAY_AUTH_MODE='disabled'"):
        check_local_ray_auth("local")  # "local" starts one here, as no address does
    check_local_ray_auth("10.0.0.1:6379")  # a cluster's own business


def test_a_ray_address_is_probed_as_host_and_port_only(monkeypatch):
    import socket

    from selfevo.agents.lm.workers import check_ray_address

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}/", f"[127.0.0.1]:{port}"):
            check_ray_address(address)  # something answers there
    for address in (None, "auto", "127.0.0.1:abc", "127.0.0.1"):
        check_ray_address(address)  # left to Ray
    with pytest.raises(ValueError, match=rf"^RAY_ADDRESS=ray://127.0.0.1:{port}: nothing answers at 127.0.0.1:{port}"):
        check_ray_address(f"ray://127.0.0.1:{port}", timeout=1.0)


def test_task_gpus_asks_for_a_gpu_on_cuda_or_where_auto_finds_one_a_task():
    from selfevo.agents.lm.workers import task_gpus

    assert task_gpus("cuda", 0) == task_gpus("cuda:1", 0) == 1
    assert task_gpus("auto", 2, tasks=2) == 1 and task_gpus("auto", 1, tasks=2) == 0
    assert task_gpus("cpu", 8, tasks=2) == 0


def test_workers_too_many_for_the_cluster_are_refused_before_any_actor(monkeypatch):
    ray = pytest.importorskip("ray")
    from selfevo.agents.lm.workers import RolloutWorkers

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 1.0})

    def no_actor(**kw):
        raise AssertionError("no actor may be made")

    monkeypatch.setattr(ray, "remote", no_actor)
    with pytest.raises(ValueError, match=r"^workers: 2 rollout workers need 2 CPUs; the Ray cluster has 1 CPUs"):
        RolloutWorkers(LMConfig(device="cpu"), 2)


class _Actor:
    """A stand-in for a rollout actor: `answer.remote(...)` records its shard and answers it."""

    def __init__(self, calls):
        self.calls = calls
        self.answer = types.SimpleNamespace(remote=self._answer)

    def _answer(self, source, topk, max_calls, policy_name, questions, greedy, n, seed, contexts):
        self.calls.append((questions, seed, contexts))
        return [[f"{q}@{seed}"] for q in questions]


def _stand_in_workers(n_actors, calls):
    from selfevo.agents.lm.workers import RolloutWorkers

    workers = object.__new__(RolloutWorkers)  # no Ray: the sharding over stand-in actors
    workers.policy_name, workers.retriever_url, workers.corpus, workers._corpus_sha = None, None, None, None
    workers._actors = [_Actor(calls) for _ in range(n_actors)]
    workers._source = lambda tool: ("url", "http://x")
    workers._get = lambda refs: list(refs)
    return workers


def test_workers_shard_the_questions_in_order_each_shard_seeded_apart():
    from selfevo.records import Document

    calls = []
    workers = _stand_in_workers(2, calls)
    tool = types.SimpleNamespace(topk=1, max_calls=2)
    got = workers.answer(["a", "b", "c"], tool, greedy=False, n=2, seed=5)
    s0, s1 = derive_seed(5, "shard", 0), derive_seed(5, "shard", 1)
    assert got == [[f"a@{s0}"], [f"b@{s0}"], [f"c@{s1}"]]
    assert [(q, c) for q, _, c in calls] == [(["a", "b"], None), (["c"], None)]
    calls.clear()
    assert workers.answer(["a", "b"], tool, greedy=True) == [["a@None"], ["b@None"]]  # greedy: no seed
    with pytest.raises(ValueError, match="one context per question"):
        workers.answer(["a", "b"], tool, contexts=[Document("d", "T", "x")])
    assert workers.answer([], tool) == []


def test_workers_search_where_the_caller_does(tmp_path):
    from selfevo.agents.lm.workers import RolloutWorkers
    from selfevo.records import Document
    from selfevo.search.bm25 import BM25Index
    from selfevo.search.tool import SearchTool

    workers = object.__new__(RolloutWorkers)
    workers.retriever_url, workers.corpus, workers._corpus_sha = "http://h:8/retrieve/", None, None
    tool = SearchTool(BM25Index.build([Document("d", "T", "x")]), topk=1)
    assert workers._source(tool) == ("url", "http://h:8")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "d", "title": "T", "text": "other"}\n')
    workers.retriever_url, workers.corpus = None, str(corpus)
    with pytest.raises(ValueError, match="is not the corpus the tool's BM25 index was built from"):
        workers._source(tool)


def test_start_ray_keeps_the_commands_sigterm_handler_and_exits_143_for_a_sigterm_while_starting(monkeypatch):
    import signal

    ray = pytest.importorskip("ray")
    from selfevo.agents.lm.workers import start_ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    shut = []
    monkeypatch.setattr(ray, "shutdown", lambda: shut.append(True))

    def ours(signum, frame):  # the command's handler, which Ray's driver would replace
        pass

    def init_replacing_the_handler(**kw):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    previous = signal.signal(signal.SIGTERM, ours)
    try:
        monkeypatch.setattr(ray, "init", init_replacing_the_handler)
        start_ray()
        assert signal.getsignal(signal.SIGTERM) is ours and not shut

        def init_stopped_by_sigterm(**kw):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            raise SystemExit(signal.SIGTERM)  # what Ray's handler does with a SIGTERM during the call

        monkeypatch.setattr(ray, "init", init_stopped_by_sigterm)
        with pytest.raises(SystemExit) as stopped:
            start_ray()
        assert stopped.value.code == 128 + signal.SIGTERM and shut == [True]
        assert signal.getsignal(signal.SIGTERM) is ours

        def init_exiting_otherwise(**kw):
            raise SystemExit(3)

        monkeypatch.setattr(ray, "init", init_exiting_otherwise)
        with pytest.raises(SystemExit) as other:
            start_ray()
        assert other.value.code == 3 and shut == [True]
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------- mutation sweep: the engine without a model


class _FakePeft:
    """peft's save_pretrained of one named adapter: a subdirectory of `out` holding its config."""
    def __init__(self):
        self.saved = []

    def save_pretrained(self, out, selected_adapters, save_embedding_layers):
        [name] = selected_adapters
        (Path(out) / name).mkdir(parents=True)
        (Path(out) / name / "adapter_config.json").write_text("{}")
        self.saved.append(name)


def _stub_policy(**cfg):
    """What VLLMEngine uses of an LMPolicy: its config, revisions, peft model and prompt ids (one id per
    character of the rendered conversation and its prefix)."""
    config = LMConfig(**cfg)

    def prompt_ids(convs, prefixes):
        prompts = ["|".join(m["content"] for m in conv) + p for conv, p in zip(convs, prefixes, strict=True)]
        return prompt_token_ids(lambda p, **kw: {"input_ids": [ord(c) for c in p]}, prompts, config.max_prompt_tokens)

    return types.SimpleNamespace(cfg=config, revision={}, peft=_FakePeft(), prompt_ids=prompt_ids)


def test_engine_generate_caps_the_budget_takes_a_prefix_per_row_and_asks_nothing_for_no_rows(monkeypatch, tmp_path):
    _fake_vllm(monkeypatch)
    llm = _FakeLLM(lambda ids, sp: (" x </search> y", "stop"))
    engine = VLLMEngine(_stub_policy(max_new_tokens=16), llm=llm, adapter_root=tmp_path / "a")
    assert engine.generate(None, [], greedy=True, seed=None) == [] and llm.calls == []
    convs = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    out = engine.generate(None, convs, greedy=True, seed=None, max_new_tokens=10**6, prefix=["<p>", "<q>"])
    assert out == [("<p> x </search>", "stop"), ("<q> x </search>", "stop")]
    call = llm.calls[-1]
    assert [p["prompt_token_ids"] for p in call["prompts"]] == [[ord(c) for c in "a<p>"], [ord(c) for c in "b<q>"]]
    assert [sp.kwargs["max_tokens"] for sp in call["params"]] == [16, 16]  # capped at lm.max_new_tokens
    assert engine.generate(None, convs[:1], greedy=True, seed=None, max_new_tokens=3)[0][0].startswith(" x")
    assert llm.calls[-1]["params"][0].kwargs["max_tokens"] == 3
    assert engine.max_model_len == LMConfig().max_prompt_tokens + 16


def test_engine_exports_a_policy_once_per_revision_and_removes_the_stale_export(monkeypatch, tmp_path):
    _fake_vllm(monkeypatch)
    policy = _stub_policy()
    engine = VLLMEngine(policy, llm=_FakeLLM(lambda ids, sp: ("", "stop")), adapter_root=tmp_path / "a")
    first = engine.lora_request("main")
    assert (first.lora_name, first.lora_int_id) == ("main#1", 1)
    assert first.lora_path == str(tmp_path / "a" / "000001" / "main")
    assert engine.lora_request("main") is first and engine.exports == 1 and policy.peft.saved == ["main"]
    policy.revision["main"] = 1  # an update
    second = engine.lora_request("main")
    assert (second.lora_name, second.lora_int_id, engine.exports) == ("main#2", 2, 2)
    assert not Path(first.lora_path).exists() and Path(second.lora_path).is_dir()
    other = engine.lora_request("main@frozen")  # another policy: its own id, the first one's export kept
    assert other.lora_int_id == 3 and Path(second.lora_path).is_dir()


def test_engine_refuses_a_full_adapter_and_removes_its_own_temporary_exports(monkeypatch):
    _fake_vllm(monkeypatch)
    with pytest.raises(ValueError, match="lm.generator=vllm needs lm.adapter=lora"):
        VLLMEngine(_stub_policy(adapter="full"), llm=_FakeLLM(lambda ids, sp: ("", "stop")))
    engine = VLLMEngine(_stub_policy(), llm=_FakeLLM(lambda ids, sp: ("", "stop")))
    path = Path(engine.lora_request("main").lora_path)
    assert path.is_dir()
    engine.close()
    assert not engine.root.exists()


def test_the_engine_is_built_for_the_base_model_at_a_rank_and_length_vllm_takes(monkeypatch, tmp_path):
    """The vllm.LLM made for a policy: its base model, a max_lora_rank vLLM accepts holding lm.lora_r, and a
    context of lm.max_prompt_tokens + lm.max_new_tokens; cuda:0 is the first visible GPU, so it is taken."""
    import torch


    vllm = _fake_vllm(monkeypatch)
    built = []
    vllm.LLM = lambda **kw: built.append(kw) or "llm"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = tmp_path / "base"
    model.mkdir()
    cfg = LMConfig(model=str(model), device="cuda:0", lora_r=17, max_prompt_tokens=300, max_new_tokens=40,
                   dtype="bfloat16")
    check_vllm(cfg)
    assert VLLMEngine._build_llm(cfg) == "llm"
    [kw] = built
    assert (kw["model"], kw["tokenizer"], kw["dtype"], kw["enable_lora"], kw["max_lora_rank"], kw["max_model_len"],
            kw["gpu_memory_utilization"]) == (str(model), str(model), "bfloat16", True, 32, 340, cfg.vllm_gpu_memory)
