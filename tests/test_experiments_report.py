"""Experiment grids (local processes and Ray give identical results; failures are reported and
the rest completes; reruns skip finished jobs) and the report built from a grid."""

from __future__ import annotations

import contextlib
import html
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import selfevo._software as sw
from selfevo._fmt import DASH, mean_std_text, num, shown
from selfevo._software import software, software_changes, software_tally, software_text
from selfevo.audit.figures import COLORS, CURVES
from selfevo.cli import app
from selfevo.experiments import Job, grid, run_grid
from selfevo.report import build, figures
from selfevo.report.build import build_report
from selfevo.report.collect import readings
from selfevo.report.compare import compare, describe_audit
from selfevo.report.render import html_page, markdown, tables
from selfevo.runs import RunError

SMALL = ["world.name=\"small\"", "loop.admit_per_round=120", "loop.proposer_steps=6", "loop.solver_steps=5"]


def _tables(root: Path) -> dict:
    """Every result a run writes that must not depend on the executor."""
    out = {}
    for run in sorted(p for p in root.iterdir() if p.is_dir()):
        for rel in ("records/steps.jsonl", "audit/metrics.json", "eval/round-3.json"):
            out[f"{run.name}/{rel}"] = (run / rel).read_bytes()
        state = json.loads((run / "checkpoints" / "round-3.json").read_text())
        state["compute"].pop("seconds")  # wall time is the one thing allowed to differ
        out[f"{run.name}/models"] = state
    return out


@pytest.fixture(scope="module")
def local_grid(tmp_path_factory):
    root = tmp_path_factory.mktemp("local")
    jobs = grid(["coupled", "crossfit"], [0, 1], root, SMALL)
    results = run_grid(jobs, "local", workers=2)
    return root, jobs, results


def test_grid_names_and_overrides(tmp_path):
    jobs = grid(["coupled", "msv"], [0, 3], tmp_path, ["loop.rounds=2"])
    assert [j.name for j in jobs] == ["coupled-s0", "coupled-s3", "msv-s0", "msv-s3"]
    assert jobs[3].overrides == ("loop.rounds=2", "treatment=msv", "seed=3")
    assert jobs[0].out == str(tmp_path / "coupled-s0")


def test_local_grid_runs_every_job(local_grid):
    root, jobs, results = local_grid
    assert [r["status"] for r in results] == ["ok"] * 4
    assert [r["job"] for r in results] == [j.name for j in jobs]
    for j in jobs:
        assert json.loads((Path(j.out) / "manifest.json").read_text())["status"] == "complete"


def test_workers_do_not_change_results(local_grid, tmp_path):
    root, jobs, _ = local_grid
    serial = grid(["coupled", "crossfit"], [0, 1], tmp_path, SMALL)
    run_grid(serial, "local", workers=1)
    assert _tables(tmp_path) == _tables(root)


def test_rerun_skips_finished_jobs(local_grid):
    root, jobs, _ = local_grid
    before = _tables(root)
    assert [r["status"] for r in run_grid(jobs, "local", workers=2)] == ["skipped"] * 4
    assert _tables(root) == before


def test_a_failed_job_is_reported_and_the_rest_complete(tmp_path):
    jobs = [Job("bad", (*SMALL, "treatment=no-such-treatment"), str(tmp_path / "bad")),
            *grid(["coupled"], [0], tmp_path, SMALL)]
    results = run_grid(jobs, "local", workers=2)
    assert results[0]["status"] == "failed" and "no-such-treatment" in results[0]["error"]
    assert results[1]["status"] == "ok"


def test_unknown_executor():
    with pytest.raises(ValueError, match="executor"):
        run_grid([], "dask")


def test_a_grid_refuses_common_overrides_of_what_it_sets_per_job(tmp_path):
    """`common=["seed=7"]` was overridden by each job's own seed, silently."""
    for common in (["seed=7"], ["loop.rounds=2", " treatment = msv"]):
        with pytest.raises(ValueError, match=r"^common: .* sets (seed|treatment), which the grid sets"):
            grid(["coupled"], [0, 1], tmp_path, common)
    assert [j.overrides for j in grid(["coupled"], [0], tmp_path, ["world.seed=7"])] == [
        ("world.seed=7", "treatment=coupled", "seed=0")]


def test_ray_matches_local(local_grid, tmp_path):
    ray = pytest.importorskip("ray")
    root, _, _ = local_grid
    jobs = grid(["coupled", "crossfit"], [0, 1], tmp_path, SMALL)

    driver = os.getpid()

    class Dies(str):  # a local class: Ray ships it to the worker by value, where reading it kills the
        def __contains__(self, item):  # worker as an OOM kill or a segfault would (the driver reads it too)
            if os.getpid() != driver:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().__contains__(item)

    dies = Job("dies", (*SMALL, Dies("seed=0")), str(tmp_path.parent / f"{tmp_path.name}-dies"))
    try:
        results = run_grid([*jobs, dies], "ray")
    finally:
        ray.shutdown()
    assert [r["status"] for r in results] == ["ok"] * 4 + ["failed"]  # Ray retried it, then gave up
    assert "worker process died" in results[-1]["error"]
    assert _tables(tmp_path) == _tables(root)  # the death changed nothing in the other jobs


def test_report_from_a_grid(local_grid):
    root, _, _ = local_grid
    res = build_report(root, context="test")
    assert res["treatments"] == ["coupled", "crossfit"] and res["seeds"] == [0, 1]
    gain = res["downstream"]["crossfit"]["gain_vs_coupled"]["macro"]
    coupled = [json.loads((root / f"coupled-s{s}" / "eval" / "round-3.json").read_text())["macro"]["cover_em"]
               for s in (0, 1)]
    crossfit = [json.loads((root / f"crossfit-s{s}" / "eval" / "round-3.json").read_text())["macro"]["cover_em"]
                for s in (0, 1)]
    assert gain["mean"] == pytest.approx(sum(crossfit) / 2 - sum(coupled) / 2)
    f3 = [json.loads((root / f"coupled-s{s}" / "audit" / "metrics.json").read_text())["rounds"][-1]["F"]
          for s in (0, 1)]
    assert res["audit"]["coupled"]["rounds"][-1]["F"]["mean"] == pytest.approx(sum(f3) / 2)
    # next to F: how many questions were admitted and of which hop counts (DESIGN §1, harder questions)
    last = [json.loads((root / f"crossfit-s{s}" / "audit" / "metrics.json").read_text())["rounds"][-1]
            for s in (0, 1)]
    mine = res["audit"]["crossfit"]["rounds"][-1]
    assert mine["admitted"]["mean"] == pytest.approx(sum(r["admitted"] for r in last) / 2)
    # per step too, the mean over seeds (a mutation that took the first seed's went unseen); coupled has no
    # gain against itself, nor a reading of one
    steps = [json.loads((root / f"coupled-s{s}" / "audit" / "metrics.json").read_text())["steps"] for s in (0, 1)]
    assert any(a["F"] != b["F"] for a, b in zip(*steps))
    for i, step in enumerate(res["audit"]["coupled"]["steps"]):
        seen = [st[i]["F"] for st in steps if st[i]["F"] is not None]
        assert step["F"] == (pytest.approx(sum(seen) / len(seen)) if seen else None)
    assert "gain_vs_coupled" not in res["downstream"]["coupled"]
    assert not any(line.startswith("coupled: downstream") for line in res["readings"])
    assert mine["hop_mix_admitted"]["1"] == pytest.approx(
        sum(r["hop_mix_admitted"].get("1", 0) for r in last) / 2, abs=1e-4)
    html = (root / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 3 and "Readings" in html
    md = (root / "report.md").read_text()
    assert "| coupled |" in md and "figures/figure-1.png" in md
    assert "admitted hop mix" in md and f"1: {mine['hop_mix_admitted']['1']:.2f}, 2: " in md
    assert (root / "figures" / "figure-1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((root / "results.json").read_text())["treatments"] == ["coupled", "crossfit"]
    assert oct(os.stat(root / "report.html").st_mode & 0o777) != oct(0o600)
    # the software the runs were made with, stated in the report
    assert res["software"]["versions"]["numpy"] == {np.__version__: 4} and res["software"]["unrecorded"] == 0
    line = f"Software: every run: python {software()['python']}, platform {software()['platform']}, selfevo "
    assert line in md and line in html


def test_the_report_says_which_std_and_which_interval_its_numbers_are():
    """Every table read "mean ± std" or "mean [95% CI]" without saying which: the sample std (n − 1)
    and Student's t with n − 1 degrees of freedom, as algos.summary computes them."""
    import statistics

    from selfevo.algos import summary
    from selfevo.report.render import html_page, markdown

    vals = [0.1, 0.3, 0.35]
    s = summary(vals)
    assert s["std"] == pytest.approx(statistics.stdev(vals))  # n − 1, not statistics.pstdev
    assert s["hi"] - s["mean"] == pytest.approx(4.303 * statistics.stdev(vals) / 3 ** 0.5)  # t, 2 df
    res = {"treatments": [], "seeds": [0, 1, 2], "readings": [], "benchmarks": [], "base": {}, "downstream": {},
           "audit": {}, "compute": {}}
    note = "± is the sample standard deviation (n − 1) and [lo, hi] a 95% Student-t interval (n − 1 degrees"
    assert note in markdown(res, {}) and note in html_page(res, {})


def test_the_report_names_software_the_runs_differ_in():
    made = {"python": "3.11.7", "numpy": "2.4.6", "bm25s": "0.3.16"}
    tally = software_tally([{"software": made}, {"software": {**made, "numpy": "2.5.0"}},
                            {"software": made, "software_resumed": [{"software": {}}]},
                            {"software": {k: v for k, v in made.items() if k != "bm25s"}}, {"status": "complete"}])
    assert tally == {"versions": {"python": {"3.11.7": 4}, "numpy": {"2.4.6": 3, "2.5.0": 1},
                                  "bm25s": {"0.3.16": 3, "none": 1}},
                     "unrecorded": 1, "resumed_under_other": 1}
    assert software_text(tally) == (
        "every run: python 3.11.7; the runs differ in numpy 2.4.6 (3 runs), 2.5.0 (1 run); bm25s 0.3.16 (3 runs), "
        "none (1 run); 1 run resumed under other software than made with (manifest.json: software_resumed); "
        "1 run made before runs recorded it")
    assert software_text(software_tally([{}, {}])) == "2 runs made before runs recorded it"
    assert software_text({}) == "not recorded"


def test_report_cli(local_grid, tmp_path):
    root, _, _ = local_grid
    result = CliRunner().invoke(app, ["report", str(root)])
    assert result.exit_code == 0, result.output
    assert "Downstream" in result.output
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2 and "no run directories" in result.output
    for absent in (tmp_path / "nope", tmp_path / "nope" / "deeper"):  # named, and not made
        result = CliRunner().invoke(app, ["report", str(absent)])
        assert result.exit_code == 2 and not (tmp_path / "nope").exists()
        assert "no such directory" in result.output  # was "no run directories found below it"
    (tmp_path / "c.jsonl").write_text("{}\n")
    result = CliRunner().invoke(app, ["report", str(tmp_path / "c.jsonl")])
    assert result.exit_code == 2 and "not a directory" in result.output


def test_report_refuses_a_directory_a_demo_is_writing(local_grid):
    """`selfevo report DIR` while a demo wrote DIR did not hold the directory: its report.html could
    be replaced under it, half of one run's state beside the other's."""
    import fcntl
    import os

    root, _, _ = local_grid
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, as `selfevo demo --out DIR` holds it
        result = CliRunner().invoke(app, ["report", str(root)])
        assert result.exit_code == 2 and "another process (a demo, a run, another report) is writing here" in \
            " ".join(result.output.split())
    finally:
        os.close(fd)
    assert CliRunner().invoke(app, ["report", str(root)]).exit_code == 0  # released


def test_report_of_a_run_being_written_names_no_demo_that_is_not_there(local_grid):
    """A run directory is held by the `evolve` writing it: `selfevo report RUN` then said "a demo (or
    another report) is writing here", and there was neither."""
    from selfevo.runs import RunDir

    _, jobs, _ = local_grid
    with RunDir(Path(jobs[0].out)).lock():
        result = CliRunner().invoke(app, ["report", jobs[0].out])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "a demo (or another report)" not in said and "a run" in said


def test_rounds_figure_leaves_a_gap_where_the_judge_resolved_nothing():
    from selfevo.report.figures import rounds_figure

    audit = {"coupled": {"rounds": [
        {"round": 1, "A": None, "T_P": {"mean": None, "std": None}, "F": {"mean": 0.1, "std": 0.01}},
        {"round": 2, "A": {"mean": 0.5, "std": None}, "T_P": {"mean": 0.7, "std": 0.1},
         "F": {"mean": 0.2, "std": 0.0}}]}}
    assert rounds_figure(audit)[:8] == b"\x89PNG\r\n\x1a\n"


def test_rounds_figure_ticks_every_round_whatever_treatment_comes_last(monkeypatch):
    """The ticks were the last treatment's rounds: an unaudited one left every panel without any."""
    from selfevo.report import figures

    monkeypatch.setattr(figures, "png", lambda fig: fig)
    rnd = [{"round": i, **{m: {"mean": 0.1 * i, "std": 0.0} for m in ("A", "T_P", "F")}} for i in (1, 2, 3)]
    fig = figures.rounds_figure({"coupled": {"rounds": rnd}, "msv": {"rounds": []}})
    for ax in fig.axes:
        assert list(ax.get_xticks()) == [1, 2, 3]
        assert [c.get_label() for c in ax.containers] == ["coupled"]  # no empty line for msv


def test_a_treatment_has_one_colour_in_every_figure_and_its_interval_as_given(monkeypatch):
    from matplotlib.colors import to_hex

    from selfevo.report import figures

    monkeypatch.setattr(figures, "png", lambda fig: fig)  # inspect the figure instead of its bytes
    rnd = {"round": 1, "A": {"mean": 0.5, "std": 0.0}, "T_P": {"mean": 0.7, "std": 0.0}, "F": {"mean": 0.1, "std": 0.0}}
    audit = {"coupled": {"rounds": [rnd]}, "msv": {"rounds": [rnd]}, "crossfit": {"rounds": [rnd]}}
    lines = {c.get_label(): to_hex(c.lines[0].get_color()) for c in figures.rounds_figure(audit).axes[0].containers}
    gain = {"mean": 0.02, "lo": 0.01, "hi": 0.05}
    downstream = {"coupled": {}, "msv": {"gain_vs_coupled": {"macro": None}},
                  "crossfit": {"gain_vs_coupled": {"macro": gain}}}
    ax = figures.cost_figure(downstream, {"crossfit": {"extra_seconds": {"mean": 0.2, "std": 0.05}}}).axes[0]
    (bar,) = ax.containers  # coupled and msv have no point
    point, _, (_, ybar) = bar.lines
    assert to_hex(point.get_color()) == lines["crossfit"] != lines["msv"]
    ys = sorted(y for seg in ybar.get_segments() for _, y in seg)
    assert ys == pytest.approx([0.01, 0.05])


def _audit(first: dict[str, list[float]], last: dict[str, list[float]], seeds=None) -> dict:
    """A treatment's audit entry as collect_runs writes it, from per-seed round-1 and last-round
    A / T_P / F."""
    from selfevo.algos import summary

    seeds = list(seeds if seeds is not None else range(len(last["A"])))
    by_seed = [{s: {m: v[i] for m, v in per.items()} for i, s in enumerate(seeds)} for per in (first, last)]
    return {"rounds": [{m: summary(v) for m, v in per.items()} for per in (first, last)],
            "first_by_seed": by_seed[0], "last_by_seed": by_seed[1], "unaudited": []}


def _res(coupled: dict[str, list[float]], other: dict[str, list[float]], gain: list[float]) -> dict:
    """A results dict as collect_runs writes it: per-seed round-3 A / T_P / F of coupled and one
    other treatment ("crossfit"), coupled's round-1 F below its round 3, and downstream macro gains."""
    from selfevo.algos import summary

    def audit(per_seed: dict[str, list[float]]) -> dict:
        return _audit({m: [v / 4 for v in vs] for m, vs in per_seed.items()}, per_seed)

    return {"audit": {"coupled": audit(coupled), "crossfit": audit(other)},
            "downstream": {"coupled": {}, "crossfit": {"gain_vs_coupled": {"macro": summary(gain)}}}}


COUPLED = {"A": [0.70, 0.72, 0.69], "T_P": [0.76, 0.75, 0.77], "F": [0.11, 0.12, 0.10]}


def test_readings_state_the_regression_only_where_paired_intervals_show_it():
    from selfevo.report.collect import readings

    clear = {"A": [0.42, 0.43, 0.41], "T_P": [0.83, 0.84, 0.83], "F": [0.04, 0.05, 0.04]}
    lines = readings(_res(COUPLED, clear, [0.010, 0.012, 0.011]))
    assert lines[0].startswith("Coupled loop: false agreement F rises from 0.028 (round 1) to 0.110")
    said = [line for line in lines if line.startswith("crossfit: agreement looks worse")]
    assert len(said) == 1 and said[0].endswith("would call this a regression.")
    assert "(A 0.420 vs coupled 0.703)" in said[0]
    assert "crossfit: downstream macro Cover-EM +0.011 vs coupled" in lines[-1]
    assert "(an interval excluding 0; 3 seeds)" in lines[-1]

    # the same means, but one seed's T_P below coupled's: the pattern is said with its intervals
    noisy = dict(clear, T_P=[0.95, 0.99, 0.55])
    said = [line for line in readings(_res(COUPLED, noisy, [0.03, -0.02, 0.00]))
            if line.startswith("crossfit: agreement looks worse")]
    assert len(said) == 1 and "on average over 3 seeds" in said[0] and "regression" not in said[0]
    assert "do not both exclude 0" in said[0]

    # agreement not lower: nothing is said about it, and an interval including 0 is called so
    higher = dict(clear, A=[0.75, 0.76, 0.74])
    lines = readings(_res(COUPLED, higher, [0.03, -0.02, 0.00]))
    assert not any("looks worse" in line for line in lines)
    assert "(an interval including 0; 3 seeds)" in lines[-1]
    # (each held by no test before a mutation sweep) a gain wholly below 0 excludes 0 too; lower agreement
    # with lower label truth is no "looks worse, truth better"; one paired seed says the pattern it shows with
    # the caveat the coupled reading gives one seed (it said nothing: a one-seed report hid the paper's headline)
    assert "(an interval excluding 0; 3 seeds)" in readings(_res(COUPLED, higher, [-0.010, -0.012, -0.011]))[-1]
    worse = dict(clear, T_P=[0.60, 0.61, 0.62])
    assert not any("looks worse" in line for line in readings(_res(COUPLED, worse, [0.01, 0.012, 0.011])))
    one = readings(_res({m: v[:1] for m, v in COUPLED.items()}, {m: v[:1] for m, v in clear.items()}, [0.01]))
    said = [line for line in one if "looks worse" in line]
    assert len(said) == 1 and said[0].endswith("(1 seed: no interval, the pattern is not settled).")
    assert "regression" not in said[0]


def test_the_coupled_reading_claims_co_cheating_only_where_paired_seeds_show_f_rising_with_a():
    """It said "rising agreement is partly co-cheating" on any rise of the mean F, even one of
    0.001 while A fell (a review's real runs: F 0.067 -> 0.068, A 0.414 -> 0.382)."""
    from selfevo.report.collect import readings

    def coupled_says(first: dict, last: dict) -> str:
        lines = readings({"audit": {"coupled": _audit(first, last)}, "downstream": {}})
        return lines[0] if lines else ""

    rising = coupled_says({"A": [0.34, 0.35, 0.33], "T_P": [0.77] * 3, "F": [0.03, 0.02, 0.03]},
                          {"A": [0.70, 0.69, 0.71], "T_P": [0.76] * 3, "F": [0.11, 0.10, 0.12]})
    assert rising.startswith("Coupled loop: false agreement F rises from 0.027 (round 1) to 0.110 (round 2)")
    assert "paired 95% interval [" in rising and rising.endswith("rising agreement is partly co-cheating.")
    flat = coupled_says({"A": [0.42, 0.41, 0.41], "T_P": [0.63] * 3, "F": [0.067, 0.070, 0.060]},
                        {"A": [0.38, 0.39, 0.38], "T_P": [0.69] * 3, "F": [0.068, 0.060, 0.075]})
    assert "includes 0: more seeds would settle it" in flat and "co-cheating" not in flat
    falling_a = coupled_says({"A": [0.50, 0.52, 0.51], "T_P": [0.7] * 3, "F": [0.03, 0.02, 0.03]},
                             {"A": [0.45, 0.46, 0.44], "T_P": [0.7] * 3, "F": [0.09, 0.10, 0.08]})
    assert "agreement itself did not rise" in falling_a and "co-cheating" not in falling_a
    one_seed = coupled_says({"A": [0.3], "T_P": [0.7], "F": [0.03]}, {"A": [0.7], "T_P": [0.7], "F": [0.10]})
    assert "1 seed: no interval" in one_seed and "co-cheating" not in one_seed
    assert coupled_says({"A": [0.3] * 2, "T_P": [0.7] * 2, "F": [0.05] * 2},
                        {"A": [0.7] * 2, "T_P": [0.7] * 2, "F": [0.05] * 2}) == ""  # F does not rise
    # a seed whose round-1 judge resolved nothing (every metric None) is left out of the means too:
    # they were over 4 seeds beside a rise over 3 ("rises from 0.110 to 0.113 (rise +0.040)")
    unresolved = coupled_says({"A": [0.5, 0.5, 0.5, None], "T_P": [0.5, 0.5, 0.5, None],
                               "F": [0.10, 0.12, 0.11, None]},
                              {"A": [0.6] * 4, "T_P": [0.5] * 4, "F": [0.14, 0.16, 0.15, 0.00]})
    assert "rises from 0.110 (round 1) to 0.150 (round 2)" in unresolved and "3 seeds" in unresolved


def test_the_coupled_reading_claims_no_rise_the_printed_decimals_do_not_show():
    """Any positive difference was a rise: "F rises from 0.060 (round 1) to 0.060 (round 2)" (a
    review's demo: F 0.0600 -> 0.0604, one seed)."""
    from selfevo.report.collect import readings

    def coupled_says(f_first: list, f_last: list) -> str:
        first = {"A": [0.40] * len(f_first), "T_P": [0.75] * len(f_first), "F": f_first}
        last = {"A": [0.38] * len(f_last), "T_P": [0.74] * len(f_last), "F": f_last}
        lines = readings({"audit": {"coupled": _audit(first, last)}, "downstream": {}})
        return lines[0] if lines else ""

    assert coupled_says([0.06], [0.0604026]) == ""
    assert coupled_says([0.0601, 0.0603], [0.0602, 0.0604]) == ""  # 0.060 -> 0.060 over 2 seeds
    assert coupled_says([0.06], [0.0606]).startswith("Coupled loop: false agreement F rises from 0.060 "
                                                     "(round 1) to 0.061 (round 2)")


def test_a_treatment_reading_quotes_the_means_of_the_seeds_it_pairs():
    """With a failed job the seed sets differ; the reading quoted each treatment's mean over its own
    seeds, and could say "agreement looks worse (A 0.460 vs coupled 0.407)"."""
    from selfevo.report.collect import readings

    coupled = _audit({"A": [0.3] * 3, "T_P": [0.7] * 3, "F": [0.03] * 3},
                     {"A": [0.52, 0.50, 0.20], "T_P": [0.60, 0.61, 0.60], "F": [0.10] * 3})
    crossfit = _audit({"A": [0.3] * 2, "T_P": [0.7] * 2, "F": [0.03] * 2},
                      {"A": [0.47, 0.45], "T_P": [0.80, 0.81], "F": [0.05, 0.05]}, seeds=[0, 1])
    crossfit["unaudited"] = [2]
    lines = readings({"audit": {"coupled": coupled, "crossfit": crossfit}, "downstream": {}})
    said = next(line for line in lines if line.startswith("crossfit: agreement looks worse"))
    assert "(A 0.460 vs coupled 0.510)" in said and "seeds 0, 1" in said
    assert "crossfit: seed(s) 2 not audited (`selfevo audit RUN`); the audit numbers leave them out." in lines


def test_every_table_formats_numbers_and_missing_numbers_alike():
    from selfevo._fmt import DASH, mean_std_text, num

    assert (num(0.12345), num(-0.5, "+.3f"), num(0.255, "+.0%"), num(None)) == ("0.123", "-0.500", "+26%", DASH)
    assert mean_std_text({"mean": 0.5, "std": 0.01}) == "0.500 ± 0.010"
    assert mean_std_text({"mean": 0.5, "std": 0.0, "n": 1}) == f"0.500 ± {DASH}"  # one seed: no spread
    assert mean_std_text({"mean": None, "std": None}) == mean_std_text(None) == DASH


def test_report_gains_are_paired_by_seed(local_grid):
    import statistics

    root, _, _ = local_grid
    gain = build_report(root, context="test")["downstream"]["crossfit"]["gain_vs_coupled"]["macro"]
    macro = {(t, s): json.loads((root / f"{t}-s{s}" / "eval" / "round-3.json").read_text())["macro"]["cover_em"]
             for t in ("coupled", "crossfit") for s in (0, 1)}
    diffs = [macro[("crossfit", s)] - macro[("coupled", s)] for s in (0, 1)]  # same seed, not pooled
    assert gain["std"] == pytest.approx(statistics.stdev(diffs), abs=1e-12)
    assert gain["lo"] == pytest.approx(statistics.fmean(diffs) - 12.706 * statistics.stdev(diffs) / 2 ** 0.5)


def test_compare_ratios_are_against_the_coupled_run_of_the_same_seed(local_grid):
    from selfevo.report.compare import compare

    root, _, _ = local_grid
    runs = [root / f"{t}-s{s}" for t in ("coupled", "crossfit") for s in (0, 1)]
    compute = {p.name: json.loads((p / "compute.json").read_text()) for p in runs}
    rows = {Path(r["run"]).name: r for r in compare(runs)}
    for s in (0, 1):
        mine, base = compute[f"crossfit-s{s}"], compute[f"coupled-s{s}"]
        row = rows[f"crossfit-s{s}"]
        # the training's cost: the downstream evaluation, the same in every arm, is left out
        assert mine["generations"]["evaluation"] == base["generations"]["evaluation"] > 0

        def trained(c):
            return c["total_generations"] - c["generations"]["evaluation"]

        assert row["extra_generations"] == pytest.approx(trained(mine) / trained(base) - 1)
        assert row["extra_updates"] == pytest.approx(mine["total_updates"] / base["total_updates"] - 1)
        secs, base_secs = ({ph: v for ph, v in c["seconds"].items() if ph != "eval"} for c in (mine, base))
        secs, base_secs = sum(secs.values()), sum(base_secs.values())  # every training phase
        assert row["seconds"] == round(secs, 3)
        assert row["extra_seconds"] == pytest.approx(secs / base_secs - 1)
        assert rows[f"coupled-s{s}"]["extra_seconds"] == 0.0
    assert compare([root / "crossfit-s0"])[0]["extra_generations"] is None  # no coupled run of its seed


def test_compare_reads_a_run_given_twice_once(local_grid, tmp_path):
    """One run under two spellings (and a link to it) was two coupled runs of one seed, refused, or a
    treatment's row twice."""
    from selfevo.report.compare import compare

    root, _, _ = local_grid
    (tmp_path / "link").symlink_to(root / "coupled-s0", target_is_directory=True)
    spellings = [root / "coupled-s0", f"{root}/./coupled-s0/", tmp_path / "link", root / "crossfit-s0",
                 root / "crossfit-s0"]
    rows = compare(spellings)
    assert [Path(r["run"]).name for r in rows] == ["coupled-s0", "crossfit-s0"]
    assert rows[1]["extra_generations"] is not None


ONE_ROUND = [*SMALL, "loop.rounds=1"]


def test_a_run_killed_in_its_audit_is_audited_on_rerun_not_skipped(tmp_path, monkeypatch):
    import selfevo.evolve

    (job,) = grid(["coupled"], [0], tmp_path, ONE_ROUND)
    real = selfevo.evolve.audit_run

    def dies(*args, **kwargs):
        raise RuntimeError("judge died")

    monkeypatch.setattr(selfevo.evolve, "audit_run", dies)
    (res,) = run_grid([job], "local", workers=1)
    assert res["status"] == "failed" and "judge died" in res["error"]
    assert json.loads((Path(job.out) / "manifest.json").read_text())["status"] != "complete"
    monkeypatch.setattr(selfevo.evolve, "audit_run", real)
    (res,) = run_grid([job], "local", workers=1)
    assert res["status"] == "ok" and (Path(job.out) / "audit" / "metrics.json").exists()
    assert json.loads((Path(job.out) / "manifest.json").read_text())["status"] == "complete"


def test_a_finished_job_under_another_config_is_refused_not_skipped(tmp_path):
    (job,) = grid(["coupled"], [0], tmp_path, ONE_ROUND)
    assert run_grid([job], "local", workers=1)[0]["status"] == "ok"
    (changed,) = grid(["coupled"], [0], tmp_path, [*SMALL, "loop.rounds=2"])
    (res,) = run_grid([changed], "local", workers=1)
    assert res["status"] == "failed" and "config differs" in res["error"] and "loop.rounds" in res["error"]
    assert run_grid([job], "local", workers=1)[0]["status"] == "skipped"  # its own config: finished


def test_a_worker_that_dies_fails_its_job_and_the_grid_still_returns(tmp_path, monkeypatch):
    import signal

    import selfevo.evolve

    real = selfevo.evolve.evolve

    def evolve(cfg, out, **kwargs):  # the forked workers inherit this
        if str(out).endswith("coupled-s1"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(cfg, out, **kwargs)

    monkeypatch.setattr(selfevo.evolve, "evolve", evolve)
    jobs = grid(["coupled"], [0, 1, 2, 3], tmp_path, ONE_ROUND)
    results = run_grid(jobs, "local", workers=2)
    assert [r["job"] for r in results] == ["coupled-s0", "coupled-s1", "coupled-s2", "coupled-s3"]
    assert results[1]["status"] == "failed" and "worker process died" in results[1]["error"]
    # the death fails its job alone: a process pool, broken by it, failed every job not yet finished,
    # those it had not started included (a helper's review: one OOM kill failed a whole demo)
    assert [r["status"] for r in results] == ["ok", "failed", "ok", "ok"]
    monkeypatch.setattr(selfevo.evolve, "evolve", real)
    assert [r["status"] for r in run_grid(jobs, "local", workers=2)] == ["skipped", "ok", "skipped", "skipped"]


def test_a_local_job_may_start_processes_and_one_slow_to_exit_holds_up_no_other(tmp_path, monkeypatch):
    """Each local job runs in a process of its own: a daemonic one could start no child ("daemonic
    processes are not allowed to have children": vLLM's engine does), and one joined before the next
    result was read held up the grid while a thread it left ran on (a review of the session's diff)."""
    import multiprocessing
    import threading

    import selfevo.evolve

    real = selfevo.evolve.evolve

    def evolve(cfg, out, **kwargs):  # the forked job processes inherit this
        child = multiprocessing.get_context("fork").Process(target=int)
        child.start()
        child.join()
        if str(out).endswith("coupled-s0"):  # a thread of the job's left running after its result
            threading.Thread(target=time.sleep, args=(120,)).start()
        return real(cfg, out, **kwargs)

    monkeypatch.setattr(selfevo.evolve, "evolve", evolve)
    jobs = grid(["coupled"], [0, 1, 2], tmp_path, ONE_ROUND)
    started = time.monotonic()
    results = run_grid(jobs, "local", workers=2)
    assert [r["status"] for r in results] == ["ok"] * 3, results
    assert time.monotonic() - started < 90  # not the thread's 120 s: killed after a grace period


def test_collect_pairs_only_values_that_exist(local_grid, tmp_path):
    """No multi-hop benchmark (a corpus's single-hop QA set) leaves that column's gain empty, and a
    seed whose last round the judge resolved nothing of drops out of the readings' pairs."""
    import shutil

    from selfevo.report.collect import collect_runs, readings

    root, jobs, _ = local_grid
    copies = []
    for j in jobs:
        dst = tmp_path / Path(j.out).name
        shutil.copytree(j.out, dst)
        copies.append(dst)
        ev = json.loads((dst / "eval" / "round-3.json").read_text())
        ev["multi_hop"] = {"cover_em": None, "em": None, "f1": None}
        (dst / "eval" / "round-3.json").write_text(json.dumps(ev))
    res = collect_runs(copies)
    gain = res["downstream"]["crossfit"]["gain_vs_coupled"]
    assert gain["multi_hop"]["n"] == 0 and gain["macro"]["n"] == 2
    res["audit"]["crossfit"]["last_by_seed"][1].update(A=None, T_P=None, F=None)
    readings(res)  # one seed left to pair: no reading of the pattern, and no crash


def test_a_round_that_admitted_nothing_is_left_out_of_the_hop_mix(local_grid, tmp_path):
    """A run whose round admitted nothing (MSV rejecting every proposal: its mix is {}) was averaged
    in as shares of 0: two seeds' mix summed to 0.5, every hop count's share halved."""
    import shutil

    from selfevo.report.collect import collect_runs

    root, _, _ = local_grid
    copies = [tmp_path / name for name in ("coupled-s0", "coupled-s1")]
    for dst in copies:
        shutil.copytree(root / dst.name, dst)
    path = copies[1] / "audit" / "metrics.json"
    metrics = json.loads(path.read_text())
    metrics["rounds"][-1].update(admitted=0, hop_mix_admitted={})
    path.write_text(json.dumps(metrics))
    last = collect_runs(copies)["audit"]["coupled"]["rounds"][-1]
    kept = json.loads((copies[0] / "audit" / "metrics.json").read_text())["rounds"][-1]
    assert last["hop_mix_admitted"] == kept["hop_mix_admitted"]
    assert sum(last["hop_mix_admitted"].values()) == pytest.approx(1.0, abs=1e-3)
    assert last["admitted"]["mean"] == kept["admitted"] / 2  # the count itself is a real 0


def test_the_base_row_covers_every_seed_any_treatment_completed(local_grid):
    from selfevo.report.collect import collect_runs

    root, _, _ = local_grid
    res = collect_runs([root / "coupled-s0", root / "crossfit-s0", root / "crossfit-s1"])  # coupled-s1 failed
    assert res["base"]["macro"]["n"] == 2


def test_a_grid_refuses_two_jobs_on_one_run_directory(tmp_path):
    # both would write the same run directory at once; results keyed by name would drop one
    with pytest.raises(ValueError, match="two jobs share the name 'coupled-s0'"):
        run_grid(grid(["coupled", "crossfit", "coupled"], [0], tmp_path, ONE_ROUND), "local", workers=1)
    with pytest.raises(ValueError, match="two jobs share the name 'coupled-s1'"):
        run_grid(grid(["coupled"], [1, 1], tmp_path, ONE_ROUND), "local", workers=1)
    a, b = grid(["coupled", "crossfit"], [0], tmp_path, ONE_ROUND)
    with pytest.raises(ValueError, match="two jobs share the run directory"):
        run_grid([a, replace(b, out=a.out + "/")], "local", workers=1)
    assert not any(tmp_path.iterdir())  # refused before any job ran


def test_a_report_leaves_no_figure_of_an_earlier_report_behind(local_grid, tmp_path):
    import shutil

    root = tmp_path / "grid"
    shutil.copytree(local_grid[0], root)
    build_report(root)
    assert len(list((root / "figures").glob("figure-*.png"))) == 3  # steps, rounds, cost
    build_report(root, runs=[root / "crossfit-s0", root / "crossfit-s1"])  # no coupled: rounds only
    assert sorted(p.name for p in (root / "figures").iterdir()) == ["figure-1.png"]
    assert "figures/figure-1.png" in (root / "report.md").read_text()


def test_a_report_that_cannot_be_written_whole_leaves_the_previous_one(local_grid, tmp_path, monkeypatch):
    """On a full disk the report's files were written one at a time: new figures, results.json and report.md
    beside the old report.html, each whole, the set telling two stories. Now every file is written before any
    replaces its old self."""
    import errno
    import shutil

    import selfevo._io as io_mod

    root = tmp_path / "grid"
    shutil.copytree(local_grid[0], root)
    build_report(root, runs=[root / "coupled-s0", root / "coupled-s1"])
    files = [root / "results.json", root / "report.md", root / "report.html", *(root / "figures").glob("*.png")]
    before = {p: p.read_bytes() for p in files}
    real = io_mod.atomic_writer
    written = []

    def full_at_html(path, mode="w", fsync=True):  # the disk fills as the last file is written
        if Path(path).name == "report.html":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        written.append(Path(path).name)
        return real(path, mode, fsync)

    monkeypatch.setattr(io_mod, "atomic_writer", full_at_html)
    with pytest.raises(OSError, match="No space left"):
        build_report(root)
    assert "results.json" in written and "report.md" in written  # they were written, then not put in place
    assert {p: p.read_bytes() for p in before} == before and len(list((root / "figures").iterdir())) == len(files) - 3
    assert not list(root.rglob(".*.tmp"))
    monkeypatch.setattr(io_mod, "atomic_writer", real)
    assert "crossfit" in build_report(root)["downstream"] and "crossfit" in (root / "report.html").read_text()


TWO_SMALL = ["world.name=\"small\"", "loop.admit_per_round=20", "loop.proposer_steps=2", "loop.solver_steps=2"]


def test_compare_ratios_are_against_the_coupled_run_of_the_same_config_and_rounds(tmp_path):
    import shutil

    from selfevo.report.compare import compare
    from selfevo.runs import RunError

    two = grid(["coupled", "crossfit"], [0], tmp_path / "two", [*TWO_SMALL, "loop.rounds=2"])
    (one,) = grid(["coupled"], [0], tmp_path / "one", [*TWO_SMALL, "loop.rounds=1"])
    assert [r["status"] for r in run_grid(two, "local", workers=1)] == ["ok"] * 2
    assert run_grid([one], "local", workers=1)[0]["status"] == "ok"
    coupled, crossfit, short = Path(two[0].out), Path(two[1].out), Path(one.out)
    gen = {p: (c := json.loads((p / "compute.json").read_text()))["total_generations"] - c["generations"]["evaluation"]
           for p in (coupled, crossfit)}
    want = gen[crossfit] / gen[coupled] - 1
    for order in ([coupled, short, crossfit], [short, coupled, crossfit]):  # the order chose the base
        rows = {Path(r["run"]): r for r in compare(order)}
        assert rows[crossfit]["extra_generations"] == pytest.approx(want)
        assert rows[coupled]["extra_generations"] == rows[short]["extra_generations"] == 0.0
    # a coupled run of seed 0 killed after round 1 of 2: its counts are of one round, no base
    killed = tmp_path / "killed" / "coupled-s0"
    shutil.copytree(coupled, killed)
    manifest = json.loads((killed / "manifest.json").read_text())
    (killed / "manifest.json").write_text(json.dumps({**manifest, "status": "running", "rounds_completed": 1}))
    state = json.loads((killed / "checkpoints" / "round-1.json").read_text())
    (killed / "compute.json").write_text(json.dumps(state["compute"]))
    rows = {Path(r["run"]): r for r in compare([killed, crossfit])}
    assert rows[crossfit]["extra_generations"] is None and rows[killed]["extra_generations"] == 0.0
    # two coupled runs of one seed and config: which one is the base is not guessed
    twin = tmp_path / "twin" / "coupled-s0"
    shutil.copytree(coupled, twin)
    with pytest.raises(RunError, match="two coupled runs of seed 0"):
        compare([coupled, twin, crossfit])


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_an_interrupted_grid_stops_with_its_workers(tmp_path, signame):
    """Ctrl-C (or SIGTERM) of a local grid ends it now: no worker goes on running the queued jobs,
    before the grid returns (Ctrl-C) or after it is gone (SIGTERM: orphans writing run directories
    that a rerun resumes at the same time)."""
    import contextlib
    import signal
    import subprocess
    import sys
    import time

    script = (f"from selfevo.experiments import grid, run_grid\n"
              f"run_grid(grid(['coupled'], range(8), {str(tmp_path)!r}, {ONE_ROUND!r}), 'local', workers=2)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")},
                            start_new_session=True)  # its own group: the test cleans up whatever outlives it
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("*/manifest.json")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None and list(tmp_path.glob("*/manifest.json")), "the grid never started a run"
        proc.send_signal(getattr(signal, signame))  # the grid's process only, as `kill PID` does
        proc.wait(timeout=30)
        after = time.monotonic()

        def state() -> list:
            return sorted((p.parent.name, p.read_bytes()) for p in tmp_path.glob("*/manifest.json"))

        seen = state()
        while time.monotonic() - after < 4:  # nothing left running writes another manifest
            time.sleep(0.2)
            assert state() == seen
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    complete = [name for name, m in seen if json.loads(m)["status"] == "complete"]
    assert len(seen) < 8 and len(complete) < 8


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an orphan's reaper may be slow, or none)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _hanging_grid(tmp_path: Path, setup: str = "") -> str:
    """A script running a 4-job grid on 2 workers whose jobs write tmp_path/marks/PID and then hang
    (`setup`: a line run before the grid starts)."""
    (tmp_path / "marks").mkdir()
    return textwrap.dedent(f"""
        import os, time
        import selfevo.evolve, selfevo.experiments
        def evolve(cfg, out, **kwargs):  # a job that runs long after its grid is stopped
            open(os.path.join({str(tmp_path / "marks")!r}, str(os.getpid())), "w").close()
            time.sleep(120)
        selfevo.evolve.evolve = evolve
        {setup}
        from selfevo.experiments import grid, run_grid
        run_grid(grid(["coupled"], range(4), {str(tmp_path / "runs")!r}), "local", workers=2)
        """)


def _stop_with_workers(script: str, marks: Path, signame: str, children: Path | None = None,
                       again_after: float | None = None) -> tuple[subprocess.Popen, list[int]]:
    """Run `script` (whose pool workers each write marks/PID and then hang in their job), send
    its process `signame` once 2 workers are in a job (and again `again_after` seconds later); returns the
    process (ended) and the pids of the workers (and of the processes named in `children`) still alive 5 s
    later. The test's process group is killed on the way out."""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")},
                            start_new_session=True)  # its own group: the test cleans up whatever outlives it
    try:
        deadline = time.monotonic() + 120
        while len(list(marks.glob("*"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = [int(p.name) for p in marks.glob("*")]
        assert len(workers) == 2, proc.stderr.read().decode() if proc.poll() is not None else "no worker started"
        workers += [int(p.name) for p in children.glob("*")] if children else []
        proc.send_signal(getattr(signal, signame))  # the process only, as `kill PID` or the OOM killer does
        if again_after is not None:
            time.sleep(again_after)
            proc.send_signal(getattr(signal, signame))
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return proc, [w for w in workers if _alive(w)]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="death with the parent is Linux's prctl")
def test_a_grid_killed_with_kill_9_takes_its_workers_with_it(tmp_path):
    """kill -9 (the OOM killer, `timeout -s KILL`) of a grid left its workers running their jobs as
    orphans, holding the runs' locks: an immediate rerun was refused ("another process is writing
    this run")."""
    _, left = _stop_with_workers(_hanging_grid(tmp_path), tmp_path / "marks", "SIGKILL")
    assert left == []


def test_a_stopped_grid_stops_what_its_jobs_started(tmp_path):
    """SIGTERM of a grid killed its jobs' processes alone: what a job had started (vLLM's engine processes,
    holding a GPU) ran on, orphaned."""
    marks, children = tmp_path / "marks", tmp_path / "children"
    marks.mkdir()
    children.mkdir()
    script = textwrap.dedent(f"""
        import os, subprocess, sys, time
        import selfevo.evolve
        def evolve(cfg, out, **kwargs):  # a job that starts a process of its own, then runs long
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            open(os.path.join({str(children)!r}, str(child.pid)), "w").close()
            open(os.path.join({str(marks)!r}, str(os.getpid())), "w").close()
            time.sleep(120)
        selfevo.evolve.evolve = evolve
        from selfevo.experiments import grid, run_grid
        run_grid(grid(["coupled"], range(4), {str(tmp_path / "runs")!r}), "local", workers=2)
        """)
    proc, left = _stop_with_workers(script, marks, "SIGTERM", children)
    assert proc.returncode == 128 + signal.SIGTERM and len(list(children.glob("*"))) == 2 and left == []


def test_a_grid_stopped_before_a_started_jobs_watch_began_stops_that_job_too(tmp_path):
    """SIGTERM while the grid began watching a job it had just started (a /proc scan, slow on a loaded
    machine) left that job out of the stop: the interpreter's exit then waited on it, the whole job's
    length (CI saw the grid outlive its 30 s). Here the second watch takes a minute to begin."""
    slow_watch = ("import selfevo._proc as P; W = P.Watch.__init__; P.Watch.__init__ = "
                  "lambda self, proc, interval, n=[]: (n.append(1), time.sleep(60 * (len(n) == 2)), "
                  "W(self, proc, interval))[-1]")
    proc, left = _stop_with_workers(_hanging_grid(tmp_path, slow_watch), tmp_path / "marks", "SIGTERM")
    assert proc.returncode == 128 + signal.SIGTERM and left == []


def test_a_grid_interrupted_in_a_jobs_start_before_its_fork_stops_the_started_job(tmp_path, monkeypatch):
    """Ctrl-C in the second job's start, before its fork: the grid stops the first job, and the second, with no
    process (its pid None), is left out of the stop, where a stop of it would raise a TypeError that hid
    the KeyboardInterrupt."""
    import multiprocessing.context

    import selfevo.experiments as ex

    monkeypatch.setattr(ex, "run_job", lambda job: time.sleep(60))
    start, started = multiprocessing.context.ForkProcess.start, []

    def interrupted_second(self):
        if started:
            raise KeyboardInterrupt
        start(self)
        started.append(self.pid)

    monkeypatch.setattr(multiprocessing.context.ForkProcess, "start", interrupted_second)
    jobs = [Job(n, ("seed=0",), str(tmp_path / n)) for n in ("a", "b")]
    with pytest.raises(KeyboardInterrupt):
        ex._job_processes(jobs, 2, lambda res: None)
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(started[0], 0)


def test_a_second_sigterm_in_a_jobs_stop_leaves_no_other_job_running(tmp_path):
    """A second SIGTERM (the first "did not work") landing in one job's stop ended the grid's stops there: the
    jobs after it ran on, and the interpreter's exit waited on them. Here each stop's look at the tree takes
    2 s, and the second SIGTERM comes 1 s after the first. The jobs ignore SIGTERM: one dying of it before its
    stop looked again skipped that look, and the stops could end before the second SIGTERM came."""
    slow_stop = ("import selfevo._proc as P, signal, sys; S = P.process_tree; P.process_tree = lambda *roots: "
                 "(time.sleep(2 * (sys._getframe(1).f_code.co_name == '_stop')), S(*roots))[-1]; "
                 "E = selfevo.evolve.evolve; selfevo.evolve.evolve = lambda *a, **k: "
                 "(signal.signal(signal.SIGTERM, signal.SIG_IGN), E(*a, **k))[-1]")
    proc, left = _stop_with_workers(_hanging_grid(tmp_path, slow_stop), tmp_path / "marks", "SIGTERM",
                                    again_after=1.0)
    assert proc.returncode == 128 + signal.SIGTERM and left == []


def test_a_job_process_that_dies_leaving_a_process_with_its_pipe_is_failed_at_once(tmp_path, monkeypatch, caplog):
    """A job's death was noticed only as the end of its result pipe, which a process it had started held
    open: the grid waited on that process (forever, for a server), its other jobs queued behind it. The
    job fails at once, and the process it left is stopped, named in a warning."""
    import selfevo._proc
    import selfevo.experiments

    helper, seen = tmp_path / "helper", tmp_path / "seen"
    look = selfevo._proc.process_tree

    def process_tree(*roots):  # the grid's watch, in this process: says when one of its looks found the helper
        tree = look(*roots)
        if helper.exists() and int(helper.read_text()) in tree:
            seen.touch()
        return tree

    def run_job(job):  # the forked job processes inherit this: a forks a helper (keeping the pipe), then dies
        if job.name == "b":
            return {"job": job.name, "status": "ok", "run": job.out}
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        part = tmp_path / "helper.part"
        part.write_text(str(pid))
        part.replace(helper)  # whole when it appears
        deadline = time.monotonic() + 10
        while not seen.exists() and time.monotonic() < deadline:  # the grid's watch has seen the helper (it
            time.sleep(0.02)  # looks every second; a sleep of 2 s was not always enough on a loaded machine)
        os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(selfevo._proc, "process_tree", process_tree)
    monkeypatch.setattr(selfevo.experiments, "run_job", run_job)
    start = time.monotonic()
    try:
        with caplog.at_level("WARNING", logger="selfevo._proc"):
            results = run_grid([Job(name, (), str(tmp_path / name)) for name in "ab"], "local", workers=2)
        assert time.monotonic() - start < 30  # not the helper's 60 s
        assert results[0]["status"] == "failed" and "exit code -9" in results[0]["error"]
        assert results[1]["status"] == "ok"
        assert not _alive(int(helper.read_text()))
        assert f"job a exited (code -9) leaving 1 of its processes running (pid {helper.read_text()})" in caplog.text
    finally:
        if helper.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(helper.read_text()), signal.SIGKILL)


def test_a_grid_forks_no_more_workers_than_jobs(tmp_path):
    """--workers 40 forked 40 processes for a 2-job grid; and no more than --workers run at once."""
    import multiprocessing

    seen = []
    jobs = [Job(name, ("no.such_field=1",), str(tmp_path / name)) for name in ("a", "b")]  # fail at once
    results = run_grid(jobs, "local", workers=8,
                       on_done=lambda res: seen.append(len(multiprocessing.active_children())))
    assert [r["status"] for r in results] == ["failed", "failed"]
    assert max(seen) <= 2
    seen.clear()
    jobs = [Job(name, ("no.such_field=1",), str(tmp_path / name)) for name in "cdefg"]
    assert [r["status"] for r in run_grid(jobs, "local", workers=2,
                                          on_done=lambda res: seen.append(len(multiprocessing.active_children())))
            ] == ["failed"] * 5
    assert len(seen) == 5 and max(seen) <= 2


def test_sigterm_exits_143_where_a_library_re_raises_the_exit_as_its_own():
    """Ray's wait runs the SIGTERM handler and raises SystemExit(1) in place of its SystemExit(143):
    `selfevo demo --executor ray` exited 1, the code for "a job failed, the report covers the rest"."""
    from selfevo.experiments import terminate_raises

    def ray_wait():  # what ray.wait does with an exception a signal handler raises inside it
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs here
        except SystemExit:
            raise SystemExit(1) from None

    with pytest.raises(SystemExit) as e, terminate_raises():
        ray_wait()
    assert e.value.code == 143


def _copy_grid(local_grid, tmp_path) -> Path:
    import shutil

    root = tmp_path / "grid"
    shutil.copytree(local_grid[0], root)
    return root


def test_runs_made_on_different_data_under_one_path_are_not_pooled_or_paired(local_grid, tmp_path):
    """A world directory (or corpus) remade at the same path gives identical configs: only the sha256
    the manifest records tells the runs apart (before: reported and paired as one setting)."""
    from selfevo.report.compare import compare

    root = _copy_grid(local_grid, tmp_path)
    for seed in (0, 1):
        path = root / f"crossfit-s{seed}" / "manifest.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "world_sha256": "remade"}))
    with pytest.raises(ValueError, match="made on different data under one path .*world_sha256"):
        build_report(root)
    rows = compare([root / "coupled-s0", root / "crossfit-s0"])
    assert rows[1]["extra_generations"] is None  # no coupled run of its setting to pair with
    # the benchmarks evaluated on (a QA directory replaced under its path) tell runs apart too
    for seed in (0, 1):
        path = root / f"crossfit-s{seed}" / "manifest.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "world_sha256": None, "qa_sha256": "b" * 64}))
    with pytest.raises(ValueError, match="made on different data under one path .*qa_sha256"):
        build_report(root)
    assert compare([root / "coupled-s0", root / "crossfit-s0"])[1]["extra_generations"] is None


def test_audits_by_other_settings_are_not_pooled_and_the_judge_is_named(local_grid, tmp_path):
    root = _copy_grid(local_grid, tmp_path)
    build_report(root)
    assert "## Audit by round (mean ± std over seeds; judge oracle)" in (root / "report.md").read_text()
    # one run audited again on the first item of every step only: its numbers mean something else
    rc = CliRunner().invoke(app, ["audit", str(root / "coupled-s1"), "--max-items-per-step", "1", "--no-figures"])
    assert rc.exit_code == 0, rc.output
    with pytest.raises(ValueError, match="coupled-s1 and .* were audited differently .*max_items_per_step"):
        build_report(root)
    # all of them audited alike: reported, and the table says how
    for run in ("coupled-s0", "crossfit-s0", "crossfit-s1"):
        assert CliRunner().invoke(app, ["audit", str(root / run), "--max-items-per-step", "1",
                                        "--no-figures"]).exit_code == 0
    build_report(root)
    assert "judge oracle, first 1 items of every step only)" in (root / "report.md").read_text()


def test_the_report_has_a_column_for_each_benchmark_the_runs_were_evaluated_on(local_grid, tmp_path):
    """Macro averages every benchmark of an evaluation: one outside the paper's seven is shown, and
    one the QA set lacks gets no column of dashes."""
    root = _copy_grid(local_grid, tmp_path)
    for ev in root.glob("*/eval/round-*.json"):
        data = json.loads(ev.read_text())
        data["benchmarks"] = {"nq": data["benchmarks"]["nq"], "mybench": data["benchmarks"]["popqa"]}
        ev.write_text(json.dumps(data))
    res = build_report(root)
    assert res["benchmarks"] == ["nq", "mybench"]
    header = next(line for line in (root / "report.md").read_text().splitlines() if line.startswith("| treatment | nq"))
    assert header.startswith("| treatment | nq | mybench | macro |")


def test_a_replay_study_of_other_runs_is_named_in_the_report(local_grid, tmp_path):
    root = _copy_grid(local_grid, tmp_path)
    (root / "replay").mkdir()
    study = {"bank": {"sources": [str(tmp_path / "elsewhere" / "coupled-7")]},
             "conditions": {"coupled": {m: {"mean": 0.1, "std": 0.01} for m in ("F", "solver_truth",
                                                                                  "replay_accuracy", "A", "coverage")}}}
    (root / "replay" / "results.json").write_text(json.dumps(study))
    res = build_report(root)
    assert any("come from run(s) not in this report" in r and "coupled-7" in r for r in res["readings"])
    study["bank"]["sources"] = [str(root / "coupled-s0")]  # its own runs: nothing to say
    (root / "replay" / "results.json").write_text(json.dumps(study))
    assert not any("not in this report" in r for r in build_report(root)["readings"])
    # runs and study moved or copied together (the bank names the runs where they were built): the run
    # is known by its manifest's creation time, and another run's time is still someone else's run
    created = json.loads((root / "coupled-s0" / "manifest.json").read_text())["created"]
    study["bank"].update(sources=[str(tmp_path / "before-the-move" / "coupled-s0")], source_created=[created])
    (root / "replay" / "results.json").write_text(json.dumps(study))
    assert not any("not in this report" in r for r in build_report(root)["readings"])
    study["bank"]["source_created"] = [created + 1]
    (root / "replay" / "results.json").write_text(json.dumps(study))
    assert any("not in this report" in r for r in build_report(root)["readings"])
    from selfevo.runs import RunError

    study["bank"]["source_created"] = ["yesterday"]
    (root / "replay" / "results.json").write_text(json.dumps(study))
    with pytest.raises(RunError, match="bank.source_created"):
        build_report(root)
    study["bank"]["source_created"] = [created]
    study["reference"] = {"base": {"F": {"mean": 0.03, "std": 0.001}}}  # a base row lacking its other columns
    (root / "replay" / "results.json").write_text(json.dumps(study))
    with pytest.raises(RunError, match=r"field reference.base.solver_truth: should be an object"):
        build_report(root)


def test_a_cluster_address_nothing_answers_at_is_refused_at_once(tmp_path, monkeypatch):
    """RAY_ADDRESS naming a port nothing listens on: `ray.init` retried for about 14 minutes, the
    progress bar at 0, before its error (a helper's review); now one line, before Ray is started."""
    ray = pytest.importorskip("ray")
    import socket

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # a Ray another test left up is not joined
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    started = time.monotonic()
    with pytest.raises(ValueError, match=f"RAY_ADDRESS=127.0.0.1:{port}: nothing answers at"):
        run_grid(grid(["coupled"], [0], tmp_path, ONE_ROUND), "ray")
    assert time.monotonic() - started < 30 and not (tmp_path / "coupled-s0").exists()


def test_a_ray_grid_does_not_start_a_local_ray_with_token_authentication_off(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail("ray.init was called"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(ValueError, match="RAY_AUTH_MODE='disabled' would start a local Ray without token"):
        run_grid(grid(["coupled"], [0], tmp_path, ONE_ROUND), "ray")


def test_a_ray_grid_keeps_the_sigterm_handler_it_found(monkeypatch):
    """ray.init installs Ray's driver SIGTERM handler (exit 15). `demo --executor ray` kept it after its
    grid: a SIGTERM during the rest of the demo (bank, report) exited 15 without its cleanup or the line
    saying how to go on (a helper's review). The handler found before ray.init is put back."""
    import signal
    import sys

    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: signal.signal(signal.SIGTERM, lambda s, f: sys.exit(15)))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)

    def ours(signum, frame):
        raise SystemExit(143)
    previous = signal.signal(signal.SIGTERM, ours)
    try:
        assert run_grid([], "ray") == []
        assert signal.getsignal(signal.SIGTERM) is ours
        # a SIGTERM while ray.init runs meets Ray's handler (exit 15): the command's exit 143, what Ray
        # started shut down, the handler put back (`eval --workers` starts Ray the same way)
        shut = []
        monkeypatch.setattr(ray, "shutdown", lambda: shut.append(True))

        def init_stopped(**kw):
            signal.signal(signal.SIGTERM, lambda s, f: sys.exit(15))
            sys.exit(15)  # as Ray's handler does when the signal arrives

        monkeypatch.setattr(ray, "init", init_stopped)
        with pytest.raises(SystemExit) as stopped:
            run_grid([], "ray")
        assert stopped.value.code == 143 and shut == [True] and signal.getsignal(signal.SIGTERM) is ours
        from selfevo.agents.lm.config import LMConfig
        from selfevo.agents.lm.workers import RolloutWorkers

        with pytest.raises(SystemExit) as stopped:
            RolloutWorkers(LMConfig(), 1)
        assert stopped.value.code == 143 and signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_run_whose_admission_read_truth_is_no_run_of_the_loop(local_grid, tmp_path):
    """benchmarks/downstream.py's ceiling arm lets the oracle withhold wrong labels, under a config
    that says `coupled`: its manifest says so, and no report, comparison or replay bank takes it."""
    import shutil

    from selfevo.replay import ReplayError, build_bank
    from selfevo.report.collect import collect_runs
    from selfevo.report.compare import compare
    from selfevo.runs import ORACLE_ADMISSION, RunDir, RunError

    root, _, _ = local_grid
    ceiling = tmp_path / "coupled-s0"
    shutil.copytree(root / "coupled-s0", ceiling)
    RunDir(ceiling).note(**{ORACLE_ADMISSION: True})
    with pytest.raises(RunError, match="admission was decided by the oracle"):
        collect_runs([ceiling, root / "crossfit-s0"])
    with pytest.raises(RunError, match="admission was decided by the oracle"):
        compare([ceiling, root / "crossfit-s0"])
    with pytest.raises(ReplayError, match="admission was decided by the oracle"):
        build_bank([ceiling], size=10)
    build_bank([root / "coupled-s0"], size=10)  # the run it copies is taken


def test_a_benchmark_name_with_a_pipe_or_markup_keeps_the_markdown_table_whole(local_grid, tmp_path):
    """A benchmark is named by its QA file (`metadata.benchmark`): a `|` in the name split the header
    cell, so the header had one cell more than the delimiter row and no renderer read a table; a
    `<script>` went into the Markdown raw (the HTML page escapes it)."""
    markdown_it = pytest.importorskip("markdown_it")
    root = _copy_grid(local_grid, tmp_path)
    name = "a|b <script>x</script>"
    for ev in root.glob("*/eval/round-*.json"):
        data = json.loads(ev.read_text())
        data["benchmarks"] = {"nq": data["benchmarks"]["nq"], name: data["benchmarks"]["popqa"]}
        ev.write_text(json.dumps(data))
    build_report(root)
    page = markdown_it.MarkdownIt("commonmark").enable("table").render((root / "report.md").read_text())
    assert page.count("<table>") == 3 and "<script>" not in page  # downstream, audit, compute: none lost
    downstream = page.split("<table>")[1]
    assert "<th>a|b &lt;script&gt;x&lt;/script&gt;</th>" in downstream
    assert downstream.count("<th>") == 9  # treatment, nq, the name, macro, single-hop, multi-hop, three Δ
    assert "&lt;script&gt;" in (root / "report.html").read_text()


def test_run_file_text_opens_no_html_however_its_backticks_pair():
    """`_text` paired backticks one by one, where CommonMark pairs runs of equal length: "`<img>``"
    opened no code span there, and the `<img>` went out raw (718 of a helper's short strings did); a
    left-out run's path in backticks was closed by a backtick of its own. Checked against a CommonMark
    renderer over every string of up to five pieces."""
    import itertools

    markdown_it = pytest.importorskip("markdown_it")
    from selfevo.report.render import _code, _text

    md = markdown_it.MarkdownIt("commonmark")
    pieces = ["`", "``", "<i>", "a", " ", "\\"]
    for n in range(1, 6):
        for combo in itertools.product(pieces, repeat=n):
            s = "".join(combo)
            for line in (_text(s), f"x {_code(s)} y", _text(f"run {_code(s)}: {s}")):
                assert "<i>" not in md.render(line), (s, line)
    assert md.render(_code("a`b")) == "<p><code>a`b</code></p>\n"


def test_markdown_lines_of_the_run_files_text_open_no_html():
    """Only table cells were escaped: the context line (a world path), the readings and the left-out
    runs' reasons went into the Markdown raw."""
    from selfevo.report.render import markdown

    res = {"treatments": ["coupled"], "seeds": [0], "context": "World `/w/<script>`.", "software": {},
           "readings": ["a <b>reading</b>\nsplit"], "benchmarks": [], "base": {}, "downstream": {"coupled": {}},
           "audit": {}, "compute": {},
           "excluded": [{"run": "/r", "treatment": "msv", "seed": 1, "why": "failed: <oops>"}]}
    page = markdown(res, {})
    assert "- a &lt;b>reading&lt;/b> split" in page and "failed: &lt;oops>" in page
    assert "World `/w/<script>`." in page  # a code span shows `<` as written, and `&lt;` as that
    assert "<" not in page.replace("&lt;", "").replace("`/w/<script>`", "")
    res["readings"] = ["odd ` <b>"]  # an unmatched backtick opens no code span
    assert "- odd ` &lt;b>" in markdown(res, {})


def test_an_audit_of_fewer_rounds_than_its_run_is_refused(local_grid, tmp_path):
    """An audit made while a run was stopped (`selfevo audit` audits its completed rounds), then the
    run resumed with --no-audit: the report cut coupled's table at that seed's rounds (rounds 2-3 of
    every seed silently gone, and with them the coupled reading) and paired that seed's round 1 as
    its "last round" with the other treatments' round 3."""
    root = _copy_grid(local_grid, tmp_path)
    run = root / "coupled-s1"
    manifest = (run / "manifest.json").read_text()
    (run / "manifest.json").write_text(json.dumps({**json.loads(manifest), "status": "running",
                                                   "rounds_completed": 1}))
    rc = CliRunner().invoke(app, ["audit", str(run), "--no-figures"])
    assert rc.exit_code == 0 and "rounds audited: 1 of 3" in " ".join(rc.output.split()), rc.output
    (run / "manifest.json").write_text(manifest)  # resumed to the end without an audit
    with pytest.raises(ValueError, match=r"coupled-s1/audit/metrics.json: audits round\(s\) 1 of a run that "
                                         r"completed 3; audit it again \(`selfevo audit .*coupled-s1`\)"):
        build_report(root)
    assert CliRunner().invoke(app, ["audit", str(run), "--no-figures"]).exit_code == 0
    assert [r["round"] for r in build_report(root)["audit"]["coupled"]["rounds"]] == [1, 2, 3]


def test_readings_claim_no_change_of_a_the_printed_decimals_do_not_show():
    """"A goes 0.449 -> 0.449 ...: rising agreement is partly co-cheating", and "agreement looks worse
    (A 0.500 vs coupled 0.500) while truth is better (T_P 0.700 vs 0.700 ...)": the change of A (and
    T_P) was tested unrounded, as F's rise was before it was fixed."""
    from selfevo.report.collect import readings

    first = {"A": [0.4491, 0.4492, 0.4490], "T_P": [0.75] * 3, "F": [0.03, 0.02, 0.03]}
    last = {"A": [0.4493, 0.4494, 0.4492], "T_P": [0.74] * 3, "F": [0.11, 0.10, 0.12]}
    said = readings({"audit": {"coupled": _audit(first, last)}, "downstream": {}})[0]
    assert "A goes 0.449 -> 0.449" in said and "co-cheating" not in said
    assert said.endswith("though agreement itself did not rise.")

    coupled = _audit({"A": [0.3] * 3, "T_P": [0.7] * 3, "F": [0.03] * 3},
                     {"A": [0.5001, 0.5002, 0.5003], "T_P": [0.70] * 3, "F": [0.10] * 3})
    level = _audit({"A": [0.3] * 3, "T_P": [0.7] * 3, "F": [0.03] * 3},
                   {"A": [0.5000, 0.5001, 0.5002], "T_P": [0.7001, 0.7002, 0.7003], "F": [0.05] * 3})
    assert not any("looks worse" in line for line in readings({"audit": {"coupled": coupled, "crossfit": level},
                                                               "downstream": {}}))
    worse = _audit({"A": [0.3] * 3, "T_P": [0.7] * 3, "F": [0.03] * 3},
                   {"A": [0.40, 0.41, 0.40], "T_P": [0.80, 0.81, 0.80], "F": [0.05] * 3})
    said = [line for line in readings({"audit": {"coupled": coupled, "crossfit": worse}, "downstream": {}})
            if "looks worse" in line]
    assert len(said) == 1 and "(A 0.403 vs coupled 0.500)" in said[0]


def test_runs_without_an_audit_get_no_empty_audit_figure(local_grid, tmp_path):
    """A grid made with --no-audit had two empty figures captioned as A, T_P, F... by step and by
    round; and the rounds figure's caption did not say its bars are the std over seeds."""
    import shutil

    root = _copy_grid(local_grid, tmp_path)
    build_report(root)
    assert "A, T_P and F by round per treatment (mean ± std over seeds" in (root / "report.md").read_text()
    for run in root.glob("*-s*"):
        shutil.rmtree(run / "audit")
    build_report(root)
    md = (root / "report.md").read_text()
    assert "by scheduled step" not in md and "by round per treatment" not in md
    assert sorted(p.name for p in (root / "figures").iterdir()) == ["figure-1.png"]  # the cost figure
    assert "coupled: seed(s) 0, 1 not audited" in md


def test_the_compute_table_says_its_counts_leave_the_evaluations_out(local_grid, tmp_path):
    """Its generations and seconds are the training's (compare's): compute.json's totals, which count
    the downstream evaluations too, differ from them, and the table did not say so."""
    root = _copy_grid(local_grid, tmp_path)
    res = build_report(root)
    total = json.loads((root / "coupled-s0" / "compute.json").read_text())["total_generations"]
    assert res["compute"]["coupled"]["generations"]["mean"] < total
    assert ("## Compute of the training (the downstream evaluations, the same in every arm, left out) and overhead "
            "against coupled") in (root / "report.md").read_text()


def test_one_seed_draws_no_error_bar_of_zero(monkeypatch):
    """One seed has no std and no interval (None): the rounds and cost figures drew bars of length 0
    with caps, which read as seeds that agree / a certain gain."""
    from selfevo.report import figures

    monkeypatch.setattr(figures, "png", lambda fig: fig)
    rnd = {"round": 1, **{m: {"mean": 0.5, "std": None, "n": 1} for m in ("A", "T_P", "F")}}
    for ax in figures.rounds_figure({"coupled": {"rounds": [rnd]}}).axes:
        (bar,) = ax.containers
        assert all(len(seg) == 0 for seg in bar.lines[2][0].get_segments())
    gain = {"mean": 0.02, "lo": None, "hi": None, "n": 1}
    ax = figures.cost_figure({"coupled": {}, "msv": {"gain_vs_coupled": {"macro": gain}}},
                             {"msv": {"extra_seconds": {"mean": 0.2, "std": None}}}).axes[0]
    (bar,) = ax.containers
    assert all(len(seg) == 0 for coll in bar.lines[2] for seg in coll.get_segments())


def test_a_report_whose_treatments_share_no_seed_with_coupled_draws_no_empty_cost_figure(local_grid, tmp_path):
    """No gain and no overhead to plot: the report showed blank axes captioned as the cost plot, an empty
    Δ cell and unexplained dashes in the compute table (a review of the report)."""
    import shutil

    from selfevo._fmt import DASH

    root = tmp_path / "apart"
    for name in ("coupled-s0", "crossfit-s1"):
        shutil.copytree(local_grid[0] / name, root / name)
    build_report(root)
    md = (root / "report.md").read_text()
    assert "Downstream gain vs compute" not in md and "Audit by round" in md
    assert f"overhead against coupled ({DASH}: no coupled run of the same seed)" in md
    crossfit_row = next(line for line in md.splitlines() if line.startswith("| crossfit |") and "[" in line)
    assert crossfit_row.rstrip(" |").endswith(DASH)


def test_compare_says_why_a_run_has_no_overhead(local_grid):
    """A run with no coupled run of its seed, config and rounds done among those given has dashes for
    its overheads; they were printed with no word of why."""
    root, _, _ = local_grid
    res = CliRunner().invoke(app, ["compare", str(root / "coupled-s1"), str(root / "crossfit-s0"),
                                   str(root / "crossfit-s1")], terminal_width=200)
    assert res.exit_code == 0, res.output
    note = " ".join(res.output.split()).split("+gen, +upd, +time –: ")
    assert len(note) == 2 and str(root / "crossfit-s0") in note[1] and "crossfit-s1" not in note[1]


def test_compare_says_which_runs_are_not_complete(local_grid, tmp_path):
    """`compare` took a run killed part way as any other, with no sign that its numbers are of the rounds
    it did (`report` refuses it; a helper's review)."""
    import shutil

    root, _, _ = local_grid
    killed = tmp_path / "crossfit-killed"
    shutil.copytree(root / "crossfit-s0", killed)
    manifest = json.loads((killed / "manifest.json").read_text())
    (killed / "manifest.json").write_text(json.dumps({**manifest, "status": "running"}))
    res = CliRunner().invoke(app, ["compare", str(root / "coupled-s0"), str(root / "crossfit-s0"), str(killed)],
                             terminal_width=200)
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    rounds = manifest["rounds_completed"]
    assert f"not complete, so counted over the rounds done: {killed} ({rounds} of {rounds} rounds)" in said
    assert str(root / "crossfit-s0") + " (" not in said


def test_compare_refuses_what_is_not_a_run_or_has_no_compute_yet(local_grid, tmp_path):
    """`compare` names the directory that is not a run, and a run killed before its first round ended
    (no compute.json), rather than a traceback or a row of zeros."""
    import shutil

    root, _, _ = local_grid
    res = CliRunner().invoke(app, ["compare", str(root / "coupled-s0"), str(tmp_path)], terminal_width=250)
    assert res.exit_code == 2 and f"{tmp_path}: not a run directory (no run manifest.json)" in res.output
    early = tmp_path / "crossfit-early"
    shutil.copytree(root / "crossfit-s0", early)
    (early / "compute.json").unlink()
    res = CliRunner().invoke(app, ["compare", str(root / "coupled-s0"), str(early)], terminal_width=250)
    assert res.exit_code == 2 and f"{early}: no compute.json (the run has not finished a round)" in res.output


def test_compare_leaves_out_an_audit_older_than_the_run(local_grid, tmp_path):
    """An audit of rounds 1..k of a run that went on to round k+1 (audited, then resumed with
    --no-audit) put round k's F beside round k+1's Cover-EM; the report refuses such a run."""
    import shutil

    from selfevo.report.compare import compare

    root, _, _ = local_grid
    stale = tmp_path / "crossfit-stale"
    shutil.copytree(root / "crossfit-s0", stale)
    metrics = json.loads((stale / "audit" / "metrics.json").read_text())
    done = len(metrics["rounds"])
    (stale / "audit" / "metrics.json").write_text(json.dumps({**metrics, "rounds": metrics["rounds"][:-1]}))
    fresh, old = compare([root / "crossfit-s0", stale])
    assert fresh["F"] == metrics["rounds"][-1]["F"] and fresh["stale_audit"] is None
    assert old["F"] is old["T_P"] is old["A"] is None and old["cover_em"] == fresh["cover_em"]
    assert old["stale_audit"] == f"rounds 1-{done - 1} of {done}"
    res = CliRunner().invoke(app, ["compare", str(stale)], terminal_width=200)
    assert res.exit_code == 0 and "run `selfevo audit` on it again" in " ".join(res.output.split()), res.output


def test_compare_names_audits_made_differently(local_grid, tmp_path):
    """`compare` put F, T_P and A of an every-item audit beside those of a `--max-items-per-step 2` one with no
    word (`report` refuses such runs; a helper's review)."""
    import shutil

    root, _, _ = local_grid
    part = tmp_path / "crossfit-part"
    shutil.copytree(root / "crossfit-s0", part)
    judge = json.loads((part / "audit" / "judge.json").read_text())
    (part / "audit" / "judge.json").write_text(json.dumps({**judge, "max_items_per_step": 2}))
    alike = CliRunner().invoke(app, ["compare", str(root / "coupled-s0"), str(root / "crossfit-s0")],
                               terminal_width=250)
    assert alike.exit_code == 0 and "F, T_P, A by oracle" in alike.output and "warning" not in alike.output
    res = CliRunner().invoke(app, ["compare", str(root / "coupled-s0"), str(part)], terminal_width=250)
    said = " ".join(res.output.split())
    assert res.exit_code == 0 and "F, T_P, A come from audits made differently" in said, res.output
    assert "oracle, the first 2 items a step" in said
    # each row says which run it is (two runs of one treatment and seed looked alike), and a run with no
    # audit (--no-audit) is said to have none rather than left with blank F, T_P, A
    shutil.rmtree(part / "audit")
    res = CliRunner().invoke(app, ["compare", str(root / "coupled-s0"), str(part)], terminal_width=250)
    said = " ".join(res.output.split())
    assert res.exit_code == 0 and "coupled-s0" in said and "crossfit-part" in said
    assert f"F, T_P, A left blank: no audit of {part}" in said


def test_engine_runs_of_other_engine_settings_are_not_paired_nor_pooled(local_grid, tmp_path):
    """An engine-run's [engine] table lives in engine/engine.json, not config.json: a coupled run of 2 solver
    generations was the base of a CrossFit run of 8 (+133% generations, a helper's review), and `report`
    pooled them."""
    import shutil

    from selfevo.report.collect import collect_runs
    from selfevo.report.compare import compare

    root, _, _ = local_grid
    runs = {}
    for name, generations in (("coupled-s0", 2), ("crossfit-s0", 8)):
        runs[name] = tmp_path / name
        shutil.copytree(root / name, runs[name])
        (runs[name] / "engine").mkdir()
        (runs[name] / "engine" / "engine.json").write_text(json.dumps(
            {"engine": "trl", "solver_generations": generations, "grader_port": 8100 + generations}))
    rows = {Path(r["run"]).name: r for r in compare(list(runs.values()))}
    assert rows["crossfit-s0"]["extra_generations"] is None
    with pytest.raises(ValueError, match="were made with different configs"):
        collect_runs(list(runs.values()))
    def engine_json(run, **spec):
        (runs[run] / "engine" / "engine.json").write_text(json.dumps({"engine": "trl", "solver_generations": 2,
                                                                      "retriever_url": "", **spec}))

    def paired():
        return {Path(r["run"]).name: r for r in compare(list(runs.values()))}["crossfit-s0"]["extra_generations"]

    engine_json("coupled-s0", verl={"trainer.experiment_name": "coupled", "actor_rollout_ref.rollout.n": 5})
    # where it ran and where it logs: not what it computed
    engine_json("crossfit-s0", grader_port=9000, verl={"trainer.experiment_name": "crossfit",
                                                       "actor_rollout_ref.rollout.n": 5})
    assert paired() is not None
    engine_json("crossfit-s0", retriever_url="http://127.0.0.1:8000/retrieve",  # a server, not its own index
                verl={"trainer.experiment_name": "coupled", "actor_rollout_ref.rollout.n": 5})
    assert paired() is None


def test_a_ray_worker_gets_the_run_directory_as_an_absolute_path(tmp_path, monkeypatch):
    """`run_grid` (the Python API) passed a relative run directory to Ray workers as given: a worker
    whose working directory is not the driver's (a cluster's) wrote the run elsewhere."""
    ray = pytest.importorskip("ray")
    sent = []

    def remote(fn):
        class Remote:
            def options(self, **resources):
                sent.append(resources)
                return self

            def remote(self, job):
                sent.append(job)
                return job

        return Remote()

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "remote", remote)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns: (refs[:1], refs[1:]))
    monkeypatch.setattr(ray, "get", lambda job: {"job": job.name, "status": "ok", "run": job.out})
    monkeypatch.chdir(tmp_path)
    [res] = run_grid([Job("j", ("seed=0", "world.name=relworld"), "rel/run")], "ray")
    assert sent[0] == {"num_gpus": 0} and sent[1].out == str(tmp_path / "rel" / "run")
    # ... and the paths its overrides name, too (a world directory beside the driver was looked for in the
    # worker's directory: "not a world directory")
    assert sent[1].overrides == ("seed=0", f"world.name={json.dumps(str(tmp_path / 'relworld'))}")
    assert res == {"job": "j", "status": "ok", "run": "rel/run"}  # as the local executor reports it


def test_a_language_model_job_on_ray_asks_for_a_gpu(tmp_path):
    """Every grid task asked Ray for no GPU, and Ray 2.60 hides none from such a task: an lm grid on a
    GPU node packed one job per CPU onto cuda:0 (a helper's review). A sim job asks for none, an lm
    job on cuda or on auto with GPUs in the cluster for one; cuda on a cluster with none is refused
    before any job starts (Ray would wait for a GPU forever)."""
    from selfevo.experiments import _job_gpus

    def job(*overrides):
        return Job("j", overrides, str(tmp_path / "j"))

    assert _job_gpus(job(*SMALL), 4) == 0
    assert _job_gpus(job('backend="lm"', 'lm.device="cuda"'), 4) == 1
    assert _job_gpus(job('backend="lm"'), 4) == 1 and _job_gpus(job('backend="lm"'), 0) == 0  # auto
    assert _job_gpus(job('backend="lm"', 'lm.device="cpu"'), 4) == 0
    assert _job_gpus(job("no.such_field=1"), 4) == 0  # its worker says what is wrong with it
    with pytest.raises(ValueError, match="job j: lm.device cuda needs a GPU; the Ray cluster has none"):
        _job_gpus(job('backend="lm"', 'lm.device="cuda"'), 0)
    # a task sees its one GPU as cuda:0, so cuda:1 would not be there (a review of the session's diff)
    assert _job_gpus(job('backend="lm"', 'lm.device="cuda:0"'), 4) == 1
    with pytest.raises(ValueError, match=r"job j: lm.device cuda:1 on Ray: a task sees only the GPU Ray gives it"):
        _job_gpus(job('backend="lm"', 'lm.device="cuda:1"'), 4)


def test_a_ray_grid_shuts_down_the_ray_it_started_and_cancels_its_tasks_when_stopped(tmp_path, monkeypatch):
    """A Ray the grid started stayed up after it (9 processes, about 780 MB through the demo's replay and
    report), and a grid interrupted in a live session left its tasks writing their runs (a helper's
    review). A Ray that was running before the grid is left running."""
    ray = pytest.importorskip("ray")
    import selfevo.agents.lm.workers as workers

    calls = []

    def remote(fn):
        class Remote:
            def options(self, **resources):
                return self

            def remote(self, job):
                return job.name

        return Remote()

    monkeypatch.setattr(workers, "start_ray", lambda: calls.append("start"))
    monkeypatch.setattr(ray, "remote", remote)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(ray, "cancel", lambda ref, force: calls.append(f"cancel {ref}"))
    monkeypatch.setattr(ray, "get", lambda ref: {"job": ref, "status": "ok"})
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns: (refs[:1], refs[1:]))
    jobs = [Job(n, ("seed=0",), str(tmp_path / n)) for n in ("a", "b")]
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert [r["status"] for r in run_grid(jobs, "ray")] == ["ok", "ok"]
    assert calls == ["start", "shutdown"]
    calls.clear()

    def stopped(refs, num_returns):
        raise KeyboardInterrupt

    monkeypatch.setattr(ray, "wait", stopped)
    with pytest.raises(KeyboardInterrupt):
        run_grid(jobs, "ray")
    assert calls == ["start", "cancel a", "cancel b", "shutdown"]
    calls.clear()
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # someone else's Ray: joined, not shut down
    with pytest.raises(KeyboardInterrupt):
        run_grid(jobs, "ray")
    assert calls == ["cancel a", "cancel b"]
    calls.clear()

    def submitted(job):  # interrupted while submitting b: a, already submitted, is cancelled
        if job.name == "b":
            raise KeyboardInterrupt
        return job.name

    monkeypatch.setattr(ray, "remote", lambda fn: type("Remote", (), {"options": lambda self, **r: self,
                                                                      "remote": lambda self, job: submitted(job)})())
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(KeyboardInterrupt):
        run_grid(jobs, "ray")
    assert calls == ["start", "cancel a", "shutdown"]


def test_a_grid_refuses_one_run_directory_named_by_a_relative_and_an_absolute_path(tmp_path, monkeypatch):
    """(held by no test before a mutation sweep) The run directories are compared resolved: "sub/x", and
    "/abs/sub/x" or "sub/../sub/x", are one directory two jobs would write at once."""
    monkeypatch.chdir(tmp_path)
    a, b = grid(["coupled", "crossfit"], [0], "sub", ONE_ROUND)
    for other in (str(tmp_path / a.out), f"sub/../{a.out}"):
        with pytest.raises(ValueError, match="two jobs share the run directory"):
            run_grid([a, replace(b, out=other)], "local", workers=1)
    assert not any(tmp_path.iterdir())  # refused before any job ran


def test_a_grid_never_runs_more_job_processes_than_workers(tmp_path, monkeypatch):
    """(held by no test before a mutation sweep: jobs that fail at once never overlap) A job process is
    started only while fewer than `workers` are in flight: counted at each start, not sampled at each end."""
    import multiprocessing

    real = multiprocessing.get_context
    in_flight, done = [], []

    class Context:
        def __init__(self, ctx):
            self._ctx = ctx

        def __getattr__(self, name):
            return getattr(self._ctx, name)

        def Process(self, *args, **kwargs):  # noqa: N802 - the context's own name
            in_flight.append(len(in_flight) + 1 - len(done))  # jobs running once this one starts
            return self._ctx.Process(*args, **kwargs)

    monkeypatch.setattr(multiprocessing, "get_context", lambda method=None: Context(real(method)))
    jobs = [Job(name, ("no.such_field=1",), str(tmp_path / name)) for name in "abcde"]  # fail at once
    results = run_grid(jobs, "local", workers=2, on_done=lambda res: done.append(res["job"]))
    assert [r["status"] for r in results] == ["failed"] * 5
    assert len(in_flight) == 5 and max(in_flight) == 2, in_flight


def test_a_job_process_that_dies_is_failed_with_its_exit_code(tmp_path, monkeypatch):
    """(held by no test before a mutation sweep) The error of a job whose process died says how it
    ended and that a rerun resumes it; the other jobs' results stand."""
    import selfevo.experiments

    def run_job(job):  # the forked job processes inherit this
        if job.name == "b":
            os._exit(3)
        return {"job": job.name, "status": "ok", "run": job.out}

    monkeypatch.setattr(selfevo.experiments, "run_job", run_job)
    results = run_grid([Job(name, (), str(tmp_path / name)) for name in "abc"], "local", workers=2)
    assert [r["status"] for r in results] == ["ok", "failed", "ok"]
    assert results[1] == {"job": "b", "status": "failed", "run": str(tmp_path / "b"),
                          "error": "worker process died (RuntimeError: exit code 3); rerun the grid to resume it"}


def test_a_job_process_still_there_after_the_grace_period_is_killed(tmp_path, monkeypatch):
    """(held by no test before a mutation sweep: the slow-to-exit test passed with the process left
    running, its pytest then waiting two minutes at exit) A process slow to exit after its result is
    gone when the grid returns."""
    import multiprocessing
    import threading

    import selfevo.experiments

    def run_job(job):  # the forked job process inherits this: a thread left running after its result
        threading.Thread(target=time.sleep, args=(60,)).start()
        return {"job": job.name, "status": "ok", "run": job.out}

    monkeypatch.setattr(selfevo.experiments, "run_job", run_job)
    got = []
    try:
        selfevo.experiments._job_processes([Job("a", (), str(tmp_path / "a"))], 2, got.append, grace=0.2)
        assert [r["status"] for r in got] == ["ok"]
        assert multiprocessing.active_children() == []
    finally:
        for proc in multiprocessing.active_children():
            proc.kill()
            proc.join()


def test_a_job_process_sent_sigterm_dies_of_it(tmp_path, monkeypatch):
    """(held by no test before a mutation sweep) A job process is forked inside the grid's
    `terminate_raises`, whose handler would raise SystemExit in the middle of the job: it gets SIGTERM's
    default action back, so `kill` of one job ends it as a signal, which its code cannot catch."""
    import selfevo.experiments

    def run_job(job):  # the forked job processes inherit this
        if job.name == "b":
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            except BaseException:  # noqa: BLE001 - what a job's own cleanup might do
                return {"job": job.name, "status": "ok", "run": job.out}
        return {"job": job.name, "status": "ok", "run": job.out}

    monkeypatch.setattr(selfevo.experiments, "run_job", run_job)
    results = run_grid([Job(name, (), str(tmp_path / name)) for name in "abc"], "local", workers=2)
    assert [r["status"] for r in results] == ["ok", "failed", "ok"]
    assert "exit code -15" in results[1]["error"]


def test_a_stopped_grid_kills_its_running_jobs_at_once_not_after_the_grace_period(tmp_path):
    """(held by no test before a mutation sweep: the grace period after the last result killed them
    too, 10 s later) SIGTERM of a grid kills the jobs it is running now; with a grace period longer than
    the test waits, only that kill ends them."""
    # a grace period no stop may wait out
    grid_ = _hanging_grid(tmp_path, "selfevo.experiments._job_processes.__defaults__ = (600.0,)")
    proc, left = _stop_with_workers(grid_, tmp_path / "marks", "SIGTERM")
    assert proc.returncode == 128 + signal.SIGTERM and left == []


def test_an_audit_whose_rounds_are_not_the_runs_rounds_in_order_is_refused(local_grid, tmp_path):
    """(held by no test before a mutation sweep: only the count of rounds was tried) An audit listing as
    many rounds as its run completed, but not rounds 1..N in order (a round twice, one missing), is
    refused too: the report would pair its last entry as the run's last round."""
    root = _copy_grid(local_grid, tmp_path)
    path = root / "coupled-s1" / "audit" / "metrics.json"
    metrics = json.loads(path.read_text())
    metrics["rounds"][1]["round"] = 1
    path.write_text(json.dumps(metrics))
    with pytest.raises(ValueError, match=r"coupled-s1/audit/metrics.json: audits round\(s\) 1, 1, 3 of a run "
                                         r"that completed 3"):
        build_report(root)


def test_find_runs_takes_only_directories_with_a_config_beside_their_manifest(tmp_path):
    """(held by no test before a mutation sweep) A manifest.json alone (not a run directory) is no run
    of the report, which would refuse it as damaged; the runs come sorted, whatever the file system's order."""
    from selfevo.report.collect import find_runs

    for d in ("b/run", "a/run", "a/run/notes", "other"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
        (tmp_path / d / "manifest.json").write_text("{}")
    for d in ("b/run", "a/run"):
        (tmp_path / d / "config.json").write_text("{}")
    assert find_runs(tmp_path) == [tmp_path / "a" / "run", tmp_path / "b" / "run"]


def test_software_changes_names_every_difference_in_name_order():
    was = {"torch": "2.4", "python": "3.11.7", "numpy": "2.4.6", "vllm": "0.6"}
    now = {"python": "3.11.7", "numpy": "2.5.0", "torch": "2.4", "bm25s": "0.3.16"}
    # a package on one side only is "none" on the other, whichever side lost it
    assert software_changes(was, now) == ["bm25s none → 0.3.16", "numpy 2.4.6 → 2.5.0", "vllm 0.6 → none"]
    assert software_changes(now, now) == [] and software_changes({}, {}) == []


def test_software_record_leaves_out_packages_not_installed(monkeypatch):
    """A package not installed is left out (not recorded as "none"): a record made before it was listed and
    one made after read the same."""

    monkeypatch.setattr(sw, "PACKAGES", ("numpy", "selfevo-no-such-package"))
    rec = software()
    assert rec["numpy"] == np.__version__ and "selfevo-no-such-package" not in rec
    assert {"python", "platform", "selfevo", "selfevo_source"} <= set(rec)


def test_software_tally_skips_records_that_are_not_objects_and_orders_the_text():
    made = {"python": "3.11.7", "platform": "Linux x86_64", "numpy": "2.5.0"}
    tally = software_tally([{"software": made}, {"software": {**made, "numpy": "2.4.6"}},
                            {"software": "3.11.7"}, {"software": None}, {"software": made, "software_resumed": []}])
    # a record that is not an object is no record; an empty software_resumed list is no resume
    assert tally == {"versions": {"python": {"3.11.7": 3}, "platform": {"Linux x86_64": 3},
                                  "numpy": {"2.5.0": 2, "2.4.6": 1}}, "unrecorded": 2, "resumed_under_other": 0}
    # shared names in software()'s order (python first), a package's versions in version order
    assert software_text(tally) == ("every run: python 3.11.7, platform Linux x86_64; the runs differ in "
                                    "numpy 2.4.6 (1 run), 2.5.0 (2 runs); 2 runs made before runs recorded it")


def test_the_tables_put_each_statistic_where_its_header_says():
    """Each cell of the downstream, compute and replay tables, from
    a results dict made by hand: an interval as [lo, hi], a signed gain on every treatment but coupled, the
    overheads in their columns with the wall time's std beside it, and one seed's cells without a spread."""

    def stat(mean, lo=None, hi=None, std=None, n=3):
        return {"mean": mean, "lo": lo, "hi": hi, "std": std, "n": n}

    cols = ("nq", "macro", "single_hop", "multi_hop")

    def cost(gen, upd, secs, extra_gen, extra_upd, extra_secs, std, n=3):
        return {"generations": stat(gen), "updates": stat(upd), "seconds": stat(secs),
                "extra_generations": stat(extra_gen), "extra_updates": stat(extra_upd),
                "extra_seconds": stat(extra_secs, std=std, n=n)}

    res = {"benchmarks": ["nq"], "seeds": [0, 1, 2], "audit": {},
           "base": {c: stat(0.1, 0.05, 0.15) for c in cols},
           "downstream": {"coupled": {c: stat(0.3, 0.2, 0.4) for c in cols},
                          "crossfit": {**{c: stat(0.35, 0.25, 0.45) for c in cols},
                                       "gain_vs_coupled": {"macro": stat(0.05, 0.01, 0.09),
                                                           "single_hop": stat(0.04, 0.0, 0.08),
                                                           "multi_hop": stat(0.06, 0.02, 0.1)}},
                          "msv": {**{c: stat(0.3, n=1) for c in cols},
                                  "gain_vs_coupled": {"macro": stat(-0.02, n=1), "single_hop": stat(None, n=0)}}},
           "compute": {"coupled": cost(100, 50, 10, 0.0, 0.0, 0.0, 0.0),
                       "crossfit": cost(150, 60, 14, 0.5, 0.2, 0.4, 0.1),
                       "msv": cost(130, 55, 12, 0.3, 0.1, 0.25, None, n=1)},
           "replay": {"conditions": {"coupled": {"seeds": 1, **{k: {"mean": 0.5, "std": 0.0} for k in
                                                                  ("F", "solver_truth", "replay_accuracy", "A",
                                                                   "coverage")}}}}}
    out = tables(res)
    head, rows = out["Downstream Cover-EM after the last round (mean [95% CI] over seeds)"]
    assert head == ["treatment", "nq", "macro", "single-hop", "multi-hop",
                    "Δ macro vs coupled", "Δ single-hop", "Δ multi-hop"]
    # the gains over coupled for the macro and each hop group; a gain with no value (no seed shared, no
    # benchmark of the group) is a dash
    assert rows == [["base (untrained)", *["0.100 [0.050, 0.150]"] * 4, "", "", ""],
                    ["coupled", *["0.300 [0.200, 0.400]"] * 4, "", "", ""],
                    ["crossfit", *["0.350 [0.250, 0.450]"] * 4, "+0.050 [+0.010, +0.090]", "+0.040 [+0.000, +0.080]",
                     "+0.060 [+0.020, +0.100]"],
                    ["msv", *[f"0.300 [{DASH}]"] * 4, f"-0.020 [{DASH}]", DASH, DASH]]
    (title,) = [t for t in out if t.startswith("Compute")]
    assert DASH not in title  # every run has its coupled run: no dash to explain
    head, rows = out[title]
    assert head[4:] == ["extra generations", "extra updates", "extra wall time (± std over seeds)"]
    assert rows == [["coupled", "100", "50", "10.00", "+0%", "+0%", "+0% ± 0%"],
                    ["crossfit", "150", "60", "14.00", "+50%", "+20%", "+40% ± 10%"],
                    ["msv", "130", "55", "12.00", "+30%", "+10%", "+25%"]]
    _, rows = out["Fixed replay bank (mean ± std over seeds)"]
    assert rows == [["coupled", *[f"0.500 ± {DASH}"] * 5]]  # one seed: no spread, as its "seeds" says


def test_the_html_page_escapes_every_text_the_run_files_give_it():
    """Only a benchmark name's escaping was checked: treatment
    names, the context line, readings, a left-out run's path, treatment and reason, the judge in a table's
    title and a figure's caption go into the page as text, never as markup; the Markdown puts the run's path
    in a code span."""

    bad = "<i>x</i>"
    res = {"treatments": [f"coupled{bad}"], "seeds": [0], "context": f"world {bad}", "software": {},
           "readings": [f"reading {bad}"], "benchmarks": [], "base": {}, "downstream": {f"coupled{bad}": {}},
           "audit": {}, "compute": {}, "audit_setting": {"judge": f"llm:{bad}"},
           "excluded": [{"run": f"/r/{bad}", "treatment": f"msv{bad}", "seed": 1, "why": f"failed: {bad}"}]}
    page = html_page(res, {f"caption {bad}": b"\x89PNG"})
    assert "<i>" not in page
    e = html.escape(bad)
    for text in (f"Treatments: coupled{e}", f"world {e}</p>", f"<li>reading {e}</li>", f"(msv{e} seed 1)",
                 f"<code>/r/{e}</code>", f"failed: {e}</li>", f"judge llm:{e})</h2>", f"<td>coupled{e}</td>",
                 f"alt='caption {e}'", f"<figcaption>caption {e}</figcaption>"):
        assert text in page, text
    md = markdown(res, {})
    assert f"- `/r/{bad}` (msv&lt;i>x&lt;/i> seed 1): failed: &lt;i>x&lt;/i>" in md
    res["readings"] = []  # none: said so, not an empty section
    assert "## Readings\n\n- (none)\n" in markdown(res, {}) and "<li>(none)</li>" in html_page(res, {})


def test_a_report_writes_no_nan_and_no_replay_figure_of_a_study_it_does_not_report(local_grid, tmp_path, monkeypatch):
    """A NaN that slips into the results is refused before any file is written (strict JSON); a replay.png
    with no study beside it, or a study the caller leaves out, is no figure of this report; a bank source
    that is not a path is named, not a traceback."""
    root = _copy_grid(local_grid, tmp_path)
    for name in ("results.json", "report.html", "report.md"):  # a report an earlier test built in the grid
        (root / name).unlink(missing_ok=True)
    real = build.collect_runs

    def with_nan(runs):
        res = real(runs)
        res["downstream"]["crossfit"]["macro"]["mean"] = float("nan")
        return res

    monkeypatch.setattr(build, "collect_runs", with_nan)
    with pytest.raises(ValueError, match="results.json: not written, a result is not a finite number"):
        build_report(root)
    assert not (root / "results.json").exists() and not (root / "report.html").exists()
    monkeypatch.setattr(build, "collect_runs", real)
    (root / "replay").mkdir()
    (root / "replay" / "replay.png").write_bytes(b"\x89PNG\r\n\x1a\n")  # bytes only: it is embedded as read
    build_report(root)
    assert "Fixed replay bank" not in (root / "report.md").read_text()
    study = {"bank": {"sources": [3]},
             "conditions": {"coupled": {m: {"mean": 0.1, "std": 0.01} for m in ("F", "solver_truth",
                                                                                  "replay_accuracy", "A", "coverage")}}}
    (root / "replay" / "results.json").write_text(json.dumps(study))
    build_report(root, replay=False)
    assert "Fixed replay bank" not in (root / "report.md").read_text()
    with pytest.raises(RunError, match="field bank.sources should be a list of run directories"):
        build_report(root)


def test_a_treatment_reading_needs_lower_a_and_higher_t_p_as_printed_and_pairs_only_valued_seeds():
    """"Agreement looks worse, truth is better" needs both: A equal
    to coupled's (as printed) with higher T_P is no "looks worse", nor lower A with T_P equal; and a seed whose
    last round the judge resolved nothing of is left out of the seeds the reading names."""

    first = {"A": [0.3] * 3, "T_P": [0.7] * 3, "F": [0.03] * 3}
    coupled = _audit(first, {"A": [0.5] * 3, "T_P": [0.7] * 3, "F": [0.1] * 3})

    def says(last: dict) -> list[str]:
        lines = readings({"audit": {"coupled": coupled, "crossfit": _audit(first, last)}, "downstream": {}})
        return [line for line in lines if "looks worse" in line]

    assert says({"A": [0.5] * 3, "T_P": [0.8, 0.81, 0.8], "F": [0.05] * 3}) == []  # A not lower
    assert says({"A": [0.4, 0.41, 0.4], "T_P": [0.7] * 3, "F": [0.05] * 3}) == []  # T_P not higher
    (said,) = says({"A": [0.4, 0.41, 0.4], "T_P": [0.8, 0.81, 0.8], "F": [0.05] * 3})  # both: said
    assert "seeds 0, 1, 2;" in said
    (said,) = says({"A": [0.4, 0.41, None], "T_P": [0.8, 0.81, None], "F": [0.05, 0.05, None]})
    assert "seeds 0, 1;" in said and "(A 0.405 vs coupled 0.500)" in said


def test_compare_gives_no_ratio_against_a_coupled_count_of_zero(local_grid, tmp_path):
    """An overhead against a coupled run that counted none of a
    thing (no updates recorded) is undefined: None, the dash the tables show, not a ZeroDivisionError."""

    root = _copy_grid(local_grid, tmp_path)
    path = root / "coupled-s0" / "compute.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "total_updates": 0}))
    coupled, crossfit = compare([root / "coupled-s0", root / "crossfit-s0"])
    assert coupled["extra_updates"] is crossfit["extra_updates"] is None
    assert crossfit["extra_generations"] is not None and crossfit["extra_seconds"] is not None


def test_compare_rows_carry_each_metric_of_the_last_audited_round(local_grid):
    """A row's F, T_P and A are the last round's, each its own, and
    its Cover-EM the evaluation after the last round."""

    root, _, _ = local_grid
    last = json.loads((root / "crossfit-s1" / "audit" / "metrics.json").read_text())["rounds"][-1]
    (row,) = compare([root / "crossfit-s1"])
    assert (row["F"], row["T_P"], row["A"]) == (last["F"], last["T_P"], last["A"])
    assert len({last["F"], last["T_P"], last["A"]}) == 3  # three different numbers: a swap would show
    cover = [json.loads((root / "crossfit-s1" / "eval" / f"round-{r}.json").read_text())["macro"]["cover_em"]
             for r in (0, 3)]
    assert row["cover_em"] == cover[1] != cover[0]  # after the last round, not the untrained model's


def test_an_audit_is_described_by_its_judge_prompt_and_items():
    """Two runs' F, T_P and A compare only where these match."""

    assert describe_audit("llm:m", "v2", 2) == "llm:m (prompt v2), the first 2 items a step"
    assert describe_audit(None, None, None) == "unknown judge"


def test_steps_figure_draws_each_metric_by_round_at_the_proposer_steps_only(monkeypatch):
    """The report's per-run figure: one segment per round and metric at the proposer steps (a solver
    step between them is no point of the grader's), each round shaded and named over its steps."""
    from matplotlib.colors import to_hex


    monkeypatch.setattr(figures, "png", lambda fig: fig)

    def step(r, s, kind="proposer"):
        return {"round": r, "step": s, "kind": kind, "A": 0.1 * s, "T_P": 0.2, "T_S": 0.3, "F": 0.05, "L": 0.01}

    steps = [step(1, 0), step(1, 1), step(1, 2, "solver"), step(2, 3), step(2, 4), step(2, 5, "solver")]
    ax = figures.steps_figure(steps, "coupled, seed 0").axes[0]
    assert ax.get_title() == "coupled, seed 0" and ax.get_xlabel().startswith("scheduled step (proposer steps")
    assert tuple(ax.get_ylim()) == (0, 1)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(CURVES)  # once each, not once a round
    by_metric = {m: [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines
                     if to_hex(line.get_color()) == COLORS[m]] for m in CURVES}
    assert by_metric["A"] == [([0, 1], pytest.approx([0.0, 0.1])), ([3, 4], pytest.approx([0.3, 0.4]))]
    assert by_metric["T_P"] == [([0, 1], [0.2, 0.2]), ([3, 4], [0.2, 0.2])]
    assert by_metric["L"] == [([0, 1], [0.01, 0.01]), ([3, 4], [0.01, 0.01])]
    names = {t.get_text(): t.get_position()[0] for t in ax.texts}
    assert names == {"round 1": 0.5, "round 2": 3.5}
    spans = sorted((p.get_x(), p.get_x() + p.get_width(), p.get_alpha()) for p in ax.patches)
    assert spans == [(-0.5, 1.5, 0.07), (2.5, 4.5, 0.0)]  # every other round shaded


def test_rounds_figure_draws_a_panel_per_metric_with_each_treatments_mean_and_std(monkeypatch):

    monkeypatch.setattr(figures, "png", lambda fig: fig)

    def rnd(r, a):
        return {"round": r, "A": {"mean": a, "std": 0.1}, "T_P": {"mean": 0.7, "std": 0.05},
                "F": {"mean": 0.2, "std": 0.02}}

    audit = {"coupled": {"rounds": [rnd(1, 0.5), rnd(2, 0.6)]}, "msv": {"rounds": [rnd(1, 0.4), rnd(2, 0.3)]}}
    fig = figures.rounds_figure(audit)
    assert [ax.get_title() for ax in fig.axes] == ["A", "T_P", "F"]
    assert [ax.get_xlabel() for ax in fig.axes] == ["round"] * 3
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["coupled", "msv"]
    coupled, msv = ax.containers
    assert list(coupled.lines[0].get_xdata()) == [1, 2] and list(coupled.lines[0].get_ydata()) == [0.5, 0.6]
    assert list(msv.lines[0].get_ydata()) == [0.4, 0.3]
    bars = sorted(tuple(round(y, 6) for _, y in seg) for seg in coupled.lines[2][0].get_segments())
    assert bars == [(0.4, 0.6), (0.5, 0.7)]  # mean ± std
    assert list(fig.axes[2].containers[0].lines[0].get_ydata()) == [0.2, 0.2]


def test_cost_figure_puts_each_treatment_at_its_overhead_in_percent_with_both_bars(monkeypatch):
    """x is the extra wall time in percent (as its axis says), its bar ± the std in percent too; y the
    gain with its own interval (lo and hi, not symmetric); each point named; a line marks no gain."""

    monkeypatch.setattr(figures, "png", lambda fig: fig)
    downstream = {"coupled": {}, "msv": {"gain_vs_coupled": {"macro": {"mean": 0.02, "lo": -0.01, "hi": 0.06}}},
                  "crossfit": {"gain_vs_coupled": {"macro": {"mean": None, "lo": None, "hi": None}}},
                  "half-budget": {"gain_vs_coupled": {"macro": {"mean": 0.01, "lo": 0.0, "hi": 0.02}}}}
    compute = {"msv": {"extra_seconds": {"mean": 0.25, "std": 0.05}, "extra_generations": {"mean": 0.33, "std": 0},
                       "extra_updates": {"mean": 0.0, "std": 0}},
               "crossfit": {"extra_seconds": {"mean": 0.1, "std": None}},
               "half-budget": {"extra_seconds": {"mean": None, "std": None}, "extra_generations": {"mean": 0.15},
                               "extra_updates": {"mean": 0.39}}}
    fig = figures.cost_figure(downstream, compute)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "extra wall time over coupled (%)"
    assert ax.get_ylabel() == "macro Cover-EM gain over coupled" and fig._suptitle.get_text() == "cost-effectiveness"
    # the counts' panels: each treatment at its extra generations / updates, no spread drawn (a schedule's
    # counts do not vary), the same gain and interval
    for panel, label, points in ((fig.axes[1], "generations", {"msv": 33.0, "half-budget": 15.0}),
                                 (fig.axes[2], "updates", {"msv": 0.0, "half-budget": 39.0})):
        assert panel.get_xlabel() == f"extra {label} over coupled (%)"
        assert {t.get_text(): t.xy[0] for t in panel.texts} == pytest.approx(points)
        for c in panel.containers:
            assert c.has_xerr is False and c.has_yerr is True
    (bar,) = ax.containers  # crossfit has no gain, half-budget no overhead: no point
    point, _, (xbar, ybar) = bar.lines
    assert list(point.get_xdata()) == [25.0] and list(point.get_ydata()) == [0.02]
    assert sorted(x for seg in xbar.get_segments() for x, _ in seg) == pytest.approx([20.0, 30.0])
    assert sorted(y for seg in ybar.get_segments() for _, y in seg) == pytest.approx([-0.01, 0.06])
    assert [(t.get_text(), tuple(t.xy)) for t in ax.texts] == [("msv", (25.0, 0.02))]
    others = [line for line in ax.lines if line is not point and line not in bar.lines[1]]
    assert [list(line.get_ydata()) for line in others] == [[0, 0]]  # the zero line


def test_a_zero_is_a_number_and_a_cell_keeps_its_spec_and_the_seed_count_given():

    assert (num(0.0), num(0, "+.0%"), num(0.0, "+.3f")) == ("0.000", "+0%", "+0.000")  # never the dash
    assert (shown(0.4996), shown(0.4994), shown(-0.0004)) == (0.5, 0.499, -0.0)
    assert mean_std_text({"mean": 0.25, "std": 0.015}, "+.1%") == "+25.0% ± +1.5%"
    assert mean_std_text({"mean": 0.5, "std": 0.01, "n": 1}, n=3) == "0.500 ± 0.010"  # the count given wins
    assert mean_std_text({"mean": 0.5, "std": 0.01, "n": 3}, n=1) == f"0.500 ± {DASH}"
    assert mean_std_text({"mean": 0.5, "std": None, "n": 2}) == f"0.500 ± {DASH}"  # no std: no spread to show
    assert DASH == "\u2013"  # an en dash, not a hyphen that reads as a minus sign


def _compare_rows(output: str) -> dict[str, list[str]]:
    """The rows of `compare`'s table by their run cell (rich draws the cells between │)."""
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) >= 13 and cells[0] not in ("run", ""):
            rows[cells[0]] = cells[1:]
    return rows


def test_compare_prints_each_number_in_its_column(local_grid):
    """Every cell of the table is the row's own number under its own header: seed, generations,
    updates, seconds (2 decimals), the three overheads as percentages, F, T_P, A and Cover-EM."""
    root, _, _ = local_grid
    runs = [root / "coupled-s1", root / "crossfit-s1"]
    res = CliRunner().invoke(app, ["compare", *map(str, runs)], terminal_width=250)
    assert res.exit_code == 0, res.output
    printed = _compare_rows(res.output)
    assert set(printed) == {"coupled-s1", "crossfit-s1"}
    for row in compare(runs):
        assert row["generations"] != row["updates"] and len({row["F"], row["T_P"], row["A"]}) == 3
        assert row["extra_generations"] != row["extra_updates"] or row["treatment"] == "coupled"
        assert printed[Path(row["run"]).name] == [
            row["treatment"], str(row["seed"]), str(row["generations"]), str(row["updates"]), f"{row['seconds']:.2f}",
            *[num(row[k], "+.0%") for k in ("extra_generations", "extra_updates", "extra_seconds")],
            *[num(row[k]) for k in ("F", "T_P", "A", "cover_em")]]


def test_compare_names_a_run_given_as_dot_and_runs_of_one_name_by_their_paths(local_grid, tmp_path, monkeypatch):
    """`compare .` names the directory it is run in, not an empty cell; two runs of one directory name
    are told apart by their paths."""
    import shutil

    root, _, _ = local_grid
    monkeypatch.chdir(root / "crossfit-s0")
    res = CliRunner().invoke(app, ["compare", "."], terminal_width=250)
    assert res.exit_code == 0, res.output
    assert list(_compare_rows(res.output)) == ["crossfit-s0"]
    other = tmp_path / "elsewhere" / "crossfit-s0"
    shutil.copytree(root / "crossfit-s0", other)
    res = CliRunner().invoke(app, ["compare", str(root / "crossfit-s0"), str(other)], terminal_width=400)
    assert res.exit_code == 0, res.output
    assert list(_compare_rows(res.output)) == [str(root / "crossfit-s0"), str(other)]


def test_compare_does_not_count_a_stale_audit_as_no_audit_nor_as_one_made_differently(local_grid, tmp_path):
    """A run audited before it went on is warned of as such: its F, T_P, A are blank, so its audit is
    neither a run "with no audit" nor one "made differently" from the others' (its numbers are not shown)."""
    import shutil

    root, _, _ = local_grid
    stale = tmp_path / "crossfit-stale"
    shutil.copytree(root / "crossfit-s0", stale)
    metrics = json.loads((stale / "audit" / "metrics.json").read_text())
    (stale / "audit" / "metrics.json").write_text(json.dumps({**metrics, "rounds": metrics["rounds"][:-1]}))
    judge = json.loads((stale / "audit" / "judge.json").read_text())
    (stale / "audit" / "judge.json").write_text(json.dumps({**judge, "max_items_per_step": 2}))
    res = CliRunner().invoke(app, ["compare", str(root / "coupled-s0"), str(stale)], terminal_width=250)
    said = " ".join(res.output.split())
    assert res.exit_code == 0 and "run `selfevo audit` on it again" in said, res.output
    assert "no audit of" not in said and "made differently" not in said and "F, T_P, A by oracle" in said


def test_report_cli_names_the_page_it_wrote(local_grid):
    """The last line says where the report is (the one line a user follows from the terminal)."""
    root, _, _ = local_grid
    res = CliRunner().invoke(app, ["report", str(root)], terminal_width=400)
    assert res.exit_code == 0, res.output
    assert f"report: {root / 'report.html'}" in "".join(res.output.split("\n"))
