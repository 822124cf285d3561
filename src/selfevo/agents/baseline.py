"""The retrieval baseline: a real, non-learning Solver that reads one passage.

It exists to exercise the evaluation runner end to end with a real retriever and to give the
results table a floor that any trained agent must beat. Heuristic, fully deterministic:

1. Search the question once (1 of the 5 allowed calls); read the top passage only.
2. Either-or question ("Who died first, A or B?"): answer the option the top passage's title
   names (BM25 found a page about it), else the first option. A coin flip with a hint.
3. Yes/no question (starts with "is", "did", "are", ...): answer "yes", the majority answer of
   such questions in HotpotQA / 2WikiMQA.
4. If the question asks for a number or date ("when", "what year", "how many", ...), or the
   question already names the passage's title (at least half of the title's words occur in
   it), answer the span of the passage closest to the question's words. Spans are runs of
   capitalised or numeric words ("13 January 1933", "Capitol Records"), skipping spans the
   question already contains; number/date questions take only spans with a digit, other
   questions only spans without one. A span scores sum(1 / (1 + distance)) over occurrences of
   question words outside it; ties go to the earlier span.
5. Otherwise answer the title: for "who wrote X" the top passage is often about X, but for
   "which film ..." or "who ..." it is often the answer itself.
6. No passage: answer "". No span: answer the title.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from selfevo.agents.base import Trajectory
from selfevo.algos import float_sum
from selfevo.evaluate import normalize_answer
from selfevo.records import Document
from selfevo.search.tool import Hit, SearchTool

_YES_NO_STARTS = frozenset({
    "is", "are", "was", "were", "do", "does", "did", "can", "could", "has", "have", "had",
    "will", "would", "should",
})
_NUMERIC_CUES = ("when ", "what year", "which year", "how many", "how much", "how old",
                 "how long", "what date", "in what year", "what decade")
# Frequent capitalised words that start sentences rather than name things.
_SPAN_STOPWORDS = frozenset({
    "a", "an", "the", "he", "she", "it", "they", "his", "her", "its", "their", "this", "that",
    "these", "those", "there", "in", "on", "at", "of", "for", "by", "to", "from", "with",
    "after", "before", "during", "when", "while", "as", "but", "and", "or", "however", "also",
    "later", "then", "i", "we", "you", "our",
})
# Lowercase words allowed inside a name ("Prince of Wales", "Leonardo da Vinci").
_CONNECTORS = frozenset({"of", "de", "da", "di", "del", "von", "van", "der", "la", "le", "du",
                         "y", "the"})
_QUESTION_STOPWORDS = _SPAN_STOPWORDS | {
    "who", "whom", "whose", "what", "which", "where", "when", "why", "how", "is", "are", "was",
    "were", "do", "does", "did", "name", "one", "first",
}

# "..., A or B?" at the end of a question
_EITHER_OR = re.compile(r",\s*([^,?]+?)\s+or\s+([^,?]+?)\s*\?\s*$")


def either_or(question: str) -> re.Match | None:
    """`_EITHER_OR.search(question)`, in time linear in the question. The options hold no "," and no
    "?", so a match starts at the last comma and ends at the one "?" after it; a question that has no
    such tail is refused before the regex, whose failing search backtracks over every " or "."""
    comma = question.rfind(",")
    tail = question[comma + 1:].rstrip()
    if comma < 0 or not tail.endswith("?") or "?" in tail[:-1]:
        return None
    return _EITHER_OR.search(question, comma)

_TOKEN = re.compile(r"\w+(?:[-'’.]\w+)*")


def _strip_disambiguation(title: str) -> str:
    """"Michael Johnson (athlete)" → "Michael Johnson"."""
    return re.sub(r"\s*\([^)]*\)\s*$", "", title).strip()


def _title_named_in(title: str, question_tokens: set[str]) -> bool:
    words = normalize_answer(title).split()
    return bool(words) and sum(w in question_tokens for w in words) * 2 >= len(words)


def _spans(text: str) -> list[tuple[int, int, str]]:
    """(first token index, end token index, span text) for runs of capitalised or numeric
    tokens separated only by spaces; lowercase connectors may sit inside a run."""
    tokens = list(_TOKEN.finditer(text))
    spans: list[tuple[int, int, str]] = []
    i = 0
    while i < len(tokens):
        word = tokens[i].group()
        if not (word[0].isupper() or word[0].isdigit()):
            i += 1
            continue
        j = i + 1
        while j < len(tokens):
            gap = text[tokens[j - 1].end():tokens[j].start()]
            nxt = tokens[j].group()
            if gap.strip():  # punctuation between words ends the name
                break
            if nxt[0].isupper() or nxt[0].isdigit():
                j += 1
            elif nxt in _CONNECTORS and j + 1 < len(tokens) and (
                    tokens[j + 1].group()[0].isupper()
                    and not text[tokens[j].end():tokens[j + 1].start()].strip()):
                j += 2
            else:
                break
        span_text = text[tokens[i].start():tokens[j - 1].end()]
        # a sentence-initial "The" / "In" alone is not an answer; drop it from the front
        while i < j and tokens[i].group().lower() in _SPAN_STOPWORDS:
            i += 1
            span_text = text[tokens[i].start():tokens[j - 1].end()] if i < j else ""
        if span_text:
            spans.append((i, j, span_text))
        # the next run starts at j (> the run's first token), not past it: after "However," token j
        # is a capitalised word (j is where punctuation ended a run of stopwords)
        i = j
    return spans


def _asks_for_number(question: str) -> bool:
    q = question.lower()
    return any(cue in q for cue in _NUMERIC_CUES)


def _best_span(question: str, text: str) -> str | None:
    q_norm = normalize_answer(question)
    q_words = {w for w in q_norm.split() if w not in _QUESTION_STOPWORDS}
    numeric = _asks_for_number(question)
    tokens = [m.group().lower() for m in _TOKEN.finditer(text)]
    anchors = [k for k, tok in enumerate(tokens) if normalize_answer(tok) in q_words]
    best: tuple[float, int, str] | None = None
    for start, end, span in _spans(text):
        norm = normalize_answer(span)
        if not norm or norm in q_norm or numeric != any(c.isdigit() for c in span):
            continue
        score = float_sum(1.0 / (1 + (start - k if k < start else k - end + 1))
                    for k in anchors if not start <= k < end)
        if best is None or score > best[0]:  # strict: ties keep the earlier span
            best = (score, start, span)
    return best[2] if best else None


class RetrievalBaseline:
    """Search once, answer with a span of the top passage (see the module docstring)."""

    name = "retrieval-baseline"

    def answer_one(self, question: str, tool: SearchTool, context: Document | None = None) -> Trajectory:
        session = tool.session()
        # a document in context stands in for the search result
        hits = [Hit(context, 0.0)] if context is not None else session.search(question)
        return Trajectory(self._pick(question, hits), list(session.queries), actions=1)

    def _pick(self, question: str, hits: list[Hit]) -> str:
        title = _strip_disambiguation(hits[0].document.title) if hits else ""
        pair = either_or(question)
        if pair:
            options = [o.strip() for o in pair.groups()]
            t = normalize_answer(title)
            named = [o for o in options
                     if t and (normalize_answer(o) in t or t in normalize_answer(o))]
            return (named or options)[0]
        if question.strip().split(" ", 1)[0].lower() in _YES_NO_STARTS:
            return "yes"
        if not hits:
            return ""
        q_tokens = set(normalize_answer(question).split())
        if _asks_for_number(question) or not title or _title_named_in(title, q_tokens):
            return _best_span(question, hits[0].document.text) or title
        return title

    def answer(self, questions: Sequence[str], tool: SearchTool, *, greedy: bool = True,
               n: int = 1, seed: int | None = None,
               contexts: Sequence[Document] | None = None) -> list[list[Trajectory]]:
        # Deterministic: sampling (greedy=False) or a seed changes nothing, so the n
        # trajectories of a question are n copies of one.
        out = []
        contexts = contexts if contexts is not None else [None] * len(questions)
        for q, c in zip(questions, contexts, strict=True):
            traj = self.answer_one(q, tool, c)
            out.append([traj] + [Trajectory(traj.answer, list(traj.searches), traj.actions)
                                 for _ in range(n - 1)])
        return out
