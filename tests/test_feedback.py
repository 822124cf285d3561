"""CrossFit's rules as pure functions (`loop.feedback`) and the one treatment -> options mapping
(`loop.treatments.feedback_options`), with concrete numbers: the loop, the endpoint routing, the
engine's datasets and its aux phases all call these."""

from __future__ import annotations

import pytest

from selfevo.loop.feedback import (
    AuxFeedback,
    aux_names,
    aux_updates,
    budget_batches,
    crossfit_fold,
    fewest_aux_updates,
    grader_index,
    lineage_of,
    other_fold,
    record_training,
    touched_folds,
    trains_on,
)
from selfevo.loop.folds import FoldAssignment, question_fold
from selfevo.loop.treatments import FeedbackOptions, feedback_options, parse_treatment


@pytest.mark.parametrize("updates, n_aux, budget, want", [
    (25, 2, 1.0, [25, 25]),  # paper: each aux solver gets 25 updates a round
    (25, 2, 0.5, [13, 12]),  # half budget: 25 a round in total, the first takes the remainder
    (25, 1, 1.0, [25]),  # full-data: one solver on everything
    (25, 3, 0.5, [13, 13, 12]),  # 37.5 rounds (half to even) to 38
    (3, 2, 0.5, [2, 1]),
    (1, 2, 0.5, [1, 0]),
])
def test_aux_updates_splits_the_budget(updates, n_aux, budget, want):
    assert aux_updates(updates, n_aux, budget) == want
    assert fewest_aux_updates(updates, n_aux, budget) == min(want)


def test_budget_batches_are_the_full_splits_batches_a_smaller_budget_draws_from_the_whole_round():
    """The half budget trained on the full split's first batches: the round's first proposer steps'
    questions only. Now a seeded draw over the whole round, in order, of the same batches."""
    full = budget_batches(100, 25, 25, seed=0)
    assert full == [(u, 4 * u, 4 * u + 4) for u in range(25)]  # the even split, every item once
    half = budget_batches(100, 25, 13, seed=0)
    assert len(half) == 13 and set(half) <= set(full) and half == sorted(half)
    assert half == budget_batches(100, 25, 13, seed=0)  # the seed decides
    assert max(u for u, _, _ in half) > 12  # not the first 13
    draws = [budget_batches(100, 25, 13, seed=s) for s in range(200)]
    assert len({tuple(d) for d in draws}) > 150
    shares = [sum(u >= 13 for u, _, _ in d) / 13 for d in draws]  # the round's second half: 12 of 25 batches
    assert abs(sum(shares) / len(shares) - 12 / 25) < 0.03
    # fewer items than updates: one item a batch, the rest empty; a budget draws among all of them, so the
    # half budget trains on about half the items (taking every non-empty batch, it trained as CrossFit)
    assert budget_batches(3, 25, 25, seed=0) == [(8, 0, 1), (16, 1, 2), (24, 2, 3)]
    trained = [sum(hi - lo for _, lo, hi in budget_batches(10, 25, 13, seed=s)) for s in range(400)]
    assert abs(sum(trained) / len(trained) - 10 * 13 / 25) < 0.3 and max(trained) < 10
    assert budget_batches(0, 25, 13, seed=0) == []


@pytest.mark.parametrize("h, touched, k, want", [
    (0, {0}, 2, (1, False)),
    (1, {1}, 2, (0, False)),
    (0, {0, 1}, 2, (1, True)),  # every fold touched: the source rule, flagged
    (1, {1, 2}, 3, (0, False)),  # the next fold (2) is touched: the one after it
    (2, {2}, 3, (0, False)),
    (0, {0, 1, 2}, 3, (1, True)),
])
def test_other_fold(h, touched, k, want):
    assert other_fold(h, touched, k) == want


def test_grader_index_per_grading_rule():
    assert grader_index("other-fold", 1, {1, 2}, 3) == (0, False)
    assert grader_index("own-fold", 1, {1}, 2) == (1, False)  # same-source control
    assert grader_index("full", 1, {0, 1}, 2) == (0, False)  # full-data control: aux-all


def test_trains_on_and_touched_folds():
    # a fold-0 question that also read a fold-1 page
    assert trains_on(0, 0, {0, 1}, lineage_aware=False) and not trains_on(1, 0, {0, 1}, lineage_aware=False)
    assert not trains_on(0, 0, {0, 1}, lineage_aware=True) and not trains_on(1, 0, {0, 1}, lineage_aware=True)
    assert trains_on(0, 0, [0], lineage_aware=True)
    assert touched_folds(0, {0, 1}, lineage_aware=False) == {0}
    assert touched_folds(0, [0, 1], lineage_aware=True) == {0, 1}


def test_crossfit_fold_by_source_or_by_question():
    folds = FoldAssignment(2, 7, "source", {"s0": 0, "s1": 1})
    assert crossfit_fold(folds, "source", "s1", "Where?") == 1
    assert crossfit_fold(folds, "question", "s1", "Where?") == question_fold("Where?", 7, 2)


def test_aux_names():
    assert aux_names("own-fold", 3) == ["aux-0", "aux-1", "aux-2"]
    assert aux_names("everything", 2) == ["aux-all"]


@pytest.mark.parametrize("name, want", [
    ("coupled", None),
    ("msv", None),
    ("crossfit", FeedbackOptions()),
    ("msv+crossfit-k3", FeedbackOptions()),
    ("crossfit-connected", FeedbackOptions(lineage_aware=True)),
    ("half-budget", FeedbackOptions(budget=0.5)),
    ("same-source", FeedbackOptions(grades="own-fold")),
    ("full-data", FeedbackOptions(trains="everything", grades="full")),
    ("question-split", FeedbackOptions(split="question")),
])
def test_feedback_options_of_each_treatment(name, want):
    assert feedback_options(parse_treatment(name)) == want


def test_make_rules_builds_the_options():
    """`evolve.make_rules` passes the mapping to AuxFeedback unchanged."""
    from selfevo.config import load_config
    from selfevo.evolve import make_rules
    from selfevo.loop.feedback import AuxFeedback, CoupledFeedback

    class Stub:
        def __init__(self, name):
            self.name, self.lineage = name, {}

    folds = FoldAssignment(2, 0, "source", {})
    _, rule = make_rules(load_config(None, ["treatment=half-budget"]), [], folds, Stub)
    assert isinstance(rule, AuxFeedback) and rule.updates == [13, 12] and rule.grades == "other-fold"
    _, rule = make_rules(load_config(None, ["treatment=full-data"]), [], folds, Stub)
    assert [a.name for a in rule.aux] == ["aux-all"] and rule.updates == [25] and rule.grades == "full"
    _, rule = make_rules(load_config(None, ["treatment=coupled"]), [], folds, Stub)
    assert isinstance(rule, CoupledFeedback)


@pytest.mark.parametrize("name", ["crossfit\n", "msv+crossfit-k3\n", "crossfit-k٣", "crossfit-k２",
                                  "crossfit-connected-k3\n"])
def test_parse_treatment_refuses_a_lookalike_of_a_crossfit_name(name):
    """`$` matched before a trailing newline and `\\d` any script's digits: a config's "crossfit\\n"
    ran as crossfit under a name of its own (its config.json, its report row)."""
    with pytest.raises(ValueError, match="treatment: unknown"):
        parse_treatment(name)


def test_parse_treatment_names_the_field_for_a_k_of_thousands_of_digits():
    # int() of over 4,300 digits raised its own ValueError, naming no field
    with pytest.raises(ValueError, match="treatment: crossfit-k<K> takes at most 18 digits"):
        parse_treatment("crossfit-k" + "9" * 5000)
    assert parse_treatment("crossfit-k" + "9" * 18).k == 10**18 - 1
    assert (parse_treatment("msv+crossfit-connected-k3").k, parse_treatment("crossfit-k3").grouping) == (3, "source")


@pytest.mark.parametrize("name", ["msv+msv", "MSV+crossfit", "Crossfit"])
def test_parse_treatment_refuses_a_third_spelling_of_a_treatment(name):
    """`msv` and `msv+coupled` are one treatment's two names already (reported apart); `msv+msv` and a
    capitalised name would be more runs of one treatment under names no other run of it shares."""
    with pytest.raises(ValueError, match="treatment: unknown"):
        parse_treatment(name)


@pytest.mark.parametrize("name", ["crossfit-k1", "crossfit-k0", "msv+crossfit-connected-k1"])
def test_parse_treatment_refuses_fewer_than_two_folds(name):
    """With one fold no auxiliary solver can grade another fold's question: refused by the name's own check,
    before `assign_folds` fails at the run's start."""
    with pytest.raises(ValueError, match=r"treatment: crossfit needs k >= 2"):
        parse_treatment(name)


def test_aux_feedback_refuses_a_budget_of_nothing_and_a_state_of_other_solvers():
    """A budget of 0 would leave every auxiliary solver untrained; a saved state with another number of
    auxiliary solvers (a damaged or foreign checkpoint) loaded the ones it had and left the rest as they were."""
    from selfevo.loop.feedback import AuxFeedback

    class Stub:
        def __init__(self, name):
            self.name, self.lineage, self.state = name, {}, None

        def load_state_dict(self, state):
            self.state = state

    folds = FoldAssignment(2, 0, "source", {})
    with pytest.raises(ValueError, match="bad split or budget"):
        AuxFeedback("crossfit", folds, Stub, 25, 5, budget=0.0)
    rule = AuxFeedback("crossfit", folds, Stub, 25, 5)
    with pytest.raises(ValueError):
        rule.load_state_dict({"aux": [{"w": 1}]})


def test_make_rules_samples_msv_as_loop_msv_samples():
    """`evolve` had no knob for MSV's sample count (the replay and engine-run had theirs): loop.msv_samples
    reaches the admission rule, its strict majority and its generation count."""
    from selfevo.config import ConfigError, load_config
    from selfevo.evolve import make_rules
    from selfevo.loop.admission import AdmitAll

    folds = FoldAssignment(2, 0, "source", {})
    default, _ = make_rules(load_config(None, ["treatment=msv"]), [], folds, None)
    assert (default.samples, default.min_count, default.generations_per_candidate) == (3, 2, 6)  # the paper's
    five, _ = make_rules(load_config(None, ["treatment=msv+crossfit", "loop.msv_samples=5"]), [], folds,
                         lambda name: type("S", (), {"name": name, "lineage": {}})())
    assert (five.samples, five.min_count, five.generations_per_candidate) == (5, 3, 10)
    assert isinstance(make_rules(load_config(None, ["loop.msv_samples=5"]), [], folds, None)[0], AdmitAll)
    with pytest.raises(ConfigError, match="loop.msv_samples: must be a positive integer, got 0"):
        load_config(None, ["loop.msv_samples=0"])


def test_record_training_accumulates_folds_and_rounds():
    """A solver's lineage is everything it ever trained on: a later update on fewer folds adds, never replaces
    (DESIGN.md §2: cross-fitting is a query over lineage)."""
    solver = type("S", (), {"name": "aux-0@r2", "lineage": {}})()
    record_training(solver, [1], 1)
    record_training(solver, [0], 2)
    record_training(solver, [1], 2)
    assert solver.lineage == {"folds": [0, 1], "rounds": [1, 2]}
    assert lineage_of(solver) == {"id": "aux-0@r2", "trained_on": {"folds": [0, 1], "rounds": [1, 2]}}


@pytest.mark.parametrize("option, said", [({"trains": "fold"}, "bad trains/grades option"),
                                          ({"grades": "other"}, "bad trains/grades option"),
                                          ({"split": "page"}, "bad split or budget"),
                                          ({"budget": 1.5}, "bad split or budget")])
def test_aux_feedback_refuses_an_option_no_treatment_has(option, said):
    """An unknown `trains` fell through to per-fold training and a budget over 1 gave the aux solvers more
    updates than the paper's 25 a round each: each is refused, naming the rule."""
    folds = FoldAssignment(2, 0, "source", {})
    with pytest.raises(ValueError, match=f"feedback crossfit: {said}"):
        AuxFeedback("crossfit", folds, lambda name: None, 25, 5, **option)


def test_parse_treatment_refuses_nineteen_digits_of_k():
    """18 digits of K are the most taken (the bound named in the message), 19 already refused."""
    with pytest.raises(ValueError, match="treatment: crossfit-k<K> takes at most 18 digits of K, got 19"):
        parse_treatment("crossfit-k" + "1" * 19)


@pytest.mark.parametrize("name, msv", [("msv+crossfit-k3", True), ("msv+crossfit-connected", True),
                                       ("msv+crossfit-connected-k4", True), ("crossfit-k3", False),
                                       ("crossfit-connected", False)])
def test_parse_treatment_keeps_msv_on_every_crossfit_spelling(name, msv):
    """`msv+` before a crossfit-k<K> or crossfit-connected name is MSV admission too, not dropped silently."""
    assert parse_treatment(name).msv is msv and parse_treatment(name).feedback == "crossfit"


def test_the_rules_refuse_a_misspelt_option_and_a_fold_of_no_assignment():
    """A misspelt control ran as CrossFit (`grader_index("own_fold", ...)` graded by another fold);
    `other_fold(0, {0}, 0)` divided by zero; a fold outside 0..k-1 was routed."""
    folds = FoldAssignment(2, 0, "source", {"s0": 0, "s1": 1})
    with pytest.raises(ValueError, match="grades: other-fold, own-fold or full, got 'own_fold'"):
        grader_index("own_fold", 1, {1}, 2)
    with pytest.raises(ValueError, match="split: source or question, got 'sources'"):
        crossfit_fold(folds, "sources", "s0", "q")
    for h, k in ((7, 2), (-1, 2), (0, 0), (0, 1)):
        with pytest.raises(ValueError, match="k >= 2 folds, numbered 0..k-1"):
            other_fold(h, {h}, k)


def test_a_fold_assignment_hands_out_copies_and_reads_back_only_what_it_writes():
    folds = FoldAssignment(2, 7, "source", {"a": 0, "b": 1}, {"a": "a", "b": "b"})
    j = folds.to_json()
    j["folds"]["a"], j["groups"]["a"] = 1, "b"  # editing what it handed out changed the assignment
    assert folds.of("a") == 0 and folds.groups["a"] == "a"
    assert FoldAssignment.from_json(folds.to_json()) == folds
    for bad, message in (({**folds.to_json(), "seed": "7"}, "field 'seed': must be an integer, got '7'"),
                         ({**folds.to_json(), "seed": 7.9}, "field 'seed': must be an integer, got 7.9"),
                         ({k: v for k, v in folds.to_json().items() if k != "groups"}, "field 'groups': missing")):
        with pytest.raises(ValueError, match=message):
            FoldAssignment.from_json(bad)
