"""Helpers shared by the benchmark scripts: machine facts, timing, where runs go, and rewriting
one "## " section of a Markdown results file in place (other sections are left as they are)."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import platform
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from selfevo._fmt import DASH, mean_std_text
from selfevo._software import software
from selfevo.algos import summary

REPO = Path(__file__).resolve().parents[1]

# A sim solver whose reading skill learns fast and whose memory slowly (configs/default.toml:
# lr_theta 0.05, lr_memory 4.0). Picked from a grid (lr_memory 0.5, 1, 2 x lr_theta 0.1, 0.2, 0.5;
# coupled, CrossFit and MSV on seeds 0..2, one replay of a seed-0 bank) as the setting where
# CrossFit's round-3 in-loop agreement comes closest to coupled's (0.67 vs 0.76), as it does in the
# paper (0.679 vs 0.710): there, a solver trained on other sources grades nearly as well, so what it
# learns is mostly skill that transfers; in the default sim it is mostly per-source memory.
SKILL_LED = ["solver.lr_theta=0.5", "solver.lr_memory=0.5"]


@contextlib.contextmanager
def run_root(keep: Path | None) -> Iterator[Path]:
    """Where a benchmark writes its runs: `--keep DIR` (created and kept, so a rerun skips finished
    runs), else a temporary directory removed afterwards."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


def median_time(fn: Callable[[], object], repeats: int = 3,
                setup: Callable[[], object] | None = None) -> tuple[float, list[float]]:
    """Median wall seconds of `repeats` calls of `fn`, and each; `setup` runs before each call, untimed."""
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_line() -> str:
    sw = software()  # the sim's numbers depend on numpy's sampling and bm25s's scoring
    return (f"{os.cpu_count()} cores, {cpu_model()}; Python {platform.python_version()}; numpy {sw['numpy']}, "
            f"bm25s {sw['bm25s']}; date {dt.date.today().isoformat()}")


def device_line(device: str, dtype: str, threads: int) -> str:
    """Where a language-model benchmark ran: the GPU's name, or the CPU's torch threads, and the dtype."""
    if device == "cpu":
        return f"CPU, {dtype}, torch threads {threads}"
    import torch

    return f"{torch.cuda.get_device_name(torch.device(device))}, {dtype}"


def replace_section(text: str, heading: str, section: str, title: str = "# Results") -> str:
    """Swap the section starting at `heading` (up to the next "## " heading) or append it."""
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    if pattern.search(text):
        return pattern.sub(lambda _: section.rstrip("\n") + "\n\n", text, count=1)
    return text.rstrip("\n") + "\n\n" + section if text.strip() else f"{title}\n\n" + section


def write_section(path: Path, heading: str, section: str, title: str = "# Results") -> None:
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(replace_section(old, heading, section, title), encoding="utf-8")


def write_block(path: Path, name: str, text: str) -> None:
    """Swap what lies between the lines `<!-- name -->` and `<!-- /name -->` of `path` (a page's part a
    script writes, the rest written by hand)."""
    old = path.read_text(encoding="utf-8")
    tag = re.escape(name)
    pattern = re.compile(rf"(^<!-- {tag} -->\n).*?(^<!-- /{tag} -->$)", re.DOTALL | re.MULTILINE)
    if not pattern.search(old):
        raise SystemExit(f"{path}: no <!-- {name} --> ... <!-- /{name} --> lines to write between")
    path.write_text(pattern.sub(lambda m: m.group(1) + text.rstrip("\n") + "\n" + m.group(2), old, count=1),
                    encoding="utf-8")


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and std over seeds, NaN where there is none (no values; one seed has no std)."""
    s = summary(values)
    nan = float("nan")
    return (nan if s["mean"] is None else s["mean"], nan if s["std"] is None else s["std"])


def fmt(values: list[float], digits: int = 3) -> str:
    """"mean ± std" over seeds; a dash for the std of one seed (and for no values at all)."""
    return mean_std_text(summary(values), f".{digits}f")


def interval_text(s: dict, spec: str = "+.3f") -> str:
    """A paired difference's `summary` as "mean [lo, hi]" (95% t-interval); one seed has no interval."""
    if s["mean"] is None:
        return DASH
    if s["lo"] is None:
        return f"{format(s['mean'], spec)} (one seed: no interval)"
    return f"{format(s['mean'], spec)} [{format(s['lo'], spec)}, {format(s['hi'], spec)}]"
