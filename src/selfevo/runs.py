"""Run directories: the resolved config, a manifest, append-only step records, per-round
evaluations, compute accounting and round checkpoints — and resuming from them.

    RUN_DIR/config.json              resolved config (a resumed run must match it)
    RUN_DIR/manifest.json            status, rounds completed, versions
    RUN_DIR/records/steps.jsonl      one line per scheduled step (append-only)
    RUN_DIR/eval/round-R.json        main solver on the seven benchmarks after round R (0 = base)
    RUN_DIR/eval/round-R.predictions.jsonl  per-item predictions of that evaluation
    RUN_DIR/compute.json             generations, updates per model, wall seconds per phase
    RUN_DIR/checkpoints/round-R.json every model's parameters after round R (JSON, no pickle)
    RUN_DIR/audit/metrics.json       written by `selfevo audit`
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from selfevo import __version__
from selfevo._io import append_jsonl, atomic_writer, read_json, read_jsonl_log, write_json, write_jsonl
from selfevo.records import SCHEMA_VERSION


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted paths of the fields where two configs differ."""
    out = []
    for key in sorted(set(a) | set(b)):
        x, y, path = a.get(key), b.get(key), f"{prefix}{key}"
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, path + ".")
        elif x != y:
            out.append(path)
    return out


def _with_new_defaults(saved: dict, current: dict, defaults: dict | None) -> dict:
    """`saved` with the fields it lacks (added to selfevo since the run was made) read as their
    defaults -- where the current config keeps the default, so the run means what it meant."""
    out = dict(saved)
    for key, value in current.items():
        default = defaults.get(key) if isinstance(defaults, dict) else None
        if key not in saved:
            if isinstance(defaults, dict) and key in defaults and default == value:
                out[key] = value
        elif isinstance(value, dict) and isinstance(saved[key], dict):
            out[key] = _with_new_defaults(saved[key], value, default)
    return out


class RunError(ValueError):
    """A run directory that cannot be used as asked (exists, mismatched config, incomplete)."""


class RunDir:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    # ---------------------------------------------------------------- paths
    @property
    def steps_path(self) -> Path:
        return self.path / "records" / "steps.jsonl"

    def eval_path(self, round: int) -> Path:
        return self.path / "eval" / f"round-{round}.json"

    def eval_predictions_path(self, round: int) -> Path:
        return self.path / "eval" / f"round-{round}.predictions.jsonl"

    def checkpoint_path(self, round: int) -> Path:
        return self.path / "checkpoints" / f"round-{round}.json"

    # ---------------------------------------------------------------- lifecycle
    def exists(self) -> bool:
        return (self.path / "manifest.json").exists()

    def create(self, config: dict) -> None:
        if self.exists():
            raise RunError(f"{self.path}: a run already exists here; pass --resume to continue it "
                           "or choose another --out")
        self.path.mkdir(parents=True, exist_ok=True)
        write_json(self.path / "config.json", config)
        self._write_manifest({"status": "running", "rounds_completed": 0, "created": time.time()})

    def open_for_resume(self, config: dict, defaults: dict | None = None) -> int:
        """Check the config matches, drop records after the last checkpoint; return the number
        of completed rounds (0 = nothing checkpointed yet). `defaults` (the config's default
        values) lets a run made before a field existed resume while that field keeps its default."""
        if not self.exists():
            raise RunError(f"{self.path}: no run to resume (no manifest.json)")
        config = json.loads(json.dumps(config))  # tuples -> lists, as saved
        defaults = json.loads(json.dumps(defaults)) if defaults is not None else None
        saved = _with_new_defaults(self._read_for_resume(self.path / "config.json"), config, defaults)
        if saved != config:
            diff = _differences(saved, config)
            raise RunError(f"{self.path}: config differs from the saved run (fields: {', '.join(diff)})")
        done = self._read_for_resume(self.path / "manifest.json").get("rounds_completed", 0)
        if done and not self.checkpoint_path(done).exists():
            raise RunError(f"{self.path}: manifest says round {done} is done but its checkpoint is missing")
        # a kill inside an atomic write leaves its temp file (`.NAME.XXXXXXXX.tmp`), never read: clear it
        for tmp in self.path.rglob(".*.tmp"):
            tmp.unlink(missing_ok=True)
        # a killed run may have logged steps of an unfinished round, and a torn last line
        try:
            rows = read_jsonl_log(self.steps_path, repair=True)
        except ValueError as e:  # corruption before the last line is no crash artefact: refuse
            raise RunError(f"{e}; refusing to resume over it") from None
        keep = [r for r in rows if r["round"] <= done]
        if len(keep) != len(rows):
            write_jsonl(self.steps_path, keep)
        return done

    @staticmethod
    def _read_for_resume(path: Path) -> dict:
        # written atomically, so unreadable only if changed by hand: one clear error, not a traceback
        try:
            data = read_json(path)
        except (OSError, ValueError) as e:
            raise RunError(f"{path}: unreadable ({e}); cannot resume") from None
        if not isinstance(data, dict):
            raise RunError(f"{path}: expected a JSON object; cannot resume")
        return data

    def manifest(self) -> dict:
        return read_json(self.path / "manifest.json")

    def _write_manifest(self, update: dict) -> None:
        path = self.path / "manifest.json"
        current = read_json(path) if path.exists() else {}
        current.update(update, schema=SCHEMA_VERSION, selfevo_version=__version__, updated=time.time())
        write_json(path, current)

    # ---------------------------------------------------------------- what the loop writes
    def append_steps(self, rows: list[dict]) -> None:
        append_jsonl(self.steps_path, rows)


    def checkpoint(self, round: int, state: dict) -> None:
        # checkpoint first, then the manifest: a kill between the two only repeats a round
        with atomic_writer(self.checkpoint_path(round)) as fh:
            json.dump(state, fh)
        write_json(self.path / "compute.json", state.get("compute", {}))
        self._write_manifest({"rounds_completed": round})

    def finish(self) -> None:
        self._write_manifest({"status": "complete"})

    def note(self, **fields) -> None:
        """Record extra facts in the manifest (timings, versions)."""
        self._write_manifest(fields)

    # ---------------------------------------------------------------- reading
    def steps(self) -> list[dict]:
        return read_jsonl_log(self.steps_path)

    def load_checkpoint(self, round: int) -> dict:
        return read_json(self.checkpoint_path(round))

    def config(self) -> dict:
        return read_json(self.path / "config.json")
