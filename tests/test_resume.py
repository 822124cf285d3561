"""Resume (torchtune-style): a run killed anywhere and resumed gives the numbers of a run that was
never interrupted, byte for byte."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import selfevo
from selfevo._software import SoftwareChanged, software, source_digest
from selfevo.cli import app
from selfevo.config import load_config
from selfevo.evolve import evolve
from selfevo.loop.engine import Loop
from selfevo.runs import RunDir, RunError

SCALED = ["world.name=small", "loop.admit_per_round=100", "loop.proposer_steps=6", "loop.solver_steps=5"]
CLI_SCALED = [x for s in SCALED for x in ("--set", s)]
COMPARED = ("records/steps.jsonl", "audit/metrics.json", "eval/round-1.json", "eval/round-2.json",
            "eval/round-3.json")


def cfg_for(seed=0, extra=()):
    return load_config(None, [*SCALED, f"seed={seed}", *extra])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("resume") / "reference"
    evolve(cfg_for(), path, progress=False)
    return RunDir(path)


def assert_same_results(run: RunDir, reference: RunDir, files=COMPARED):
    for f in files:
        assert (run.path / f).read_bytes() == (reference.path / f).read_bytes(), f
    assert run.manifest()["status"] == "complete" and run.manifest()["rounds_completed"] == 3


def crash_at(monkeypatch, method: str, round_: int, step_in_round: int):
    """Make Loop.<method> raise the first time it runs the given step."""
    original = getattr(Loop, method)
    fired = []

    def wrapper(self, st, *args, **kwargs):
        if st.round == round_ and st.step_in_round == step_in_round and not fired:
            fired.append(st.step)
            raise RuntimeError(f"simulated crash at round {st.round} step {st.step_in_round}")
        return original(self, st, *args, **kwargs)

    monkeypatch.setattr(Loop, method, wrapper)
    return fired


def crashed_run(tmp_path, monkeypatch, cfg, method: str, round_: int, step_in_round: int) -> RunDir:
    """`cfg` run into tmp_path/run and killed (a simulated crash) at the given step; every monkeypatch of
    the test undone after it, so the run is ready to resume."""
    crash_at(monkeypatch, method, round_, step_in_round)
    with pytest.raises(RuntimeError, match="simulated crash"):
        evolve(cfg, tmp_path / "run", progress=False)
    monkeypatch.undo()
    return RunDir(tmp_path / "run")


# ------------------------------------------------------------------ in-process crash + resume


def test_crash_in_round_2_then_resume_matches_an_uninterrupted_run(tmp_path, monkeypatch, reference):
    cfg = cfg_for()
    fired = crash_at(monkeypatch, "solver_step", 2, cfg.loop.proposer_steps + 3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        evolve(cfg, tmp_path / "run", progress=False)
    assert fired
    run = RunDir(tmp_path / "run")
    m = run.manifest()
    assert m["status"] == "running" and m["rounds_completed"] == 1
    rounds_logged = [r["round"] for r in run.steps()]
    assert rounds_logged.count(2) == cfg.loop.proposer_steps + 2  # round 2 was half done
    assert not run.eval_path(2).exists()

    monkeypatch.undo()
    evolve(cfg, run.path, resume=True, progress=False)
    assert_same_results(run, reference)


def test_crash_in_round_1_then_resume(tmp_path, monkeypatch, reference):
    cfg = cfg_for()
    crash_at(monkeypatch, "proposer_step", 1, 4)
    with pytest.raises(RuntimeError):
        evolve(cfg, tmp_path / "run", progress=False)
    run = RunDir(tmp_path / "run")
    assert run.manifest()["rounds_completed"] == 0 and len(run.steps()) == 3
    monkeypatch.undo()
    evolve(cfg, run.path, resume=True, progress=False)
    assert_same_results(run, reference, (*COMPARED, "eval/round-0.json"))
    # the base model's evaluation, made before the kill and not redone, is still counted
    counts = [{k: v for k, v in r.compute().items() if k != "seconds"} for r in (run, reference)]
    assert counts[0] == counts[1] and counts[0]["generations"]["evaluation"] > 0


def test_torn_last_line_is_repaired_on_resume(tmp_path, monkeypatch, reference):
    cfg = cfg_for()
    # crash right at the start of round 2, so the log holds exactly round 1 ...
    crash_at(monkeypatch, "proposer_step", 2, 1)
    with pytest.raises(RuntimeError):
        evolve(cfg, tmp_path / "run", progress=False)
    run = RunDir(tmp_path / "run")
    n_round_1 = len(run.steps())
    assert n_round_1 == cfg.loop.proposer_steps + cfg.loop.solver_steps
    # ... plus half a line, as a kill in the middle of a write leaves it
    with open(run.steps_path, "ab") as fh:
        fh.write(b'{"schema": 1, "round": 2, "step": 12, "step_in_round": 1, "kind": "prop')
    assert len(run.steps()) == n_round_1  # readers skip the torn tail
    monkeypatch.undo()
    evolve(cfg, run.path, resume=True, progress=False)
    assert_same_results(run, reference)
    assert b"kind\": \"prop{" not in run.steps_path.read_bytes()


def test_resuming_a_complete_run_is_a_no_op(tmp_path):
    cfg = cfg_for()
    evolve(cfg, tmp_path / "run", progress=False)
    run = RunDir(tmp_path / "run")
    files = [*COMPARED, "eval/round-0.json", "compute.json", "checkpoints/round-3.json"]
    before = {f: (run.path / f).read_bytes() for f in files}
    evolve(cfg, run.path, resume=True, progress=False)
    assert {f: (run.path / f).read_bytes() for f in files} == before
    assert run.manifest()["status"] == "complete"


def killed_in_round_2(tmp_path, monkeypatch):
    """A run of `cfg_for()` stopped in round 2 (round 1 checkpointed), in tmp_path/run."""
    cfg = cfg_for()
    crash_at(monkeypatch, "solver_step", 2, cfg.loop.proposer_steps + 3)
    with pytest.raises(RuntimeError):
        evolve(cfg, tmp_path / "run", progress=False)
    monkeypatch.undo()
    return cfg, RunDir(tmp_path / "run")


def test_a_resume_under_other_software_is_warned_and_recorded(tmp_path, monkeypatch, reference):
    made = reference.manifest()["software"]  # what the run was made with
    assert made == software() and made["numpy"] == np.__version__ and "bm25s" in made and "python" in made
    cfg, run = killed_in_round_2(tmp_path, monkeypatch)
    other = {**software(), "numpy": "0.0.1"}
    monkeypatch.setattr("selfevo.runs.software", lambda: other)
    result = CliRunner().invoke(app, ["evolve", "--out", str(run.path), *CLI_SCALED, "--resume"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"warning: {run.path}: resumed under other software than it was made with (numpy {np.__version__} → " \
           "0.0.1)" in text
    m = run.manifest()
    assert m["software"] == made and len(m["software_resumed"]) == 1
    assert m["software_resumed"][0]["software"] == other and m["software_resumed"][0]["rounds_completed"] == 1
    assert_same_results(run, reference)  # numpy did not really change
    # resumed again under the software it was made with: no warning, nothing recorded
    monkeypatch.undo()
    result = CliRunner().invoke(app, ["evolve", "--out", str(run.path), *CLI_SCALED, "--resume"])
    assert result.exit_code == 0 and "warning" not in result.output
    assert len(run.manifest()["software_resumed"]) == 1
    # a finished loop resumed (it audits again, nothing of the loop runs) has not resumed under that
    # software: no warning, nothing recorded (the report said "resumed under other software")
    monkeypatch.setattr("selfevo.runs.software", lambda: {**software(), "torch": "9.9"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", SoftwareChanged)
        evolve(cfg, run.path, resume=True, progress=False)
    assert len(run.manifest()["software_resumed"]) == 1


def test_a_resume_refused_by_its_checkpoint_records_no_software(tmp_path, monkeypatch):
    """The software was checked (and a change noted in the manifest) before the round's checkpoint was
    read: a resume refused for a damaged checkpoint was recorded as resumed under other software."""
    cfg, run = killed_in_round_2(tmp_path, monkeypatch)
    run.checkpoint_path(1).write_text('{"proposer": 1}')
    monkeypatch.setattr("selfevo.runs.software", lambda: {**software(), "numpy": "0.0.1"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", SoftwareChanged)
        with pytest.raises(RunError, match="field 'proposer' should be an object"):
            evolve(cfg, run.path, resume=True, progress=False)
    assert "software_resumed" not in run.manifest()


def test_the_software_record_moves_with_selfevos_own_code(tmp_path):
    """selfevo's version has not moved while its code has: a run resumed under other code was not
    warned. The record now holds a digest of the package's source files (each file's path with its bytes)."""
    pkg = tmp_path / "selfevo"
    shutil.copytree(Path(selfevo.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))

    def digest_of_copy() -> str:
        spec = importlib.util.spec_from_file_location("_software_copy", pkg / "_software.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.source_digest()

    assert software()["selfevo_source"] == source_digest() == digest_of_copy()  # the same files anywhere
    (pkg / "algos.py").write_text((pkg / "algos.py").read_text() + "\n# an edit\n")
    edited = digest_of_copy()
    assert edited != source_digest()
    (pkg / "algos.py").rename(pkg / "algos2.py")  # the same bytes under another name: other code
    assert digest_of_copy() != edited


def test_a_resume_removes_tensor_files_no_checkpoint_references(tmp_path):
    """A kill after a step checkpoint replaced the one before it, before the files only the old one
    referenced were removed, left those files (a policy each: gigabytes at 4B) for good: nothing
    looked at them again."""
    run = RunDir(tmp_path / "run")
    run.tensors_dir.mkdir(parents=True)
    (run.path / "checkpoints" / "round-1.json").write_text(json.dumps({"main": {"file": "a", "sha256": "0"}}))
    run.step_checkpoint_path.write_text(json.dumps({"main": {"file": "b", "sha256": "0"}}))
    for name in "abc":
        (run.tensors_dir / name).write_text(name)
    run._drop_unreferenced_tensors()
    assert sorted(p.name for p in run.tensors_dir.iterdir()) == ["a", "b"]


def test_resume_of_a_missing_run_starts_it(tmp_path, reference):
    evolve(cfg_for(), tmp_path / "run", resume=True, progress=False)
    assert_same_results(RunDir(tmp_path / "run"), reference)


def test_resume_with_no_config_option_takes_the_runs_own(tmp_path, monkeypatch, reference):
    """`selfevo evolve --resume --out RUN` alone: the defaults differed from a scaled run in every
    field it set, and were refused; the run's config.json is its config."""
    cfg = cfg_for()
    run = crashed_run(tmp_path, monkeypatch, cfg, "solver_step", 2, cfg.loop.proposer_steps + 3)
    result = CliRunner().invoke(app, ["evolve", "--out", str(run.path), "--resume"])
    assert result.exit_code == 0, result.output
    assert "the run's own config" in " ".join(result.output.split())
    assert_same_results(run, reference)
    # an option given is compared, as before: one that differs is refused
    result = CliRunner().invoke(app, ["evolve", "--out", str(run.path), "--resume", "--seed", "9"])
    assert result.exit_code == 2 and "seed" in " ".join(result.output.split())
    # every field the run's command set is named with it: the message says how to resume (a helper's review)
    assert "resume with no config options (the run's own config is used)" in " ".join(result.output.split())


def test_resume_with_a_different_config_exits_2_naming_the_field(reference, tmp_path):
    before = (reference.path / "records" / "steps.jsonl").read_bytes()
    result = CliRunner().invoke(app, ["evolve", "--out", str(reference.path), *CLI_SCALED,
                                      "--set", "loop.solver_steps=7", "--resume"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    # only the field that differs (saved lists against in-memory tuples once named solver and proposer too)
    assert "config differs" in text and "fields: loop.solver_steps)" in text, text
    result = CliRunner().invoke(app, ["evolve", "--out", str(reference.path), *CLI_SCALED, "--seed", "9",
                                      "--resume"])
    assert result.exit_code == 2 and "seed" in " ".join(result.output.split())
    # nothing of the saved run was touched
    assert (reference.path / "records" / "steps.jsonl").read_bytes() == before


# ------------------------------------------------------------------ a real kill -9


def _cli(out, *extra):
    return [sys.executable, "-m", "selfevo.cli", "evolve", "--out", str(out), "--world", "default",
            "--seed", "2", *extra]


@pytest.mark.slow
def test_sigkill_during_round_2_then_resume(tmp_path):
    env = {**os.environ, "COLUMNS": "200"}
    # the uninterrupted run, alongside the one we kill
    ref = subprocess.Popen(_cli(tmp_path / "ref"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    out = tmp_path / "killed"
    steps = out / "records" / "steps.jsonl"
    child = subprocess.Popen(_cli(out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    seen, offset, deadline = False, 0, time.monotonic() + 120
    try:
        while time.monotonic() < deadline and child.poll() is None:
            if steps.exists():
                with open(steps, "rb") as fh:
                    fh.seek(max(0, offset - 32))
                    chunk = fh.read()
                offset += len(chunk) - min(offset, 32)
                if b'"round": 2' in chunk:
                    seen = True
                    break
            time.sleep(0.005)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
    if not seen or child.returncode != -signal.SIGKILL:
        pytest.fail(f"the child was not killed during round 2 (saw round 2: {seen}, "
                    f"exit code {child.returncode}); the test proved nothing")
    killed = RunDir(out)
    assert killed.manifest()["status"] == "running"
    assert killed.manifest()["rounds_completed"] == 1

    resumed = subprocess.run(_cli(out, "--resume"), capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert ref.wait(timeout=300) == 0, ref.stderr.read()[-2000:]
    for f in ("audit/metrics.json", "eval/round-3.json", "records/steps.jsonl"):
        assert (out / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f
    metrics = json.loads((out / "audit" / "metrics.json").read_text())
    assert [r["round"] for r in metrics["rounds"]] == [1, 2, 3]


def test_a_run_still_being_written_is_not_resumed_beside_its_writer(tmp_path):
    """`--resume` (or a grid rerun) while another process still writes the run: refused, naming
    the run, instead of both processes appending the same steps to one log."""

    out, go = tmp_path / "run", tmp_path / "go"
    args = ["evolve", "--out", str(out), "--rounds", "2", "--world", "small"]  # the full small schedule: seconds
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    # the writer holds on after its first solver step until the test says go: it is still writing when
    # the resume is tried (it finished in about a second of its log appearing, sometimes before the try)
    script = (f"import os, time\nfrom selfevo.loop.engine import Loop\nreal = Loop.solver_step\n"
              f"def held(*a, **k):\n    out = real(*a, **k)\n"
              f"    while not os.path.exists({str(go)!r}): time.sleep(0.02)\n    return out\n"
              f"Loop.solver_step = held\nfrom selfevo.cli import app\napp()")
    writer = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": src})
    deadline = time.monotonic() + 120
    while not (out / "records" / "steps.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        assert writer.poll() is None, "the writer ended before the resume was tried"
        with pytest.raises(RunError, match="another process is writing this run"):
            evolve(load_config(None, ["world.name=small", "loop.rounds=2"]), out, resume=True, progress=False)
    finally:
        go.touch()
        assert writer.wait(timeout=300) == 0
    keys = [(r["round"], r["step"]) for r in RunDir(out).steps()]
    assert keys == sorted(set(keys)) and len(keys) == 2 * (18 + 25)


def test_a_run_with_no_finished_round_says_how_to_start_afresh_with_another_config(tmp_path, reference):
    """A first start that failed in its round-0 evaluation (say out of memory) leaves a run with no
    finished round; retried with a smaller batch, both a plain rerun and --resume refused it, and
    neither said that removing the directory loses nothing finished."""
    partial = tmp_path / "run"
    shutil.copytree(reference.path, partial)
    m = json.loads((partial / "manifest.json").read_text())
    (partial / "manifest.json").write_text(json.dumps({**m, "status": "running", "rounds_completed": 0}))
    result = CliRunner().invoke(app, ["evolve", "--out", str(partial), *CLI_SCALED,
                                      "--set", "loop.solver_steps=7", "--resume"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "config differs" in text, result.output
    assert "no round of it finished" in text and "start afresh" in text
    # a run with a finished round gets no such advice: removing it would lose that round
    result = CliRunner().invoke(app, ["evolve", "--out", str(reference.path), *CLI_SCALED,
                                      "--set", "loop.solver_steps=7", "--resume"])
    assert result.exit_code == 2 and "afresh" not in " ".join(result.output.split())


def test_a_refused_resume_under_other_software_warns_and_notes_nothing(tmp_path, monkeypatch, reference):
    """The software check ran before the steps log and the world were checked: a resume refused for
    them had already warned "resumed under other software" and noted it in the manifest, once for
    every refused attempt (a report would count the run as resumed under other software)."""
    import warnings

    run = RunDir(tmp_path / "run")
    shutil.copytree(reference.path, run.path)
    steps = run.path / "records" / "steps.jsonl"
    lines = steps.read_text().splitlines(keepends=True)
    steps.write_text("{not json\n" + "".join(lines[1:]))  # damage before the last line: refused
    monkeypatch.setattr("selfevo.runs.software", lambda: {**software(), "numpy": "0.0.1"})
    for _ in range(2):
        with warnings.catch_warnings(record=True) as seen, pytest.raises(RunError, match="corrupt"):
            warnings.simplefilter("always")
            evolve(cfg_for(), run.path, resume=True, progress=False)
        assert not [w for w in seen if issubclass(w.category, SoftwareChanged)]
    assert "software_resumed" not in run.manifest()


# ------------------------------------------------------------------ step checkpoints (within a round)


def _calls(monkeypatch, method: str) -> list:
    """Count the steps Loop.<method> runs (round, step_in_round)."""
    original, seen = getattr(Loop, method), []

    def counted(self, st, *args, **kwargs):
        seen.append((st.round, st.step_in_round))
        return original(self, st, *args, **kwargs)

    monkeypatch.setattr(Loop, method, counted)
    return seen


@pytest.mark.parametrize("every", [1, 4])
def test_a_resume_goes_on_from_the_last_step_checkpoint(tmp_path, monkeypatch, reference, every):
    """With step checkpoints a run killed inside a round goes on from the last one, not the round's
    start, and writes what a run never killed (and never step-checkpointed) writes."""
    cfg = cfg_for()
    crash_at(monkeypatch, "solver_step", 2, cfg.loop.proposer_steps + 3)  # round 2's 9th step
    with pytest.raises(RuntimeError, match="simulated crash"):
        evolve(cfg, tmp_path / "run", progress=False, step_checkpoints=every)
    run = RunDir(tmp_path / "run")
    state = json.loads(run.step_checkpoint_path.read_text())
    # the 8th step's, whether every step or every 4th (the 4th's and the 8th's) is checkpointed
    assert (state["round"], state["step"]) == (2, 11 + 8)
    assert len(state["pool"]) == 100  # round 2's admissions, all made by its proposer steps
    monkeypatch.undo()
    proposer, solver = _calls(monkeypatch, "proposer_step"), _calls(monkeypatch, "solver_step")
    evolve(cfg, run.path, resume=True, progress=False, step_checkpoints=every)
    assert proposer == [(3, i) for i in range(1, 7)]  # round 2's proposer steps are not redone
    assert solver == [(2, 9), (2, 10), (2, 11)] + [(3, i) for i in range(7, 12)]
    assert_same_results(run, reference)
    assert not run.step_checkpoint_path.exists()  # the round's own checkpoint replaced it
    counts = [{k: v for k, v in r.compute().items() if k != "seconds"} for r in (run, reference)]
    assert counts[0] == counts[1]


@pytest.fixture(scope="module")
def crossfit_reference(tmp_path_factory):
    return evolve(cfg_for(extra=["treatment=msv+crossfit"]), tmp_path_factory.mktemp("resume") / "ref",
                  progress=False)


def _aux_updates(monkeypatch, crash_in: tuple[int, str] | None = None) -> list:
    """Record (round, aux solver) of every auxiliary update; with `crash_in` = (round, name), raise
    at that solver's second update of that round."""
    from selfevo.agents.sim import SimSolver
    from selfevo.loop.feedback import AuxFeedback

    current, seen = {}, []
    end_round, update = AuxFeedback.end_round, SimSolver.update

    def in_round(self, round, *args, **kwargs):
        current["round"] = round
        return end_round(self, round, *args, **kwargs)

    def counted(self, groups):
        if self.name.startswith("aux-"):
            seen.append((current["round"], self.name))
            if seen[-1] == crash_in and seen.count(crash_in) == 2:
                raise RuntimeError(f"simulated crash in {self.name}'s training")
        return update(self, groups)

    monkeypatch.setattr(AuxFeedback, "end_round", in_round)
    monkeypatch.setattr(SimSolver, "update", counted)
    return seen


def test_a_kill_in_the_aux_solvers_training_goes_on_from_the_last_one_trained(tmp_path, monkeypatch,
                                                                               crossfit_reference):
    """Each auxiliary solver's training (25 updates a round at the paper's schedule: hours at 4B) is
    followed by a step checkpoint: a kill in the second redoes the second only, not the first."""
    cfg = cfg_for(extra=["treatment=msv+crossfit"])
    _aux_updates(monkeypatch, crash_in=(2, "aux-1"))
    with pytest.raises(RuntimeError, match="simulated crash in aux-1"):
        evolve(cfg, tmp_path / "run", progress=False, step_checkpoints=1)
    run = RunDir(tmp_path / "run")
    state = json.loads(run.step_checkpoint_path.read_text())
    assert (state["round"], state["step"], state["aux_trained"]) == (2, 22, 1) and len(state["feedback"]["aux"]) == 2
    monkeypatch.undo()
    aux, solver = _aux_updates(monkeypatch), _calls(monkeypatch, "solver_step")
    evolve(cfg, run.path, resume=True, progress=False, step_checkpoints=0)  # (at another cadence)
    assert {r for r, _ in solver} == {3}  # round 2's steps are not redone, nor its aux-0
    assert set(aux) == {(2, "aux-1")}  # (after the last round, round 3, none is trained)
    assert_same_results(run, crossfit_reference)
    for r in (2, 3):  # every model, the aux solvers' lineage and the counts (not the seconds)
        made, want = (json.loads((d.path / "checkpoints" / f"round-{r}.json").read_text())
                      for d in (run, crossfit_reference))
        assert made["compute"].pop("seconds").keys() == want["compute"].pop("seconds").keys() and made == want


def _stop_evaluation(monkeypatch, round_: int | None = None, batches: int = 0) -> dict:
    """Count the questions each evaluation asks; with `round_`, make that round's evaluation raise
    after `batches` batches answered (once)."""
    import selfevo.evolve as ev

    original, asked = ev.evaluate_solver, {}

    class Stopping:
        def __init__(self, solver, r, stop):
            self.solver, self.r, self.stop, self.calls = solver, r, stop, 0

        def __getattr__(self, name):
            return getattr(self.solver, name)

        def answer(self, questions, tool, **kw):
            if self.calls == self.stop:
                raise RuntimeError("simulated crash in the evaluation")
            self.calls += 1
            asked[self.r] = asked.get(self.r, 0) + len(questions)
            return self.solver.answer(questions, tool, **kw)

    def wrapped(solver, *args, run_info, **kwargs):
        r = run_info["round"]
        stop = batches if r == round_ and not asked.get("stopped") else None
        if stop is not None:
            asked["stopped"] = True
        return original(Stopping(solver, r, stop), *args, run_info=run_info, **kwargs)

    monkeypatch.setattr(ev, "evaluate_solver", wrapped)
    return asked


@pytest.mark.parametrize("every", [0, 1])
def test_a_kill_in_the_evaluation_keeps_the_answers_given(tmp_path, monkeypatch, crossfit_reference, every):
    """The round's evaluation (1,325 questions: hours at 4B) was redone whole after a kill; its
    answers now go on from eval/round-R.partial.jsonl, as the model that gave them is the one
    resumed (from the step checkpoint after the last auxiliary solver, or, with none, the round
    redone: the same model, the same hash)."""
    cfg = cfg_for(extra=["treatment=msv+crossfit"])
    _stop_evaluation(monkeypatch, 2, batches=3)
    with pytest.raises(RuntimeError, match="simulated crash in the evaluation"):
        evolve(cfg, tmp_path / "run", progress=False, step_checkpoints=every)
    run = RunDir(tmp_path / "run")
    partial = run.eval_partial_path(2)
    assert len(partial.read_text().splitlines()) == 1 + 3 * 64 and not run.eval_path(2).exists()
    if every:
        assert json.loads(run.step_checkpoint_path.read_text())["aux_trained"] == 2
    monkeypatch.undo()
    asked, aux = _stop_evaluation(monkeypatch), _aux_updates(monkeypatch)
    evolve(cfg, run.path, resume=True, progress=False, step_checkpoints=every)
    assert asked[2] == 1325 - 3 * 64 and asked[3] == 1325  # round 2's answered questions are not asked again
    assert ((2, "aux-0") in aux) == (not every)  # with step checkpoints, its aux solvers are not retrained
    assert_same_results(run, crossfit_reference, files=(*COMPARED, "eval/round-2.predictions.jsonl"))
    assert not partial.exists()


def test_answers_of_another_model_are_not_gone_on_from(tmp_path, monkeypatch, crossfit_reference):
    cfg = cfg_for(extra=["treatment=msv+crossfit"])
    _stop_evaluation(monkeypatch, 2, batches=3)
    with pytest.raises(RuntimeError, match="simulated crash in the evaluation"):
        evolve(cfg, tmp_path / "run", progress=False, step_checkpoints=1)
    run = RunDir(tmp_path / "run")
    lines = run.eval_partial_path(2).read_text().splitlines()
    head = json.loads(lines[0])
    head["partial_of"]["model"] = "0" * 64  # e.g. a GPU run whose round redone came out otherwise
    run.eval_partial_path(2).write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    monkeypatch.undo()
    asked = _stop_evaluation(monkeypatch)
    with pytest.warns(UserWarning, match="round-2.partial.jsonl: a stopped evaluation of other settings"):
        evolve(cfg, run.path, resume=True, progress=False, step_checkpoints=1)
    assert asked[2] == 1325
    assert_same_results(run, crossfit_reference)


def test_a_damaged_answers_file_is_an_error_naming_it(tmp_path, monkeypatch, crossfit_reference):
    """A line before the last that does not parse is no kill's doing (a kill tears the last line at
    most): refused with the file and line, exit 2, not a traceback; removed, the evaluation is redone."""
    cfg = cfg_for(extra=["treatment=msv+crossfit"])
    _stop_evaluation(monkeypatch, 2, batches=3)
    with pytest.raises(RuntimeError, match="simulated crash in the evaluation"):
        evolve(cfg, tmp_path / "run", progress=False, step_checkpoints=1)
    monkeypatch.undo()
    run = RunDir(tmp_path / "run")
    partial = run.eval_partial_path(2)
    lines = partial.read_text().splitlines()
    partial.write_text("\n".join([*lines[:5], "{not json", *lines[6:]]) + "\n")
    result = CliRunner().invoke(app, ["evolve", "--out", str(run.path), "--resume", *CLI_SCALED,
                                      "--treatment", "msv+crossfit", "--step-checkpoints", "1"])
    assert result.exit_code == 2 and f"{partial}:6" in result.output.replace("\n", ""), result.output
    partial.unlink()
    evolve(cfg, run.path, resume=True, progress=False, step_checkpoints=1)
    assert_same_results(run, crossfit_reference)


@pytest.mark.parametrize("aux_trained, says", [(3, "field 'aux_trained' should be 0..2, got 3"),
                                               ("1", "field 'aux_trained' should be an integer")])
def test_a_step_checkpoint_with_a_bad_aux_count_is_an_error_naming_it(tmp_path, monkeypatch, aux_trained, says):
    cfg = cfg_for(extra=["treatment=msv+crossfit"])
    _stop_evaluation(monkeypatch, 2, batches=1)
    with pytest.raises(RuntimeError):
        evolve(cfg, tmp_path / "run", progress=False, step_checkpoints=1)
    monkeypatch.undo()
    run = RunDir(tmp_path / "run")
    state = json.loads(run.step_checkpoint_path.read_text())
    run.step_checkpoint_path.write_text(json.dumps({**state, "aux_trained": aux_trained}))
    with pytest.raises(RunError, match=says) as e:
        evolve(cfg, run.path, resume=True, progress=False, step_checkpoints=1)
    assert str(run.step_checkpoint_path) in str(e.value)


def test_a_stale_step_checkpoint_is_dropped_and_the_next_round_starts_afresh(tmp_path, monkeypatch, reference):
    """A kill after a round's checkpoint and before its step checkpoint is removed leaves one of the
    round done: it is not gone on from."""
    cfg = cfg_for()
    monkeypatch.setattr(RunDir, "_drop_step_checkpoint", lambda self: None)
    crash_at(monkeypatch, "proposer_step", 3, 1)
    with pytest.raises(RuntimeError):
        evolve(cfg, tmp_path / "run", progress=False, step_checkpoints=1)
    run = RunDir(tmp_path / "run")
    assert json.loads(run.step_checkpoint_path.read_text())["round"] == 2 and run.manifest()["rounds_completed"] == 2
    monkeypatch.undo()
    evolve(cfg, run.path, resume=True, progress=False, step_checkpoints=1)
    assert_same_results(run, reference)
    assert not run.step_checkpoint_path.exists()


def test_a_step_checkpoint_whose_steps_the_log_lost_redoes_the_round(tmp_path, monkeypatch, reference):
    cfg = cfg_for()
    crash_at(monkeypatch, "solver_step", 2, cfg.loop.proposer_steps + 3)
    with pytest.raises(RuntimeError):
        evolve(cfg, tmp_path / "run", progress=False, step_checkpoints=1)
    run = RunDir(tmp_path / "run")
    lines = run.steps_path.read_bytes().splitlines(keepends=True)
    run.steps_path.write_bytes(b"".join(lines[:-2]))  # the last two steps of round 2 lost
    monkeypatch.undo()
    proposer = _calls(monkeypatch, "proposer_step")
    with pytest.warns(UserWarning, match="the step records hold 6 of the 8 steps of round 2"):
        evolve(cfg, run.path, resume=True, progress=False, step_checkpoints=1)
    assert proposer[0] == (2, 1)
    assert_same_results(run, reference)


@pytest.mark.parametrize("damage, says", [
    ("{", "unreadable, not valid JSON"),
    ('{"round": 2, "step": 19, "proposer": {}, "main": {}, "compute": {}, "pool": "x"}', "field 'pool'"),
    ('{"round": 3, "step": 19, "proposer": {}, "main": {}, "compute": {}, "pool": []}', "no such step next"),
    ('{"round": 2, "step": 19, "proposer": {}, "main": {}, "compute": {}, "pool": []}',
     "not a step checkpoint this run can load"),
])
def test_a_damaged_step_checkpoint_is_an_error_naming_it(tmp_path, monkeypatch, damage, says):
    cfg = cfg_for()
    crash_at(monkeypatch, "solver_step", 2, cfg.loop.proposer_steps + 3)
    with pytest.raises(RuntimeError):
        evolve(cfg, tmp_path / "run", progress=False, step_checkpoints=1)
    monkeypatch.undo()
    run = RunDir(tmp_path / "run")
    run.step_checkpoint_path.write_text(damage)
    with pytest.raises(RunError, match=says) as e:
        evolve(cfg, run.path, resume=True, progress=False)
    assert str(run.step_checkpoint_path) in str(e.value)


def test_cli_step_checkpoints_reach_the_run(tmp_path, monkeypatch):
    seen = {}

    def fake(cfg, out, **kw):
        seen.update(kw)
        raise RunError("stop here")

    monkeypatch.setattr("selfevo.evolve.evolve", fake)
    result = CliRunner().invoke(app, ["evolve", "--world", "small", "--out", str(tmp_path / "o"),
                                      "--step-checkpoints", "3"])
    assert result.exit_code == 2 and seen["step_checkpoints"] == 3
    result = CliRunner().invoke(app, ["evolve", "--world", "small", "--out", str(tmp_path / "o"),
                                      "--step-checkpoints", "-1"])
    assert result.exit_code == 2 and "--step-checkpoints" in result.output


def test_a_finished_run_keeps_no_evaluation_answers_file(tmp_path):
    """A kill after a round's checkpoint, before its answers file was removed, left the file in the
    run for good (a helper's review): finishing the run removes what is left."""
    from selfevo.runs import RunDir

    run = RunDir(tmp_path / "run")
    run.create({"seed": 0})
    (run.path / "eval").mkdir()
    run.eval_partial_path(3).write_text('{"partial_of": {}}\n')
    (run.path / "eval" / "round-3.json").write_text("{}")
    run.finish()
    assert sorted(p.name for p in (run.path / "eval").iterdir()) == ["round-3.json"]


@pytest.mark.parametrize("every", [1, 4])
def test_a_kill_in_a_proposer_step_goes_on_after_the_last_step_checkpoint(tmp_path, monkeypatch, reference, every):
    """A kill in round 2's 5th proposer step (both cadences checkpointed its 4th) redoes the 5th only: the
    4th, whose record and admissions the checkpoint holds, is not run again (its records twice, its
    admissions twice in the pool)."""
    cfg = cfg_for()
    crash_at(monkeypatch, "proposer_step", 2, 5)
    with pytest.raises(RuntimeError, match="simulated crash"):
        evolve(cfg, tmp_path / "run", progress=False, step_checkpoints=every)
    run = RunDir(tmp_path / "run")
    assert json.loads(run.step_checkpoint_path.read_text())["step"] == 11 + 4
    monkeypatch.undo()
    proposer = _calls(monkeypatch, "proposer_step")
    evolve(cfg, run.path, resume=True, progress=False, step_checkpoints=every)
    assert proposer == [(2, 5), (2, 6)] + [(3, i) for i in range(1, 7)]
    assert_same_results(run, reference)


def test_a_step_checkpoint_follows_the_rounds_last_step_whatever_the_cadence(tmp_path, monkeypatch, reference):
    """Every 4th step of an 11-step round checkpoints steps 4 and 8, and the 11th, the round's last: a kill
    in the round's evaluation redoes none of its steps."""
    cfg = cfg_for()
    _stop_evaluation(monkeypatch, 2, batches=3)
    with pytest.raises(RuntimeError, match="simulated crash in the evaluation"):
        evolve(cfg, tmp_path / "run", progress=False, step_checkpoints=4)
    run = RunDir(tmp_path / "run")
    assert json.loads(run.step_checkpoint_path.read_text())["step"] == 11 + 11
    monkeypatch.undo()
    solver = _calls(monkeypatch, "solver_step")
    evolve(cfg, run.path, resume=True, progress=False, step_checkpoints=4)
    assert {r for r, _ in solver} == {3}
    assert_same_results(run, reference)


def test_a_run_with_rounds_done_keeps_what_its_manifest_says_it_was_made_on(tmp_path):
    """(held by no test before a mutation sweep) A run with rounds done that records no sha256 (made
    before the fields existed) is not given what the data is now: those rounds were made on the data
    of then, which a resume, audit or report would then take for checked."""
    from selfevo.config import load_config
    from selfevo.evolve import note_made_on

    (tmp_path / "corpus.jsonl").write_text('{"id": "d1", "contents": "a"}\n')
    (tmp_path / "qa").mkdir()
    (tmp_path / "qa" / "nq.jsonl").write_text('{"question": "q", "golden_answers": ["a"]}\n')

    class Run:  # a RunDir's manifest, as `note` would update it
        def __init__(self, manifest):
            self.manifest_ = manifest

        def manifest(self):
            return dict(self.manifest_)

        def note(self, **fields):
            self.manifest_.update(fields)

    cfg = load_config(overrides=['backend="lm"', f'data.corpus="{tmp_path / "corpus.jsonl"}"',
                                 f'data.qa_dir="{tmp_path / "qa"}"'])
    old = Run({"status": "running", "rounds_completed": 2})
    note_made_on(old, cfg, None)
    assert "qa_sha256" not in old.manifest() and "corpus_sha256" not in old.manifest()
    new = Run({"status": "running", "rounds_completed": 0})  # a resume before any round is done notes it
    note_made_on(new, cfg, None)
    assert len(new.manifest()["qa_sha256"]) == len(new.manifest()["corpus_sha256"]) == 64


def test_evolve_refuses_a_negative_step_checkpoints_before_writing_anything(tmp_path):
    """(held by no test before a mutation sweep) `step_checkpoints=-1` is refused, naming it, before the
    world is built or the run directory made (it ran with no step checkpoint, as 0)."""
    from selfevo.config import load_config
    from selfevo.evolve import evolve

    with pytest.raises(ValueError, match=r"^step_checkpoints: must be an integer >= 0, got -1$"):
        evolve(load_config(), tmp_path / "run", step_checkpoints=-1)
    assert not (tmp_path / "run").exists()


def test_a_rounds_checkpoint_clears_what_it_makes_redundant(tmp_path):
    """RunDir.checkpoint(R): the answers files of the evaluations now recorded (rounds 0..R, R's own too) and
    the step checkpoint of the round are removed; a later round's answers stay until finish()."""
    run = RunDir(tmp_path / "run")
    run.create({"seed": 0})
    run.eval_partial_path(0).parent.mkdir()
    for r in (0, 1, 2):
        run.eval_partial_path(r).write_text("{}\n")
    run.step_checkpoint({"round": 1, "step": 3})
    run.checkpoint(1, {"compute": {"total_updates": 3}})
    assert [run.eval_partial_path(r).exists() for r in (0, 1, 2)] == [False, False, True]
    assert not run.step_checkpoint_path.exists() and run.manifest()["rounds_completed"] == 1
    assert json.loads((run.path / "compute.json").read_text()) == {"total_updates": 3}
    run.finish()
    assert not run.eval_partial_path(2).exists() and run.manifest()["status"] == "complete"


def test_tensor_files_are_the_references_with_a_digest_only():
    """A checkpoint's {"file", "sha256"} objects name tensor files; a "file" without its digest (a path a
    config or a state mentions) is none, and is never removed as one."""
    from selfevo.runs import tensor_files

    state = {"main": {"file": "main.pt", "sha256": "0"}, "aux": [{"policy": {"file": "aux.pt", "sha256": "1"}}],
             "corpus": {"file": "corpus.jsonl"}, "weights": [0.5, 1.5]}
    assert tensor_files(state) == {"main.pt", "aux.pt"}


def test_a_replaced_step_checkpoint_takes_only_its_own_tensor_files_with_it(tmp_path):
    """Replacing (or dropping) a step checkpoint removes the tensor files only it referenced (a policy's
    weights each); a file a round checkpoint references stays, whichever step checkpoint also named it."""
    run = RunDir(tmp_path / "run")
    run.tensors_dir.mkdir(parents=True)
    for name in ("round.pt", "a.pt", "b.pt"):
        (run.tensors_dir / name).write_text(name)
    run.checkpoint_path(1).write_text(json.dumps({"main": {"file": "round.pt", "sha256": "0"}}))
    run.step_checkpoint({"main": {"file": "a.pt", "sha256": "0"}, "proposer": {"file": "round.pt", "sha256": "0"}})
    run.step_checkpoint({"main": {"file": "b.pt", "sha256": "0"}})
    assert sorted(p.name for p in run.tensors_dir.iterdir()) == ["b.pt", "round.pt"]
    run._drop_step_checkpoint()
    assert sorted(p.name for p in run.tensors_dir.iterdir()) == ["round.pt"] and not run.step_checkpoint_path.exists()


def test_a_field_the_saved_config_lacks_resumes_only_at_its_default(tmp_path):
    """A run made before a field existed (its config.json lacks it) resumes where the config keeps that
    field's default -- nested fields too (mutant: no recursion into tables) -- and is refused, naming the
    field, where the config moves it (mutant: the missing field filled from the config whatever it says)."""
    from selfevo.config import RunConfig
    from selfevo.runs import ConfigDiffers

    run = RunDir(tmp_path / "run")
    cfg = cfg_for().to_json()
    assert cfg["search"]["topk"] == RunConfig().search.topk
    run.create(cfg)
    saved = json.loads((run.path / "config.json").read_text())
    del saved["search"]["topk"]  # as a selfevo from before the field wrote it
    (run.path / "config.json").write_text(json.dumps(saved))
    defaults = RunConfig().to_json()
    run.check_config(cfg, defaults)  # the default kept: the run means what it meant
    moved = json.loads(json.dumps(cfg))
    moved["search"]["topk"] += 1
    with pytest.raises(ConfigDiffers, match=r"\(fields: search\.topk\)$"):
        run.check_config(moved, defaults)


def test_a_run_made_before_runs_recorded_their_software_resumes_without_a_word(tmp_path):
    """A manifest without "software" (a run made before runs recorded it) is not checked on resume: no
    warning, nothing noted (mutant: the check dropped -- a KeyError, every such run refused)."""
    run = RunDir(tmp_path / "run")
    run.create({"seed": 0})
    m = json.loads((run.path / "manifest.json").read_text())
    del m["software"]
    (run.path / "manifest.json").write_text(json.dumps(m))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run.check_software()
    assert "software_resumed" not in run.manifest()


def test_config_differences_name_fields_either_side_has_alone():
    """The dotted fields where two configs differ, sorted: a field only the new config has is named too
    (mutant: only the saved config's keys walked -- "config differs (fields: )")."""
    from selfevo.runs import differences

    saved = {"seed": 0, "loop": {"rounds": 3, "gone": 1}}
    now = {"seed": 0, "loop": {"rounds": 4, "new": 2}, "search": {"topk": 3}}
    assert differences(saved, now) == ["loop.gone", "loop.new", "loop.rounds", "search"]
    assert differences(now, now) == []


def test_a_resume_takes_the_base_models_recorded_evaluation_and_is_held_to_its_qa_set(tmp_path, monkeypatch,
                                                                                         reference):
    """A run killed in round 1 (none checkpointed) has its base model's evaluation recorded: the resume takes
    it instead of evaluating again (hours at 4B; mutant: evaluated again, the same numbers), and checks the
    world and the QA set its rounds to come are evaluated on (mutant: evaluation=False, the QA set unchecked)."""
    import selfevo.evolve as ev

    cfg = cfg_for()
    run = crashed_run(tmp_path, monkeypatch, cfg, "solver_step", 1, cfg.loop.proposer_steps + 1)
    assert run.manifest()["rounds_completed"] == 0 and run.eval_path(0).exists()
    evaluated, checked = [], []
    real_evaluate, real_check = ev.evaluate_solver, ev.check_world
    monkeypatch.setattr(ev, "evaluate_solver", lambda *a, **k: evaluated.append(k["run_info"]["round"])
                        or real_evaluate(*a, **k))
    monkeypatch.setattr(ev, "check_world", lambda *a, **k: checked.append(k) or real_check(*a, **k))
    evolve(cfg, run.path, resume=True, progress=False)
    assert evaluated == [1, 2, 3] and checked == [{"evaluation": True, "held": True}]
    assert_same_results(run, reference)


def test_a_resumed_run_grades_by_the_folds_it_wrote_not_by_the_folds_made_again(tmp_path, monkeypatch):
    """folds.json is the run's permanent assignment: a resume reads it back rather than assigning again (a
    selfevo whose assignment changed would otherwise move sources between folds mid-run). Here it is edited
    (every source in the other fold) between the kill and the resume: round 3 grades by the edited folds."""
    cfg = cfg_for(extra=["treatment=crossfit"])
    crashed_run(tmp_path, monkeypatch, cfg, "proposer_step", 3, 1)
    path = tmp_path / "run" / "folds.json"
    saved = json.loads(path.read_text(encoding="utf-8"))
    saved["folds"] = {doc: 1 - fold for doc, fold in saved["folds"].items()}
    path.write_text(json.dumps(saved), encoding="utf-8")
    evolve(cfg, tmp_path / "run", resume=True, progress=False)
    items = [it for row in RunDir(tmp_path / "run").steps() if row["kind"] == "proposer" and row["round"] == 3
             for it in row["items"]]
    assert items and all(it["fold"] == saved["folds"][it["source_id"]] for it in items)


def test_a_config_replaced_in_code_is_checked_before_anything_is_written(tmp_path):
    """A RunConfig built or replaced in Python skips the parser: evolve checks it as config.json would be read
    back, so a str seed is a ConfigError naming the field, and no run directory is left behind."""
    import dataclasses

    from selfevo.config import ConfigError

    with pytest.raises(ConfigError, match=r"^seed: expected an integer, got '0'"):
        evolve(dataclasses.replace(cfg_for(), seed="0"), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_saved_config_with_relative_paths_resumes_from_its_directory(tmp_path, monkeypatch):
    """An older selfevo saved path fields as given (relative to its working directory); this one stores them
    absolute. A resume from that directory reads them as it does and is not refused as another config."""
    from selfevo.config import RunConfig
    from selfevo.runs import ConfigDiffers

    monkeypatch.chdir(tmp_path)
    (tmp_path / "w").mkdir()
    cfg = load_config(None, [*SCALED, f'world.name="{tmp_path / "w"}"']).to_json()
    run = RunDir(tmp_path / "run")
    run.create(cfg)
    saved = json.loads((run.path / "config.json").read_text(encoding="utf-8"))
    saved["world"]["name"] = "w"
    (run.path / "config.json").write_text(json.dumps(saved), encoding="utf-8")
    run.check_config(cfg, RunConfig().to_json())
    monkeypatch.chdir(tmp_path / "w")  # from elsewhere "w" is another directory
    with pytest.raises(ConfigDiffers, match=r"\(fields: world\.name\)$"):
        run.check_config(cfg, RunConfig().to_json())


def test_a_run_notes_the_wall_time_of_the_invocation_that_last_ran_it(reference):
    """The manifest says how long the last `evolve` of the run took, the evaluation and audit included
    (compute.json's seconds are the loop's phases only)."""
    seconds = reference.manifest()["wall_seconds_last_invocation"]
    assert isinstance(seconds, float) and 0 < seconds < 600
