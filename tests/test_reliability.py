"""Reliability and security: nothing lost under kills and faults, nothing exposed.

- kill -9 at 10 seeded points spread over the whole schedule, resume each: byte-identical results,
  no torn or doubled record line (the experiment lives in benchmarks/crash.py; docs/reliability.md
  has its figures on the default world);
- same seed and config in another process (another PYTHONHASHSEED): byte-identical files (local vs
  Ray executors: tests/test_experiments_report.py::test_ray_matches_local);
- a failure or a kill inside an atomic write leaves the previous file; a torn log tail is repaired
  wherever the kill cut it;
- services: slow requests time out (408 / 504) instead of hanging, every server entry point binds
  127.0.0.1 by default, a bounded load test on loopback shows no errors;
- no unsafe deserialisation in src/ (AST scan; the scanner itself is tested on snippets).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import typer
from _servers import serve_app, stopped_within
from _shared import QA_DIR, REPO
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from test_search import DOCS
from typer.testing import CliRunner

from selfevo._io import append_jsonl, atomic_writer, read_jsonl_log, write_json
from selfevo.cli import app as cli_app
from selfevo.corpus import read_qa_dir, write_corpus
from selfevo.runs import RunDir
from selfevo.search.bm25 import BM25Index
from selfevo.search.client import RetrieverClient, RetrieverError
from selfevo.search.server import make_app

SRC = REPO / "src" / "selfevo"


def _benchmark(name: str):
    """A script of benchmarks/ as a module (they are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"selfevo_bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


crash = _benchmark("crash")
load_bench = _benchmark("load_retriever")

# A small world, but enough steps that a run lasts seconds and kills land all over it.
WORLD, SEED, OVERRIDES = "small", 3, ["loop.admit_per_round=600"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted CLI run (PYTHONHASHSEED=0)."""
    out = tmp_path_factory.mktemp("reliability") / "reference"
    crash.run_to_completion(crash.evolve_cmd(out, WORLD, SEED, OVERRIDES), hash_seed=0)
    assert crash.check_records(out) == []
    return out


# ------------------------------------------------------------------ kill -9 and resume


def test_kill_points_are_spread_over_the_whole_schedule():
    import random

    points = crash.kill_points(10, 129, random.Random(2024))
    assert len(points) == 10 and points == sorted(points) and 0 <= points[0] < 13 and 117 <= points[-1] <= 129
    assert all(b - a >= 1 for a, b in zip(points, points[1:]))  # one per stratum, no two the same


@pytest.mark.slow
def test_kill_9_at_10_points_then_resume_matches_an_uninterrupted_run(tmp_path, reference):
    summary = crash.experiment(tmp_path, WORLD, SEED, OVERRIDES, kills=10, points_seed=2024,
                               reference=reference, workers=2, log=print)
    print("kills per round:", summary["kills_per_round"])
    assert len(summary["kills"]) == 10
    for k in summary["kills"]:
        assert k["problems_after_kill"] == [], k  # atomic files parse even right after the kill
        assert k["problems_after_resume"] == [], k  # no torn line, no step twice, steps in order
        assert k["mismatches"] == [], k  # results byte-identical to the uninterrupted run
        assert k["temp_files_left"] == [], k  # a resume clears what a kill left of an atomic write
    # the stratified points reach every round of the schedule
    assert {"1", "2", "3"} <= set(summary["kills_per_round"]), summary["kills_per_round"]
    assert summary["all_matched"]


@pytest.mark.slow
def test_kill_9_with_step_checkpoints_resumes_from_them_to_the_uninterrupted_run(tmp_path, reference):
    """Killed runs writing a step checkpoint every 2 steps go on from the last one, and end as the
    uninterrupted run (which wrote none) did."""
    summary = crash.experiment(tmp_path, WORLD, SEED, OVERRIDES, kills=4, points_seed=7, reference=reference,
                               workers=2, step_checkpoints=2, log=print)
    assert summary["all_matched"], summary["kills"]
    within = [k for k in summary["kills"] if " after step " in k["goes_on_from"]]
    assert within, [k["goes_on_from"] for k in summary["kills"]]  # some kill did land after a step checkpoint
    for k in within:  # at most 2 steps behind the kill (a kill between a step's line and its checkpoint: 2)
        logged_in_round = k["lines"] - k["rounds_completed"] * summary["steps_per_round"]
        after = int(re.search(r" after step (\d+)", k["goes_on_from"])[1])
        assert logged_in_round - after in (0, 1, 2), k


@pytest.mark.slow
def test_kill_9_during_setup_and_during_the_audit_then_resume(tmp_path, reference):
    """The two ends the random points rarely hit: before the first step (world, index, base
    evaluation) and after the last checkpoint (the audit)."""
    summary = crash.experiment(tmp_path, WORLD, SEED, OVERRIDES, points=[0, "audit"], max_delay_s=0.0,
                               reference=reference, workers=2, log=print)
    assert [k["phase"] for k in summary["kills"]] == ["setup / base evaluation", "after the loop (audit)"]
    assert summary["all_matched"], summary["kills"]


def test_same_seed_same_bytes_in_another_process(tmp_path, reference):
    """Determinism: another process with another string-hash seed writes the same bytes; only
    timings (manifest, compute.json, the checkpoints' wall seconds) may differ."""
    out = tmp_path / "again"
    crash.run_to_completion(crash.evolve_cmd(out, WORLD, SEED, OVERRIDES), hash_seed=4242)
    files = sorted(str(p.relative_to(reference)) for p in reference.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    timing = {"manifest.json", "compute.json"} | {f for f in files if f.startswith("checkpoints/")}
    differ = [f for f in files if f not in timing and (out / f).read_bytes() != (reference / f).read_bytes()]
    assert differ == [] and crash.compare_runs(out, reference) == []
    assert len(files) - len(timing) >= 10  # the comparison covered the records, evals and audit


# ------------------------------------------------------------------ atomic writes and logs


def _temp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_an_error_inside_an_atomic_write_leaves_the_previous_file(tmp_path):
    path = tmp_path / "state.json"
    write_json(path, {"round": 1})
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="midway"):
        with atomic_writer(path) as fh:
            fh.write('{"round": 2, "weights": [0.1, 0.')
            raise RuntimeError("killed midway")
    assert path.read_bytes() == before and _temp_files(tmp_path) == []
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C is a BaseException: cleaned up all the same
        with atomic_writer(tmp_path / "new.json") as fh:
            fh.write("{")
            raise KeyboardInterrupt
    assert not (tmp_path / "new.json").exists() and _temp_files(tmp_path) == []


def test_a_kill_inside_a_checkpoint_write_leaves_the_previous_round(tmp_path):
    """A real SIGKILL in the middle of RunDir.checkpoint: the previous checkpoint and manifest stand,
    the half-written temp file is never read, and resuming clears it."""
    run_dir = tmp_path / "run"
    script = textwrap.dedent(f"""
        import contextlib, os, signal
        from selfevo import runs
        run = runs.RunDir({str(run_dir)!r})
        run.create({{"seed": 0}})
        run.checkpoint(1, {{"weights": [1.0] * 1000, "compute": {{}}}})
        real_writer = runs.atomic_writer

        @contextlib.contextmanager
        def dying_writer(path, *a, **kw):  # the checkpoint's write: half its bytes reach the disk, then kill -9
            with real_writer(path, *a, **kw) as fh:
                class Half:
                    def write(self, text):
                        fh.write(text[: len(text) // 2]); fh.flush(); os.fsync(fh.fileno())
                        os.kill(os.getpid(), signal.SIGKILL)
                yield Half()
        runs.atomic_writer = dying_writer
        run.checkpoint(2, {{"weights": [2.0] * 1000, "compute": {{}}}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    run = RunDir(run_dir)
    assert run.manifest()["rounds_completed"] == 1
    assert run.load_checkpoint(1)["weights"] == [1.0] * 1000
    assert not run.checkpoint_path(2).exists()
    left = _temp_files(run_dir / "checkpoints")
    assert len(left) == 1 and left[0].startswith(".round-2.json.")  # the kill's leftover, never read
    assert run.open_for_resume({"seed": 0}) == 1
    assert _temp_files(run_dir / "checkpoints") == []


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.fixed_dictionaries({"round": st.integers(1, 3), "text": st.text(max_size=20)}),
                     min_size=1, max_size=6),
       cut=st.floats(0, 1, exclude_max=True))
def test_a_log_torn_anywhere_in_its_last_line_is_repaired(tmp_path_factory, rows, cut):
    """Wherever a kill cuts the last append (even inside a multi-byte character), the reader
    drops exactly that line, `repair` truncates it, and appending continues cleanly."""
    path = tmp_path_factory.mktemp("log") / "steps.jsonl"
    path.touch()
    append_jsonl(path, rows[:-1])
    whole = path.read_bytes()
    last = (json.dumps(rows[-1], ensure_ascii=False) + "\n").encode()
    with open(path, "ab") as fh:
        fh.write(last[: int(cut * (len(last) - 1))])  # never the newline: the line is torn
    assert read_jsonl_log(path) == rows[:-1]
    assert read_jsonl_log(path, repair=True) == rows[:-1] and path.read_bytes() == whole
    append_jsonl(path, [{"round": 9, "text": "after"}])
    assert read_jsonl_log(path) == [*rows[:-1], {"round": 9, "text": "after"}]


def test_a_whole_last_row_without_its_newline_is_kept_and_its_line_ended(tmp_path):
    """A kill just before the newline leaves a whole row: it is kept, and repair ends its line,
    so the next append starts a line of its own instead of being glued onto it."""
    path = tmp_path / "steps.jsonl"
    path.write_bytes(b'{"round": 1}\n{"round": 2}')
    assert read_jsonl_log(path, repair=True) == [{"round": 1}, {"round": 2}]
    append_jsonl(path, [{"round": 3}])
    assert read_jsonl_log(path) == [{"round": 1}, {"round": 2}, {"round": 3}]


def test_a_log_line_that_is_not_an_object_is_corruption(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_bytes(b'{"round": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: corrupt log line (a JSON list")):
        read_jsonl_log(path, repair=True)


def test_a_corrupt_line_before_the_last_is_an_error_naming_it(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_bytes(b'{"round": 1}\n{"round": \n{"round": 1}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: corrupt log line")):
        read_jsonl_log(path, repair=True)
    assert path.read_bytes() == b'{"round": 1}\n{"round": \n{"round": 1}\n'  # repair never hides corruption


def test_a_line_nested_past_the_parsers_limit_is_corruption_named_by_line(tmp_path):
    """json raises RecursionError, not JSONDecodeError, on such a line: it was a traceback."""
    path = tmp_path / "steps.jsonl"
    path.write_bytes(b'{"round": 1}\n' + b"[" * 100_000 + b"]" * 100_000 + b'\n{"round": 2}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: corrupt log line")):
        read_jsonl_log(path)


def test_a_write_or_a_new_log_syncs_its_directory_after_the_rename(tmp_path, monkeypatch):
    """A rename (and a new file's name) lives in the directory: fsync of the file alone leaves it to
    the kernel's writeback, so a power cut could lose a checkpoint a later, synced manifest names."""
    synced: list[tuple[int, bool]] = []  # (inode, is a directory) of each fsync, in order
    real = os.fsync

    def recording(fd):
        st = os.fstat(fd)
        synced.append((st.st_ino, stat.S_ISDIR(st.st_mode)))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    folder = tmp_path / "run"
    write_json(folder / "manifest.json", {"round": 1})
    assert synced[-1] == (folder.stat().st_ino, True) and (folder / "manifest.json").stat().st_ino in \
        [ino for ino, is_dir in synced if not is_dir]
    synced.clear()
    append_jsonl(folder / "records" / "steps.jsonl", [{"round": 1}])  # a new log: its name too
    assert synced == [((folder / "records" / "steps.jsonl").stat().st_ino, False),
                      ((folder / "records").stat().st_ino, True)]
    synced.clear()
    append_jsonl(folder / "records" / "steps.jsonl", [{"round": 2}])  # an append: the file's fsync only
    assert [is_dir for _, is_dir in synced] == [False]
    synced.clear()
    with atomic_writer(folder / "scratch.json", fsync=False) as fh:  # a writer that asked for no sync
        fh.write("{}")
    assert synced == []


def _resume_cli(out: Path) -> list[str]:
    return crash.evolve_cmd(out, WORLD, SEED, OVERRIDES)[3:] + ["--resume"]  # the CLI's own arguments


@pytest.mark.parametrize("damage, named", [
    (lambda run: run / "records" / "steps.jsonl", "steps.jsonl:5: corrupt log line"),
    (lambda run: run / "manifest.json", "manifest.json: unreadable"),
    (lambda run: run / "config.json", "config.json: unreadable"),
])
def test_resume_over_a_damaged_run_exits_2_naming_the_file_and_changes_nothing(tmp_path, reference, damage, named):
    """Damage no kill can cause (the run's files are atomic or append-only): a corrupt line before
    the last one, a truncated manifest or config. Resume must refuse with one line, exit 2."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    target = damage(run)
    data = bytearray(target.read_bytes())
    if target.suffix == ".jsonl":
        lines = data.split(b"\n")
        lines[4] = lines[4][: len(lines[4]) // 2]
        data = bytearray(b"\n".join(lines))
    else:
        data = data[: len(data) // 2]
    target.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    result = CliRunner().invoke(cli_app, _resume_cli(run))
    assert result.exit_code == 2, result.output
    assert named in " ".join(result.output.split()) and "Traceback" not in result.output
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


# ------------------------------------------------------------------ writers: full disks, bad paths, two writers

_NO_ROOM_SCRIPT = """
import os, resource, signal, sys
from selfevo._io import append_jsonl, read_jsonl_log, write_json
log, state = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(log) + 10, hard))  # the disk fills mid-line
errors = []
for write in (lambda: append_jsonl(log, [{"row": 2, "text": "x" * 100}]),
              lambda: write_json(state, {"round": 2, "weights": [0.5] * 100})):
    try:
        write()
    except OSError as e:
        errors.append(str(e))
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # room again: the run goes on
append_jsonl(log, [{"row": 3}])
print(repr(errors))
"""


def test_a_write_on_a_full_disk_names_the_file_and_leaves_the_log_whole(tmp_path):
    """A full disk (here: a file-size limit, the kernel's own short write then EFBIG) cut an append inside
    its line: the torn part stayed, and the next append was glued onto it, so that row was lost (read as a
    torn last line) or the log refused as corrupt. The error named no file ("[Errno 27] File too large").
    Now the failed append is cut back off, and both errors name the file."""
    log, state = tmp_path / "steps.jsonl", tmp_path / "state.json"
    append_jsonl(log, [{"row": 1}])
    write_json(state, {"round": 1})
    proc = subprocess.run([sys.executable, "-c", _NO_ROOM_SCRIPT, str(log), str(state)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    errors = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert len(errors) == 2 and str(log) in errors[0] and str(state) in errors[1], errors
    assert read_jsonl_log(log) == [{"row": 1}, {"row": 3}]
    assert log.read_bytes().endswith(b"\n")
    assert json.loads(state.read_text()) == {"round": 1} and _temp_files(tmp_path) == []


def test_an_output_path_that_is_a_directory_or_under_a_file_is_one_line_naming_it(tmp_path):
    """`score --out DIR` wrote the whole file, then failed its rename naming the temp file
    (".DIR.x1y2z3.tmp: Is a directory"); `--out FILE/x.json` said only "FILE: File exists"."""
    qa = tmp_path / "qa"
    qa.mkdir()
    (qa / "nq.jsonl").write_text(json.dumps({"id": "n0", "question": "q", "golden_answers": ["x"]}) + "\n")
    preds = tmp_path / "preds.jsonl"
    preds.write_text(json.dumps({"id": "n0", "prediction": "a"}) + "\n")
    (tmp_path / "taken").mkdir()
    (tmp_path / "afile").write_text("keep")
    for out, said in ((tmp_path / "taken", "taken: is a directory"),
                      (tmp_path / "afile" / "x.json", "afile: File exists and is not a directory")):
        res = CliRunner().invoke(cli_app, ["score", "--data-dir", str(qa), "--predictions", str(preds),
                                           "--out", str(out)])
        text = " ".join(res.output.split())
        assert res.exit_code == 2 and said in text and ".tmp" not in text and "Traceback" not in text, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "preds.jsonl", "qa", "taken"]
    assert (tmp_path / "afile").read_text() == "keep" and not any((tmp_path / "taken").iterdir())


def test_a_rebuild_clears_what_a_build_killed_in_its_save_left(tmp_path):
    """A kill inside a BM25 index's save left its scratch directory (.bm25-XXXX, the score matrix: 12 MB
    for wiki18-mini's 21,845 passages, gigabytes for wiki-18) in the index directory for good, counted in
    the size `index build` reports. A build, or a cache rebuilt there, now clears it."""
    from selfevo.search.index import get_retriever

    _, corpus = _tiny_qa(tmp_path)
    for how in ("index build", "a cache"):
        out = tmp_path / how.replace(" ", "-")
        script = textwrap.dedent(f"""
            import os, signal, bm25s
            from selfevo.search.index import build_index
            real = bm25s.BM25.save
            def save_then_die(self, path, *a, **k):
                real(self, path, *a, **k)
                open(os.path.join(path, "..", ".docs.jsonl.x1y2z3w4.tmp"), "w").close()  # an atomic write's too
                os.kill(os.getpid(), signal.SIGKILL)
            bm25s.BM25.save = save_then_die
            build_index("bm25", {str(corpus)!r}, {str(out)!r})
        """)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        assert any(p.name.startswith(".bm25-") for p in out.iterdir())
        if how == "index build":
            res = CliRunner().invoke(cli_app, ["index", "build", "--corpus", str(corpus), "--out", str(out)])
            assert res.exit_code == 0, res.output
        else:  # the cache of `eval` and `serve-retriever --index-dir`
            assert len(get_retriever(corpus=corpus, cache_dir=out)) == len(DOCS)
        left = [p.name for p in out.iterdir() if p.name.startswith(".")]
        assert left == [], (how, left)


def test_a_build_clears_only_its_own_leftovers_not_those_of_a_directory_below(tmp_path):
    """The clean-up swept the whole tree under --out: with `--out indexes/`, another build's temp files
    (in flight, under its own lock) and anyone's `.bm25-*` directories below were deleted."""
    from selfevo.search.index import build_index

    _, corpus = _tiny_qa(tmp_path)
    out = tmp_path / "indexes"
    build_index("bm25", corpus, out)  # an index there, rebuilt: a directory a build may write into
    mine = [out / ".docs.jsonl.a1b2c3d4.tmp", out / "bm25" / ".x.jsonl.a1b2c3d4.tmp"]
    theirs = [out / "other" / ".docs.jsonl.a1b2c3d4.tmp", out / "other" / ".bm25-cache" / "f"]
    for p in [*mine, *theirs]:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x")
    build_index("bm25", corpus, out)
    assert not any(p.exists() for p in mine) and all(p.read_text() == "x" for p in theirs)
    # the corpus copy a rebuild killed while staging left beside a cache that is still valid: the next
    # user of the cache (eval, serve-retriever --index-dir) loads it and clears the copy
    from selfevo.search.index import get_retriever

    (out / ".docs-building").mkdir()
    (out / ".docs-building" / "docs.jsonl").write_text("x")
    built = (out / "manifest.json").read_bytes()
    assert len(get_retriever(corpus=corpus, cache_dir=out)) == len(DOCS)
    assert (out / "manifest.json").read_bytes() == built and not (out / ".docs-building").exists()


def test_a_world_make_killed_part_way_leaves_no_half_world_and_a_second_writer_is_refused(tmp_path):
    """A kill inside `world make` (here after corpus.jsonl) left a directory of some files the rerun
    refused with "a world is written once, to a new directory", while `evolve --world` on it said "not a
    world directory". A world is now written beside its directory and renamed onto it whole: a kill
    leaves no directory, the rerun writes the world. Two writers to one new directory both passed the
    emptiness check, and one world silently replaced the other: the second is refused."""
    from selfevo.world import WorldError, load_world, make_world, save_world
    from selfevo.world.generate import WorldConfig

    out = tmp_path / "world"
    script = textwrap.dedent(f"""
        import os, signal, sys
        import selfevo.world as world
        world.write_qa = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        from selfevo.cli import app
        sys.argv = ["selfevo", "world", "make", "--size", "small", "--out", {str(out)!r}]
        app()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not out.exists()  # the half world lies beside it, hidden: never read as a world
    res = CliRunner().invoke(cli_app, ["world", "make", "--size", "small", "--out", str(out)])
    assert res.exit_code == 0, res.output
    made = load_world(out)
    with pytest.raises(WorldError, match="not empty"):  # what a second writer meets once the first is done
        save_world(make_world(WorldConfig(size="small", seed=1)), out)
    assert load_world(out).documents == made.documents
    # a directory that is not empty and holds no world (files of the user's) is named so
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    res = CliRunner().invoke(cli_app, ["world", "make", "--size", "small", "--out", str(other)])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "holds no world (no world.json" in text and "remove it" in text, res.output


def _tiny_qa(tmp_path: Path) -> tuple[Path, Path]:
    qa, corpus = tmp_path / "qa", tmp_path / "corpus.jsonl"
    qa.mkdir()
    write_corpus(corpus, DOCS)
    (qa / "nq.jsonl").write_text("".join(json.dumps({"id": f"n{i}", "question": f"Which river is {w}?",
                                                     "golden_answers": [w]}) + "\n"
                                         for i, w in enumerate(["Danube", "Volga", "zebra"])))
    return qa, corpus


def test_a_second_evaluation_into_the_same_out_is_refused_and_the_first_is_untouched(tmp_path, monkeypatch):
    """Two `selfevo eval` into one --out were not locked: the second appended to (or, with other settings
    and nothing answered yet, removed and replaced) the first's predictions.partial.jsonl, so a resumed
    evaluation took the other's answers for its own (reviewer's run: 320 of 1,325 answers from another
    corpus's evaluation, macro Cover-EM 0.153 instead of 0.195, exit 0). Now the second is refused."""
    from selfevo.agents.baseline import RetrievalBaseline
    from selfevo.evaluate import run_eval

    qa, corpus = _tiny_qa(tmp_path)
    clean = run_eval(qa, corpus, "retrieval-baseline", tmp_path / "clean", progress=False)
    answering, go = threading.Event(), threading.Event()
    real = RetrievalBaseline.answer

    def held(self, *args, **kwargs):  # the first evaluation waits, mid-way, for the second to try
        answering.set()
        go.wait(timeout=30)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(RetrievalBaseline, "answer", held)
    out, first = tmp_path / "out", {}
    thread = threading.Thread(target=lambda: first.update(run_eval(qa, corpus, "retrieval-baseline", out,
                                                                   progress=False)))
    thread.start()
    try:
        assert answering.wait(timeout=30)
        partial = (out / "predictions.partial.jsonl").read_bytes()
        res = CliRunner().invoke(cli_app, ["eval", "--data-dir", str(qa), "--corpus", str(corpus), "--out", str(out),
                                           "--limit", "1"])
        text = " ".join(res.output.split())
        assert res.exit_code == 2 and "another evaluation is writing here" in text, res.output
        assert (out / "predictions.partial.jsonl").read_bytes() == partial  # untouched by the refused one
    finally:
        go.set()
        thread.join(timeout=60)
    assert first["macro"] == clean["macro"] and first["run"]["questions"] == 3
    assert (out / "predictions.jsonl").read_bytes() == (tmp_path / "clean" / "predictions.jsonl").read_bytes()
    assert not (out / "predictions.partial.jsonl").exists()
    run_eval(qa, corpus, "retrieval-baseline", out, progress=False)  # released once the first has ended


def _within(seconds: float, fn):
    """What `fn()` raised (None if it returned), waited for at most `seconds` in a daemon thread."""
    import threading

    outcome = []

    def run():
        try:
            fn()
            outcome.append(None)
        except BaseException as e:  # handed to the test
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still waiting after {seconds} s"
    return outcome[0]


def test_a_second_index_build_into_the_same_directory_is_refused(tmp_path):
    """Two builds into one index directory (`index build`, or a cache shared by two `serve-retriever
    --index-dir`): the second cleared the first's staged documents under it (the first failed with
    ".docs-building/.docs.jsonl.x.tmp: No such file or directory"), and two saves could leave one
    index's arrays beside the other's documents. Now a second build is refused while the first holds
    it, and a second user of a cache waits for it, then loads what is there."""
    import fcntl
    import threading

    from selfevo.search.index import build_index, get_retriever

    _, corpus = _tiny_qa(tmp_path)
    out = tmp_path / "index"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)
    loaded = []
    waiter = threading.Thread(target=lambda: loaded.append(get_retriever(corpus=corpus, cache_dir=out)))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, as a build in progress holds it
        # in a thread, bounded: a regression that waits for the lock fails here instead of hanging the suite
        # (a mutation sweep's did)
        err = _within(30, lambda: build_index("bm25", corpus, out))
        assert isinstance(err, ValueError) and "another process is building an index here" in str(err)
        res = []
        assert _within(30, lambda: res.append(CliRunner().invoke(
            cli_app, ["index", "build", "--corpus", str(corpus), "--out", str(out)]))) is None
        assert res[0].exit_code == 2 and "another process is building an index here" in res[0].output, res[0].output
        waiter.start()
        waiter.join(timeout=2)
        assert waiter.is_alive() and not loaded  # the cache's user waits
        assert list(out.iterdir()) == []
    finally:
        os.close(fd)  # the "build" ends
    waiter.join(timeout=60)
    assert len(loaded[0]) == len(DOCS)
    assert len(build_index("bm25", corpus, out)) == len(DOCS)
    assert len(get_retriever(corpus=corpus, cache_dir=out)) == len(DOCS)


# ------------------------------------------------------------------ services: timeouts, loopback, load


class GatedRetriever:
    """Answers only once `gate` is set: a stand-in for a retrieval that hangs."""

    def __init__(self, inner):
        self.inner, self.gate = inner, threading.Event()

    def __len__(self):
        return len(self.inner)

    def retrieve(self, queries, topk=3):
        self.gate.wait(timeout=30)
        return self.inner.retrieve(queries, topk)


@pytest.fixture(scope="module")
def small_index() -> BM25Index:
    return BM25Index.build(DOCS)


def test_a_slow_retrieval_times_out_with_504_and_the_server_keeps_answering(small_index):
    slow = GatedRetriever(small_index)
    try:
        with TestClient(make_app(slow, timeout_s=0.3)) as client:
            start = time.monotonic()
            r = client.post("/retrieve", json={"queries": ["zebra"]})
            assert r.status_code == 504 and "0.3 s" in r.json()["detail"]
            assert time.monotonic() - start < 5
            # a client retrying waits out the abandoned retrieval first (ours honours Retry-After)
            assert r.headers["retry-after"] == "1"
            assert client.get("/health").json()["status"] == "ok"
            slow.gate.set()  # retrieval is fast again: the same app answers normally
            r = client.post("/retrieve", json={"queries": ["zebra"], "topk": 1})
            assert r.status_code == 200 and r.json()["result"][0][0]["id"] == "d0"
    finally:
        slow.gate.set()


def test_a_trickling_body_gets_408_and_a_hung_retrieval_504_over_http(small_index):
    slow = GatedRetriever(small_index)
    try:
        with serve_app(make_app(slow, timeout_s=0.5)) as url:
            host, port = url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=10) as s:  # promise 100 bytes, send 10
                s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n" + b'{"queries"')
                start = time.monotonic()
                reply = s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
            assert time.monotonic() - start < 5
            with RetrieverClient(url, retries=0) as client:
                with pytest.raises(RetrieverError, match="HTTP 504"):
                    client.retrieve(["zebra"])
                assert client.health()["status"] == "ok"
            slow.gate.set()  # let the abandoned retrieval finish before the server shuts down
    finally:
        slow.gate.set()


def test_a_client_retrying_the_servers_504_waits_out_the_abandoned_retrieval(small_index):
    """The server's own 504 was retried after the client's backoff (0.5 s): a second slow retrieval
    started beside the abandoned one, which still held its thread. It now asks for its time limit."""
    slow = GatedRetriever(small_index)
    try:
        with serve_app(make_app(slow, timeout_s=0.3)) as url, \
                RetrieverClient(url, retries=1, backoff_s=0.01) as client:
            # the abandoned retrieval ends meanwhile: 0.6 s after it began (on the clock of the server's 0.3 s
            # limit, not the test's: a handoff delayed under load would let the first try succeed)
            wait = slow.retrieve

            def retrieve(queries, topk=3):
                if not timer.is_alive() and not slow.gate.is_set():
                    timer.start()
                return wait(queries, topk)

            timer, slow.retrieve = threading.Timer(0.6, slow.gate.set), retrieve
            start = time.monotonic()
            [[hit]] = client.retrieve(["zebra"], topk=1)
            assert hit.document.id == "d0" and time.monotonic() - start >= 1.0  # Retry-After: 1
    finally:
        slow.gate.set()


def test_daemon_threads_run_calls_as_the_thread_pool_does_and_an_interrupt_waits_for_none():
    """`DaemonThreads`, the pool of the remote agent's, the LLM judge's and the retriever server's calls: what
    concurrent.futures' pool gives (results, errors, map, at most max_workers threads, a with-block waiting
    for its calls), on daemon threads, and an interrupt leaving the block waits for no
    call in flight and cancels those queued."""
    from selfevo._threads import DaemonThreads

    both = threading.Barrier(2, timeout=10)  # two calls at once: two threads
    with DaemonThreads(2, "t") as pool:
        assert [f.result(10) for f in [pool.submit(both.wait) for _ in range(2)]] in ([0, 1], [1, 0])
        assert list(pool.map(lambda x: x * x, range(5))) == [0, 1, 4, 9, 16]
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 / 0).result(5)
    assert len(pool._threads) == 2 and all(t.daemon for t in pool._threads)  # no third
    assert not any(t.is_alive() for t in pool._threads)  # ended with the block
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(print)
    gate, ran = threading.Event(), []
    try:
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt), DaemonThreads(1) as pool:
            running = pool.submit(gate.wait, 30)
            queued = pool.submit(ran.append, "queued")
            raise KeyboardInterrupt
        assert time.monotonic() - start < 10 and not running.done() and queued.cancelled()
    finally:
        gate.set()
    assert running.result(10) is True and ran == []
    pool.shutdown(wait=True, cancel_futures=True)  # a second shutdown: the threads still end
    assert not pool._threads[0].is_alive()


def test_ctrl_c_of_a_server_does_not_wait_for_a_retrieval_it_gave_up_on(tmp_path):
    """A retrieval past the server's time limit is answered 504 and left running on its thread; Ctrl-C of the
    server then waited for it to finish (60 s here; a stuck one, for ever), and the server exited 0 after."""
    port_file = tmp_path / "port"
    script = f"""if True:
        import os, socket, time, uvicorn
        from selfevo.search.server import make_app
        class Stuck:
            def retrieve(self, queries, topk):
                time.sleep(60)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        with open({str(port_file)!r} + ".tmp", "w") as f:
            f.write(str(sock.getsockname()[1]))
        os.replace({str(port_file)!r} + ".tmp", {str(port_file)!r})
        uvicorn.Server(uvicorn.Config(make_app(Stuck(), timeout_s=1), log_level="warning")).run(sockets=[sock])
        """
    answered, replies = threading.Event(), []

    def ask():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with RetrieverClient(f"http://127.0.0.1:{port_file.read_text()}", retries=0) as client:
                    client.retrieve(["zebra"])
            except (FileNotFoundError, RetrieverError) as e:
                if "HTTP 504" in str(e):
                    replies.append(504)
                    answered.set()
                    return
                time.sleep(0.1)  # not yet written, or not yet serving

    threading.Thread(target=ask, daemon=True).start()
    took = stopped_within(script, answered, signal.SIGINT)
    assert replies == [504] and took < 15


def _typer_commands(app: typer.Typer, prefix: str = ""):
    for cmd in app.registered_commands:
        yield f"{prefix}{cmd.name or cmd.callback.__name__}", cmd.callback
    for group in app.registered_groups:
        yield from _typer_commands(group.typer_instance, f"{prefix}{group.name} ")


def test_every_server_entry_point_binds_loopback_by_default():
    # the CLI: every command with a --host option
    hosts = {}
    for name, callback in _typer_commands(cli_app):
        for param in inspect.signature(callback).parameters.values():
            if param.name == "host":
                default = param.default
                hosts[name] = getattr(default, "default", default)
    assert "serve-retriever" in hosts and set(hosts.values()) == {"127.0.0.1"}, hosts
    # the library: every function of src/ with a `host` parameter, and no wildcard address anywhere
    found = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args + node.args.kwonlyargs
                defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults
                defaults += node.args.kw_defaults
                for arg, default in zip(args, defaults):
                    if arg.arg == "host":
                        if isinstance(default, ast.Call) and default.args:  # typer.Option("127.0.0.1", ...)
                            default = default.args[0]
                        value = default.value if isinstance(default, ast.Constant) else ast.dump(default or ast.Pass())
                        found.append((f"{path.relative_to(SRC)}:{node.name}", value))
            if isinstance(node, ast.Constant) and node.value in ("0.0.0.0", "::", "[::]"):
                pytest.fail(f"{path}:{node.lineno}: a wildcard bind address in the source")
    assert found and all(v == "127.0.0.1" for _, v in found), found


def test_serve_retriever_is_unreachable_off_loopback_and_holds_a_bounded_load(tmp_path):
    """The real `selfevo serve-retriever` process, default host: answers on 127.0.0.1 only; a small
    concurrent load (8 clients × 25 requests) gets no error."""
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, DOCS)
    queries = [it.question for items in read_qa_dir(QA_DIR).values() for it in items][:200] if QA_DIR.exists() \
        else ["zebra stripes", "longest river in Europe", "hoofed mammal"]
    with load_bench.Server(corpus) as server:
        assert load_bench.reachable("127.0.0.1", server.port)
        other = load_bench.non_loopback_address()
        if other is not None:
            assert not load_bench.reachable(other, server.port), f"reachable on {other}"
        result = load_bench.load(server.url, queries, clients=8, requests_per_client=25)
        assert server.proc.poll() is None  # still serving
    assert result["requests"] == 200 and result["errors"] == 0, result
    assert 0 < result["p50_ms"] <= result["p99_ms"] <= result["max_ms"] and result["requests_per_s"] > 0


# ------------------------------------------------------------------ no unsafe deserialisation

UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib", "jsonpickle"}
# Documented safe uses, "relative/path.py: finding" (no line number) -> why. None so far: run data
# is JSON, indexes are numpy arrays (allow_pickle=False), FAISS's own format or JSON, configs TOML.
ALLOWED: dict[str, str] = {}


def unsafe_uses(source: str, filename: str = "<snippet>") -> list[str]:
    """Every construct in `source` that could deserialise or execute untrusted data."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            bad += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            if root in UNSAFE_MODULES:
                bad.append(f"{where}: from {node.module} import ...")
            if root == "torch" and any(a.name == "load" for a in node.names):
                bad.append(f"{where}: from torch import load (call torch.load(..., weights_only=True))")
            if root == "yaml" and any(a.name in ("load", "unsafe_load", "full_load", "load_all") for a in node.names):
                bad.append(f"{where}: from yaml import an unsafe loader")
        elif isinstance(node, ast.Call):
            func, kw = node.func, {k.arg: k.value for k in node.keywords}
            if isinstance(func, ast.Name) and func.id in ("eval", "exec", "__import__"):
                bad.append(f"{where}: {func.id}(...)")
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                owner, attr = func.value.id, func.attr
                if owner == "torch" and attr == "load":
                    wo = kw.get("weights_only")
                    if not (isinstance(wo, ast.Constant) and wo.value is True):
                        bad.append(f"{where}: torch.load without weights_only=True")
                if owner == "yaml" and attr in ("unsafe_load", "full_load", "load_all", "load"):
                    loader = kw.get("Loader")
                    if attr != "load" or not (isinstance(loader, ast.Attribute) and "Safe" in loader.attr
                                              or isinstance(loader, ast.Name) and "Safe" in loader.id):
                        bad.append(f"{where}: yaml.{attr} without a SafeLoader")
                if owner in ("pd", "pandas") and attr == "read_pickle":
                    bad.append(f"{where}: pandas.read_pickle")
            for name in ("allow_pickle", "trust_remote_code"):
                v = kw.get(name)
                if v is not None and not (isinstance(v, ast.Constant) and v.value is False):
                    bad.append(f"{where}: {name}={ast.unparse(v)}")
    return bad


def test_the_unsafe_use_scanner_finds_what_it_should():
    snippet = textwrap.dedent("""
        import pickle, json
        import cloudpickle as cp
        from marshal import loads
        from torch import load
        import torch, yaml, numpy as np, pandas as pd
        torch.load("w.pt")
        torch.load("w.pt", weights_only=False)
        torch.load("w.pt", weights_only=flag)
        torch.load("w.pt", weights_only=True)        # fine
        yaml.load(text)
        yaml.load(text, Loader=yaml.SafeLoader)      # fine
        yaml.safe_load(text)                         # fine
        yaml.unsafe_load(text)
        np.load("a.npy", allow_pickle=True)
        np.load("a.npy")                             # fine: numpy refuses pickles by default
        bm25s.BM25.load(d, allow_pickle=False)       # fine
        AutoModel.from_pretrained(p, trust_remote_code=True)
        pd.read_pickle("x")
        eval("1 + 1")
        exec(code)
        model.eval()                                 # fine: a method, not the builtin
        json.loads(s)                                # fine
    """)
    found = unsafe_uses(snippet)
    expected_lines = [2, 3, 4, 5, 7, 8, 9, 11, 14, 15, 18, 19, 20, 21]
    assert sorted(int(f.split(":")[1]) for f in found) == expected_lines, found


def test_no_unsafe_deserialisation_in_src():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 20  # the scan saw the package
    found = [f for path in files for f in unsafe_uses(path.read_text(encoding="utf-8"), str(path.relative_to(SRC)))]
    unexplained = [f for f in found if re.sub(r":\d+:", ":", f, count=1) not in ALLOWED]
    assert unexplained == [], unexplained
    # torch.load: every call in src/ (if any) passed the weights_only=True check above
    calls = sum(len(re.findall(r"\btorch\.load\(", p.read_text(encoding="utf-8"))) for p in files)
    print(f"scanned {len(files)} files; torch.load calls: {calls} (each with weights_only=True)")


def test_configs_are_parsed_never_evaluated(tmp_path):
    """A config value that would run code if evaluated is only ever a string (or an error)."""
    marker = tmp_path / "pwned"
    payload = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    from selfevo.config import ConfigError, load_config

    for text in (f"treatment={payload}", f"world.name={payload}", f'world.name="{payload}"'):
        try:
            cfg = load_config(None, [text])
            # a world directory is stored absolute: the payload stays its text, under this directory
            assert cfg.treatment == payload or cfg.world.name.endswith(payload)
        except ConfigError:
            pass
    assert not marker.exists()


def test_a_run_made_before_a_config_field_existed_resumes_while_it_keeps_its_default(tmp_path):
    from selfevo.config import RunConfig, load_config
    from selfevo.runs import RunError

    cfg = load_config(None, ["world.name=small"]).to_json()
    old = json.loads(json.dumps(cfg))
    del old["backend"], old["lm"], old["data"]["eval_limit"]  # as a run from an older selfevo saved it
    run = RunDir(tmp_path / "run")
    run.create(old)
    defaults = RunConfig().to_json()
    assert run.open_for_resume(cfg, defaults=defaults) == 0
    # a new field set away from its default changes what the run means: refused, and named
    changed = load_config(None, ["world.name=small", "data.eval_limit=3"]).to_json()
    with pytest.raises(RunError, match="data.eval_limit"):
        run.open_for_resume(changed, defaults=defaults)
    with pytest.raises(RunError, match="backend"):  # without defaults nothing is filled in
        run.open_for_resume(cfg)


def _running(pid: int) -> bool:
    """The process exists and is no zombie (an orphan killed waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_sigterm_stops_the_work_and_the_subprocess_it_started(tmp_path):
    """`kill`, `timeout` and a scheduler's preemption send SIGTERM. Python's default ended `selfevo`
    at once and silently, and a subprocess the work had started (engine-run's training job; `vllm
    serve`) went on, writing into the run a resume would take. Now the work's cleanup runs, and the
    exit is 143 with the line saying how to go on. The job here is a launcher whose own child does the
    work (accelerate's workers, the python verl's bash script runs): `subprocess.run` killed the
    launcher alone and left that child orphaned (a helper's review); both ignore SIGTERM, and a second
    SIGTERM, sent while the stop waits out its grace period, kills them at once (before, it skipped the
    kill)."""
    out, pidfile = tmp_path / "run", tmp_path / "pids"
    worker = f"import os, time; open({str(pidfile)!r}, 'a').write(str(os.getpid()) + ' '); time.sleep(600)"
    launcher = ("import signal, subprocess, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"open({str(pidfile)!r}, 'a').write(str(__import__('os').getpid()) + ' '); "
                f"subprocess.Popen([sys.executable, '-c', {worker!r}]).wait()")
    script = tmp_path / "go.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from selfevo import _proc
        from selfevo.cli import app
        from selfevo.loop.engine import Loop

        def proposer_step(self, *args, **kwargs):  # a step that waits on a training job
            _proc.run([sys.executable, "-c", {launcher!r}])

        Loop.proposer_step = proposer_step
        app(["evolve", "--world", "small", "--out", {str(out)!r}, "--no-audit"])
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "COLUMNS": "200"})
    pids = []
    try:
        deadline = time.monotonic() + 300
        while len(pidfile.read_text().split() if pidfile.exists() else []) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        pids = [int(p) for p in pidfile.read_text().split()]
        proc.send_signal(signal.SIGTERM)
        time.sleep(2)
        assert proc.poll() is None  # waiting out the grace period (30 s) for the group to stop
        proc.send_signal(signal.SIGTERM)
        text, _ = proc.communicate(timeout=20)  # at once, not after the grace period
        assert proc.returncode == 143, text
        assert "stopped:" in text and "--resume" in text, text
        assert not [pid for pid in pids if _running(pid)]  # the launcher and its worker: killed, not orphaned
    finally:
        proc.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_served_process_stops_with_its_descendants_when_the_block_ends(tmp_path):
    """`vllm serve` runs engine processes of its own, torchrun starts its workers in sessions of their
    own: leaving the block stops the whole tree, SIGKILL after the grace period for what ignores
    SIGTERM (before: `terminate` and `kill` of the server alone)."""
    from selfevo._proc import running

    pidfile = tmp_path / "pids"
    worker = f"import os, time; open({str(pidfile)!r}, 'a').write(str(os.getpid()) + ' '); time.sleep(600)"
    server = ("import signal, subprocess, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True); "
              f"exec({worker!r})")
    pids = []
    try:
        with running([sys.executable, "-c", server], grace=0.5):
            deadline = time.monotonic() + 60
            while len(pidfile.read_text().split() if pidfile.exists() else []) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            pids = [int(p) for p in pidfile.read_text().split()]
        assert not [pid for pid in pids if _running(pid)]
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("code", [3, 0])
def test_a_job_that_exits_leaving_its_workers_running_has_them_stopped(tmp_path, caplog, monkeypatch, code):
    """A launcher that exits by itself (an error in it, say) while its workers still run hands them to
    init, where no parent link finds them: before, they went on holding the GPU after the job had
    failed. The tree recorded while the job ran finds them; they are stopped, with a warning, whether
    the job failed or not (a worker SIGTERM does not stop is killed after the grace period)."""
    from selfevo import _proc

    pidfile, seen = tmp_path / "pids", tmp_path / "seen"
    worker = ("import os, pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"t = pathlib.Path({str(pidfile) + '.part'!r}); t.write_text(str(os.getpid())); "
              f"t.replace({str(pidfile)!r}); time.sleep(600)")
    look = _proc.process_tree

    def process_tree(*roots):  # the job's watch: says when one of its looks found the worker
        tree = look(*roots)
        if pidfile.exists() and int(pidfile.read_text()) in tree:
            seen.touch()
        return tree

    monkeypatch.setattr(_proc, "process_tree", process_tree)
    # the launcher exits once its worker is up (its pid written beside and renamed, whole) and the watch has
    # recorded it (a sleep of 1 s assumed the watch's looks, every 0.05 s, were on time)
    launcher = ("import os, subprocess, sys, time; "
                f"subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True)\n"
                "deadline = time.monotonic() + 30\n"
                f"while not os.path.exists({str(seen)!r}) and time.monotonic() < deadline: time.sleep(0.02)\n"
                f"sys.exit({code})")
    pids = []
    try:
        with caplog.at_level("WARNING", logger="selfevo._proc"):
            if code:
                with pytest.raises(subprocess.CalledProcessError):
                    _proc.run([sys.executable, "-c", launcher], grace=0.5, interval=0.05)
            else:
                _proc.run([sys.executable, "-c", launcher], grace=0.5, interval=0.05)
        pids = [int(p) for p in pidfile.read_text().split()]
        assert len(pids) == 1 and not _running(pids[0])
        assert f"exited (code {code}) leaving 1 of its processes running (pid {pids[0]})" in caplog.text
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_job_that_leaves_nothing_running_is_not_warned_about(tmp_path, caplog):
    from selfevo import _proc

    with caplog.at_level("WARNING", logger="selfevo._proc"):
        _proc.run([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass'])"],
                  interval=0.01)
    assert not caplog.records


def test_a_starter_refused_does_not_remove_the_directory_another_holds(tmp_path, monkeypatch):
    """Two starters found the run directory missing; the one the lock refused removed the (still
    empty) directory the other held, whose writes then went to a new directory nobody held."""
    import selfevo._io as io

    target = tmp_path / "run"
    real_open = os.open
    other = contextlib.ExitStack()
    opened = []

    def open_after_the_other_holds(path, flags, *a):
        if Path(path) == target and not opened:  # the other starter gets in between: it holds the directory
            opened.append(path)
            other.enter_context(io.hold_directory(target, lambda: RuntimeError("busy")))
        return real_open(path, flags, *a)

    monkeypatch.setattr(io.os, "open", open_after_the_other_holds)
    with other:
        with pytest.raises(RuntimeError, match="busy"), io.hold_directory(target, lambda: RuntimeError("busy")):
            pass
        assert target.is_dir()  # the holder's, still there


def test_an_atomic_write_reads_like_any_new_file_not_like_a_private_temp_file(tmp_path, monkeypatch):
    """mkstemp makes its file 0600: a run's files written through it must carry the umask's mode (0644 under
    022), or a colleague reading the run directory is refused."""
    from selfevo import _io

    monkeypatch.setattr(_io, "_UMASK", 0o022)
    write_json(tmp_path / "manifest.json", {"round": 1})
    assert stat.S_IMODE((tmp_path / "manifest.json").stat().st_mode) == 0o644


def test_a_directory_the_file_system_cannot_sync_is_left_as_it_is_but_an_io_error_is_raised(tmp_path, monkeypatch):
    """Some network file systems refuse fsync on a directory (EINVAL): the write stands; a real I/O error of it
    is no such refusal and is raised."""
    import errno

    real = os.fsync

    def refusing(code):
        def fsync(fd):
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                raise OSError(code, os.strerror(code))
            real(fd)
        return fsync

    monkeypatch.setattr(os, "fsync", refusing(errno.EINVAL))
    write_json(tmp_path / "a.json", {"round": 1})
    append_jsonl(tmp_path / "log" / "steps.jsonl", [{"round": 1}])
    assert read_jsonl_log(tmp_path / "log" / "steps.jsonl") == [{"round": 1}]
    monkeypatch.setattr(os, "fsync", refusing(errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        write_json(tmp_path / "b.json", {"round": 2})


def test_a_holder_with_no_busy_error_waits_for_the_other_holder_to_end(tmp_path):
    """hold_directory(path, None) (a second user of an index cache) waits for the holder and then holds it, where
    one with `busy` is refused at once."""
    from selfevo._io import hold_directory

    order: list[str] = []
    failed: list[BaseException] = []

    def second():
        try:
            with hold_directory(tmp_path / "cache", None):
                order.append("second holds")
        except BaseException as e:  # noqa: BLE001 - reported below, not lost in the thread
            failed.append(e)

    with hold_directory(tmp_path / "cache", lambda: RuntimeError("busy")):
        with pytest.raises(RuntimeError, match="busy"):
            with hold_directory(tmp_path / "cache", lambda: RuntimeError("busy")):
                pass
        waiter = threading.Thread(target=second)
        waiter.start()
        waiter.join(0.2)  # it cannot take the lock while this block holds it
        order.append("first ends")
    waiter.join(10)
    assert failed == [] and order == ["first ends", "second holds"]


def test_stray_files_names_only_what_the_command_would_not_write(tmp_path):
    """Hidden files (temp files, locks) and the command's own names are no obstacle; the others are named, the
    first three in name order."""
    from selfevo._io import stray_files

    for name in (".lock", ".score.json.abc.tmp", "score.json"):
        (tmp_path / name).write_text("x")
    assert stray_files(tmp_path, ["score.json"]) is None
    assert stray_files(tmp_path / "missing", ["score.json"]) is None
    for name in ("d.txt", "b.txt", "c.txt"):
        (tmp_path / name).write_text("x")
    assert stray_files(tmp_path, ["score.json"]) == "b.txt, c.txt, d.txt"
    (tmp_path / "a.txt").write_text("x")
    assert stray_files(tmp_path, ["score.json"]) == "a.txt, b.txt, c.txt, ..."


def test_only_an_atomic_writes_temp_files_are_cleared_as_leftovers(tmp_path):
    """`.NAME.XXXXXXXX.tmp` is an atomic write's; any other hidden file (a lock, a user's dotfile) is not."""
    from selfevo._io import remove_leftover_temps

    for name in (".a.json.x1y2.tmp", ".a.json.keep", ".notes.txt", "a.json", "b.tmp"):
        (tmp_path / name).write_text("x")
    remove_leftover_temps(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".a.json.keep", ".notes.txt", "a.json", "b.tmp"]


def test_a_json_file_keeps_its_writers_key_order(tmp_path):
    """write_json writes keys in the writer's order (a manifest's, an evaluation's), indented, ending its line."""
    write_json(tmp_path / "x.json", {"status": "complete", "benchmarks": {"nq": 1}, "a": "é"})
    assert (tmp_path / "x.json").read_text(encoding="utf-8") == \
        '{\n  "status": "complete",\n  "benchmarks": {\n    "nq": 1\n  },\n  "a": "\\u00e9"\n}\n'


def test_a_log_rewritten_on_resume_has_the_bytes_appending_gave_it(tmp_path):
    """open_for_resume rewrites the kept rows with write_jsonl; they must be the bytes append_jsonl wrote
    (non-ASCII text as UTF-8), or a resumed run's log differs from an uninterrupted one's."""
    from selfevo._io import write_jsonl

    rows = [{"question": "Who founded Zürich?", "responses": ["Ærø", "北京"]}, {"round": 2}]
    append_jsonl(tmp_path / "appended.jsonl", rows)
    write_jsonl(tmp_path / "rewritten.jsonl", rows)
    assert (tmp_path / "rewritten.jsonl").read_bytes() == (tmp_path / "appended.jsonl").read_bytes()


def test_a_blank_line_inside_a_log_is_corruption_not_its_end(tmp_path):
    """Only the very end of the file may be empty: a blank line before rows must not end the reading there
    (the rows after it silently lost)."""
    path = tmp_path / "steps.jsonl"
    path.write_bytes(b'{"round": 1}\n\n{"round": 2}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: corrupt log line")):
        read_jsonl_log(path, repair=True)
    assert path.read_bytes() == b'{"round": 1}\n\n{"round": 2}\n'


def test_appending_no_rows_leaves_no_file(tmp_path):
    """Nothing to append touches nothing: no empty log (a finished run's missing log would read as one emptied)."""
    append_jsonl(tmp_path / "records" / "steps.jsonl", [])
    assert not (tmp_path / "records").exists()


# ------------------------------------------------------------------ _proc: what counts as running, how a stop goes


def test_a_zombie_a_reaped_child_or_another_start_time_is_not_running():
    """`_running` is what keeps a stop from signalling a pid another process took: the start time must
    match, a zombie is gone, and a reaped pid is gone also when /proc's start time is unknown ("")."""
    from selfevo import _proc

    me = _proc._stat(os.getpid())
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    assert me == (os.getppid(), fields[0], fields[19]) and _proc._running(os.getpid(), me[2])
    assert not _proc._running(os.getpid(), str(int(me[2]) + 1))  # same pid, another process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = _proc._stat(child.pid)[2]
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert _proc._stat(child.pid)[1] == "Z" and not _proc._running(child.pid, start)
    assert _proc._running(child.pid, "")  # kill(pid, 0) still finds a zombie ...
    child.wait()
    assert not _proc._running(child.pid, "") and not _proc._running(child.pid, start)  # ... not a reaped pid
    assert _proc.process_tree(child.pid) == {child.pid: ""}  # a root /proc does not show


def _wait_for(path: Path, deadline_s: float = 60) -> None:
    deadline = time.monotonic() + deadline_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _sleeper(tmp_path: Path, setup: str) -> subprocess.Popen:
    """A Python process that runs `setup` (statements; pathlib and signal imported), says it is ready, then
    sleeps: returned once ready (the caller kills it on the way out)."""
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", f"import pathlib, signal, time; {setup}; "
                                                   f"pathlib.Path({str(ready)!r}).write_text(''); time.sleep(600)"])
    _wait_for(ready)
    return proc


def test_a_stop_sends_sigterm_first_and_does_not_wait_out_the_grace_once_the_job_is_gone(tmp_path, caplog):
    """A server that handles SIGTERM (saves, exits) gets it, and leaving the block returns as soon as it
    has exited, not after the grace period; nothing is warned about (the job did not exit by itself)."""
    from selfevo._proc import running

    ready, termed = tmp_path / "ready", tmp_path / "termed"
    server = ("import pathlib, signal, sys, time; "
              f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(termed)!r}).write_text('x'), "
              "sys.exit(0))); "
              f"pathlib.Path({str(ready)!r}).write_text(''); time.sleep(600)")
    with caplog.at_level("WARNING", logger="selfevo._proc"):
        with running([sys.executable, "-c", server], grace=30) as proc:
            _wait_for(ready)
            start = time.monotonic()
        assert time.monotonic() - start < 15  # not the 30 s grace
    assert termed.exists() and proc.returncode == 0
    assert not caplog.records


def test_a_stop_kills_what_ignores_sigterm_and_reaps_it(tmp_path):
    from selfevo._proc import running

    ready = tmp_path / "ready"
    server = ("import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"pathlib.Path({str(ready)!r}).write_text(''); time.sleep(600)")
    with running([sys.executable, "-c", server], grace=0.2) as proc:
        _wait_for(ready)
    assert proc.returncode == -signal.SIGKILL  # reaped: no zombie left behind


@pytest.mark.skipif(not Path("/proc/self/comm").exists(), reason="needs Linux's /proc")
def test_a_process_named_in_bytes_that_are_no_utf8_is_read(tmp_path):
    """A process name is cut at 15 bytes, which can split a UTF-8 character (`./обработка`): /proc read as
    text raised UnicodeDecodeError in every job's start anywhere on the machine, the job left running."""
    from selfevo import _proc

    other = _sleeper(tmp_path, "pathlib.Path('/proc/self/comm').write_bytes(b'obrab\\xd0\\xbe\\xd0')")
    try:
        assert Path(f"/proc/{other.pid}/comm").read_bytes() == b"obrab\xd0\xbe\xd0\n"
        assert other.pid in _proc.process_tree(other.pid)
        _proc.run([sys.executable, "-c", "pass"])  # a job's start and stop look at every process
    finally:
        other.kill()
        other.wait()


def test_an_interrupt_while_the_stop_looks_at_the_tree_kills_what_was_recorded(tmp_path, monkeypatch):
    """A second Ctrl-C or SIGTERM landing while the stop looked at the job's tree, before its signals, ended
    the stop there and left the job (and its workers) running. What was recorded is now killed at once."""
    from selfevo import _proc

    ready = tmp_path / "ready"
    server = ("import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"pathlib.Path({str(ready)!r}).write_text(''); time.sleep(600)")
    close = _proc.Watch.close

    def interrupted(self):
        close(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(_proc.Watch, "close", interrupted)
    proc = None
    try:
        with pytest.raises(KeyboardInterrupt), _proc.running([sys.executable, "-c", server], grace=30) as proc:
            _wait_for(ready)
        assert proc.returncode == -signal.SIGKILL  # killed, not waited out for the 30 s grace, and reaped
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_interrupt_before_a_commands_watch_began_stops_the_command(monkeypatch):
    """Ctrl-C or SIGTERM after the command started and before its watch began (a /proc scan, slow on a loaded
    machine): the command is stopped there and reaped, not left running with nothing to stop it."""
    from selfevo import _proc

    started = []

    def interrupted(self, proc, interval):
        started.append(proc)
        raise KeyboardInterrupt

    monkeypatch.setattr(_proc.Watch, "__init__", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt), _proc.running([sys.executable, "-c", "import time; time.sleep(600)"]):
            pass
        [proc] = started
        assert proc.returncode in (-signal.SIGTERM, -signal.SIGKILL)
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_pid_an_earlier_descendant_held_is_recorded_as_the_process_holding_it_now(monkeypatch):
    """The watch kept the start time first seen for a pid: a later descendant that took the pid of an earlier
    one (a long job) was recorded as the earlier, which `_running` found gone, and was never signalled."""
    from selfevo import _proc

    looks = []

    def tree(*roots):  # the job 1, its worker 100 replaced by another that took its pid
        looks.append(roots)
        return {1: "10", 100: "50" if len(looks) == 1 else "90"}

    class Job:
        pid = 1

        def poll(self):
            return None

    monkeypatch.setattr(_proc, "process_tree", tree)
    watch = _proc.Watch(Job(), 0.01)
    deadline = time.monotonic() + 10
    while len(looks) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch.seen == {1: "10", 100: "90"}
    assert watch.close() == {1: "10", 100: "90"}


def test_a_stop_waits_kill_wait_in_all_for_what_sigkill_does_not_end(monkeypatch, caplog):
    """The wait for a job stuck after SIGKILL (in a device driver) was KILL_WAIT on the job, then KILL_WAIT
    again on its tree; and a process /proc does not show (macOS: start "", an unreaped child that kill(pid, 0)
    finds) was waited on, and warned of, as one stuck."""
    from selfevo import _proc

    class Stuck:  # a job SIGKILL does not end
        pid, args, returncode = 4242, ["job"], None

        def wait(self, timeout=None):
            time.sleep(timeout)
            raise subprocess.TimeoutExpired(self.args, timeout)

    monkeypatch.setattr(_proc, "KILL_WAIT", 2.0)  # (the margins below hold on a loaded machine)
    monkeypatch.setattr(_proc, "_signal", lambda tree, signum: None)
    monkeypatch.setattr(_proc, "_running", lambda pid, start: True)
    monkeypatch.setattr(_proc, "process_tree", lambda *pids: {})
    with caplog.at_level("WARNING", logger="selfevo._proc"):
        start = time.monotonic()
        _proc._stop({4242: "77", 4243: "78"}, 0, Stuck())
        assert 1.9 < time.monotonic() - start < 3.5  # KILL_WAIT in all, not twice
        assert "pid 4242, 4243 still there 2 s after SIGKILL" in caplog.text
        caplog.clear()
        start = time.monotonic()
        _proc._stop({4244: ""}, 0)
        assert time.monotonic() - start < 1.5 and not caplog.records  # not waited on


def test_an_interrupt_during_the_stops_last_look_at_the_tree_still_kills(tmp_path, monkeypatch):
    """A third Ctrl-C landing while the stop looked for what the job started in its grace period skipped the
    SIGKILL: a job ignoring SIGTERM ran on."""
    from selfevo import _proc

    proc = _sleeper(tmp_path, "signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    try:
        tree = _proc.process_tree(proc.pid)

        def interrupted(*pids):
            raise KeyboardInterrupt

        monkeypatch.setattr(_proc, "process_tree", interrupted)
        with pytest.raises(KeyboardInterrupt):
            _proc._stop(tree, 0, proc)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_worker_started_since_the_last_look_is_stopped_with_the_job(tmp_path):
    """The tree is looked at again when the block ends (here the periodic look never comes): a worker
    in a session of its own, which the job started after the first look, is stopped too, though its
    parent's exit on SIGTERM leaves it with no parent link."""
    from selfevo._proc import running

    pidfile = tmp_path / "pid"
    worker = "import time; time.sleep(600)"
    server = ("import pathlib, subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True); "
              # written beside and renamed: the test reads it as soon as it exists, never half-written
              f"t = pathlib.Path({str(pidfile) + '.part'!r}); t.write_text(str(p.pid)); "
              f"t.replace({str(pidfile)!r}); time.sleep(600)")
    pid = None
    try:
        with running([sys.executable, "-c", server], grace=5, interval=600):
            _wait_for(pidfile)
            pid = int(pidfile.read_text())
        assert not _running(pid)
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_worker_started_during_the_grace_period_is_killed_with_the_job(tmp_path):
    """What the job starts while it ignores SIGTERM (a launcher's cleanup spawning a process) is found
    from the job again before the SIGKILL."""
    from selfevo._proc import running

    ready, pidfile = tmp_path / "ready", tmp_path / "pid"
    worker = "import time; time.sleep(600)"
    server = ("import pathlib, signal, subprocess, sys, time; "
              "signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path(" + repr(str(pidfile) + ".part") + ").write_text("
              f"str(subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True).pid)), "
              "pathlib.Path(" + repr(str(pidfile) + ".part") + ").replace(" + repr(str(pidfile)) + "))); "
              f"pathlib.Path({str(ready)!r}).write_text(''); time.sleep(600)")
    pid = None
    try:
        with running([sys.executable, "-c", server], grace=3.0, interval=600):  # time to spawn, under load too
            _wait_for(ready)
        pid = int(pidfile.read_text())
        assert not _running(pid)
    finally:
        if pid is None and pidfile.exists():
            pid = int(pidfile.read_text())
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_run_raises_for_a_job_killed_by_a_signal_and_passes_its_environment():
    from selfevo import _proc

    with pytest.raises(subprocess.CalledProcessError) as err:
        _proc.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert err.value.returncode == -signal.SIGKILL
    _proc.run([sys.executable, "-c", "import os, sys; sys.exit(os.environ.get('SELFEVO_PROC_T') != 'yes')"],
              env={**os.environ, "SELFEVO_PROC_T": "yes"})
