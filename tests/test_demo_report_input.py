"""Bad input to `selfevo demo` and `selfevo report`: a demo plan is checked whole before anything
runs (errors name the file and the field, exit 2, no traceback); a report writes strict JSON,
refuses two runs of one (treatment, seed) and leaves runs that are not complete out, visibly."""

from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import selfevo.demo
from selfevo._fmt import DASH
from selfevo.cli import app
from selfevo.config import ConfigError
from selfevo.demo import load_plan
from selfevo.report.build import build_report, write_demo_record

TINY = ["--world", "small", "--set", "loop.proposer_steps=2", "--set", "loop.solver_steps=2",
        "--set", "loop.admit_per_round=20"]


def _one_line(output: str) -> str:
    return " ".join(output.split())  # rich wraps long lines


@pytest.fixture
def no_run(monkeypatch):
    """A demo that got past its plan would start the grid: make that an error of the test."""
    def run_demo(*args, **kwargs):
        raise AssertionError("the demo ran on a bad plan")

    monkeypatch.setattr(selfevo.demo, "run_demo", run_demo)


def _demo(tmp_path: Path, *args: str):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["demo", *args, "--out", str(out), "--workers", "1"])
    assert not out.exists()
    return result


def test_a_missing_demo_config_is_an_error(tmp_path, no_run, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = _demo(tmp_path, "--config", "nosuch.toml")
    assert result.exit_code == 2, result.output
    assert _one_line(result.output) == "error: nosuch.toml: cannot read: No such file or directory"


@pytest.mark.parametrize("text, message", [
    ("[demo\n", "Expected ']'"),
    ('[demo]\nseeds = "3"\n', "demo.seeds: expected an integer, got '3'"),
    ("[demo]\nseeds = true\n", "demo.seeds: expected an integer, got True"),
    ('[demo]\ntreatments = "coupled"\n', "demo.treatments: expected a list, got str"),
    ('[demo]\ntreatments = ["coupled", 3]\n', "demo.treatments[1]: expected a string, got 3"),
    ('[demo]\ntreatments = ["coupled", "msv", "coupled"]\n', "demo.treatments: 'coupled' is listed twice"),
    ("[demo]\nreplay_size = -5\n", "demo.replay_size: must be >= 1, got -5"),
    ("[demo]\nseeds = 99999999999999\n", "demo.seeds: must be at most 10,000, got 99,999,999,999,999"),
    ('[demo]\nreplay_size = "big"\n', "demo.replay_size: expected an integer, got 'big'"),
    ('[demo]\nreplay_conditions = ["coupled", "nope"]\n', "demo.replay_conditions: unknown 'nope'"),
    ('[demo]\nreplay_conditions = "coupled"\n', "demo.replay_conditions: expected a list"),
    ('[demo]\nworld = "no-such-world"\n', "demo.world: no-such-world: not a world directory"),
    ('[demo]\nworld = "~nosuchuser0/w"\n', "demo.world: ~nosuchuser0/w: no home directory for ~nosuchuser0 here"),
    ("[demo]\nworld = 3\n", "demo.world: expected small, default or a world directory, got 3"),
    ("[demo]\nexecutor = 1\n", "demo.executor: expected one of local, ray, got 1"),
    ("demo = 3\n", "demo: expected a table, got int"),
    ("seed = 3\n", "seed: set by the demo for every run; use demo.seeds"),
    ('[world]\nname = "small"\n', "world.name: set by the demo for every run; use demo.world"),
    ("[loop]\nrounds = 0\n", "loop.rounds: "),
    ("[loop]\nrounds = 1\n", "loop.rounds: the replay bank takes round-2"),  # not after every run finished
    ("[dmeo]\nseeds = 2\n", "dmeo: unknown field (known: demo, treatment, "),
    ('[demo]\ntreatments = ["coupled", "fooo"]\n', "demo.treatments[1]: unknown 'fooo'"),
    ('[demo]\ntreatments = ["coupled", "msv", "msv+coupled"]\n',
     "demo.treatments: 'msv' and 'msv+coupled' name one treatment"),
])
def test_every_plan_field_is_checked_before_anything_runs(tmp_path, no_run, text, message):
    cfg = tmp_path / "demo.toml"
    cfg.write_text(text)
    result = _demo(tmp_path, "--config", str(cfg))
    assert result.exit_code == 2, result.output  # 1 would be a traceback
    assert _one_line(result.output).startswith(f"error: {cfg}: {message}")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(cfg))}: "):
        load_plan(cfg)


def test_a_directory_or_bad_utf8_as_the_demo_config(tmp_path, no_run):
    result = _demo(tmp_path, "--config", str(tmp_path))
    assert result.exit_code == 2 and _one_line(result.output) == f"error: {tmp_path}: cannot read: Is a directory"
    cfg = tmp_path / "demo.toml"
    cfg.write_bytes(b"[demo]\nworld = \"\xff\"\n")
    result = _demo(tmp_path, "--config", str(cfg))
    assert result.exit_code == 2 and "invalid UTF-8 at byte" in result.output


def test_bad_flags_are_named_as_flags(tmp_path, no_run):
    result = _demo(tmp_path, "--seeds", "0")
    assert result.exit_code == 2 and _one_line(result.output) == "error: --seeds: must be >= 1, got 0"
    result = _demo(tmp_path, "--world", str(tmp_path / "nowhere"))
    assert result.exit_code == 2 and "error: --world: " in _one_line(result.output)
    assert "not a world directory" in _one_line(result.output)
    result = _demo(tmp_path, "--executor", "dask")
    assert result.exit_code == 2 and "error: --executor: expected one of local, ray" in _one_line(result.output)


def test_a_world_directory_is_kept_absolute(tmp_path, monkeypatch):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "world.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert load_plan(world="w").world == str((tmp_path / "w").resolve())
    assert load_plan(world="small").world == "small"
    # and the run tables' paths: every job, on a Ray cluster too, reads the files this directory names
    cfg = tmp_path / "demo.toml"
    cfg.write_text('backend = "lm"\n[data]\ncorpus = "c.jsonl"\nqa_dir = "qa"\n')
    assert {f"data.corpus={json.dumps(str(tmp_path / 'c.jsonl'))}",
            f"data.qa_dir={json.dumps(str(tmp_path / 'qa'))}"} <= set(load_plan(cfg).overrides())


# ---------------------------------------------------------------- report


def _evolve(out: Path, *args: str) -> Path:
    result = CliRunner().invoke(app, ["evolve", "--out", str(out), *TINY, *args])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """coupled and crossfit, one seed, two rounds each; a one-round coupled seed 0 beside them."""
    root = tmp_path_factory.mktemp("runs")
    _evolve(root / "grid" / "coupled-s0", "--set", "loop.rounds=2")
    _evolve(root / "grid" / "crossfit-s0", "--treatment", "crossfit", "--set", "loop.rounds=2")
    _evolve(root / "short" / "coupled-s0", "--set", "loop.rounds=1")
    return root


def _copy_as_seed(run: Path, to: Path, seed: int) -> Path:
    """A copy of a run directory that says it is of another seed (its records are the original's)."""
    shutil.copytree(run, to)
    config = json.loads((to / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**config, "seed": seed}))
    return to


def _strict(text: str):
    def no_constant(name: str):
        raise AssertionError(f"{name} is not JSON")

    return json.loads(text, parse_constant=no_constant)


def test_one_seed_report_is_strict_json(runs, tmp_path):
    root = tmp_path / "r"
    shutil.copytree(runs / "grid", root)
    build_report(root)
    res = _strict((root / "results.json").read_text())
    gain = res["downstream"]["crossfit"]["gain_vs_coupled"]["macro"]
    assert gain["n"] == 1 and gain["lo"] is None and gain["hi"] is None and gain["mean"] is not None
    assert res["base"]["macro"]["lo"] is None
    md = (root / "report.md").read_text()
    assert "nan" not in md.lower() and f"[{DASH}]" in md  # a missing interval is a dash (the tables' one)
    assert f"| {gain['mean']:+.3f} [{DASH}] |" in md


def test_two_runs_of_one_treatment_and_seed_are_refused(runs, tmp_path):
    root = tmp_path / "r"
    shutil.copytree(runs / "grid" / "coupled-s0", root / "a")
    shutil.copytree(runs / "short" / "coupled-s0", root / "b")
    result = CliRunner().invoke(app, ["report", str(root)])
    assert result.exit_code == 2, result.output
    said = _one_line(result.output)
    assert "two runs of coupled seed 0" in said and str(root / "a") in said and str(root / "b") in said
    assert not (root / "results.json").exists()


def _mark_running(run: Path) -> None:
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["status"] = "running"
    (run / "manifest.json").write_text(json.dumps(manifest))


def test_a_run_not_complete_is_left_out_and_listed(runs, tmp_path):
    root = tmp_path / "r"
    shutil.copytree(runs / "grid", root / "grid")
    killed = _copy_as_seed(runs / "short" / "coupled-s0", root / "killed" / "coupled-s1", 1)
    _mark_running(killed)
    result = CliRunner().invoke(app, ["report", str(root)])
    assert result.exit_code == 0, result.output
    assert "left out (failed or not complete):" in _one_line(result.output)
    res = _strict((root / "results.json").read_text())
    assert res["seeds"] == [0]  # the killed seed 1 is in no number
    assert res["downstream"]["coupled"]["macro"]["n"] == 1
    assert res["excluded"] == [{"run": str(killed), "treatment": "coupled", "seed": 1,
                                "why": "status 'running' (still running, or stopped: `selfevo evolve --out RUN "
                                       "--resume` goes on), 1 round(s) done"}]
    for page in ("report.md", "report.html"):
        text = (root / page).read_text()
        assert "Runs left out" in text and str(killed) in text


def test_rows_over_different_seeds_say_so(runs, tmp_path):
    """A treatment with a seed another lacks (its run failed): each row's mean is over its own seeds,
    its Δ over the seeds shared with coupled, and the header's seed list was all the reader saw."""
    root = tmp_path / "r"
    shutil.copytree(runs / "grid", root / "grid")
    extra = _copy_as_seed(runs / "grid" / "coupled-s0", root / "grid" / "coupled-s1", 1)
    result = CliRunner().invoke(app, ["report", str(root)])
    assert result.exit_code == 0, result.output
    res = _strict((root / "results.json").read_text())
    assert res["downstream"]["coupled"]["seeds"] == [0, 1] and res["downstream"]["crossfit"]["seeds"] == [0]
    note = ("Not every treatment has every seed (a run failed or is not complete): coupled 0, 1; crossfit 0. "
            "Each row is over its treatment's seeds, each Δ over the seeds it shares with coupled.")
    assert note in (root / "report.md").read_text()
    assert html.escape(note) in (root / "report.html").read_text()
    shutil.rmtree(extra)
    assert CliRunner().invoke(app, ["report", str(root)]).exit_code == 0
    assert "Not every treatment" not in (root / "report.md").read_text()  # every row over seed 0


def test_no_complete_run_is_an_error(runs, tmp_path):
    root = tmp_path / "r"
    shutil.copytree(runs / "short" / "coupled-s0", root / "coupled-s0")
    _mark_running(root / "coupled-s0")
    result = CliRunner().invoke(app, ["report", str(root)])
    assert result.exit_code == 2 and "no complete run among the 1 found" in _one_line(result.output)


def test_a_damaged_run_file_is_named(runs, tmp_path):
    root = tmp_path / "r"
    shutil.copytree(runs / "grid" / "coupled-s0", root / "coupled-s0")
    (root / "coupled-s0" / "config.json").write_text("{not json")
    result = CliRunner().invoke(app, ["report", str(root)])
    assert result.exit_code == 2
    assert f"error: {root / 'coupled-s0' / 'config.json'}: unreadable, not valid JSON" in _one_line(result.output)


def test_runs_of_another_config_are_neither_pooled_nor_paired(runs, tmp_path):
    from selfevo.report.collect import collect_runs

    # a one-round coupled seed 1 pooled with the two-round coupled seed 0: "after the last round"
    # averaged a round-1 and a round-2 evaluation, and the audit table silently showed one round
    root = tmp_path / "pooled"
    shutil.copytree(runs / "grid", root / "grid")
    short = _copy_as_seed(runs / "short" / "coupled-s0", root / "other" / "coupled-s1", 1)
    with pytest.raises(ValueError, match="different configs.*loop.rounds"):
        collect_runs([root / "grid" / "coupled-s0", root / "grid" / "crossfit-s0", short])
    # crossfit (two rounds) paired with a coupled run of one round: Δ against another setting
    paired = tmp_path / "paired"
    shutil.copytree(runs / "grid" / "crossfit-s0", paired / "crossfit-s0")
    shutil.copytree(runs / "short" / "coupled-s0", paired / "coupled-s0")
    result = CliRunner().invoke(app, ["report", str(paired)])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "different configs" in said and "loop.rounds" in said
    assert str(paired / "coupled-s0") in said and str(paired / "crossfit-s0") in said
    assert not (paired / "results.json").exists()
    assert collect_runs([runs / "grid" / "coupled-s0", runs / "grid" / "crossfit-s0"])["treatments"] == \
        ["coupled", "crossfit"]  # one config: reported as before


@pytest.mark.parametrize("entry, message", [
    ({"run": "x"}, "excluded[0].treatment should be a string, got None"),
    ({"run": "x", "treatment": "coupled", "seed": "1", "why": "no"}, "excluded[0].seed should be an integer, got '1'"),
    ({"run": "x", "treatment": "coupled", "seed": True, "why": ""}, "excluded[0].seed should be an integer, got True"),
])
def test_a_damaged_demo_record_entry_is_named(runs, tmp_path, entry, message):
    """demo.json's excluded entries were checked as objects only: one without `treatment` was a
    KeyError traceback from the Markdown renderer, after results.json had been written."""
    from selfevo.report.build import write_demo_record

    root = tmp_path / "r"
    shutil.copytree(runs / "grid", root)
    write_demo_record(root, [root / "coupled-s0"], False, [entry], "")
    result = CliRunner().invoke(app, ["report", str(root)])
    assert result.exit_code == 2, result.output
    assert _one_line(result.output) == f"error: {root / 'demo.json'}: field {message}"
    assert not (root / "results.json").exists()


def test_a_failed_job_finished_since_says_how_to_take_it_in(runs, tmp_path):
    """A demo job that failed is left out of its report; finished by hand since (`evolve --resume`), the
    report went on saying "the job failed" of a complete run. It still follows the demo's plan, and says
    that the same demo again takes the run in."""
    from selfevo.report.build import build_report, write_demo_record

    root = tmp_path / "r"
    shutil.copytree(runs / "grid", root)
    others = sorted(p.parent for p in root.glob("*/manifest.json") if p.parent.name != "coupled-s0")
    entry = {"run": str(others[0]), "treatment": "x", "seed": 0, "why": "the job failed: MemoryError"}
    write_demo_record(root, [root / "coupled-s0"], False, [entry], "")
    (why,) = [x["why"] for x in build_report(root)["excluded"]]
    assert why == ("the job failed: MemoryError; its run directory holds a complete run now: the same "
                   "`selfevo demo` again reports it")


def test_an_empty_demo_world_is_refused_even_beside_a_world_json(tmp_path, monkeypatch):
    """(held by no test before a mutation sweep) An empty world is no path: run from a world directory,
    "" named the current directory's world.json (and a run directory from elsewhere, another world)."""
    (tmp_path / "world.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^demo.world: expected small, default or a world directory, got ''$"):
        selfevo.demo.DemoPlan(world="")
    with pytest.raises(ConfigError, match=r"^--world: expected small, default or a world directory, got ''$"):
        load_plan(world="")


def test_run_tables_that_fit_coupled_but_not_another_treatment_are_refused_before_anything_runs(tmp_path, no_run):
    """(held by no test before a mutation sweep) The run tables are checked with every treatment of the
    plan, not only coupled's: a crossfit with more folds than source documents failed each of its jobs."""
    cfg = tmp_path / "demo.toml"
    cfg.write_text('[demo]\ntreatments = ["coupled", "crossfit"]\n[loop]\nsource_docs = 1\n')
    result = _demo(tmp_path, "--config", str(cfg))
    assert result.exit_code == 2, result.output
    assert _one_line(result.output).startswith(f"error: {cfg}: treatment: 'crossfit' asks for 2 source folds")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(cfg))}: treatment: 'crossfit' asks for 2 source"):
        load_plan(cfg)


def test_a_run_table_given_as_a_value_is_named_not_a_traceback(tmp_path, no_run):
    """`world = 3` at the top of a demo config (meant for
    demo.world) is named as the table it is not; the check of what the demo sets itself must not look inside it
    as one (a TypeError, exit 1)."""
    cfg = tmp_path / "demo.toml"
    cfg.write_text("world = 3\n")
    result = _demo(tmp_path, "--config", str(cfg))
    assert result.exit_code == 2, result.output  # 1 would be a traceback
    assert _one_line(result.output) == f"error: {cfg}: world: expected a table, got int"


def test_a_demo_report_says_whether_it_holds_the_demos_replay_study_and_keeps_its_context(runs, tmp_path):
    """The report's opening line says what demo.json names: the
    replay study only where the demo made one, then the demo's own context, then the caller's."""

    root = tmp_path / "r"
    shutil.copytree(runs / "grid", root)
    write_demo_record(root, [root / "coupled-s0"], False, [], "made by the test's demo")
    assert build_report(root, context="and by hand")["context"] == (
        "The runs of the demo recorded in demo.json; other runs below this directory are not reported. "
        "made by the test's demo and by hand")
    write_demo_record(root, [root / "coupled-s0"], True, [], "")
    assert build_report(root)["context"].startswith("The runs and replay study of the demo recorded in demo.json;")


def test_a_demo_world_under_home_is_found_where_it_points(tmp_path, monkeypatch):
    """`demo.world = "~/w"` is the world in the home directory, stored absolute for the jobs: its world.json
    was looked for in a directory named "~" under the working directory, and the world refused."""
    (tmp_path / "home" / "w").mkdir(parents=True)
    (tmp_path / "home" / "w" / "world.json").write_text("{}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert selfevo.demo.DemoPlan(world="~/w").world == str(tmp_path / "home" / "w")
