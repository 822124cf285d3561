"""Audit the auditor: a judge's A / T_P / T_S / F / L / coverage next to a truth judge's (the
oracle on a world run, gold answers on external records), per round, with the difference and a
paired bootstrap 95% interval, and the judge's confusion matrix against truth.

The bootstrap resamples items (the unit a judge resolves or not) with replacement, B times; in each
resample both audits are recomputed exactly as `audit_metrics` computes them (each judge over its
own resolved items), and the interval is the 2.5th..97.5th percentile of judge - truth. Resamples
where a metric is undefined for either judge (nothing resolved) are skipped and counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from selfevo._fmt import DASH, num
from selfevo.audit import METRICS, JudgedItem, Verdict, _judged, audit_metrics

STATES = ("correct", "incorrect", "unresolved")
# per-item count columns: resolved, pairs, agreeing pairs, correct responses, false agreement,
# lost credit, label correct
_COLS = ("resolved", "pairs", "a", "ts", "f", "l", "tp")
_BOOT_CELLS = 1 << 22  # resample weights held at once by the bootstrap (int64: 32 MB)


def _counts(j: JudgedItem) -> list[int]:
    if not j.resolved:
        return [0] * len(_COLS)
    wrong = not j.label_correct
    return [1, len(j.matches), sum(j.matches), sum(j.responses_correct),
            sum(m and wrong for m in j.matches), sum(c and wrong for c in j.responses_correct), int(j.label_correct)]


def _metrics_from_sums(s: np.ndarray, n_items: int | np.ndarray) -> dict[str, np.ndarray]:
    """Vectorised audit_metrics over count sums (last axis = _COLS)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        resolved, pairs = s[..., 0], s[..., 1]
        pairs_ok = np.where(pairs > 0, pairs, np.nan)
        res_ok = np.where((resolved > 0) & (pairs > 0), resolved, np.nan)
        return {"A": s[..., 2] / pairs_ok, "T_P": s[..., 6] / res_ok, "T_S": s[..., 3] / pairs_ok,
                "F": s[..., 4] / pairs_ok, "L": s[..., 5] / pairs_ok, "coverage": resolved / n_items}


def _state(v: Verdict, i: int) -> str:
    if not v.resolved:
        return "unresolved"
    ok = v.label_correct if i == 0 else v.responses_correct[i - 1]
    return "correct" if ok else "incorrect"


def confusion(items: Sequence[dict], judge: Sequence[Verdict], truth: Sequence[Verdict]) -> dict:
    """Counts of (judge state, truth state) over adopted labels and over responses, and the
    judge's accuracy where both resolved."""
    out: dict[str, Any] = {}
    for part in ("labels", "responses"):
        m = {a: {b: 0 for b in STATES} for a in STATES}
        for it, jv, tv in zip(items, judge, truth, strict=True):
            idx = [0] if part == "labels" else range(1, len(it["responses"]) + 1)
            for i in idx:
                m[_state(jv, i)][_state(tv, i)] += 1
        both = sum(m[a][b] for a in STATES[:2] for b in STATES[:2])
        right = m["correct"]["correct"] + m["incorrect"]["incorrect"]
        out[part] = {"matrix": m, "both_resolved": both, "accuracy_when_both_resolved": right / both if both else None,
                     "false_correct": m["correct"]["incorrect"], "false_incorrect": m["incorrect"]["correct"]}
    return out


def _round_block(items: list[dict], jv: list[Verdict], tv: list[Verdict], n_boot: int,
                 rng: np.random.Generator) -> dict:
    jj = [_judged(it, v) for it, v in zip(items, jv, strict=True)]
    tj = [_judged(it, v) for it, v in zip(items, tv, strict=True)]
    judge_m, truth_m = audit_metrics(jj), audit_metrics(tj)
    n = len(items)
    diff: dict[str, dict] = {}
    if n:
        cj = np.array([_counts(x) for x in jj], dtype=np.int64)
        ct = np.array([_counts(x) for x in tj], dtype=np.int64)
        # paired resampling: the same resampled items for both judges (multinomial weights), drawn a
        # block of resamples at a time so the weights held stay under _BOOT_CELLS (the whole
        # n_boot x n matrix was 1.6 GB at 100,000 items). Generator.multinomial draws its rows one
        # after another from the stream, so the blocks are the same numbers as one draw of n_boot rows.
        p, rows = np.full(n, 1.0 / n), max(1, _BOOT_CELLS // n)
        sj, st = np.empty((n_boot, len(_COLS)), np.int64), np.empty((n_boot, len(_COLS)), np.int64)
        for start in range(0, n_boot, rows):
            w = rng.multinomial(n, p, size=min(rows, n_boot - start))
            sj[start:start + len(w)], st[start:start + len(w)] = w @ cj, w @ ct
        bj, bt = _metrics_from_sums(sj, n), _metrics_from_sums(st, n)
        for m in METRICS:
            d = bj[m] - bt[m]
            ok = d[~np.isnan(d)]
            point = None if judge_m[m] is None or truth_m[m] is None else judge_m[m] - truth_m[m]
            lo, hi = (np.percentile(ok, [2.5, 97.5]).tolist() if ok.size and point is not None else (None, None))
            diff[m] = {"diff": point, "lo": lo, "hi": hi, "resamples": int(ok.size)}
    return {"items": n, "judge": judge_m, "truth": truth_m, "diff": diff, "confusion": confusion(items, jv, tv)}


def compare_judges(steps: Sequence[dict], judge_verdicts: Sequence[Verdict], truth_verdicts: Sequence[Verdict],
                   judge_name: str, truth_name: str, n_boot: int = 2000, seed: int = 0,
                   kind: str = "proposer") -> dict:
    """Per round over `kind` steps (the round metrics of the audit use the proposer steps), then
    over all rounds. Verdicts are aligned with the items of `steps` in order."""
    flat = [(st, it) for st in steps for it in st["items"]]
    if not (len(flat) == len(judge_verdicts) == len(truth_verdicts)):
        raise ValueError("verdicts and items differ in number")
    rng = np.random.default_rng(seed)
    by_round: dict[int, tuple[list, list, list]] = {}
    for (st, it), jv, tv in zip(flat, judge_verdicts, truth_verdicts):
        if st["kind"] != kind:
            continue
        slot = by_round.setdefault(st["round"], ([], [], []))
        slot[0].append(it)
        slot[1].append(jv)
        slot[2].append(tv)
    rounds = [{"round": r, **_round_block(*by_round[r], n_boot, rng)} for r in sorted(by_round)]
    every = tuple(sum((list(by_round[r][i]) for r in sorted(by_round)), []) for i in range(3))
    return {"judge": judge_name, "truth": truth_name, "kind": kind, "bootstrap": {"resamples": n_boot, "seed": seed},
            "rounds": rounds, "all": _round_block(*every, n_boot, rng)}


# ---------------------------------------------------------------- presentation


def comparison_markdown(cmp: dict) -> str:
    """The side-by-side table, the coverage and the confusion matrices as Markdown."""
    j, t = cmp["judge"], cmp["truth"]
    lines = [f"Judge `{j}` against truth `{t}` over {cmp['kind']} steps; difference = judge − truth, "
             f"paired bootstrap 95% interval over items ({cmp['bootstrap']['resamples']} resamples, "
             f"seed {cmp['bootstrap']['seed']}).", "",
             "| round | metric | truth | judge | judge − truth | 95% interval |",
             "|---|---|---:|---:|---:|---|"]
    for block in [*cmp["rounds"], {"round": "all", **cmp["all"]}]:
        for m in METRICS:
            d = block["diff"].get(m, {})
            ci = DASH if d.get("lo") is None else f"[{d['lo']:+.3f}, {d['hi']:+.3f}]"
            lines.append(f"| {block['round']} | {m} | {num(block['truth'][m])} | {num(block['judge'][m])} | "
                         f"{num(d.get('diff'), '+.3f')} | {ci} |")
    lines += ["", f"Coverage: the judge resolved {cmp['all']['judge']['resolved']} of {cmp['all']['items']} items "
              f"({num(cmp['all']['judge']['coverage'])}); truth resolved {cmp['all']['truth']['resolved']}.", ""]
    for part in ("labels", "responses"):
        c = cmp["all"]["confusion"][part]
        lines += [f"Confusion over {part} (rows: judge, columns: truth), all rounds; accuracy where both "
                  f"resolved: {num(c['accuracy_when_both_resolved'])} of {c['both_resolved']}.", "",
                  "| judge \\ truth | correct | incorrect | unresolved |", "|---|---:|---:|---:|"]
        for a in STATES:
            lines.append(f"| {a} | " + " | ".join(str(c["matrix"][a][b]) for b in STATES) + " |")
        lines.append("")
    return "\n".join(lines)
