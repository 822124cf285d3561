"""The typed records every room exchanges.

Documents and QA items are the data formats (FlashRAG / Search-R1); the loop's step records
live with the loop's schema version so a reader can refuse records it does not understand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1


# ---------------------------------------------------------------- step records
# Built here only, by the loop (`loop.engine.Loop`) and the engine integrations (`integrations.rewards`,
# `admit`, `engine`) alike: the audit, the replay and resume read them, so their keys, key order and
# rounding must not drift between writers.


def round6(x: float) -> float:  # a function: `round` is a record field, and a parameter below
    return round(x, 6)


def item_record(*, item_id: str, source_id: str, source_ids: Sequence[str], fold: int, source_folds: Sequence[int],
                hops: int, question: str, draft_label: str, adopted_label: str, admitted: bool,
                responses: Sequence[str], k: int, reward: float, grader: Mapping, **extra: Any) -> dict[str, Any]:
    """One graded item of a step: its lineage (source, every page read, their folds), the labels, the
    grader's responses, k matching and the reward; `extra` (e.g. `admission`, `routing`) goes last."""
    return {"item_id": item_id, "source_id": source_id, "source_ids": list(source_ids), "fold": fold,
            "source_folds": list(source_folds), "hops": hops, "question": question, "draft_label": draft_label,
            "adopted_label": adopted_label, "admitted": admitted, "responses": list(responses), "k": k,
            "reward": round6(reward), "grader": grader, **extra}


MALFORMED_TEXT_CHARS = 2000  # of a malformed proposal's last action, kept to show what the model wrote


def malformed_record(*, item_id: str, source_id: str, hops: int, question: str, draft_label: str,
                     format_error: str, reward: float, text: str | None = None) -> dict[str, Any]:
    """A proposal that broke the format rules: neither graded nor admitted, so nothing to audit. `text`: a
    language model's last action as it wrote it (the rule it broke says what is missing, not what is there)."""
    return {"item_id": item_id, "source_id": source_id, "hops": hops, "question": question,
            "draft_label": draft_label, "format_error": format_error, "reward": reward,
            **({"text": text[:MALFORMED_TEXT_CHARS]} if text is not None else {})}


def step_record(*, round: int, step: int, step_in_round: int, kind: str, items: list[dict],
                stats: Mapping[str, Any], malformed: list[dict] | None = None) -> dict[str, Any]:
    """One scheduled step (`kind`: proposer | solver); float stats rounded to 6 places; `malformed`
    only when there are any."""
    record = {"schema": SCHEMA_VERSION, "round": round, "step": step, "step_in_round": step_in_round,
              "kind": kind, "items": items,
              "stats": {k: (round6(v) if isinstance(v, float) else v) for k, v in stats.items()}}
    if malformed:
        record["malformed"] = malformed
    return record


@dataclass(frozen=True)
class Document:
    """One retrievable passage. FlashRAG stores it as `{"id", "contents"}` with the title,
    in double quotes, on the first line of `contents`."""

    id: str
    title: str
    text: str
    # a corpus's `contents` as read, where it is not the quoted form (a title without quotes, say):
    # kept verbatim so that what is indexed, embedded, served and shown is the corpus's exact text,
    # as FlashRAG and Search-R1 embed it (None where the quoted form is exact; "" is an empty passage's)
    verbatim: str | None = field(default=None, repr=False)

    @property
    def contents(self) -> str:
        return f'"{self.title}"\n{self.text}' if self.verbatim is None else self.verbatim

    @classmethod
    def from_contents(cls, id: str, contents: str) -> Document:
        first, _, text = contents.partition("\n")
        title = first.strip()
        if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
            title = title[1:-1]
        doc = cls(id=id, title=title, text=text)
        return doc if doc.contents == contents else cls(id=id, title=title, text=text, verbatim=contents)

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "contents": self.contents}


@dataclass(frozen=True)
class QAItem:
    """One benchmark question with its gold answer aliases (FlashRAG QA format)."""

    id: str
    question: str
    golden_answers: tuple[str, ...]
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        golds = self.golden_answers
        # a bare string is one alias: kept as given, "Paris" was written as five one-letter golds
        golds = (golds,) if isinstance(golds, str) else tuple(golds)
        if not all(isinstance(g, str) for g in golds):
            raise TypeError(f"question {self.id!r}: golden_answers must be strings, got {list(golds)!r:.200}")
        object.__setattr__(self, "golden_answers", golds)

    @property
    def benchmark(self) -> str | None:
        return self.metadata.get("benchmark")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "question": self.question,
            "golden_answers": list(self.golden_answers),
        }
        if self.metadata:
            out["metadata"] = self.metadata
        return out
