"""`selfevo demo` end to end on a small world (one seed, a scaled-down schedule, a few replay
conditions), and the plan's validation."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from selfevo.cli import app
from selfevo.config import ConfigError
from selfevo.demo import DemoPlan, load_plan

SMALL_DEMO = """
[demo]
treatments = ["coupled", "crossfit"]
seeds = 1
world = "small"
replay_size = 200
replay_conditions = ["coupled", "source-id"]

[loop]
admit_per_round = 240
proposer_steps = 6
solver_steps = 5
"""


def test_plan_defaults_match_the_shipped_config():
    assert load_plan() == DemoPlan(run=load_plan().run)
    assert load_plan().seeds == 3 and "crossfit" in load_plan().treatments


def test_an_installed_package_without_configs_plans_the_same_demo(monkeypatch):
    """A non-editable install has no configs/ directory: `selfevo demo` then plans from the defaults,
    which must be configs/demo.toml's plan, run configs included."""
    from selfevo import demo
    from selfevo.config import load_config

    shipped = load_plan()
    monkeypatch.setattr(demo, "DEFAULT_CONFIG", Path("/nonexistent/configs/demo.toml"))
    installed = load_plan()
    assert dataclasses.replace(installed, run=shipped.run) == shipped
    assert load_config(overrides=installed.overrides()) == load_config(overrides=shipped.overrides())
    assert load_plan(seeds=2).seeds == 2  # the command's flags apply as before


def test_plan_validation(tmp_path):
    with pytest.raises(ConfigError, match="demo.executor"):
        DemoPlan(executor="dask")
    with pytest.raises(ConfigError, match="coupled"):
        DemoPlan(treatments=("crossfit",))
    with pytest.raises(ConfigError, match="treatment"):
        DemoPlan(treatments=("coupled", "nope"))
    bad = tmp_path / "bad.toml"
    bad.write_text('[demo]\nsedes = 3\n')
    with pytest.raises(ConfigError, match="demo.sedes"):
        load_plan(bad)
    bad.write_text('[loop]\nrounds = 0\n')
    with pytest.raises(ConfigError, match="loop.rounds"):
        load_plan(bad)
    assert DemoPlan(run={"loop": {"rounds": 2}}).overrides() == ["loop.rounds=2", 'world.name="default"']


# A Python started with this directory first on its path cannot import torch: the README's first
# command installs no torch, so the main job must not need it (nor its worker processes, which
# inherit PYTHONPATH).
NO_TORCH = """import sys


class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise ModuleNotFoundError("No module named 'torch' (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, _NoTorch())
"""


def _demo_without_torch(tmp_path, *args):
    block = tmp_path / "no_torch"
    block.mkdir(exist_ok=True)
    (block / "sitecustomize.py").write_text(NO_TORCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(block), *sys.path])}
    return subprocess.run([sys.executable, "-m", "selfevo.cli", "demo", *args], env=env, capture_output=True,
                          text=True, timeout=600)


def test_demo_end_to_end_without_torch(tmp_path):
    cfg = tmp_path / "demo.toml"
    cfg.write_text(SMALL_DEMO)
    out = tmp_path / "demo"
    args = ["--config", str(cfg), "--out", str(out), "--workers", "1"]
    result = _demo_without_torch(tmp_path, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    res = json.loads((out / "results.json").read_text())
    assert res["treatments"] == ["coupled", "crossfit"] and res["seeds"] == [0]
    assert set(res["replay"]["conditions"]) == {"coupled", "source-id"}
    assert len(res["audit"]["coupled"]["rounds"]) == 3
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 4  # steps, rounds, replay bars, cost
    report_md = (out / "report.md").read_text()
    assert "Fixed replay bank" in report_md
    # the study's own table: its coverage column and the untrained base model's row, which the figure
    # draws as a line (the report's table left both out)
    assert "| condition | F | solver truth | replay accuracy | A | coverage |" in report_md
    assert "| base model (untrained, reference) |" in report_md
    assert "Downstream" in result.stdout and "report:" in result.stdout
    # a rerun skips the finished runs and rebuilds the same report
    before = (out / "results.json").read_text()
    again = _demo_without_torch(tmp_path, *args)
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads((out / "results.json").read_text())["downstream"] == json.loads(before)["downstream"]
    # ... and the replay study's finished jobs (2 conditions, the base model) from its journal (it ran them again)
    assert "3 finished job(s) of this study, not run again" in " ".join(again.stdout.split())
    assert json.loads((out / "results.json").read_text())["replay"]["conditions"] == \
        json.loads(before)["replay"]["conditions"]
    # a plan changed since (another replay size: another bank): its journal is the demo's own, started over
    # (the study was skipped, "holds the finished jobs of another study", and the demo exited 1)
    cfg.write_text(SMALL_DEMO.replace("replay_size = 200", "replay_size = 150"))
    third = _demo_without_torch(tmp_path, *args)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "the journal of an earlier study (another plan, other runs or another selfevo): started over" in \
        " ".join(third.stdout.split())
    assert json.loads((out / "results.json").read_text())["replay"]["bank"]["items"] == 150


def test_the_torch_blocker_blocks(tmp_path):
    block = tmp_path / "no_torch"
    block.mkdir()
    (block / "sitecustomize.py").write_text(NO_TORCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(block), *sys.path])}
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True)
    assert probe.returncode == 1 and "blocked by the test" in probe.stderr


def test_demo_bad_config_exits_2(tmp_path):
    cfg = tmp_path / "demo.toml"
    cfg.write_text('[demo]\nexecutor = "dask"\n')
    result = CliRunner().invoke(app, ["demo", "--config", str(cfg), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "demo.executor" in " ".join(result.output.split())
    assert not (tmp_path / "o").exists()
    # --workers under Ray was ignored without a word (Ray schedules by its own resources)
    result = CliRunner().invoke(app, ["demo", "--executor", "ray", "--workers", "2", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "--workers counts local processes" in " ".join(result.output.split())
    assert not (tmp_path / "o").exists()


def _quick(**fields) -> DemoPlan:
    run = {"loop": {"admit_per_round": 120, "proposer_steps": 4, "solver_steps": 3, "rounds": 2}}
    return DemoPlan(**{"treatments": ("coupled", "crossfit"), "seeds": 1, "world": "small",
                       "replay_size": 100, "replay_conditions": (), "run": run, **fields})


def test_a_rerun_with_another_plan_reports_that_plan_only(tmp_path):
    from io import StringIO

    from rich.console import Console

    from selfevo.demo import run_demo

    quiet = Console(file=StringIO())
    out = tmp_path / "demo"
    run_demo(_quick(seeds=2, replay_conditions=("coupled",)), out, console=quiet, workers=1)
    res = run_demo(_quick(treatments=("coupled",)), out, console=quiet, workers=1)
    # seed 1, crossfit and the replay study are left from the first plan; this one ran none of them
    assert res["treatments"] == ["coupled"] and res["seeds"] == [0] and "replay" not in res
    assert "Fixed replay bank" not in (out / "report.md").read_text()
    # `selfevo report DIR` on the demo's --out (its help's example) reports the same plan: it took
    # every run below DIR and DIR/replay, and wrote the first plan's report over this one's
    result = CliRunner().invoke(app, ["report", str(out)])
    assert result.exit_code == 0, result.output
    again = json.loads((out / "results.json").read_text())
    assert again["treatments"] == ["coupled"] and again["seeds"] == [0] and "replay" not in again
    assert again["audit"] == json.loads(json.dumps(res["audit"]))
    assert "of the demo recorded in demo.json" in again["context"]
    (out / "demo.json").unlink()  # a plain directory of runs: every run below it, as before
    assert CliRunner().invoke(app, ["report", str(out)]).exit_code == 0
    plain = json.loads((out / "results.json").read_text())
    assert plain["treatments"] == ["coupled", "crossfit"] and plain["seeds"] == [0, 1] and "replay" in plain


def test_a_job_that_failed_before_its_run_directory_is_named_in_the_report(tmp_path):
    from io import StringIO

    from rich.console import Console

    from selfevo.demo import run_demo

    buf = StringIO()
    out = tmp_path / "exp[v2]"  # brackets are rich markup: the error must print them as they are
    (out / "runs").mkdir(parents=True)
    (out / "runs" / "crossfit-s0").write_text("a file where the run directory goes")
    res = run_demo(_quick(), out, console=Console(file=buf, width=400), workers=1)
    assert f"job crossfit-s0 failed: RunError: {out / 'runs' / 'crossfit-s0'}" in buf.getvalue()
    (left,) = res["excluded"]
    assert (left["treatment"], left["seed"]) == ("crossfit", 0) and "failed before it wrote" in left["why"]
    assert "crossfit seed 0" in (out / "report.md").read_text()
    assert res["incomplete"] == ["1 of 2 jobs failed"]  # the CLI exits 1 on it


def test_a_partial_demo_writes_its_report_and_exits_1(tmp_path):
    """A replay study that cannot run (too small a bank) ended the demo with exit 2 and no report,
    after every run had finished (one round is now refused by the plan); a failed job ended it with
    exit 0."""
    from io import StringIO

    from rich.console import Console

    from selfevo.demo import run_demo

    quiet = Console(file=StringIO(), width=400)
    out = tmp_path / "demo"
    res = run_demo(_quick(treatments=("coupled",), replay_conditions=("source-id",), replay_size=60), out,
                   console=quiet, workers=1)
    (why,) = res["incomplete"]
    assert why.startswith("replay study skipped: feedback solver") and "demo.replay_size" in why
    assert "replay" not in res and not (out / "replay" / "bank.json").exists()
    report = (out / "report.md").read_text()
    assert "Replay study skipped: feedback solver" in report and "| coupled |" in report
    one_round = {"loop": {**_quick().run["loop"], "rounds": 1}}
    with pytest.raises(ConfigError, match="^loop.rounds: the replay bank takes round-2"):  # refused before any run
        _quick(treatments=("coupled",), replay_conditions=("coupled",), run=one_round)
    # through the CLI: the report is written, and the exit status says it is not the whole plan
    cfg = tmp_path / "partial.toml"
    cfg.write_text('[demo]\ntreatments = ["coupled"]\nseeds = 1\nworld = "small"\nreplay_conditions = []\n'
                   "[loop]\nadmit_per_round = 120\nproposer_steps = 4\nsolver_steps = 3\nrounds = 1\n")
    (tmp_path / "cli" / "runs").mkdir(parents=True)
    result = CliRunner().invoke(app, ["demo", "--config", str(cfg), "--out", str(tmp_path / "cli"), "--workers", "1"])
    assert result.exit_code == 0 and (tmp_path / "cli" / "report.html").exists(), result.output
    cfg.write_text(cfg.read_text().replace('["coupled"]', '["coupled", "msv"]'))
    (tmp_path / "cli" / "runs" / "msv-s0").write_text("a file where the run directory goes")
    result = CliRunner().invoke(app, ["demo", "--config", str(cfg), "--out", str(tmp_path / "cli"), "--workers", "1"])
    assert result.exit_code == 1 and "1 of 2 jobs failed" in result.output, result.output
    assert "msv seed 0" in (tmp_path / "cli" / "report.md").read_text()


def test_a_replay_worker_killed_fails_the_study_not_the_demo(tmp_path, monkeypatch):
    """A replay worker killed (the OOM killer) broke the pool: BrokenProcessPool escaped the demo,
    with a traceback and no report of the finished runs."""
    import os
    import signal
    from io import StringIO

    from rich.console import Console

    from selfevo import replay
    from selfevo.demo import run_demo

    def grade(*args):  # the forked replay workers inherit this
        os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(replay, "_grade", grade)
    out = tmp_path / "demo"
    res = run_demo(_quick(treatments=("coupled",), replay_conditions=("coupled",)), out,
                   console=Console(file=StringIO(), width=400), workers=2)
    (why,) = res["incomplete"]  # the CLI exits 1 on it
    assert why.startswith("replay study failed: BrokenProcessPool: A process in the process pool was terminated")
    assert "replay" not in res and not (out / "replay" / "results.json").exists()
    report = (out / "report.md").read_text()
    assert "Replay study failed: BrokenProcessPool" in report and "| coupled |" in report

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(out / "report.html"))

    # the report cannot be written either (a full disk): the line naming the study's failure is printed all the same
    monkeypatch.setattr("selfevo.report.build.build_report", full)
    said = StringIO()
    with pytest.raises(OSError, match="No space left"):
        run_demo(_quick(treatments=("coupled",), replay_conditions=("coupled",)), out,
                 console=Console(file=said, width=400), workers=2)
    assert "replay study failed: BrokenProcessPool" in said.getvalue()


def test_the_ray_executor_without_ray_is_one_line(monkeypatch, tmp_path):
    import sys

    from selfevo.experiments import grid, run_grid

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(ValueError, match=r"executor ray: Ray is not installed \(pip install 'selfevo\[ray\]'\)"):
        run_grid(grid(["coupled"], [0], tmp_path, []), "ray")


def test_a_job_refused_for_another_config_is_left_out_not_reported(tmp_path):
    from io import StringIO

    from rich.console import Console

    from selfevo.demo import run_demo

    quiet = Console(file=StringIO(), width=400)
    out = tmp_path / "demo"
    first = run_demo(_quick(), out, console=quiet, workers=1)
    changed = {"loop": {**_quick().run["loop"], "rounds": 1}}
    # every job is refused (its run directory holds the 2-round plan): the old numbers must not be
    # reported as this plan's
    with pytest.raises(ValueError, match="no job of this plan finished"):
        run_demo(_quick(run=changed), out, console=quiet, workers=1)
    assert json.loads((out / "results.json").read_text())["downstream"] == first["downstream"]
    # one job refused: the report is of this plan's other runs, the refused one listed as left out
    (out / "runs" / "crossfit-s0").rename(tmp_path / "moved")
    (tmp_path / "old").mkdir()
    (out / "runs" / "coupled-s0").rename(tmp_path / "old" / "coupled-s0")
    (tmp_path / "moved").rename(out / "runs" / "crossfit-s0")  # a 2-round run where a 1-round one goes
    res = run_demo(_quick(run=changed), out, console=quiet, workers=1)
    assert res["treatments"] == ["coupled"] and len(res["audit"]["coupled"]["rounds"]) == 1
    (left,) = res["excluded"]
    assert (left["treatment"], left["seed"]) == ("crossfit", 0) and "config differs" in left["why"]


def test_the_headline_prints_names_from_run_files_as_text_not_markup():
    """Readings quote run paths (and table cells hold names from run files): rich read `[bold]` in
    one as a style tag and dropped it."""
    import io

    from rich.console import Console

    from selfevo.demo import headline

    res = {"audit": {}, "compute": {}, "downstream": {}, "readings": ["runs under [bold]x[/bold] read"],
           "treatments": ["coupled"], "benchmarks": ["[nq]"], "base": {}, "seeds": [0]}
    captured = io.StringIO()
    headline(res, Console(file=captured, width=200, color_system=None))
    out = captured.getvalue()
    assert "runs under [bold]x[/bold] read" in out


def test_a_demo_stopped_before_its_report_leaves_no_record_of_an_earlier_plan(tmp_path, monkeypatch):
    """(held by no test before a mutation sweep) The earlier demo's demo.json no longer describes --out
    once this plan writes there: stopped before its own record, the demo leaves none, and `selfevo report`
    takes every run below --out instead of the earlier plan's only."""
    from io import StringIO

    from rich.console import Console

    import selfevo.demo
    from selfevo.report.build import DEMO_RECORD

    out = tmp_path / "demo"
    out.mkdir()
    (out / DEMO_RECORD).write_text("{}")

    def run_grid(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the jobs run

    monkeypatch.setattr(selfevo.demo, "run_grid", run_grid)
    with pytest.raises(KeyboardInterrupt):
        selfevo.demo.run_demo(_quick(), out, console=Console(file=StringIO()), workers=1)
    assert not (out / DEMO_RECORD).exists()


def test_the_replay_bank_is_built_from_the_first_seeds_coupled_run(tmp_path, monkeypatch):
    """(held by no test before a mutation sweep: the demos tried have one seed) The bank is one run's
    questions, as the paper's are: the coupled run of the lowest seed, whatever order the jobs finish in."""
    from io import StringIO
    from pathlib import Path

    from rich.console import Console

    import selfevo.demo
    import selfevo.replay

    class Built(BaseException):  # past the demo's handlers: the test ends at the bank
        pass

    def run_grid(jobs, *args, **kwargs):  # every job done, the last seed's first
        for job in jobs:
            Path(job.out).mkdir(parents=True)
            Path(job.out, "manifest.json").write_text('{"status": "complete"}')
        return [{"job": j.name, "status": "ok", "run": j.out} for j in reversed(jobs)]

    def build_bank(sources, *args, **kwargs):
        raise Built(sources)

    monkeypatch.setattr(selfevo.demo, "run_grid", run_grid)
    monkeypatch.setattr(selfevo.replay, "build_bank", build_bank)
    out = tmp_path / "demo"
    with pytest.raises(Built) as built:
        selfevo.demo.run_demo(_quick(seeds=3, replay_conditions=("coupled",)), out, console=Console(file=StringIO()))
    assert built.value.args == ([str(out / "runs" / "coupled-s0")],)


def test_the_headline_shows_the_last_audit_round_and_the_downstream_averages_only(monkeypatch):
    """(held by no test before a mutation sweep) In the terminal, the audit table keeps its last round
    (compared as a number: round 10 after round 2) and the downstream table its name and last four
    columns; the per-benchmark columns live in the report."""
    import io

    from rich.console import Console

    import selfevo.report.render
    from selfevo.demo import headline

    made = {"Downstream Cover-EM": (["treatment", "bench-a", "bench-b", "col-1", "col-2", "col-3", "col-4"],
                                    [["coupled", "0.1", "0.2", "v-1", "v-2", "v-3", "v-4"]]),
            "Audit by round": (["treatment", "round", "F"],
                               [["coupled", "1", "f-one"], ["coupled", "2", "f-two"], ["coupled", "10", "f-ten"]])}
    monkeypatch.setattr(selfevo.report.render, "tables", lambda res: made)
    captured = io.StringIO()
    headline({"readings": []}, Console(file=captured, width=200, color_system=None))
    out = captured.getvalue()
    assert "Audit, last round" in out and "f-ten" in out and "f-one" not in out and "f-two" not in out
    assert "bench-a" not in out and "0.2" not in out
    assert all(f"{x}-{i}" in out for x in ("col", "v") for i in range(1, 5))


def test_a_demo_given_a_relative_out_gives_its_jobs_absolute_run_directories(tmp_path, monkeypatch):
    """(held by no test before a mutation sweep) A Ray worker runs elsewhere (on a cluster, wherever
    `ray start` ran): the jobs, and the runs the report and demo.json name, get --out as an absolute path."""
    from io import StringIO

    from rich.console import Console

    import selfevo.demo

    monkeypatch.chdir(tmp_path)
    seen = []

    def run_grid(jobs, *args, **kwargs):
        seen.extend(jobs)
        raise KeyboardInterrupt  # the jobs are all this test needs

    monkeypatch.setattr(selfevo.demo, "run_grid", run_grid)
    with pytest.raises(KeyboardInterrupt):
        selfevo.demo.run_demo(_quick(), "demo", console=Console(file=StringIO()), workers=1)
    runs = tmp_path.resolve() / "demo" / "runs"
    assert [j.out for j in seen] == [str(runs / "coupled-s0"), str(runs / "crossfit-s0")]
