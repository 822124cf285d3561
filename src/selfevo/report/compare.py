"""`selfevo compare`: compute overhead of treatments against the coupled run of the same seed
(the paper's Table 3), next to what each run bought (F, T_P, A in the last round; Cover-EM). The cost
is the training's: generations and wall seconds leave out the downstream evaluation (`training_cost`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from selfevo.loop.engine import EVAL_GENERATIONS, EVAL_PHASE
from selfevo.runs import RunDir, RunError, check_loop_run, made_on


@dataclass
class RunSummary:
    path: Path
    treatment: str
    seed: int
    generations: int
    updates: int
    seconds: float
    last_round: dict | None  # audit metrics of the last round, if audited
    cover_em: float | None  # main solver macro Cover-EM after the last round
    # what a treatment's run must share with its coupled run: the config but the treatment, the data
    # it was made on (a world directory or corpus remade under one path), the rounds done (compute.json
    # counts those only), for an engine-run its [engine] table (`RunDir.engine_setting`), and a user's learners
    setting: str = ""
    unfinished: str | None = None  # "9 of 10 rounds" for a run not complete (killed, or still running)
    stale_audit: str | None = None  # "rounds 1-2 of 3": an audit made before the run went on (no F, T_P, A)
    audit: str | None = None  # how it was audited: "oracle", "llm:MODEL (prompt v2), the first 2 items a step"

    @classmethod
    def load(cls, path: str | os.PathLike) -> RunSummary:
        run = RunDir(path)
        if not run.exists():
            raise RunError(f"{path}: not a run directory (no run manifest.json)")
        cfg = run.config()
        if not (run.path / "compute.json").exists():
            raise RunError(f"{path}: no compute.json (the run has not finished a round)")
        compute = run.compute()
        metrics = run.audit_metrics() if (run.path / "audit" / "metrics.json").exists() else None
        rounds = metrics["rounds"] if metrics else []
        manifest = run.manifest()
        check_loop_run(manifest, run.path, cfg["loop"]["rounds"])
        done = manifest.get("rounds_completed", 0)
        stale = None
        if rounds and rounds[-1]["round"] != done:
            # an audit of fewer rounds (made before a resume) would put an older round's F beside this
            # round's Cover-EM: no audit figures, as the report refuses such a run (`selfevo audit` again)
            stale, rounds = f"rounds 1-{rounds[-1]['round']} of {done}", []
        cover = run.evaluation(done)["macro"]["cover_em"] if run.eval_path(done).exists() else None
        setting = json.dumps([{k: v for k, v in cfg.items() if k != "treatment"}, made_on(manifest), done,
                              run.engine_setting(), manifest.get("agents")], sort_keys=True)
        generations, seconds = training_cost(compute)
        unfinished = None if manifest.get("status") == "complete" else f"{done} of {cfg['loop']['rounds']} rounds"
        return cls(run.path, cfg["treatment"], cfg["seed"], generations, compute["total_updates"], seconds,
                   rounds[-1] if rounds else None, cover, setting, unfinished, stale,
                   metrics and describe_audit(metrics.get("judge"), **run.audit_setting()))


def describe_audit(judge: str | None, prompt_version: str | None, max_items_per_step: int | None) -> str:
    """An audit's judge and what it read, in words: two runs' F, T_P and A compare only when these match."""
    prompt = f" (prompt {prompt_version})" if prompt_version else ""
    items = f", the first {max_items_per_step} items a step" if max_items_per_step else ""
    return f"{judge or 'unknown judge'}{prompt}{items}"


def training_cost(compute: dict) -> tuple[int, float]:
    """(generations, wall seconds) of a run's training, from its compute.json: all but the downstream
    evaluation's, which is the same in every arm (it would dilute each overhead towards 0)."""
    generations = compute["total_generations"] - compute["generations"].get(EVAL_GENERATIONS, 0)
    # (an engine run made before its audit was left out of compute.json has its seconds under "audit")
    return generations, sum(v for k, v in compute["seconds"].items() if k not in (EVAL_PHASE, "audit"))


def unique_dirs(paths: list[str | os.PathLike]) -> list[str | os.PathLike]:
    """The paths in order, each directory once: `runs/a` and `./runs/a/` (or a link to it) are one run,
    which would otherwise be two coupled runs of one seed, or a treatment's row twice."""
    seen: set[Path] = set()
    unique = []
    for p in paths:
        key = Path(p).resolve()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


def compare(paths: list[str | os.PathLike]) -> list[dict]:
    """One row per run, with ratios against the coupled run of the same seed, config, data, rounds done
    and [engine] table (None if absent)."""
    runs = [RunSummary.load(p) for p in unique_dirs(paths)]
    base: dict[str, RunSummary] = {}
    for r in runs:
        if r.treatment == "coupled":
            if r.setting in base:  # which one is the base is not ours to guess
                raise RunError(f"two coupled runs of seed {r.seed} with one config: {base[r.setting].path} and "
                               f"{r.path}; compare against one of them")
            base[r.setting] = r
    rows = []
    for r in runs:
        b = base.get(r.setting)  # the setting holds the seed

        def ratio(x: float, y: float | None) -> float | None:
            return None if not y else x / y - 1.0

        rows.append({
            "run": str(r.path), "treatment": r.treatment, "seed": r.seed,
            "generations": r.generations, "updates": r.updates, "seconds": round(r.seconds, 3),
            "extra_generations": ratio(r.generations, b and b.generations),
            "extra_updates": ratio(r.updates, b and b.updates),
            "extra_seconds": ratio(r.seconds, b and b.seconds),
            "F": r.last_round and r.last_round["F"], "T_P": r.last_round and r.last_round["T_P"],
            "A": r.last_round and r.last_round["A"], "cover_em": r.cover_em, "unfinished": r.unfinished,
            "stale_audit": r.stale_audit, "audit": r.audit,
        })
    return rows
