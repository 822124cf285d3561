"""The `selfevo` command. Each subcommand is a thin wrapper: parse, call one room, print.

Usage errors (bad flags, bad config fields, malformed data files) exit with code 2 and one
clear message; nothing is half-written.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from selfevo.corpus import DataError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Self-evolving search agents without co-cheating.")
# wide enough for the tables when the output is a pipe or a log file (rich assumes 80 columns)
console = Console(width=None if sys.stdout.isatty() else 160)


def _fail(msg: str) -> None:
    console.print(f"[red]error:[/red] {msg}")
    raise typer.Exit(code=2)


@app.command("serve-retriever")
def serve_retriever(
    corpus: Path = typer.Option(..., help="FlashRAG corpus JSONL"),
    host: str = typer.Option("127.0.0.1", help="bind address (loopback unless told otherwise)"),
    port: int = typer.Option(8000),
    index_dir: Path | None = typer.Option(None, "--index-dir", help="cache/load the BM25 index here"),
) -> None:
    """Serve the Search-R1 / verl `POST /retrieve` API over a BM25 index."""
    from selfevo.search.server import serve

    try:
        serve(corpus=corpus, host=host, port=port, index_dir=index_dir)
    except DataError as e:
        _fail(str(e))


@app.command("score")
def score(
    data_dir: Path = typer.Option(..., "--data-dir", help="directory of FlashRAG QA JSONL files"),
    predictions: Path = typer.Option(..., help='JSONL of {"id","prediction"}'),
    out: Path = typer.Option(..., help="where to write the score JSON"),
) -> None:
    """Score predictions with Cover-EM / EM / F1 per benchmark, macro, single- and multi-hop."""
    from selfevo.evaluate import print_score_table, score_files

    try:
        result = score_files(data_dir, predictions, out)
    except DataError as e:
        _fail(str(e))
    print_score_table(result, console)


@app.command("eval")
def eval_(
    data_dir: Path = typer.Option(..., "--data-dir", help="directory of FlashRAG QA JSONL files"),
    corpus: Path = typer.Option(..., help="FlashRAG corpus JSONL to search"),
    agent: str = typer.Option("retrieval-baseline", help="agent spec, e.g. retrieval-baseline"),
    out: Path = typer.Option(..., help="output directory"),
    limit: int | None = typer.Option(None, help="at most N questions per benchmark"),
    retriever_url: str | None = typer.Option(None, "--retriever-url",
                                                help="use a remote /retrieve server instead of a local BM25 index"),
) -> None:
    """Run an agent on the seven benchmarks end to end; write predictions.jsonl and score.json."""
    from selfevo.evaluate import print_score_table, run_eval
    from selfevo.search.client import RetrieverError

    try:
        result = run_eval(data_dir=data_dir, corpus=corpus, agent=agent, out_dir=out,
                          limit=limit, retriever_url=retriever_url)
    except (DataError, ValueError, RetrieverError) as e:  # one line, not a traceback
        _fail(str(e))
    print_score_table(result, console)


world_app = typer.Typer(add_completion=False, no_args_is_help=True, help="The synthetic world.")
app.add_typer(world_app, name="world")


@world_app.command("make")
def world_make(
    size: str = typer.Option("default", help="small | default"),
    seed: int = typer.Option(0),
    out: Path = typer.Option(..., help="directory for corpus.jsonl, qa/, truth.json, world.json"),
    confusable_rate: float = typer.Option(0.6, help="share of facts with a confusable sentence"),
    shared_misreading: float = typer.Option(0.1, help="correlation of proposer and solver misreadings"),
) -> None:
    """Write a synthetic world: corpus, seven benchmarks and exact truth."""
    from selfevo.world import WorldConfig, make_world, save_world

    try:
        world = make_world(WorldConfig(size, seed, confusable_rate, shared_misreading))
    except ValueError as e:
        _fail(str(e))
    save_world(world, out)
    n = sum(len(v) for v in world.benchmarks.values())
    console.print(f"wrote {len(world.documents)} pages and {n} benchmark questions to {out}")


@app.command("evolve")
def evolve_cmd(
    out: Path = typer.Option(..., help="run directory"),
    world: str | None = typer.Option(None, help="small | default | a world directory"),
    treatment: str | None = typer.Option(None, help="coupled"),
    seed: int | None = typer.Option(None),
    rounds: int | None = typer.Option(None),
    config: Path | None = typer.Option(None, help="TOML config (see configs/)"),
    set_: list[str] = typer.Option([], "--set", help="override a config field, e.g. solver.memory=false"),
    resume: bool = typer.Option(False, help="continue a killed run in --out"),
    audit: bool = typer.Option(True, help="run the oracle audit at the end"),
) -> None:
    """Run the self-evolution loop into a run directory (then audit it against exact truth)."""
    from selfevo.config import ConfigError, load_config
    from selfevo.evolve import evolve
    from selfevo.runs import RunError
    from selfevo.world import WorldError

    try:
        cfg = load_config(config, set_, treatment=treatment, seed=seed, **{"world.name": world,
                                                                           "loop.rounds": rounds})
        run = evolve(cfg, out, resume=resume, audit=audit)
    except (ConfigError, RunError, DataError, WorldError) as e:
        _fail(str(e))
    _print_run(run.path)


def _print_run(path: Path) -> None:
    from rich.table import Table

    from selfevo._io import read_json

    metrics = path / "audit" / "metrics.json"
    if metrics.exists():
        table = Table(title=f"audit ({read_json(metrics)['judge']}) by round")
        cols = ["round", "A", "T_P", "T_S", "F", "L", "coverage", "admitted"]
        for c in cols:
            table.add_column(c, justify="right")
        for r in read_json(metrics)["rounds"]:
            table.add_row(*[str(r[c]) if c in ("round", "admitted") else
                            ("-" if r[c] is None else f"{r[c]:.3f}") for c in cols])
        console.print(table)
    evals = sorted((path / "eval").glob("round-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    if evals:
        line = ", ".join(f"r{p.stem.split('-')[1]} {read_json(p)['macro']['cover_em']:.3f}" for p in evals)
        console.print(f"main solver macro Cover-EM by round: {line}")
    console.print(f"run directory: {path}")


@app.command("audit")
def audit_cmd(
    run_dir: Path = typer.Argument(..., help="a run directory"),
    judge: str = typer.Option("oracle", help="oracle (exact truth of the synthetic world)"),
) -> None:
    """Audit a run's saved steps post hoc: A, T_P, T_S, F, L, coverage per step and round."""
    from selfevo.audit import OracleJudge, audit_run
    from selfevo.config import ConfigError, config_from_dict
    from selfevo.evolve import load_run_world
    from selfevo.runs import RunDir

    run = RunDir(run_dir)
    if not run.exists():
        _fail(f"{run_dir}: not a run directory (no manifest.json)")
    if judge != "oracle":
        _fail(f"--judge: unknown judge {judge!r} (known: oracle)")
    try:
        world = load_run_world(config_from_dict(run.config()))
    except (ConfigError, ValueError) as e:
        _fail(str(e))
    audit_run(run, OracleJudge(world.truth))
    _print_run(run.path)


@app.command("compare")
def compare_cmd(run_dirs: list[Path] = typer.Argument(..., help="run directories")) -> None:
    """Compute overhead (generations, updates, wall seconds) against the coupled run of the same
    seed, next to each run's last-round F / T_P / A and Cover-EM."""
    from rich.table import Table

    from selfevo.report.compare import compare
    from selfevo.runs import RunError

    try:
        rows = compare(run_dirs)
    except RunError as e:
        _fail(str(e))

    def pct(x):
        return "-" if x is None else f"{x:+.0%}"

    def num(x):
        return "-" if x is None else f"{x:.3f}"

    table = Table(title="compute overhead vs coupled (same seed)")
    for col in ("treatment", "seed", "generations", "updates", "seconds", "+gen", "+upd", "+time",
                "F", "T_P", "A", "Cover-EM"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["treatment"], str(r["seed"]), str(r["generations"]), str(r["updates"]),
                      f"{r['seconds']:.2f}", pct(r["extra_generations"]), pct(r["extra_updates"]),
                      pct(r["extra_seconds"]), num(r["F"]), num(r["T_P"]), num(r["A"]), num(r["cover_em"]))
    console.print(table)


@app.command("demo")
def demo_cmd(
    out: Path = typer.Option(Path("runs/demo"), help="output directory (runs, replay bank, report)"),
    seeds: int | None = typer.Option(None, help="seeds per treatment (default: the config's, 3)"),
    world: str | None = typer.Option(None, help="small | default | a world directory"),
    executor: str | None = typer.Option(None, help="local | ray (RAY_ADDRESS names a cluster)"),
    config: Path | None = typer.Option(None, help="demo config (default: configs/demo.toml)"),
    workers: int | None = typer.Option(None, help="local worker processes (default: all cores)"),
) -> None:
    """The paper's whole protocol on the embedded world: every treatment over several seeds, the
    audit, the downstream evaluation, the replay bank study, and one report."""
    from selfevo.config import ConfigError
    from selfevo.demo import load_plan, run_demo

    try:
        plan = load_plan(config, seeds=seeds, world=world, executor=executor)
    except ConfigError as e:
        _fail(str(e))
    run_demo(plan, out, console, workers)


@app.command("report")
def report_cmd(run_root: Path = typer.Argument(..., help="a directory of runs (e.g. a demo's --out)")) -> None:
    """Collect every run below a directory into report.html, report.md and results.json."""
    from selfevo.demo import headline
    from selfevo.report.build import build_report

    try:
        res = build_report(run_root)
    except ValueError as e:
        _fail(str(e))
    headline(res, console)
    console.print(f"report: {run_root / 'report.html'}")


if __name__ == "__main__":
    app()
