"""Figures as PNG bytes (matplotlib, Agg): what a person would rather look at than read."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from selfevo.audit.figures import COLORS, CURVES, png  # noqa: E402


def steps_figure(steps: list[dict], title: str) -> bytes:
    """A, T_P, T_S, F, L at every proposer step (the grader's responses), rounds shaded."""
    rows = [s for s in steps if s["kind"] == "proposer"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for r in sorted({s["round"] for s in rows}):  # one segment per round: solver steps sit between
        seg = [s for s in rows if s["round"] == r]
        for m in CURVES:
            ax.plot([s["step"] for s in seg], [s[m] for s in seg], marker="o", ms=3, lw=1.4, color=COLORS[m],
                    label=m if r == 1 else None)
    for r in sorted({s["round"] for s in rows}):
        in_r = [s["step"] for s in rows if s["round"] == r]
        ax.axvspan(min(in_r) - 0.5, max(in_r) + 0.5, color="grey", alpha=0.07 if r % 2 else 0.0)
        ax.text((min(in_r) + max(in_r)) / 2, 1.02, f"round {r}", ha="center", fontsize=8,
                transform=ax.get_xaxis_transform())
    ax.set_xlabel("scheduled step (proposer steps; the main solver's steps of each round lie between)")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=10, pad=16)
    ax.legend(ncol=5, fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    return png(fig)


def treatment_colors(treatments) -> dict[str, str]:
    """One colour per treatment, the same in every figure of a report (coupled first, as listed)."""
    return {t: f"C{i}" for i, t in enumerate(treatments)}


def rounds_figure(audit: dict[str, dict], metrics=("A", "T_P", "F")) -> bytes:
    """Each metric by round, one line per treatment (mean and std over seeds; one seed: no bar)."""
    color = treatment_colors(audit)
    # every round any treatment has: the ticks are not those of the treatment drawn last (an unaudited
    # one has none, and would leave every panel without ticks)
    ticks = sorted({r["round"] for a in audit.values() for r in a["rounds"]})
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.3 * len(metrics), 3.2))
    for ax, m in zip(axes, metrics, strict=True):
        for t, a in audit.items():
            if not a["rounds"]:  # unaudited: no line, and no empty legend entry
                continue
            rounds = [r["round"] for r in a["rounds"]]
            # a round the judge resolved nothing of has no value: a gap in the line, not a crash
            mean = [math.nan if not r[m] or r[m]["mean"] is None else r[m]["mean"] for r in a["rounds"]]
            # one seed has no std (None): no bar, not a bar of 0 that reads as seeds that agree
            std = [math.nan if not r[m] or r[m]["std"] is None else r[m]["std"] for r in a["rounds"]]
            ax.errorbar(rounds, mean, yerr=std, marker="o", ms=4, capsize=3, lw=1.5 if t == "coupled" else 1.2,
                        color=color[t], label=t)
        ax.set_title(m, fontsize=10)
        ax.set_xlabel("round")
        ax.set_xticks(ticks)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return png(fig)


# the cost-effectiveness figure's panels: compute's key, the x axis, and whether the spread over seeds is
# drawn (wall time varies between runs of seconds; counts of a schedule do not)
COST_PANELS = (("extra_seconds", "extra wall time over coupled (%)", True),
               ("extra_generations", "extra generations over coupled (%)", False),
               ("extra_updates", "extra updates over coupled (%)", False))


def cost_figure(downstream: dict, compute: dict) -> bytes:
    """Downstream gain over coupled (with its 95% interval) against the extra compute, one panel a
    measure (COST_PANELS): wall time (± its std over seeds: single runs of seconds time noisily), and the
    generations and updates that cost wall time on a language model; one seed has neither bar."""
    color = treatment_colors(downstream)
    fig, axes = plt.subplots(1, len(COST_PANELS), figsize=(4 * len(COST_PANELS), 3.6), sharey=True)
    for ax, (key, xlabel, spread_shown) in zip(axes, COST_PANELS):
        for t, d in downstream.items():
            g = d.get("gain_vs_coupled", {}).get("macro")
            cost = compute.get(t, {}).get(key, {})
            c = cost.get("mean")
            if not g or c is None or g["mean"] is None:
                continue
            # one seed has no interval and no std (None): no bar, not one of length 0 that reads as certain
            below = g["mean"] - g["lo"] if g["lo"] is not None else math.nan
            above = g["hi"] - g["mean"] if g["hi"] is not None else math.nan
            xerr = None
            if spread_shown:
                spread = 100 * cost["std"] if cost.get("std") is not None else math.nan
                xerr = [[spread]] * 2
            ax.errorbar([100 * c], [g["mean"]], yerr=[[below], [above]], xerr=xerr,
                        fmt="o", capsize=3, color=color[t])
            ax.annotate(t, (100 * c, g["mean"]), fontsize=7, xytext=(4, 4), textcoords="offset points")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("macro Cover-EM gain over coupled")
    fig.suptitle("cost-effectiveness", fontsize=10)
    fig.tight_layout()
    return png(fig)
