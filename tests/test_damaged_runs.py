"""A damaged run directory is a one-line error naming the file (and line, and field), never a
traceback, whichever command reads it; a failed start leaves nothing that blocks the retry; a
replay bank refuses the same run twice.

Every test copies one small finished run (`--world small`, 2 rounds of 2 + 2 steps) and damages
the copy."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
from _shared import loop_that_trains_nothing
from typer.testing import CliRunner

import selfevo.evolve
from selfevo._io import file_sha256
from selfevo.cli import app
from selfevo.config import load_config
from selfevo.evolve import evolve
from selfevo.records import Document
from selfevo.replay import ReplayError, build_bank
from selfevo.runs import RunDir, RunError, check_loop_run

SMALL = ["world.name=small", "loop.rounds=2", "loop.proposer_steps=2", "loop.solver_steps=2",
         "loop.admit_per_round=20"]
CLI_SMALL = ["--world", "small", *[x for s in SMALL[1:] for x in ("--set", s)]]


def small_cfg():
    return load_config(None, SMALL)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("damaged") / "base"
    evolve(small_cfg(), out, progress=False)
    return out


@pytest.fixture
def run(tmp_path, finished) -> Path:
    """A fresh copy of the finished run, to damage."""
    return Path(shutil.copytree(finished, tmp_path / "run"))


def cli(*args) -> tuple[int, str]:
    res = CliRunner().invoke(app, [str(a) for a in args])
    return res.exit_code, " ".join(res.output.split())  # rich wraps long lines


def assert_one_line_error(rc: int, out: str, *named: str) -> None:
    assert rc == 2, out
    assert "Traceback" not in out and out.startswith("error:"), out
    for text in named:
        assert text in out, out


def files(path: Path) -> dict:
    return {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}


def n_lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def append_line(path: Path, text: str) -> int:
    """Append one line; return its line number."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text + "\n")
    return n_lines(path)


def cut_line(path: Path, n: int) -> int:
    """Cut line `n` (not the last) in half: corruption no kill can cause; return `n`."""
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[n - 1] = lines[n - 1][:20]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return n


def edit_json(path: Path, **fields) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(fields)
    path.write_text(json.dumps(data), encoding="utf-8")


# ------------------------------------------------------------------ evolve --resume


def edit_main(run: Path, **fields) -> None:
    """Set fields of the main solver's part of the round-2 checkpoint."""
    path = run / "checkpoints" / "round-2.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data["main"].update(fields)
    path.write_text(json.dumps(data), encoding="utf-8")


def _steps(run):
    return run / "records" / "steps.jsonl"


@pytest.mark.parametrize("damage, named", [
    (lambda run: append_line(_steps(run), '{"x": 1}'), "steps.jsonl:{line}: field 'round' is missing"),
    (lambda run: append_line(_steps(run), '[1, 2]'), "steps.jsonl:{line}: "),
    (lambda run: append_line(_steps(run), '{"schema": 1, "round": 1, "step": 9, "kind": "solver", '
                                          '"items": [{"question": "q"}]}'),
     "steps.jsonl:{line}: items[0]: field 'item_id' is missing"),
    (lambda run: edit_json(run / "manifest.json", rounds_completed="1"),
     "manifest.json: field 'rounds_completed' should be an integer, got '1'"),
    (lambda run: edit_json(run / "manifest.json", software="numpy 2"),
     "manifest.json: field 'software' should be an object, got 'numpy 2'"),
    (lambda run: (run / "checkpoints" / "round-2.json").write_text("{", encoding="utf-8"),
     "checkpoints/round-2.json: unreadable, not valid JSON"),
    (lambda run: (run / "checkpoints" / "round-2.json").write_text("{}", encoding="utf-8"),
     "checkpoints/round-2.json: field 'proposer' is missing"),
    (lambda run: (run / "checkpoints" / "round-2.json").write_text(
        '{"proposer": {}, "main": {}, "feedback": {}, "compute": {}}', encoding="utf-8"),
     "checkpoints/round-2.json: not a checkpoint this run can load"),
    # a part of the right kind holding values of the wrong shape: the loader's own error, named
    (lambda run: edit_main(run, theta="x"), "checkpoints/round-2.json: not a checkpoint this run can load ("),
    (lambda run: edit_main(run, theta=[1.0]), "checkpoints/round-2.json: not a checkpoint this run can load ("),
    (lambda run: edit_main(run, memory=5), "checkpoints/round-2.json: not a checkpoint this run can load ("),
    (lambda run: edit_main(run, memory=[[1]]), "checkpoints/round-2.json: not a checkpoint this run can load ("),
    (lambda run: (run / "folds.json").write_text("{", encoding="utf-8"), "folds.json: unreadable, not valid JSON"),
    (lambda run: edit_json(run / "folds.json", k="2"), "folds.json: field 'k' should be an integer"),
])
def test_resume_over_a_damaged_file_names_it_and_changes_nothing(run, damage, named):
    line = damage(run)
    before = files(run)
    rc, out = cli("evolve", "--out", run, *CLI_SMALL, "--resume", "--no-audit")
    assert_one_line_error(rc, out, str(run), named.format(line=line))
    assert files(run) == before


# ------------------------------------------------------------------ audit, replay build, compare, report


def test_audit_of_a_step_row_without_its_fields_names_line_and_field(run):
    line = append_line(_steps(run), '{"round": 1, "step": 99, "kind": "proposer"}')
    rc, out = cli("audit", run, "--out", run / "again", "--no-figures")
    assert_one_line_error(rc, out, f"{run}/records/steps.jsonl:{line}: field 'items' is missing")


def test_step_records_of_another_schema_are_refused(run):
    """records.py writes the schema version so that a reader can refuse records it does not
    understand: it does (before: a schema-99 log was audited, exit 0)."""
    steps = _steps(run)
    rows = [json.loads(line) for line in steps.read_text(encoding="utf-8").splitlines()]
    rows[3]["schema"] = 99
    steps.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    rc, out = cli("audit", run, "--out", run / "again", "--no-figures")
    assert_one_line_error(rc, out, f"{run}/records/steps.jsonl:4: field 'schema' is 99; this selfevo reads")


@pytest.mark.parametrize("command", [
    lambda run: ["audit", run, "--out", run / "again", "--no-figures"],
    lambda run: ["replay", "build", "--from", run, "--size", "5", "--out", run / "bank.json"],
    lambda run: ["compare", run],
])
def test_a_corrupt_config_is_named(run, command):
    (run / "config.json").write_text("{", encoding="utf-8")
    rc, out = cli(*command(run))
    assert_one_line_error(rc, out, f"{run}/config.json: unreadable, not valid JSON")


def test_a_config_with_a_bad_field_is_named(run):
    edit_json(run / "config.json", seed="0")
    rc, out = cli("compare", run)
    assert_one_line_error(rc, out, f"{run}/config.json: seed: expected an integer")


def test_an_unknown_treatment_in_the_config_of_a_run_of_selfevos_is_named(run):
    """A run of selfevo's own treatment (its manifest names no rules of a user's) whose config.json names
    an unknown treatment is refused, naming the field; it was read as a treatment of a user's where the
    manifest's `rules` was anything but a string (a damaged manifest's null)."""
    edit_json(run / "config.json", treatment="corpled")
    rc, out = cli("compare", run)
    assert_one_line_error(rc, out, f"{run}/config.json: treatment: unknown 'corpled'")
    for rules in (None, 5, ["mypkg.rules"]):
        edit_json(run / "manifest.json", rules=rules)
        assert RunDir(run).users_treatment() is None
        with pytest.raises(RunError, match="treatment: unknown 'corpled'"):
            RunDir(run).run_config()


def test_report_names_a_corrupt_config(tmp_path, finished):
    shutil.copytree(finished, tmp_path / "runs" / "a")
    (tmp_path / "runs" / "a" / "config.json").write_text("{", encoding="utf-8")
    rc, out = cli("report", tmp_path / "runs")
    assert_one_line_error(rc, out, "runs/a/config.json")


@pytest.mark.parametrize("damage, named", [
    (lambda steps: cut_line(steps, 2), "steps.jsonl:{line}: corrupt log line"),
    (lambda steps: append_line(steps, '{"x": 1}'), "steps.jsonl:{line}: field 'round' is missing"),
    (lambda steps: append_line(steps, '{"schema": 1, "round": 2, "step": 99, "kind": "cheat", "items": []}'),
     "steps.jsonl:{line}: field 'kind' should be proposer or solver"),
])
def test_replay_build_names_a_damaged_step_line(run, damage, named):
    line = damage(_steps(run))
    rc, out = cli("replay", "build", "--from", run, "--size", "5", "--out", run / "bank.json")
    assert_one_line_error(rc, out, named.format(line=line))
    assert not (run / "bank.json").exists()


def test_replay_build_refuses_the_same_run_twice(run, tmp_path):
    (tmp_path / "link").symlink_to(run)
    for again in (run, tmp_path / "run" / ".." / "run", tmp_path / "link"):
        rc, out = cli("replay", "build", "--from", run, again, "--size", "5", "--out", tmp_path / "bank.json")
        assert_one_line_error(rc, out, "is named twice")
    assert not (tmp_path / "bank.json").exists()
    rc, out = cli("replay", "build", "--from", run, "--size", "5", "--out", tmp_path / "bank.json")
    assert rc == 0 and "from 1 run(s)" in out, out


@pytest.mark.parametrize("damage", [
    lambda steps: steps.write_bytes(steps.read_bytes()[:-40]),  # a torn last line
    lambda steps: steps.write_bytes(b"".join(steps.read_bytes().splitlines(keepends=True)[:-2])),  # whole lines
])
def test_a_finished_run_whose_log_lost_its_tail_is_refused(run, damage):
    """A run marked complete holds every scheduled step: an audit of what is left of a damaged log
    would pass for the run's (before: "steps audited 27 of 33", exit 0)."""
    damage(_steps(run))
    rc, out = cli("audit", run, "--out", run / "again", "--no-figures")
    assert_one_line_error(rc, out, f"{run}/records/steps.jsonl:", "in a run marked complete")
    # the same log in a run still going is what a crash leaves: read, its torn line dropped
    edit_json(run / "manifest.json", status="running")
    assert len(RunDir(run).steps()) < 2 * 4


def test_a_finished_run_whose_log_is_gone_is_named_as_missing(run):
    """A missing log read as "steps.jsonl:1: 0 step records where the schedule has N", as if damaged."""
    _steps(run).unlink()
    rc, out = cli("audit", run, "--out", run / "again", "--no-figures")
    assert_one_line_error(rc, out, f"{run}/records/steps.jsonl: missing in a run marked complete")


# ------------------------------------------------------------------ the readers themselves


def test_readers_name_file_and_field(run):
    rd = RunDir(run)
    edit_json(run / "compute.json", total_generations=None)
    with pytest.raises(RunError, match=r"compute\.json: field 'total_generations' should be an integer"):
        rd.compute()
    (run / "compute.json").write_text('{"x": 1}', encoding="utf-8")
    with pytest.raises(RunError, match=r"compute\.json: field 'generations' is missing"):
        rd.compute()
    edit_json(run / "manifest.json", rounds_completed=True)  # a bool is not a count
    with pytest.raises(RunError, match=r"manifest\.json: field 'rounds_completed' should be an integer"):
        rd.manifest()
    edit_json(run / "manifest.json", rounds_completed=-1)
    with pytest.raises(RunError, match=r"manifest\.json: field 'rounds_completed' should be >= 0"):
        rd.manifest()
    (run / "manifest.json").write_text("[]", encoding="utf-8")
    with pytest.raises(RunError, match=r"manifest\.json: expected a JSON object, got a JSON list"):
        rd.manifest()
    (run / "config.json").unlink()
    with pytest.raises(RunError, match=r"config\.json: missing"):
        rd.config()


# ------------------------------------------------------------------ a failed start


def test_a_failed_start_leaves_nothing_that_blocks_the_retry(tmp_path, monkeypatch):
    """Building the agents (loading a model) fails: no run directory is left, so the corrected
    retry runs without --resume (before: "a run already exists here", and --resume said the
    config differs)."""
    def no_model(*args, **kwargs):
        raise OSError("nosuch: not a model")

    monkeypatch.setattr(selfevo.evolve, "build_loop", no_model)
    out = tmp_path / "run"
    with pytest.raises(OSError, match="not a model"):
        evolve(small_cfg(), out, progress=False)
    assert not out.exists()
    monkeypatch.undo()
    evolve(small_cfg(), out, progress=False)
    assert RunDir(out).manifest()["status"] == "complete"


def test_an_existing_run_is_refused_before_the_start_up_and_left_alone(run, monkeypatch):
    built = []
    real = selfevo.evolve.build_loop
    monkeypatch.setattr(selfevo.evolve, "build_loop", lambda *a, **k: built.append(1) or real(*a, **k))
    before = files(run)
    with pytest.raises(RunError, match="a run already exists here; pass --resume"):
        evolve(small_cfg(), run, progress=False)
    assert built == [] and files(run) == before
    # the same for a run that has logged steps but finished no round
    edit_json(run / "manifest.json", rounds_completed=0, status="running")
    before = files(run)
    with pytest.raises(RunError, match="a run already exists here"):
        evolve(small_cfg(), run, progress=False)
    assert built == [] and files(run) == before


def test_evolve_out_that_is_a_file_is_refused_before_the_start_up(tmp_path):
    (tmp_path / "afile").write_text("notes", encoding="utf-8")
    rc, out = cli("evolve", "--out", tmp_path / "afile", *CLI_SMALL, "--no-audit")
    assert_one_line_error(rc, out, "afile: not a directory")
    assert (tmp_path / "afile").read_text(encoding="utf-8") == "notes"


def _edit(path: Path, fn) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    fn(data)
    path.write_text(json.dumps(data), encoding="utf-8")


@pytest.mark.parametrize("damage, named", [
    (lambda root: _edit(root / "a" / "eval" / "round-2.json", lambda o: o.pop("benchmarks")),
     "a/eval/round-2.json: field 'benchmarks' is missing"),
    (lambda root: _edit(root / "a" / "eval" / "round-0.json", lambda o: o.update(macro=None)),
     "a/eval/round-0.json: field macro: should be an object"),
    (lambda root: _edit(root / "a" / "eval" / "round-2.json", lambda o: o["benchmarks"]["nq"].update(cover_em="x")),
     "a/eval/round-2.json: field benchmarks.nq.cover_em should be a finite number or null"),
    (lambda root: _edit(root / "a" / "audit" / "metrics.json", lambda o: o["rounds"][1].pop("F")),
     "a/audit/metrics.json: field rounds[1].F should be a finite number or null"),
    # a complete run whose rounds done are not its config's: its round-1 evaluation was paired with round 2's
    (lambda root: _edit(root / "a" / "manifest.json", lambda o: o.update(rounds_completed=1)),
     "a/manifest.json: status 'complete' with 1 round(s) done, but its config runs 2"),
    # NaN (which Python's JSON reader takes): the seed was skipped without a word
    (lambda root: _edit(root / "a" / "eval" / "round-2.json", lambda o: o["macro"].update(cover_em=float("nan"))),
     "a/eval/round-2.json: field macro.cover_em should be a finite number or null, got nan"),
    (lambda root: _edit(root / "a" / "audit" / "metrics.json", lambda o: o["rounds"][1].update(F=float("inf"))),
     "a/audit/metrics.json: field rounds[1].F should be a finite number or null, got inf"),
    (lambda root: (root / "replay").mkdir() or (root / "replay" / "results.json").write_text(
        '{"conditions": {}, "bank": [1]}'),
     "replay/results.json: field 'bank' should be an object"),
    (lambda root: _edit(root / "a" / "audit" / "metrics.json", lambda o: o.pop("steps")),
     "a/audit/metrics.json: field 'steps' is missing"),
    # what the report sums or reads of an audit and compute.json, past the metric numbers
    (lambda root: _edit(root / "a" / "compute.json", lambda o: o["seconds"].update(eval="0.27")),
     "a/compute.json: field seconds.eval should be a number"),
    (lambda root: _edit(root / "a" / "compute.json", lambda o: o["generations"].update(proposer=True)),
     "a/compute.json: field generations.proposer should be a number, got True"),  # summed as 1
    # a count below 0, or a NaN or infinity: shown as -125% extra updates, or a mean of -7650 generations
    (lambda root: _edit(root / "a" / "compute.json", lambda o: o.update(total_updates=-8)),
     "a/compute.json: field total_updates should be a finite number >= 0, got -8"),
    (lambda root: _edit(root / "a" / "compute.json", lambda o: o["updates"].update(main=float("nan"))),
     "a/compute.json: field updates.main should be a finite number >= 0, got nan"),
    (lambda root: _edit(root / "a" / "compute.json", lambda o: o["seconds"].update(eval=float("inf"))),
     "a/compute.json: field seconds.eval should be a finite number >= 0, got inf"),
    (lambda root: _edit(root / "a" / "audit" / "metrics.json", lambda o: o["steps"][0].pop("kind")),
     "a/audit/metrics.json: field steps[0]: field 'kind' is missing"),
    (lambda root: _edit(root / "a" / "audit" / "metrics.json", lambda o: o["rounds"][0].update(hop_mix_admitted=[])),
     "a/audit/metrics.json: field rounds[0].hop_mix_admitted should be an object keyed by hop count"),
    (lambda root: _edit(root / "a" / "audit" / "metrics.json",
                        lambda o: o["rounds"][0].update(hop_mix_admitted={"two": 1.0})),
     "a/audit/metrics.json: field rounds[0].hop_mix_admitted should be an object keyed by hop count"),
    (lambda root: _edit(root / "a" / "audit" / "metrics.json",  # a digit of another script: int() would fail
                        lambda o: o["rounds"][0].update(hop_mix_admitted={"\u00b2": 1.0})),
     "a/audit/metrics.json: field rounds[0].hop_mix_admitted should be an object keyed by hop count"),
    (lambda root: (root / "replay").mkdir() or (root / "replay" / "results.json").write_text('{"bank": 1}'),
     "replay/results.json: field 'conditions' should be an object of objects"),
    (lambda root: (root / "replay").mkdir() or (root / "replay" / "results.json").write_text(
        '{"conditions": {"coupled": {"F": 0.5, "seeds": 1}}}'),
     "replay/results.json: field conditions.coupled.F: should be an object, got 0.5"),
    (lambda root: (root / "replay").mkdir() or (root / "replay" / "results.json").write_text(
        '{"conditions": {"coupled": {"F": {"mean": "0.5", "std": 0}}}}'),
     "replay/results.json: field conditions.coupled.F.mean should be a finite number or null"),
])
def test_report_names_a_damaged_eval_audit_or_replay_file(tmp_path, finished, damage, named):
    # the report read these without the checks config, manifest and compute have: a KeyError traceback
    root = tmp_path / "runs"
    shutil.copytree(finished, root / "a")
    damage(root)
    rc, out = cli("report", root)
    assert_one_line_error(rc, out, named)
    assert not (root / "results.json").exists()
    if "replay" not in named and "round-0" not in named:  # compare reads the last round's files
        rc, out = cli("compare", root / "a")
        assert_one_line_error(rc, out, named.split(": field")[0])


def test_a_corpus_rewritten_since_the_run_is_refused(tmp_path, monkeypatch):
    """A run on a real corpus records its documents' sha256, as a world run records its world's:
    resume and audit refuse a corpus file edited since (before: the resumed rounds drew their sources
    from the new documents, and the audit's judge read whatever text the ids now name, exit 0)."""


    corpus, qa = tmp_path / "data" / "corpus" / "c.jsonl", tmp_path / "data" / "qa"
    corpus.parent.mkdir(parents=True)
    qa.mkdir()
    docs = [{"id": str(i), "contents": f'"Page {i}"\nPage {i} was founded in {1900 + i}.'} for i in range(3)]
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    (qa / "nq.jsonl").write_text(json.dumps({"id": "q0", "question": "When was Page 1 founded?",
                                             "golden_answers": ["1901"]}) + "\n", encoding="utf-8")
    # the language model is not what is checked here: a loop that trains nothing, a main solver that loads none
    monkeypatch.setattr(selfevo.evolve, "build_loop", loop_that_trains_nothing)
    cfg = load_config(None, [], backend="lm", **{"data.corpus": str(corpus), "data.qa_dir": str(qa)})
    out = tmp_path / "run"
    evolve(cfg, out, progress=False, audit=False)
    # the file's sha256, as a saved index records it (a BM25 index built in memory recorded its documents'
    # serialisation's: `sha256sum` could not check it, and one file had two hashes; a helper's review) ...
    assert RunDir(out).manifest()["corpus_sha256"] == file_sha256(corpus)
    assert RunDir(out).manifest()["index"] == {"kind": "bm25", "encoder": None}  # what its searches searched
    evolve(cfg, out, resume=True, progress=False, audit=False)  # the same corpus: resumes
    # ... and a run that recorded the serialisation's still resumes on the same documents (written here in
    # other bytes than their serialisation, which the file's own were)
    written = corpus.read_text(encoding="utf-8")
    serialised = hashlib.sha256("".join(json.dumps(Document.from_contents(d["id"], d["contents"]).to_json(),
                                                   ensure_ascii=False) + "\n" for d in docs).encode()).hexdigest()
    corpus.write_text("".join(json.dumps(d, separators=(",", ":")) + "\n" for d in docs), encoding="utf-8")
    assert file_sha256(corpus) != serialised
    edit_json(out / "manifest.json", corpus_sha256=serialised)
    # a reader without the run's lock (`replay build`, a grid's completeness check) accepts it and writes nothing
    with pytest.raises(ReplayError, match="no admitted items"):  # past the checks: the loop here trains nothing
        build_bank([out], size=1)
    assert RunDir(out).manifest()["corpus_sha256"] == serialised
    evolve(cfg, out, resume=True, progress=False, audit=False)
    # ... and records the file's from then on (else `report` saw other data beside a run made since)
    assert RunDir(out).manifest()["corpus_sha256"] == file_sha256(corpus)
    corpus.write_text(written, encoding="utf-8")
    edit_json(out / "manifest.json", corpus_sha256=file_sha256(corpus))
    # an index rebuilt in place (another kind, another encoder) over the same corpus is refused too
    edit_json(out / "manifest.json", index={"kind": "hybrid", "encoder": "0" * 64})
    with pytest.raises(RunError, match="the index is not the one .* searched"):
        evolve(cfg, out, resume=True, progress=False, audit=False)
    edit_json(out / "manifest.json", index={"kind": "bm25", "encoder": None})

    docs[1]["contents"] = '"Page 1"\nPage 1 was founded in 1950.'  # the user edits the corpus in place
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    before = files(out)
    with pytest.raises(RunError, match="c.jsonl: the corpus has changed since"):
        evolve(cfg, out, resume=True, progress=False, audit=False)
    rc, text = cli("audit", out, "--judge", "llm", "--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "m")
    assert_one_line_error(rc, text, "the corpus has changed since")
    assert files(out) == before
    # the audit reads the run's documents, not its QA set: one moved away since is no error
    docs[1]["contents"] = '"Page 1"\nPage 1 was founded in 1901.'
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    qa.rename(tmp_path / "moved-qa")
    rc, text = cli("audit", out, "--judge", "llm", "--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "m")
    # past every check of the run and its documents, to the judge: whose endpoint, down, is probed first
    assert_one_line_error(rc, text, "http://127.0.0.1:9/v1: cannot connect")
    # judges and comparisons a corpus run has no truth for, each refused with what does apply (they spoke of
    # "a world run", and --judge llm --compare oracle was told to use --judge llm; a helper's review)
    llm = ["--judge", "llm", "--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "m"]
    for args, said in ((["--judge", "oracle"], "a run on a real corpus has no exact truth; audit it with --judge llm"),
                       ([*llm, "--compare", "oracle"], "--compare oracle: " + str(out) + " is a run on a real "
                        "corpus, which has no exact truth to compare the judge with; leave --compare out"),
                       (["--judge", "gold"], "--judge gold reads gold answers from --records; a run directory is "
                        "audited with --judge oracle (a world run: its exact truth) or --judge llm"),
                       ([*llm, "--compare", "gold"], "--compare: a run directory is compared with its world's exact "
                        "truth only")):
        rc, text = cli("audit", out, *args)
        assert_one_line_error(rc, text, said)


# ------------------------------------------------------------------ mutation sweep: readers and run detection


def test_a_run_file_that_cannot_be_read_is_named_not_a_traceback(run):
    """An OSError other than a missing file (a directory where compute.json was) is one RunError naming
    the file, as a missing or corrupt one is."""
    (run / "compute.json").unlink()
    (run / "compute.json").mkdir()
    with pytest.raises(RunError, match=re.escape(f"{run / 'compute.json'}: unreadable (")):
        RunDir(run).compute()


@pytest.mark.parametrize("change, named", [
    (lambda row: row.update(malformed="x"), "field 'malformed' should be a list, got 'x'"),
    (lambda row: row.update(items=[5]), "items[0]: expected an object, got int"),
    (lambda row: row["items"][0].update(source_ids=["d0", 7]),
     "items[0]: field 'source_ids' should be a list of strings"),
    (lambda row: row["items"][0].update(responses=[None]), "items[0]: field 'responses' should be a list of strings"),
])
def test_a_step_row_with_a_bad_field_is_named_by_line_and_field(run, change, named):
    steps = _steps(run)
    rows = [json.loads(line) for line in steps.read_text(encoding="utf-8").splitlines()]
    n = next(i for i, r in enumerate(rows) if r["items"])  # a step that graded items
    change(rows[n])
    steps.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(RunError, match=re.escape(f"{steps}:{n + 1}: {named}")):
        RunDir(run).steps()


def test_an_evaluation_number_that_is_a_bool_is_refused_and_null_is_taken(run):
    """JSON true is no score (Python reads it as 1): refused like a string; null (nothing to measure) is taken."""
    path = run / "eval" / "round-2.json"
    _edit(path, lambda o: o["macro"].update(cover_em=None))
    assert RunDir(run).evaluation(2)["macro"]["cover_em"] is None
    _edit(path, lambda o: o["macro"].update(cover_em=True))
    with pytest.raises(RunError, match=re.escape(f"{path}: field macro.cover_em should be a finite number or null, "
                                                 "got True")):
        RunDir(run).evaluation(2)


def test_a_complete_run_with_more_rounds_done_than_its_config_runs_is_refused(tmp_path):
    """Not only fewer: a complete run with rounds beyond its config's would pair another round's evaluation."""
    for done in (1, 3):
        with pytest.raises(RunError, match=f"status 'complete' with {done} round\\(s\\) done, but its config runs 2"):
            check_loop_run({"status": "complete", "rounds_completed": done}, tmp_path, 2)
    check_loop_run({"status": "complete", "rounds_completed": 2}, tmp_path, 2)
    check_loop_run({"status": "running", "rounds_completed": 1}, tmp_path, 2)  # a run still going: fewer is fine


@pytest.mark.parametrize("manifest", ["[1]", '{"status": "running"}', '{"rounds_completed": 0}', "{"])
def test_a_damaged_or_minimal_run_manifest_is_still_a_run(run, manifest):
    """A run's manifest that is damaged (not an object, not JSON) or holds only one of its fields is a run:
    a new run there is refused, never written over it."""
    (run / "manifest.json").write_text(manifest, encoding="utf-8")
    rd = RunDir(run)
    assert rd.exists()
    with pytest.raises(RunError, match="a run already exists here"):
        rd.check_new()


def test_another_tools_manifest_is_no_run(tmp_path):
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "manifest.json").write_text('{"name": "bm25", "docs": 3}', encoding="utf-8")
    assert not RunDir(tmp_path / "index").exists()


def test_check_new_refuses_a_file_before_any_start_up(tmp_path):
    """check_new is what evolve and engine-run call before the model load: a file there is refused by it,
    not only later by the lock."""
    (tmp_path / "afile").write_text("notes", encoding="utf-8")
    with pytest.raises(RunError, match="afile: not a directory"):
        RunDir(tmp_path / "afile").check_new()


@pytest.mark.parametrize("left", [
    ["config.json", "engine/engine.json"],  # engine-run killed before its manifest
    ["config.json", ".config.json.abc123.tmp"],  # killed inside the config's write
])
def test_what_a_start_killed_before_its_manifest_left_does_not_block_the_retry(tmp_path, left):
    out = tmp_path / "run"
    for name in left:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps({"treatment": "coupled"}), encoding="utf-8")
    RunDir(out).check_new()
    RunDir(out).create(small_cfg().to_json())
    if left[1].endswith(".tmp"):  # the killed write's temp file is cleared
        assert not (out / left[1]).exists()
    assert RunDir(out).manifest()["status"] == "running"


@pytest.mark.parametrize("config", ['{"seed": 0}', "{"])
def test_a_directory_holding_only_a_config_json_of_no_run_is_refused(tmp_path, config):
    """A user's own config.json (no `treatment`, or not JSON) is no run's: a new run would replace it."""
    (tmp_path / "config.json").write_text(config, encoding="utf-8")
    with pytest.raises(RunError, match="not empty and holds no run \\(it has config.json\\)"):
        RunDir(tmp_path).check_new()
    assert (tmp_path / "config.json").read_text(encoding="utf-8") == config


def test_a_resume_over_a_damaged_manifest_never_says_to_remove_the_run(run):
    """The "remove it to start afresh" hint is for a run with no round finished; a damaged manifest says
    nothing of the rounds done, and the run behind it (2 rounds here) must not be thrown away."""
    edit_json(run / "manifest.json", rounds_completed="2")
    with pytest.raises(RunError, match="should be an integer, got '2'; cannot resume") as e:
        RunDir(run).open_for_resume(json.loads((run / "config.json").read_text(encoding="utf-8")))
    assert "remove" not in str(e.value) and "start afresh" not in str(e.value)


def test_a_resume_whose_last_checkpoint_is_gone_is_refused_naming_the_round(run):
    """Refused by open_for_resume itself, before the records are cut back or a model is loaded."""
    (run / "checkpoints" / "round-2.json").unlink()
    before = files(run)
    with pytest.raises(RunError, match="manifest says round 2 is done but its checkpoint is missing"):
        RunDir(run).open_for_resume(json.loads((run / "config.json").read_text(encoding="utf-8")))
    assert files(run) == before


def test_a_resume_removes_tensor_files_no_checkpoint_references(run):
    """open_for_resume itself clears what a kill between a step checkpoint's replacement and the removal of
    the old one's files left (a policy's weights each), keeping the files a checkpoint references."""
    tensors = RunDir(run).tensors_dir
    tensors.mkdir()
    _edit(run / "checkpoints" / "round-2.json", lambda o: o.update(policy={"file": "kept.pt", "sha256": "0"}))
    for name in ("kept.pt", "left.pt"):
        (tensors / name).write_text(name, encoding="utf-8")
    RunDir(run).open_for_resume(json.loads((run / "config.json").read_text(encoding="utf-8")))
    assert sorted(p.name for p in tensors.iterdir()) == ["kept.pt"]


@pytest.mark.parametrize("pool, named", [
    ([5], "pool[0]: expected an object, got int"),
    ([{"item_id": "x"}], "pool[0]: field 'question' is missing"),
])
def test_a_step_checkpoint_with_a_damaged_pool_is_an_error_naming_it(run, pool, named):
    """The admitted candidates of a step checkpoint are checked when it is read, not when the loop rebuilds them."""
    edit_json(run / "manifest.json", status="running", rounds_completed=1)  # killed in round 2, after step 6
    state = {"round": 2, "step": 6, "proposer": {}, "main": {}, "compute": {}, "pool": pool}
    RunDir(run).step_checkpoint_path.write_text(json.dumps(state), encoding="utf-8")
    with pytest.raises(RunError, match=re.escape(f"{RunDir(run).step_checkpoint_path}: {named}")):
        RunDir(run).open_for_resume(json.loads((run / "config.json").read_text(encoding="utf-8")))


def test_a_resume_under_other_software_again_keeps_the_earlier_record(run):
    """software_resumed is a history: a second resume under other software adds to it, with the rounds done."""
    from selfevo._software import SoftwareChanged

    earlier = {"rounds_completed": 1, "at": 0.0, "software": {"numpy": "0.0.2"}}
    _edit(run / "manifest.json", lambda m: m.update(software={**m["software"], "numpy": "0.0.1"},
                                                   software_resumed=[earlier]))
    with pytest.warns(SoftwareChanged, match="numpy 0.0.1 →"):
        RunDir(run).check_software()
    resumed = RunDir(run).manifest()["software_resumed"]
    assert len(resumed) == 2 and resumed[0] == earlier and resumed[1]["rounds_completed"] == 2


def test_a_manifest_records_the_schema_and_version_it_was_written_with(finished):
    import selfevo
    from selfevo.records import SCHEMA_VERSION

    m = RunDir(finished).manifest()
    assert m["schema"] == SCHEMA_VERSION and m["selfevo_version"] == selfevo.__version__
    assert m["status"] == "complete" and m["rounds_completed"] == 2 and isinstance(m["created"], float)


def test_a_finished_runs_log_with_a_torn_line_past_its_schedule_is_refused(run):
    """A torn line appended to a complete run's log leaves every scheduled row whole: still damage done after
    the run ended (no crash of the run tears a line once it is complete), named by its line."""
    with open(_steps(run), "ab") as fh:
        fh.write(b'{"schema": 1, "round": 3')
    with pytest.raises(RunError, match=re.escape(f"{_steps(run)}:9: the last line is cut short, in a run marked "
                                                 "complete")):
        RunDir(run).steps()


def test_a_finished_run_whose_log_lost_whole_rows_names_the_first_missing_line(run):
    steps = _steps(run)
    steps.write_bytes(b"".join(steps.read_bytes().splitlines(keepends=True)[:-2]))
    with pytest.raises(RunError, match=re.escape(f"{steps}:7: 6 step records where the schedule of the 2 round(s) "
                                                 "done has 8")):
        RunDir(run).steps()


def test_an_engine_runs_log_is_not_held_to_the_loops_schedule(run):
    """engine-run logs the steps its trainers ran: a complete engine run with fewer rows than the loop's
    schedule is no damage (only a torn last line is)."""
    steps = _steps(run)
    steps.write_bytes(b"".join(steps.read_bytes().splitlines(keepends=True)[:-2]))
    edit_json(run / "manifest.json", engine={"name": "trl"})
    assert len(RunDir(run).steps()) == 6


def test_a_recorded_evaluation_is_taken_only_where_it_is_whole(run):
    """A resumed run takes eval/round-N.json instead of evaluating again only where its question count (what
    compute.json counts) was written; else None: it evaluates again."""
    rd = RunDir(run)
    assert rd.recorded_evaluation(0)["run"]["questions"] > 0
    _edit(run / "eval" / "round-0.json", lambda o: o["run"].pop("questions"))
    assert rd.recorded_evaluation(0) is None
    _edit(run / "eval" / "round-0.json", lambda o: o.pop("run"))
    assert rd.recorded_evaluation(0) is None
    (run / "eval" / "round-0.json").unlink()
    assert rd.recorded_evaluation(0) is None


@pytest.mark.parametrize("change, named", [
    (lambda r: r.update(admitted="20"), "field rounds[0].admitted should be a finite number or null, got '20'"),
    (lambda r: r.update(hop_mix_admitted={"1": "0.45"}),
     "field rounds[0].hop_mix_admitted.1 should be a finite number or null, got '0.45'"),
])
def test_audit_metrics_name_a_bad_admission_count_or_hop_share(run, change, named):
    path = run / "audit" / "metrics.json"
    _edit(path, lambda o: change(o["rounds"][0]))
    with pytest.raises(RunError, match=re.escape(f"{path}: {named}")):
        RunDir(run).audit_metrics()


def test_a_resume_clears_what_a_kill_inside_an_atomic_write_left(run):
    """A kill inside an atomic write (a checkpoint, the manifest, an evaluation) leaves `.NAME.XXXX.tmp`
    beside the file: the resume removes them all, below the run's top too, and nothing else (mutant: the
    sweep dropped from open_for_resume -- they piled up with every kill, some a checkpoint's size)."""
    left = [run / ".manifest.json.k1ll3d00.tmp", run / "checkpoints" / ".round-3.json.k1ll3d00.tmp",
            run / "eval" / ".round-2.json.abcd1234.tmp"]
    for p in left:
        p.write_text("{half", encoding="utf-8")
    mine = run / "checkpoints" / "notes.tmp"  # no atomic write's leftover
    mine.write_text("mine", encoding="utf-8")
    assert RunDir(run).open_for_resume(json.loads((run / "config.json").read_text(encoding="utf-8"))) == 2
    assert [p.exists() for p in left] == [False, False, False] and mine.read_text(encoding="utf-8") == "mine"


def test_a_step_checkpoint_past_its_rounds_last_step_is_refused_naming_it(run):
    """A step checkpoint whose step the round's schedule does not reach (edited: no kill writes one) is
    refused naming the file, before anything is cut back (mutant: only "no step at all" refused -- it was
    gone on from as if the round's last step were done)."""
    edit_json(run / "manifest.json", status="running", rounds_completed=1)
    step = run / "checkpoints" / "step.json"
    step.write_text(json.dumps({"round": 2, "step": 99, "proposer": {}, "main": {}, "compute": {}, "pool": []}))
    before = files(run)
    with pytest.raises(RunError, match=r"step\.json: a checkpoint of round 2 step 99, .*no such step next"):
        RunDir(run).open_for_resume(json.loads((run / "config.json").read_text(encoding="utf-8")))
    assert files(run) == before


@pytest.mark.parametrize("field, value", [("seed", 5), ("k", 3), ("grouping", "connected")])
def test_a_resume_refuses_folds_its_config_does_not_make(run, field, value):
    """folds.json is permanent for the run, so one made by another seed, K or grouping (edited, or copied from
    another run) is refused naming the file and field, not run on (mutant: the seed not compared)."""
    from selfevo.evolve import saved_folds

    made = json.loads((run / "folds.json").read_text(encoding="utf-8"))[field]
    assert made != value
    edit_json(run / "folds.json", **{field: value})
    with pytest.raises(RunError, match=rf"folds\.json: field '{field}' is {value!r}, but the run's config makes "
                                       rf"{made!r}$"):
        saved_folds(RunDir(run), small_cfg())
