"""The post-hoc audit: judge every saved step item, compute A/T_P/T_S/F/L/coverage per step and
per round. Reads only the run directory (and the judge's own source of truth); writes only
`RUN_DIR/audit/`. Nothing in the loop reads what it writes."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence

from selfevo._plugins import ContractError
from selfevo.algos import float_sum
from selfevo.audit.judges import Judge, OracleJudge, Verdict
from selfevo.audit.metrics import METRICS, JudgedItem, audit_metrics
from selfevo.evaluate import answers_match
from selfevo.runs import RunDir

__all__ = ["METRICS", "Judge", "JudgedItem", "OracleJudge", "Verdict", "audit_metrics", "audit_run", "checked_verdicts",
           "hop_mix_text", "mean_hop_mix"]


def _judged(item: dict, verdict: Verdict) -> JudgedItem:
    matches = tuple(answers_match(r, item["adopted_label"]) for r in item["responses"])
    return JudgedItem(matches, verdict.resolved, verdict.label_correct, verdict.responses_correct)


def _mix(items: Sequence[dict]) -> dict:
    """The hop mix of items: lower F could come from fewer hard questions (DESIGN §1)."""
    counts = Counter(it["hops"] for it in items)
    n = sum(counts.values())
    return {str(h): round(c / n, 4) for h, c in sorted(counts.items())} if n else {}


def mean_hop_mix(mixes: Sequence[dict]) -> dict:
    """Hop mixes (as `audit_steps` writes them) averaged over runs: a hop count a run never
    admitted counts as share 0 there. A run that admitted nothing has no mix (0 of 0, written as {}):
    it is left out, not averaged in as shares of 0, which would make the mix sum to less than 1."""
    mixes = [m for m in mixes if m]
    hops = sorted({h for m in mixes for h in m}, key=int)
    return {h: round(float_sum(m.get(h, 0.0) for m in mixes) / len(mixes), 4) for h in hops}


def hop_mix_text(mix: dict) -> str:
    """`1: 0.40, 2: 0.30, ...`: the shares of a hop mix, each named by its hop count."""
    return ", ".join(f"{h}: {share:.2f}" for h, share in mix.items()) or "-"


def checked_verdicts(judge: Judge, items: Sequence[dict], verdicts) -> list[Verdict]:
    """`judge`'s verdicts on `items` as a list: one `Verdict` an item, in order, a resolved one saying whether
    the label and each response are right (booleans). A judge of a user's that answers otherwise is named
    with the item, not met later as a TypeError in the metrics (or a generator read twice)."""
    import dataclasses

    import numpy as np

    def truth_value(x) -> bool:  # a bool, or numpy's (a judge built on array comparisons)
        return isinstance(x, bool | np.bool_)

    name = getattr(judge, "name", type(judge).__name__)
    try:
        verdicts = list(verdicts)
    except TypeError:
        raise ContractError(f"judge {name!r}: judge() returns a list of Verdict, one an item; got "
                            f"{type(verdicts).__name__}") from None
    if len(verdicts) != len(items):
        raise ContractError(f"judge {name!r}: {len(verdicts)} verdicts for {len(items)} items")
    out = []
    for it, v in zip(items, verdicts):
        where = f"judge {name!r}, item {it.get('item_id', '?')!r}"
        if not isinstance(v, Verdict):
            raise ContractError(f"{where}: a {type(v).__name__}, not a selfevo.audit.Verdict")
        if not truth_value(v.resolved):
            raise ContractError(f"{where}: resolved is {v.resolved!r}, not True or False")
        if v.resolved and not (truth_value(v.label_correct)
                               and isinstance(v.responses_correct, tuple | list | np.ndarray)
                               and all(map(truth_value, v.responses_correct))
                               and len(v.responses_correct) == len(it["responses"])):
            raise ContractError(f"{where}: a resolved verdict needs label_correct (True or False) and "
                                "responses_correct (a tuple or list of one True or False a response: "
                                f"{len(it['responses'])}); got "
                                f"{v.label_correct!r}, {v.responses_correct!r}")
        if v.resolved:  # Python's own: written as JSON later
            v = dataclasses.replace(v, resolved=True, label_correct=bool(v.label_correct),
                                    responses_correct=tuple(map(bool, v.responses_correct)))
        out.append(v if v.resolved else dataclasses.replace(v, resolved=False))
    return out


def audit_steps(steps: Sequence[dict], judge: Judge, verdicts: Sequence[Verdict] | None = None) -> dict:
    """Per step (both kinds) and per round. Round metrics aggregate the proposer steps, whose
    responses are the grader's (the feedback the proposer is paid with); `solver` holds the same
    metrics over the main solver's training rollouts.

    The judge sees every item in one call (an LLM judge batches, caches and parallelises across
    steps); `verdicts`, aligned with the items of `steps` in order, skips the call."""
    # malformed proposals (kept apart in the step record) were never graded: only counted
    malformed = Counter()
    for st in steps:
        malformed[st["round"]] += len(st.get("malformed", ()))
    flat = [it for st in steps for it in st["items"]]
    verdicts = checked_verdicts(judge, flat, judge.judge(flat) if verdicts is None else verdicts)
    per_step, by_round, pos = [], {}, 0
    for st in steps:
        items = st["items"]
        judged = [_judged(it, v) for it, v in zip(items, verdicts[pos:pos + len(items)], strict=True)]
        pos += len(items)
        per_step.append({"round": st["round"], "step": st["step"], "kind": st["kind"],
                         **audit_metrics(judged)})
        slot = by_round.setdefault(st["round"], {"proposer": ([], []), "solver": ([], [])})
        slot[st["kind"]][0].extend(judged)
        slot[st["kind"]][1].extend(items)
    rounds = []
    for r in sorted(by_round):
        (pj, pi), (sj, _) = by_round[r]["proposer"], by_round[r]["solver"]
        admitted = [it for it in pi if it.get("admitted")]
        rounds.append({"round": r, **audit_metrics(pj), "admitted": len(admitted), "malformed": malformed[r],
                       "hop_mix_admitted": _mix(admitted), "solver": audit_metrics(sj)})
    return {"judge": judge.name, "rounds": rounds, "steps": per_step}


def audit_run(run: RunDir | str | os.PathLike, judge: Judge, out: str | os.PathLike | None = None, *,
              truth: Judge | str | None = None) -> dict:
    """Audit a finished run (a RunDir or its directory) as `selfevo audit` does (metrics.json, judge.json, and
    an LLM judge's judgements.jsonl), without figures; returns the metrics. Into `out`, by default RUN/audit:
    the run's own audit, which `report` and `compare` read (a world run ends with the oracle's there: give
    another judge's an `out` of its own, as `selfevo audit --judge llm` writes RUN/audit/llm).

    `truth`: a judge to validate `judge` against (`--compare`): "oracle", the exact truth of the run's world,
    or any Judge; comparison.json and comparison.md are written beside the metrics (docs/judge.md)."""
    from selfevo.audit.pipeline import audit_to_dir  # it imports this module
    from selfevo.runs import RunError

    if not isinstance(run, RunDir):
        run = RunDir(run)
    if not run.exists():  # else its steps are none, and an empty audit is written for a run that is not there
        raise RunError(f"{run.path}: not a run directory (no run manifest.json)")
    if getattr(judge, "documents", ...) is None:  # an LLM judge made without the run's documents
        raise ValueError(f"{getattr(judge, 'name', 'the judge')}: made without documents, it would leave every "
                         "item unresolved (no source document); give it the run's: "
                         "documents=selfevo.search.docstore.contents_by_id(...) of the run's world or corpus")
    if truth == "oracle":
        from selfevo.evolve import check_world, environment

        cfg = run.run_config()
        if cfg.data.corpus:  # before any index of it is opened or built
            raise ValueError(f"{run.path}: a run on a real corpus has no exact truth to compare the judge with")
        check_world(run, cfg)  # the truth of the world the run was made on, not of one remade since
        truth = OracleJudge(environment(cfg, benchmarks=False).truth)
    elif isinstance(truth, str):
        raise ValueError(f"truth: 'oracle' or a Judge, got {truth!r}")
    return audit_to_dir(run.steps(), judge, run.path / "audit" if out is None else out, truth=truth,
                        figures=False)["metrics"]
