"""CrossFit, MSV and the paper's controls against the coupled loop on the embedded world.

    python benchmarks/mitigations.py [--seeds 5] [--world default] [--out docs/results.md]

Every treatment runs the paper's schedule over the same seeds (round 1 is shared by all arms);
reported: round-3 audit metrics with the admitted questions' hop mix and base-model difficulty, the
main solver's downstream Cover-EM after round 3 (macro, single-hop, multi-hop) with the paired
difference to coupled (mean and a 95% t-interval over seeds), and compute overhead against coupled
(generations, updates, wall seconds).
Writes the "## Mitigations: CrossFit, MSV and controls" section of docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
from pathlib import Path

from _common import REPO, fmt, interval_text, machine_line, run_root, write_section
from rich.console import Console
from rich.progress import Progress

from selfevo.algos import summary
from selfevo.audit import OracleJudge, hop_mix_text, mean_hop_mix
from selfevo.config import config_from_dict, load_config
from selfevo.evaluate import answers_match
from selfevo.evolve import build_loop, environment, evolve, fold_assignment, load_run_world
from selfevo.loop.engine import EVAL_PHASE
from selfevo.report.compare import compare, training_cost
from selfevo.runs import RunDir
from selfevo.search.tool import SearchTool

HEADING = "## Mitigations: CrossFit, MSV and controls"
TREATMENTS = ["coupled", "msv", "crossfit", "msv+crossfit", "same-source", "full-data", "question-split",
              "half-budget", "crossfit-k3", "crossfit-connected", "crossfit-connected-k3"]


def ci95(diffs: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval of paired differences over seeds (the report's own interval)."""
    s = summary(diffs)
    return s["mean"], s["lo"], s["hi"]


def memory_facts(run_dir: Path) -> tuple[int, int]:
    """(right, wrong) facts the main solver's memory holds after the last round: memory rows whose
    preferred answer clearly stands out (logit > 0.5), judged against the world's truth. A
    diagnostic of how much knowledge the training corrupted, not a metric of the method."""
    run = RunDir(run_dir)
    truth = load_run_world(config_from_dict(run.config())).truth
    memory = run.load_checkpoint(run.manifest()["rounds_completed"])["main"]["memory"]
    by_alias: dict[str, list] = {}  # memory keys are lowercased mentions
    for e in truth.entities.values():
        for a in {a.lower() for a in e.aliases}:
            by_alias.setdefault(a, []).append(e)
    right = wrong = 0
    for key, row in memory.items():
        best = max(row, key=row.get, default=None)
        if best is None or row[best] <= 0.5:
            continue
        mention, rel = key.rsplit("|", 1)
        matches = by_alias.get(mention, [])
        if len(matches) != 1 or rel not in matches[0].facts:
            continue
        golds = truth.value_aliases(matches[0].facts[rel])
        if any(answers_match(best, g) for g in golds):
            right += 1
        else:
            wrong += 1
    return right, wrong


def base_solved(run_dir: Path) -> float:
    """Share of the last round's admitted questions the untrained solver answers right (one greedy
    answer, exact truth): how hard what a treatment admits is for the base model, to read next to
    F (DESIGN §1: lower F could come from fewer hard questions)."""
    run = RunDir(run_dir)
    cfg = config_from_dict(run.config())
    env = environment(cfg)
    tool = SearchTool(env.index, topk=cfg.search.topk, max_calls=cfg.search.max_calls)
    base = build_loop(cfg, env, tool, fold_assignment(cfg, env.documents)).main  # before any update
    last = run.manifest()["rounds_completed"]
    questions = [it["question"] for st in run.steps() if st["round"] == last and st["kind"] == "proposer"
                 for it in st["items"] if it.get("admitted")]
    answers = [trajs[0].answer for trajs in base.answer(questions, tool, greedy=True)]
    # the answer in the label's place: the oracle's verdict on it is whether the base model is right
    verdicts = OracleJudge(env.world.truth).judge([{"question": q, "adopted_label": a, "responses": []}
                                                   for q, a in zip(questions, answers)])
    return sum(v.resolved and v.label_correct for v in verdicts) / max(1, len(verdicts))


def timed_phases(root: Path, world: str, treatments: list[str], repeats: int) -> dict[str, dict]:
    """Wall seconds of fresh runs of seed 0 per treatment (compute.json): each training phase's median
    over `repeats` runs, and every run's training total (`training_cost`: the downstream evaluation,
    the same in every arm, left out). The runs are interleaved (t1, t2, ..., t1, t2, ...) so
    that a treatment's r-th run and coupled's r-th run lie close in time and their ratio is paired:
    a slow spell of the machine falls on both. A single ~2 s run per seed is too short to time: the
    five-seed mean of single-run ratios gave CrossFit +17% in one run of this script and +35% in the
    next; medians of 3 unpaired runs gave +18% and +8% in two sessions."""
    seconds: dict[str, list[dict[str, float]]] = {t: [] for t in treatments}
    for r in range(repeats):
        for t in treatments:
            out = root / f"timing-{t}-{r}"
            shutil.rmtree(out, ignore_errors=True)  # always a fresh run: a finished one would be skipped
            evolve(load_config(overrides=[f"treatment={t}", "seed=0", f"world.name={world}"]), out, progress=False)
            compute = json.loads((out / "compute.json").read_text())
            seconds[t].append({**compute["seconds"], "total": training_cost(compute)[1]})
    return {t: {"phases": {ph: statistics.median(s[ph] for s in runs) for ph in runs[0]
                           if ph not in ("total", EVAL_PHASE)},
                "totals": [s["total"] for s in runs]} for t, runs in seconds.items()}


def paired_overhead(totals: list[float], ref_totals: list[float]) -> tuple[float, float, float]:
    """Median, min and max over repeats of (this run / coupled's run of the same repeat) − 1."""
    ratios = [a / b - 1 for a, b in zip(totals, ref_totals, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def acceptance(res: dict[str, list[dict]], timing: dict[str, dict]) -> list[tuple[str, bool, str]]:
    """Issue 5's acceptance items on this run's numbers: (item, holds, the numbers). Means over seeds;
    Δ paired by seed; "most" = more than half; "does not help" = less than half of CrossFit's F cut (no
    cut at all where CrossFit cut none: then it has no reduction for the half budget to keep either)."""
    def mean(t: str, key: str) -> float:
        return statistics.fmean(r["audit"][key] for r in res[t])

    co, checks = res["coupled"], []
    co_f = mean("coupled", "F")
    cut = {t: co_f - mean(t, "F") for t in res}
    if "crossfit" in res:
        f, tp, a = (mean("crossfit", k) for k in ("F", "T_P", "A"))
        checks.append(("CrossFit round-3 F ≤ 0.5 × coupled's, with T_P higher and A not higher",
                       f <= 0.5 * co_f and tp > mean("coupled", "T_P") and a <= mean("coupled", "A"),
                       f"F {f:.3f} vs 0.5 × {co_f:.3f} = {0.5 * co_f:.3f}; "
                       f"T_P {tp:.3f} vs {mean('coupled', 'T_P'):.3f}; A {a:.3f} vs {mean('coupled', 'A'):.3f}"))
        m, lo, hi = ci95([r["macro"] - b["macro"] for r, b in zip(res["crossfit"], co)])
        checks.append(("downstream macro Cover-EM, CrossFit − coupled > 0 with a 95% interval excluding 0",
                       lo is not None and lo > 0,
                       f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]" if lo is not None else f"{m:+.3f} (one seed)"))
        if "msv" in res:
            d = {t: ci95([r["macro"] - b["macro"] for r, b in zip(res[t], co)]) for t in ("msv", "crossfit")}
            checks.append(("MSV moves F less than CrossFit does", abs(cut["msv"]) < abs(cut["crossfit"]),
                           f"ΔF {-cut['msv']:+.3f} vs {-cut['crossfit']:+.3f}"))
            # "less than CrossFit's downstream effect" means something only where that effect is shown:
            # comparing two point estimates whose intervals both hold 0 would pass on noise
            shown = d["crossfit"][1] is not None and (d["crossfit"][1] > 0 or d["crossfit"][2] < 0)
            checks.append(("MSV moves macro Cover-EM less than CrossFit does (CrossFit's effect shown: its "
                           "interval excludes 0)", shown and abs(d["msv"][0]) < abs(d["crossfit"][0]),
                           "; ".join(f"{t} Δ macro {m:+.3f}" + (f" [{lo:+.3f}, {hi:+.3f}]" if lo is not None else "")
                                     for t, (m, lo, hi) in d.items())))
        if "question-split" in res:
            keep = mean("question-split", "F") / co_f if co_f else math.nan  # nothing to keep: not a pass
            checks.append(("question-split keeps most of coupled's F", keep > 0.5,
                           f"{keep:.2f} of it" if co_f else "coupled's F is 0: none to keep"))
        # the controls are measured against CrossFit's F reduction, so where CrossFit reduced nothing there
        # is no reduction to keep (a share of a rise is no pass), and "help" is any F cut at all
        cf_cut = cut["crossfit"]
        for t in ("same-source", "full-data"):
            if t in res:
                checks.append((f"{t} does not help", cut[t] < 0.5 * cf_cut if cf_cut > 0 else cut[t] <= 0,
                               f"F cut {cut[t]:+.3f} vs CrossFit's {cf_cut:+.3f}"))
        if "half-budget" in res:
            share = cut["half-budget"] / cf_cut if cf_cut > 0 else math.nan
            checks.append(("half budget keeps most of CrossFit's F reduction", share > 0.5, f"{share:.2f} of it"
                           if cf_cut > 0 else f"CrossFit reduced no F ({cf_cut:+.3f}): none to keep"))
        if "coupled" in timing and "crossfit" in timing:
            mid, lo, hi = paired_overhead(timing["crossfit"]["totals"], timing["coupled"]["totals"])
            checks.append(("CrossFit's wall-time overhead ≤ +40%", mid <= 0.40,
                           f"{mid:+.0%} [{lo:+.0%}, {hi:+.0%}] (median [min, max] of paired ratios)"))
    return checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--world", default="default")
    ap.add_argument("--treatments", nargs="*", default=TREATMENTS)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results.md")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    ap.add_argument("--timing-repeats", type=int, default=5, help="fresh seed-0 runs per treatment timed")
    args = ap.parse_args()
    console = Console()
    res: dict[str, list[dict]] = {t: [] for t in args.treatments}
    overhead: dict[str, list[dict]] = {t: [] for t in args.treatments}
    with run_root(args.keep) as root, Progress(console=console) as bar:
        task = bar.add_task("runs", total=len(args.treatments) * args.seeds)
        for seed in range(args.seeds):
            dirs = []
            for t in args.treatments:
                bar.update(task, description=f"{t} seed {seed}")
                out = root / f"{t}-{seed}"
                if not (out / "manifest.json").exists():
                    evolve(load_config(overrides=[f"treatment={t}", f"seed={seed}", f"world.name={args.world}"]),
                           out, progress=False)
                dirs.append(out)
                last = json.loads((out / "audit" / "metrics.json").read_text())["rounds"][-1]
                ev = json.loads((out / "eval" / "round-3.json").read_text())
                right, wrong = memory_facts(out)
                res[t].append({"audit": last, "macro": ev["macro"]["cover_em"],
                               "single": ev["single_hop"]["cover_em"], "multi": ev["multi_hop"]["cover_em"],
                               "memory_right": right, "memory_wrong": wrong, "base_solved": base_solved(out)})
                bar.advance(task)
            for row in compare(dirs):
                overhead[row["treatment"]].append(row)
        bar.update(task, description=f"timing: {args.timing_repeats} fresh runs of seed 0 per treatment")
        timing = timed_phases(root, args.world, args.treatments, args.timing_repeats)

    base = res.get("coupled")
    lines = [HEADING, "",
             f"Command: `python benchmarks/mitigations.py --seeds {args.seeds} --world {args.world}`  ",
             f"Machine: {machine_line()}  ",
             f"Seeds 0..{args.seeds - 1}, world `{args.world}`; the paper's schedule; mean ± std over seeds. "
             "Audit metrics are those of round 3 (oracle judge, grader responses); Cover-EM is the main "
             "solver's after round 3. Δ = paired difference to coupled (same seed), mean [95% t-interval]. "
             "`admitted`: round-3 admitted questions; the budget is 1,600 a round, and a proposal MSV rejects "
             "is not replaced, so the MSV arms train on fewer. Under MSV, A is agreement with the adopted "
             "label (the MSV majority), while the proposer's reward counted agreement with its draft; the "
             "audit covers every proposal a step graded, admitted or not (a rejected one's label is its draft).",
             "",
             "| treatment | F | T_P | A | T_S | coverage | admitted | admitted hop mix | base solves "
             "| macro Cover-EM | Δ macro | Δ single-hop | Δ multi-hop |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for t, rows in res.items():
        cells = [fmt([r["audit"][m] for r in rows]) for m in ("F", "T_P", "A", "T_S", "coverage")]
        cells.append(f"{statistics.fmean(r['audit']['admitted'] for r in rows):.0f}")
        cells.append(hop_mix_text(mean_hop_mix([r["audit"]["hop_mix_admitted"] for r in rows])))
        cells.append(fmt([r["base_solved"] for r in rows]))
        cells.append(fmt([r["macro"] for r in rows]))
        for key in ("macro", "single", "multi"):
            if base is None or t == "coupled":
                cells.append("")
                continue
            cells.append(interval_text(summary([r[key] - b[key] for r, b in zip(rows, base)])))
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    if base is not None and "crossfit" in res:
        def mem(t: str, key: str) -> str:
            return fmt([r[key] for r in res[t]], 1)

        def difficulty(t: str) -> str:
            d = summary([r["base_solved"] - b["base_solved"] for r, b in zip(res[t], base)])
            m, lo, hi = d["mean"], d["lo"], d["hi"]
            if lo is None:  # one seed: no interval, no verdict
                return f"{t} {interval_text(d)}"
            if lo <= 0 <= hi:
                verdict = "no clear difference in difficulty"
            elif m > 0:
                verdict = "easier questions, which can account for part of its lower F"
            else:
                verdict = "harder questions: its lower F does not come from easier ones"
            return f"{t} {m:+.3f} [{lo:+.3f}, {hi:+.3f}] ({verdict})"

        lines += ["", "Harder questions (DESIGN §1): `admitted hop mix` is the share of round-3 admitted questions "
                  "by hop count (the proposer draws hop counts by the 4:3:2:1 ratio, so only admission can "
                  "move it); `base solves` is the share of them the untrained solver answers right (one greedy "
                  "answer, exact truth; `base_solved` in this script). Paired difference to coupled: "
                  + "; ".join(difficulty(t) for t in ("crossfit", "msv") if t in res) + "."]

        def than(key: str) -> str:
            """CrossFit's memory facts against coupled's of the same seed: more or fewer where the paired 95%
            interval excludes 0, else no clear difference (one seed: the two counts as they are, no interval)."""
            d, lo, hi = ci95([x[key] - c[key] for x, c in zip(res["crossfit"], base, strict=True)])
            if lo is None:
                return ("as many" if d == 0 else "more" if d > 0 else "fewer") + " (one seed: no interval)"
            word = "more" if lo > 0 else "fewer" if hi < 0 else "no clearly different number of"
            return f"{word} ({d:+.1f} [{lo:+.1f}, {hi:+.1f}], paired by seed)"

        _, gain_lo, _ = ci95([r["macro"] - b["macro"] for r, b in zip(res["crossfit"], base)])
        tp_up = statistics.fmean(r["audit"]["T_P"] for r in res["crossfit"]) > statistics.fmean(
            r["audit"]["T_P"] for r in base)
        lines += ["", ("What the memory holds (one seed: no interval for the downstream gain)" if gain_lo is None
                       else "Why the downstream gain does not appear in this world" if gain_lo <= 0 else
                       "The downstream gain appears here (interval above 0); what the memory holds")
                  + ": facts the main solver's memory holds "
                  "after round 3 (rows whose preferred answer stands out, judged by the oracle; "
                  f"`memory_facts` in this script): coupled {mem('coupled', 'memory_right')} right / "
                  f"{mem('coupled', 'memory_wrong')} wrong, CrossFit {mem('crossfit', 'memory_right')} right / "
                  f"{mem('crossfit', 'memory_wrong')} wrong. CrossFit admits {'fewer' if tp_up else 'no fewer'} "
                  f"wrong labels (T_P above), and the main solver ends with {than('memory_wrong')} wrong facts and "
                  f"{than('memory_right')} right ones: round 1, which every "
                  "arm shares, already plants the wrong facts, and CrossFit's curriculum follows the auxiliary "
                  "solvers' frontier, so fewer of the main solver's items carry a learning signal, right-label "
                  "ones included (measured in \"## Downstream sensitivity\", benchmarks/downstream.py: the "
                  "mixed-rollout columns, and the ceiling of withholding every wrong label)."]
    ref = timing.get("coupled")
    lines += ["", "Compute against coupled: generations and updates of the same seed, mean over seeds (the "
              "counts do not depend on the machine; the downstream evaluation, the same in every arm, left "
              "out); wall time of the loop's training phases (compute.json; the downstream evaluation, world "
              f"and index building excluded) over {args.timing_repeats} fresh interleaved runs of seed 0 per "
              "treatment: the median run, and the extra wall time as the median [min, max] over repeats of "
              "the ratio to coupled's run of the same repeat (the acceptance's figure: runs of one repeat share "
              "the machine's state of the moment, so the two medians of the wall-seconds column, each over "
              "its own treatment's runs, need not give the same ratio).", "",
              "| treatment | extra generations | extra updates | wall seconds | extra wall time |",
              "|---|---:|---:|---:|---:|"]
    for t, rows in overhead.items():
        def pct(key, rows=rows):
            vals = [r[key] for r in rows if r[key] is not None]
            return f"{statistics.fmean(vals):+.0%}" if vals else "-"
        wall = statistics.median(timing[t]["totals"])
        extra = "-"
        if ref:
            mid, lo, hi = paired_overhead(timing[t]["totals"], ref["totals"])
            extra = f"{mid:+.0%} [{lo:+.0%}, {hi:+.0%}]"
        lines.append(f"| {t} | {pct('extra_generations')} | {pct('extra_updates')} | {wall:.2f} | {extra} |")
    if ref and "crossfit" in timing:
        cf, co = timing["crossfit"]["phases"], ref["phases"]
        where = [(d, ph) for d, ph in sorted(((cf[ph] - co.get(ph, 0.0), ph) for ph in cf), reverse=True)
                 if abs(d) >= 0.01]
        meaning = {"aux": "training the auxiliary solvers on their folds' admitted questions",
                   "grade": "the grader's five answers per proposal, now from an auxiliary solver"}
        shown = [f"`{ph}`: {meaning[ph]}" for _, ph in where if ph in meaning]
        lines += ["", "Where CrossFit's extra wall time goes (median seconds, CrossFit − coupled, by phase, those of "
                  "0.01 s or more): " + ", ".join(f"{ph} {d:+.2f} s" for d, ph in where)
                  + (f" ({'; '.join(shown)})." if shown else ".")]
    if base is not None:
        lines += ["", "Acceptance (issue 5):", "", *(f"- {'PASS' if ok else '**FAIL**'} {name}: {detail}"
                                                      for name, ok, detail in acceptance(res, timing))]
    write_section(args.out, HEADING, "\n".join(lines))
    console.print("\n".join(lines))


if __name__ == "__main__":
    main()
