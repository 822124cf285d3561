"""Audit step records from another system (a Dr. Zero or verl run): one JSON object per graded
item, one per line,

    {"round": int, "step": int, "source_id": str, "source": str, "question": str, "label": str,
     "responses": [str, ...], "gold_answers": [str, ...]}        (gold_answers optional)

`read_records` groups them into the step records `audit_steps` reads (every step a proposer step:
its responses are the feedback the label was paid with). `GoldJudge` uses `gold_answers` as truth
exactly as the oracle uses the world's answers; items without them stay unresolved.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from selfevo.audit.judges import Verdict, usable_answers
from selfevo.corpus import DataError, iter_json_lines
from selfevo.evaluate import answers_match

NonEmpty = Annotated[str, StringConstraints(min_length=1)]


class ExternalRecord(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    round: int = Field(ge=0)
    step: int = Field(ge=0)
    source_id: NonEmpty
    source: NonEmpty
    question: NonEmpty
    label: str
    responses: list[str] = Field(min_length=1)
    gold_answers: list[str] | None = None


def read_records(path: str | os.PathLike) -> list[dict]:
    """Step records from a records JSONL file; a malformed line raises DataError(file:line)."""
    steps: dict[tuple[int, int], dict] = {}
    for lineno, obj in iter_json_lines(path):
        try:
            rec = ExternalRecord.model_validate(obj)
        except ValidationError as e:
            err = e.errors(include_url=False, include_input=False)[0]
            where = ".".join(str(x) for x in err["loc"]) or "record"
            raise DataError(path, lineno, f"field '{where}': {err['msg']}") from None
        step = steps.setdefault((rec.round, rec.step), {"round": rec.round, "step": rec.step,
                                                        "kind": "proposer", "items": []})
        step["items"].append({
            "item_id": f"{os.path.basename(path)}:{lineno}", "source_id": rec.source_id,
            "source_ids": [rec.source_id], "sources": [{"id": rec.source_id, "text": rec.source}],
            "question": rec.question, "adopted_label": rec.label, "responses": rec.responses,
            "gold_answers": rec.gold_answers, "line": lineno})
    if not steps:
        raise DataError(path, None, "no records")
    return [steps[k] for k in sorted(steps)]


class GoldJudge:
    """Truth from the records' own `gold_answers`: correct iff the answer matches any gold answer
    under the loop's matcher, as the oracle judges. No gold answers: unresolved."""

    name = "gold"

    def judge(self, items: Sequence[dict]) -> list[Verdict]:
        out = []
        for it in items:
            gold = usable_answers(it.get("gold_answers") or [])
            if not gold:
                out.append(Verdict(False, reason="no gold answers"))
                continue

            def correct(ans: str, gold=gold) -> bool:
                return any(answers_match(ans, g) for g in gold)

            out.append(Verdict(True, correct(it["adopted_label"]), tuple(correct(r) for r in it["responses"]),
                               tuple(gold)))
        return out
