"""The language-model backend's tiny CrossFit run on the real corpus, as docs/lm.md gives it to a user:

    selfevo evolve --config configs/lm-tiny.toml --backend lm --model smollm2-135m \
        --corpus ../shared/data/corpus/wiki18-mini.jsonl --treatment crossfit --out OUT

timed from a fresh output directory (wall clock and the largest resident set of the command's process
tree), and what its run directory says it did: proposals, well-formed and why not, admitted, updates
per model, who graded round 2's questions, the loop's seconds per phase, the audit's coverage. The
numbers measure the plumbing on a 135M model, not the method.

    python benchmarks/lm_tiny.py [--corpus PATH] [--qa-dir DIR] [--keep DIR]

Writes the block between `<!-- lm-tiny -->` and `<!-- /lm-tiny -->` of docs/lm.md ("Measured").
`--keep DIR` keeps the run there, and a second call with the same DIR reads it instead of running again.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from _common import REPO, machine_line, write_block

from selfevo._software import software
from selfevo.runs import RunDir

SHARED = REPO.parent / "shared" / "data"


def run_tiny(corpus: Path, qa_dir: Path, out: Path) -> dict:
    """The command as docs/lm.md writes it; its wall seconds and peak RSS (MiB, the largest process)."""
    cmd = [sys.executable, "-m", "selfevo.cli", "evolve", "--config", str(REPO / "configs" / "lm-tiny.toml"),
           "--backend", "lm", "--model", "smollm2-135m", "--corpus", str(corpus), "--qa-dir", str(qa_dir),
           "--treatment", "crossfit", "--out", str(out)]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    return {"wall_s": time.perf_counter() - start,
            "max_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024}


def summarise(path: Path) -> dict:
    """What the run directory records: one number per claim the page makes."""
    run = RunDir(path)
    steps = run.steps()
    proposer = [s for s in steps if s["kind"] == "proposer"]
    items = [it for s in proposer for it in s["items"]]
    malformed = [m["format_error"] for s in proposer for m in s.get("malformed", [])]
    compute = run.compute()
    audit = run.audit_metrics()
    # round 2 is the first CrossFit round: each question's grader and its fold
    routing = Counter((it["fold"], it["grader"]["id"]) for s in proposer if s["round"] == 2 for it in s["items"])
    rounds = run.manifest()["rounds_completed"]
    return {
        "rounds": rounds,
        "proposals": len(items) + len(malformed),
        "well_formed": len(items),
        "malformed_reasons": Counter(malformed).most_common(),
        "admitted": sum(it["admitted"] for it in items),
        "updates": compute["updates"],
        "generations": compute["generations"],
        "seconds": compute["seconds"],
        "routing_round_2": sorted(routing.items()),
        "judge": audit["judge"],
        "coverage": [r["coverage"] for r in audit["rounds"]],
        "questions": sum(b["n"] for b in run.evaluation(0)["benchmarks"].values()),  # each round asks these
    }


def untrained_note(s: dict) -> str:
    """The round-2 graders that made no update in round 1 (an auxiliary solver trains only on its own
    fold's admitted questions): they graded as the base model."""
    idle = sorted({g for (_, g), _ in s["routing_round_2"] if g.split("@")[0] not in s["updates"]})
    return (f"; {', '.join(idle)} made no update in round 1 (its fold had no admitted question), so it graded "
            "as the base model" if idle else "")


def block(s: dict, timing: dict | None) -> str:
    sw = software()
    reasons = ", ".join(f"{n} {why!r}" for why, n in s["malformed_reasons"])
    routing = "; ".join(f"fold {fold} by {grader} ({n})" for (fold, grader), n in s["routing_round_2"])
    timed = (f"**{timing['wall_s'] / 60:.0f} min {timing['wall_s'] % 60:.0f} s** wall, "
             f"{timing['max_rss_mib'] / 1024:.2f} GiB max RSS (the largest process)" if timing else
             "not timed (read from a kept run directory)")
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in s["seconds"].items() if v >= 0.5)
    lines = [
        "Command: `python benchmarks/lm_tiny.py` (runs `selfevo evolve --config configs/lm-tiny.toml --backend lm "
        "--model smollm2-135m --corpus ../shared/data/corpus/wiki18-mini.jsonl --qa-dir ../shared/data/qa "
        "--treatment crossfit --out OUT` from a fresh output directory, seed 0, and reads OUT)  ",
        f"Machine: {machine_line()}; torch {sw.get('torch')}, transformers {sw.get('transformers')}, "
        f"peft {sw.get('peft')}; CPU, float32",
        "",
        f"- {timed}; {s['rounds']} rounds.",
        f"- {s['proposals']} proposals, {s['well_formed']} well-formed and {s['admitted']} of those admitted; "
        f"malformed: {reasons or 'none'}.",
        f"- Updates: {', '.join(f'{k} {v}' for k, v in s['updates'].items())}.",
        f"- Round 2's questions graded by: {routing or 'none'}{untrained_note(s)}.",
        f"- Generations: {', '.join(f'{k} {v}' for k, v in s['generations'].items())}.",
        f"- Loop phases: {phases}; the rest of the wall time is loading the model and corpus, building the "
        "index and the audit.",
        f"- Audit: judge `{s['judge']}`, coverage by round {', '.join(f'{c:.2f}' for c in s['coverage'])} "
        "(docs/judge.md measures this model as a judge).",
        f"- Per-round evaluation: {s['questions']} questions (`data.eval_limit = 1`: one per benchmark) after each "
        f"of rounds 0..{s['rounds']}.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=SHARED / "corpus" / "wiki18-mini.jsonl")
    ap.add_argument("--qa-dir", type=Path, default=SHARED / "qa")
    ap.add_argument("--keep", type=Path, help="keep the run here; an existing run here is read, not run again")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "lm.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or Path(tmp) / "run"
        kept = path / "lm_tiny.json"  # the timing of the run kept there, taken when it ran
        if RunDir(path).exists():
            timing = json.loads(kept.read_text())["timing"] if kept.exists() else None
        else:
            timing = run_tiny(args.corpus.resolve(), args.qa_dir.resolve(), path)
            if args.keep:
                kept.write_text(json.dumps({"timing": timing}))
        s = summarise(path)
    text = block(s, timing)
    write_block(args.out, "lm-tiny", text)
    print(text)


if __name__ == "__main__":
    main()
