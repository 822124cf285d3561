"""Co-cheating in the coupled (Dr. Zero) loop on the embedded world, with the ablations that show
it is emergent, and the speed of a full run.

    python benchmarks/coupled.py [--seeds 5] [--world default] [--out docs/results.md]

Arms (each a full 3-round run per seed, audited with the exact-truth oracle):
  coupled         the baseline loop
  no-memory       the solver has no parametric memory (solver.memory=false)
  perfect-reader  nobody misreads a page (solver/proposer misread_scale=0)
Then the median wall time of three full default-world coupled runs pinned to one core.
Writes the "## Co-cheating in the coupled loop" section of docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from _common import REPO, fmt, machine_line, mean_std, median_time, write_section
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import selfevo.evolve as evolve_module
from selfevo.audit import METRICS, hop_mix_text, mean_hop_mix
from selfevo.config import load_config
from selfevo.evolve import evolve

HEADING = "## Co-cheating in the coupled loop"
ARMS = {
    "coupled": [],
    "no-memory": ["solver.memory=false"],
    "perfect-reader": ["solver.misread_scale=0.0", "proposer.misread_scale=0.0"],
}


def run_arm(overrides: list[str], seed: int, world: str, root: Path) -> dict:
    out = root / f"{abs(hash((tuple(overrides), seed)))}"
    cfg = load_config(overrides=[*overrides, f"seed={seed}", f"world.name={world}"])
    evolve(cfg, out, progress=False)
    audit = json.loads((out / "audit" / "metrics.json").read_text())
    evals = [json.loads((out / "eval" / f"round-{r}.json").read_text())["macro"]["cover_em"]
             for r in range(cfg.loop.rounds + 1)]
    return {"rounds": audit["rounds"], "eval": evals}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--world", default="default")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results.md")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw numbers here")
    args = ap.parse_args()
    console = Console()
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp, Progress(console=console) as bar:
        task = bar.add_task("runs", total=len(ARMS) * args.seeds)
        for arm, overrides in ARMS.items():
            results[arm] = []
            for seed in range(args.seeds):
                bar.update(task, description=f"{arm} seed {seed}")
                results[arm].append(run_arm(overrides, seed, args.world, Path(tmp)))
                bar.advance(task)

        # speed: one full default-world run on one core (median of 3)
        cfg = load_config(overrides=[f"world.name={args.world}"])
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        runs = iter(range(3))
        # cold, as the sentence below says: evolve keeps a world and its BM25 index in
        # selfevo.evolve._WORLDS (keyed by the world spec), so a run after the arms' runs of the same
        # world would build neither; emptied before each timed run (untimed), as a new process starts
        wall, walls = median_time(lambda: evolve(cfg, Path(tmp) / f"speed-{next(runs)}", progress=False),
                                  setup=lambda: evolve_module._WORLDS.clear())

    lines = [HEADING, "",
             f"Command: `python benchmarks/coupled.py --seeds {args.seeds} --world {args.world}`  ",
             f"Machine: {machine_line()}  ",
             f"Seeds 0..{args.seeds - 1}; values are mean ± std over seeds; world `{args.world}` "
             "(world seed 0); every run is the paper's schedule (3 rounds × (18 proposer + 25 solver "
             "updates), 1,600 admitted questions a round, 5 grader samples), audited with the "
             "exact-truth oracle. Round metrics aggregate the proposer steps (the grader's responses).",
             ""]
    for arm, rows in results.items():
        rounds = len(rows[0]["rounds"])
        lines += [f"**{arm}**", "", "| round | " + " | ".join(METRICS) + " | admitted hop mix |",
                  "|---|" + "---:|" * len(METRICS) + "---|"]
        for i in range(rounds):
            mix = mean_hop_mix([r["rounds"][i]["hop_mix_admitted"] for r in rows])
            lines.append(f"| {i + 1} | " + " | ".join(fmt([r["rounds"][i][m] for r in rows]) for m in METRICS)
                         + f" | {hop_mix_text(mix)} |")
        f1 = [r["rounds"][0]["F"] for r in rows]
        f3 = [r["rounds"][-1]["F"] for r in rows]
        if mean_std(f1)[0] >= 1e-3:
            per_seed = ", ".join(f"{b / a:.1f}" if a > 0 else "n/a" for a, b in zip(f1, f3))
            ratio = mean_std(f3)[0] / mean_std(f1)[0]
            rise = f"F round 3 / round 1: {ratio:.2f} (ratio of means; per seed {per_seed})."
        elif mean_std(f3)[0] < 1e-3:
            rise = f"F stays below 0.001 (round 1 {mean_std(f1)[0]:.4f}, round 3 {mean_std(f3)[0]:.4f})."
        else:
            rise = (f"F goes {mean_std(f1)[0]:.4f} → {mean_std(f3)[0]:.4f} from round 1 to 3 (round-1 F below "
                    "0.001: no ratio).")
        lines += ["", rise + "  ",
                  "Main solver macro Cover-EM by round (0 = base): "
                  + ", ".join(f"r{i} {fmt([r['eval'][i] for r in rows])}" for i in range(rounds + 1)), ""]
    lines += [f"Speed: a full `{args.world}`-world coupled run (world generation, BM25 index, 129 scheduled "
              f"steps, 4 evaluations of 1,325 questions, the audit; seed {cfg.seed}) takes **{wall:.2f} s** on one "
              f"core (median of 3: {', '.join(f'{w:.2f}' for w in walls)} s).", ""]
    write_section(args.out, HEADING, "\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "wall_seconds": walls}, indent=1))

    table = Table(title="F by round (mean over seeds)")
    for col in ("arm", "F r1", "F r2", "F r3", "A r1", "A r3", "T_P r1", "T_P r3"):
        table.add_column(col, justify="right")
    for arm, rows in results.items():
        def m(key: str, i: int, rows=rows) -> str:
            return f"{mean_std([r['rounds'][i][key] for r in rows])[0]:.3f}"
        table.add_row(arm, m("F", 0), m("F", 1), m("F", 2), m("A", 0), m("A", 2), m("T_P", 0), m("T_P", 2))
    console.print(table)
    console.print(f"full run on one core: {wall:.2f} s (median of 3); section written to {args.out}")


if __name__ == "__main__":
    main()
