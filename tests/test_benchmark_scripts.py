"""Pure helpers of the benchmark scripts (benchmarks/*.py, not a package: loaded from their files):
one seed formats without an interval or a spread, and lineage.misread_hop on a hand-built chain."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from selfevo.algos import summary
from selfevo.world.language import ChainQuery, render_chain
from selfevo.world.truth import Entity, Truth

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str):
    """benchmarks/<name>.py as a module (the scripts import `_common` from their own folder)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def common():
    return _script("_common")


def test_one_seed_has_no_std_and_no_interval(common):
    assert common.fmt([0.5]) == "0.500 ± –"
    assert common.fmt([0.1, 0.3]) == "0.200 ± 0.141"
    assert common.fmt([1.0, 2.0], 1) == "1.5 ± 0.7"
    assert common.fmt([]) == "–"
    m, s = common.mean_std([0.5])
    assert m == 0.5 and math.isnan(s)
    assert common.mean_std([0.1, 0.3]) == pytest.approx((0.2, 0.1414213562))
    assert common.interval_text(summary([0.02])) == "+0.020 (one seed: no interval)"
    two = summary([0.0, 0.02])
    assert common.interval_text(two) == f"+0.010 [{two['lo']:+.3f}, {two['hi']:+.3f}]"
    assert two["lo"] < 0 < two["hi"]
    assert common.interval_text(summary([])) == "–"


def test_replay_spread_of_one_seed_is_nan():
    replay = _script("replay")
    assert replay.spread({"std": 0.3}, {"std": 0.4}) == pytest.approx(1.0)
    assert math.isnan(replay.spread({"std": None}, {"std": 0.4}))
    assert replay.spread_text({"std": None}, {"std": None}) == "no bound: one seed has no spread"
    assert replay.spread_text({"std": 0.3}, {"std": 0.4}) == "bound ±1.000"


def _study(F: dict[str, float], truth: dict[str, float], std: float = 0.01, base: float = 0.03) -> dict:
    """A replay study's results.json as the by-bank helpers read it: each condition's F and solver
    truth as mean and std over seeds, the untrained reference's F."""
    return {"conditions": {n: {"F": {"mean": f, "std": std}, "solver_truth": {"mean": truth.get(n, 0.5), "std": std},
                               "seeds": 5} for n, f in F.items()},
            "reference": {"base": {"F": {"mean": base, "std": std}}}, "bank": {"items": 3000, "T_P": 0.75}}


def test_replay_by_bank_measures_and_reading_count_each_bank():
    replay = _script("replay")
    F = {"coupled": 0.12, "same-source": 0.12, "full-data": 0.20, "question-split": 0.08, "source-id": 0.05,
         "source-id-half": 0.045, "connected": 0.04}
    m = replay.bank_measures(_study(F, {"coupled": 0.75, "source-id": 0.40}))
    assert m["ratio"] == pytest.approx(0.05 / 0.08)
    assert m["truth_gap"] == pytest.approx(-0.35)
    # the spread bound is 2 * sqrt(2) * 0.01 = 0.028: full-data's +0.08 is outside it, half's -0.005 inside
    assert (m["same-source"], m["full-data"], m["half"]) == (True, False, True)
    clean = dict(F, **{"source-id": 0.01, "full-data": 0.12})  # a held-out grader under 0.2 of the split
    studies = [(0, _study(F, {"coupled": 0.75, "source-id": 0.40})),
               (1, _study(clean, {"coupled": 0.70, "source-id": 0.80}))]
    text = replay.bank_reading("Memory-led learner", studies)
    assert "over the 2 banks" in text and "(at or below 0.2 in 1 of 2)" in text
    assert "above 0 in 1 of 2" in text and "full-data in 1 of 2" in text
    assert "same-source F near coupled in 2 of 2" in text
    row = replay.bank_row("memory-led", 1, studies[1][1])
    assert row.startswith("| memory-led, run seed 1 | 3000 | 0.750 |") and row.endswith("| +0.100 |")


def test_replay_value_skew_reading_counts_the_banks_at_or_below_the_ratio():
    replay = _script("replay")
    chance = {"another page": 0.5, "confusable": 0.5}
    by_skew = [(name, _study({"question-split": 0.08, "source-id": 0.05}, {}), chance) for name in ("1", "0.5")]
    text = replay.skew_reading(by_skew, [[0.6, 0.5], [0.3, 0.2]])
    assert "and the ratio 0.62 at the default and 0.62 at 0.5: below 0.2 in no world here" in text
    assert "Over the banks of 2 coupled runs" in text and "at or below 0.2 on 1 of the 4 banks" in text
    assert "the ratio is 0.55 ± 0.07 at the default and 0.25 ± 0.07 at 0.5," in text


def test_horizon_table_with_one_seed():
    downstream = _script("downstream")
    runs = [{"treatment": t, "seed": 0, "macro": [0.30 + 0.01 * i + (0.02 if t == "crossfit" else 0.0)
                                                  for i in range(4)],
             "F": [0.05] * 4, "T_P": [0.8] * 4} for t in ("coupled", "crossfit")]
    text = "\n".join(downstream.horizon_lines(runs, rounds=4, seeds=range(1)))
    assert "| 4 | 0.330 ± – | +0.020 (one seed: no interval) |" in text
    assert "+0.020 (one seed: no interval) after round 4" in text
    assert "no verdict" in text and "appears" not in text


def _mitigation_rows(f: list[float], macro=(0.60, 0.61, 0.62)) -> list[dict]:
    return [{"audit": {"F": x, "T_P": 0.8, "A": 0.5}, "macro": m} for x, m in zip(f, macro, strict=True)]


def test_mitigations_acceptance_claims_no_share_of_a_reduction_crossfit_did_not_make():
    """CrossFit raising F (0.10 -> 0.12) and the half budget raising it more (0.14) passed "half budget
    keeps most of CrossFit's F reduction: 2.00 of it"; a same-source arm that left F where it was failed
    "does not help" (its 0 cut was not below half of CrossFit's -0.02)."""
    mitigations = _script("mitigations")
    res = {"coupled": _mitigation_rows([0.10] * 3), "crossfit": _mitigation_rows([0.12] * 3),
           "half-budget": _mitigation_rows([0.14] * 3), "same-source": _mitigation_rows([0.10] * 3),
           "full-data": _mitigation_rows([0.08] * 3)}
    checks = {name: (ok, detail) for name, ok, detail in mitigations.acceptance(res, {})}
    ok, detail = checks["half budget keeps most of CrossFit's F reduction"]
    assert not ok and "CrossFit reduced no F (-0.020)" in detail
    assert checks["same-source does not help"][0] is True  # no F cut at all
    assert checks["full-data does not help"][0] is False  # it cut F where CrossFit did not
    # where CrossFit does cut F the shares are as before
    res["crossfit"], res["half-budget"] = _mitigation_rows([0.04] * 3), _mitigation_rows([0.06] * 3)
    checks = {name: (ok, detail) for name, ok, detail in mitigations.acceptance(res, {})}
    assert checks["half budget keeps most of CrossFit's F reduction"] == (True, "0.67 of it")
    assert checks["same-source does not help"][0] is True and checks["full-data does not help"][0] is True


def test_mitigations_acceptance_with_no_coupled_f_fails_instead_of_crashing():
    """Coupled F of 0 (a world nobody misreads) raised ZeroDivisionError at the end of the whole study."""
    mitigations = _script("mitigations")
    res = {t: _mitigation_rows([0.0] * 3) for t in ("coupled", "crossfit", "question-split")}
    checks = {name: (ok, detail) for name, ok, detail in mitigations.acceptance(res, {})}
    assert checks["question-split keeps most of coupled's F"] == (False, "coupled's F is 0: none to keep")


def test_demo_acceptance_counts_an_msv_that_raises_f_as_an_effect():
    """MSV tripling F (0.10 -> 0.30) passed "MSV's effect on F smaller than CrossFit's" (0.10 -> 0.04):
    the effects were compared signed, so any rise of F counted as smaller than any cut."""
    demo = _script("demo")

    def audit(f: list[float], a: float, tp: float) -> dict:
        return {"rounds": [{"F": {"mean": x}, "A": {"mean": a}, "T_P": {"mean": tp}} for x in f]}

    def says(msv_f: float) -> str:
        res = {"audit": {"coupled": audit([0.03, 0.07, 0.10], 0.70, 0.76),
                         "crossfit": audit([0.03, 0.04, 0.04], 0.43, 0.84),
                         "msv": audit([0.03, 0.05, msv_f], 0.65, 0.80)},
               "downstream": {"crossfit": {"gain_vs_coupled": {"macro": {"mean": 0.002, "lo": -0.007, "hi": 0.011}}}}}
        return next(line for line in demo.acceptance(res, []) if "MSV's effect" in line)

    assert says(0.30).startswith("- **FAIL**")
    assert says(0.08).startswith("- PASS") and says(0.12).startswith("- PASS")  # small either way


def test_demo_acceptance_claims_no_rise_of_f_the_printed_decimals_do_not_show():
    """"PASS coupled F rising by round: 0.060 → 0.060 → 0.070" (0.0600 → 0.0604): the report's reading
    claims no such rise, and the acceptance line said one in the same numbers."""
    demo = _script("demo")

    def says(f: list[float]) -> str:
        rounds = [{"F": {"mean": x}, "A": {"mean": 0.5}, "T_P": {"mean": 0.8}} for x in f]
        res = {"audit": {"coupled": {"rounds": rounds}, "crossfit": {"rounds": rounds}},
               "downstream": {"crossfit": {"gain_vs_coupled": {"macro": {"mean": 0.0, "lo": None, "hi": None}}}}}
        return next(line for line in demo.acceptance(res, []) if "coupled F rising" in line)

    assert says([0.0600, 0.0604, 0.0700]).startswith("- **FAIL**")
    assert says([0.0600, 0.0610, 0.0700]).startswith("- PASS")


def test_the_readme_headline_is_written_between_its_lines_and_claims_only_what_its_numbers_show(tmp_path):
    """The README's headline was copied by hand from the demo's output, with sentences ("A doubles",
    "the untrained base scores 0.485") that no script printed. demo.py now writes it, each claim checked."""
    demo = _script("demo")
    common = _script("_common")

    def audit(f: list[float], a: list[float], tp: float) -> dict:
        return {"rounds": [{"F": {"mean": x, "std": 0.01}, "A": {"mean": y, "std": 0.01},
                            "T_P": {"mean": tp, "std": 0.01}} for x, y in zip(f, a, strict=True)]}

    def headline(coupled_a: list[float], crossfit_a: float) -> str:
        res = {"seeds": [0, 1], "treatments": ["coupled", "crossfit"], "base": {"macro": {"mean": 0.4851}},
               "audit": {"coupled": audit([0.03, 0.07, 0.10], coupled_a, 0.76),
                         "crossfit": audit([0.03, 0.04, 0.04], [0.4, 0.4, crossfit_a], 0.84)},
               "downstream": {"coupled": {"macro": {"mean": 0.609}},
                              "crossfit": {"macro": {"mean": 0.612},
                                           "gain_vs_coupled": {"macro": {"mean": 0.003, "lo": -0.01, "hi": 0.02}}}}}
        return "\n".join(demo.readme_headline(res, [50.0, 40.0, 60.0], [100.0]))

    text = headline([0.34, 0.63, 0.70], 0.43)
    assert "50 s median of 3; 100 s from a fresh clone" in text
    assert "| crossfit | 0.430 ± 0.010 | 0.840 ± 0.010 | 0.040 ± 0.010 | 0.612 | +0.003 [-0.010, +0.020] |" in text
    assert "A 0.340 → 0.630 → 0.700 and label truth T_P 0.760 → 0.760 → 0.760: rising agreement is partly" in text
    assert "CrossFit cuts round-3 F by 60% with *lower* in-loop agreement" in text
    assert "The untrained base scores 0.485 macro Cover-EM." in text
    # agreement that does not rise, and a CrossFit A above coupled's: neither claim is made
    text = headline([0.70, 0.63, 0.60], 0.80)
    assert "co-cheating" not in text and "regression" not in text and "CrossFit cuts round-3 F by 60%." in text

    page = tmp_path / "README.md"
    page.write_text("# t\n\n<!-- demo-headline -->\nold\n<!-- /demo-headline -->\n\nkept\n")
    common.write_block(page, "demo-headline", "new\nlines\n")
    assert page.read_text() == "# t\n\n<!-- demo-headline -->\nnew\nlines\n<!-- /demo-headline -->\n\nkept\n"
    page.write_text("# t\n")
    with pytest.raises(SystemExit, match="no <!-- demo-headline -->"):
        common.write_block(page, "demo-headline", "new")


def test_the_readme_downstream_paragraph_follows_its_numbers():
    downstream = _script("downstream")
    seeds = range(1000, 1002)
    rows, gains = [], {}
    for v in downstream.VARIANTS:
        for arm, _, _ in downstream.ARMS:
            for s in seeds:
                rows.append({"variant": v, "arm": arm, "seed": s, "T_P": 0.80 if arm == "crossfit" else 0.75,
                             "A": 0.4 if arm == "crossfit" else 0.7,
                             "macro": 0.70 if "no memory" in arm else 0.60})
        gains[v, "crossfit"] = summary([0.0, 0.01])
    gains["default", "crossfit"] = summary([0.02, 0.03, 0.025, 0.022, 0.028])
    horizon = [{"treatment": t, "seed": s, "macro": [0.6, 0.6 + (0.01 * (s - 999) if t == "crossfit" else 0)],
                "F": [0.1, 0.05 if t == "crossfit" else 0.1]} for t in ("coupled", "crossfit") for s in seeds]
    text = "\n".join(downstream.readme_summary(rows, gains, horizon, 2, seeds))
    assert text.startswith("What this world reproduces is the paper's downstream gain: CrossFit − coupled macro "
                           "Cover-EM of the main solver after round 3 is +0.025 [+0.020, +0.030] (mean [95% interval]")
    assert "seeds 1000..1001" in text and "CrossFit cleans 20%–20% of the wrong labels" in text
    assert "CrossFit's round-2 F is 0.50 of coupled's" in text and "after round 2" in text
    assert "bounded memory +0.005 [" in text and "(+0.100)" in text
    assert "CrossFit A is 0.400 against coupled's 0.700" in text
    gains["default", "crossfit"] = summary([-0.01, 0.03])
    assert "does **not** reproduce" in "\n".join(downstream.readme_summary(rows, gains, horizon, 2, seeds))


def test_the_ceiling_arm_says_its_oracle_admitted(tmp_path):
    """downstream.py's ceiling arm (the oracle withholds wrong labels, config `coupled`): the manifest
    marks the run, so that nothing takes it for a run of the loop, and each withheld item says who
    withheld it."""
    import json

    from selfevo.runs import ORACLE_ADMISSION, RunDir

    downstream = _script("downstream")
    row = downstream.run_one(("default", downstream.CEILING, 0, "small", tmp_path))
    run = RunDir(next(tmp_path.iterdir()))
    assert run.manifest()[ORACLE_ADMISSION] is True and row["arm"] == downstream.CEILING
    withheld = [it for rec in run.steps() if rec["kind"] == "proposer" for it in rec["items"]
                if it.get("admission", {}).get("oracle_withheld")]
    assert withheld and not any(it["admitted"] for it in withheld), json.dumps(withheld[:1])


# ------------------------------------------------------------------ lineage.misread_hop


def _ent(id_: str, name: str, **facts: str) -> Entity:
    return Entity(id=id_, type=id_.split("-")[0], name=name, aliases=[name], popularity=1.0, facts=facts)


def _truth(**drop: str) -> Truth:
    """Ada Varn -employer-> Brask Guild -founder-> Cela Dorn -born_in-> Dovra -located_in-> Emberland,
    and decoys; `drop`: entity id -> the relation removed from it (a chain that breaks there)."""
    ents = [_ent("person-0", "Ada Varn", employer="org-1"), _ent("org-1", "Brask Guild", founder="person-2"),
            _ent("person-2", "Cela Dorn", born_in="city-3"), _ent("city-3", "Dovra", located_in="country-4"),
            _ent("country-4", "Emberland"), _ent("org-7", "Falk Press", founder="person-8"),
            _ent("person-8", "Gita Holm", born_in="city-3"), _ent("city-9", "Ivrel", located_in="country-10"),
            _ent("country-10", "Jarnland")]
    for e in ents:
        e.facts.pop(drop.get(e.id, ""), None)
    return Truth(ents)


QUESTION = render_chain(ChainQuery("Ada Varn", ("employer", "founder", "born_in", "located_in")))
ON_CHAIN = ["person-0", "org-1", "person-2", "city-3"]  # the pages the true chain reads, source first


@pytest.mark.parametrize(("pages", "label", "hop"), [
    (ON_CHAIN, "Emberland", None),  # right label
    (ON_CHAIN, "Jarnland", 3),  # every page on the chain: the last one was misread
    (["person-0", "org-1", "person-8", "city-3"], "Emberland", None),  # right by luck: not a wrong label
    (["person-0", "org-1", "person-8", "city-3"], "Jarnland", 1),  # the founder read off org-1's page
    (["person-0", "org-7", "person-8", "city-3"], "Jarnland", 0),  # the employer read off the source
])
def test_misread_hop_on_a_whole_chain(pages, label, hop):
    lineage = _script("lineage")
    assert lineage.misread_hop(_truth(), QUESTION, pages, label) == hop


@pytest.mark.parametrize(("drop", "pages", "hop"), [
    # the chain breaks at the last page (Dovra has no country): the pages follow it that far
    ({"city-3": "located_in"}, ON_CHAIN, 3),
    ({"city-3": "located_in"}, ["person-0", "org-1", "person-8", "city-3"], 1),  # left it before the break
    # the chain breaks at page 1 (the guild has no founder): that page's fact was made up
    ({"org-1": "founder"}, ["person-0", "org-1", "person-8", "city-9"], 1),
    ({"org-1": "founder"}, ["person-0", "org-7", "person-8", "city-3"], 0),  # left it at the source
    ({"person-0": "employer"}, ON_CHAIN, 0),  # breaks at the source
])
def test_misread_hop_where_the_true_chain_breaks(drop, pages, hop):
    """No true answer: any label is wrong, and the hop is the first page off the chain or whose fact is
    missing, not always the source (the defect: every broken chain was counted as the source's)."""
    lineage = _script("lineage")
    truth = _truth(**drop)
    assert truth.follow(truth.resolve("Ada Varn"), ("employer", "founder", "born_in", "located_in")) is None
    assert lineage.misread_hop(truth, QUESTION, pages, "Emberland") == hop


def test_misread_hop_unknown_mention_and_other_questions():
    lineage = _script("lineage")
    unknown = render_chain(ChainQuery("Nobody Known", ("employer", "founder")))
    assert lineage.misread_hop(_truth(), unknown, ["person-0", "org-1"], "Cela Dorn") == 0
    assert lineage.misread_hop(_truth(), "Who is taller, Ada or Bob?", ON_CHAIN, "Ada") is None



def test_known_items_keys_a_question_by_what_it_asks_not_its_wording():
    """Repeated benchmark questions are counted by what they ask: every wording of one chain (the
    templates and the nested form) and an alias of its entity share a key; another entity is another
    key, and a comparison's pair matches in either order."""
    from selfevo.world.language import CompareQuery, render_compare

    known = _script("known_items")
    ents = list(_truth().entities.values())
    next(e for e in ents if e.id == "person-2").aliases.append("C. Dorn")
    truth = Truth(ents)
    keys = {known.question_key(truth, render_chain(ChainQuery(m, ("born_in",)), variant=v))
            for m in ("Cela Dorn", "C. Dorn") for v in range(3)}
    assert keys == {("chain", "person-2", ("born_in",))}
    assert known.question_key(truth, render_chain(ChainQuery("Gita Holm", ("born_in",)))) == \
        ("chain", "person-8", ("born_in",))
    assert known.question_key(truth, QUESTION) == ("chain", "person-0", ("employer", "founder", "born_in",
                                                                          "located_in"))
    pair = [known.question_key(truth, render_compare(CompareQuery(ms, "birth_year")))
            for ms in (("Ada Varn", "Cela Dorn"), ("Cela Dorn", "Ada Varn"))]
    assert pair[0] == pair[1] == ("compare", frozenset({"person-0", "person-2"}), "birth_year")
    assert known.question_key(truth, "What is love?") is None


def test_the_pythons_check_compares_values_as_numbers_and_leaves_timings_out(tmp_path):
    """benchmarks/pythons.py: two run files compared value by value (a JSONL log line by line), a number by its
    difference, anything else as differing or not, wall seconds left out; a report compared without its
    compute section, wall-time and software lines."""
    pythons = _script("pythons")
    a = pythons.parsed(b'{"w": [1.0, 2.0], "label": "x", "compute": {"seconds": {"propose": 0.5}}}')
    b = pythons.parsed(b'{"w": [1.0, 2.5], "label": "y", "compute": {"seconds": {"propose": 9.0}}}')
    assert pythons.differences(a, b) == (1, 0.5)
    assert pythons.differences(a, a) == (0, 0.0)
    assert pythons.parsed(b'{"a": 1}\n{"a": 2}\n') == [{"a": 1}, {"a": 2}]
    assert pythons.differences([{"a": 1}], [{"a": 1}, {"a": 2}]) == (1, 0.0)  # a line more is a difference
    report = tmp_path / "report.md"
    report.write_text("# r\nTreatments: a; demo wall time 3 s\nSoftware: python 3.11\n## Audit\n| a | 1 |\n"
                      "## Compute of the training\n| a | 1.2 s |\n## Replay\n| b | 2 |\n", encoding="utf-8")
    assert pythons.tables(report) == ["# r", "## Audit", "| a | 1 |", "## Replay", "| b | 2 |"]


def test_line_coverage_lists_lines_as_ranges_and_files_by_lines_not_run(tmp_path):
    cov = _script("line_coverage")
    assert cov.line_ranges([9, 1, 2, 3, 7, 10]) == "1-3, 7, 9-10"
    assert cov.line_ranges([5]) == "5" and cov.line_ranges([]) == ""
    package = tmp_path / "src" / "selfevo"
    report = {"files": {str(package / "a.py"): {"missing_lines": [3], "summary": {"num_statements": 10}},
                        str(package / "b" / "c.py"): {"missing_lines": [1, 2], "summary": {"num_statements": 4}},
                        str(package / "d.py"): {"missing_lines": [], "summary": {"num_statements": 7}},
                        str(package / "e.py"): {"missing_lines": [8], "summary": {"num_statements": 9}}}}
    assert cov.package_rows(report, package) == [("b/c.py", 4, [1, 2]), ("a.py", 10, [3]), ("e.py", 9, [8])]
    # an installed copy's lines count as the repository's; one place is named once
    rc = cov.rc_text(tmp_path / ".coverage", package, tmp_path / "site" / "selfevo")
    assert f"source =\n    {package}\n    {tmp_path / 'site' / 'selfevo'}\n" in rc and "patch = subprocess" in rc
    assert cov.rc_text(tmp_path / ".coverage", package, package).endswith(f"source =\n    {package}\n")
