"""Kill -9 a running `selfevo evolve` at random points of its schedule, resume each run, and check
that nothing was lost or doubled: every resumed run must equal one uninterrupted run byte for byte
(step records, every evaluation, the audit, the models), and every record file must hold only whole,
distinct lines.

    python benchmarks/crash.py [--world default] [--kills 10] [--seed 0] [--points-seed 2024]
                               [--set KEY=VALUE ...] [--step-checkpoints N] [--out docs/reliability.md]

Kill points are spread over the whole schedule: the schedule's step lines (plus "before the first
step") are cut into `--kills` equal strata and one point is drawn from each, then the kill lands
0-10 ms (`--max-delay-ms`) after that many lines are on disk. Each process gets its own PYTHONHASHSEED, so a resumed
run also shows that nothing depends on string hashing. Writes the "## Kill -9 and resume" section
of docs/reliability.md. `tests/test_reliability.py` runs the same experiment on a small world.

With `--step-checkpoints N` the killed runs and their resumes write a checkpoint within each round
every N steps (`selfevo evolve --step-checkpoints`), and each resume must go on from the last one;
the uninterrupted run they are compared with writes none (its own section: "... with step checkpoints").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SECTION = "## Kill -9 and resume"
# files that must not depend on being killed (besides every eval/round-R*.json* and checkpoint)
COMPARED = ("records/steps.jsonl", "audit/metrics.json", "folds.json", "config.json")


class KillMissed(RuntimeError):
    """The child finished (or died) before the kill point: the kill proved nothing."""


def evolve_cmd(out: Path, world: str, seed: int, overrides: list[str], step_checkpoints: int | None = None
               ) -> list[str]:
    sets = [x for o in overrides for x in ("--set", o)]
    every = [] if step_checkpoints is None else ["--step-checkpoints", str(step_checkpoints)]
    return [sys.executable, "-m", "selfevo.cli", "evolve", "--out", str(out), "--world", world,
            "--seed", str(seed), *sets, *every]


def schedule_shape(world: str, seed: int, overrides: list[str]) -> tuple[int, int]:
    """(rounds, steps per round) of the run these arguments start."""
    from selfevo.config import load_config

    cfg = load_config(None, overrides, seed=seed, **{"world.name": world}).loop
    return cfg.rounds, cfg.proposer_steps + cfg.solver_steps


def kill_points(n: int, total_lines: int, rng: random.Random) -> list[int]:
    """`n` line counts spread over 0..total_lines: one uniform draw from each of n equal strata
    (0 = as soon as the run directory exists, i.e. during setup or the base evaluation)."""
    edges = [round(i * (total_lines + 1) / n) for i in range(n + 1)]
    return [rng.randrange(edges[i], max(edges[i] + 1, edges[i + 1])) for i in range(n)]


class _LineCounter:
    """Counts complete lines of a growing file, reading only what was appended since last time."""

    def __init__(self, path: Path):
        self.path, self.offset, self.lines = path, 0, 0

    def count(self) -> int:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return 0
        self.offset += len(chunk)
        self.lines += chunk.count(b"\n")
        return self.lines


def _env(hash_seed: int) -> dict:
    return {**os.environ, "PYTHONHASHSEED": str(hash_seed), "COLUMNS": "200"}


def run_to_completion(cmd: list[str], hash_seed: int, timeout: float = 600) -> None:
    res = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=_env(hash_seed), timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr[-2000:]}")


def _manifest_rounds(path: Path) -> int:
    try:
        return json.loads(path.read_bytes())["rounds_completed"]
    except (OSError, ValueError, KeyError):
        return -1


def run_and_kill(cmd: list[str], out: Path, target_lines: int | str, delay_s: float, hash_seed: int,
                 per_round: int, rounds: int, timeout: float = 600, step_checkpoints: int | None = None) -> dict:
    """Start `cmd`, SIGKILL it `delay_s` after `target_lines` step lines are on disk (0: after the
    manifest appears; "audit": after the manifest records the last round), and say where the kill
    landed."""
    steps = _LineCounter(out / "records" / "steps.jsonl")
    manifest = out / "manifest.json"
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(hash_seed))
    deadline = time.monotonic() + timeout
    try:
        while child.poll() is None and time.monotonic() < deadline:
            if target_lines == "audit":
                if _manifest_rounds(manifest) == rounds:
                    break
            elif (steps.count() >= target_lines) if target_lines else manifest.exists():
                break
            time.sleep(0.0005)
        if delay_s:
            time.sleep(delay_s)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
    if child.returncode != -signal.SIGKILL:
        raise KillMissed(f"{out}: the child exited {child.returncode} before the kill at line {target_lines}")
    data = (out / "records" / "steps.jsonl").read_bytes() if (out / "records" / "steps.jsonl").exists() else b""
    lines = data.count(b"\n")
    m = json.loads(manifest.read_text()) if manifest.exists() else {"rounds_completed": 0, "status": "none"}
    done = m["rounds_completed"]
    in_round = lines - done * per_round  # steps of the unfinished round already logged
    # where a resume goes on from: the round's start, or the step checkpoint the kill left (after a
    # step, or after an auxiliary solver's training), and the answers a killed evaluation kept
    ck = out / "checkpoints" / "step.json"
    state = json.loads(ck.read_text()) if ck.exists() else None
    checkpointed = (state["step"] - done * per_round if state is not None and state["round"] == done + 1
                    and "aux_trained" not in state else 0)  # steps of the round a step checkpoint holds
    if done == rounds:
        phase, rnd = "after the loop (audit)", "audit"
    elif lines == 0:
        phase, rnd = "setup / base evaluation", 1
    elif in_round >= per_round:
        phase, rnd = f"round {done + 1} evaluation / checkpoint", done + 1
    elif step_checkpoints and in_round % step_checkpoints == 0 and checkpointed < in_round:
        # a step is logged, then its checkpoint written: killed between the two
        phase, rnd = f"round {done + 1}, step {in_round}'s checkpoint", done + 1
    else:
        phase, rnd = f"round {done + 1}, step {in_round + 1} of {per_round}", done + 1
    if state is not None and state["round"] == done + 1:
        goes_on = f"round {state['round']} after step {state['step'] - (state['round'] - 1) * per_round}"
        if "aux_trained" in state:
            goes_on = f"round {state['round']} after auxiliary solver {state['aux_trained']}"
    else:
        goes_on = f"round {done + 1} start" if done < rounds else "the audit"
    for partial in (out / "eval").glob("round-*.partial.jsonl"):  # the one evaluation running, if any
        if partial.with_name(partial.name.replace(".partial.jsonl", ".json")).exists():
            continue  # a finished evaluation's answers, kept until the next checkpoint: a resume reads its JSON
        kept = partial.read_bytes().count(b"\n") - 1  # its first line names the model
        goes_on += f" (evaluation: {kept} answers kept)"
    return {"target_lines": target_lines, "delay_ms": round(delay_s * 1000, 1), "lines": lines,
            "torn_tail": bool(data) and not data.endswith(b"\n"), "rounds_completed": done,
            "round": rnd, "phase": phase, "goes_on_from": goes_on}


def check_records(run_dir: Path, allow_torn_logs: bool = False) -> list[str]:
    """Every problem with the run's files: a JSON file that does not parse, a JSONL line that does
    not parse or is unterminated, a step logged twice or out of order. A torn last line of an
    append-only log (the step log, an evaluation's answers so far) is a legal crash artefact before
    a resume (`allow_torn_logs`), never after."""
    problems = []
    steps_path = run_dir / "records" / "steps.jsonl"
    for path in sorted(run_dir.rglob("*.json")):
        try:
            json.loads(path.read_bytes())
        except ValueError as e:
            problems.append(f"{path}: does not parse ({e})")
    for path in sorted(run_dir.rglob("*.jsonl")):
        data = path.read_bytes()
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline
        if tail and not (allow_torn_logs and (path == steps_path or path.name.endswith(".partial.jsonl"))):
            problems.append(f"{path}: torn last line ({len(tail)} bytes without a newline)")
        rows = []
        for i, line in enumerate(lines, start=1):
            try:
                rows.append(json.loads(line))
            except ValueError:
                problems.append(f"{path}:{i}: does not parse")
        if path == steps_path:
            keys = [(r.get("round"), r.get("step")) for r in rows]
            dup = [k for k, c in Counter(keys).items() if c > 1]
            if dup:
                problems.append(f"{path}: steps logged twice: {dup[:5]}")
            if [r.get("step") for r in rows] != list(range(1, len(rows) + 1)):
                problems.append(f"{path}: steps not logged in order 1..{len(rows)}")
    return problems


def _model_state(path: Path) -> dict:
    state = json.loads(path.read_text())
    state.get("compute", {}).pop("seconds", None)  # wall time is the one thing allowed to differ
    return state


def compare_runs(run: Path, ref: Path) -> list[str]:
    """Files of `run` that differ from the uninterrupted `ref` (all must be byte-identical; the
    checkpoints must hold identical models and counts)."""
    rel = [*COMPARED, *sorted(str(p.relative_to(ref)) for p in (ref / "eval").iterdir())]
    bad = [f for f in rel if not (run / f).exists() or (run / f).read_bytes() != (ref / f).read_bytes()]
    for p in sorted((ref / "checkpoints").glob("round-*.json")):
        other = run / "checkpoints" / p.name
        if not other.exists() or _model_state(other) != _model_state(p):
            bad.append(f"checkpoints/{p.name}")
    return bad


def experiment(root: Path, world: str = "default", seed: int = 0, overrides: list[str] | None = None,
               kills: int = 10, points_seed: int = 2024, reference: Path | None = None,
               max_delay_s: float = 0.010, workers: int = 1, points: list[int | str] | None = None,
               step_checkpoints: int | None = None, log=print) -> dict:
    """The whole experiment; returns a summary (see `main` for its use). `points` replaces the
    random kill points (line counts, or "audit"); each then lands 0-`max_delay_s` later.
    `step_checkpoints`: the killed runs' (and their resumes') `--step-checkpoints`; the reference's
    is the default (none on the sim backend)."""
    overrides = list(overrides or [])
    load_average = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    rounds, per_round = schedule_shape(world, seed, overrides)
    started = time.perf_counter()
    if reference is None:
        reference = root / "reference"
        t = time.perf_counter()
        run_to_completion(evolve_cmd(reference, world, seed, overrides), hash_seed=0)
        log(f"uninterrupted run: {time.perf_counter() - t:.1f} s")
    rng = random.Random(points_seed)
    points = list(points) if points is not None else kill_points(kills, rounds * per_round, rng)
    delays = [rng.uniform(0, max_delay_s) for _ in points]

    def one(k: int) -> dict:
        out = root / f"killed-{k}"
        target, delay = points[k], delays[k]
        for _ in range(3):
            try:
                landing = run_and_kill(evolve_cmd(out, world, seed, overrides, step_checkpoints), out, target, delay,
                                       hash_seed=k + 1, per_round=per_round, rounds=rounds,
                                       step_checkpoints=step_checkpoints)
                break
            except KillMissed:
                # a point near the end can race the run's last milliseconds on a fast machine: start
                # over one line earlier and without the extra delay (the point is recorded as landed)
                shutil.rmtree(out, ignore_errors=True)
                target, delay = (max(0, target - 1) if isinstance(target, int) else target), 0.0
        else:
            raise KillMissed(f"{out}: three attempts to kill near line {points[k]} all finished first")
        before = check_records(out, allow_torn_logs=True)
        left_by_kill = [str(p.relative_to(out)) for p in out.rglob(".*.tmp")]
        t = time.perf_counter()
        run_to_completion(evolve_cmd(out, world, seed, overrides, step_checkpoints) + ["--resume"],
                          hash_seed=k + 101)
        resume_s = time.perf_counter() - t
        row = {**landing, "problems_after_kill": before, "problems_after_resume": check_records(out),
               "mismatches": compare_runs(out, reference), "resume_seconds": round(resume_s, 2),
               "temp_files_after_kill": left_by_kill,
               "temp_files_left": [str(p.relative_to(out)) for p in out.rglob(".*.tmp")]}
        log(f"kill {k + 1:2d}: {row['phase']:<38} lines {row['lines']:3d}{' torn' if row['torn_tail'] else ''}"
            f" | resumed in {resume_s:4.1f} s | mismatches {len(row['mismatches'])}, problems "
            f"{len(row['problems_after_kill']) + len(row['problems_after_resume'])}")
        return row

    # `workers` experiments at a time (each is its own pair of processes; the kill timing is per child)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(one, range(len(points))))
    per_round_counts = Counter(str(r["round"]) for r in results)
    return {
        "world": world, "seed": seed, "overrides": overrides, "points_seed": points_seed,
        "step_checkpoints": step_checkpoints,
        "rounds": rounds, "steps_per_round": per_round, "kills": results,
        "kills_per_round": dict(sorted(per_round_counts.items())),
        "all_matched": all(not r["mismatches"] and not r["problems_after_resume"]
                           and not r["problems_after_kill"] for r in results),
        "torn_tails": sum(r["torn_tail"] for r in results),
        "seconds": round(time.perf_counter() - started, 1), "workers": workers, "load_average": load_average,
    }


_HEADER = ("| kill | point (lines + delay) | landed in | lines on disk | resumes from | resume | vs uninterrupted "
           "| file problems | temp files |\n|---:|---|---|---|---|---:|---|---:|---:|")


def section_title(step_checkpoints: int | None) -> str:
    return SECTION if step_checkpoints is None else f"{SECTION}, with step checkpoints"


def _section(summary: dict, command: str) -> str:
    from _common import machine_line

    rows = "\n".join(
        f"| {i + 1} | {r['target_lines']} + {r['delay_ms']} ms | {r['phase']} | {r['lines']}"
        f"{' (torn tail)' if r['torn_tail'] else ''} | {r['goes_on_from']} | {r['resume_seconds']:.1f} s | "
        f"{'identical' if not r['mismatches'] else ', '.join(r['mismatches'])} | "
        f"{len(r['problems_after_kill']) + len(r['problems_after_resume'])} | {len(r['temp_files_left'])} |"
        for i, r in enumerate(summary["kills"]))
    per_round = ", ".join(f"{'round ' + k if k != 'audit' else 'audit'}: {v}"
                          for k, v in summary["kills_per_round"].items())
    n = len(summary["kills"])
    every = summary.get("step_checkpoints")
    step_note = ("" if every is None else
                 f"\nThe killed runs and their resumes write a step checkpoint every {every} step(s) of a round "
                 "(`--step-checkpoints`); the uninterrupted run writes none. \"Resumes from\": the checkpoint "
                 "the kill left, which the resume goes on from.")
    return f"""{section_title(every)}

- Command: `{command}` (from the repo root)
- Machine: {machine_line()}; load average {summary['load_average']} at the start (other work on the machine)
- Run: world `{summary['world']}`, seed {summary['seed']}, {summary['rounds']} rounds × {summary['steps_per_round']} \
steps{', ' + ' '.join(summary['overrides']) if summary['overrides'] else ''}; kill points drawn with seed \
{summary['points_seed']}; whole experiment {summary['seconds']:.0f} s.{step_note}

**{n} kills, {n} resumes, {'all' if summary['all_matched'] else 'NOT all'} identical to the uninterrupted run.**
Kills per round: {per_round}. Torn last lines left by a kill: {summary['torn_tails']}.
Compared byte for byte: `records/steps.jsonl`, `audit/metrics.json`, `folds.json`, `config.json`, every
`eval/round-R.json` and `eval/round-R.predictions.jsonl`; the checkpoints' models and counts (not their
wall seconds). Checked in every file: each `*.json` parses, each `*.jsonl` line parses and ends in a
newline, no (round, step) twice, steps in order.

{_HEADER}
{rows}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", default="default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--points-seed", type=int, default=2024)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "reliability.md")
    ap.add_argument("--workers", type=int, default=1, help="experiments at a time")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    ap.add_argument("--step-checkpoints", type=int, default=None,
                    help="the killed runs' `selfevo evolve --step-checkpoints` (default: none)")
    ap.add_argument("--max-delay-ms", type=float, default=10.0,
                    help="a kill lands 0 to this many ms after its line (with step checkpoints, make it longer "
                         "than a step and its checkpoint's write, so kills land in both)")
    args = ap.parse_args()
    from _common import run_root, write_section

    with run_root(args.keep) as root:
        summary = experiment(root, args.world, args.seed, args.overrides, args.kills, args.points_seed,
                             workers=args.workers, step_checkpoints=args.step_checkpoints,
                             max_delay_s=args.max_delay_ms / 1000)
    print(json.dumps({k: v for k, v in summary.items() if k != "kills"}, indent=2))
    command = "python benchmarks/crash.py" + "".join(
        f" --{k} {v}" for k, v in (("world", args.world), ("seed", args.seed), ("kills", args.kills),
                                   ("points-seed", args.points_seed))) + "".join(f" --set {o}" for o in args.overrides)
    if args.step_checkpoints is not None:
        command += f" --step-checkpoints {args.step_checkpoints}"
    if args.max_delay_ms != 10.0:
        command += f" --max-delay-ms {args.max_delay_ms:g}"
    title = section_title(args.step_checkpoints)
    write_section(args.out, title, _section(summary, command), title="# Reliability")
    print(f"wrote {title!r} to {args.out}")
    sys.exit(0 if summary["all_matched"] else 1)


if __name__ == "__main__":
    main()
