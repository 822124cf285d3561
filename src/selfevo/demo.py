"""`selfevo demo`: the paper's whole protocol on the embedded world, end to end.

Base (untrained), coupled (Dr. Zero), MSV, CrossFit and MSV+CrossFit for 3 rounds each over N seeds,
the oracle audit of every run, the downstream evaluation after every round, the fixed replay bank
study on questions saved from the coupled runs, then one report (HTML, Markdown, JSON).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from selfevo.config import ConfigError, config_from_dict
from selfevo.experiments import EXECUTORS, grid, run_grid

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.toml"


@dataclass(frozen=True)
class DemoPlan:
    treatments: tuple[str, ...] = ("coupled", "msv", "crossfit", "msv+crossfit")
    seeds: int = 3
    world: str = "default"
    executor: str = "local"
    replay_size: int = 3000
    replay_conditions: tuple[str, ...] = ("coupled", "same-source", "full-data", "question-split", "source-id",
                                          "source-id-half", "connected", "coupled+msv", "question-split+msv",
                                          "source-id+msv")
    run: dict = field(default_factory=dict)  # run-config tables applied to every run

    def __post_init__(self):
        if self.seeds < 1:
            raise ConfigError(f"demo.seeds: must be >= 1, got {self.seeds}")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"demo.executor: expected one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        if "coupled" not in self.treatments:
            raise ConfigError("demo.treatments: must include coupled (every comparison is against it)")
        for t in self.treatments:  # validate every treatment (and the run tables) before running
            config_from_dict({**self.run, "treatment": t})

    def overrides(self) -> list[str]:
        """The run tables as `--set` overrides (TOML literals), plus the world."""
        out = []

        def walk(prefix: str, value) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out.append(f"{prefix}={json.dumps(value)}")

        walk("", self.run)
        return [*out, f"world.name={json.dumps(self.world)}"]


def load_plan(path: str | os.PathLike | None = None, **changes) -> DemoPlan:
    path = Path(path) if path else DEFAULT_CONFIG
    data = tomllib.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    demo = dict(data.pop("demo", {}))
    known = {f for f in DemoPlan.__dataclass_fields__ if f != "run"}
    unknown = set(demo) - known
    if unknown:
        raise ConfigError(f"demo.{sorted(unknown)[0]}: unknown field (known: {', '.join(sorted(known))})")
    for key in ("treatments", "replay_conditions"):
        if key in demo:
            demo[key] = tuple(demo[key])
    demo.update({k: v for k, v in changes.items() if v is not None})
    return DemoPlan(**demo, run=data)


def run_demo(plan: DemoPlan, out: str | os.PathLike, console: Console | None = None,
             workers: int | None = None) -> dict:
    from selfevo.replay import build_bank, run_replay, write_results
    from selfevo.report.build import build_report

    console = console or Console()
    out = Path(out)
    started = time.perf_counter()
    seeds = list(range(plan.seeds))
    jobs = grid(plan.treatments, seeds, out / "runs", plan.overrides())
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(f"runs ({plan.executor})", total=len(jobs))
        failed = []

        def on_done(res: dict) -> None:
            bar.advance(task)
            bar.update(task, description=f"runs ({plan.executor}): {res['job']} {res['status']}")
            if res["status"] == "failed":
                failed.append(res)

        results = run_grid(jobs, plan.executor, workers, on_done)
    for res in failed:
        console.print(f"[red]job {res['job']} failed:[/red] {res['error']}")
    coupled = [r["run"] for r in results if r["job"].startswith("coupled-") and r["status"] != "failed"]
    if plan.replay_conditions and coupled:
        console.print(f"fixed replay bank: up to {plan.replay_size} questions from the coupled runs' rounds 2-3, "
                      f"{len(plan.replay_conditions)} conditions x {len(seeds)} seeds")
        bank = build_bank(coupled, plan.replay_size, seed=0, allow_fewer=True)
        bank.save(out / "replay" / "bank.json")
        results = run_replay(bank, list(plan.replay_conditions), seeds, workers=workers or os.cpu_count() or 1,
                             progress=True)
        write_results(results, out / "replay")
    res = build_report(out, context=f"World `{plan.world}`; demo wall time "
                                    f"{time.perf_counter() - started:.0f} s on {os.cpu_count()} cores.")
    headline(res, console)
    console.print(f"report: {out / 'report.html'}  (also report.md, results.json)")
    return res


def headline(res: dict, console: Console) -> None:
    """The headline tables in the terminal."""
    from selfevo.report.render import tables

    for title, (head, rows) in tables(res).items():
        if title.startswith("Downstream"):  # per-benchmark columns live in the report
            keep = [0, *range(len(head) - 4, len(head))]
            head, rows = [head[i] for i in keep], [[r[i] for i in keep] for r in rows]
        if title.startswith("Audit"):
            rows = [r for r in rows if r[1] == str(max(int(x[1]) for x in rows))]  # last round only
            title = "Audit, last round (mean ± std over seeds)"
        table = Table(title=title)
        for h in head:
            table.add_column(h, justify="right")
        for r in rows:
            table.add_row(*r)
        console.print(table)
    for r in res["readings"]:
        console.print(f"- {r}")
