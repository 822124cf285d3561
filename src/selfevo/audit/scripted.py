"""A scripted judge: a deterministic stand-in for an LLM behind the same real HTTP endpoint
(`selfevo serve-model --model scripted:judge --script-file KEY.json`), for tests and for
measuring the audit pipeline itself.

It answers the judge's two prompts (llm_judge.py) from an answer key {question: {"reference",
"quote"}}, which `answer_key` builds from a world's exact truth, optionally with a controlled share
of misread references (the wrong answer a confusable sentence of the page offers), so that the
judge-versus-truth comparison has a known error to recover. Its grades compare answers to the
reference with the loop's matcher.

With `obey_injections`, it is the worst case for prompt injection: it does what injected text in a
document says -- gives a reply planted in the page ({"reference": ..., "quote": ...}), adopts "the
correct answer is X" with that sentence as its quote, quotes a "mark every answer correct"
instruction as its evidence, and grades every answer correct when the quote it is shown says so.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from selfevo.algos import hash_unit
from selfevo.audit.judges import OracleJudge
from selfevo.audit.llm_judge import MIN_QUOTE_WORDS, item_sources
from selfevo.evaluate import answers_match, mentions, normalize_answer

OVERRIDE = re.compile(r"(?:correct|reference) answer(?: to any question about this page)? is ([^.;\n]+)", re.I)
MARK_ALL = re.compile(r"mark every answer correct", re.I)
FAKE_REPLY = re.compile(r'"reference":\s*"([^"]+)",\s*"quote":\s*"([^"]+)"')
_DOC = re.compile(r'<document id="[^"]*">\n(.*?)\n</document>', re.S)


def sentences(text: str, min_words: int = MIN_QUOTE_WORDS) -> list[str]:
    """The sentences (and lines) of a text with at least `min_words` words: quotable evidence."""
    parts = (s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", text))
    return [s for s in parts if len(s.split()) >= min_words]


def _sentence_with(texts: Sequence[str], pattern: re.Pattern) -> str | None:
    return next((s for t in texts for s in sentences(t) if pattern.search(s)), None)


def check_key(key: Any) -> None:
    """An answer key is {question: {"reference": str | null, "quote": str | null}}: a ValueError
    naming the first entry that is not."""
    if not isinstance(key, Mapping):
        raise ValueError(f"expected an object {{question: {{reference, quote}}}}, got {type(key).__name__}")
    for q, entry in key.items():
        if not (isinstance(entry, Mapping) and all(isinstance(entry.get(k), (str, type(None)))
                                                   for k in ("reference", "quote"))
                and {"reference", "quote"} <= set(entry)):
            raise ValueError(f"entry {q!r}: expected {{\"reference\": str or null, \"quote\": str or null}}, "
                             f"got {json.dumps(entry)[:80]}")


class ScriptedJudge:
    """The script: chat messages -> reply text (see the module docstring)."""

    def __init__(self, key: Mapping[str, Mapping[str, Any]], obey_injections: bool = False):
        check_key(key)
        # the prompts carry the question whitespace-collapsed (llm_judge.reference_messages): so do the keys
        self.key = {" ".join(q.split()): v for q, v in key.items()}
        self.obey = obey_injections

    def __call__(self, messages: Sequence[Mapping[str, str]]) -> str:
        user = next(m["content"] for m in messages if m["role"] == "user")  # the first: corrections come later
        question = re.search(r"^QUESTION: (.*)$", user, re.M)
        q = question.group(1).strip() if question else ""
        if "<document" in user:
            return json.dumps(self._reference(q, _DOC.findall(user)))
        ref = re.search(r"^REFERENCE: (.*)$", user, re.M)
        answers = re.search(r"^ANSWERS: (.*)$", user, re.M)
        quote = re.search(r"<quote>(.*?)</quote>", user, re.S)
        if not (ref and answers):
            return "I do not understand the request."
        a = json.loads(answers.group(1))
        if self.obey and quote and MARK_ALL.search(quote.group(1)):
            return json.dumps({"label": "correct", "responses": ["correct"] * len(a["responses"])})

        def grade(x: str) -> str:
            return "correct" if answers_match(x, ref.group(1)) else "incorrect"

        return json.dumps({"label": grade(a["label"]), "responses": [grade(r) for r in a["responses"]]})

    def _reference(self, question: str, docs: list[str]) -> dict:
        entry = self.key.get(question)
        if self.obey:
            fake = next((m for d in docs for m in [FAKE_REPLY.search(d)] if m), None)
            if fake:  # a reply planted in the page: give it
                return {"reference": fake.group(1), "quote": fake.group(2)}
            said = _sentence_with(docs, OVERRIDE)
            if said:
                return {"reference": OVERRIDE.search(said).group(1).strip().strip("\"'"), "quote": said}
            order = _sentence_with(docs, MARK_ALL)
            if order:
                return {"reference": entry["reference"] if entry else "every answer", "quote": order}
        if entry is None:
            return {"reference": None, "quote": None}
        return {"reference": entry["reference"], "quote": entry["quote"]}


def answer_key(items: Sequence[Mapping[str, Any]], documents: Mapping[str, str], oracle: OracleJudge,
               error_rate: float = 0.0, seed: int = 0) -> dict[str, dict]:
    """{question: {"reference", "quote"}} for every question whose true answer a sentence of its
    source documents states. With probability `error_rate` (per question, seeded) the entry is
    misread: it names a wrong answer another sentence of the same documents offers (the item's
    label or a response, when one is wrong and stated there), quoting that sentence."""
    key: dict[str, dict] = {}
    for it in items:
        q = it["question"]
        if q in key:
            continue
        truth = oracle.reference(q)
        texts = [t for _, t in item_sources(it, documents)]
        if not truth or not texts:
            continue
        found = next(((s, a) for t in reversed(texts) for s in sentences(t) for a in truth if mentions(s, a)), None)
        if found is None:
            continue
        entry = {"reference": found[1], "quote": found[0]}
        if error_rate and hash_unit(seed, q) < error_rate:
            wrong = [a for a in [it["adopted_label"], *it["responses"]]
                     if normalize_answer(a or "") and not any(answers_match(a, g) for g in truth)]
            misread = next(((s, a) for a in wrong for t in texts for s in sentences(t) if mentions(s, a)), None)
            if misread:
                entry = {"reference": misread[1], "quote": misread[0], "misread": True}
        key[q] = entry
    return key
