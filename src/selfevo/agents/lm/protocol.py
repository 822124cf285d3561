"""The text protocols of language-model agents, as pure functions (no torch, no model).

Solver (the Search-R1 protocol). The model reasons in `<think>…</think>`, searches with
`<search> query </search>` -- the tool's top passages come back in `<information>…</information>`
-- and ends with `<answer> … </answer>`. One assistant action is one generation that stops at the
first `</search>` or `</answer>`; at most `max_actions` actions a trajectory. An action that is
neither gets a corrective message and costs an action. Over a chat API the information goes back as
a user turn, so local models, vLLM and hosted endpoints all see the same conversation.

Proposer (the Dr. Zero style). From the first 256 tokens of a source document the model writes an
exactly-n-hop question, `<question>…</question>` then `<answer>…</answer>`, optionally searching
first (or, `scaffolded`, with both tags forced, for models too small to write them). `check_proposal`
applies the format rules: both non-empty, the answer short and not inside the question.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from selfevo.agents.base import blank, missing_part
from selfevo.algos import sample_index
from selfevo.evaluate import mentions
from selfevo.loop.schedule import derive_seed

STOP_STRINGS = ("</search>", "</answer>")
HOP_RATIO = (4, 3, 2, 1)  # paper (Dr. Zero): 1-, 2-, 3-, 4-hop questions in ratio 4:3:2:1
MAX_ANSWER_WORDS = 8  # a "short answer": a name, a place, a date
PASSAGE_WORDS = 100  # each passage in an observation is cut to this many words

SOLVER_SYSTEM = (
    "You answer questions with the help of a search engine. Think step by step inside <think> and "
    "</think> whenever you get new information. If you need knowledge you do not have, search by "
    "writing <search> your query </search>; the results come back between <information> and "
    "</information>. Search as often as you need. When you know the answer, give it inside <answer> "
    "and </answer>, as a few words only, for example <answer> Stratford-upon-Avon </answer>."
)

# the proposer's offer of the search tool, left out of its prompt where it has none (lm.proposer_search = false)
_PROPOSER_SEARCH_OFFER = (
    "You may first search for related facts by writing <search> query </search>; results come back between "
    "<information> and </information>. Then write"
)
PROPOSER_SYSTEM = (
    "You write quiz questions from a document. Read the document and write one question that takes "
    "exactly {hops} reasoning hop(s) to answer and whose answer is stated in the document. "
    + _PROPOSER_SEARCH_OFFER + " the question inside <question> and </question> "
    "followed by its short answer (a few words) inside <answer> and </answer>. The answer must not "
    "appear in the question. For example:\n"
    "<question> In which city was the author of Hamlet born? </question> <answer> Stratford-upon-Avon </answer>"
)

CORRECTIVE = ("My previous action is invalid. If I want to search, I should put the query between "
              "<search> and </search>. If I want to give the final answer, I should put the answer "
              "between <answer> and </answer>. Let me try again.")
BUDGET_SPENT = "The search budget is spent. Give your final answer now inside <answer> and </answer>."

# a tag's content runs from the LAST opening before its first closing tag: a model that repeats the
# opening tag ("<answer> <answer> Paris </answer>") answered "Paris", not "<answer> Paris" (which the
# reward's exact match calls wrong and Cover-EM right)
_TAG = {name: re.compile(rf"<{name}>((?:(?!<{name}>).)*?)</{name}>", re.DOTALL)
        for name in ("search", "answer", "question")}


@dataclass(frozen=True)
class Action:
    kind: str  # "search" | "answer" | "invalid"
    content: str = ""


def cut_at_stop(text: str, stops: Sequence[str] = STOP_STRINGS) -> str:
    """The text up to and including the first stop string (generation may run a few tokens past
    it, since a stop string can end inside a token; an API may also drop it: see `close_action`)."""
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return text[:min(ends)] if ends else text


def close_action(text: str, finish_reason: str) -> str:
    """OpenAI-compatible servers drop the stop string from the reply: put it back, so the action
    reads the same whoever generated it. The server stopped at the closing tag of the action opened
    last (a `<search>` left open before an `<answer>` stopped at `</answer>`), so that one is closed."""
    if finish_reason == "stop":
        unclosed = {name: at for name in ("search", "answer")
                    if (at := text.rfind(f"<{name}>")) >= 0 and f"</{name}>" not in text[at:]}
        if unclosed:
            return text + f"</{max(unclosed, key=unclosed.get)}>"
    return text


def parse_action(text: str) -> Action:
    """The action one assistant turn takes: the first closed `<search>` or `<answer>` (after any
    thinking); anything else is invalid."""
    text = cut_at_stop(text)
    found = []
    for kind in ("search", "answer"):
        m = _TAG[kind].search(text)
        if m:
            found.append((m.start(), kind, m.group(1).strip()))
    if not found:
        return Action("invalid")
    _, kind, content = min(found)
    if blank(content):
        return Action("invalid")
    return Action(kind, content)


def format_information(passages: Sequence[tuple[str, str]], max_words: int = PASSAGE_WORDS) -> str:
    """The observation for one search: `(title, text)` passages, each cut to `max_words` words."""
    lines = []
    for i, (title, text) in enumerate(passages, 1):
        words = text.split()
        body = " ".join(words[:max_words]) + (" ..." if len(words) > max_words else "")
        lines.append(f"Doc {i} (Title: {title}) {body}")
    return "<information>" + "\n".join(lines) + "</information>"


QUESTION = "Question: "  # what the solver's user turn opens with


def solver_messages(question: str, context: str | None = None) -> list[dict]:
    """The opening of a solver conversation. `context` (MSV's "with the source") is put in front
    of the question as a document to read."""
    user = f"{QUESTION}{question.strip()}"
    if context is not None:
        user = f"<document>\n{context}\n</document>\n{user}"
    return [{"role": "system", "content": SOLVER_SYSTEM}, {"role": "user", "content": user}]


def solver_question(prompt: list[dict] | str) -> str:
    """The question of a conversation `solver_messages` opened without a context: its last user turn
    after the prefix (a question may hold "Question: " itself), or, for a prompt rendered as text, what
    follows the prefix's first occurrence (the system prompt holds none)."""
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    return text.split(QUESTION, 1)[-1].strip()


# ---------------------------------------------------------------- proposer


def sample_hops(u: float, ratio: Sequence[int] = HOP_RATIO) -> int:
    """A hop count 1..len(ratio) drawn with `u` in [0, 1) in the given ratio."""
    total = sum(ratio)
    return 1 + sample_index([r / total for r in ratio], u)


def proposer_messages(document: str, hops: int, search: bool = True) -> list[dict]:
    """The opening of a proposer conversation. Without `search` (lm.proposer_search = false: one
    action, no tool) the system prompt does not offer the tool. The loop's proposer and the engines'
    prompt rows (`integrations.datasets.proposer_rows`) both build it here, so they show the same."""
    system = PROPOSER_SYSTEM.format(hops=hops)
    if not search:
        system = system.replace(_PROPOSER_SEARCH_OFFER, "Write")
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"<document>\n{document}\n</document>\nWrite a {hops}-hop question."}]


def scaffolded(generate: Callable[..., list[tuple[str, str]]]) -> Callable[..., list[tuple[str, str]]]:
    """The proposer scaffold, for models too small to write the tags unprompted: each reply is made
    to start "<question>" and stops at the question's end; a second generation continues from
    "<question> …</question> <answer>" and stops at the answer's end, so the reply always has both
    tags. `generate(conversations, seed, prefix=[...], stops=(...))` writes one reply a conversation,
    starting with its prefix (part of the returned text); the result takes `(conversations, seed)`.
    A question or answer cut at the token limit (or a call that failed) is no whole one: the reply is
    left as it was cut, unclosed, so it reads as malformed (before, a cut question kept a stray
    "</question" and was graded and admitted)."""
    cut = ("length", "error")

    def run(conversations, seed):
        out = generate(conversations, seed, prefix=["<question>"] * len(conversations), stops=("</question>", "\n"))
        whole = [i for i, (_, finish) in enumerate(out) if finish not in cut]
        if whole:
            heads = [out[i][0].removesuffix("</question>").rstrip("\n").strip() for i in whole]
            # a seed of its own: with the question's, the answer's k-th token drew the question's k-th number
            replies = generate([conversations[i] for i in whole], None if seed is None else derive_seed(seed, "answer"),
                               prefix=[f"{h}</question> <answer>" for h in heads], stops=("</answer>", "\n"))
            for i, (a, finish) in zip(whole, replies, strict=True):
                out[i] = (a if finish in cut else a.rstrip("\n").removesuffix("</answer>") + "</answer>", finish)
        return out
    return run


def parse_proposal(text: str) -> tuple[str, str]:
    """`(question, answer)` from the proposer's final turn ('' where a tag is missing)."""
    q = _TAG["question"].search(text)
    a = _TAG["answer"].search(text[q.end():] if q else text)
    return (q.group(1).strip() if q else ""), (a.group(1).strip() if a else "")


def parse_proposer_action(text: str) -> Action:
    """The proposer's action: a search written before any question, else its final turn once the
    <answer> after the <question> is closed (the whole text is the content), else invalid."""
    text = cut_at_stop(text)
    s, q = _TAG["search"].search(text), text.find("<question>")
    if s and (q < 0 or s.start() < q) and not blank(s.group(1)):
        return Action("search", s.group(1).strip())
    if "</answer>" in text:
        return Action("answer", text)
    return Action("invalid")


def check_proposal(question: str, answer: str, max_answer_words: int = MAX_ANSWER_WORDS) -> str | None:
    """The format rule a proposal breaks, or None: non-empty question and answer, a short answer,
    the answer not given away inside the question (under the loop's normalisation)."""
    if empty := missing_part(question, answer):
        return empty
    if len(answer.split()) > max_answer_words:
        return "long answer"
    if mentions(question, answer):
        return "answer in question"
    return None


def read_proposal(final: str) -> tuple[str, str, str | None]:
    """`(question, answer, format error or None)` from the proposer's final turn; no final turn ('': a
    rollout that never answered) is "no final question". The loop's proposer and the TRL/verl reward
    both judge a proposal by this."""
    question, answer = parse_proposal(final)
    return question, answer, "no final question" if not final else check_proposal(question, answer)
