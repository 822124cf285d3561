"""Where CrossFit's downstream gain comes from in the embedded world: a sensitivity study.

    python benchmarks/downstream.py [--seeds 10] [--first-seed 1000] [--world default] [--out docs/results.md]

The paper's downstream gain (Dr. Zero 0.400 -> CrossFit 0.488) does not appear on the default world
(benchmarks/mitigations.py). This script asks which property of the solver the gain depends on.
Five solver variants and one of the proposer. The second is the one that looked best in an earlier 5-seed exploration of
memory bounds, learning rates and temperatures (CrossFit - coupled +0.021 there; a figure of that
exploration, which is not in this repository), so it was chosen for its downstream difference; this
script runs it again on seeds that no exploration used (1000.. by default), with the seed count fixed
in advance, to see whether that holds. The third and fourth come from a later exploration (seeds
100..102) of the two properties that separate the sim from the paper most: a learned value rippling
into every chain through the same entity, and an untrained solver that agrees with the proposer's
wrong labels about 7x as often as the paper's (round-1 F 0.029 vs 0.004); the fifth from a grid on
seeds 0..2 by its in-loop A alone (benchmarks/_common.py):

- `default`: configs/default.toml (memory unbounded, sampling temperature 1.0, lr_theta 0.05);
- `bounded memory`: a memory logit bounded at 1.5, so a learned pseudo-label never becomes certain
  and co-cheating keeps paying the proposer instead of saturating at k = 5; the paper's sampling
  temperature 0.8; reading weights that learn at lr_theta 0.6, so reading skill, which is what
  transfers to the benchmarks, moves within three rounds;
- `question-keyed memory`: `solver.memory_key="question"`, a learned value is reused only by questions
  that start from the same mention (no ripple through shared intermediate pages), so a source-level
  fold does hold every reuse path out;
- `careful reader`: the untrained solver trusts what a page says about its own subject more
  (`about_page` 4.0 instead of 2.5), so it rarely reads the confusable sentence the proposer misread:
  round 1, which every arm shares, plants fewer wrong values in the main solver;
- `skill-led learner`: reading weights that learn ten times as fast and a memory eight times as
  slow (benchmarks/_common.py: SKILL_LED, and how it was picked), so that, as in the paper, a
  solver trained on other sources grades nearly as well as the main one;
- `given source`: not a solver variant but the paper's proposer protocol (chosen for that, before any
  run): each proposal's source page is drawn for the proposer (`proposer.options=1`), where the default
  lets its policy pick among 8 drawn pages, so its curriculum can follow a grader's frontier by the
  choice of page, not only of the fact asked about.

For each: coupled, MSV and CrossFit, and coupled and CrossFit with the memory switched off (the
ablation: no reuse path, no co-cheating), and a ceiling: coupled with every wrong pseudo-label
withheld from the main solver (the oracle decides admission; a diagnostic no loop may offer, since
agents never see truth). It bounds what any mitigation that only cleans the main solver's training
labels, as CrossFit does through the proposer's curriculum, could gain downstream.

Reported per treatment: round-3 F, T_P, A (oracle judge), the main solver's macro Cover-EM after
round 3 with the paired difference to coupled (mean and 95% t-interval over seeds), and its learned
`about_page` reading weight (how much it trusts what a page says about its own subject over a
confusable sentence about someone else; a wrong pseudo-label is such a sentence, so training to
agree with one lowers this weight) and `title_match` weight (how much it prefers the page whose
title is the mention: the reading skill training adds), and what the main solver's rounds-2/3 training items carry: the
share whose five rollouts were mixed (the only items with a policy-gradient signal), split by
whether the label was right or wrong (oracle, after the run), and the share with a right label that
the main solver already answered five times out of five (no signal: what a curriculum following
another solver's frontier spends on it).
A last table runs coupled and CrossFit (default config) for `--horizon` rounds instead of 3: if
co-cheating compounded into the main solver faster than CrossFit's curriculum cost, CrossFit's gain
would appear later. Writes the "## Downstream sensitivity" section of docs/results.md and the README's paragraph on
the downstream gain (between its `<!-- downstream -->` lines).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from _common import REPO, SKILL_LED, fmt, interval_text, machine_line, run_root, write_block, write_section
from rich.console import Console
from rich.progress import Progress

import selfevo.evolve as evolve_module
from selfevo.algos import summary
from selfevo.audit.judges import OracleJudge
from selfevo.config import load_config
from selfevo.evaluate import answers_match
from selfevo.evolve import environment, evolve
from selfevo.runs import ORACLE_ADMISSION, RunDir

HEADING = "## Downstream sensitivity"
CEILING = "coupled, wrong labels withheld (ceiling)"
VARIANTS = {
    "default": [],
    "bounded memory": ["solver.memory_cap=1.5", "solver.temperature=0.8", "solver.lr_theta=0.6"],
    "question-keyed memory": ['solver.memory_key="question"'],
    "careful reader": ["solver.theta0=[4.0,0.0,0.3,0.2]"],
    "skill-led learner": SKILL_LED,
    "given source": ["proposer.options=1"],
}
# (label, treatment, extra overrides)
ARMS = [("coupled", "coupled", []), ("msv", "msv", []), ("crossfit", "crossfit", []),
        ("coupled, no memory", "coupled", ["solver.memory=false"]),
        ("crossfit, no memory", "crossfit", ["solver.memory=false"]),
        (CEILING, "coupled", [])]


class WithholdWrongLabels:
    """Admission for the ceiling arm only: the run's own rule, then the oracle withholds every
    candidate whose label is wrong. The proposer's reward is untouched (admission never sets it)."""

    def __init__(self, inner, judge: OracleJudge):
        self.inner, self.judge = inner, judge
        self.name, self.generations_per_candidate = f"{inner.name}+oracle-withheld", inner.generations_per_candidate

    def begin_round(self, round: int, main) -> None:
        self.inner.begin_round(round, main)

    def decide(self, proposals, tool, seed):
        decisions = self.inner.decide(proposals, tool, seed)
        for p, d in zip(proposals, decisions, strict=True):
            ref = self.judge.reference(p.question)
            if d.admitted and not (ref and any(answers_match(d.label, g) for g in ref)):
                d.admitted = False
                d.detail = {**d.detail, "oracle_withheld": True}  # the step record says who refused it
        return decisions


def training_signal(run: RunDir, judge: OracleJudge) -> dict:
    """Shares of the main solver's rounds-2/3 training items with mixed rollouts (0 < k < 5), by
    label correctness, over resolved items."""
    counts = {"right": 0, "wrong": 0, "solved": 0, "all": 0}
    for rec in run.steps():
        if rec["kind"] != "solver" or rec["round"] < 2:
            continue
        for it, v in zip(rec["items"], judge.judge(rec["items"]), strict=True):
            if v.resolved:
                counts["all"] += 1
                if 0 < it["k"] < 5:
                    counts["right" if v.label_correct else "wrong"] += 1
                elif it["k"] == 5 and v.label_correct:
                    counts["solved"] += 1
    return {k: counts[k] / max(1, counts["all"]) for k in ("right", "wrong", "solved")}


def run_one(job: tuple[str, str, int, str, Path]) -> dict:
    variant, label, seed, world, root = job
    treatment, extra = next((t, e) for name, t, e in ARMS if name == label)
    out = root / re.sub(r"[^\w-]+", "_", f"{variant}-{label}-{seed}")
    cfg = load_config(overrides=[f"treatment={treatment}", f"seed={seed}", f"world.name={world}",
                                 *VARIANTS[variant], *extra])
    judge = OracleJudge(environment(cfg).truth)
    if not (out / "manifest.json").exists():
        if label == CEILING:  # this process runs one job at a time, so the swap is scoped to it
            rules = evolve_module.make_rules

            def withheld(*args):
                admission, feedback = rules(*args)
                return WithholdWrongLabels(admission, judge), feedback

            evolve_module.make_rules = withheld
            try:
                evolve(cfg, out, progress=False)
            finally:
                evolve_module.make_rules = rules
            # its config says coupled: the manifest says the oracle admitted, so that no report,
            # comparison or replay bank takes it for a run of the loop (runs.check_loop_run)
            RunDir(out).note(**{ORACLE_ADMISSION: True})
        else:
            evolve(cfg, out, progress=False)
    last = json.loads((out / "audit" / "metrics.json").read_text())["rounds"][-1]
    ev = json.loads((out / "eval" / "round-3.json").read_text())
    run = RunDir(out)
    theta = run.load_checkpoint(run.manifest()["rounds_completed"])["main"]["theta"]
    first = json.loads((out / "audit" / "metrics.json").read_text())["rounds"][0]
    return {"variant": variant, "arm": label, "seed": seed, "F": last["F"], "T_P": last["T_P"], "A": last["A"],
            "F1": first["F"],
            "macro": ev["macro"]["cover_em"], "about_page": theta[0], "title_match": theta[1],
            **training_signal(run, judge)}


def run_horizon(job: tuple[str, int, str, int, Path]) -> dict:
    """One coupled or CrossFit run of `rounds` rounds (default config): per round, the main solver's
    macro Cover-EM after it and the round's F and T_P."""
    treatment, seed, world, rounds, root = job
    out = root / f"horizon-{rounds}-{treatment}-{seed}"
    if not (out / "manifest.json").exists():
        evolve(load_config(overrides=[f"treatment={treatment}", f"seed={seed}", f"world.name={world}",
                                      f"loop.rounds={rounds}"]), out, progress=False)
    audit = json.loads((out / "audit" / "metrics.json").read_text())["rounds"]
    macro = [json.loads((out / "eval" / f"round-{r}.json").read_text())["macro"]["cover_em"]
             for r in range(1, rounds + 1)]
    return {"treatment": treatment, "seed": seed, "macro": macro,
            "F": [a["F"] for a in audit], "T_P": [a["T_P"] for a in audit]}


def horizon_arms(runs: list[dict], seeds: range) -> tuple[list[dict], list[dict]]:
    """The coupled and CrossFit run_horizon rows, in seed order (paired by seed)."""
    by = {(r["treatment"], r["seed"]): r for r in runs}
    return [by[("coupled", s)] for s in seeds], [by[("crossfit", s)] for s in seeds]


def horizon_gap(co: list[dict], cf: list[dict], i: int) -> dict:
    """CrossFit − coupled macro Cover-EM after round i + 1, paired by seed."""
    return summary([b["macro"][i] - a["macro"][i] for a, b in zip(co, cf, strict=True)])


def horizon_lines(runs: list[dict], rounds: int, seeds: range) -> list[str]:
    """The longer-horizon table (run_horizon rows) and its reading."""
    co, cf = horizon_arms(runs, seeds)
    lines = [f"**Longer horizon**: coupled and CrossFit (configs/default.toml) for {rounds} rounds, seeds "
             f"{seeds[0]}..{seeds[-1]}; the main solver's macro Cover-EM after each round, Δ paired [95% "
             "t-interval].", "",
             "| round | coupled macro | CrossFit − coupled | F coupled | F CrossFit | T_P coupled | T_P CrossFit |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    gaps = []
    for i in range(rounds):
        d = horizon_gap(co, cf, i)
        gaps.append(d)
        lines.append(f"| {i + 1} | {fmt([r['macro'][i] for r in co])} | {interval_text(d)} "
                     f"| {fmt([r['F'][i] for r in co])} | {fmt([r['F'][i] for r in cf])} | "
                     f"{fmt([r['T_P'][i] for r in co])} | {fmt([r['T_P'][i] for r in cf])} |")
    third, last = gaps[2], gaps[-1]
    if last["lo"] is None:
        verdict = "one seed gives no interval, so no verdict"
    elif last["lo"] > 0:
        verdict = f"CrossFit's downstream gain appears by round {rounds}"
    elif last["hi"] < 0:
        verdict = (f"CrossFit is behind at round {rounds}, an interval excluding 0: a longer loop does not turn "
                   "its cleaner grading into a downstream gain in this world")
    else:
        verdict = f"no downstream difference is settled at round {rounds}"
    lines += ["", f"CrossFit − coupled: {third['mean']:+.3f} after round 3, {interval_text(last)} after round "
              f"{rounds}, while round-{rounds} F is "
              f"{statistics.fmean(r['F'][-1] for r in co):.3f} vs {statistics.fmean(r['F'][-1] for r in cf):.3f}: "
              f"{verdict}."]
    return lines


def mean_of(rows: list[dict], variant: str, arm: str, key: str) -> float:
    """`key` of a variant's arm (run_one rows), mean over seeds."""
    return statistics.fmean(r[key] for r in rows if r["variant"] == variant and r["arm"] == arm)


def cleaned_share(rows: list[dict], variant: str) -> float:
    """The share of coupled's wrong labels CrossFit does not admit (round-3 T_P): of those the ceiling withholds."""
    co, cf = (mean_of(rows, variant, arm, "T_P") for arm in ("coupled", "crossfit"))
    return (cf - co) / (1 - co)


def readme_summary(rows: list[dict], gains: dict, horizon: list[dict], rounds: int, seeds: range) -> list[str]:
    """The README's paragraph on the downstream gain, from the same numbers as the section."""
    avg = functools.partial(mean_of, rows)
    default = gains["default", "crossfit"]
    reproduced = default["lo"] is not None and default["lo"] > 0
    cleaned = [cleaned_share(rows, v) for v in VARIANTS]
    lines = [("What this world reproduces is" if reproduced else "What this world does **not** reproduce is")
             + " the paper's downstream gain: CrossFit − coupled macro Cover-EM of the main solver after round 3 is "
             f"{interval_text(default)} (mean [95% interval], seeds {seeds[0]}..{seeds[-1]}). `docs/results.md` "
             "(\"Downstream sensitivity\"; `benchmarks/downstream.py`, which writes this paragraph) measures what it "
             "depends on:",
             f"- CrossFit cleans {min(cleaned):.0%}–{max(cleaned):.0%} of the wrong labels (round-3 T_P, across the "
             f"{len(VARIANTS)} variants below); most are the proposer's own misreadings, which no grader removes "
             "(`docs/results.md`, \"Shared errors\")."]
    if horizon:
        co, cf = horizon_arms(horizon, seeds)
        last = horizon_gap(co, cf, rounds - 1)
        ratio = statistics.fmean(r["F"][-1] for r in cf) / statistics.fmean(r["F"][-1] for r in co)
        lines.append(f"- Run for {rounds} rounds instead of 3, CrossFit − coupled is {interval_text(last)} after "
                     f"round {rounds}, while CrossFit's round-{rounds} F is {ratio:.2f} of coupled's.")

    def cost(v: str) -> float:  # what the memory costs the coupled main solver
        return avg(v, "coupled, no memory", "macro") - avg(v, "coupled", "macro")

    lines.append("- By variant, CrossFit − coupled after round 3 (and what the memory costs the coupled main solver, "
                 "no memory minus memory): " + "; ".join(
                     f"{v} {interval_text(gains[v, 'crossfit'])} ({cost(v):+.3f})" for v in VARIANTS)
                 + ". The bounded-memory learner was picked in an earlier exploration for "
                 "this very difference; these seeds are new to it.")
    skill = "skill-led learner"
    if skill in VARIANTS:
        lines.append(f"- The {skill}'s CrossFit A is {avg(skill, 'crossfit', 'A'):.3f} against coupled's "
                     f"{avg(skill, 'coupled', 'A'):.3f} (the paper's CrossFit, too, agrees less in the loop), and "
                     f"its coupled main solver scores {avg(skill, 'coupled', 'macro'):.3f} macro Cover-EM.")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--first-seed", type=int, default=1000,
                    help="seeds first..first+n-1; 1000 and up: none that picked a variant (see above)")
    ap.add_argument("--world", default="default")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results.md")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    ap.add_argument("--horizon", type=int, default=6, help="rounds of the longer-horizon table (0: skip it)")
    ap.add_argument("--no-readme", dest="readme", action="store_false", help="leave the README's paragraph")
    args = ap.parse_args()
    console = Console()
    rows: list[dict] = []
    horizon: list[dict] = []
    with run_root(args.keep) as root, Progress(console=console) as bar, ProcessPoolExecutor(args.workers) as pool:
        seeds = range(args.first_seed, args.first_seed + args.seeds)
        jobs = [(v, arm, s, args.world, root) for v in VARIANTS for s in seeds for arm, _, _ in ARMS]
        horizon_jobs = ([(t, s, args.world, args.horizon, root) for s in seeds
                         for t in ("coupled", "crossfit")] if args.horizon > 3 else [])
        task = bar.add_task("runs", total=len(jobs) + len(horizon_jobs))
        for row in pool.map(run_one, jobs):
            rows.append(row)
            bar.advance(task)
        if horizon_jobs:
            bar.update(task, description=f"{args.horizon} rounds")
            for row in pool.map(run_horizon, horizon_jobs):
                horizon.append(row)
                bar.advance(task)

    lines = [HEADING, "",
             f"Command: `python benchmarks/downstream.py --seeds {args.seeds} --first-seed {args.first_seed} "
             f"--world {args.world}`  ",
             f"Machine: {machine_line()}  ",
             f"Seeds {seeds[0]}..{seeds[-1]}, world `{args.world}`, the paper's schedule; mean ± std over seeds; "
             "round-3 audit metrics (oracle judge); macro Cover-EM of the main solver after round 3; "
             "Δ = paired difference to coupled of the same variant and seed, mean [95% t-interval]; "
             "`about_page` = the main solver's learned weight on what a page says about its own subject, "
             "`title_match` = on the page whose title is the mention (untrained 0) "
             "(the bounded variant was picked from a 5-seed exploration for its downstream difference, the "
             "question-keyed and careful-reader variants from one on seeds 100..102, the skill-led one from a grid "
             "on seeds 0..2 by its in-loop A alone, the given-source one as the paper's proposer protocol; "
             + ("these runs check them on seeds from 1000, which no exploration used by the account of the "
                "script's docstring (the bounded variant's exploration, and its seeds, are not in this "
                "repository: that account is not checked here)" if seeds[0] >= 1000 else
                "these seeds may overlap them: a check needs seeds from 1000 (`--first-seed`)")
             + "; see the script's docstring).", ""]
    gains: dict[tuple[str, str], dict] = {}  # (variant, arm) -> the paired difference to coupled
    for variant in VARIANTS:
        lines += [f"**{variant}** (`{' '.join(VARIANTS[variant]) or 'configs/default.toml'}`)", "",
                  "| treatment | F | T_P | A | macro Cover-EM | Δ macro vs coupled | about_page | title_match "
                  "| mixed, right label | mixed, wrong label | solved, right label |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        by_arm = {arm: sorted((r for r in rows if r["variant"] == variant and r["arm"] == arm),
                              key=lambda r: r["seed"]) for arm, _, _ in ARMS}
        base = by_arm["coupled"]
        for arm, runs in by_arm.items():
            cells = [fmt([r[m] for r in runs]) for m in ("F", "T_P", "A", "macro")]
            if arm == "coupled":
                cells.append("")
            else:
                ref = base if "no memory" not in arm else by_arm["coupled, no memory"]
                d = summary([r["macro"] - b["macro"] for r, b in zip(runs, ref)])
                gains[variant, arm] = d
                cells.append("" if runs is ref else interval_text(d))
            cells += [fmt([r[k] for r in runs], 2) for k in ("about_page", "title_match")]
            cells += [fmt([r[k] for r in runs]) for k in ("right", "wrong", "solved")]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("Δ for the no-memory CrossFit row is against coupled with no memory (the same ablation).")
    if horizon:
        lines += ["", *horizon_lines(horizon, args.horizon, seeds)]
    lines += ["", "Reading (numbers from the tables above):"]
    avg = functools.partial(mean_of, rows)

    for variant in VARIANTS:
        mean = functools.partial(avg, variant)

        cost = mean("coupled, no memory", "macro") - mean("coupled", "macro")
        gain = mean("crossfit", "macro") - mean("coupled", "macro")
        lines.append(f"- `{variant}`: the reuse path costs the coupled main solver {cost:+.3f} macro Cover-EM "
                     f"(no memory minus memory); CrossFit wins back {gain:+.3f} of it "
                     f"({gain / cost:.0%}) while cutting round-3 F from {mean('coupled', 'F'):.3f} to "
                     f"{mean('crossfit', 'F'):.3f}. `about_page` {mean('coupled', 'about_page'):.2f} (coupled) vs "
                     f"{mean('crossfit', 'about_page'):.2f} (CrossFit) vs "
                     f"{mean('coupled, no memory', 'about_page'):.2f} (no memory); `title_match` "
                     f"{mean('coupled', 'title_match'):.2f} vs {mean('crossfit', 'title_match'):.2f} vs "
                     f"{mean('coupled, no memory', 'title_match'):.2f}.")
        ceiling = mean(CEILING, "macro") - mean("coupled", "macro")
        lines.append(f"  Withholding every wrong label from the main solver would gain {ceiling:+.3f}; CrossFit's "
                     f"{gain:+.3f} is {gain / ceiling:.0%} of that ceiling. Items with a learning signal "
                     f"(mixed rollouts), right / wrong label: coupled {mean('coupled', 'right'):.3f} / "
                     f"{mean('coupled', 'wrong'):.3f}, CrossFit {mean('crossfit', 'right'):.3f} / "
                     f"{mean('crossfit', 'wrong'):.3f}; already solved, right label: coupled "
                     f"{mean('coupled', 'solved'):.3f}, CrossFit {mean('crossfit', 'solved'):.3f}.")
        cleaned = cleaned_share(rows, variant)
        lines.append(f"  CrossFit removes {cleaned:.0%} of the wrong labels the ceiling withholds (round-3 T_P "
                     f"{mean('coupled', 'T_P'):.3f} → {mean('crossfit', 'T_P'):.3f}); at that share, cleaner labels "
                     f"would be worth about {cleaned * ceiling:+.3f}, and CrossFit measures {gain:+.3f}.")
    # the words below are checked against the tables, variant by variant, not assumed
    def paired(v: str, key: str) -> dict:  # CrossFit − coupled of the same seed, with its 95% interval
        by_seed = {r["seed"]: r[key] for r in rows if r["variant"] == v and r["arm"] == "coupled"}
        return summary([r[key] - by_seed[r["seed"]] for r in rows if r["variant"] == v and r["arm"] == "crossfit"])

    # more solved items and fewer mixed ones, each an interval excluding 0
    shift = [v for v in VARIANTS if (paired(v, "solved")["lo"] or 0) > 0
             and all((paired(v, k)["hi"] or 0) < 0 for k in ("right", "wrong"))]
    halved = [v for v in VARIANTS if avg(v, "crossfit", "F") < 0.5 * avg(v, "coupled", "F")]
    behind = [v for v in VARIANTS if avg(v, "crossfit", "macro") < avg(v, "coupled", "macro")]
    gained = [v for v in VARIANTS if (gains[v, "crossfit"]["lo"] or 0) > 0]
    lines.append("- CrossFit changes who grades the proposer, not what the main solver trains on: the main solver "
                 "still trains on every admitted question, and its curriculum now follows the auxiliary solvers' "
                 f"frontier rather than its own; in {len(shift)} of {len(VARIANTS)} variants "
                 f"({', '.join(shift) or 'none'}) more of its items are ones it already answers five times out "
                 "of five (the solved column) and fewer carry a signal, right- and wrong-label alike (the mixed "
                 "columns; each of the three a paired difference by seed whose 95% interval excludes 0). "
                 "Most wrong labels are the proposer's own misreadings, "
                 "which no grader choice removes, so the share CrossFit can clean is small; the ceiling row "
                 "bounds what cleaner labels alone could buy in this world. CrossFit cuts round-3 F to under half "
                 f"of coupled's in {len(halved)} of {len(VARIANTS)} variants ({', '.join(halved) or 'none'}); its "
                 f"mean downstream difference is below zero in {len(behind)} of {len(VARIANTS)} "
                 f"({', '.join(behind) or 'none'}) and above zero with an interval excluding 0 in {len(gained)} "
                 f"({', '.join(gained) or 'none'}). "
                 + "Round-1 F (every arm shares round 1, graded before any reuse): "
                 + ", ".join(f"{v} {avg(v, 'coupled', 'F1'):.3f}" for v in VARIANTS) + ".")
    d = {k: {arm: avg("default", arm, k) for arm in ("coupled", "crossfit", "coupled, no memory", CEILING)}
         for k in ("solved", "title_match", "macro")}
    lines.append("- Why the reuse path costs more than its wrong labels (`default`): with a memory the main solver "
                 "soon answers its training items from memory, right ones included (solved, right label: "
                 f"coupled {d['solved']['coupled']:.3f}, ceiling {d['solved'][CEILING]:.3f}, no memory "
                 f"{d['solved']['coupled, no memory']:.3f}), and an item it answers five times out of five "
                 "teaches the reading weights nothing; those weights carry over to every benchmark question, a "
                 "memory row only to questions through its entity "
                 f"(`title_match` coupled {d['title_match']['coupled']:.2f}, ceiling "
                 f"{d['title_match'][CEILING]:.2f}, no memory {d['title_match']['coupled, no memory']:.2f}). "
                 "Cleaner labels do not change that (macro Cover-EM: ceiling "
                 f"{d['macro'][CEILING]:.3f}, CrossFit {d['macro']['crossfit']:.3f}, coupled "
                 f"{d['macro']['coupled']:.3f}, no memory {d['macro']['coupled, no memory']:.3f}).")
    text = "\n".join(lines)
    write_section(args.out, HEADING, text)
    console.print(text)
    if args.readme:
        write_block(REPO / "README.md", "downstream", "\n".join(readme_summary(rows, gains, horizon, args.horizon,
                                                                              seeds)))


if __name__ == "__main__":
    main()
