"""A review of the language-model backend's pure logic (protocol, rollouts, masks, config): each test
failed on the code before its fix. Fast: no model is loaded."""

from __future__ import annotations

import dataclasses
import math

import jinja2
import pytest

from selfevo.agents.lm import protocol as P
from selfevo.agents.lm.config import LMConfig
from selfevo.agents.lm.rl import append_only, content_spans, encode_conversation, encode_trajectory, trained_spans
from selfevo.agents.lm.rollout import Rollout, run_rollouts
from selfevo.integrations.rewards import extract_answer
from selfevo.integrations.trl_env import SearchRollout
from selfevo.loop.schedule import derive_seed
from selfevo.records import Document
from selfevo.search.bm25 import BM25Index
from selfevo.search.tool import SearchTool

# ---------------------------------------------------------------- nested tags


def test_a_repeated_opening_tag_reads_as_the_innermost_action():
    # a small model that writes the opening tag twice answered "<answer> Paris", which the reward's
    # exact match scored wrong (and Cover-EM right); the loop and the TRL/verl reward read the same
    for text in ("<answer> <answer> Paris </answer>", "<think>t</think><answer>\n<answer>Paris</answer></answer>"):
        assert P.parse_action(text) == P.Action("answer", "Paris")
        assert extract_answer(text) == "Paris"
        assert extract_answer([{"role": "assistant", "content": text}]) == "Paris"
    assert P.parse_action("<search> <search> capital of France </search>") == P.Action("search", "capital of France")
    assert P.parse_proposal("<question> <question> Who? </question> <answer> <answer> Ann </answer>") == ("Who?", "Ann")
    # what held before still holds: the first action, the tag opened last closes, empty is invalid
    assert P.parse_action("<answer> a </answer><answer> b </answer>") == P.Action("answer", "a")
    assert P.parse_action("<search> a <answer> b </answer>") == P.Action("answer", "b")
    assert P.parse_action("<answer> <answer> </answer>").kind == "invalid"


# ---------------------------------------------------------------- masks on a template that is not prefix-stable

# Qwen3's chat template (its assistant branch, without tools): an assistant turn after the last user
# turn is rendered with a <think> block (empty if it has none); one before it without, and with its
# <think> dropped. The rollouts send every observation as a user turn.
QWEN3_LIKE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if not ns.found and message.role == 'user' %}{%- set ns.found = true %}"
    "{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- set content = message.content %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CONVERSATION = [{"role": "system", "content": "S"}, {"role": "user", "content": "Question: who?"},
                {"role": "assistant", "content": "<search> paris mayor </search>"},
                {"role": "user", "content": "<information>Doc 1 (Title: Paris) The mayor is Anne</information>"},
                {"role": "assistant", "content": "<answer> Anne </answer>"}]


# Llama 3's chat template renders each message's content through `| trim`
LLAMA3_LIKE = ("{{- '<|begin_of_text|>' }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + "
               "'<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
               "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
               "{%- endif %}")


class OffsetTokenizer:  # one token a character, offsets as a fast tokenizer gives them
    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        return {"input_ids": [ord(c) for c in text], "offset_mapping": [(i, i + 1) for i in range(len(text))]}


def qwen3_like(messages, add_generation_prompt=False):
    return jinja2.Environment().from_string(QWEN3_LIKE).render(messages=list(messages),
                                                                add_generation_prompt=add_generation_prompt)


def llama3_like(messages, add_generation_prompt=False):
    return jinja2.Environment().from_string(LLAMA3_LIKE).render(messages=list(messages),
                                                                 add_generation_prompt=add_generation_prompt)


def trained_text(ids, mask):
    return "".join(chr(i) for i, m in zip(ids, mask) if m)


def test_a_template_that_rerenders_earlier_turns_trains_each_action_on_the_prompt_it_was_generated_from():
    rendered = [qwen3_like(CONVERSATION[:i + 1]) for i in range(len(CONVERSATION))]
    # one sequence cannot be masked: the first action's span landed 19 characters late, on
    # "<|im_end|>\n<|im_sta" of the observation's turn (TRL's single completion refuses it)
    with pytest.raises(ValueError, match=r"message 2 \(assistant\).*not a prefix"):
        content_spans(rendered, CONVERSATION)
    with pytest.raises(ValueError, match="not a prefix"):
        encode_conversation(OffsetTokenizer(), CONVERSATION, render=qwen3_like)
    # before: a trainable agent refused such a model (Qwen3's template) outright; now one sequence an
    # action, each the exact text generation rendered (template and generation prompt) and the action
    parts = encode_trajectory(OffsetTokenizer(), CONVERSATION, render=qwen3_like,
                              prompt=lambda ms: qwen3_like(ms, add_generation_prompt=True))
    assert [trained_text(*p) for p in parts] == ["<search> paris mayor </search>", "<answer> Anne </answer>"]
    for (ids, mask), k in zip(parts, (2, 4), strict=True):
        first = mask.index(1)
        assert "".join(map(chr, ids[:first])) == qwen3_like(CONVERSATION[:k], add_generation_prompt=True)
        assert len(ids) == first + len(CONVERSATION[k]["content"])
    # the proposer: its last action's <answer> stays untrained
    prop = [*CONVERSATION[:4], {"role": "assistant", "content": "<question> Who? </question> <answer> Anne </answer>"}]
    parts = encode_trajectory(OffsetTokenizer(), prop, mask_final_answer=True, render=qwen3_like,
                              prompt=lambda ms: qwen3_like(ms, add_generation_prompt=True))
    assert [trained_text(*p) for p in parts] == ["<search> paris mayor </search>", "<question> Who? </question> "]


def test_an_action_rendered_otherwise_than_its_generation_prompt_starts_it_is_trained_on_that_prompt():
    # one action after the last user turn: the template renders the chat as a prefix of itself, but
    # writes an empty <think> block before the action, which generation never showed the model
    one = CONVERSATION[:3]
    rendered = [qwen3_like(one[:i + 1]) for i in range(3)]
    content_spans(rendered, one)  # no error: whole-chat masking would train the action after "<think>\n\n</think>"
    [(ids, mask)] = encode_trajectory(OffsetTokenizer(), one, render=qwen3_like,
                                      prompt=lambda ms: qwen3_like(ms, add_generation_prompt=True))
    assert "".join(map(chr, ids[:mask.index(1)])).endswith("<|im_start|>user\nQuestion: who?<|im_end|>\n"
                                                           "<|im_start|>assistant\n")
    assert trained_text(ids, mask) == "<search> paris mayor </search>"


def test_a_prefix_stable_template_is_one_sequence_as_before():
    def chatml(ms, add_generation_prompt=False):
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in ms) + (
            "<|im_start|>assistant\n" if add_generation_prompt else "")

    for final in (False, True):
        parts = encode_trajectory(OffsetTokenizer(), CONVERSATION, final, render=chatml,
                                  prompt=lambda ms: chatml(ms, add_generation_prompt=True))
        assert parts == [encode_conversation(OffsetTokenizer(), CONVERSATION, final, render=chatml)]


def test_an_action_a_trimming_template_renders_without_its_outer_whitespace_is_trained_as_generated():
    # Llama 3's template renders each message `| trim`: the whole chat is prefix-stable and each action
    # follows its generation prompt, but " <search>" was generated, not "<search>" (another first token)
    conversation = [*CONVERSATION[:2], {"role": "assistant", "content": " <search> paris mayor </search>"}]
    parts = encode_trajectory(OffsetTokenizer(), conversation, render=llama3_like,
                              prompt=lambda ms: llama3_like(ms, add_generation_prompt=True))
    # before: one sequence, "<search> paris mayor </search>" trained right after the prompt
    assert ["".join(map(chr, ids)) for ids, _ in parts] == [
        llama3_like(conversation[:2], True) + conversation[2]["content"]]
    assert [trained_text(*p) for p in parts] == [" <search> paris mayor </search>"]
    # an action without outer whitespace is rendered as generated: one sequence, as before
    plain = [*CONVERSATION[:2], {"role": "assistant", "content": "<search> paris mayor </search>"}]
    assert encode_trajectory(OffsetTokenizer(), plain, render=llama3_like,
                             prompt=lambda ms: llama3_like(ms, add_generation_prompt=True)) == [
        encode_conversation(OffsetTokenizer(), plain, render=llama3_like)]


def test_a_prefix_stable_template_still_masks_exactly_the_actions():
    def chatml(ms):
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in ms)

    rendered = [chatml(CONVERSATION[:i + 1]) for i in range(len(CONVERSATION))]
    spans = trained_spans(CONVERSATION, content_spans(rendered, CONVERSATION))
    assert [rendered[-1][a:b] for a, b in spans] == ["<search> paris mayor </search>", "<answer> Anne </answer>"]
    # an empty message is no span and no error
    empty = [*CONVERSATION[:2], {"role": "assistant", "content": ""}]
    assert content_spans([chatml(empty[:i + 1]) for i in range(3)], empty)[2][0] == len(chatml(empty))


def chatml(ms, add_generation_prompt=False):
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in ms) + (
        "<|im_start|>assistant\n" if add_generation_prompt else "")


@pytest.mark.parametrize("template", [qwen3_like, llama3_like, chatml], ids=["qwen3", "llama3", "chatml"])
def test_the_append_only_rendering_holds_each_action_right_after_what_it_was_generated_from(template):
    """TRL takes one completion a trajectory, so its engine refused a template that re-renders earlier
    turns (Qwen3's, the paper's models') and trained a trimming template's (Llama 3's) action without
    its outer whitespace. It now generates and trains on the append-only rendering (`rl.append_only`)."""
    render = append_only(template)
    chat = [*CONVERSATION[:2], {"role": "assistant", "content": " <think>t</think><search> paris mayor </search>"},
            *CONVERSATION[3:], {"role": "user", "content": "late note"}, {"role": "assistant", "content": "x "}]
    whole = render(chat)
    for k, m in enumerate(chat):
        assert whole.startswith(render(chat[:k + 1]))  # prefix-stable by construction
        if m["role"] == "assistant":  # each action verbatim, right after the text generation rendered
            assert whole.startswith(render(chat[:k], True) + m["content"])
    assert render(chat[:2], True) == template(chat[:2], True)  # the prompt is the template's own
    ids, mask = encode_conversation(OffsetTokenizer(), chat, render=render)  # before: "not a prefix" (qwen3)
    assert trained_text(ids, mask) == "".join(m["content"] for m in chat if m["role"] == "assistant")
    if template is chatml:  # a prefix-stable template renders as it did
        assert all(render(chat[:k], gen) == chatml(chat[:k], gen) for k in range(len(chat) + 1) for gen in (0, 1))


def test_the_trl_rollout_encodes_a_qwen3_like_template_as_generated():
    from selfevo.integrations.trl_env import SearchRollout

    class QwenLikeTokenizer(OffsetTokenizer):
        eos_token_id = ord("\x04")  # in no text here: the completion runs to the end

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            return qwen3_like(messages, add_generation_prompt)

    tool = SearchTool(BM25Index.build([Document("d1", "Paris", "The mayor is Anne.")]), topk=1, max_calls=2)
    replies = iter([("<think>who?</think><search> paris mayor </search>", "stop"), ("<answer> Anne </answer>", "stop")])
    ro = SearchRollout(tool, role="solver", max_actions=3)
    prompt = CONVERSATION[:2]
    [rollout] = ro.rollouts([prompt], lambda convs, seed: [next(replies)], seed=0)
    out = ro.encode(QwenLikeTokenizer(), [prompt], [rollout])  # before: ValueError, "not a prefix"
    prompt_text = "".join(map(chr, out["prompt_ids"][0]))
    assert prompt_text == qwen3_like(prompt, add_generation_prompt=True)
    completion = "".join(map(chr, out["completion_ids"][0]))
    assert completion.startswith("<think>who?</think><search> paris mayor </search><|im_end|>\n<|im_start|>user\n")
    assert trained_text(out["completion_ids"][0], out["env_mask"][0]) == (
        "<think>who?</think><search> paris mayor </search><answer> Anne </answer>")
    # an action whose text the template writes too ("\n", an invalid action of a small model) is placed
    # where it was generated; found by searching, it was placed in the template's close after it, and the
    # prompt took the action and that close
    replies = iter([("\n", "stop"), ("<answer> Anne </answer>", "stop")])
    [rollout] = ro.rollouts([prompt], lambda convs, seed: [next(replies)], seed=0)
    out = ro.encode(QwenLikeTokenizer(), [prompt], [rollout])
    assert "".join(map(chr, out["prompt_ids"][0])) == qwen3_like(prompt, add_generation_prompt=True)
    assert trained_text(out["completion_ids"][0], out["env_mask"][0]) == "\n<answer> Anne </answer>"
    assert "".join(map(chr, out["completion_ids"][0])).startswith("\n<|im_end|>\n<|im_start|>user\n")
    # a rollout the backend failed before any action: its prompt with the generation prompt, as for any
    # other (before: without it), and one untrained end-of-turn token
    [rollout] = ro.rollouts([prompt], lambda convs, seed: [("", "error")], seed=0)
    out = ro.encode(QwenLikeTokenizer(), [prompt], [rollout])
    assert "".join(map(chr, out["prompt_ids"][0])) == qwen3_like(prompt, add_generation_prompt=True)
    assert (out["completion_ids"][0], out["env_mask"][0]) == ([QwenLikeTokenizer.eos_token_id], [0])


# ---------------------------------------------------------------- the rollouts' searches


class CountingRetriever:
    def __init__(self, index):
        self.index, self.calls = index, []

    def retrieve(self, queries, topk):
        self.calls.append(list(queries))
        return self.index.retrieve(queries, topk)


@pytest.fixture
def index():
    docs = [Document("d1", "Hamlet", "Hamlet is a tragedy by Shakespeare."),
            Document("d2", "Paris", "Paris is the capital of France."),
            Document("d3", "Nile", "The Nile flows through Cairo.")]
    return BM25Index.build(docs)


def test_the_searches_of_a_turn_go_to_the_retriever_as_one_batch(index):
    retriever = CountingRetriever(index)
    tool = SearchTool(retriever, topk=1, max_calls=2)
    queries = {"a": "capital of France", "b": "Nile Cairo", "c": "Hamlet tragedy"}

    def generate(convs, seed):
        return [(f"<search> {queries[c[1]['content'][-1]]} </search>", "stop") for c in convs]

    ros = run_rollouts([P.solver_messages(f"q {k}") for k in queries], tool, generate, max_actions=3)
    # before: one retriever call a query (one HTTP request each to a /retrieve server): 6 calls
    assert len(retriever.calls) == 1 and sorted(retriever.calls[0]) == sorted(queries.values())
    for ro, q in zip(ros, queries.values()):
        # the budget of 2 searches a trajectory holds as before: the repeated query is served from the
        # cache, the third is refused
        assert ro.searches == [q, q] and ro.actions == 3
        # the third search is the last allowed action: nothing follows it, not even the budget note
        assert ro.messages[-1] == {"role": "assistant", "content": f"<search> {q} </search>"}
        assert len(ro.read) == 2 and ro.messages[3]["content"].startswith("<information>Doc 1 (Title: ")
    assert tool.calls == 6 and tool.queries_issued == 3


def test_a_zero_search_budget_refuses_every_search(index):
    tool = SearchTool(CountingRetriever(index), topk=1, max_calls=0)
    [ro] = run_rollouts([P.solver_messages("q")], tool, lambda convs, s: [("<search> Nile </search>", "stop")],
                        max_actions=2)
    assert ro.searches == [] and ro.read == [] and tool.retriever.calls == []
    assert [m["content"] for m in ro.messages[2:]] == ["<search> Nile </search>", P.BUDGET_SPENT,
                                                       "<search> Nile </search>"]  # no note after the last


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("device", ["cuda0", "cuda:", "cuda:x", "cudafoo", "cuda:1 "])
def test_a_malformed_cuda_device_is_refused_by_name(device):
    # before: any string starting "cuda" passed, and torch raised "Invalid device string" on a GPU machine
    with pytest.raises(ValueError, match=r"^lm\.device: "):
        LMConfig(device=device)


def test_well_formed_devices_pass():
    for device in ("auto", "cpu", "cuda", "cuda:0", "cuda:12"):
        assert LMConfig(device=device).device == device


# ---------------------------------------------------------------- the local generator's finish reason


class CharTokenizer:
    """A character tokenizer with a pad token (0) that is not EOS (1), as Qwen's tokenizers have."""

    pad_token_id, eos_token_id = 0, 1

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        return text + ("[assistant]" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        return {"input_ids": [ord(c) for c in text], "offset_mapping": [(i, i + 1) for i in range(len(text))]}

    def pad(self, encoded, return_tensors=None):  # on the left, as LMPolicy sets its tokenizer's padding_side
        import torch

        class Encoding(dict):
            def to(self, device):
                return self

        ids = encoded["input_ids"]
        width = max(map(len, ids))
        return Encoding({"input_ids": torch.tensor([[0] * (width - len(r)) + r for r in ids]),
                         "attention_mask": torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])})

    def decode(self, row, skip_special_tokens=False):
        return "".join(chr(int(i)) for i in row if int(i) > 1)


class ScriptedModel:
    """`generate` appends each row's scripted reply (EOS, pads) to its prompt."""

    def __init__(self, replies):
        self.replies = replies

    def generate(self, input_ids, attention_mask=None, max_new_tokens=None, **_):
        import torch

        width = max(map(len, self.replies))
        assert width <= max_new_tokens
        new = torch.tensor([r + [0] * (width - len(r)) for r in self.replies])
        return torch.cat([input_ids, new], dim=1)


def test_an_action_generated_from_a_cut_prompt_is_trained_on_that_cut_prompt():
    """An action whose prompt was over `lm.max_prompt_tokens` was sampled from the prompt `prompt_ids` cut
    (head kept, oldest turns after it dropped). It was trained on the whole context: tokens the model
    never saw when it chose the action. Now its sequence is the cut prompt followed by the action."""
    from selfevo.agents.lm.policy import LMPolicy

    chat = P.solver_messages("Where is Beta?")
    chat += [{"role": "assistant", "content": "<search> Beta </search>"},
             {"role": "user", "content": "<information>" + "old passage " * 20 + "</information>"},
             {"role": "assistant", "content": "<search> Beta city </search>"},
             {"role": "user", "content": "<information>Beta is a city by the sea.</information>"},
             {"role": "assistant", "content": "<answer> the sea </answer>"}]
    policy = object.__new__(LMPolicy)
    policy.tokenizer = CharTokenizer()
    head = len(policy.render(chat[:2])) - len("[assistant]")
    policy.cfg = LMConfig(max_prompt_tokens=10_000, max_train_tokens=100_000)
    [(whole, whole_mask)] = policy.encode(chat)  # under the limit: one sequence, as before
    limit = head + 120  # the first action's prompt fits, the last two's do not
    policy.cfg = LMConfig(max_prompt_tokens=limit, max_train_tokens=100_000)
    parts = policy.encode(chat)
    assert len(parts) == 3
    for k, (ids, mask) in zip((2, 4, 6), parts, strict=True):
        seen = policy.prompt_ids([chat[:k]], [""])[0]  # what generation continued
        action = [ord(c) for c in chat[k]["content"]]
        assert ids == seen + action and mask == [0] * len(seen) + [1] * len(action)
    assert len(parts[0][0]) - len(chat[2]["content"]) < limit  # not cut
    assert len(parts[2][0]) == limit + len(chat[6]["content"])  # cut to the limit, its head kept
    assert "".join(map(chr, parts[2][0])).startswith(policy.render(chat[:2])[:head])
    assert "old passage" not in "".join(map(chr, parts[2][0]))
    assert sum(m for _, mask in parts for m in mask) == sum(whole_mask)  # every action trained, once


def test_a_reply_that_ends_with_eos_on_its_last_allowed_token_is_a_stop():
    from selfevo.agents.lm.policy import LMPolicy

    budget = 16
    at_budget = [ord(c) for c in "<answer> Paris"]
    at_budget += [ord(" ")] * (budget - 1 - len(at_budget)) + [CharTokenizer.eos_token_id]  # EOS is token 16
    replies = [at_budget, [ord(c) for c in "<answer> Rome"] + [1],  # EOS early: padded after it
               [ord("x")] * budget]  # no EOS: cut short
    policy = object.__new__(LMPolicy)  # no model to load: the generation loop over a scripted model
    policy.cfg, policy.tokenizer = LMConfig(adapter="full", max_new_tokens=budget), CharTokenizer()
    policy.device = "cpu"
    policy.base, policy.full = ScriptedModel(replies), {}
    out = policy.generate(None, [P.solver_messages(q) for q in "abc"], greedy=True, seed=None)
    # before: the first was "length" (16 tokens that are not the pad token), and the rollout read its
    # answer as an invalid action
    assert [f for _, f in out] == ["stop", "stop", "length"]
    index = BM25Index.build([Document("d1", "Paris", "Paris is the capital of France.")])
    replies[:] = [at_budget]
    [ro] = run_rollouts([P.solver_messages("q")], SearchTool(index),
                        lambda convs, s: policy.generate(None, convs, greedy=True, seed=s), max_actions=1)
    assert ro.answer == "Paris" and not ro.truncated


def test_nothing_is_said_after_the_last_allowed_action(index):
    """An invalid last action got the corrective message, and a search past the budget on the last
    action the budget-spent note: user turns nobody reads, kept in the trajectory (and in TRL's
    completion, as environment tokens)."""
    tool = SearchTool(CountingRetriever(index), topk=1, max_calls=1)
    replies = iter(["no tags", "<search> Nile </search>", "<search> Cairo </search>", "no tags either"])
    [ro] = run_rollouts([P.solver_messages("q")], tool, lambda convs, s: [(next(replies), "stop")], max_actions=4)
    assert [m["role"] for m in ro.messages[2:]] == ["assistant", "user"] * 3 + ["assistant"]
    assert [m["content"] for m in ro.messages[3::2]] == [P.CORRECTIVE, ro.messages[5]["content"], P.BUDGET_SPENT]
    assert ro.invalid == 2 and ro.actions == 4  # the last invalid action still counts
    replies = iter(["<search> Nile </search>", "<search> Cairo </search>"])
    [ro] = run_rollouts([P.solver_messages("q")], SearchTool(CountingRetriever(index), topk=1, max_calls=1),
                        lambda convs, s: [(next(replies), "stop")], max_actions=2)
    assert ro.messages[-1] == {"role": "assistant", "content": "<search> Cairo </search>"}


def test_the_token_count_of_sampled_replies_that_end_early():
    """n > 1 samples come back padded to the longest row, and where the pad is the EOS token: a row
    that ended at EOS counts its EOS once; one a stop string ended counts up to the stop string, the
    padding after it not taken for an EOS (it was: one token too many); one out of budget is "length".
    A model and tokenizer standing in for transformers' (their ids are what the count is of)."""
    import threading
    from types import SimpleNamespace

    import torch

    from selfevo.agents.lm.model import TransformersChatModel

    words = {1: "a", 2: "b", 3: ".", 4: "c"}  # 0: EOS and pad

    class Tokenizer:
        pad_token_id = eos_token_id = 0

        def apply_chat_template(self, messages, **kw):
            return "prompt"

        def __call__(self, text, **kw):
            ids = torch.tensor([[7, 8, 9]])
            return SimpleNamespace(to=lambda device: {"input_ids": ids, "attention_mask": torch.ones_like(ids)})

        def decode(self, ids, skip_special_tokens=True):
            return "".join(words.get(int(i), "") for i in ids)

    rows = [[1, 2, 3, 0, 0], [1, 0, 0, 0, 0], [1, 2, 4, 1, 2]]  # stop string, EOS, out of budget
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=100),
                            generate=lambda **kw: torch.tensor([[7, 8, 9, *r] for r in rows]))
    m = TransformersChatModel.__new__(TransformersChatModel)
    m.tokenizer, m.model, m.device, m.max_new_tokens, m.max_seconds = Tokenizer(), model, "cpu", 5, None
    m._lock = threading.Lock()
    got = m.generate([{"role": "user", "content": "q"}], temperature=1.0, max_tokens=5, n=3, stop=["."])
    assert [(c.text, c.finish_reason, c.completion_tokens, c.stop_reason) for c in got] == [
        ("ab", "stop", 3, "."), ("a", "stop", 2, None), ("abcab", "length", 5, None)]


# ---------------------------------------------------------------- mutation sweep: encoding edges


def test_an_empty_action_does_not_split_a_prefix_stable_chat():
    # an action the model ended at once ("" before EOS) is no training sequence of its own
    chat = [*CONVERSATION[:2], {"role": "assistant", "content": ""}, {"role": "user", "content": P.CORRECTIVE},
            {"role": "assistant", "content": "<answer> Anne </answer>"}]
    parts = encode_trajectory(OffsetTokenizer(), chat, render=chatml, prompt=lambda ms: chatml(ms, True))
    assert parts == [encode_conversation(OffsetTokenizer(), chat, render=chatml)]
    assert trained_text(*parts[0]) == "<answer> Anne </answer>"


def test_one_action_rendered_otherwise_than_generated_splits_the_whole_trajectory():
    # the first action's outer whitespace is trimmed away by the template, the second's is not: every
    # action must sit in the chat as generated for one sequence, else one sequence an action
    chat = [*CONVERSATION[:2], {"role": "assistant", "content": " <search> paris mayor </search>"}, *CONVERSATION[3:]]
    parts = encode_trajectory(OffsetTokenizer(), chat, render=llama3_like,
                              prompt=lambda ms: llama3_like(ms, add_generation_prompt=True))
    assert [trained_text(*p) for p in parts] == [" <search> paris mayor </search>", "<answer> Anne </answer>"]


def test_append_only_refuses_a_template_that_rewrites_an_actions_text():
    def shouting(ms, add_generation_prompt=False):
        text = "".join(f"[{m['role']}]{m['content'].upper()}" for m in ms)
        return text + ("[assistant]" if add_generation_prompt else "")

    with pytest.raises(ValueError, match="does not render an assistant turn's content as given"):
        append_only(shouting)(CONVERSATION)


# ---------------------------------------------------------------- mutation sweep: the local generator


class RecordingModel(ScriptedModel):
    """A `ScriptedModel` that records the token budget and the torch seed of each call."""

    def __init__(self, replies):
        super().__init__(replies)
        self.budgets, self.seeds = [], []

    def generate(self, input_ids, attention_mask=None, max_new_tokens=None, **kw):
        import torch

        self.budgets.append(max_new_tokens)
        self.seeds.append(torch.initial_seed())
        return super().generate(input_ids, attention_mask, max_new_tokens, **kw)


def _scripted_policy(replies, **cfg):
    from selfevo.agents.lm.policy import LMPolicy

    policy = object.__new__(LMPolicy)  # no model to load: the generation loop over a scripted model
    policy.cfg, policy.tokenizer, policy.device = LMConfig(adapter="full", **cfg), CharTokenizer(), "cpu"
    policy.base, policy.full = RecordingModel(replies), {}
    return policy


def test_a_reply_cut_at_a_stop_string_or_ending_on_one_at_the_budget_is_a_stop():
    ran_past = [ord(c) for c in "<answer>P</answer>xyz"]  # 21 tokens, the whole budget, no EOS
    policy = _scripted_policy([ran_past], max_new_tokens=len(ran_past))
    [(text, finish)] = policy.generate(None, [P.solver_messages("q")], greedy=True, seed=None)
    assert (text, finish) == ("<answer>P</answer>", "stop")
    exact = [ord(c) for c in "<answer>P</answer>"]  # the stop string on the last allowed token
    policy = _scripted_policy([exact], max_new_tokens=len(exact))
    assert policy.generate(None, [P.solver_messages("q")], greedy=True, seed=None) == [("<answer>P</answer>", "stop")]


def test_a_call_budget_and_prefix_and_each_batch_seed_reach_the_model():
    from selfevo.loop.schedule import derive_seed

    reply = [ord(c) for c in " Who?"]
    policy = _scripted_policy([reply], max_new_tokens=64, gen_batch=1)
    out = policy.generate(None, [P.solver_messages("a"), P.solver_messages("b")], greedy=False, seed=9,
                          max_new_tokens=5, prefix=["<question>", "<q2>"], stops=("</question>",))
    # the call's budget, not lm.max_new_tokens: 5 tokens without a stop are cut at the limit
    assert policy.base.budgets == [5, 5] and [f for _, f in out] == ["length", "length"]
    assert [t for t, _ in out] == ["<question> Who?", "<q2> Who?"]  # each reply starts with its prefix
    # each batch of gen_batch rows samples with a seed of its own
    assert policy.base.seeds == [derive_seed(9, "chunk", k) % 2**63 for k in (0, 1)]


def test_a_policy_file_header_is_canonical():
    import json

    import torch
    from safetensors.torch import load, save

    from selfevo.agents.lm.policy import canonical_safetensors

    blob = save({"param.b": torch.zeros(3), "param.a": torch.ones(2)}, metadata={"steps": "1", "adapter": "lora"})
    n = int.from_bytes(blob[:8], "little")
    # the same content with its header's keys in reverse order (as safetensors may write it)
    header = json.loads(blob[8:8 + n])
    reordered = json.dumps({k: header[k] for k in reversed(sorted(header))}).encode()
    reordered += b" " * (-len(reordered) % 8)
    other = len(reordered).to_bytes(8, "little") + reordered + blob[8 + n:]
    canon = canonical_safetensors(blob)
    assert canonical_safetensors(other) == canon == canonical_safetensors(canon)
    m = int.from_bytes(canon[:8], "little")
    assert m % 8 == 0  # safetensors' own alignment of the data that follows
    assert list(json.loads(canon[8:8 + m])) == sorted(header)
    got = load(canon)
    assert torch.equal(got["param.a"], torch.ones(2)) and torch.equal(got["param.b"], torch.zeros(3))


def test_resolve_device_picks_cpu_without_a_gpu_and_refuses_cuda(monkeypatch):
    import torch

    from selfevo.agents.lm.policy import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match=r"lm\.device: cuda:1 asked for, but no CUDA GPU"):
        resolve_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:1") == "cuda:1"


# ---------------------------------------------------------------- mutation sweep: the LM agents over a stand-in policy


class StandInPolicy:
    """What LMSolver and LMProposer ask of an `LMPolicy`, recorded: no model is loaded."""

    def __init__(self, reply="<answer> Paris </answer>", **cfg):
        from selfevo.agents.lm.config import LMConfig

        self.cfg, self.reply = LMConfig(**cfg), reply
        self.new_calls, self.generated, self.encoded, self.updates = [], [], [], []

    def new(self, name, like=None):
        self.new_calls.append((name, like))

    def truncate(self, text, n):
        return text[:n]  # a character a token

    def generate(self, name, convs, greedy, seed, **kw):
        self.generated.append({"name": name, "convs": [list(c) for c in convs], "greedy": greedy, "seed": seed})
        return [(self.reply, "stop") for _ in convs]

    def encode(self, messages, mask_final_answer=False):
        self.encoded.append(mask_final_answer)
        return [([1, 2], [0, 1])]

    def update(self, name, seqs, advs):
        self.updates.append((name, list(advs)))
        return {"loss": 0.0}


def _paris_tool():
    return SearchTool(BM25Index.build([Document("d1", "Paris", "Paris is the capital of France.")]), topk=1)


def test_a_greedy_solver_generates_once_a_question_and_repeats_it_n_times():
    from selfevo.agents.lm.agents import LMSolver

    policy = StandInPolicy()
    [trajs] = LMSolver(policy, "s", policy_name="p").answer(["Where?"], _paris_tool(), greedy=True, n=3, seed=4)
    assert len(trajs) == 3 and {t.answer for t in trajs} == {"Paris"}
    [call] = policy.generated
    assert len(call["convs"]) == 1 and call["greedy"] and call["seed"] is None and call["name"] == "p"
    # sampled: n rollouts a question, seeded (seed None samples as seed 0, reproducibly)
    policy = StandInPolicy()
    [trajs] = LMSolver(policy, "s", policy_name="p").answer(["Where?"], _paris_tool(), greedy=False, n=3)
    [call] = policy.generated
    assert len(trajs) == 3 and len(call["convs"]) == 3 and not call["greedy"]
    assert call["seed"] == derive_seed(0, "turn", 0)


def test_a_solver_refuses_contexts_that_do_not_line_up_and_truncates_each_to_doc_tokens():
    from selfevo.agents.lm.agents import LMSolver

    policy = StandInPolicy(doc_tokens=5)
    solver = LMSolver(policy, "s", policy_name="p")
    docs = [Document("d1", "Alpha", "Alpha is a river.")]
    with pytest.raises(ValueError, match="one context per question"):
        solver.answer(["a", "b"], _paris_tool(), contexts=docs)
    solver.answer(["a"], _paris_tool(), contexts=docs)
    user = policy.generated[0]["convs"][0][1]["content"]
    assert user.startswith(f"<document>\n{docs[0].contents[:5]}\n</document>\n")


def test_frozen_agents_refuse_to_train():
    from selfevo.agents.lm.agents import LMProposer, LMSolver

    policy = StandInPolicy()
    with pytest.raises(RuntimeError, match="frozen snapshot"):
        LMSolver(policy, "s@frozen", policy_name="x", frozen=True).update([])
    proposer = LMProposer(policy, "proposer", [Document("d", "T", "Alpha.")], frozen=True)
    with pytest.raises(RuntimeError, match="frozen snapshot"):
        proposer.update([], [])
    assert policy.updates == []
    with pytest.raises(ValueError, match="at least one source document"):
        LMProposer(policy, "proposer", [])


def test_the_proposer_without_search_has_one_action_and_its_lineage_starts_at_its_source():
    from selfevo.agents.lm.agents import LMProposer

    doc = Document("d", "T", "Alpha is a river.")
    policy = StandInPolicy(reply="<search> Paris </search>", proposer_search=False, max_actions=4)
    [p] = LMProposer(policy, "proposer", [doc]).propose(1, _paris_tool(), seed=3)
    assert len(policy.generated) == 1 and p.format_error == "no final question"
    assert policy.generated[0]["seed"] == derive_seed(derive_seed(3, "proposer"), "turn", 0)
    assert p.trace.read == [] and p.source_ids == ("d",)
    # with search: the pages read follow the source, which comes first
    policy = StandInPolicy(reply="<search> Paris </search>", max_actions=2)
    [p] = LMProposer(policy, "proposer", [doc]).propose(1, _paris_tool(), seed=3)
    assert p.source_ids == ("d", "d1")


def test_the_proposer_trains_within_hop_buckets_without_its_final_answer_and_counts_the_malformed():
    from selfevo.agents.lm.agents import LMProposer
    from selfevo.algos import bucket_advantages

    doc = Document("d", "T", "Alpha is a river.")
    policy = StandInPolicy(reply="<question> Who? </question> <answer> Ann </answer>")
    proposer = LMProposer(policy, "proposer", [doc])
    proposals = proposer.propose(4, _paris_tool(), seed=1)
    proposals[0] = dataclasses.replace(proposals[0], format_error="long answer")
    rewards = [1.0, 0.0, 0.5, 0.25]
    stats = proposer.update(proposals, rewards)
    assert policy.encoded == [True] * 4
    assert policy.updates == [("proposer", bucket_advantages(rewards, [p.hops for p in proposals]))]
    assert stats["malformed"] == 1 and stats["reward"] == pytest.approx(0.4375)
    # its frozen snapshot copies it
    proposer.snapshot()
    assert policy.new_calls[-1] == ("proposer@frozen", "proposer")


# ---------------------------------------------------------------- mutation sweep: LMPolicy on a tiny random model


class TinyChatTokenizer(CharTokenizer):
    """`CharTokenizer` with ChatML, offsets for the training masks, and transformers' truncation and
    padding sides (the policy sets both): what LMPolicy's training, checkpoint and truncation paths use."""

    padding_side = truncation_side = "right"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return chatml(messages, add_generation_prompt)

    def __call__(self, texts, return_tensors=None, padding=False, add_special_tokens=False, truncation=False,
                 max_length=None, return_offsets_mapping=False):
        if isinstance(texts, str):  # one text: ids and offsets, as a fast tokenizer gives them
            return {"input_ids": [ord(c) for c in texts], "offset_mapping": [(i, i + 1) for i in range(len(texts))]}
        if truncation and max_length is not None:
            texts = [t[-max_length:] if self.truncation_side == "left" else t[:max_length] for t in texts]
        if self.padding_side == "left":
            return super().__call__(texts)
        enc = super().__call__([t[::-1] for t in texts])  # padded on the right: the mirror image
        return type(enc)({k: v.flip(1) for k, v in enc.items()})

    def decode(self, row, skip_special_tokens=False):
        return "".join(chr(int(i)) for i in row if int(i) > 1 or not skip_special_tokens)


def _tiny_policy(monkeypatch, store=None, seed=0, **cfg):
    """An LMPolicy (its own __init__) whose `load_pretrained` gives a one-layer random Llama over
    `TinyChatTokenizer`'s 128 ids: a step or a save takes milliseconds."""
    pytest.importorskip("peft")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from selfevo.agents.lm import policy as policy_module

    def load(path, dtype, model=None):  # a base of its own for every policy (peft wraps it in place)
        torch.manual_seed(0)  # the same weights every call
        return TinyChatTokenizer(), LlamaForCausalLM(LlamaConfig(
            vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=2))

    monkeypatch.setattr(policy_module, "load_pretrained", load)
    return policy_module.LMPolicy(LMConfig(**{"model": "org/tiny-llama", "device": "cpu", "lr": 1e-2, **cfg}),
                                  store=store, seed=seed)


def _seq(text, trained_from=1):
    """One training sequence: `text`'s ids, trained from position `trained_from` on."""
    ids = [ord(c) for c in text]
    return [(ids, [0] * trained_from + [1] * (len(ids) - trained_from))]


def _weights(policy, name):
    return {n: p.detach().clone() for n, p in policy.parameters(name)}


def _same(a, b):
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_a_zero_advantage_trains_nothing_and_leaves_the_optimizer_without_state(monkeypatch):
    policy = _tiny_policy(monkeypatch)
    policy.new("p")
    stats = policy.update("p", [_seq("abcdef")], [0.0])
    assert (stats["trained_sequences"], stats["trained_rows"], stats["trained_tokens"]) == (0, 0, 0)
    assert stats["sequences"] == 1 and stats["grad_norm"] == 0.0 and policy.optimizers["p"].state == {}
    assert policy.steps["p"] == 1  # a step all the same


def test_the_loss_is_equation_1_over_the_trajectories_trained_tokens(monkeypatch):
    """-(1/G) Σ A_i · mean log π over the tokens trained (position 0 has no log-probability and is not
    counted, even where its mask is set); G counts every trajectory, a zero advantage included."""
    policy = _tiny_policy(monkeypatch)
    policy.new("p")
    a, b = _seq("hello world", trained_from=0), _seq("xyz", trained_from=1)
    la = policy.sequence_logprob("p", a)
    stats = policy.update("p", [a, b], [2.0, 0.0])
    assert stats["loss"] == pytest.approx(-2.0 * la / 2, rel=1e-5)
    assert (stats["trained_sequences"], stats["trained_tokens"]) == (1, len("hello world") - 1)
    # a mask that trains position 0 alone trains nothing
    policy.new("q")
    assert policy.update("q", [[([97, 98], [1, 0])]], [1.0])["trained_sequences"] == 0


def test_sequence_logprob_is_the_mean_over_its_trained_tokens(monkeypatch):
    import torch

    from selfevo.agents.lm.rl import token_logprobs

    policy = _tiny_policy(monkeypatch)
    ids = [ord(c) for c in "abc"]
    with torch.no_grad():
        lp = token_logprobs(policy.base(input_ids=torch.tensor([ids])).logits, torch.tensor([ids]))[0]
    # one trained token (the last): its log-probability, not half of it
    assert policy.sequence_logprob(None, [(ids, [0, 0, 1])]) == pytest.approx(float(lp[1]), rel=1e-5)
    assert policy.sequence_logprob(None, [(ids, [0, 1, 1])]) == pytest.approx(float(lp.mean()), rel=1e-5)
    assert policy.sequence_logprob(None, [(ids, [0, 0, 0])]) == 0.0


def test_encode_cuts_each_sequence_at_max_train_tokens(monkeypatch):
    policy = _tiny_policy(monkeypatch, max_train_tokens=40)
    chat = [*P.solver_messages("Who wrote Hamlet?"), {"role": "assistant", "content": "<answer> Shakespeare </answer>"}]
    [(ids, mask)] = policy.encode(chat)
    assert len(ids) == len(mask) == 40 and ids == [ord(c) for c in chatml(chat)][:40]


def test_truncate_keeps_a_text_within_the_budget_as_it_is(monkeypatch):
    policy = _tiny_policy(monkeypatch)
    lossy = TinyChatTokenizer()
    lossy.decode = lambda ids, skip_special_tokens=False: "".join(chr(i) for i in ids).strip()  # as a real one may
    policy.tokenizer = lossy
    assert policy.truncate(" Alpha ", 7) == " Alpha " and policy.truncate(" Alpha ", 8) == " Alpha "
    assert policy.truncate(" Alpha ", 6) == "Alpha"


def test_an_over_long_prompt_loses_its_oldest_turns_and_rows_are_padded_on_the_left(monkeypatch):
    policy = _tiny_policy(monkeypatch, adapter="full", max_prompt_tokens=60, max_new_tokens=4)
    seen = []

    class Recording(ScriptedModel):
        def generate(self, input_ids, **kw):
            seen.extend("".join(chr(int(i)) for i in row) for row in input_ids)
            return super().generate(input_ids, **kw)

    policy.base = Recording([[ord("x"), 1]] * 2)
    long = [{"role": "user", "content": "old " * 50 + "new"}]
    policy.generate(None, [[{"role": "user", "content": "q"}], long], greedy=True, seed=None)
    # every row ends where its reply starts; the long one keeps its last 60 characters
    assert seen[0] == chatml([{"role": "user", "content": "q"}], True).rjust(60, chr(0))
    assert seen[1] == chatml(long, True)[-60:]


def test_a_prefix_may_be_a_tuple_of_one_a_row():
    policy = _scripted_policy([[ord(c) for c in " Who?"], [ord(c) for c in " Why?"]], max_new_tokens=8)
    out = policy.generate(None, [P.solver_messages("a"), P.solver_messages("b")], greedy=True, seed=None,
                          prefix=("<q1>", "<q2>"))
    assert [t for t, _ in out] == ["<q1> Who?", "<q2> Why?"]


def test_an_adapter_is_initialised_by_its_name_whatever_was_made_before(monkeypatch):
    policy = _tiny_policy(monkeypatch)
    policy.new("one")
    policy.new("two")
    first, two = _weights(policy, "one"), _weights(policy, "two")
    assert not _same(first, two)  # another name, another initialisation
    policy.drop("one")
    policy.new("one")  # made again after "two": the same adapter
    assert _same(_weights(policy, "one"), first)


def test_each_step_draws_its_dropout_from_the_policy_and_the_step(monkeypatch):
    import torch

    from selfevo.loop.schedule import derive_seed

    policy = _tiny_policy(monkeypatch, lora_dropout=0.5, seed=3)
    policy.new("p")
    seeds = []
    hook = policy.peft.register_forward_pre_hook(lambda *a: seeds.append(torch.initial_seed()))
    try:
        for _ in range(2):
            policy.update("p", [_seq("abcdef")], [1.0])
    finally:
        hook.remove()
    assert seeds == [derive_seed(3, "dropout", "p", step) % 2**63 for step in (0, 1)]


def test_an_update_leaves_the_policy_in_eval_mode(monkeypatch):
    policy = _tiny_policy(monkeypatch, lora_dropout=0.5)
    policy.new("p")
    policy.update("p", [_seq("abcdef")], [1.0])
    policy.update("p", [_seq("abcdef")], [1.0])
    seq = _seq("abcdef")
    assert policy.sequence_logprob("p", seq) == policy.sequence_logprob("p", seq)  # no dropout outside training
    assert not policy.peft.training
    assert all(p.grad is None for _, p in policy.parameters("p"))  # no gradient kept between steps


def test_a_step_clips_the_gradient_to_max_grad_norm(monkeypatch):
    import torch

    policy = _tiny_policy(monkeypatch, max_grad_norm=1e-3)
    policy.new("p")
    stats = policy.update("p", [_seq("abcdef")], [1.0])
    assert stats["grad_norm"] > 1e-2  # reported before clipping
    # AdamW's first moment after one step is (1 - 0.9) times the gradient it was given: the clipped one
    moments = [st["exp_avg"] for st in policy.optimizers["p"].state.values()]
    assert float(torch.linalg.vector_norm(torch.cat([m.flatten() for m in moments]))) == pytest.approx(1e-4, rel=1e-3)


def test_full_fine_tuning_trains_the_policys_copy_alone(monkeypatch):
    policy = _tiny_policy(monkeypatch, adapter="full")
    policy.new("p")
    base, before = _weights(policy, "p"), policy.sequence_logprob(None, _seq("abcdef"))
    policy.update("p", [_seq("abcdef")], [1.0])
    assert not _same(_weights(policy, "p"), base) and policy.sequence_logprob("p", _seq("abcdef")) > before
    assert policy.sequence_logprob(None, _seq("abcdef")) == before  # the base model stays as it was


def test_a_snapshot_copies_and_a_replaced_policy_starts_afresh(monkeypatch, tmp_path):
    policy = _tiny_policy(monkeypatch, store=tmp_path)
    policy.new("p")
    fresh = policy.save("p")
    for _ in range(2):
        policy.update("p", [_seq("abcdef")], [1.0])
    trained = policy.save("p")
    policy.new("p@copy", like="p")
    assert _same(_weights(policy, "p@copy"), _weights(policy, "p"))
    policy.new("p")  # replaced: a fresh adapter, no steps, no optimizer; saved as the fresh file again
    assert policy.steps.get("p", 0) == 0 and "p" not in policy.optimizers
    assert policy.save("p") == fresh != trained
    before = _weights(policy, "p")
    policy.update("p", [_seq("abcdef")], [1.0])  # its new optimizer trains the new adapter
    assert not _same(_weights(policy, "p"), before)


def test_save_names_the_file_without_at_and_records_steps_and_optimizer(monkeypatch, tmp_path):
    import json

    policy = _tiny_policy(monkeypatch, store=tmp_path)
    policy.new("s@r1")
    ref = policy.save("s@r1")
    assert ref["file"].startswith("s_r1-") and "@" not in ref["file"] and ref["steps"] == 0
    blob = (tmp_path / ref["file"]).read_bytes()
    meta = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])["__metadata__"]
    assert (meta["model"], meta["has_optimizer"], meta["steps"]) == ("tiny-llama", "False", "0")
    policy.update("s@r1", [_seq("abcdef")], [1.0])
    ref = policy.save("s@r1")
    ref["steps"] = 99  # the caller's copy
    assert policy.save("s@r1")["steps"] == 1


def test_a_checkpoint_round_trip_restores_weights_moments_and_steps(monkeypatch, tmp_path):
    policy = _tiny_policy(monkeypatch, store=tmp_path)
    policy.new("p")
    for _ in range(2):
        policy.update("p", [_seq("abcdef")], [1.0])
    ref = policy.save("p")
    assert ref["steps"] == 2
    other = _tiny_policy(monkeypatch, store=tmp_path)
    other.load("p", ref)
    assert other.steps["p"] == 2 and _same(_weights(other, "p"), _weights(policy, "p"))
    assert other.save("p") == ref  # the same weights, moments and steps: the same file
    for p in (policy, other):
        p.update("p", [_seq("xyzzy")], [-1.0])
    assert _same(_weights(other, "p"), _weights(policy, "p"))  # the restored moments take the same step
    # the file's hash is checked
    with pytest.raises(ValueError, match="checksum mismatch"):
        other.load("p", dict(ref, sha256="0" * 64))


def test_a_policy_loaded_back_to_an_earlier_file_saves_as_that_file(monkeypatch, tmp_path):
    policy = _tiny_policy(monkeypatch, store=tmp_path)
    policy.new("p")
    untrained = policy.save("p")  # no optimizer yet
    policy.update("p", [_seq("abcdef")], [1.0])
    trained = policy.save("p")
    assert trained != untrained
    policy.load("p", untrained)  # its optimizer (and moments) go: the file had none
    assert "p" not in policy.optimizers and policy.save("p") == untrained
    policy.load("p", trained)
    assert policy.save("p") == trained
    # a save whose file was removed from the store writes it again
    (tmp_path / trained["file"]).unlink()
    assert policy.save("p") == trained and (tmp_path / trained["file"]).exists()


def test_a_policy_whose_update_trained_nothing_saves_again_as_the_same_file(monkeypatch, tmp_path):
    policy = _tiny_policy(monkeypatch, store=tmp_path)
    policy.new("p")
    policy.update("p", [_seq("abcdef")], [0.0])  # an optimizer with no state
    ref = policy.save("p")
    other = _tiny_policy(monkeypatch, store=tmp_path)
    other.load("p", ref)
    assert "p" in other.optimizers and other.save("p") == ref


def test_a_policy_file_of_other_settings_is_refused_naming_the_field(monkeypatch, tmp_path):
    import re

    from safetensors.torch import load, save

    policy = _tiny_policy(monkeypatch, store=tmp_path)
    policy.new("p")
    path = tmp_path / policy.save("p")["file"]
    for setting, field, there, here in ((dict(lora_alpha=16), "lora_alpha", "32", "16"),
                                        (dict(lora_r=8), "lora_r", "16", "8")):
        other = _tiny_policy(monkeypatch, **setting)
        with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: .*lm\.{field}: '{there}' in the file, "
                                             rf"'{here}' here"):
            other.load_file("evaluated", path)
    # the targets' order is not a setting: a file saved under one order loads under another
    _tiny_policy(monkeypatch, lora_targets=("v_proj", "o_proj", "k_proj", "q_proj")).load_file("evaluated", path)
    # files saved before the settings were recorded: the names and shapes are checked instead
    tensors = load(path.read_bytes())
    old = tmp_path / "old.safetensors"
    old.write_bytes(save(tensors, metadata={"adapter": "lora", "steps": "0", "has_optimizer": "False"}))
    with pytest.raises(ValueError, match=r"another shape .*lm\.lora_r"):
        _tiny_policy(monkeypatch, lora_r=8).load_file("evaluated", old)
    old.write_bytes(save({k: v for k, v in tensors.items() if "q_proj" not in k}, metadata={"adapter": "lora"}))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(old))}: .*parameters missing \(e\.g\. .*q_proj"):
        _tiny_policy(monkeypatch).load_file("evaluated", old)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path / 'gone'))}: cannot read the policy file"):
        policy.load_file("evaluated", tmp_path / "gone")
    for content, why in ((b"not a safetensors file", "not a safetensors policy file"),
                         (save({"junk": tensors[next(iter(tensors))]}), "not a selfevo policy file")):
        old.write_bytes(content)
        with pytest.raises(ValueError, match=rf"^{re.escape(str(old))}: {why}"):
            policy.load_file("evaluated", old)
    assert "evaluated" not in policy.names()  # refused before anything was made


def test_an_lm_agent_with_a_policy_file_is_that_policy_frozen(monkeypatch, tmp_path):
    """`selfevo eval --agent lm:MODEL@FILE` (README: a run's checkpoints/tensors/main-*.safetensors):
    the agent is a frozen solver generating from the policy in the file, not from the base model (a
    solver generates from its policy_name: test_a_greedy_solver_generates_once_a_question...)."""
    import torch

    from selfevo.agents import load_agent
    from selfevo.agents.lm.agents import LMSolver

    trained = _tiny_policy(monkeypatch, store=tmp_path)
    trained.new("main")
    for _ in range(3):
        trained.update("main", [_seq("abcdefgh")], [1.0])
    path = tmp_path / trained.save("main")["file"]
    agent = load_agent(f"lm:org/tiny-llama@{path}", lm_options={"device": "cpu"})
    assert isinstance(agent, LMSolver) and agent.name == f"lm:org/tiny-llama@{path}"
    assert agent.policy_name == "evaluated" and agent.policy.names() == ["evaluated"]
    want, got = _weights(trained, "main"), _weights(agent.policy, "evaluated")
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)
    assert any(w.abs().max() > 0 for n, w in want.items() if "lora_B" in n)  # trained: not the zero init
    with pytest.raises(RuntimeError, match="frozen"):
        agent.update([])
    base = load_agent("lm:org/tiny-llama", lm_options={"device": "cpu"})
    assert base.policy_name is None and base.name == "lm:org/tiny-llama" and base.policy.names() == []


def test_a_solver_snapshot_keeps_its_own_lineage_and_a_state_without_one_loads_as_none():
    from selfevo.agents.lm.agents import LMSolver

    class Loading(StandInPolicy):
        def load(self, name, ref):
            self.loaded = (name, ref)

    policy = Loading()
    solver = LMSolver(policy, "main", policy_name="main", lineage={"trained_on": {"folds": [0]}})
    snap = solver.snapshot()
    solver.lineage["trained_on"]["folds"].append(1)  # the solver trains on
    assert snap.lineage == {"trained_on": {"folds": [0]}} and snap.frozen and snap.policy_name == "main@frozen"
    solver.load_state_dict({"name": "main", "policy": {"file": "f"}, "updates": 3})  # saved before lineage was
    assert (solver.updates, solver.lineage, policy.loaded) == (3, {}, ("main", {"file": "f"}))


def test_the_proposer_samples_from_the_first_doc_tokens_of_its_source():
    from selfevo.agents.lm.agents import LMProposer

    doc = Document("d", "T", "Alpha is a river in Beta.")
    policy = StandInPolicy(reply="<question> Who? </question> <answer> Ann </answer>", doc_tokens=5)
    LMProposer(policy, "proposer", [doc]).propose(2, _paris_tool(), seed=1)
    [call] = policy.generated
    assert call["name"] == "proposer" and call["greedy"] is False  # sampled: a group of distinct proposals
    head = doc.contents[:5]
    assert all(c[1]["content"].startswith(f"<document>\n{head}\n</document>\n") for c in call["convs"])


class _ChatmlTokenizer(OffsetTokenizer):  # chatml, one token a character; EOS is ">" (so "<|im_end|>" ends a turn)
    eos_token_id = ord(">")

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return chatml(messages, add_generation_prompt)


def _mayor_tool():
    return SearchTool(BM25Index.build([Document("d1", "Paris", "The mayor is Anne.")]), topk=1, max_calls=2)


def test_the_trl_rollout_refuses_an_unknown_role_or_backend_and_a_scaffold_off_hf():
    """SearchRollout's settings are checked when it is made, each error naming the setting. Mutants: each
    check dropped (trl_env.py:56, :58, :60)."""
    tool = _mayor_tool()
    with pytest.raises(ValueError, match=r"^SearchRollout\.role: solver or proposer, got 'grader'"):
        SearchRollout(tool, role="grader")
    with pytest.raises(ValueError, match=r"^SearchRollout\.backend: hf or vllm, got 'sglang'"):
        SearchRollout(tool, backend="sglang")
    with pytest.raises(ValueError, match="the proposer scaffold needs backend='hf'"):
        SearchRollout(tool, role="proposer", scaffold=True, backend="vllm")
    assert SearchRollout(tool, role="proposer", scaffold=True).calls == 0  # hf: fine


def test_the_trl_rollout_forwards_each_page_read_once_and_ends_at_the_last_actions_end_of_turn():
    """`read` (the proposal's lineage, for the reward) holds each page once, in the order the searches
    first returned it, with the answer and final action beside it; the completion ends at the last
    action's end of turn (the template's "\\n" after it is not trained on or scored), while one that ends
    on an observation keeps it whole. Mutants: duplicates kept (trl_env.py:113); the completion not cut at
    its last EOS (trl_env.py:103)."""
    ro = Rollout(list(CONVERSATION), answer="Anne", final="<answer> Anne </answer>", read=["d2", "d1", "d2", "d1"])
    out = SearchRollout(_mayor_tool()).encode(_ChatmlTokenizer(), [CONVERSATION[:2]], [ro])
    assert out["read"] == [["d2", "d1"]] and out["answer"] == ["Anne"] and out["final"] == ["<answer> Anne </answer>"]
    assert "".join(map(chr, out["prompt_ids"][0])) == chatml(CONVERSATION[:2], True)
    completion = "".join(map(chr, out["completion_ids"][0]))
    assert completion == chatml(CONVERSATION)[len(chatml(CONVERSATION[:2], True)):].removesuffix("\n")
    assert len(out["env_mask"][0]) == len(out["completion_ids"][0])
    assert trained_text(out["completion_ids"][0], out["env_mask"][0]) == (
        "<search> paris mayor </search><answer> Anne </answer>")
    unanswered = Rollout(list(CONVERSATION[:4]))  # the last turn is an observation
    out = SearchRollout(_mayor_tool()).encode(_ChatmlTokenizer(), [CONVERSATION[:2]], [unanswered])
    assert "".join(map(chr, out["completion_ids"][0])).endswith("</information><|im_end|>\n")


def test_the_trl_proposer_rollout_reads_its_reply_as_a_proposal_and_never_trains_its_answer():
    """The proposer's rollout reads its final reply with the proposer's parser (the whole proposal is what
    the reward parses, not the <answer> alone), and its final <answer> span is not trained
    (`trained_spans(mask_final_answer=True)`). Mutants: the solver's parser for the proposer
    (trl_env.py:83); the final answer trained (trl_env.py:88)."""
    text = "<question> Who is the mayor of Paris? </question> <answer> Anne </answer>"
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "doc"}]
    prop = SearchRollout(_mayor_tool(), role="proposer")
    (ro,) = prop.rollouts([prompt], lambda cs, seed: [(text, "stop") for _ in cs], seed=0)
    assert ro.answer == ro.final == text
    out = prop.encode(_ChatmlTokenizer(), [prompt], [ro])
    assert out["answer"] == [text]
    assert trained_text(out["completion_ids"][0], out["env_mask"][0]) == (
        "<question> Who is the mayor of Paris? </question> ")


def test_the_trl_vllm_backend_generates_from_the_generation_prompt_and_reads_each_finish():
    """backend = vllm: each conversation goes to TRL's colocated engine as the append-only rendering with
    its generation prompt; a reply is cut after its first stop string, and it stopped when it held one or
    ended in EOS, else it ran out of tokens. Mutants: the reply not cut (trl_env.py:180); EOS not read as a
    stop (trl_env.py:182); rendered without the generation prompt (trl_env.py:175); the hf generator for
    backend = vllm (trl_env.py:119)."""
    from types import SimpleNamespace

    eos = 4

    class Tok(OffsetTokenizer):
        eos_token_id = eos

        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(i) for i in ids if not (skip_special_tokens and i == eos))

    sent = []
    replies = ["<search> a </search> and on", "<answer> b", "<answer> c"]

    def generate(prompts, images, num_generations):
        sent.extend(prompts)
        return None, [[ord(c) for c in r] + ([eos] if i == 1 else []) for i, r in enumerate(replies)], None, None
    trainer = SimpleNamespace(vllm_generation=SimpleNamespace(generate=generate))
    tool = SearchTool(BM25Index.build([Document("d1", "Paris", "The mayor is Anne.")]), topk=1, max_calls=2)
    render = append_only(chatml)
    gen = SearchRollout(tool, backend="vllm")._generator(trainer, Tok(), render)
    convs = [CONVERSATION[:2]] * 3
    assert gen(convs, 0) == [("<search> a </search>", "stop"), ("<answer> b", "stop"), ("<answer> c", "length")]
    assert ["".join(map(chr, p)) for p in sent] == [chatml(CONVERSATION[:2], True)] * 3


@pytest.mark.parametrize("settings, field", [
    ({"model": "  "}, "model"), ({"adapter": "qlora"}, "adapter"), ({"dtype": "fp8"}, "dtype"),
    ({"judge_max_tokens": 0}, "judge_max_tokens"), ({"lora_alpha": 0}, "lora_alpha"), ({"threads": -1}, "threads"),
    ({"lora_dropout": 1.0}, "lora_dropout"), ({"max_grad_norm": 0.0}, "max_grad_norm"),
    ({"temperature": 2.01}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"format_penalty": -0.1}, "format_penalty"),
    ({"lora_targets": ()}, "lora_targets"), ({"generator": "sglang"}, "generator"),
    ({"generator": "vllm", "adapter": "full"}, "generator"), ({"vllm_gpu_memory": 1.0}, "vllm_gpu_memory"),
])
def test_each_lm_setting_out_of_range_is_refused_by_name(settings, field):
    """Each [lm] check refuses by itself, naming its field. Mutants: each check dropped or its bound moved
    (config.py:49-98)."""
    with pytest.raises(ValueError, match=rf"^lm\.{field}: "):
        LMConfig(**settings)


def test_each_lm_setting_at_its_bound_passes():
    """The bounds themselves: threads 0 (torch's default), temperature 2, top_p 1, no format penalty, a
    LoRA dropout of 0."""
    cfg = LMConfig(threads=0, temperature=2.0, top_p=1.0, format_penalty=0.0, lora_dropout=0.0, vllm_gpu_memory=0.99)
    assert (cfg.threads, cfg.temperature, cfg.top_p, cfg.format_penalty) == (0, 2.0, 1.0, 0.0)


def test_the_scaffolded_proposer_never_searches():
    """The scaffold writes the reply at once: the proposer does not search, whatever lm.proposer_search says.
    Mutant: proposer_searches = proposer_search (config.py:104)."""
    assert LMConfig().proposer_searches and not LMConfig(proposer_search=False).proposer_searches
    assert not LMConfig(proposer_scaffold=True).proposer_searches


@pytest.mark.parametrize("field", ["lr", "max_grad_norm", "format_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_an_lm_setting_built_in_python_as_nan_or_inf_is_refused(field, value):
    """load_config refuses a non-finite number before it builds LMConfig; a Python caller building LMConfig
    itself gets the same refusal from the check of the field (nan passed `< 0` and `> 0` tests as written)."""
    with pytest.raises(ValueError, match=rf"^lm\.{field}: must be a finite number"):
        LMConfig(**{field: value})


@pytest.mark.parametrize("settings", [{"lora_r": 2.5}, {"threads": True}, {"max_new_tokens": 64.0}])
def test_an_lm_count_built_in_python_must_be_an_integer(settings):
    """A count given as a float or a bool (True is an int to Python) is refused by name, as load_config
    refuses it in a config file."""
    (field, value), = settings.items()
    with pytest.raises(ValueError, match=rf"^lm\.{field}: must be an integer, got {value!r}$"):
        LMConfig(**settings)


# ------------------------------------------------ pinned by a mutation sweep (forty-sixth session): the update path


def test_a_micro_batch_of_rows_of_other_lengths_trains_each_on_its_own_tokens(monkeypatch):
    """Rows of different lengths share a micro-batch (lm.train_batch): the padding is neither trained nor
    counted, and each row is read where its own tokens are, so the loss is Equation (1) over each alone."""
    policy = _tiny_policy(monkeypatch)
    policy.new("p")
    long, short = _seq("hello world"), _seq("xyz")
    la, ls = policy.sequence_logprob("p", long), policy.sequence_logprob("p", short)
    stats = policy.update("p", [long, short], [1.0, -1.0])
    assert stats["trained_rows"] == 2 and stats["trained_tokens"] == len("hello world") - 1 + len("xyz") - 1
    assert stats["loss"] == pytest.approx(-(1.0 * la - 1.0 * ls) / 2, rel=1e-5)


def test_a_trajectory_of_several_sequences_is_one_mean_over_all_its_trained_tokens(monkeypatch):
    """One trajectory trained one sequence an action (`encode_trajectory`'s fallback): each row is divided by
    the trajectory's trained tokens, not its own, so the rows sum to the trajectory's mean (Equation (1)); a
    row with nothing to train (only position 0 set) takes no forward pass."""
    policy = _tiny_policy(monkeypatch, train_batch=1)  # each row a micro-batch of its own: their losses add up
    policy.new("p")
    trajectory = _seq("abcdefgh") + _seq("xyz") + [([97, 98, 99], [1, 0, 0])]  # 7 + 2 + 0 trained tokens
    mean = policy.sequence_logprob("p", trajectory)
    stats = policy.update("p", [trajectory], [1.0])
    assert (stats["trained_sequences"], stats["trained_rows"], stats["sequences"]) == (1, 2, 1)
    assert stats["loss"] == pytest.approx(-mean, rel=1e-5)


def test_an_update_refuses_advantages_that_do_not_line_up_with_the_trajectories(monkeypatch):
    policy = _tiny_policy(monkeypatch)
    policy.new("p")
    with pytest.raises(ValueError):
        policy.update("p", [_seq("abcdef"), _seq("xyz")], [1.0])


def test_the_optimizer_is_adamw_without_weight_decay_and_its_betas(monkeypatch):
    """A fresh LoRA adapter's B is zero, so its A gets no gradient at the first step: without weight decay A
    does not move. AdamW's second moment after one step is (1 - 0.999) g², its first (1 - 0.9) g."""
    import torch

    policy = _tiny_policy(monkeypatch, max_grad_norm=1e6)
    policy.new("p")
    before = _weights(policy, "p")
    policy.update("p", [_seq("abcdef")], [1.0])
    after = _weights(policy, "p")
    a_keys = [k for k in before if "lora_A" in k]
    assert a_keys and all(torch.equal(before[k], after[k]) for k in a_keys)
    assert not all(torch.equal(before[k], after[k]) for k in before)  # B moved
    for st in policy.optimizers["p"].state.values():
        g = st["exp_avg"] / (1 - 0.9)
        assert torch.allclose(st["exp_avg_sq"], (1 - 0.999) * g * g, rtol=1e-4, atol=1e-12)


def test_an_update_runs_the_policy_in_training_mode(monkeypatch):
    # lm.lora_dropout applies only in training mode: the forward of an update must see it
    policy = _tiny_policy(monkeypatch, lora_dropout=0.5)
    policy.new("p")
    modes = []
    hook = policy.peft.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    try:
        for _ in range(2):  # the second after the first left it in eval mode
            policy.update("p", [_seq("abcdef")], [1.0])
        policy.sequence_logprob("p", _seq("abcdef"))
    finally:
        hook.remove()
    assert modes == [True, True, False]


def test_an_update_leaves_the_callers_random_state_as_it_was(monkeypatch):
    import torch

    policy = _tiny_policy(monkeypatch, lora_dropout=0.5)
    policy.new("p")
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    policy.update("p", [_seq("abcdef")], [1.0])
    assert torch.equal(torch.rand(3), expected)


def test_a_policy_file_of_another_base_model_or_adapter_kind_is_refused_naming_the_field(monkeypatch, tmp_path):
    import re

    policy = _tiny_policy(monkeypatch, store=tmp_path)
    policy.new("p")
    path = tmp_path / policy.save("p")["file"]
    other = _tiny_policy(monkeypatch, model="org/other-llama")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: .*lm\.model: 'tiny-llama' in the file, "
                                         r"'other-llama' here"):
        other.load_file("evaluated", path)
    full = _tiny_policy(monkeypatch, adapter="full")
    with pytest.raises(ValueError, match=r"lm\.adapter: 'lora' in the file, 'full' here"):
        full.load_file("evaluated", path)


# ------------------------------------------------ pinned by a mutation sweep (forty-sixth session): rollouts


def test_a_conversation_the_backend_failed_ends_at_once_unanswered_and_leaves_the_batch(index):
    sizes = []

    def generate(convs, seed):
        sizes.append(len(convs))
        return [("", "error") if "a" in c[1]["content"] else ("<search> Nile </search>", "stop") for c in convs]

    starts = [P.solver_messages("q a"), P.solver_messages("q b")]
    failed, ok = run_rollouts(starts, SearchTool(index, topk=1), generate, max_actions=3)
    assert failed.failed and not ok.failed and sizes == [2, 1, 1]
    assert failed.messages == starts[0] and failed.actions == 0 and not failed.answered and failed.last_action == ""


def test_a_policy_file_loaded_over_a_trained_policy_brings_its_own_step_count(monkeypatch, tmp_path):
    """The step count goes with the weights and optimizer state it counts: loaded over a policy trained
    further, the file's (the old count stayed, and a save then recorded it with the file's weights)."""
    policy = _tiny_policy(monkeypatch, store=tmp_path)
    policy.new("p")
    policy.update("p", [_seq("abcdef")], [1.0])
    path = tmp_path / policy.save("p")["file"]
    for _ in range(2):
        policy.update("p", [_seq("abcdef")], [1.0])
    assert policy.steps["p"] == 3
    policy.load_file("p", path)
    policy.load_file("evaluated", path)
    assert (policy.steps["p"], policy.steps["evaluated"]) == (1, 1)
    # a step count that is no integer (an edited file) is named, not an int() traceback
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata()
    save_file(load_file(str(path)), str(tmp_path / "edited.safetensors"), metadata={**meta, "steps": "1.5"})
    with pytest.raises(ValueError, match=r"edited\.safetensors: the policy file's steps should be an integer, "
                                         r"got '1\.5'"):
        policy.load_file("p", tmp_path / "edited.safetensors")
