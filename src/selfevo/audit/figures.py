"""The audit's figures (PNG, matplotlib Agg), after the paper's Figures 1 and 3:
  metrics.png      A, T_P, T_S, F, L at every proposer step (small points) and per round (large
                   markers at the middle of the round's steps), and each round's coverage (dashed)
  f_vs_l.png       false-agreement mass F against lost-credit mass L, steps small, rounds large
  comparison.png   with a truth judge: each metric by round for both judges (top) and the
                   difference with its bootstrap 95% interval (bottom)
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _plain(text: str) -> str:
    """A name from a run file (a judge's model) as text: matplotlib reads what lies between two "$" as
    math, and a model named "org/m$_{x$" raised, after metrics.json, failing the audit (and the run)."""
    return str(text).replace("$", r"\$")

from selfevo._io import atomic_writer  # noqa: E402
from selfevo.audit.metrics import METRICS  # noqa: E402

CURVES = ("A", "T_P", "T_S", "F", "L")
# one colour per metric, shared with the report's figures (report/figures.py), so the two read alike
COLORS = {"A": "#4c72b0", "T_P": "#55a868", "T_S": "#8172b2", "F": "#c44e52", "L": "#dd8452", "coverage": "#937860"}


def png(fig) -> bytes:
    """A figure as PNG bytes (closed after: a grid of runs draws hundreds)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _legend_or_note(ax, **kw) -> None:
    """A legend, or (when the judge resolved nothing to plot) a note saying so."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)
    else:
        ax.text(0.5, 0.5, "nothing resolved", ha="center", va="center", transform=ax.transAxes, color="grey")


def _step_x(steps: list[dict]) -> dict[tuple[int, int], int]:
    """Where each (round, step) is drawn: its scheduled step, or, where the step numbers do not
    rise with the rounds (records that number steps within each round), its place in (round, step)
    order, so that a later round never lands on or left of an earlier one."""
    keys = sorted({(s["round"], s["step"]) for s in steps})
    if all(a[1] < b[1] for a, b in zip(keys, keys[1:])):
        return {k: k[1] for k in keys}
    return {k: i for i, k in enumerate(keys)}


def _round_x(steps: list[dict], pos: dict[tuple[int, int], int]) -> dict[int, float]:
    by: dict[int, list[int]] = {}
    for s in steps:
        by.setdefault(s["round"], []).append(pos[(s["round"], s["step"])])
    return {r: (min(v) + max(v)) / 2 for r, v in by.items()}


def metrics_figure(result: dict, kind: str = "proposer") -> bytes:
    steps = [s for s in result["steps"] if s["kind"] == kind]
    pos = _step_x(steps)
    xs = _round_x(steps, pos)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for m in CURVES:
        pts = [(pos[(s["round"], s["step"])], s[m]) for s in steps if s[m] is not None]
        if pts:
            ax.scatter(*zip(*pts), s=9, color=COLORS[m], alpha=0.55)
        rows = [(xs[r["round"]], r[m]) for r in result["rounds"] if r[m] is not None and r["round"] in xs]
        if rows:
            ax.plot(*zip(*rows), marker="o", ms=9, lw=1.2, color=COLORS[m], label=m)
    # the judge's coverage by round: curves of a judge that resolved 10% of items look as solid as
    # the oracle's, and every point above is a share of the resolved items only
    cov = [(xs[r["round"]], r["coverage"]) for r in result["rounds"] if r.get("coverage") is not None
           and r["round"] in xs]
    if cov and any(c for _, c in cov):
        ax.plot(*zip(*cov), marker="s", ms=5, lw=1.2, ls="--", color=COLORS["coverage"], label="coverage")
    for r, x in xs.items():
        ax.text(x, 1.02, f"round {r}", ha="center", fontsize=8, transform=ax.get_xaxis_transform())
    # where steps were re-placed (numbered within each round) x is a place in order, not a step number
    where = "scheduled step" if all(x == k[1] for k, x in pos.items()) else "step, in (round, step) order"
    ax.set_xlabel(f"{where} ({kind} steps: small points; rounds: large markers)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"audit by step and round — judge {_plain(result['judge'])}", fontsize=10, pad=16)
    _legend_or_note(ax, fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # clear of coverage near 1
    ax.grid(alpha=0.3)
    return png(fig)


def f_vs_l_figure(result: dict, kind: str = "proposer") -> bytes:
    steps = [s for s in result["steps"] if s["kind"] == kind and s["F"] is not None]
    rounds = sorted({s["round"] for s in result["steps"]})
    cmap = plt.get_cmap("viridis", max(len(rounds), 2))
    color = {r: cmap(i) for i, r in enumerate(rounds)}
    fig, ax = plt.subplots(figsize=(4.6, 4.2))
    for s in steps:
        ax.scatter(s["L"], s["F"], s=10, color=color[s["round"]], alpha=0.5)
    for r in result["rounds"]:
        if r["F"] is not None:
            ax.scatter(r["L"], r["F"], s=110, color=color[r["round"]], edgecolor="black", zorder=3,
                       label=f"round {r['round']}")
    hi = max([0.05] + [max(s["F"], s["L"]) for s in steps] + [max(r["F"], r["L"]) for r in result["rounds"]
                                                             if r["F"] is not None])
    ax.plot([0, hi], [0, hi], color="grey", lw=0.8, ls="--")
    ax.set_xlim(0, hi * 1.05)
    ax.set_ylim(0, hi * 1.05)
    ax.set_xlabel("L (lost credit: correct response, wrong label)")
    ax.set_ylabel("F (false agreement on a wrong label)")
    ax.set_title(f"F against L — judge {_plain(result['judge'])}", fontsize=10)
    _legend_or_note(ax, fontsize=8)
    ax.grid(alpha=0.3)
    return png(fig)


def comparison_figure(cmp: dict) -> bytes:
    rounds = [b["round"] for b in cmp["rounds"]]
    fig, axes = plt.subplots(2, len(METRICS), figsize=(2.6 * len(METRICS), 5.2), sharex=True)
    for k, m in enumerate(METRICS):
        top, bottom = axes[0][k], axes[1][k]
        for who, style in (("truth", dict(color="black", marker="s")), ("judge", dict(color=COLORS.get(m, "#4c72b0"),
                                                                                     marker="o"))):
            pts = [(b["round"], b[who][m]) for b in cmp["rounds"] if b[who][m] is not None]
            if pts:
                top.plot(*zip(*pts), ms=6, lw=1.3, label=_plain(cmp[who]), **style)
        top.set_title(m, fontsize=10)
        top.grid(alpha=0.3)
        d = [(b["round"], b["diff"][m]) for b in cmp["rounds"] if b["diff"].get(m, {}).get("lo") is not None]
        if d:
            x, v = zip(*d)
            mid = [e["diff"] for e in v]
            bottom.errorbar(x, mid, yerr=[[a - e["lo"] for a, e in zip(mid, v)], [e["hi"] - a for a, e in zip(mid, v)]],
                            fmt="o", capsize=3, color=COLORS.get(m, "#4c72b0"))
        bottom.axhline(0, color="grey", lw=0.8)
        bottom.set_xlabel("round")
        bottom.set_xticks(rounds)
        bottom.grid(alpha=0.3)
    _legend_or_note(axes[0][0], fontsize=7)
    axes[1][0].set_ylabel("judge − truth (95% CI)")
    fig.suptitle(f"judge {_plain(cmp['judge'])} against {_plain(cmp['truth'])}", fontsize=10)
    fig.tight_layout()
    return png(fig)


def write_figures(result: dict, out_dir: str | os.PathLike, cmp: dict | None = None) -> list[Path]:
    out = Path(out_dir)
    figs = {"metrics.png": metrics_figure(result), "f_vs_l.png": f_vs_l_figure(result)}
    if cmp is not None and cmp["rounds"]:
        figs["comparison.png"] = comparison_figure(cmp)
    paths = []
    for name, data in figs.items():
        with atomic_writer(out / name, "wb") as fh:
            fh.write(data)
        paths.append(out / name)
    return paths
