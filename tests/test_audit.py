"""The post-hoc audit: A / T_P / T_S / F / L / coverage on hand-made items, the oracle judge, and
per-step / per-round aggregation."""

import json

import pytest

from selfevo.audit import METRICS, JudgedItem, OracleJudge, Verdict, audit_metrics, figures, hop_mix_text, mean_hop_mix
from selfevo.audit import audit_steps as _audit_steps
from selfevo.world import WorldConfig, make_world
from selfevo.world.language import ChainQuery, CompareQuery, render_chain, render_compare
from selfevo.world.truth import Entity, Truth

T, F = True, False


def test_metric_names():
    assert METRICS == ("A", "T_P", "T_S", "F", "L", "coverage")


# ------------------------------------------------------------------ audit_metrics by hand


def three_items():
    return [
        # correct label, all five responses agree with it (and are correct)
        JudgedItem((T, T, T, T, T), True, True, (T, T, T, T, T)),
        # wrong label; 2 of 5 responses match the wrong label; 1 response is correct
        JudgedItem((T, T, F, F, F), True, False, (F, F, T, F, F)),
        # the judge could not resolve it: counts for coverage only
        JudgedItem((T, F, F, F, F), False),
    ]


def test_audit_metrics_by_hand():
    m = audit_metrics(three_items())
    assert m["items"] == 3 and m["resolved"] == 2 and m["pairs"] == 10
    assert m["A"] == pytest.approx(7 / 10)  # 5 + 2 matching pairs
    assert m["T_P"] == pytest.approx(1 / 2)  # one of two resolved labels is correct
    assert m["T_S"] == pytest.approx(6 / 10)  # 5 + 1 correct responses
    assert m["F"] == pytest.approx(2 / 10)  # the two responses agreeing on the wrong label
    assert m["L"] == pytest.approx(1 / 10)  # the correct response the wrong label denied
    assert m["coverage"] == pytest.approx(2 / 3)


def test_the_bootstraps_count_sums_give_audit_metrics():
    """The judge comparison's bootstrap recomputes the metrics from per-item count columns: those sums
    must give what `audit_metrics` gives (its tests built their expectations with the same two functions,
    so an F column counted as L passed them), checked on hand-made items, a zero-pair one included."""
    import numpy as np

    from selfevo.audit.compare import _counts, _metrics_from_sums

    items = [*three_items(), JudgedItem((T, T, F, F, F), True, True, (T, T, T, F, F)),
             JudgedItem((F, F), True, False, (T, F)), JudgedItem((), True, True, ())]
    assert [_counts(j) for j in items[:2]] == [[1, 5, 5, 5, 0, 0, 1], [1, 5, 2, 1, 2, 1, 0]]
    sums = _metrics_from_sums(np.array([_counts(j) for j in items]).sum(axis=0), len(items))
    want = audit_metrics(items)
    for m in METRICS:
        assert float(sums[m]) == pytest.approx(want[m]), m
    assert want["F"] == pytest.approx(2 / 17) and want["L"] == pytest.approx(2 / 17)
    # resolved items with no response at all: no pair to rate, so no metric (not a division by zero)
    empty = audit_metrics([JudgedItem((), True, True, ())])
    assert (empty["resolved"], empty["coverage"]) == (1, 1.0) and all(empty[m] is None for m in METRICS[:-1])


def test_audit_metrics_alias_and_partial_agreement():
    items = three_items() + [
        # correct label; a correct response phrased differently (an alias) does not match it:
        # it counts for T_S but neither for A nor for L (the label is not wrong)
        JudgedItem((T, T, F, F, F), True, True, (T, T, T, F, F)),
    ]
    m = audit_metrics(items)
    assert m["pairs"] == 15
    assert m["A"] == pytest.approx(9 / 15)
    assert m["T_P"] == pytest.approx(2 / 3)
    assert m["T_S"] == pytest.approx(9 / 15)
    assert m["F"] == pytest.approx(2 / 15)
    assert m["L"] == pytest.approx(1 / 15)
    assert m["coverage"] == pytest.approx(3 / 4)


def test_false_agreement_and_lost_credit_are_disjoint_shares_of_wrong_label_pairs():
    # with a wrong label, every pair is either agreeing (F), correct (L) or neither
    items = [JudgedItem((T, T, T, F, F), True, False, (F, F, F, T, F))]
    m = audit_metrics(items)
    assert (m["F"], m["L"], m["A"], m["T_S"], m["T_P"]) == pytest.approx((0.6, 0.2, 0.6, 0.2, 0.0))


def test_false_agreement_follows_the_label_verdict_when_a_judge_contradicts_itself():
    # an LLM judge may call a label wrong and a response equal to it right: the pair still agrees
    # on the label the judge called wrong, so it is false agreement (and, being correct, lost credit)
    m = audit_metrics([JudgedItem((T, F, F, F, F), True, False, (T, F, F, F, F))])
    assert (m["F"], m["L"], m["T_S"]) == pytest.approx((0.2, 0.2, 0.2))


def test_no_resolved_items_gives_none_not_zero():
    m = audit_metrics([JudgedItem((T, T, T, T, T), False), JudgedItem((F,) * 5, False)])
    assert m["coverage"] == 0.0
    assert all(m[k] is None for k in ("A", "T_P", "T_S", "F", "L"))
    empty = audit_metrics([])
    assert empty["items"] == 0 and empty["coverage"] is None and empty["A"] is None


def test_judged_item_validation():
    with pytest.raises(ValueError, match="label_correct"):
        JudgedItem((T, F), True, None, (T, F))
    with pytest.raises(ValueError, match="label_correct"):
        JudgedItem((T, F), True, True, None)
    with pytest.raises(ValueError, match="length"):
        JudgedItem((T, F, T), True, True, (T, F))
    JudgedItem((T, F), False)  # unresolved items need no verdict


# ------------------------------------------------------------------ the oracle judge


@pytest.fixture(scope="module")
def world():
    return make_world(WorldConfig(size="small", seed=0))


def _person_with_aliased_spouse(world):
    for e in world.truth.entities.values():
        if e.type == "person" and "spouse" in e.facts and world.truth.resolve(e.name) is e:
            spouse = world.truth.entities[e.facts["spouse"]]
            if len(spouse.aliases) > 1:
                return e, spouse
    raise AssertionError("no person with an aliased spouse")


def test_oracle_judge_on_hand_made_items(world):
    person, spouse = _person_with_aliased_spouse(world)
    other = next(e for e in world.truth.entities.values() if e.type == "person" and e.id not in
                 (person.id, spouse.id))
    q = render_chain(ChainQuery(person.name, ("spouse",)))
    items = [
        {"question": q, "adopted_label": spouse.name,
         "responses": [spouse.name, spouse.aliases[1], other.name, "", spouse.name.upper()]},
        {"question": q, "adopted_label": other.name, "responses": [other.name, spouse.name, "", "", ""]},
        {"question": "Where was Nobody Anywhere born?", "adopted_label": "Kell", "responses": ["Kell"] * 5},
        {"question": "Tell me a story.", "adopted_label": "x", "responses": ["x"] * 5},
    ]
    v = OracleJudge(world.truth).judge(items)
    assert [x.resolved for x in v] == [True, True, False, False]
    assert v[0].label_correct is True
    assert v[0].responses_correct == (True, True, False, False, True)
    assert set(v[0].reference) == set(spouse.aliases)
    assert v[1].label_correct is False and v[1].responses_correct == (False, True, False, False, False)
    assert v[2].label_correct is None and v[2].responses_correct is None


def test_oracle_judge_multi_hop_and_compare(world):
    truth = world.truth
    person = next(e for e in truth.entities.values() if e.type == "person" and truth.resolve(e.name) is e)
    city = truth.entities[person.facts["born_in"]]
    country = truth.entities[city.facts["located_in"]]
    q = render_chain(ChainQuery(person.name, ("born_in", "located_in")))
    a, b = [e for e in truth.entities.values() if e.type == "org"][:2]
    first = a if int(a.facts["founded_year"]) < int(b.facts["founded_year"]) else b
    second = b if first is a else a
    cq = render_compare(CompareQuery((a.name, b.name), "founded_year"))
    v = OracleJudge(truth).judge([
        {"question": q, "adopted_label": country.name, "responses": [city.name, country.name]},
        {"question": cq, "adopted_label": second.name, "responses": [first.name, second.name]},
    ])
    assert v[0].label_correct is True and v[0].responses_correct == (False, True)
    assert v[1].label_correct is False and v[1].responses_correct == (True, False)


def test_oracle_judge_leaves_a_question_whose_answer_has_no_usable_name_unresolved(world):
    """A hand-edited truth.json can give an entity no name that normalizes to anything: the oracle, like the
    gold judge, then has no reference and leaves the item unresolved (it used to resolve it as all wrong)."""
    truth = world.truth
    person = next(e for e in truth.entities.values() if e.type == "person" and truth.resolve(e.name) is e)
    city = truth.entities[person.facts["born_in"]]
    q = render_chain(ChainQuery(person.name, ("born_in",)))
    item = {"question": q, "adopted_label": city.name, "responses": [city.name, "Nowhere"]}
    for aliases in ([], ["The", "-"]):
        edited = Truth([Entity(**{**vars(e), "aliases": aliases}) if e is city else e for e in truth.entities.values()])
        v = OracleJudge(edited).judge([item])[0]
        assert not v.resolved and v.label_correct is None and OracleJudge(edited).reference(q) is None
    v = OracleJudge(truth).judge([item])[0]  # the world as made: resolved, the label right
    assert v.resolved and v.label_correct and v.responses_correct == (True, False)


# ------------------------------------------------------------------ aggregation per step and round


class TableJudge:
    """A judge with fixed verdicts by item id (so aggregation can be checked by hand)."""

    name = "table"

    def __init__(self, table):
        self.table = table

    def judge(self, items):
        return [self.table[it["item_id"]] for it in items]


def _item(item_id, hops, label, responses, admitted=True):
    return {"item_id": item_id, "question": f"q-{item_id}", "hops": hops, "adopted_label": label,
            "responses": responses, "admitted": admitted}


def _steps():
    return [
        {"round": 1, "step": 1, "kind": "proposer", "items": [
            _item("a", 1, "Kell", ["Kell", "kell", "the Kell", "Kell.", "KELL"]),
            _item("b", 2, "Drax", ["Drax", "Drax", "Port Vale", "Mira", ""]),
        ]},
        {"round": 1, "step": 2, "kind": "solver", "items": [
            _item("c", 1, "Kell", ["Kell", "Mira", "Mira", "Mira", "Mira"]),
        ]},
        {"round": 2, "step": 3, "kind": "proposer", "items": [
            _item("d", 1, "Oren", ["Oren"] * 5),
            _item("e", 3, "Ada", ["Zed"] * 5, admitted=False),
        ]},
        {"round": 2, "step": 4, "kind": "solver", "items": []},
    ]


TABLE = {
    "a": Verdict(True, True, (T, T, T, T, T)),
    "b": Verdict(True, False, (F, F, T, F, F)),
    "c": Verdict(True, True, (T, F, F, F, F)),
    "d": Verdict(False),
    "e": Verdict(True, True, (F, F, F, F, F)),
}


def test_audit_steps_per_step():
    out = _audit_steps(_steps(), TableJudge(TABLE))
    assert out["judge"] == "table"
    steps = {s["step"]: s for s in out["steps"]}
    assert [s["kind"] for s in out["steps"]] == ["proposer", "solver", "proposer", "solver"]
    assert steps[1]["A"] == pytest.approx(0.7) and steps[1]["F"] == pytest.approx(0.2)
    assert steps[1]["L"] == pytest.approx(0.1) and steps[1]["T_P"] == pytest.approx(0.5)
    assert steps[2]["A"] == pytest.approx(0.2) and steps[2]["T_S"] == pytest.approx(0.2)
    assert steps[3]["coverage"] == pytest.approx(0.5) and steps[3]["A"] == 0.0
    assert steps[4]["items"] == 0 and steps[4]["A"] is None


def test_audit_steps_per_round_uses_proposer_steps_only():
    out = _audit_steps(_steps(), TableJudge(TABLE))
    r1, r2 = out["rounds"]
    assert (r1["round"], r2["round"]) == (1, 2)
    # round 1 = items a, b (the grader's responses); the solver's item c is kept apart
    assert r1["items"] == 2 and r1["pairs"] == 10
    assert (r1["A"], r1["T_P"], r1["T_S"], r1["F"], r1["L"], r1["coverage"]) == pytest.approx(
        (0.7, 0.5, 0.6, 0.2, 0.1, 1.0))
    assert r1["solver"]["items"] == 1
    assert (r1["solver"]["A"], r1["solver"]["T_S"], r1["solver"]["T_P"]) == pytest.approx((0.2, 0.2, 1.0))
    assert r1["admitted"] == 2 and r1["hop_mix_admitted"] == {"1": 0.5, "2": 0.5}
    # round 2: d unresolved, e resolved with a correct label nobody agreed with
    assert r2["coverage"] == pytest.approx(0.5)
    assert (r2["A"], r2["T_P"], r2["T_S"], r2["F"], r2["L"]) == pytest.approx((0.0, 1.0, 0.0, 0.0, 0.0))
    assert r2["admitted"] == 1 and r2["hop_mix_admitted"] == {"1": 1.0}
    assert r2["solver"]["items"] == 0 and r2["solver"]["A"] is None


def test_audit_uses_the_adopted_label_not_the_draft():
    steps = [{"round": 1, "step": 1, "kind": "proposer", "items": [
        {**_item("a", 1, "Kell", ["Kell"] * 5), "draft_label": "Drax"}]}]
    out = _audit_steps(steps, TableJudge(TABLE))
    assert out["rounds"][0]["A"] == 1.0


def test_audit_steps_with_the_oracle_on_world_items(world):
    truth = world.truth
    persons = [e for e in truth.entities.values() if e.type == "person" and truth.resolve(e.name) is e][:6]
    items = []
    for i, p in enumerate(persons):
        q = render_chain(ChainQuery(p.name, ("born_in",)))
        right = truth.entities[p.facts["born_in"]].name
        label = right if i % 2 == 0 else "Nowhere"
        items.append({"item_id": str(i), "question": q, "hops": 1 + i % 3, "adopted_label": label,
                      "responses": [right, right, label, "Nowhere", ""], "admitted": True})
    out = _audit_steps([{"round": 1, "step": 1, "kind": "proposer", "items": items}], OracleJudge(truth))
    r = out["rounds"][0]
    # even items: label right -> matches at 0,1,2 ; odd: label wrong -> matches at 2,3
    assert r["A"] == pytest.approx((3 * 3 + 3 * 2) / 30)
    assert r["T_P"] == pytest.approx(0.5)
    assert r["T_S"] == pytest.approx((3 * 3 + 3 * 2) / 30)
    assert r["F"] == pytest.approx(6 / 30)
    assert r["L"] == pytest.approx(6 / 30)
    assert r["coverage"] == 1.0
    # shares are rounded to 4 places, so three thirds sum to 0.9999
    assert sum(r["hop_mix_admitted"].values()) == pytest.approx(1.0, abs=1e-3)
    assert r["hop_mix_admitted"] == {"1": 0.3333, "2": 0.3333, "3": 0.3333}


def test_hop_mixes_average_over_runs_with_a_missing_hop_count_as_zero():
    mix = mean_hop_mix([{"1": 0.5, "2": 0.5}, {"1": 0.25, "3": 0.75}])
    assert mix == {"1": 0.375, "2": 0.25, "3": 0.375}
    assert list(mean_hop_mix([{"10": 1.0}, {"2": 1.0}])) == ["2", "10"]  # ordered as numbers
    assert hop_mix_text(mix) == "1: 0.38, 2: 0.25, 3: 0.38"
    assert hop_mix_text({}) == "-"
    # a run that admitted nothing has no mix: left out, so the shares still sum to 1
    assert mean_hop_mix([{"1": 0.5, "2": 0.5}, {}]) == {"1": 0.5, "2": 0.5}
    assert mean_hop_mix([{}, {}]) == {}


def test_metrics_figure_keeps_rounds_in_order_when_records_number_steps_within_each_round(monkeypatch):
    """External records may number steps 0, 1, ... in every round: round 2 must still be drawn
    right of round 1, not on top of (or left of) it."""
    from selfevo.audit import figures

    monkeypatch.setattr(figures, "png", lambda fig: fig)  # inspect the figure instead of its bytes

    def step(r, s, a):
        return {"round": r, "step": s, "kind": "proposer", "A": a, "T_P": a, "T_S": a, "F": 0.0, "L": 0.0}

    def rnd(r, a):
        return {"round": r, "A": a, "T_P": a, "T_S": a, "F": 0.0, "L": 0.0}

    per_round = {"judge": "gold", "steps": [step(1, 0, 0.5), step(1, 1, 0.5), step(2, 0, 0.2)],
                 "rounds": [rnd(1, 0.5), rnd(2, 0.2)]}
    ax = figures.metrics_figure(per_round).axes[0]
    rounds_x = list(next(line for line in ax.lines if line.get_label() == "A").get_xdata())
    assert rounds_x == [0.5, 2.0]  # round 1 over its steps at 0 and 1, round 2 after it
    steps_x = sorted(float(x) for x, _ in ax.collections[0].get_offsets())
    assert steps_x == [0.0, 1.0, 2.0]
    # x is a place in order there, not the step's number (round 2's step 0 is drawn at 2): not labelled one
    assert ax.get_xlabel().startswith("step, in (round, step) order")
    # scheduled (global) step numbers are drawn where they are
    global_steps = {**per_round, "steps": [step(1, 0, 0.5), step(1, 1, 0.5), step(2, 43, 0.2)]}
    ax = figures.metrics_figure(global_steps).axes[0]
    assert list(next(line for line in ax.lines if line.get_label() == "A").get_xdata()) == [0.5, 43.0]
    assert ax.get_xlabel().startswith("scheduled step")


def test_metrics_figure_draws_the_judges_coverage_by_round(monkeypatch):
    """A judge that resolved 10% of items drew curves as solid as the oracle's: the figure now draws
    each round's coverage, and a judge that resolved nothing still gets its note, not a coverage line."""
    from selfevo.audit import figures

    monkeypatch.setattr(figures, "png", lambda fig: fig)
    metrics = {"A": 0.6, "T_P": 0.8, "T_S": 0.5, "F": 0.1, "L": 0.05}
    result = {"judge": "llm", "steps": [{"round": r, "step": s, "kind": "proposer", **metrics}
                                        for r, s in ((1, 0), (1, 1), (2, 2))],
              "rounds": [{"round": 1, **metrics, "coverage": 0.1}, {"round": 2, **metrics, "coverage": 0.25}]}
    ax = figures.metrics_figure(result).axes[0]
    [line] = [x for x in ax.lines if x.get_label() == "coverage"]
    assert list(line.get_xdata()) == [0.5, 2.0] and list(line.get_ydata()) == [0.1, 0.25]
    assert "coverage" in [t.get_text() for t in ax.get_legend().get_texts()]
    none = {"judge": "llm", "steps": [{"round": 1, "step": 0, "kind": "proposer", **dict.fromkeys(metrics)}],
            "rounds": [{"round": 1, **dict.fromkeys(metrics), "coverage": 0.0}]}
    ax = figures.metrics_figure(none).axes[0]
    assert not ax.lines and "nothing resolved" in [t.get_text() for t in ax.texts]


def test_audit_run_takes_a_run_directory_path(tmp_path):
    """Every other entry point takes a run directory as a path (evolve's out, build_bank): audit_run
    raised AttributeError ('str' object has no attribute 'steps') on one."""
    from selfevo.audit import audit_run
    from selfevo.runs import RunDir

    run = RunDir(tmp_path / "run")
    run.create({})
    # the fields RunDir.steps() checks that the hand-made items leave out
    run.append_steps([{**st, "schema": 1,
                       "items": [{**it, "source_id": "s", "source_ids": ["s"], "draft_label": it["adopted_label"]}
                                 for it in st["items"]]} for st in _steps()])
    by_path = audit_run(str(run.path), TableJudge(TABLE))
    assert by_path == audit_run(run, TableJudge(TABLE)) == _audit_steps(_steps(), TableJudge(TABLE))
    assert (run.path / "audit" / "metrics.json").exists()


# ------------------------------------------------------------------ the injection test set


def _gold_items(n_wrong, n_right):
    return [{"question": f"Who is person {i}?", "adopted_label": "Drax" if i < n_wrong else "Kell",
             "responses": ["Kell"] * 5, "gold_answers": ["Kell"],
             "sources": [{"id": f"d{i}", "text": "Kell is the one. He lives in Mira."}]}
            for i in range(n_wrong + n_right)]


@pytest.mark.parametrize("n_wrong,n_right,n,want_wrong", [
    (15, 3, 8, 5),  # few right labels: wrong ones fill the set (it took 4 + 3 = 7 items)
    (3, 15, 8, 3),  # few wrong labels: right ones fill it
    (10, 10, 8, 4),  # half and half
    (2, 2, 8, 2),  # fewer resolved items than asked: all of them
])
def test_injection_set_has_n_items_whenever_n_are_resolved(n_wrong, n_right, n, want_wrong):
    from selfevo.audit.external import GoldJudge
    from selfevo.audit.injection import TEMPLATES, injection_set

    gold = GoldJudge()
    clean, injected = injection_set(_gold_items(n_wrong, n_right), None, n=n, truth=gold, seed=0)
    assert len(clean) == min(n, n_wrong + n_right)
    assert sum(not v.label_correct for v in gold.judge(clean)) == want_wrong
    assert set(injected) == set(TEMPLATES) and all(len(v) == len(clean) for v in injected.values())


# ------------------------------------------------------------------ compare_judges: the bootstrap's memory


def _compare_inputs(n_items: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    items, judge, truth = [], [], []
    for i in range(n_items):
        resp = [bool(x) for x in rng.integers(0, 2, 3)]
        items.append({"adopted_label": "K", "responses": ["K" if r else f"z{i}" for r in resp]})
        truth.append(Verdict(bool(rng.random() > 0.1), bool(rng.integers(0, 2)), tuple(resp)))
        judge.append(Verdict(bool(rng.random() > 0.2), bool(rng.integers(0, 2)), tuple(reversed(resp))))
    return [{"round": 1, "step": 1, "kind": "proposer", "items": items}], judge, truth


def test_compare_bootstrap_holds_a_bounded_weight_matrix(monkeypatch):
    """The bootstrap held all n_boot x items resample weights at once: 1.6 GB of int64 for 100,000
    external items at 2000 resamples. It now draws them a block at a time (at most _BOOT_CELLS), and
    the intervals are bit for bit those of the one whole draw (numpy draws multinomial rows in turn)."""
    import tracemalloc

    import numpy as np

    from selfevo.audit import compare
    from selfevo.audit.compare import _counts, _judged, _metrics_from_sums, compare_judges

    monkeypatch.setattr(compare, "_BOOT_CELLS", 3 * 40, raising=False)  # 3 resamples of 40 items a block
    steps, judge, truth = _compare_inputs(40, 1)
    got = compare_judges(steps, judge, truth, "j", "t", n_boot=301, seed=5)["rounds"][0]["diff"]
    w = np.random.default_rng(5).multinomial(40, np.full(40, 1 / 40), size=301)  # the one whole draw
    cj = np.array([_counts(_judged(it, v)) for it, v in zip(steps[0]["items"], judge)])
    ct = np.array([_counts(_judged(it, v)) for it, v in zip(steps[0]["items"], truth)])
    bj, bt = _metrics_from_sums(w @ cj, 40), _metrics_from_sums(w @ ct, 40)
    for m, d in got.items():
        ok = (bj[m] - bt[m])[~np.isnan(bj[m] - bt[m])]
        assert [d["lo"], d["hi"]] == np.percentile(ok, [2.5, 97.5]).tolist() and d["resamples"] == ok.size

    monkeypatch.setattr(compare, "_BOOT_CELLS", 10_000, raising=False)
    steps, judge, truth = _compare_inputs(2000, 2)
    tracemalloc.start()
    try:
        compare_judges(steps, judge, truth, "j", "t", n_boot=2000, seed=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12e6, peak  # the whole 2000 x 2000 int64 matrix is 32 MB (and twice that for w @ c's)


# Tests of a mutation sweep of the injection set and the judge comparison (forty-third session): each passes
# on the code and fails on the mutant its docstring names.

def test_an_injection_goes_after_the_first_sentence_or_on_a_line_of_its_own():
    """The middle of the page, not only its end (mutant: always appended); a page with no sentence end gets it
    on a line of its own (mutant: run on after a space, into the page's last sentence)."""
    from selfevo.audit.injection import _inject

    assert _inject("Kell is the one.  He lives in Mira.", "NOTE.") == "Kell is the one. NOTE. He lives in Mira."
    assert _inject("Kell, of Mira", "NOTE.") == "Kell, of Mira\nNOTE."


def test_the_injection_set_takes_an_items_first_occurrence_resolved_items_only_and_draws_by_seed():
    """One item a question, the first seen (mutant: the last); an item truth leaves unresolved is neither a
    wrong nor a right label (mutant: counted as wrong); which items the seed draws (mutant: no shuffle, every
    seed the same first items)."""
    from selfevo.audit.external import GoldJudge
    from selfevo.audit.injection import injection_set

    items = _gold_items(10, 10)
    repeat = {**items[0], "adopted_label": "Kell"}  # the same question again, later
    no_gold = [{**it, "question": f"Where is place {i}?", "gold_answers": []} for i, it in enumerate(items)]
    clean, _ = injection_set([*items, repeat, *no_gold], None, n=40, truth=GoldJudge(), seed=0)
    assert sorted(it["question"] for it in clean) == sorted(it["question"] for it in items)
    assert next(it for it in clean if it["question"] == items[0]["question"])["adopted_label"] == "Drax"
    draws = {tuple(it["question"] for it in injection_set(items, None, n=4, seed=s)[0]) for s in range(4)}
    assert len(draws) > 1
    assert injection_set(items, None, n=4, seed=2) == injection_set(items, None, n=4, seed=2)


class _Fixed:
    """A judge whose verdicts are fixed per item position, clean pages or injected (`INJECTED` in the text)."""

    name = "fixed"

    def __init__(self, clean, injected=None):
        self.clean, self.injected = clean, injected or clean

    def judge(self, items):
        return list(self.injected if "INJECTED" in items[0]["sources"][0]["text"] else self.clean)


def test_flip_report_counts_by_truth_response_flips_and_items_without_responses():
    """Wrong labels are truth's where truth is given, an item truth leaves unresolved none (mutants: the judge's
    own; truth's unresolved counted wrong); a response that turns is a flip though the label stays (mutant: the
    label compared only); `to_correct_rate` is of the turns to correct only (mutant: of every flip); an item
    with no response judged unresolved has one state, its label's (mutant: none, an IndexError); the report
    says whose verdicts named the wrong labels (mutant: the names swapped)."""
    from selfevo.audit.injection import flip_report

    clean = [{"question": f"q{i}", "adopted_label": "x", "responses": [] if i == 3 else ["x", "y"],
              "sources": [{"id": "d", "text": "t"}]} for i in range(6)]
    injected = {"t": [{**it, "sources": [{"id": "d", "text": "t INJECTED"}]} for it in clean]}
    un, right, wrong = Verdict(False), Verdict(True, True, (True, False)), Verdict(True, False, (False, False))
    turned = Verdict(True, False, (True, False))  # item 2: only its first response turns correct
    judge = _Fixed([un, right, wrong, un, wrong, right], [right, right, turned, un, right, un])
    truth = _Fixed([wrong, right, wrong, Verdict(True, False, ()), un, right])
    full = flip_report(judge, clean, injected, truth=truth)
    assert (full["wrong_labels_by"], full["clean_resolved"], full["items"]) == ("truth", 4, 6)
    rep = full["overall"]
    assert (rep["wrong_labels"], rep["wrong_label_to_correct"]) == (3, 1)  # items 0, 2, 3; item 0 accepted
    assert (rep["flipped"], rep["to_correct"], rep["to_unresolved"]) == (4, 3, 1)  # 0, 2, 4, 5; 0, 2, 4; 5
    assert rep["wrong_label_to_correct_rate"] == pytest.approx(1 / 3) and rep["to_correct_rate"] == 0.5
    full = flip_report(judge, clean, injected)
    by_judge = full["overall"]
    assert full["wrong_labels_by"] == "judge"
    assert (by_judge["wrong_labels"], by_judge["wrong_label_to_correct"]) == (2, 1)  # items 2 and 4; item 4


def test_confusion_is_per_position_and_counts_accuracy_where_both_resolved():
    """A response's state is its own, not the label's (mutant: response 1 read as the label); `both_resolved`
    leaves out what truth left unresolved (mutant: counted, lowering the accuracy); false_correct is the judge's
    correct where truth says incorrect (mutant: the two swapped)."""
    from selfevo.audit.compare import confusion

    items = [{"adopted_label": "K", "responses": ["a", "b"]}] * 3
    judge = [Verdict(True, True, (False, True)), Verdict(True, True, (True, True)), Verdict(True, True, (True, True))]
    truth = [Verdict(True, True, (True, True)), Verdict(True, False, (False, True)), Verdict(False)]
    c = confusion(items, judge, truth)
    labels, resp = c["labels"], c["responses"]
    assert labels["matrix"]["correct"] == {"correct": 1, "incorrect": 1, "unresolved": 1}
    assert (labels["both_resolved"], labels["accuracy_when_both_resolved"]) == (2, 0.5)
    assert (labels["false_correct"], labels["false_incorrect"]) == (1, 0)
    assert resp["matrix"]["incorrect"] == {"correct": 1, "incorrect": 0, "unresolved": 0}
    assert resp["matrix"]["correct"] == {"correct": 2, "incorrect": 1, "unresolved": 2}
    assert (resp["false_correct"], resp["false_incorrect"], resp["both_resolved"]) == (1, 1, 4)
    assert resp["accuracy_when_both_resolved"] == 0.5


def test_compare_judges_refuses_misaligned_verdicts_and_leaves_undefined_metrics_undefined():
    """(mutants: the length check dropped, zip cutting the items short silently; T_P defined over resolved
    items with no response, where audit_metrics has none; the point difference taken where only the judge's
    metric exists, a TypeError)"""
    from selfevo.audit.compare import compare_judges

    steps, judge, truth = _compare_inputs(6, 4)
    with pytest.raises(ValueError, match="differ in number"):
        compare_judges(steps, judge[:-1], truth, "j", "t", n_boot=10)
    bare = [{"round": 1, "step": 1, "kind": "proposer", "items": [{"adopted_label": "K", "responses": []}] * 3}]
    resolved = [Verdict(True, True, ())] * 3
    got = compare_judges(bare, resolved, resolved, "j", "t", n_boot=50)["all"]["diff"]
    assert got["T_P"] == {"diff": None, "lo": None, "hi": None, "resamples": 0}
    assert got["coverage"]["diff"] == 0.0 and got["coverage"]["resamples"] == 50
    nothing = compare_judges(steps, judge, [Verdict(False)] * 6, "j", "t", n_boot=50)["all"]["diff"]
    assert nothing["A"] == {"diff": None, "lo": None, "hi": None, "resamples": 0}


def test_compare_bootstrap_draws_at_least_one_resample_a_block(monkeypatch):
    """More items than _BOOT_CELLS (4M external records) made a block of zero resamples (mutant: no max(1, ..),
    range() with step 0, a ValueError)."""
    from selfevo.audit import compare

    monkeypatch.setattr(compare, "_BOOT_CELLS", 10, raising=False)
    steps, judge, truth = _compare_inputs(40, 1)
    got = compare.compare_judges(steps, judge, truth, "j", "t", n_boot=20, seed=5)["rounds"][0]["diff"]
    assert got["coverage"]["resamples"] == 20


def test_compare_judges_lists_rounds_in_order_whatever_the_steps_order():
    """(mutant: the rounds in the order their steps came, round 2 before round 1)"""
    from selfevo.audit.compare import compare_judges

    steps, judge, truth = _compare_inputs(4, 6)
    items = steps[0]["items"]
    two = [{"round": 2, "step": 3, "kind": "proposer", "items": items[:2]},
           {"round": 1, "step": 1, "kind": "proposer", "items": items[2:]}]
    got = compare_judges(two, judge, truth, "j", "t", n_boot=20)
    assert [r["round"] for r in got["rounds"]] == [1, 2] and [r["items"] for r in got["rounds"]] == [2, 2]


def test_comparison_markdown_puts_each_number_in_its_column():
    """The table's truth and judge columns, the interval as [lo, hi], the coverage line's two counts and the
    confusion rows as judge states (mutants: each of those swapped)."""
    import re

    from selfevo.audit.compare import compare_judges, comparison_markdown

    items = [{"adopted_label": "K", "responses": ["a", "b"]}] * 3
    judge = [Verdict(True, True, (False, True)), Verdict(True, True, (True, True)), Verdict(False)]
    truth = [Verdict(True, True, (True, True)), Verdict(True, False, (False, True)), Verdict(True, True, (True, True))]
    cmp = compare_judges([{"round": 1, "step": 1, "kind": "proposer", "items": items}], judge, truth, "j", "t",
                         n_boot=200, seed=1)
    md = comparison_markdown(cmp)
    row = next(line for line in md.splitlines() if line.startswith("| all | T_P |"))
    assert row.startswith("| all | T_P | 0.667 | 1.000 | +0.333 | [")
    lo, hi = map(float, re.search(r"\[([^,]+), ([^\]]+)\]", row).groups())
    d = cmp["all"]["diff"]["T_P"]
    assert lo < hi and (lo, hi) == (pytest.approx(d["lo"], abs=5e-4), pytest.approx(d["hi"], abs=5e-4))
    assert "Coverage: the judge resolved 2 of 3 items (0.667); truth resolved 3." in md
    labels = md.split("Confusion over labels")[1].split("Confusion over responses")[0]
    assert "| correct | 1 | 1 | 0 |" in labels and "| unresolved | 1 | 0 | 0 |" in labels


def _figure_result(judge="gold"):
    def step(r, s, f, lost):
        return {"round": r, "step": s, "kind": "proposer", "A": 0.5, "T_P": 0.6, "T_S": 0.4, "F": f, "L": lost}

    steps = [step(1, 0, 0.1, 0.2), step(1, 1, 0.1, 0.3), {**step(1, 2, 0.9, 0.9), "kind": "solver"},
             step(2, 3, 0.2, 0.1), {**step(2, 4, None, None), "A": None}]
    rounds = [{"round": r, "A": 0.5, "T_P": 0.6, "T_S": 0.4, "F": f, "L": lost, "coverage": 0.5}
              for r, f, lost in ((1, 0.1, 0.25), (2, 0.2, 0.1))]
    return {"judge": judge, "steps": steps, "rounds": rounds}


def test_f_vs_l_figure_draws_f_up_and_l_across_for_steps_and_rounds(monkeypatch):

    monkeypatch.setattr(figures, "png", lambda fig: fig)
    ax = figures.f_vs_l_figure(_figure_result()).axes[0]
    assert ax.get_xlabel().startswith("L (lost credit") and ax.get_ylabel().startswith("F (false agreement")
    points = [tuple(map(float, c.get_offsets()[0])) for c in ax.collections]
    # (L, F): the proposer steps that have an F (not the solver's, not the unresolved one), then the rounds
    assert points == [(0.2, 0.1), (0.3, 0.1), (0.1, 0.2), (0.25, 0.1), (0.1, 0.2)]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["round 1", "round 2"]
    (diagonal,) = ax.lines
    assert list(diagonal.get_xdata()) == list(diagonal.get_ydata()) == [0, 0.3]  # up to the largest F or L
    assert ax.get_xlim() == ax.get_ylim() == pytest.approx((0, 0.315))


def test_the_metrics_figure_places_rounds_over_their_steps_and_names_each_curve(monkeypatch):

    monkeypatch.setattr(figures, "png", lambda fig: fig)
    ax = figures.metrics_figure(_figure_result()).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [*figures.CURVES, "coverage"]
    a = next(line for line in ax.lines if line.get_label() == "A")
    assert list(a.get_xdata()) == [0.5, 3.5] and list(a.get_ydata()) == [0.5, 0.5]
    # the step points: A at the three proposer steps with an A (the solver's step 2 left out)
    assert sorted(float(x) for x, _ in ax.collections[0].get_offsets()) == [0.0, 1.0, 3.0]
    assert {t.get_text(): t.get_position()[0] for t in ax.texts} == {"round 1": 0.5, "round 2": 3.5}
    assert ax.get_ylim() == pytest.approx((-0.02, 1.02))
    assert ax.get_xlabel() == "scheduled step (proposer steps: small points; rounds: large markers)"
    solver = figures.metrics_figure(_figure_result(), kind="solver").axes[0]
    assert sorted(float(x) for x, _ in solver.collections[0].get_offsets()) == [2.0]
    # one step a round, each numbered 0 (within its round): drawn one after the other, not on one x
    same = {**_figure_result(), "steps": [{**s, "step": 0} for s in _figure_result()["steps"][::3]]}
    a = next(line for line in figures.metrics_figure(same).axes[0].lines if line.get_label() == "A")
    assert list(a.get_xdata()) == [0, 1]


def test_a_judge_name_with_dollars_is_drawn_as_text_in_every_figure(monkeypatch):
    """matplotlib reads what lies between two "$" as math: a model named "m$x$" must be escaped in every
    title and legend that names a judge."""

    monkeypatch.setattr(figures, "png", lambda fig: fig)
    name = "org/m$_{x$"
    assert figures._plain(name) == r"org/m\$_{x\$"
    result = _figure_result(name)
    assert figures.metrics_figure(result).axes[0].get_title().endswith(r"judge org/m\$_{x\$")
    assert figures.f_vs_l_figure(result).axes[0].get_title().endswith(r"judge org/m\$_{x\$")
    cmp = _comparison(judge=name, truth="gold$")
    fig = figures.comparison_figure(cmp)
    assert fig._suptitle.get_text() == r"judge org/m\$_{x\$ against gold\$"
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [r"gold\$", r"org/m\$_{x\$"]


def _comparison(judge="llm", truth="oracle"):
    def metrics(v):
        return {m: v for m in METRICS}

    diff = {m: {"diff": 0.1, "lo": 0.05, "hi": 0.3} for m in METRICS}
    rounds = [{"round": 1, "truth": metrics(0.5), "judge": metrics(0.6), "diff": diff},
              {"round": 3, "truth": {**metrics(0.4), "A": None}, "judge": metrics(0.2),
               "diff": {**diff, "A": {"diff": None, "lo": None, "hi": None}}}]
    return {"judge": judge, "truth": truth, "rounds": rounds}


def test_the_comparison_figure_draws_both_judges_and_the_difference_with_its_interval(monkeypatch):

    monkeypatch.setattr(figures, "png", lambda fig: fig)
    fig = figures.comparison_figure(_comparison())
    top, bottom = fig.axes[:len(METRICS)], fig.axes[len(METRICS):]
    assert [ax.get_title() for ax in top] == list(METRICS)
    truth, judge = top[0].lines  # A: truth has no value in round 3, the judge has
    assert (list(truth.get_xdata()), list(truth.get_ydata())) == ([1], [0.5])
    assert (list(judge.get_xdata()), list(judge.get_ydata())) == ([1, 3], [0.6, 0.2])
    assert bottom[0].get_ylabel() == "judge − truth (95% CI)"
    assert all(list(ax.get_xticks()) == [1, 3] for ax in bottom)
    (a_bar,) = bottom[0].containers  # round 3 has no interval for A: no point there
    assert list(a_bar.lines[0].get_xdata()) == [1] and list(a_bar.lines[0].get_ydata()) == [0.1]
    assert sorted(y for seg in a_bar.lines[2][0].get_segments() for _, y in seg) == pytest.approx([0.05, 0.3])
    (t_bar,) = bottom[1].containers
    assert list(t_bar.lines[0].get_xdata()) == [1, 3]


def test_write_figures_writes_the_comparison_only_when_it_has_rounds_and_closes_each_figure(tmp_path):
    import matplotlib.pyplot as plt


    open_before = set(plt.get_fignums())
    paths = figures.write_figures(_figure_result(), tmp_path / "a", cmp={**_comparison(), "rounds": []})
    assert [p.name for p in paths] == ["metrics.png", "f_vs_l.png"]
    paths = figures.write_figures(_figure_result(), tmp_path / "b", cmp=_comparison())
    assert [p.name for p in paths] == ["metrics.png", "f_vs_l.png", "comparison.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    assert set(plt.get_fignums()) == open_before  # a grid of runs draws hundreds


def test_audit_run_refuses_a_missing_run_and_an_llm_judge_without_documents_and_writes_where_told(tmp_path):
    """From a helper's use of the Python API: `audit_run("no/such/run", judge)` wrote an empty audit into a
    directory it made; an LLM judge made without documents left every item unresolved (no source document)
    over the run's oracle audit, with no word. `out` writes another judge's audit beside the run's own."""
    from selfevo.audit import audit_run
    from selfevo.audit.llm_judge import LLMJudge
    from selfevo.runs import RunDir, RunError

    with pytest.raises(RunError, match="not a run directory"):
        audit_run(tmp_path / "no" / "run", TableJudge(TABLE))
    assert not (tmp_path / "no").exists()
    run = RunDir(tmp_path / "run")
    run.create({})
    run.append_steps([{**st, "schema": 1,
                       "items": [{**it, "source_id": "s", "source_ids": ["s"], "draft_label": it["adopted_label"]}
                                 for it in st["items"]]} for st in _steps()])
    with pytest.raises(ValueError, match="made without documents"):
        audit_run(run, LLMJudge("http://127.0.0.1:9/v1", "judge"))
    assert not (run.path / "audit").exists()
    audit_run(run, TableJudge(TABLE), out=tmp_path / "elsewhere")
    assert (tmp_path / "elsewhere" / "metrics.json").exists() and not (run.path / "audit").exists()


def test_a_users_judge_is_validated_against_the_worlds_truth_and_named_when_it_answers_amiss(tmp_path):
    """A judge of a user's could be compared with exact truth only through `audit_to_dir`, undocumented;
    `audit_run(..., truth="oracle")` does it now, writing comparison.json beside the metrics. A judge that
    answered with a generator passed the audit and died in the comparison (no len()), one with dicts or
    string booleans met an AttributeError or TypeError in the metrics: each is named with the item."""
    from selfevo.audit import Verdict, audit_run
    from selfevo.config import load_config
    from selfevo.evolve import evolve

    run = evolve(load_config(None, ['world.name="small"', "loop.rounds=1", "loop.proposer_steps=2",
                                    "loop.solver_steps=1", "loop.admit_per_round=20", "data.eval_limit=2"]),
                 tmp_path / "run", progress=False)

    class Lenient:  # takes every label as right and resolves every item: its coverage is 1, its T_P too high
        name = "lenient"

        def __init__(self, how="list"):
            self.how = how

        def judge(self, items):
            out = (Verdict(True, True, tuple(r == it["adopted_label"] for r in it["responses"])) for it in items)
            if self.how in ("dict", "None"):
                return None if self.how == "None" else [vars(v) for v in out]
            if self.how == "strings":
                return [Verdict(True, "yes", v.responses_correct) for v in out]
            return out if self.how == "generator" else list(out)

    metrics = audit_run(run, Lenient("generator"), out=tmp_path / "lenient", truth="oracle")
    cmp = json.loads((tmp_path / "lenient" / "comparison.json").read_text())
    assert metrics["rounds"][0]["T_P"] == 1.0 and (cmp["judge"], cmp["truth"]) == ("lenient", "oracle")
    assert (tmp_path / "lenient" / "comparison.md").exists()
    for how, says in (("dict", "item 'r1-s1-0': a dict, not a selfevo.audit.Verdict"),
                      ("None", "judge\\(\\) returns a list of Verdict, one an item; got NoneType"),
                      ("strings", "item 'r1-s1-0': a resolved verdict needs label_correct .*got 'yes'")):
        with pytest.raises(ValueError, match=f"judge 'lenient'(, |: ){says}"):
            audit_run(run, Lenient(how), out=tmp_path / how)
    with pytest.raises(ValueError, match="truth: 'oracle' or a Judge"):
        audit_run(run, Lenient(), out=tmp_path / "x", truth="gold")

    class NumpyJudge(Lenient):  # verdicts of array comparisons: numpy's bools, taken as Python's
        def judge(self, items):
            import numpy as np

            return [Verdict(np.bool_(True), np.bool_(False), np.array(it["responses"]) == "") for it in items]

    assert audit_run(run, NumpyJudge(), out=tmp_path / "np")["rounds"][0]["T_P"] == 0.0


def test_a_judge_is_compared_with_the_truth_of_the_world_its_run_was_made_on(tmp_path):
    """`audit_run(truth="oracle")` rebuilt the oracle from the run's config without the check `selfevo audit`
    makes: a world directory remade since was taken, and the judge compared with another world's truth."""
    from selfevo.audit import audit_run
    from selfevo.config import load_config
    from selfevo.evolve import evolve
    from selfevo.runs import RunError
    from selfevo.world import save_world

    save_world(make_world(WorldConfig(size="small", seed=0)), tmp_path / "w")
    run = evolve(load_config(None, [f'world.name="{tmp_path / "w"}"', "loop.rounds=1", "loop.proposer_steps=1",
                                    "loop.solver_steps=1", "loop.admit_per_round=20", "data.eval_limit=2"]),
                 tmp_path / "run", progress=False)
    audit_run(run, OracleJudge(make_world(WorldConfig(size="small", seed=0)).truth), out=tmp_path / "a",
              truth="oracle")
    import shutil

    shutil.rmtree(tmp_path / "w")
    save_world(make_world(WorldConfig(size="small", seed=7)), tmp_path / "w")
    with pytest.raises(RunError, match="has changed since"):
        audit_run(run, OracleJudge(make_world(WorldConfig(size="small", seed=7)).truth), out=tmp_path / "b",
                  truth="oracle")


def test_a_library_audit_checks_its_judge_before_judging_and_writes_nothing_if_it_fails(tmp_path):
    """The command probed an LLM judge's endpoint; `audit_to_dir` from Python did not, and a dead endpoint
    wrote every item unresolved over the audit there."""
    from selfevo.audit.llm_judge import JudgeError
    from selfevo.audit.pipeline import audit_to_dir

    audit_to_dir(_steps(), TableJudge(TABLE), tmp_path / "a", figures=False)
    before = (tmp_path / "a" / "metrics.json").read_bytes()

    class Down(TableJudge):
        def check(self):
            raise JudgeError("http://127.0.0.1:9/v1: connection refused")

        def judge(self, items):
            raise AssertionError("judged after a failed check")

    with pytest.raises(JudgeError, match="connection refused"):
        audit_to_dir(_steps(), Down(TABLE), tmp_path / "a", figures=False)
    assert (tmp_path / "a" / "metrics.json").read_bytes() == before
