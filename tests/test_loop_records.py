"""The step-record builders (`records.item_record`, `malformed_record`, `step_record`) every writer
uses -- the loop, the engine's rewards, admission and empty solver steps -- and the admission cap
(`loop.engine.cap_admissions`) the loop and the engine's admission share. Records are versioned
and read by the audit: the layout below is frozen byte for byte."""

from __future__ import annotations

import json

from selfevo.loop.admission import Decision
from selfevo.loop.engine import cap_admissions
from selfevo.records import MALFORMED_TEXT_CHARS, SCHEMA_VERSION, item_record, malformed_record, step_record

GRADER = {"id": "aux-1@r1", "trained_on": {"folds": [1], "rounds": [1]}}


def _item(**extra):
    return item_record(item_id="r2-s44-0", source_id="d0", source_ids=("d0", "d2"), fold=0, source_folds=(0, 1),
                       hops=2, question="Who?", draft_label="Ann", adopted_label="Ann", admitted=True,
                       responses=["Ann", "Bob", "Ann"], k=2, reward=2 / 3, grader=GRADER, **extra)


def test_item_record_layout():
    assert json.dumps(_item(admission={"over_budget": True})) == (
        '{"item_id": "r2-s44-0", "source_id": "d0", "source_ids": ["d0", "d2"], "fold": 0, "source_folds": [0, 1], '
        '"hops": 2, "question": "Who?", "draft_label": "Ann", "adopted_label": "Ann", "admitted": true, '
        '"responses": ["Ann", "Bob", "Ann"], "k": 2, "reward": 0.666667, '
        '"grader": {"id": "aux-1@r1", "trained_on": {"folds": [1], "rounds": [1]}}, '
        '"admission": {"over_budget": true}}')
    assert list(_item()) == ["item_id", "source_id", "source_ids", "fold", "source_folds", "hops", "question",
                             "draft_label", "adopted_label", "admitted", "responses", "k", "reward", "grader"]


def test_step_record_layout_rounds_float_stats_and_keeps_malformed_last():
    bad = malformed_record(item_id="r2-s44-1", source_id="d1", hops=1, question="", draft_label="x",
                           format_error="empty question", reward=-0.5)
    rec = step_record(round=2, step=44, step_in_round=1, kind="proposer", items=[_item()],
                      stats={"reward": 1 / 7, "malformed": 1, "admitted": 1}, malformed=[bad])
    assert list(rec) == ["schema", "round", "step", "step_in_round", "kind", "items", "stats", "malformed"]
    assert rec["schema"] == SCHEMA_VERSION and rec["stats"] == {"reward": 0.142857, "malformed": 1, "admitted": 1}
    assert json.dumps(rec["malformed"]) == ('[{"item_id": "r2-s44-1", "source_id": "d1", "hops": 1, "question": "", '
                                            '"draft_label": "x", "format_error": "empty question", "reward": -0.5}]')
    # a language model's malformed proposal keeps what it wrote (nothing showed it; a helper's review), cut
    written = malformed_record(item_id="x", source_id="d1", hops=1, question="", draft_label="",
                               format_error="no final question", reward=-0.5, text="<search> a " * 500)
    assert list(written)[-1] == "text" and written["text"] == ("<search> a " * 500)[:MALFORMED_TEXT_CHARS]
    empty = step_record(round=1, step=7, step_in_round=7, kind="solver", items=[], stats={}, malformed=[])
    assert json.dumps(empty) == (f'{{"schema": {SCHEMA_VERSION}, "round": 1, "step": 7, "step_in_round": 7, '
                                 '"kind": "solver", "items": [], "stats": {}}')


def test_the_loops_records_rebuild_byte_for_byte(tmp_path):
    """Every line a sim run writes is what the builders write from its fields."""
    from selfevo.config import load_config
    from selfevo.evolve import evolve
    from selfevo.runs import RunDir

    cfg = load_config(None, ["world.name=small", "loop.rounds=2", "loop.admit_per_round=21", "loop.proposer_steps=2",
                             "loop.solver_steps=2", "treatment=crossfit"])
    evolve(cfg, tmp_path / "run", progress=False, audit=False)
    lines = RunDir(tmp_path / "run").steps_path.read_text().splitlines()
    assert any("over_budget" in line for line in lines)  # 2 x 11 proposals, 21 admitted: the cap
    for line in lines:
        row = json.loads(line)
        items = [item_record(**it) for it in row["items"]]
        again = step_record(round=row["round"], step=row["step"], step_in_round=row["step_in_round"],
                            kind=row["kind"], items=items, stats=row["stats"], malformed=row.get("malformed"))
        assert json.dumps(again) == json.dumps(row)


def test_cap_admissions_holds_the_budget_in_order():
    decisions = [Decision(True, "a"), Decision(False, "b"), Decision(True, "c", {"msv": 1}), Decision(True, "d")]
    assert cap_admissions(decisions, 2) == -1
    assert [d.admitted for d in decisions] == [True, False, True, False]
    assert decisions[3].detail == {"over_budget": True} and decisions[2].detail == {"msv": 1}
    assert cap_admissions([Decision(True, "e")], -1) == -2


def test_a_malformed_proposal_that_wrote_nothing_keeps_its_empty_text():
    """`text=""` (the model's last action was empty) is what it wrote, recorded as such; only a proposal with no
    text given (a sim agent's) has no `text` field."""
    args = dict(item_id="r1-s1-0", source_id="d0", hops=1, question="", draft_label="", format_error="no answer",
                reward=-1.0)
    assert malformed_record(**args, text="")["text"] == ""
    assert "text" not in malformed_record(**args)
