"""The policy-gradient math of the language-model backend, as pure functions over tensors and
strings (after verl's core_algos): which tokens are trained, their log-probabilities, the loss.

The objective is the paper's Equation (1), sequence-normalised policy gradient:

    L(θ) = -(1/G) Σ_i A_i · (1/|o_i|) Σ_{t ∈ o_i} log π_θ(o_{i,t} | context)

over the G trajectories of a batch, where o_i are the trained tokens of trajectory i (its mask) and A_i
its advantage (normalised within the five responses to one question for a solver, within the hop
bucket for the proposer: `selfevo.algos`). Each batch is sampled from the current policy and used
for one step, so the PPO ratio is 1 and its clipping never binds: this is that objective's gradient.

Masks: prompt tokens and tool observations (the <information> turns, corrective messages) are never
trained; every assistant action is, except, for the proposer, its terminal <answer> span (the label
is what the grader is paid against, not something the proposer is rewarded for phrasing). Each action
is trained on the context it was generated from: one sequence for the whole chat where the chat
template allows it, else one sequence an action (`encode_trajectory`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence

Span = tuple[int, int]  # [start, end) character offsets

_ANSWER = re.compile(r"<answer>.*?</answer>", re.DOTALL)


def content_spans(rendered: Sequence[str], messages: Sequence[dict]) -> list[Span]:
    """Where each message's content sits in the fully rendered chat. `rendered[i]` is the chat
    template applied to `messages[:i+1]` (each a prefix of the next, as most chat templates are).
    The spans index `rendered[-1]`, which is what gets tokenised: a template that renders an earlier
    turn otherwise once later turns follow (Qwen3's drops, or adds, the `<think>` block of every
    assistant turn before the last user turn) would put each span on other characters -- template
    tokens and the next observation trained, the model's own tokens not -- so it is an error."""
    spans, prev, full = [], 0, rendered[-1] if rendered else ""
    for i, m in enumerate(messages):
        text, content = rendered[i], m["content"]
        start = text.rfind(content) if content else len(text)
        if start < prev and content != content.strip():
            # a template that trims each message (Llama 3's `| trim`) renders " <search> q </search>"
            # without its outer whitespace: the span is then the stripped content, which is what the
            # model reads back (the stripped spaces are in no rendered token to train)
            content = content.strip()
            start = text.rfind(content) if content else len(text)
        if start < prev:
            raise ValueError(f"message {i}: content not found after the previous message in the rendered chat")
        end = start + len(content)
        if content and full[:end] != text[:end]:
            raise ValueError(f"message {i} ({m['role']}): the chat template renders the conversation up to this "
                             "message differently once later messages follow (it is not a prefix of the whole "
                             "chat; e.g. a template that drops earlier turns' <think>), so the training mask "
                             "cannot be placed; use a prefix-stable chat template")
        spans.append((start, end))
        prev = end
    return spans


def trained_spans(messages: Sequence[dict], spans: Sequence[Span], mask_final_answer: bool = False) -> list[Span]:
    """The character spans trained: every assistant message's content; with `mask_final_answer`
    (the proposer) the last assistant message's <answer>…</answer> is cut out."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    out: list[Span] = []
    for i, (m, (a, b)) in enumerate(zip(messages, spans, strict=True)):
        if m["role"] != "assistant" or a == b:
            continue
        if mask_final_answer and i == last:
            # the span holds the content, or its stripped form under a trimming template (`content_spans`)
            text = m["content"] if b - a == len(m["content"]) else m["content"].strip()
            cut = [(a + x.start(), a + x.end()) for x in _ANSWER.finditer(text)]
            for s, e in cut:
                if s > a:
                    out.append((a, s))
                a = e
            if a < b:
                out.append((a, b))
        else:
            out.append((a, b))
    return out


def token_mask(offsets: Sequence[Span], spans: Sequence[Span]) -> list[int]:
    """1 for each token lying wholly inside a trained span, else 0. A token straddling a span's
    edge (BPE merges "</think><" across the proposer's masked answer) is not trained: masking
    errs on the side of not training. `offsets` are the tokenizer's character offsets; special
    tokens (empty offsets) are never trained."""
    spans = sorted(spans)
    mask, j = [], 0
    for s, e in offsets:
        while j < len(spans) and spans[j][1] <= s:
            j += 1
        inside = e > s and j < len(spans) and spans[j][0] <= s and e <= spans[j][1]
        mask.append(1 if inside else 0)
    return mask


def token_logprobs(logits, input_ids):
    """log π(token_t | tokens_<t) for t = 1..T-1: logits [B, T, V], ids [B, T] -> [B, T-1].

    Computed as the chosen logit minus the logsumexp, in float32, `_CHUNK` positions at a time, with
    a backward that recomputes each chunk's softmax: a full log-softmax would hold a float32 [B, T, V]
    copy for the backward (at a 150k vocabulary and 4k tokens, 2.4 GB a sequence)."""
    return _chosen_logprobs().apply(logits[:, :-1], input_ids[:, 1:])


_CHUNK = 1024  # positions a chunk: 1024 x 150k vocabulary x 4 bytes = 0.6 GB of float32 at a time


def _chunks(logits):
    """(row, positions) index pairs covering [B, T', V] `logits`, `_CHUNK` positions each (views, no copy)."""
    return ((b, slice(t, t + _CHUNK)) for b in range(logits.shape[0]) for t in range(0, logits.shape[1], _CHUNK))


@functools.cache
def _chosen_logprobs():
    import torch  # here, not at the top: a config is read without torch

    class ChosenLogprobs(torch.autograd.Function):
        """log_softmax(logits)[..., ids] and its gradient grad · (onehot(ids) - softmax), chunk by chunk."""

        @staticmethod
        def forward(ctx, logits, ids):
            lse = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
            for c in _chunks(logits):
                lse[c] = torch.logsumexp(logits[c].float(), dim=-1)
            ctx.save_for_backward(logits, ids, lse)
            return logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1).float() - lse

        @staticmethod
        def backward(ctx, grad):
            logits, ids, lse = ctx.saved_tensors
            out = torch.empty_like(logits)
            for c in _chunks(logits):
                g = grad[c].float().unsqueeze(-1)
                part = torch.exp(logits[c].float() - lse[c].unsqueeze(-1)).mul_(-g)
                out[c] = part.scatter_add_(-1, ids[c].unsqueeze(-1), g).to(out.dtype)
            return out, None

    return ChosenLogprobs


def sequence_pg_loss(logprobs, mask, advantages, n_sequences: int | None = None, denominators=None):
    """Equation (1): -(1/G) Σ_i A_i · mean over sequence i's trained tokens of log π.
    `logprobs`, `mask`: [B, T]; `advantages`: [B]. `n_sequences` (G) defaults to B; pass the whole
    batch's size when summing the loss over micro-batches. `denominators` ([B]; default each row's
    trained tokens) divides each row instead: a trajectory trained as several sequences (one per action,
    `encode_trajectory`) gives each of its rows its trajectory's trained tokens, so its rows sum to its mean."""
    mask = mask.to(logprobs.dtype)
    den = mask.sum(-1) if denominators is None else denominators.to(logprobs.dtype)
    per_seq = (logprobs * mask).sum(-1) / den.clamp(min=1.0)
    g = logprobs.shape[0] if n_sequences is None else n_sequences
    return -(advantages.to(logprobs.dtype) * per_seq).sum() / g


def encode_conversation(tokenizer, messages: Sequence[dict], mask_final_answer: bool = False,
                        render: Callable[[Sequence[dict]], str] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and its training mask (see `token_mask`); a template that is
    not prefix-stable is an error (`content_spans`)."""
    render = render or _renderer(tokenizer)
    rendered = [render(messages[:i + 1]) for i in range(len(messages))]
    return _encode_whole(tokenizer, rendered[-1], messages, content_spans(rendered, messages), mask_final_answer)


def encode_trajectory(tokenizer, messages: Sequence[dict], mask_final_answer: bool = False,
                      render: Callable[[Sequence[dict]], str] | None = None,
                      prompt: Callable[[Sequence[dict]], str] | None = None,
                      max_prompt_tokens: int | None = None,
                      head_chars: Callable[[Sequence[dict], str], int] | None = None,
                      ) -> list[tuple[list[int], list[int]]]:
    """The training sequences of one trajectory, each `(ids, mask)`: trained on the context each action
    was generated from. `prompt(messages[:k])` is what generation rendered before assistant message k
    (the chat template with its generation prompt).

    An action whose prompt was over `max_prompt_tokens` was generated from that prompt cut by
    `keep_head` (its first `head_chars(messages[:k], prompt)` characters kept, the oldest turns after
    them dropped: `LMPolicy.prompt_ids`); it is trained on the same cut context, in a sequence of its own.

    One sequence, the whole rendered chat, where every action sits in it, as generated, right after its
    own prompt (a prefix-stable template such as ChatML); otherwise one sequence per action, its prompt
    followed by its content. The second covers templates that render earlier turns otherwise once later
    turns follow (Qwen3 drops the <think> of assistant turns before the last user turn) or that render an
    assistant turn otherwise than their generation prompt starts it (an empty <think> block added, an
    action's outer whitespace trimmed): a trajectory of n actions then costs n forward passes over its
    growing context. `sequence_pg_loss` with `denominators` keeps Equation (1)'s per-trajectory mean over either."""
    render = render or _renderer(tokenizer)
    prompt = prompt or _renderer(tokenizer, generation_prompt=True)
    actions = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m["content"]]
    prompts = {i: prompt(messages[:i]) for i in actions}
    cut = {i: head_chars(messages[:i], prompts[i]) if head_chars else 0
           for i in actions if _over(tokenizer, prompts[i], max_prompt_tokens)}
    rendered = [render(messages[:i + 1]) for i in range(len(messages))]
    try:
        spans = content_spans(rendered, messages)
    except ValueError:
        spans = None
    # each action as generated, right after its prompt: a template that trims each message (Llama 3's)
    # renders an action's outer whitespace away, and the tokens trained would not be those sampled
    if not cut and spans is not None and all(rendered[-1][:spans[i][1]] == prompts[i] + messages[i]["content"]
                                             for i in actions):
        return [_encode_whole(tokenizer, rendered[-1], messages, spans, mask_final_answer)]
    parts = []
    for i in actions:
        content, spans = messages[i]["content"], [(0, 0)] * len(messages)
        if i in cut:  # the prompt's ids as generation took them (cut: `prompt_token_ids`), then the action's
            seen = prompt_token_ids(tokenizer, [prompts[i]], max_prompt_tokens, lambda _, i=i: cut[i])[0]
            spans[i] = (0, len(content))
            enc = tokenizer(content, add_special_tokens=False, return_offsets_mapping=True)
            parts.append((seen + list(enc["input_ids"]),
                          [0] * len(seen) + token_mask(enc["offset_mapping"],
                                                       trained_spans(messages, spans, mask_final_answer))))
            continue
        start = len(prompts[i])
        spans[i] = (start, start + len(content))
        enc = tokenizer(prompts[i] + content, add_special_tokens=False, return_offsets_mapping=True)
        parts.append((list(enc["input_ids"]),
                      token_mask(enc["offset_mapping"], trained_spans(messages, spans, mask_final_answer))))
    return parts


def _over(tokenizer, prompt: str, max_prompt_tokens: int | None) -> bool:
    """Whether `prompt` is over the limit in tokens (a token is at least one byte: a prompt of no more
    bytes than the limit is never tokenized for this)."""
    if max_prompt_tokens is None or len(prompt.encode("utf-8")) <= max_prompt_tokens:
        return False
    return len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) > max_prompt_tokens


def prompt_token_ids(tokenizer, prompts: Sequence[str], max_prompt_tokens: int,
                     head_chars: Callable[[int], int] | None = None) -> list[list[int]]:
    """Token ids of each prompt, as both generators (HF and vLLM) take them: no special tokens added;
    prompt i over `max_prompt_tokens` is cut by `keep_head`, its head the tokens within its first
    `head_chars(i)` characters (asked only of such a prompt; none: no head kept)."""
    out = []
    for i, p in enumerate(prompts):
        ids = list(tokenizer(p, add_special_tokens=False)["input_ids"])
        head = 0
        if len(ids) > max_prompt_tokens and head_chars is not None and (chars := head_chars(i)):
            ends = [b for _, b in tokenizer(p, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
            head = sum(1 for b in ends if b <= chars)
        out.append(keep_head(ids, head, max_prompt_tokens))
    return out


def keep_head(ids: Sequence[int], head: int, limit: int) -> list[int]:
    """`ids` cut to `limit` tokens: the first `head` kept (the system prompt and the question), the
    oldest after them dropped, so a long search still ends at its last observation and generation
    prompt. A head longer than the limit is not kept: the last `limit` tokens, as plain left truncation."""
    if len(ids) <= limit:
        return list(ids)
    if head >= limit:
        return list(ids[len(ids) - limit:])
    return list(ids[:head]) + list(ids[len(ids) - (limit - head):])


def _renderer(tokenizer, generation_prompt: bool = False) -> Callable[[Sequence[dict]], str]:
    template = template_of(tokenizer)
    return lambda ms: template(ms, generation_prompt)


Render = Callable[[Sequence[dict], bool], str]  # (messages, add_generation_prompt) -> text
_PLACEHOLDER = "\ue000selfevo-action\ue000"  # no whitespace or tags: no template trims or splits it


class append_only:  # noqa: N801 - used as the function it replaces: append_only(template)(messages)
    """A chat template made prefix-stable, for a trainer that takes one completion a trajectory (TRL):
    the turns before the first action as `template` renders them with its generation prompt, then
    each assistant action verbatim, as generated, each followed by what the template writes after an
    assistant turn (its close, the observations that follow and, before the next action, the
    generation prompt). Generating every action from this rendering of the turns before it, the whole
    chat holds each action right after the text it was generated from (`spans`), whatever the
    template does to earlier turns: re-render them (Qwen3 drops their <think>), trim them (Llama 3),
    or write the system prompt into the last user turn (Mistral: here into every observation turn, in
    what the model is shown and trained on alike). Where the template is prefix-stable already (ChatML)
    this is its own rendering."""

    def __init__(self, template: Render):
        self.template = template

    def __call__(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        return "".join(text for text, _ in self._pieces(messages, add_generation_prompt))

    def spans(self, messages: Sequence[dict]) -> list[Span]:
        """Where each assistant action sits in `self(messages)`, from the rendering itself (searching for
        its text, as `content_spans` must, would find an action such as "\n" in the template's own
        text). Other messages get an empty span (none is trained)."""
        spans, at = [(0, 0)] * len(messages), 0
        for text, action in self._pieces(messages, False):
            if action is not None:
                spans[action] = (at, at + len(text))
            at += len(text)
        return spans

    def _pieces(self, messages: Sequence[dict], add_generation_prompt: bool) -> list[tuple[str, int | None]]:
        """The rendering's pieces in order, each with the index of the action it is (None: template text)."""
        actions = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not actions:
            return [(self.template(list(messages), add_generation_prompt), None)]
        head = list(messages[:actions[0]])
        pieces = [(self.template(head, True), None)]
        for i, j in zip(actions, [*actions[1:], len(messages)]):
            pieces.append((messages[i]["content"], i))
            # before another action the generation prompt is written: it is what that action followed
            pieces.append((self._after_action(head, messages[i + 1:j], add_generation_prompt or j < len(messages)),
                           None))
        return pieces

    def _after_action(self, head: Sequence[dict], tail: Sequence[dict], generation_prompt: bool) -> str:
        text = self.template([*head, {"role": "assistant", "content": _PLACEHOLDER}, *tail], generation_prompt)
        at = text.find(_PLACEHOLDER)
        if at < 0:
            raise ValueError("the chat template does not render an assistant turn's content as given, so an "
                             "action cannot be placed in the chat")
        return text[at + len(_PLACEHOLDER):]


def template_of(tokenizer, **kwargs) -> Render:
    """The tokenizer's chat template as a `Render`; `kwargs` go to the template (`enable_thinking`)."""
    return lambda ms, gen=False: tokenizer.apply_chat_template(list(ms), tokenize=False, add_generation_prompt=gen,
                                                               **kwargs)


def _encode_whole(tokenizer, text: str, messages: Sequence[dict], spans: Sequence[Span],
                  mask_final_answer: bool) -> tuple[list[int], list[int]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), token_mask(enc["offset_mapping"], trained_spans(messages, spans, mask_final_answer))
