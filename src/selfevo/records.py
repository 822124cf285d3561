"""The typed records every room exchanges.

Documents and QA items are the data formats (FlashRAG / Search-R1); the loop's step records
live with the loop's schema version so a reader can refuse records it does not understand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Document:
    """One retrievable passage. FlashRAG stores it as `{"id", "contents"}` with the title,
    in double quotes, on the first line of `contents`."""

    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        return f'"{self.title}"\n{self.text}'

    @classmethod
    def from_contents(cls, id: str, contents: str) -> Document:
        title, _, text = contents.partition("\n")
        title = title.strip()
        if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
            title = title[1:-1]
        return cls(id=id, title=title, text=text)

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "contents": self.contents}


@dataclass(frozen=True)
class QAItem:
    """One benchmark question with its gold answer aliases (FlashRAG QA format)."""

    id: str
    question: str
    golden_answers: tuple[str, ...]
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

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
