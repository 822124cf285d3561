"""The `selfevo` command. Each subcommand is a thin wrapper: parse, call one room, print.

Usage errors (bad flags, bad config fields, malformed data files) exit with code 2 and one
clear message; nothing is half-written.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from selfevo.corpus import DataError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Self-evolving search agents without co-cheating.")
console = Console()


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


if __name__ == "__main__":
    app()
