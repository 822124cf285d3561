"""Collect the numbers of a grid of runs (treatments x seeds) into one results dict: downstream
Cover-EM with 95% intervals and paired gains over coupled, audit metrics by round and by step,
compute and overhead, and the readings the paper draws from them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from selfevo._fmt import shown
from selfevo._software import software_tally
from selfevo.algos import summary
from selfevo.audit import METRICS, mean_hop_mix
from selfevo.evaluate import benchmark_order
from selfevo.report.compare import compare
from selfevo.runs import RunDir, check_loop_run, differences, made_on

# what may differ between the runs of one report: every other field is the setting they share
_VARIED = ("treatment", "seed")


_GROUPS = ("macro", "single_hop", "multi_hop")  # the averages over benchmarks an evaluation holds


def _eval_row(run: RunDir, round: int) -> dict:
    score = run.evaluation(round)
    row = {b: v["cover_em"] for b, v in score["benchmarks"].items()}
    row.update({g: score[g]["cover_em"] for g in _GROUPS})
    return row


def collect_runs(run_dirs: Sequence[str | os.PathLike]) -> dict:
    """One run per (treatment, seed): two are an error (which one counts is not ours to guess).
    Runs not complete are left out of every number and listed under "excluded": an interrupted
    run stops rounds short, and its last evaluation pooled with the finished runs' would move the
    means without a word. Leaving it out (rather than refusing) still reports a grid in which a
    job failed, as `selfevo demo` does."""
    runs: dict[str, dict[int, RunDir]] = {}
    seen: dict[tuple[str, int], Path] = {}
    done: dict[Path, int] = {}  # rounds completed, by run directory
    manifests = []  # of the complete runs
    excluded = []
    rules: dict[str, tuple[str | None, Path]] = {}  # by treatment: the function behind a user's, and a run of it
    setting: tuple[dict, Path] | None = None  # the config every complete run shares, but _VARIED
    data: tuple[dict, Path] | None = None  # and the world directory or corpus they were made on
    for d in run_dirs:
        run = RunDir(d)
        cfg, manifest = run.config(), run.manifest()  # checked: a damaged file is named
        check_loop_run(manifest, run.path, cfg["loop"]["rounds"])
        treatment, seed = cfg["treatment"], cfg["seed"]
        if (treatment, seed) in seen:
            raise ValueError(f"two runs of {treatment} seed {seed}: {seen[treatment, seed]} and {run.path}; "
                             "a report pools one run per treatment and seed, so move one of them elsewhere")
        seen[treatment, seed] = run.path
        if manifest.get("status") != "complete":
            excluded.append({"run": str(run.path), "treatment": treatment, "seed": seed,
                             # "running" is also what a stopped or killed run's manifest says: a kill -9
                             # leaves no chance to write another status, so both are said
                             "why": f"status {manifest.get('status')!r}"
                                    + (" (still running, or stopped: `selfevo evolve --out RUN --resume` goes on)"
                                       if manifest.get("status") == "running" else "")
                                    + f", {manifest.get('rounds_completed', 0)} round(s) done"})
            continue
        # runs of another setting (rounds, world, learner...) pooled under one treatment name, or
        # paired with a coupled run of another setting, would mix numbers that mean different things
        setting = _same(setting, {**{k: v for k, v in cfg.items() if k not in _VARIED}, "engine": run.engine_setting(),
                                  **({"agents": manifest["agents"]} if manifest.get("agents") else {})},
                        run.path,
                        "were made with different configs",
                        "a report compares treatments and seeds of one config, so report them apart")
        # one config names a world directory or corpus by path: what lay there may have been remade
        data = _same(data, made_on(manifest), run.path,
                        "were made on different data under one path (the sha256 their manifests record)",
                        "a report compares treatments and seeds on one world or corpus, so report them apart")
        # a user's treatment: one function behind its name in every run pooled under it
        if (made_by := rules.setdefault(treatment, (manifest.get("rules"), run.path)))[0] != manifest.get("rules"):
            raise ValueError(f"{made_by[1]} and {run.path}: treatment {treatment!r} made by {made_by[0]} and by "
                             f"{manifest.get('rules')}; a report pools the runs of one treatment's rules, so report "
                             "them apart")
        runs.setdefault(treatment, {})[seed] = run
        done[run.path] = manifest.get("rounds_completed", 0)
        manifests.append(manifest)
    if not runs:
        raise ValueError(f"no complete run among the {len(excluded)} found ({excluded[0]['run']}: "
                         f"{excluded[0]['why']}); finish them with `selfevo evolve --resume`")
    treatments = sorted(runs, key=lambda t: (t != "coupled", t))
    seeds = sorted({s for by_seed in runs.values() for s in by_seed})
    # the last evaluation of every run, and the untrained base model's (round 0, identical across
    # treatments of a seed) of every seed any treatment completed, not only the first treatment's
    finals = {t: {s: _eval_row(r, done[r.path]) for s, r in runs[t].items()} for t in treatments}
    base_rows = [_eval_row(next(runs[t][s] for t in treatments if s in runs[t]), 0) for s in seeds]
    # the benchmarks the runs were evaluated on (macro averages them all), the paper's seven first
    benchmarks = benchmark_order({b for row in [*base_rows, *(r for f in finals.values() for r in f.values())]
                                  for b in row} - set(_GROUPS))
    columns = [*benchmarks, *_GROUPS]

    out: dict = {"treatments": treatments, "seeds": seeds, "benchmarks": benchmarks, "downstream": {},
                 "audit": {}, "compute": {}, "excluded": excluded}
    if made_by := {t: rules[t][0] for t in treatments if rules[t][0]}:
        out["rules"] = made_by  # what each treatment of a user's ran (its manifests' `rules`)
    if manifests and (agents := manifests[0].get("agents")):  # one for all: the setting check above
        out["learners"] = agents  # a user's learners ran every run, not selfevo's
    audits, out["audit_setting"] = _audits(runs, done)
    out["base"] = {c: summary([r.get(c) for r in base_rows]) for c in columns}
    coupled = finals.get("coupled", {})
    for t in treatments:
        rows = finals[t]
        entry = {c: summary([row.get(c) for row in rows.values()]) for c in columns}
        entry["seeds"] = sorted(rows)  # every number of the treatment's rows is over these (render.seeds_note)
        if coupled and t != "coupled":
            common = sorted(set(rows) & set(coupled))
            # a column with no value (e.g. no multi-hop benchmark in a corpus's QA set) has no gain
            entry["gain_vs_coupled"] = {c: summary([_minus(rows[s][c], coupled[s][c]) for s in common])
                                        for c in _GROUPS}
        out["downstream"][t] = entry
        by_seed = audits[t]
        mine = list(by_seed.values())
        n_rounds = min((len(a["rounds"]) for a in mine), default=0)
        out["audit"][t] = {
            # admitted count and hop mix beside F: lower F could come from fewer hard questions
            "rounds": [{"round": i + 1, **{m: summary([a["rounds"][i][m] for a in mine]) for m in METRICS},
                        "admitted": summary([a["rounds"][i].get("admitted") for a in mine]),
                        "hop_mix_admitted": mean_hop_mix([a["rounds"][i].get("hop_mix_admitted", {})
                                                          for a in mine])}
                       for i in range(n_rounds)],
            "steps": _mean_steps(mine),
            "first_by_seed": {s: a["rounds"][0] for s, a in by_seed.items() if a["rounds"]},
            "last_by_seed": {s: a["rounds"][-1] for s, a in by_seed.items() if a["rounds"]},
            # complete runs made with `evolve --no-audit`: in the downstream numbers, not the audit's
            "unaudited": sorted(set(runs[t]) - set(by_seed)),
        }
    rows = compare([r.path for by_seed in runs.values() for r in by_seed.values()])
    for t in treatments:
        mine = [r for r in rows if r["treatment"] == t]
        out["compute"][t] = {k: summary([r[k] for r in mine]) for k in
                             ("generations", "updates", "seconds", "extra_generations", "extra_updates",
                              "extra_seconds")}
    out["readings"] = readings(out)
    out["software"] = software_tally(manifests)
    return out


def _audits(runs: dict[str, dict[int, RunDir]],
            done: dict[Path, int]) -> tuple[dict[str, dict[int, dict]], dict | None]:
    """The audit metrics of every audited run, by treatment and seed, and the setting they share:
    audits by two judges (or one that read only some items of each step) pooled or paired would
    mix numbers that mean different things, so that is refused, naming both runs. So is an audit
    of fewer rounds than its run completed (made while the run was stopped, then resumed with
    --no-audit): the report would cut every seed's table at its rounds and pair its last round with
    the other seeds' last."""
    out: dict[str, dict[int, dict]] = {}
    setting: tuple[dict, Path] | None = None
    for t, by_seed in runs.items():
        out[t] = {}
        for s, run in by_seed.items():
            if not (run.path / "audit" / "metrics.json").exists():
                continue
            metrics = out[t][s] = run.audit_metrics()
            audited = [r["round"] for r in metrics["rounds"]]
            if audited != list(range(1, done[run.path] + 1)):
                raise ValueError(f"{run.path / 'audit' / 'metrics.json'}: audits round(s) "
                                 f"{', '.join(map(str, audited)) or 'none'} of a run that completed "
                                 f"{done[run.path]}; audit it again (`selfevo audit {run.path}`) before reporting it")
            setting = _same(setting, {"judge": metrics.get("judge"), **run.audit_setting()}, run.path,
                            "were audited differently", "audit them alike (`selfevo audit RUN` with one judge, "
                            "every item; an LLM judge's audit is read here when written with --out RUN/audit) "
                            "before reporting them together")
    return out, setting and setting[0]


def _same(first: tuple[dict, Path] | None, mine: dict, path: Path, differ: str, advice: str) -> tuple[dict, Path]:
    """The first run's `mine` and its path, which every later run's must equal: a run that differs
    is refused, naming both runs and the fields."""
    if first is None:
        return mine, path
    if mine != first[0]:
        raise ValueError(f"{path} and {first[1]} {differ} (fields: {', '.join(differences(first[0], mine))}); "
                         f"{advice}")
    return first


def _minus(a: float | None, b: float | None) -> float | None:
    """A paired difference, None where either side has no value (summary skips it)."""
    return None if a is None or b is None else a - b


def _mean_steps(audits: list[dict]) -> list[dict]:
    """Per-step metrics averaged over seeds (steps align: same schedule)."""
    if not audits:
        return []
    n = min(len(a["steps"]) for a in audits)
    steps = []
    for i in range(n):
        first = audits[0]["steps"][i]
        steps.append({"step": first["step"], "round": first["round"], "kind": first["kind"],
                      **{m: summary([a["steps"][i][m] for a in audits])["mean"] for m in METRICS}})
    return steps


def _mean_over(by_seed: dict, seeds: list, metric: str) -> float | None:
    return summary([by_seed[s][metric] for s in seeds])["mean"]


def _valued(seeds, *by_seeds: dict, metrics=("F", "A", "T_P")) -> list:
    """The seeds with a value of every metric in each of `by_seeds` (a judge that resolved nothing
    in a round leaves None), so that a paired difference and the means beside it share one seed set."""
    return sorted(s for s in seeds if all(b[s][m] is not None for b in by_seeds for m in metrics))


def readings(res: dict) -> list[str]:
    """The paper's qualitative findings, stated only where the numbers show them: a difference is
    paired by seed and claimed only where its 95% interval excludes 0, and the means quoted beside it
    are over the same seeds."""
    out = []
    coupled = res["audit"].get("coupled")
    if coupled and len(coupled["rounds"]) >= 2:
        first, last = coupled["first_by_seed"], coupled["last_by_seed"]
        seeds = _valued(set(first) & set(last), first, last)
        d_f = summary([_minus(last[s]["F"], first[s]["F"]) for s in seeds])
        f1, fl = _mean_over(first, seeds, "F"), _mean_over(last, seeds, "F")
        a1, al = _mean_over(first, seeds, "A"), _mean_over(last, seeds, "A")
        t1, tl = _mean_over(first, seeds, "T_P"), _mean_over(last, seeds, "T_P")
        n_rounds = len(coupled["rounds"])
        # a rise the 3 printed decimals do not show ("rises from 0.060 to 0.060") is not claimed
        if d_f["mean"] is not None and shown(fl) > shown(f1) and None not in (a1, al, t1, tl):
            said = (f"Coupled loop: false agreement F rises from {f1:.3f} (round 1) to {fl:.3f} (round {n_rounds}) "
                    f"while A goes {a1:.3f} -> {al:.3f} and label truth T_P {t1:.3f} -> {tl:.3f}")
            if d_f["n"] < 2 or d_f["lo"] is None:
                out.append(said + f" ({d_f['n']} seed: no interval, the rise is not settled).")
            elif d_f["lo"] <= 0:
                out.append(said + f", but the paired 95% interval of the rise [{d_f['lo']:+.3f}, {d_f['hi']:+.3f}] "
                           f"({d_f['n']} seeds) includes 0: more seeds would settle it.")
            elif shown(al) > shown(a1):  # a rise of A the printed "A goes ..." shows, as for F
                out.append(said + f" (rise {d_f['mean']:+.3f}, paired 95% interval [{d_f['lo']:+.3f}, "
                           f"{d_f['hi']:+.3f}], {d_f['n']} seeds): rising agreement is partly co-cheating.")
            else:
                out.append(said + f" (rise {d_f['mean']:+.3f}, paired 95% interval [{d_f['lo']:+.3f}, "
                           f"{d_f['hi']:+.3f}], {d_f['n']} seeds): more of the agreement is on wrong labels, "
                           "though agreement itself did not rise.")
    for t, a in res["audit"].items():
        if a.get("unaudited"):
            out.append(f"{t}: seed(s) {', '.join(map(str, a['unaudited']))} not audited (`selfevo audit RUN`); "
                       "the audit numbers leave them out.")
        if t == "coupled" or not coupled or not a["rounds"]:
            continue
        seeds = _valued(set(a["last_by_seed"]) & set(coupled["last_by_seed"]), a["last_by_seed"],
                        coupled["last_by_seed"])

        def paired(metric: str, seeds=seeds, a=a) -> dict:
            return summary([_minus(a["last_by_seed"][s][metric], coupled["last_by_seed"][s][metric])
                            for s in seeds])

        d_a, d_tp = paired("A"), paired("T_P")
        if d_a["n"] < 1:
            continue
        quoted = {m: [shown(_mean_over(by["last_by_seed"], seeds, m)) for by in (a, coupled)] for m in ("A", "T_P")}
        # lower A, higher T_P, as the quoted means (3 decimals) show them: "A 0.500 vs coupled 0.500"
        # is no "looks worse" (the paired means are these means' difference: both over the same seeds)
        if not (quoted["A"][0] < quoted["A"][1] and quoted["T_P"][0] > quoted["T_P"][1]):
            continue

        def means(metric: str, vs: str = "vs", seeds=seeds, a=a) -> str:  # over the seeds the test pairs
            return (f"{metric} {_mean_over(a['last_by_seed'], seeds, metric):.3f} {vs} "
                    f"{_mean_over(coupled['last_by_seed'], seeds, metric):.3f}")

        # F is quoted beside T_P as measured, not as a part of "better": it can be higher too
        pattern = (f"{t}: agreement looks worse ({means('A', 'vs coupled')}) while label truth is "
                   f"better ({means('T_P')}; seeds {', '.join(map(str, seeds))}; false agreement {means('F')})")
        if d_a["n"] < 2 or d_a["lo"] is None or d_tp["lo"] is None:  # as the coupled rise says of one seed
            out.append(pattern + f" ({d_a['n']} seed: no interval, the pattern is not settled).")
        elif d_a["hi"] < 0 and d_tp["lo"] > 0:  # both paired intervals exclude 0 in the telling direction
            out.append(pattern + ". An operator watching only in-loop agreement would call this a regression.")
        else:  # the means show the pattern, the seeds do not yet settle it: say both
            out.append(pattern + f" on average over {d_a['n']} seeds, but the paired 95% intervals (A "
                       f"[{d_a['lo']:+.3f}, {d_a['hi']:+.3f}], T_P [{d_tp['lo']:+.3f}, {d_tp['hi']:+.3f}]) "
                       "do not both exclude 0: more seeds would settle it.")
    for t, d in res["downstream"].items():
        g = d.get("gain_vs_coupled", {}).get("macro")
        if g and g["n"] > 1 and g["lo"] is not None:
            verdict = ("an interval excluding 0" if g["lo"] > 0 or g["hi"] < 0 else "an interval including 0")
            out.append(f"{t}: downstream macro Cover-EM {g['mean']:+.3f} vs coupled, 95% interval "
                       f"[{g['lo']:+.3f}, {g['hi']:+.3f}] ({verdict}; {g['n']} seeds).")
    return out


def find_runs(root: str | os.PathLike) -> list[Path]:
    """Every run directory below `root`."""
    return sorted(p.parent for p in Path(root).rglob("manifest.json") if (p.parent / "config.json").exists())
