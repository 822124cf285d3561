"""Run directories: the resolved config, a manifest, append-only step records, per-round
evaluations, compute accounting and round checkpoints — and resuming from them.

    RUN_DIR/config.json              resolved config (a resumed run must match it)
    RUN_DIR/manifest.json            status, rounds completed, the software it was made (and resumed) with
    RUN_DIR/records/steps.jsonl      one line per scheduled step (append-only)
    RUN_DIR/eval/round-R.json        main solver on the seven benchmarks after round R (0 = base)
    RUN_DIR/eval/round-R.predictions.jsonl  per-item predictions of that evaluation
    RUN_DIR/eval/round-R.partial.jsonl      the answers so far of that evaluation until the round's
                                            checkpoint (a killed run's resume goes on from them)
    RUN_DIR/compute.json             generations by purpose (evaluation too), updates per model, wall seconds per phase
    RUN_DIR/checkpoints/round-R.json every model's parameters after round R (JSON, no pickle)
    RUN_DIR/checkpoints/step.json    the latest checkpoint within the round running (`evolve
                                     --step-checkpoints`: after steps, and after each auxiliary
                                     solver's training; gone once the round's own is written)
    RUN_DIR/audit/metrics.json       the audit: written when a run ends (evolve, engine-run), again by `selfevo audit`
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

from selfevo import __version__
from selfevo._io import (
    append_jsonl,
    atomic_writer,
    hold_directory,
    read_json,
    read_jsonl_log,
    remove_leftover_temps,
    write_json,
    write_jsonl,
)
from selfevo._software import SoftwareChanged, software, software_changes
from selfevo.config import ConfigError, RunConfig, config_from_dict, with_absolute_paths
from selfevo.records import SCHEMA_VERSION


def differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted paths of the fields where two configs differ."""
    out = []
    for key in sorted(set(a) | set(b)):
        x, y, path = a.get(key), b.get(key), f"{prefix}{key}"
        if isinstance(x, dict) and isinstance(y, dict):
            out += differences(x, y, path + ".")
        elif x != y:
            out.append(path)
    return out


def with_new_defaults(saved: dict, current: dict, defaults: dict | None) -> dict:
    """`saved` with the fields it lacks (added to selfevo since the run was made) read as their
    defaults -- where the current config keeps the default, so the run means what it meant."""
    out = dict(saved)
    for key, value in current.items():
        default = defaults.get(key) if isinstance(defaults, dict) else None
        if key not in saved:
            if isinstance(defaults, dict) and key in defaults and default == value:
                out[key] = value
        elif isinstance(value, dict) and isinstance(saved[key], dict):
            out[key] = with_new_defaults(saved[key], value, default)
    return out


def made_on(manifest: dict) -> dict:
    """What a run's records are about beyond its config (from its manifest): the sha256 of the world
    directory, of the corpus and of the QA directory it was made on (None where the config alone fixes
    them: a generated world)."""
    return {"world_sha256": manifest.get("world_sha256"), "corpus_sha256": manifest.get("corpus_sha256"),
            "qa_sha256": manifest.get("qa_sha256")}


class RunError(ValueError):
    """A run directory that cannot be used as asked (exists, mismatched config, incomplete,
    damaged); the message names the file (and line) at fault."""


class ConfigDiffers(RunError):
    """A config other than the run's own, for a run that must keep it (a resume); names the fields."""


# a manifest fact: the run's admission read truth (benchmarks/downstream.py's ceiling arm, whose
# oracle withholds wrong labels); its config says `coupled` as the loop's own runs do
ORACLE_ADMISSION = "oracle_admission"


def check_loop_run(manifest: dict, path, rounds: int | None = None) -> None:
    """Refuse a run whose admission read truth: no run of the loop (its agents were told which labels
    are wrong), so no report, comparison or replay bank may take it for one. With `rounds` (its config's),
    refuse one marked complete with another number of rounds done (edited or damaged): its last
    evaluation would be paired with the other runs' last round."""
    if manifest.get(ORACLE_ADMISSION):
        raise RunError(f"{path}: its admission was decided by the oracle (a diagnostic ceiling, manifest field "
                       f"{ORACLE_ADMISSION!r}), not by the loop's rules: it is no run of the loop to report, "
                       "compare or build a replay bank from")
    done = manifest.get("rounds_completed", 0)
    if rounds is not None and manifest.get("status") == "complete" and done != rounds:
        raise RunError(f"{Path(path) / 'manifest.json'}: status 'complete' with {done} round(s) done, but its "
                       f"config runs {rounds}: its last evaluation would be paired with the other runs' last round")


_TYPE_NAMES = {int: "an integer", str: "a string", bool: "true/false", list: "a list", dict: "an object",
               (int, float): "a number"}

# What the readers of a step record (audit, replay, resume) rely on. The loop and the engine
# integrations write more; only these are checked, so a damaged row is an error naming the line
# and field instead of a KeyError deep inside a reader.
_STEP_FIELDS = {"round": int, "step": int, "kind": str, "items": list}
_ITEM_FIELDS = {"item_id": str, "source_id": str, "source_ids": list, "hops": int, "question": str,
                "draft_label": str, "adopted_label": str, "admitted": bool, "responses": list}
# an admitted candidate in a step checkpoint's pool (loop.engine.Candidate.to_json)
_POOL_FIELDS = {"item_id": str, "question": str, "draft_label": str, "source_id": str, "source_ids": list,
                "hops": int, "fold": int, "source_folds": list, "admitted": bool, "label": str, "detail": dict,
                "round": int, "step": int}
_FOLDS_FIELDS = {"k": int, "seed": int, "grouping": str, "folds": dict, "groups": dict}
_COMPUTE_FIELDS = {"generations": dict, "updates": dict, "seconds": dict, "total_generations": int,
                   "total_updates": int}


def check_fields(obj: dict, fields: dict, where: str, optional: bool = False) -> None:
    """Each field of `fields` is in `obj` (unless `optional`) with the named type."""
    for key, typ in fields.items():
        if key not in obj:
            if optional:
                continue
            raise RunError(f"{where}: field {key!r} is missing")
        value = obj[key]
        if not isinstance(value, typ) or (typ is not bool and isinstance(value, bool)):  # True is an int
            raise RunError(f"{where}: field {key!r} should be {_TYPE_NAMES[typ]}, got {value!r:.60}")


def read_object(path: Path) -> dict:
    """A JSON file of a run directory (or one a study wrote beside its runs). Written atomically,
    so a bad one was edited or damaged on disk: one error naming the file, not a traceback."""
    try:
        data = read_json(path)
    except FileNotFoundError:
        raise RunError(f"{path}: missing") from None
    except OSError as e:
        raise RunError(f"{path}: unreadable ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, absurd nesting
        raise RunError(f"{path}: unreadable, not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise RunError(f"{path}: expected a JSON object, got a JSON {type(data).__name__}")
    return data


def _check_steps(path: Path, rows: list) -> list[dict]:
    """Step records as the loop writes them. read_jsonl_log keeps every line but a torn last one,
    so row i is line i + 1."""
    for i, row in enumerate(rows):
        where = f"{path}:{i + 1}"  # rows are objects: read_jsonl_log refuses any other line
        check_fields(row, _STEP_FIELDS, where)
        if row.get("schema") != SCHEMA_VERSION:  # records.py: a reader refuses records it does not understand
            said = "is missing" if "schema" not in row else f"is {row['schema']!r:.20}"
            raise RunError(f"{where}: field 'schema' {said}; this selfevo reads step records of schema "
                           f"{SCHEMA_VERSION}")
        if row["kind"] not in ("proposer", "solver"):
            raise RunError(f"{where}: field 'kind' should be proposer or solver, got {row['kind']!r:.60}")
        check_fields(row, {"malformed": list}, where, optional=True)
        for j, it in enumerate(row["items"]):
            at = f"{where}: items[{j}]"
            if not isinstance(it, dict):
                raise RunError(f"{at}: expected an object, got {type(it).__name__}")
            check_fields(it, _ITEM_FIELDS, at)
            for key in ("responses", "source_ids"):
                if not all(isinstance(x, str) for x in it[key]):
                    raise RunError(f"{at}: field {key!r} should be a list of strings")
    return rows


def check_numbers(obj, keys: Sequence[str], where: str) -> None:
    """Each of `keys` is in `obj` (an object) as a finite number or null (a metric with nothing to
    measure). NaN and Infinity, which Python's JSON reader takes, are no number a run writes: a report
    skipped a NaN seed without a word."""
    if not isinstance(obj, dict):
        raise RunError(f"{where}: should be an object, got {obj!r:.60}")
    for key in keys:
        value = obj.get(key, "missing")
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not math.isfinite(value)):
            raise RunError(f"{where}.{key} should be a finite number or null, got {value!r:.60}")


_EVAL_GROUPS = ("macro", "single_hop", "multi_hop")

# what a run directory holds before its manifest makes it a run: the config (`RunDir.create`) and
# engine-run's engine/engine.json, left by a start killed before the manifest was written
_BEFORE_MANIFEST = ("config.json", "engine")


def config_json(cfg: RunConfig) -> dict:
    """A run's config as plain JSON, as config.json holds it (tuples as lists)."""
    return json.loads(json.dumps(cfg.to_json()))


def tensor_files(state) -> set[str]:
    """The tensor files (checkpoints/tensors/) a checkpoint's state references: language-model
    policies are saved there and referenced as {"file", "sha256", ...}. Only containers are
    visited: a sim learner's state holds long lists of numbers."""
    found, todo = set(), [state]
    while todo:
        obj = todo.pop()
        values = obj.values() if isinstance(obj, dict) else obj
        if isinstance(obj, dict) and isinstance(obj.get("file"), str) and "sha256" in obj:
            found.add(obj["file"])
        todo.extend(v for v in values if isinstance(v, (dict, list)))
    return found


class RunDir:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        # set by open_for_resume: the step checkpoint the resumed round goes on from (None: its start)
        self.step_state: dict | None = None
        self._step_tensors: set[str] | None = None  # what the step checkpoint on disk references

    # ---------------------------------------------------------------- paths
    @property
    def steps_path(self) -> Path:
        return self.path / "records" / "steps.jsonl"

    def eval_path(self, round: int) -> Path:
        return self.path / "eval" / f"round-{round}.json"

    def eval_predictions_path(self, round: int) -> Path:
        return self.path / "eval" / f"round-{round}.predictions.jsonl"

    def eval_partial_path(self, round: int) -> Path:
        return self.path / "eval" / f"round-{round}.partial.jsonl"

    def checkpoint_path(self, round: int) -> Path:
        return self.path / "checkpoints" / f"round-{round}.json"

    @property
    def step_checkpoint_path(self) -> Path:
        return self.path / "checkpoints" / "step.json"

    @property
    def tensors_dir(self) -> Path:
        """Where language-model policies are saved (a sim run has none: its learners are JSON)."""
        return self.path / "checkpoints" / "tensors"

    # ---------------------------------------------------------------- lifecycle
    def exists(self) -> bool:
        """A run's manifest.json is here: an index's or another tool's (no run status) is no run, which
        would be told to resume, then to remove the directory."""
        path = self.path / "manifest.json"
        if not path.is_file():
            return False
        try:
            m = json.loads(path.read_bytes())
        except ValueError:
            return True  # a run's, damaged: resume and audit say so, naming it
        return not isinstance(m, dict) or "rounds_completed" in m or "status" in m

    def check_new(self) -> None:
        """Refuse a place a new run cannot go: an existing run (never overwritten), a file, or a
        directory of other files (a run would write its config.json, records/, eval/... among them:
        a user's config.json replaced, a world directory filled with a run). What a start killed before
        its manifest leaves is no obstacle: the new start writes it again. Cheap, so a caller can check
        before the slow start-up (a model load) it would waste."""
        if self.exists():
            raise RunError(f"{self.path}: a run already exists here; pass --resume to continue it "
                           "or choose another --out")
        self._refuse_file()
        if not self.path.is_dir():
            return
        other = sorted(p.name for p in self.path.iterdir()
                       if p.name not in _BEFORE_MANIFEST and not (p.name.startswith(".") and p.name.endswith(".tmp")))
        if not other and (self.path / "config.json").exists():  # a run's, or a file of the same name
            try:
                if "treatment" not in read_object(self.path / "config.json"):
                    other = ["config.json"]
            except RunError:
                other = ["config.json"]
        if other:
            raise RunError(f"{self.path}: not empty and holds no run (it has {', '.join(other[:3])}"
                           f"{', ...' if len(other) > 3 else ''}); a new run goes into a new or empty directory: "
                           "choose another --out")

    def _refuse_file(self) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise RunError(f"{self.path}: not a directory; choose another --out")

    @contextlib.contextmanager
    def lock(self):
        """Hold the run directory for this process while it writes the run: a second writer (an
        `evolve --resume` of a run still going, a grid rerun beside the workers of one killed) is a
        RunError, not records of two processes interleaved. Released when the process ends, however."""
        self._refuse_file()
        with hold_directory(self.path, lambda: RunError(f"{self.path}: another process is writing this run; wait "
                                                        "for it to end (or stop it), then rerun")):
            yield

    def create(self, config: dict, **facts) -> None:
        """`facts`: what else the manifest records from the start (a user's learners and rules: in the one
        write, so that no stop leaves a run that cannot say what made it)."""
        self.check_new()
        self.path.mkdir(parents=True, exist_ok=True)
        remove_leftover_temps(self.path, recursive=True)  # of a start killed before its manifest
        write_json(self.path / "config.json", config)
        self._write_manifest({"status": "running", "rounds_completed": 0, "created": time.time(),
                              "software": software(), **facts})

    def open_for_resume(self, config: dict, defaults: dict | None = None) -> int:
        """Check the config matches, drop records after the last checkpoint; return the number of
        completed rounds (0 = nothing checkpointed yet). `defaults` (the config's default values) lets
        a run made before a field existed resume while that field keeps its default. The caller calls
        `check_software` once its own checks pass: a refused resume has not resumed."""
        if not self.exists():
            raise RunError(f"{self.path}: no run to resume (no run manifest.json)")
        done = None
        try:
            done = self.manifest().get("rounds_completed", 0)
            self.check_config(config, defaults)
        except RunError as e:
            # e.g. a first start that failed in its round-0 evaluation (out of memory), retried with a
            # smaller batch: the directory holds no finished round, so say how to start over
            hint = (f" (no round of it finished: remove {self.path} to start afresh with this config)"
                    if done == 0 else "")
            raise type(e)(f"{e}; cannot resume{hint}") from None  # a ConfigDiffers stays one
        if done and not self.checkpoint_path(done).exists():
            raise RunError(f"{self.path}: manifest says round {done} is done but its checkpoint is missing")
        remove_leftover_temps(self.path, recursive=True)  # a kill inside an atomic write leaves one
        # a killed run may have logged steps of an unfinished round, and a torn last line
        try:
            rows = _check_steps(self.steps_path, read_jsonl_log(self.steps_path, repair=True))
        except ValueError as e:  # corruption before the last line is no crash artefact: refuse
            raise RunError(f"{e}; refusing to resume over it") from None
        self.step_state = self._resumable_step(done, rows)
        self._drop_unreferenced_tensors()
        last = self.step_state["step"] if self.step_state is not None else 0
        keep = [r for r in rows if r["round"] <= done or (r["round"] == done + 1 and r["step"] <= last)]
        if len(keep) != len(rows):
            write_jsonl(self.steps_path, keep)
        return done

    def _resumable_step(self, done: int, rows: list[dict]) -> dict | None:
        """The step checkpoint of round done + 1, checked, or None (there is none; or it is stale:
        a kill after the round's own checkpoint, before it was removed)."""
        path = self.step_checkpoint_path
        if not path.exists():
            return None
        state = read_object(path)
        check_fields(state, {"round": int, "step": int, "proposer": dict, "main": dict, "compute": dict,
                             "pool": list}, str(path))
        # written after an auxiliary solver's training: those trained so far, in the feedback's state
        check_fields(state, {"aux_trained": int, "feedback": dict}, str(path), optional=True)
        if state["round"] <= done:
            self._drop_step_checkpoint()
            return None
        want = [s for s in self._schedule() if s[0] == done + 1 and s[1] <= state["step"]]
        if state["round"] != done + 1 or not want or want[-1][1] != state["step"]:
            raise RunError(f"{path}: a checkpoint of round {state['round']} step {state['step']}, but the run has "
                           f"{done} round(s) done and its schedule has no such step next; remove it to redo round "
                           f"{done + 1} from its start")
        got = [(r["round"], r["step"], r["kind"]) for r in rows
               if r["round"] == done + 1 and r["step"] <= state["step"]]
        if got != want:  # the log lost steps the checkpoint counts: the round is redone from its start
            warnings.warn(f"{path}: the step records hold {len(got)} of the {len(want)} steps of round {done + 1} "
                          "it was written after; the round is redone from its start", stacklevel=3)
            self._drop_step_checkpoint()
            return None
        for i, c in enumerate(state["pool"]):
            if not isinstance(c, dict):
                raise RunError(f"{path}: pool[{i}]: expected an object, got {type(c).__name__}")
            check_fields(c, _POOL_FIELDS, f"{path}: pool[{i}]")
        return state

    def check_config(self, config: dict, defaults: dict | None = None) -> None:
        """Refuse (RunError naming the fields) a config other than the one this run was made with;
        `defaults` as for open_for_resume."""
        config = json.loads(json.dumps(config))  # tuples -> lists, as saved
        defaults = json.loads(json.dumps(defaults)) if defaults is not None else None
        # the saved config as written (not config()'s parse): a field since removed from selfevo is
        # then named as a difference
        saved = with_new_defaults(with_absolute_paths(read_object(self.path / "config.json")), config, defaults)
        if saved != config:
            diff = differences(saved, config)
            raise ConfigDiffers(f"{self.path}: config differs from the saved run (fields: {', '.join(diff)})")

    def check_software(self) -> None:
        """On resume: warn (SoftwareChanged) if this process runs other software than the run was
        made with, and record it in the manifest's "software_resumed": what it writes from here on
        may differ from what an uninterrupted run would have written. A run made before runs
        recorded their software is not checked."""
        m = self.manifest()
        if "software" not in m:
            return
        now = software()
        if changes := software_changes(m["software"], now):
            resumed = [*m.get("software_resumed", []), {"rounds_completed": m.get("rounds_completed", 0),
                                                        "at": time.time(), "software": now}]
            self._write_manifest({"software_resumed": resumed})
            warnings.warn(SoftwareChanged(
                f"{self.path}: resumed under other software than it was made with ({'; '.join(changes)}); "
                "what it writes from here on may differ from an uninterrupted run's "
                "(manifest.json: software_resumed)"), stacklevel=2)

    def manifest(self) -> dict:
        path = self.path / "manifest.json"
        m = read_object(path)
        check_fields(m, {"status": str, "rounds_completed": int, "software": dict, "software_resumed": list},
                     str(path), optional=True)
        if m.get("rounds_completed", 0) < 0:
            raise RunError(f"{path}: field 'rounds_completed' should be >= 0, got {m['rounds_completed']}")
        return m

    def _write_manifest(self, update: dict) -> None:
        path = self.path / "manifest.json"
        current = self.manifest() if path.exists() else {}
        current.update(update, schema=SCHEMA_VERSION, selfevo_version=__version__, updated=time.time())
        write_json(path, current)

    # ---------------------------------------------------------------- what the loop writes
    def append_steps(self, rows: list[dict]) -> None:
        append_jsonl(self.steps_path, rows)


    def checkpoint(self, round: int, state: dict) -> None:
        # checkpoint first, then the manifest: a kill between the two only repeats a round (from its
        # step checkpoint, removed last)
        with atomic_writer(self.checkpoint_path(round)) as fh:
            fh.write(json.dumps(state))  # dumps: json.dump encodes in Python, several times slower
        write_json(self.path / "compute.json", state.get("compute", {}))
        self._write_manifest({"rounds_completed": round})
        self._drop_step_checkpoint()
        for r in range(round + 1):  # the answers of the evaluations now recorded (kept till here: a kill
            self.eval_partial_path(r).unlink(missing_ok=True)  # before it asks none of them again)

    def step_checkpoint(self, state: dict) -> None:
        """The latest checkpoint within a round (`Loop.step_checkpoints`), replacing the one before;
        the tensor files only the replaced one referenced are removed once it is replaced."""
        old = self._step_tensor_files()
        with atomic_writer(self.step_checkpoint_path) as fh:
            fh.write(json.dumps(state))
        self._step_tensors = self._tensor_refs(state)
        self._drop_tensors(old - self._step_tensors)

    def _tensor_refs(self, state) -> set[str]:
        """tensor_files(state), not walked where the run has no tensor files (a sim state's long lists)."""
        return tensor_files(state) if self.tensors_dir.is_dir() else set()

    def _step_tensor_files(self) -> set[str]:
        if self._step_tensors is None:
            path = self.step_checkpoint_path
            self._step_tensors = self._tensor_refs(read_json(path)) if path.exists() else set()
        return self._step_tensors

    def _drop_step_checkpoint(self) -> None:
        if not self.step_checkpoint_path.exists():
            return
        old = self._step_tensor_files()
        self.step_checkpoint_path.unlink()
        self._step_tensors = set()
        self._drop_tensors(old)

    def _round_tensor_files(self) -> set[str]:
        return set().union(*(tensor_files(read_json(p)) for p in (self.path / "checkpoints").glob("round-*.json")))

    def _drop_unreferenced_tensors(self) -> None:
        """On resume: remove tensor files no checkpoint references, which a kill between a step
        checkpoint's replacement and the removal of the files only the replaced one referenced leaves
        (each a policy's weights: gigabytes at 4B)."""
        if not self.tensors_dir.is_dir():
            return
        self._step_tensors = None  # read again: the file on disk is what a resume goes on from
        kept = self._round_tensor_files() | self._step_tensor_files()
        for path in self.tensors_dir.iterdir():
            if path.is_file() and path.name not in kept:
                path.unlink()

    def _drop_tensors(self, files: set[str]) -> None:
        """Remove tensor files that no round checkpoint references (a step checkpoint's, replaced)."""
        if not files:
            return
        kept = self._round_tensor_files()
        for name in sorted(files - kept):
            (self.tensors_dir / name).unlink(missing_ok=True)

    def finish(self) -> None:
        self._write_manifest({"status": "complete"})
        for path in (self.path / "eval").glob("round-*.partial.jsonl"):  # a kill after a checkpoint, before
            path.unlink(missing_ok=True)  # its removal, left one (its evaluation is recorded)

    def note(self, **fields) -> None:
        """Record extra facts in the manifest (timings, versions)."""
        self._write_manifest(fields)

    # ---------------------------------------------------------------- reading
    # One checking reader per file kind: a damaged file is a RunError naming it (and the line
    # and field), whichever command reads it.
    def steps(self) -> list[dict]:
        try:
            rows = read_jsonl_log(self.steps_path)
        except ValueError as e:  # a corrupt line before the last (a torn last line is dropped)
            raise RunError(str(e)) from None
        rows = _check_steps(self.steps_path, rows)
        if self.exists() and (m := self.manifest()).get("status") == "complete":
            self._check_whole(rows, m)
        return rows

    def _check_whole(self, rows: list[dict], manifest: dict) -> None:
        """A finished run's log holds every step it ran: a torn last line (dropped by the reader) or
        missing rows are damage done after the run ended, and an audit of what is left would pass
        for the run's. (A crash's torn line is cut on resume, before the run can finish.)"""
        path = self.steps_path
        damaged = f"in a run marked complete: the log was damaged after the run ended; restore {path}"
        if path.exists() and path.stat().st_size:
            with open(path, "rb") as fh:
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    raise RunError(f"{path}:{len(rows) + 1}: the last line is cut short, {damaged}")
        if "engine" in manifest:  # engine-run logs the steps its trainers ran, not the loop's schedule
            return
        done = manifest.get("rounds_completed", 0)
        want = [s for s in self._schedule() if s[0] <= done]
        got = [(r["round"], r["step"], r["kind"]) for r in rows]
        if want and not path.exists():
            raise RunError(f"{path}: missing in a run marked complete (removed after the run ended?); restore it")
        if got != want:
            line = next((i + 1 for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)) + 1)
            raise RunError(f"{path}:{line}: {len(got)} step records where the schedule of the {done} round(s) done "
                           f"has {len(want)}, {damaged}")

    def _schedule(self) -> list[tuple[int, int, str]]:
        """(round, step, kind) of every step the run's loop schedules, as its records name them."""
        from selfevo.loop.schedule import LoopConfig, schedule

        return [(s.round, s.step, s.kind) for s in schedule(LoopConfig(**self.config()["loop"]))]

    def load_checkpoint(self, round: int) -> dict:
        return read_object(self.checkpoint_path(round))

    def users_treatment(self, config: dict | None = None) -> str | None:
        """The treatment of a user's the run was made with (the manifest names its rules), else None (and for
        a damaged or missing manifest: its reader's to name, not the config's). `config`: config.json's
        object, where the caller has read it."""
        try:
            if not isinstance(self.manifest().get("rules"), str):
                return None
            name = (read_object(self.path / "config.json") if config is None else config).get("treatment")
        except (ValueError, OSError):
            return None
        return name if isinstance(name, str) else None

    def run_config(self) -> RunConfig:
        """The saved config, parsed as `selfevo evolve` would (a field added to selfevo since the run was made
        reads as its default); a user's treatment whose rules the manifest names is read without its package."""
        path = self.path / "config.json"
        data = read_object(path)
        try:
            return config_from_dict(data, recorded=self.users_treatment(data) is not None)
        except ConfigError as e:
            raise RunError(f"{path}: {e}") from None

    def config(self) -> dict:
        """`run_config()` as plain JSON."""
        return config_json(self.run_config())

    def folds(self) -> dict:
        """folds.json (see `selfevo.loop.folds.FoldAssignment.from_json`)."""
        path = self.path / "folds.json"
        data = read_object(path)
        check_fields(data, _FOLDS_FIELDS, str(path))
        return data

    def evaluation(self, round: int) -> dict:
        """eval/round-N.json: Cover-EM per benchmark and of the macro, single- and multi-hop averages
        (what the report and compare read of it, checked)."""
        path = self.eval_path(round)
        data = read_object(path)
        check_fields(data, {"benchmarks": dict}, str(path))
        for b, row in data["benchmarks"].items():
            check_numbers(row, ("cover_em",), f"{path}: field benchmarks.{b}")
        for group in _EVAL_GROUPS:
            check_numbers(data.get(group), ("cover_em",), f"{path}: field {group}")
        return data

    def recorded_evaluation(self, round: int) -> dict | None:
        """eval/round-N.json where it is whole (its question count, which compute.json counts, written), for
        a resumed run to take instead of evaluating again; else None."""
        if not self.eval_path(round).exists():
            return None
        made = self.evaluation(round)
        return made if isinstance(made.get("run"), dict) and isinstance(made["run"].get("questions"), int) else None

    def audit_metrics(self) -> dict:
        """audit/metrics.json: the audit's metrics by round and by step, checked."""
        from selfevo.audit import METRICS

        path = self.path / "audit" / "metrics.json"
        data = read_object(path)
        check_fields(data, {"rounds": list, "steps": list}, str(path))
        check_fields(data, {"judge": str}, str(path), optional=True)
        for part, fields in (("rounds", {"round": int}), ("steps", {"round": int, "step": int, "kind": str})):
            for i, row in enumerate(data[part]):
                where = f"{path}: field {part}[{i}]"
                check_numbers(row, METRICS, where)
                check_fields(row, fields, where)
                if part == "rounds":
                    check_numbers(row, ("admitted",), where)
                    mix = row.get("hop_mix_admitted", {})
                    if not isinstance(mix, dict) or not all(h.isascii() and h.isdigit() for h in mix):
                        raise RunError(f"{where}.hop_mix_admitted should be an object keyed by hop count, "
                                       f"got {mix!r:.60}")
                    check_numbers(mix, list(mix), f"{where}.hop_mix_admitted")
        return data

    def engine_setting(self) -> dict | None:
        """An engine-run's [engine] table (engine/engine.json) but where it ran
        (`integrations.engine.computed_setting`); None for an `evolve` run."""
        path = self.path / "engine" / "engine.json"
        if not path.exists():
            return None
        from selfevo.integrations.engine import computed_setting

        return computed_setting(read_object(path))

    def audit_setting(self) -> dict:
        """What an audit's numbers depend on besides the records (audit/judge.json): the judge's prompt
        version and whether it read only the first items of every step (`--max-items-per-step`)."""
        path = self.path / "audit" / "judge.json"
        judge = read_object(path) if path.exists() else {}
        return {"prompt_version": judge.get("prompt_version"), "max_items_per_step": judge.get("max_items_per_step")}

    def compute(self) -> dict:
        """compute.json: generations, updates and seconds by key, and the two totals."""
        path = self.path / "compute.json"
        data = read_object(path)
        check_fields(data, _COMPUTE_FIELDS, str(path))
        # what `compare` and the report sum: counts and seconds, none below 0 (a NaN fails the comparison)
        fields = [(f"{key}.{name}", value) for key in ("generations", "updates", "seconds")
                  for name, value in data[key].items()]
        for field, value in [*fields, ("total_generations", data["total_generations"]),
                             ("total_updates", data["total_updates"])]:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise RunError(f"{path}: field {field} should be a number, got {value!r:.60}")
            if not 0 <= value < math.inf:
                raise RunError(f"{path}: field {field} should be a finite number >= 0, got {value!r}")
        return data
