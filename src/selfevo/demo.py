"""`selfevo demo`: the paper's whole protocol on the embedded world, end to end.

Base (untrained), coupled (Dr. Zero), MSV, CrossFit and MSV+CrossFit for 3 rounds each over N seeds,
the oracle audit of every run, the downstream evaluation after every round, the fixed replay bank
study on questions saved from the first seed's coupled run, then one report (HTML, Markdown, JSON).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from selfevo._bar import Progress
from selfevo._io import absolute
from selfevo.config import (
    ConfigError,
    RunConfig,
    check_known,
    coerce,
    config_from_dict,
    read_toml,
    with_absolute_paths,
)
from selfevo.experiments import EXECUTORS, grid, run_grid
from selfevo.loop.schedule import MAX_SEEDS
from selfevo.runs import RunDir

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.toml"


# fields of the run config the demo sets itself, per run or for the whole grid: a run table
# setting them would be overridden without a word, so it is refused
_SET_BY_THE_PLAN = {"treatment": "demo.treatments", "seed": "demo.seeds", "world.name": "demo.world"}


def _int(name: str, value, least: int, most: int | None = None) -> int:
    value = coerce(value, int, f"demo.{name}")
    if value < least:
        raise ConfigError(f"demo.{name}: must be >= {least}, got {value}")
    if most is not None and value > most:
        raise ConfigError(f"demo.{name}: must be at most {most:,}, got {value:,}")
    return value


def _names(name: str, value) -> tuple[str, ...]:
    value = coerce(value, tuple[str, ...], f"demo.{name}")  # a bare string is an error, not its letters
    dup = sorted({v for v in value if value.count(v) > 1})
    if dup:
        raise ConfigError(f"demo.{name}: {dup[0]!r} is listed twice")
    return tuple(value)


def _check_field(name: str, value):
    """One field of the plan, checked on its own; returns it normalised. Errors say
    `demo.NAME: problem`, so the caller can say where the value came from."""
    if name == "seeds":  # a typo's 10**14 seeds would exhaust memory listing the grid's jobs
        return _int(name, value, 1, MAX_SEEDS)
    if name == "replay_size":
        return _int(name, value, 1)
    if name == "treatments":
        from selfevo.loop.treatments import parse_treatment, user_rules

        value = _names(name, value)
        if "coupled" not in value:
            raise ConfigError("demo.treatments: must include coupled (every comparison is against it)")
        seen: dict = {}
        for i, t in enumerate(value):
            try:
                what = parse_treatment(t)
                if what.feedback == "user":
                    user_rules(t)  # its package's import, once, not in every seed's job
                what = what if what.feedback == "user" else dataclasses.replace(what, name="")  # users': by name
            except ValueError as e:  # parse_treatment names `treatment`, which the demo sets itself
                raise ConfigError(str(e).replace("treatment:", f"demo.treatments[{i}]:", 1)) from None
            if what in seen:  # "msv" and "msv+coupled", "crossfit" and "crossfit-k2": one treatment
                raise ConfigError(f"demo.treatments: {seen[what]!r} and {t!r} name one treatment")
            seen[what] = t
        return value
    if name == "replay_conditions":
        from selfevo.replay import CONDITIONS

        value = _names(name, value)  # empty: no replay study
        unknown = [c for c in value if c not in CONDITIONS]
        if unknown:
            raise ConfigError(f"demo.replay_conditions: unknown {unknown[0]!r} (known: {', '.join(CONDITIONS)})")
        return value
    if name == "executor":
        if value not in EXECUTORS:
            raise ConfigError(f"demo.executor: expected one of {', '.join(EXECUTORS)}, got {value!r}")
        return value
    if name == "world":
        from selfevo.world.generate import SIZES

        if not isinstance(value, str) or not value:
            raise ConfigError(f"demo.world: expected small, default or a world directory, got {value!r}")
        if value in SIZES:
            return value
        # absolute: a job run from another directory (a ray worker) must read the same world
        try:
            path = absolute(value, "demo.world")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # checked once here, not by every job of the grid (each would fail the same way)
        if not (Path(path) / "world.json").is_file():
            raise ConfigError(f"demo.world: {value}: not a world directory (no world.json); make one with "
                              f"`selfevo world make` or use {' or '.join(SIZES)}")
        return path
    raise ConfigError(f"demo.{name}: unknown field")


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
        # every field is checked before anything runs: a bad one found by the grid's jobs fails
        # each of them, or (the replay size) only after all of them have finished
        for f in self.__dataclass_fields__:
            if f != "run":
                object.__setattr__(self, f, _check_field(f, getattr(self, f)))
        for key, where in _SET_BY_THE_PLAN.items():
            *tables, last = key.split(".")
            inner = self.run
            for t in tables:
                inner = inner.get(t) if isinstance(inner.get(t), dict) else {}
            if last in inner:
                raise ConfigError(f"{key}: set by the demo for every run; use {where}")
        # absolute: a job on a Ray cluster runs in another directory and must read the same files
        object.__setattr__(self, "run", with_absolute_paths(self.run))
        cfg = config_from_dict(self.run)
        if self.replay_conditions and cfg.loop.rounds < 2:
            # found only after every run had finished, the demo would then exit 1
            raise ConfigError("loop.rounds: the replay bank takes round-2 and later questions, so the demo's "
                              "runs need at least 2 rounds; or set demo.replay_conditions = []")
        for t in self.treatments:  # validate every treatment (and the run tables) before running
            config_from_dict({**self.run, "treatment": t})
        if (learners := cfg.learners) and self.replay_conditions:
            # the bank's feedback solvers are selfevo's learners: a bank of the runs would be refused once they ended
            raise ConfigError(f"learners: {learners!r}: the replay study trains selfevo's own learners on the runs' "
                              "questions, not yours; set demo.replay_conditions = [] with learners of your own")
        if learners:
            from selfevo.evolve import user_pieces

            user_pieces(cfg)  # its package's import, once, not in every seed's job

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
    """The plan of a demo config file (default: configs/demo.toml), with `changes` (the command's
    --seeds, --world, --executor; None: keep the file's) applied. Every error names where the bad
    value came from: `FILE: demo.seeds: ...` or `--seeds: ...`."""
    if path is None and not DEFAULT_CONFIG.exists():
        data = {}  # an installed package has no configs/ directory: the plan's defaults are the same
        path = DEFAULT_CONFIG
    else:
        path = Path(path) if path is not None else DEFAULT_CONFIG
        data = read_toml(path)
    # a misspelt table ([dmeo]) is named against every table the file may hold, the plan's included
    try:
        check_known(data, ["demo", *(f.name for f in dataclasses.fields(RunConfig))])
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    demo = data.pop("demo", {})
    if not isinstance(demo, dict):
        raise ConfigError(f"{path}: demo: expected a table, got {type(demo).__name__}")
    demo = dict(demo)
    known = [f for f in DemoPlan.__dataclass_fields__ if f != "run"]
    for name, value in demo.items():
        if name not in known:
            raise ConfigError(f"{path}: demo.{name}: unknown field (known: {', '.join(sorted(known))})")
        try:
            demo[name] = _check_field(name, value)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    for name, value in changes.items():
        if value is None:
            continue
        try:
            demo[name] = _check_field(name, value)
        except ConfigError as e:  # a flag's value: name the flag, not the file's field
            flag = f"--{name.replace('_', '-')}"
            raise ConfigError(str(e).replace(f"demo.{name}", flag, 1)) from None
    try:
        return DemoPlan(**demo, run=data)
    except ConfigError as e:  # the treatments and run tables: both come from the file
        raise ConfigError(f"{path}: {e}") from None


def check_out(out: Path) -> None:
    """A demo goes on in its own directory (finished runs skipped), but does not write beside other
    files: a ConfigError naming a few of them."""
    from selfevo._io import stray_files
    from selfevo.report.build import DEMO_RECORD, REPORT_FILES

    if other := stray_files(out, {"runs", "replay", DEMO_RECORD, *REPORT_FILES}):
        raise ConfigError(f"--out: {out} holds files no demo wrote ({other}); give a new directory, or an "
                          "earlier demo's")


def run_demo(plan: DemoPlan, out: str | os.PathLike, console: Console | None = None,
             workers: int | None = None) -> dict:
    from selfevo.replay import OtherStudyJournal, ReplayError, build_bank, run_replay, write_results
    from selfevo.report.build import DEMO_RECORD, build_report, write_demo_record

    console = console or Console()
    # absolute: a Ray worker runs in another directory (on a cluster, wherever `ray start` ran), and
    # a relative path would put the runs there, out of this process's sight
    out = Path(out).resolve()
    # an earlier demo's record no longer describes `out` once this plan writes into it; stopped
    # before its report, this demo leaves none (`selfevo report` then takes every run below `out`)
    (out / DEMO_RECORD).unlink(missing_ok=True)
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
        console.print(f"[red]job {escape(res['job'])} failed:[/red] {escape(res['error'])}")
    # this plan's runs only: a run directory below `out` from an earlier plan is not this demo's,
    # and neither is the directory of a failed job (one made under another config, say)
    runs = [r["run"] for r in results if r["status"] != "failed" and RunDir(r["run"]).exists()]
    job = {j.name: j for j in jobs}
    never = [{"run": r["run"], "treatment": job[r["job"]].treatment, "seed": job[r["job"]].seed,
              "why": (f"the job failed: {r['error']}" if RunDir(r["run"]).exists()
                      else f"the job failed before it wrote a run directory: {r['error']}")}
             for r in failed]
    if not runs:  # the old plan's directories would otherwise pass for this plan's results
        first = f" (job {failed[0]['job']}: {failed[0]['error']})" if failed else ""
        hidden = "" if failed else (" (the jobs say they finished, but their run directories are not on this "
                                    "machine: Ray workers need --out on a file system they share with it)")
        raise ValueError(f"{out}: no job of this plan finished, nothing to report{first}{hidden}")
    # the bank's run: one seed's, as the paper's 3,000 questions are one run's (a simulated run's base
    # model is seeded by its run seed, and the replay has one base model)
    coupled = sorted((job[r["job"]].seed, r["run"]) for r in results
                     if job[r["job"]].treatment == "coupled" and r["status"] != "failed")[:1]
    # what keeps this report short of the plan: the exit status says so (the CLI exits 1)
    incomplete = [f"{len(failed)} of {len(jobs)} jobs failed"] if failed else []
    replay = False
    if plan.replay_conditions and coupled:
        rounds = config_from_dict({**plan.run, "treatment": "coupled"}).loop.rounds
        console.print(f"fixed replay bank: up to {plan.replay_size} questions from rounds 2-{rounds} of the "
                      f"coupled run of seed {coupled[0][0]}, {len(plan.replay_conditions)} conditions x "
                      f"{len(seeds)} seeds")
        try:
            bank = build_bank([coupled[0][1]], plan.replay_size, seed=0, allow_fewer=True)
            # its journal: a rerun (or one after Ctrl-C) does not run the study's finished jobs again; one
            # of another study (the plan, the runs or selfevo changed since) is the demo's own: started over
            journal = out / "replay" / "jobs.jsonl"

            def study():
                return run_replay(bank, list(plan.replay_conditions), seeds, workers=workers or os.cpu_count() or 1,
                                  progress=True, journal=journal, log=lambda m: console.print(escape(m)))

            try:
                results = study()
            except OtherStudyJournal:
                console.print(escape(f"{journal}: the journal of an earlier study (another plan, other runs or "
                                     "another selfevo): started over"))
                journal.unlink()
                results = study()
        except ReplayError as e:  # the runs are done: report them, and say why the study is missing
            incomplete.append(f"replay study skipped: {e} (in the demo: raise demo.replay_size, "
                              "loop.admit_per_round or loop.rounds, or set demo.replay_conditions = [])")
        except Exception as e:  # noqa: BLE001 - a replay worker killed (OOM) breaks the pool; the same:
            # the finished runs are reported, the study named as missing, and the demo exits 1
            incomplete.append(f"replay study failed: {type(e).__name__}: {str(e).rstrip('.')}")
        else:
            bank.save(out / "replay" / "bank.json")
            write_results(results, out / "replay")
            replay = True
    context = (f"World `{plan.world}`; demo wall time {time.perf_counter() - started:.0f} s "
               f"({plan.executor} executor).")
    context = " ".join([context, *[f"{x[0].upper()}{x[1:]}." for x in incomplete]])
    write_demo_record(out, runs, replay, never, context)  # `selfevo report out` reports this plan too
    try:
        res = build_report(out, context=context, runs=runs, replay=replay, excluded=never)
    except BaseException:  # a full disk: what failed before it is said all the same (demo.json records it)
        for line in incomplete:
            console.print(f"[yellow]{escape(line)}[/yellow]")
        raise
    res["incomplete"] = incomplete
    headline(res, console)
    for line in incomplete:
        console.print(f"[yellow]{escape(line)}[/yellow]")
    console.print(escape(f"report: {out / 'report.html'}  (also report.md, results.json)"))
    return res


def headline(res: dict, console: Console) -> None:
    """The headline tables in the terminal."""
    from selfevo.report.render import tables

    for title, (head, rows) in tables(res).items():
        if title.startswith("Downstream"):  # per-benchmark columns live in the report
            keep = [0, *range(len(head) - 4, len(head))]
            head, rows = [head[i] for i in keep], [[r[i] for i in keep] for r in rows]
        if title.startswith("Audit"):
            last = max((int(x[1]) for x in rows), default=0)  # no rows: no run was audited
            rows = [r for r in rows if r[1] == str(last)]  # last round only
            title = "Audit, last round (mean ± std over seeds)"
        table = Table(title=escape(title))  # names and paths come from run files: text, never markup
        for h in head:
            table.add_column(escape(h), justify="right")
        for r in rows:
            table.add_row(*map(escape, r))
        console.print(table)
    for r in res["readings"]:
        console.print(f"- {escape(r)}")
    for r in res.get("excluded", []):
        console.print(f"[yellow]left out (failed or not complete):[/yellow] {escape(r['run'])} ({escape(r['why'])})")
