"""Ordinary user mistakes at the command line: one `error:` line, exit 2, nothing lost, and the
check made before any work that the mistake would waste."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import selfevo.data
import selfevo.demo
import selfevo.evaluate
import selfevo.evolve
import selfevo.search.adopt
import selfevo.search.dense
import selfevo.search.index
import selfevo.search.server
import selfevo.world
from selfevo._io import check_local_path
from selfevo._software import SoftwareChanged
from selfevo.agents.lm import model as lm_model
from selfevo.agents.lm import server
from selfevo.audit import METRICS, llm_judge, pipeline
from selfevo.audit.external import GoldJudge
from selfevo.cli import _dense_options, _print_audit_rounds, _warnings_as_lines, app
from selfevo.config import ConfigError, load_config
from selfevo.integrations import engine
from selfevo.loop.feedback import UntrainedGrader
from selfevo.runs import RunError

runner = CliRunner()
# a run of a few seconds on the small world
TINY = ["--set", "loop.rounds=2", "--set", "loop.proposer_steps=2", "--set", "loop.solver_steps=2",
        "--set", "loop.admit_per_round=20"]


def _one_doc_corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "d1", "contents": '"T"\nText one.'}) + "\n")
    return corpus


def _usage_error(args: list[str]) -> str:
    res = runner.invoke(app, args)
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert "Traceback" not in res.output
    return " ".join(res.output.split())  # rich wraps long lines


@pytest.mark.parametrize("args, named", [
    (["score", "--data-dir", "{tmp}/nope", "--predictions", "{tmp}/p.jsonl", "--out", "{tmp}/s.json"],
     "{tmp}/nope: No such file or directory"),
    (["score", "--data-dir", "{tmp}/afile", "--predictions", "{tmp}/p.jsonl", "--out", "{tmp}/s.json"],
     "{tmp}/afile: Not a directory"),
    (["index", "build", "--corpus", "{tmp}/nope.jsonl", "--out", "{tmp}/idx"], "{tmp}/nope.jsonl: No such file"),
    (["world", "make", "--size", "small", "--out", "{tmp}/afile"], "{tmp}/afile: a file, not a directory"),
])
def test_a_missing_or_misplaced_path_is_one_line_naming_it(tmp_path, args, named):
    (tmp_path / "afile").write_text("mine\n")
    out = _usage_error([a.format(tmp=tmp_path) for a in args])
    assert named.format(tmp=tmp_path) in out
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_an_output_path_in_the_way_fails_before_the_work(tmp_path):
    """`--out` naming a file: refused before the bank is even read (the bank here does not exist,
    so reaching it would be a different error), and before the benchmarks are answered."""
    (tmp_path / "afile").write_text("mine\n")
    out = _usage_error(["replay", "run", "--bank", str(tmp_path / "no-bank.json"), "--out", str(tmp_path / "afile")])
    assert "afile: exists and is not a directory" in out
    out = _usage_error(["eval", "--data-dir", str(tmp_path / "no-qa"), "--corpus", str(tmp_path / "no.jsonl"),
                        "--out", str(tmp_path / "afile")])
    assert "afile: exists and is not a directory" in out
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_world_make_never_replaces_a_world(tmp_path):
    """Runs made on a world are audited against its truth.json: writing another world over it
    would make every later audit of them wrong."""
    world = tmp_path / "w"
    world.mkdir()
    (world / "truth.json").write_text("{}\n")
    out = _usage_error(["world", "make", "--size", "small", "--out", str(world)])
    assert "not empty" in out and (world / "truth.json").read_text() == "{}\n"


@pytest.mark.parametrize("name", ["small", "default"])
def test_world_make_refuses_an_out_that_world_would_read_as_a_generated_world(name, tmp_path, monkeypatch):
    """`--world small` generates the small world: a world saved as ./small was never read by it (a
    run of another world's seed and rates, exit 0); `--out small` is refused before anything is written."""
    monkeypatch.chdir(tmp_path)
    out = _usage_error(["world", "make", "--size", "small", "--seed", "7", "--out", name])
    assert f"'{name}' names a generated world" in out and not (tmp_path / name).exists()
    assert runner.invoke(app, ["world", "make", "--size", "small", "--out", f"{name}-s7"]).exit_code == 0


def test_an_empty_benchmark_file_is_an_error_not_a_smaller_macro_average(tmp_path):
    qa = tmp_path / "qa"
    qa.mkdir()
    (qa / "nq.jsonl").write_text('{"id": "q1", "question": "who?", "golden_answers": ["x"]}\n')
    (qa / "hotpotqa.jsonl").write_text("")
    preds = tmp_path / "p.jsonl"
    preds.write_text('{"id": "q1", "prediction": "x"}\n')
    out = _usage_error(["score", "--data-dir", str(qa), "--predictions", str(preds), "--out", str(tmp_path / "s.json")])
    assert "hotpotqa.jsonl: no questions" in out and not (tmp_path / "s.json").exists()


@pytest.mark.parametrize("command", [["serve-model"], ["serve-retriever", "--corpus", "x.jsonl"]])
def test_a_port_out_of_range_is_a_usage_error(command):
    res = runner.invoke(app, [*command, "--port", "99999"])
    assert res.exit_code == 2 and "--port" in res.output


def test_python_dash_m_selfevo_is_the_command():
    """`python -m selfevo` (where the venv's scripts are not on PATH) said "No module named selfevo.__main__"."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "selfevo", "world", "make", "--size", "nope"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "Usage: selfevo world make" in res.stderr


def test_help_texts_keep_their_bracketed_words():
    """Rich reads [word] as markup: an unescaped [lm] vanished from the help."""
    assert "an [lm] setting" in " ".join(runner.invoke(app, ["eval", "--help"]).output.split())
    assert "plus [engine]" in " ".join(runner.invoke(app, ["engine-run", "--help"]).output.split())


@pytest.mark.parametrize("override", ["solver.lr_theta=-5.0", "solver.lr_memory=-1", "proposer.lr=-0.5"])
def test_a_negative_learning_rate_is_refused_naming_it(override):
    with pytest.raises(ConfigError, match=re.escape(override.split("=")[0] + ": must be >= 0")):
        load_config(None, [override])


def test_a_model_named_by_a_missing_path_is_reported_as_missing(tmp_path):
    """transformers would call ./typo a malformed hub id; a hub id itself passes."""
    with pytest.raises(FileNotFoundError) as err:
        check_local_path(str(tmp_path / "no-model"))
    assert err.value.filename == str(tmp_path / "no-model")
    check_local_path("Qwen/Qwen3.5-4B")
    check_local_path(str(tmp_path))


def test_an_encoding_device_that_does_not_exist_here_is_one_clear_error():
    pytest.importorskip("torch")
    import torch

    from selfevo.search.dense import check_device

    with pytest.raises(ValueError, match="--device"):
        check_device("tpu9")
    check_device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            check_device("cuda")


def test_an_audit_that_resolves_nothing_says_so(tmp_path):
    """A judge that leaves every item unresolved (here: it never replies with JSON) writes a table of
    dashes: the command must not let it pass for a result. A judge endpoint that is not up at all
    is refused before any item, and writes nothing."""
    from selfevo.agents.lm.model import ScriptedModel, echo_script
    from selfevo.agents.lm.server import make_app, running

    run = tmp_path / "run"
    assert runner.invoke(app, ["evolve", "--world", "small", "--out", str(run), "--no-audit", *TINY]).exit_code == 0
    llm = ["audit", str(run), "--judge", "llm", "--judge-model", "x", "--judge-retries", "0",
           "--judge-malformed-retries", "0", "--max-items-per-step", "1", "--no-figures"]
    with running(make_app(ScriptedModel(echo_script))) as url:
        res = runner.invoke(app, [*llm, "--judge-url", url, "--out", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    assert "the judge resolved no item" in " ".join(res.output.split())
    res = runner.invoke(app, ["audit", str(run), "--out", str(tmp_path / "b")])  # the oracle resolves them
    assert res.exit_code == 0 and "resolved no item" not in res.output
    out = _usage_error([*llm, "--judge-url", "http://127.0.0.1:1/v1", "--out", str(tmp_path / "c")])
    assert "http://127.0.0.1:1/v1: cannot connect" in out and not (tmp_path / "c").exists()


@pytest.mark.parametrize("judge", ["gold", "oracle"])
@pytest.mark.parametrize("option", [["--judge-url", "http://127.0.0.1:1/v1"], ["--judge-model", "gpt-judge"],
                                    ["--judge-cache", "c.jsonl"], ["--judge-concurrency", "4"],
                                    ["--judge-max-tokens", "999"], ["--injection-test", "4"]])
def test_audit_refuses_llm_judge_settings_another_judge_would_ignore(tmp_path, judge, option):
    """--judge-url and the like without --judge llm were ignored: the audit then passed for that
    judge's. --injection-test with the oracle or gold answers (which never read the documents)
    reported "0 of N verdicts flipped", which reads as injection-proof."""
    records = tmp_path / "r.jsonl"
    records.write_text('{"round": 1, "step": 0, "source_id": "d", "source": "A b c. It is in Kelda.", '
                       '"question": "Where?", "label": "Kelda", "responses": ["Kelda"], "gold_answers": ["Kelda"]}\n')
    source = ["--records", str(records)] if judge == "gold" else [str(tmp_path / "no-run")]
    out = _usage_error(["audit", *source, "--judge", judge, *option, "--out", str(tmp_path / "o")])
    assert out.startswith(f"error: {option[0]}: ") and f"--judge {judge}" in out
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("option", [["--bootstrap", "500"], ["--seed", "9"]])
def test_audit_refuses_the_settings_of_a_comparison_it_does_not_make(tmp_path, option):
    """--bootstrap and --seed are read by --compare (its intervals) and --injection-test (its item set)
    only: without either, an audit that took them said nothing of it."""
    out = _usage_error(["audit", str(tmp_path / "no-run"), *option, "--out", str(tmp_path / "o")])
    assert out.startswith(f"error: {option[0]}: read only with --compare") and not (tmp_path / "o").exists()
    if option[0] == "--bootstrap":  # nor with --injection-test alone, which reads the seed only
        out = _usage_error(["audit", str(tmp_path / "no-run"), "--judge", "llm", "--judge-model", "m",
                            "--injection-test", "5", *option, "--out", str(tmp_path / "o")])
        assert out == "error: --bootstrap: read only with --compare (its bootstrap intervals)"


def test_a_run_on_a_world_directory_is_tied_to_that_world(tmp_path, monkeypatch):
    """The run stores the world's absolute path (an audit from another directory reads the same
    world) and its fingerprint: a world rewritten in place is refused by audit, resume and
    replay build instead of judging the records against other truth."""
    monkeypatch.chdir(tmp_path)
    assert runner.invoke(app, ["world", "make", "--size", "small", "--seed", "3", "--out", "w"]).exit_code == 0
    res = runner.invoke(app, ["evolve", "--world", "w", "--out", "run", "--no-audit", *TINY])
    assert res.exit_code == 0, res.output
    # what it is made on: the directory's own parameters (config.json's [world] are the defaults left as given)
    from selfevo.runs import RunDir

    made = RunDir(tmp_path / "run").manifest()["world_params"]
    assert (made["seed"], made["size"]) == (3, "small") and RunDir(tmp_path / "run").config()["world"]["seed"] == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    res = runner.invoke(app, ["audit", str(tmp_path / "run"), "--out", "a"])
    assert res.exit_code == 0, res.output
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w").rename(tmp_path / "w-old")  # another world where the first one was
    assert runner.invoke(app, ["world", "make", "--size", "small", "--seed", "0", "--out", "w"]).exit_code == 0
    for args in (["audit", "run", "--out", "b"], ["replay", "build", "--from", "run", "--size", "5", "--out", "b.json"],
                 ["evolve", "--world", "w", "--out", "run", "--no-audit", "--resume", *TINY]):
        assert "the world directory has changed since run was made on it" in _usage_error(args)
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.json").exists()
    # a grid (or demo) rerun finds the run complete: it must not pass for a finished job of the new world
    from selfevo.experiments import grid, run_job

    sets = [f'world.name="{tmp_path / "w"}"', *[x for x in TINY if x != "--set"]]
    (job,) = grid(["coupled"], [0], tmp_path, sets)
    res = run_job(dataclasses.replace(job, out=str(tmp_path / "run")))
    assert res["status"] == "failed" and "the world directory has changed since" in res["error"], res


def test_a_model_on_the_sim_backend_is_refused(tmp_path):
    """The sim learners would ignore --model without a word."""
    out = _usage_error(["evolve", "--world", "small", "--model", "smollm2-135m", "--out", str(tmp_path / "r")])
    assert "needs the lm backend" in out and not (tmp_path / "r").exists()


# a world directory fixes its parameters when made (its world.json); a run asking for others would
# record them in config.json and run with the directory's
def test_a_server_bound_off_loopback_is_warned_of_and_an_ipv6_host_printed_as_a_url(monkeypatch):
    """`serve-model --host 0.0.0.0` without a key, or `serve-retriever --host 0.0.0.0`, said nothing of the
    network reaching it; `--host ::1` printed http://::1:8001/v1, which no client reads (a helper's review)."""
    from _servers import free_port

    from selfevo._io import url_host
    from selfevo.agents.lm import server

    monkeypatch.setattr(server, "serve", lambda *args, **kwargs: None)
    port = free_port()
    res = runner.invoke(app, ["serve-model", "--model", "scripted:echo", "--host", "0.0.0.0", "--port", str(port)])
    said = " ".join(res.output.split())
    assert res.exit_code == 0 and "warning: --host 0.0.0.0 is reachable from other machines: anyone who can " \
        "reach it can use the model (no --api-key-env: without a key)" in said, res.output
    res = runner.invoke(app, ["serve-model", "--model", "scripted:echo", "--port", str(port)])
    assert res.exit_code == 0 and "warning" not in res.output and f"at http://127.0.0.1:{port}/v1" in res.output
    assert url_host("::1") == "[::1]" and url_host("127.0.0.1") == "127.0.0.1" and url_host("[::1]") == "[::1]"


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory):
    from selfevo.world import WorldConfig, make_world, save_world

    path = tmp_path_factory.mktemp("w") / "world"
    # shared_misreading is not the default (0.1): a run's default values are not compared with the directory
    save_world(make_world(WorldConfig(size="small", seed=0, confusable_rate=0.6, shared_misreading=0.3)), path)
    return path


ONE_ROUND = ["--set", "loop.rounds=1", "--set", "loop.proposer_steps=2", "--set", "loop.solver_steps=2",
             "--set", "loop.admit_per_round=20", "--set", "loop.source_docs=40", "--no-audit"]


@pytest.mark.parametrize("field, value", [("shared_misreading", "0.9"), ("confusable_rate", "0.0"),
                                          ("value_skew", "3.0"), ("seed", "3")])
def test_a_world_directory_refuses_parameters_it_was_not_made_with(tmp_path, world_dir, field, value):
    out = _usage_error(["evolve", "--world", str(world_dir), "--out", str(tmp_path / "run"), *ONE_ROUND,
                        "--set", f"world.{field}={value}"])
    assert f"world.{field}" in out
    assert not (tmp_path / "run").exists()


def test_a_world_directory_accepts_the_parameters_it_was_made_with(tmp_path, world_dir):
    res = runner.invoke(app, ["evolve", "--world", str(world_dir), "--out", str(tmp_path / "run"), *ONE_ROUND,
                              "--set", "world.shared_misreading=0.3"])
    assert res.exit_code == 0, (res.output, res.exception)


def test_a_mistyped_world_is_named_as_not_a_world_directory(tmp_path):
    from selfevo.world import WorldError, world_fingerprint

    out = _usage_error(["evolve", "--world", str(tmp_path / "smal"), "--out", str(tmp_path / "run")])
    assert "not a world directory" in out and "corpus.jsonl" not in out
    assert not (tmp_path / "run").exists()
    with pytest.raises(WorldError, match="not a world directory"):
        world_fingerprint(tmp_path)


def test_qa_dir_without_a_corpus_is_an_error_naming_it(tmp_path):
    # a world run is evaluated on the world's benchmarks: the QA directory would be recorded and ignored
    with pytest.raises(ConfigError, match=r"^data\.qa_dir: "):
        load_config(None, [f'data.qa_dir="{tmp_path}"'])
    out = _usage_error(["evolve", "--world", "small", "--qa-dir", str(tmp_path), "--out", str(tmp_path / "run")])
    assert "data.qa_dir" in out
    assert not (tmp_path / "run").exists()
    cfg = load_config(None, ['backend="lm"', f'data.corpus="{tmp_path}/c.jsonl"', f'data.qa_dir="{tmp_path}"'])
    assert cfg.data.qa_dir == str(tmp_path)


def test_a_corpus_rewritten_in_the_same_process_is_read_again(tmp_path):
    # the process keeps one corpus and its index (a grid worker, a notebook); a rewrite must not be served stale
    import json

    from selfevo.evolve import environment

    (tmp_path / "qa").mkdir()
    (tmp_path / "qa" / "nq.jsonl").write_text(json.dumps(
        {"id": "nq-0", "question": "q?", "golden_answers": ["x"], "metadata": {"benchmark": "nq", "hop": "single"}})
        + "\n")
    corpus = tmp_path / "corpus.jsonl"

    def write(n):
        corpus.write_text("".join(json.dumps({"id": str(i), "contents": f"Page {i}\ntext number {i}"}) + "\n"
                                  for i in range(n)))

    cfg = load_config(None, ['backend="lm"', f'data.corpus="{corpus}"', f'data.qa_dir="{tmp_path / "qa"}"'])
    write(2)
    assert len(environment(cfg).documents) == 2
    assert environment(cfg).documents is environment(cfg).documents  # an unchanged file stays cached
    write(5)
    assert len(environment(cfg).documents) == 5


@pytest.mark.parametrize("command", [["index", "build", "--out"], ["serve-retriever", "--index-dir"]])
def test_an_index_is_never_written_over_its_own_corpus(tmp_path, monkeypatch, command):
    """A corpus named docs.jsonl in the directory named as the index's: the index's docs.jsonl would
    replace it (fields beyond id and contents dropped, titles re-quoted), and the index then refuses
    the very corpus it was built from (its sha256 changed)."""
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)  # serve-retriever: never start serving
    data = tmp_path / "data"
    data.mkdir()
    corpus = data / "docs.jsonl"
    corpus.write_text('{"id": "1", "contents": "Alpha\\nalpha text", "meta": "keep me"}\n')
    before = corpus.read_bytes()
    out = _usage_error([*command[:-1], "--corpus", str(corpus), command[-1], str(data)])
    assert "would write its docs.jsonl over this corpus file" in out
    assert corpus.read_bytes() == before
    assert sorted(p.name for p in data.iterdir()) == ["docs.jsonl"]


def test_names_from_the_data_and_paths_print_as_they_are(tmp_path):
    """Rich reads [word] as markup: a benchmark named "hotpot[/dev]" (metadata.benchmark, or a file
    stem) raised MarkupError after score.json was written (a traceback, exit 1), "nq[dev]" printed as
    "nq", and an --out with brackets did the same to `index build` after the index was built."""
    qa = tmp_path / "qa"
    qa.mkdir()
    (qa / "mine.jsonl").write_text(
        '{"id": "a", "question": "q?", "golden_answers": ["Paris"], "metadata": {"benchmark": "nq[dev]"}}\n'
        '{"id": "b", "question": "q2?", "golden_answers": ["x"], "metadata": {"benchmark": "hotpot[/dev]"}}\n')
    preds = tmp_path / "p.jsonl"
    preds.write_text('{"id": "a", "prediction": "paris"}\n{"id": "b", "prediction": "y"}\n')
    res = runner.invoke(app, ["score", "--data-dir", str(qa), "--predictions", str(preds),
                              "--out", str(tmp_path / "s.json")])
    assert res.exit_code == 0, res.output
    assert "nq[dev]" in res.output and "hotpot[/dev]" in res.output
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "1", "contents": "\\"Paris\\"\\nParis is the capital of France."}\n')
    out = tmp_path / "idx[/x]"
    res = runner.invoke(app, ["index", "build", "--corpus", str(corpus), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert str(out) in " ".join(res.output.split())


def test_every_commands_summary_is_one_line_so_the_command_lists_read_as_sentences():
    """Typer's command list (`selfevo --help`, `selfevo index --help`) keeps the line breaks of a
    docstring's first paragraph: a summary wrapped in the source printed as broken lines there."""
    import inspect

    import typer

    def commands(group, path):
        for name, sub in getattr(group, "commands", {}).items():
            yield f"{path} {name}", sub
            yield from commands(sub, f"{path} {name}")

    listed = list(commands(typer.main.get_command(app), "selfevo"))
    assert len(listed) >= 20
    for path, command in listed:
        summary = inspect.cleandoc(command.help or "").split("\n\n")[0]
        assert summary and "\n" not in summary, path
    out = CliRunner().invoke(app, ["--help"], terminal_width=200).output
    assert "per step and round." in out and "the oracle," not in out


def test_evolve_on_a_corpus_without_benchmarks_names_the_flag_and_where_it_looked(tmp_path):
    """`--corpus` looks for qa/ beside the corpus's directory; when there is none the error is said in
    the command's words (--qa-dir, the path looked at), not as the config field it became."""
    corpus = tmp_path / "c" / "corpus.jsonl"
    corpus.parent.mkdir()
    corpus.write_text('{"id": "0", "contents": "\\"A\\"\\nB."}\n')
    out = _usage_error(["evolve", "--backend", "lm", "--corpus", str(corpus), "--out", str(tmp_path / "run")])
    assert "--qa-dir: not given" in out and str(tmp_path / "qa") in out
    assert not (tmp_path / "run").exists()


def test_an_unknown_agent_spec_shows_how_each_is_written(tmp_path):
    (tmp_path / "nq.jsonl").write_text('{"id": "q1", "question": "who?", "golden_answers": ["X"]}\n')
    out = _usage_error(["eval", "--data-dir", str(tmp_path), "--agent", "nope", "--out", str(tmp_path / "e")])
    assert "lm:MODEL[@POLICY.safetensors]" in out and "remote:MODEL@URL" in out


def test_a_command_help_flows_its_docstring_paragraphs():
    """rich keeps a docstring's line breaks: at 80 columns a hard-wrapped paragraph printed
    half-empty lines. Each paragraph is one line for the terminal to wrap."""
    res = CliRunner().invoke(app, ["demo", "--help"], terminal_width=80, env={"COLUMNS": "80"})
    assert res.exit_code == 0
    lines = [x.strip() for x in res.output.splitlines()]
    assert "Every treatment over several seeds, the audit, the downstream evaluation, the" in lines
    assert "replay bank study," not in lines  # a source line break kept: a line ending mid-sentence


def test_serve_model_takes_every_name_of_the_shipped_model(monkeypatch):
    """README and lm.model's default call it smollm2-135m; serve-model knew only `smollm2` and sent the
    other name to the Hub (a minute of retries, then an error about huggingface.co)."""
    from selfevo.agents.lm import model as lm_model
    from selfevo.agents.lm import server
    from selfevo.agents.lm.config import LMConfig

    loaded = []

    class Loaded:  # stands for the converted model: loading it is the slow tests' business
        def __init__(self, path, name=None, **options):
            loaded.append(str(path))
            self.name = name

    monkeypatch.setattr(lm_model, "smollm2_dir", lambda: "/converted/smollm2")
    monkeypatch.setattr(lm_model, "TransformersChatModel", Loaded)
    monkeypatch.setattr(server, "serve", lambda *args, **kwargs: None)
    for name in dict.fromkeys([LMConfig().model, "smollm2-135m", "smollm2"]):
        res = runner.invoke(app, ["serve-model", "--model", name])
        assert res.exit_code == 0, (name, res.output, res.exception)
    assert loaded == ["/converted/smollm2"] * 2


@pytest.fixture
def hub_offline(monkeypatch):
    """A hub id not in the cache fails at once, as with no network, not after a minute of retries
    (huggingface_hub reads HF_HUB_OFFLINE once, at import: the constant is set too)."""
    pytest.importorskip("transformers")
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize("spec", ["selfevo-test/no-such-model", "{tmp}/no-model"])
def test_a_chat_model_that_cannot_be_loaded_is_named_with_the_remedy(tmp_path, hub_offline, spec):
    """transformers says only that it could not reach huggingface.co (or, for a missing directory, that
    the path is a malformed hub id): the error names the model and what to do, as the encoder's does."""
    spec = spec.format(tmp=tmp_path)
    out = _usage_error(["serve-model", "--model", spec])
    assert f"cannot load language model '{spec}'" in out
    assert "local Hugging Face cache" in out and "smollm2-135m" in out


@pytest.mark.parametrize("model, said", [
    ("selfevo-test/no-such-model", "cannot load language model '{model}': "),
    # no hub id either: transformers read a file as one, and an empty directory as a model whose tokenizer
    # needs sentencepiece (six lines, with the hub hint)
    ("{tmp}/empty", "language model '{model}': {model} holds no config.json (nor a PEFT adapter's"),
    ("{tmp}/c.jsonl", "language model '{model}': {model} is a file; give the directory"),
])
def test_an_lm_agent_whose_model_cannot_be_loaded_is_named_with_the_remedy(tmp_path, hub_offline, model, said):
    """`eval --agent lm:HUB_ID` (the policy's load, not the chat model's): the same error, exit 2."""
    (tmp_path / "empty").mkdir()
    qa = tmp_path / "qa"
    qa.mkdir()
    (qa / "nq.jsonl").write_text('{"id": "q1", "question": "who?", "golden_answers": ["x"]}\n')
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "1", "contents": "\\"Paris\\"\\nParis is the capital of France."}\n')
    model = model.format(tmp=tmp_path)
    out = _usage_error(["eval", "--agent", f"lm:{model}", "--data-dir", str(qa), "--corpus", str(corpus),
                        "--limit", "1", "--out", str(tmp_path / "e")])
    assert said.format(model=model) in out and ("local Hugging Face cache" in out) == ("no-such-model" in model)


def test_a_resume_without_audit_does_not_print_an_earlier_audit_of_fewer_rounds_as_the_runs(tmp_path):
    """A run audited while stopped (`selfevo audit` of its round 1), then resumed with --no-audit, keeps
    that audit: evolve printed it as the run's audit table, one round of the run's two."""
    import json

    out = tmp_path / "run"
    res = runner.invoke(app, ["evolve", "--world", "small", "--out", str(out), "--no-audit", *TINY])
    assert res.exit_code == 0, res.output
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "status": "running", "rounds_completed": 1}))
    res = runner.invoke(app, ["audit", str(out), "--no-figures", "--no-progress"])
    assert res.exit_code == 0 and "rounds audited: 1 of 2" in " ".join(res.output.split()), res.output
    res = runner.invoke(app, ["evolve", "--world", "small", "--out", str(out), "--resume", "--no-audit", *TINY])
    text = " ".join(res.output.split())
    assert res.exit_code == 0, res.output
    assert "audit (oracle) by round" not in text
    assert "audits round(s) 1 of the 2 this run completed" in text and f"selfevo audit {out}" in text


def test_an_optional_dependency_not_installed_is_one_line_naming_its_extra(tmp_path, monkeypatch):
    """`pip install -e .` (the README's main job) has no torch: `serve-model` or `evolve --backend lm`
    then ended in a ModuleNotFoundError traceback, exit 1."""
    import sys

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}\n")
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails as when it is not installed
    out = _usage_error(["serve-model", "--model", str(model)])
    assert "torch" in out and "pip install -e '.[lm]'" in out


def test_a_second_demo_into_one_out_is_refused_before_any_job(tmp_path):
    """Two demos into one --out split its jobs (each refused the runs the other was writing) and each
    wrote a report of its half over the other's, exit 1."""
    from selfevo._io import hold_directory

    plan = tmp_path / "plan.toml"
    plan.write_text('[demo]\ntreatments = ["coupled"]\nseeds = 1\nworld = "small"\nreplay_conditions = []\n'
                    "[loop]\nrounds = 1\nproposer_steps = 2\nsolver_steps = 2\nadmit_per_round = 20\n")
    out = tmp_path / "demo"
    out.mkdir()
    with hold_directory(out, None):  # the first demo, still running
        text = _usage_error(["demo", "--config", str(plan), "--out", str(out), "--workers", "1"])
    assert f"{out}: another demo is writing here" in text
    assert list(out.iterdir()) == []


def test_evolve_help_states_the_defaults_and_what_resume_does_with_no_run(tmp_path):
    """--seed, --rounds and --world said nothing of their defaults, and --resume said it continues a
    killed run, while with no run in --out it starts one (a kill before the run was made resumes so)."""
    from selfevo.config import RunConfig

    text = " ".join(runner.invoke(app, ["evolve", "--help"], env={"COLUMNS": "400"}).output.split())
    default = RunConfig()
    assert f"run seed (default: the config's, else {default.seed})" in text
    assert f"rounds of the loop (default: the config's, else {default.loop.rounds})" in text
    assert f"a world directory (default: the config's, else {default.world.name})" in text
    assert "with no run there, start it" in text
    res = runner.invoke(app, ["evolve", "--world", "small", "--out", str(tmp_path / "new"), "--resume",
                              "--no-audit", *TINY])
    assert res.exit_code == 0 and (tmp_path / "new" / "checkpoints" / "round-2.json").exists(), res.output


def test_a_new_run_into_a_directory_of_other_files_is_refused_and_they_are_kept(tmp_path):
    """`evolve --out DIR` into a directory that held no run wrote the run among its files: a user's
    config.json was replaced by the run's (a world directory, `--out worlds/small`, got a run too)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}\n')
    for extra in ("notes.txt", None):  # with another file, and with the config.json alone
        if extra:
            (mine / extra).write_text("notes\n")
        out = _usage_error(["evolve", "--world", "small", "--out", str(mine), *TINY])
        assert f"{mine}: not empty and holds no run (it has {extra or 'config.json'})" in out
        assert (mine / "config.json").read_text() == '{"mine": true}\n'
        if extra:
            (mine / extra).unlink()
    assert sorted(p.name for p in mine.iterdir()) == ["config.json"]
    # what a start killed before its manifest leaves (its config.json, a temp file) is started afresh
    killed = tmp_path / "killed"
    res = runner.invoke(app, ["evolve", "--world", "small", "--out", str(killed), "--no-audit", *TINY])
    assert res.exit_code == 0, res.output
    for name in ("manifest.json", "records", "eval", "checkpoints", "folds.json", "compute.json"):
        path = killed / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    (killed / ".manifest.json.k1ll3d00.tmp").write_text("{")
    res = runner.invoke(app, ["evolve", "--world", "small", "--out", str(killed), "--no-audit", *TINY])
    assert res.exit_code == 0, res.output
    assert not list(killed.glob(".*.tmp")) and (killed / "checkpoints" / "round-2.json").exists()


@pytest.mark.parametrize("damage", ["metrics", "eval-empty", "eval-no-macro"])
def test_a_run_damaged_before_its_print_is_named_not_a_traceback(tmp_path, damage, capsys):
    """`evolve` and `engine-run` print the run's audit and evaluations after it finished: a file damaged
    in between is named (exit 2) by the checked readers, not a traceback."""
    import typer

    from selfevo.cli import _print_run

    (tmp_path / "audit").mkdir()
    (tmp_path / "eval").mkdir()
    (tmp_path / "manifest.json").write_text('{"rounds_completed": 1}')
    bad = {"metrics": (tmp_path / "audit" / "metrics.json", '{"rounds": [{"rou'),
           "eval-empty": (tmp_path / "eval" / "round-1.json", "{}"),
           "eval-no-macro": (tmp_path / "eval" / "round-1.json", '{"benchmarks": {"nq": {"cover_em": 0.5}}}')}
    path, text = bad[damage]
    path.write_text(text)
    with pytest.raises(typer.Exit) as e:
        _print_run(tmp_path)
    assert e.value.exit_code == 2
    assert path.name in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("command, target, says", [
    (["evolve", "--world", "small", "--out", "{out}"], "selfevo.evolve.evolve",  # stopped before the run was made
     "no run was made there yet (stopped before its config was written): run the same command again"),
    (["demo", "--world", "small", "--seeds", "1", "--out", "{out}"], "selfevo.demo.run_demo",
     "run the same command again: finished runs are skipped, stopped ones resume"),
    # eval and audit stopped silently too (a helper's review)
    # (stopped before its first answer: it named an answers file that was not there; a review of the diff)
    (["eval", "--data-dir", "{out}/qa", "--out", "{out}"], "selfevo.evaluate.run_eval",
     "stopped before its first answer: run the same command again"),
    (["audit", "--records", "{records}", "--judge", "gold", "--out", "{out}"], "selfevo.audit.pipeline.audit_to_dir",
     "run the same command again"),
])
def test_ctrl_c_says_how_to_go_on(command, target, says, tmp_path, monkeypatch):
    """Ctrl-C ended a run with exit status 130 and not a word: nothing said that the work is kept."""
    def stopped(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(target, stopped)
    out, records = tmp_path / "o", tmp_path / "records.jsonl"
    records.write_text(json.dumps({"round": 1, "step": 0, "source_id": "d", "source": "s", "question": "q?",
                                   "label": "a", "responses": ["a"], "gold_answers": ["a"]}) + "\n")
    result = CliRunner().invoke(app, [x.replace("{out}", str(out)).replace("{records}", str(records))
                                      for x in command])
    assert result.exit_code == 130
    assert f"stopped: {out}: {says.replace('{out}', str(out))}" in " ".join(result.output.split())


def test_eval_stopped_after_answers_names_the_file_it_goes_on_from(tmp_path, monkeypatch):
    out = tmp_path / "o"

    def stopped(*a, **k):  # answers appended, then Ctrl-C
        out.mkdir()
        (out / "predictions.partial.jsonl").write_text('{"partial_of": {}}\n')
        raise KeyboardInterrupt

    monkeypatch.setattr("selfevo.evaluate.run_eval", stopped)
    result = CliRunner().invoke(app, ["eval", "--data-dir", str(tmp_path), "--out", str(out)])
    assert result.exit_code == 130
    assert (f"stopped: {out}: run the same command again: it goes on from the answers given "
            f"({out / 'predictions.partial.jsonl'})") in " ".join(result.output.split())


@pytest.mark.parametrize("args, says", [
    (["--agent", "retrieval-baseline", "--lm-set", "max_new_tokens=12"], "agent 'retrieval-baseline' takes neither"),
    (["--agent", "remote:m@http://127.0.0.1:9/v1", "--workers", "2"], "takes neither"),
    (["--agent", "lm:smollm2-135m", "--lm-set", "model=foo"], "the model is the agent's own"),
])
def test_eval_refuses_lm_settings_an_agent_would_run_without(args, says, tmp_path):
    """`--lm-set` and `--workers` given to the baseline or a remote agent, and `--lm-set model=`, were
    dropped without a word: the evaluation ran as if they had been applied (a helper's review)."""
    result = CliRunner().invoke(app, ["eval", "--data-dir", str(tmp_path), "--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 2 and says in " ".join(result.output.split())


def test_an_oracle_audit_that_resolves_nothing_says_why(capsys):
    """An oracle audit of a language-model run on a world resolves nothing: the oracle reads only the
    world's own question wording. The warning blamed failed calls (a helper's review)."""
    from selfevo.audit import METRICS
    from selfevo.cli import _print_audit_rounds

    row = {"round": 1, **dict.fromkeys(METRICS), "coverage": 0.0}
    _print_audit_rounds({"judge": "oracle", "rounds": [row]})
    said = " ".join(capsys.readouterr().err.split())
    assert "the judge resolved no item" in said and "audit a language-model run on a world with --judge llm" in said


def test_an_out_that_is_an_input_or_lies_inside_one_is_refused_and_the_input_kept(tmp_path):
    """`score --out` over its predictions (or into its QA directory), `replay build --out` into a run:
    the command wrote over what it read (a helper's sweep of the commands' error paths)."""
    qa = tmp_path / "qa"
    qa.mkdir()
    (qa / "nq.jsonl").write_text(json.dumps({"id": "1", "question": "q?", "golden_answers": ["x"]}) + "\n")
    preds = tmp_path / "p.jsonl"
    preds.write_text(json.dumps({"id": "1", "prediction": "a"}) + "\n")
    before = {p: p.read_bytes() for p in (preds, qa / "nq.jsonl")}
    for out in (preds, qa / "nq.jsonl"):
        text = _usage_error(["score", "--data-dir", str(qa), "--predictions", str(preds), "--out", str(out)])
        assert f"--out: {out} would write over" in text
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    text = _usage_error(["replay", "build", "--from", str(run), "--out", str(run / "config.json")])
    assert "which this command reads" in text and (run / "config.json").read_text() == "{}"
    assert {p: p.read_bytes() for p in before} == before


def test_index_and_demo_outs_of_other_files_are_refused_and_the_files_kept(tmp_path):
    """`index build` wrote its docs.jsonl and manifest.json over a directory's own; `demo` wrote its
    runs beside unrelated files. Both are refused now, before any work (an encoder load, a job)."""
    corpus = _one_doc_corpus(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "manifest.json").write_text('{"mine": true}')
    (mine / "keep.txt").write_text("keep")
    text = _usage_error(["index", "build", "--corpus", str(corpus), "--out", str(mine)])
    assert "holds a manifest.json that is no index's" in text
    (mine / "manifest.json").unlink()
    text = _usage_error(["index", "build", "--corpus", str(corpus), "--retriever", "dense", "--out", str(mine)])
    assert "not empty, and holds no index" in text
    assert sorted(p.name for p in mine.iterdir()) == ["keep.txt"]
    text = _usage_error(["demo", "--out", str(mine), "--workers", "1"])
    assert "holds files no demo wrote (keep.txt)" in text and sorted(p.name for p in mine.iterdir()) == ["keep.txt"]
    text = _usage_error(["index", "build", "--corpus", str(corpus), "--retriever", "hybrid", "--depth", "0",
                         "--out", str(tmp_path / "h")])
    assert "--depth" in text and not (tmp_path / "h").exists()
    # into a new directory, over an index, and over what a killed build left (its staged documents)
    build = ["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "b")]
    assert runner.invoke(app, build).exit_code == 0 and runner.invoke(app, build).exit_code == 0
    (tmp_path / "b" / "manifest.json").unlink()
    assert runner.invoke(app, build).exit_code == 0
    # a hybrid build that failed (a malformed line) left dense/ with nothing in it: the corrected retry runs
    bad = tmp_path / "bad.jsonl"
    bad.write_text(corpus.read_text() + '{"id": "d2", "contents": \n')
    hybrid = ["index", "build", "--retriever", "hybrid", "--out", str(tmp_path / "hy")]
    assert "bad.jsonl:2: malformed JSON" in _usage_error([*hybrid, "--corpus", str(bad)])
    assert (tmp_path / "hy" / "dense").is_dir()
    assert runner.invoke(app, [*hybrid, "--corpus", str(corpus)]).exit_code == 0


@pytest.mark.parametrize("kind, options", [("bm25", ["--index-type", "hnsw"]), ("bm25", ["--model", "m"]),
                                            ("bm25", ["--faiss-param", "nprobe=4"]), ("dense", ["--rrf-k", "10"]),
                                            ("bm25", ["--device", "cuda"]), ("bm25", ["--batch-size", "8"]),
                                            ("bm25", ["--query-prefix", "q: "]), ("dense", ["--depth", "10"])])
def test_index_build_refuses_settings_its_kind_does_not_read(tmp_path, kind, options):
    """`--retriever bm25 --index-type hnsw` built a BM25 index and dropped the FAISS setting unsaid."""
    corpus = _one_doc_corpus(tmp_path)
    text = _usage_error(["index", "build", "--corpus", str(corpus), "--retriever", kind, *options,
                         "--out", str(tmp_path / "i")])
    assert f"{options[0]}: not read by a {kind} index" in text and not (tmp_path / "i").exists()


def test_a_scripted_judges_answer_key_of_another_shape_is_named_not_a_traceback(tmp_path):
    key = tmp_path / "key.json"
    for content, says in (("[1, 2]", "expected an object"), ('{"q1": "x"}', "entry 'q1'")):
        key.write_text(content)
        text = _usage_error(["serve-model", "--model", "scripted:judge", "--script-file", str(key)])
        assert f"{key}: " in text and says in text


@pytest.mark.parametrize("command", [["serve-retriever", "--corpus", "{corpus}", "--index-dir", "{tmp}/idx"],
                                     ["serve-model", "--model", "scripted:echo"]])
def test_a_port_in_use_is_named_before_the_start_up(tmp_path, command):
    """The index was built (or the model loaded) before uvicorn found the port taken: exit 3 and its
    own words, after "serving ..." was printed."""
    import socket

    corpus = _one_doc_corpus(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = [a.format(corpus=corpus, tmp=tmp_path) for a in command]
        text = _usage_error([*args, "--port", str(port)])
    assert f"--host/--port: cannot listen on 127.0.0.1:{port}" in text and "serving" not in text
    assert not (tmp_path / "idx").exists()


def test_a_missing_policy_file_is_named_before_the_model_loads(tmp_path, monkeypatch):
    import selfevo.agents.lm.policy as policy

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(policy, "LMPolicy", no_model)
    qa = tmp_path / "qa"
    qa.mkdir()
    (qa / "nq.jsonl").write_text(json.dumps({"id": "1", "question": "q?", "golden_answers": ["x"]}) + "\n")
    corpus = _one_doc_corpus(tmp_path)
    text = _usage_error(["eval", "--data-dir", str(qa), "--corpus", str(corpus), "--out", str(tmp_path / "ev"),
                         "--agent", f"lm:smollm2-135m@{tmp_path}/nope.safetensors"])
    assert "nope.safetensors: cannot read the policy file" in text


@pytest.mark.parametrize("url, says", [("notaurl", "expected http(s)://HOST:PORT"),
                                       ("http://127.0.0.1:9", "retriever URL http://127.0.0.1:9: ")])
def test_a_retriever_url_that_answers_nothing_is_named_before_anything_is_written(tmp_path, url, says):
    qa = tmp_path / "qa"
    qa.mkdir()
    (qa / "nq.jsonl").write_text(json.dumps({"id": "1", "question": "q?", "golden_answers": ["x"]}) + "\n")
    text = _usage_error(["eval", "--data-dir", str(qa), "--retriever-url", url, "--out", str(tmp_path / "ev")])
    assert says in text and not (tmp_path / "ev").exists()


def test_an_engine_runs_retriever_url_that_answers_nothing_is_named_before_anything_is_written(tmp_path, monkeypatch):
    """engine-run's /retrieve server was first asked by a phase's first search (after a model load, the run
    created, perhaps hours of training when only the evaluation searches): it is probed as eval's is."""
    from selfevo.integrations import engine

    def started(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(engine, "EngineRun", started)
    config = Path(__file__).parents[1] / "configs" / "trl-tiny.toml"
    text = _usage_error(["engine-run", "--engine", "trl", "--config", str(config), "--out", str(tmp_path / "run"),
                         "--set", "engine.retriever_url=http://user:secret@127.0.0.1:9/retrieve"])
    assert "engine.retriever_url http://***@127.0.0.1:9/retrieve: " in text and "secret" not in text
    assert "--resume" not in text and not (tmp_path / "run").exists()


@pytest.mark.parametrize("error", ["grading", "endpoint", "process"])
def test_engine_run_says_to_resume_after_a_phase_that_failed_part_way(tmp_path, monkeypatch, error):
    """A grader or MSV call failing for good, an endpoint down or a launcher's job failing escaped as a
    traceback (exit 1), never saying that --resume goes on from the last finished phase."""
    import subprocess

    from selfevo.agents.chat_client import EndpointError
    from selfevo.integrations import engine
    from selfevo.integrations.rewards import GradingFailed

    raised = {"grading": GradingFailed("round 2: 3 of 10 samples of grader aux-1 failed after retries"),
              "endpoint": EndpointError("http://127.0.0.1:9/v1: 16 calls in a row failed"),
              "process": subprocess.CalledProcessError(1, ["accelerate", "launch"])}[error]

    def fails(*args, **kwargs):
        raise raised

    monkeypatch.setattr(engine, "engine_run", fails)
    config = Path(__file__).parents[1] / "configs" / "trl-tiny.toml"
    text = _usage_error(["engine-run", "--engine", "trl", "--config", str(config), "--out", str(tmp_path / "run")])
    assert str(raised).split(";")[0][:40] in text and "the same command with --resume goes on" in text


def test_resume_with_no_options_and_no_run_is_refused_and_a_stop_before_the_config_says_so(tmp_path, monkeypatch):
    """A run stopped before its config.json was written (the world or index building, a model
    loading) printed "selfevo evolve --out OUT --resume", which then started a run of the defaults
    (another world, treatment and schedule) and exited 0. Now the resume is refused and the stop says
    to run the same command again; once the config is written, the stop gives the resume command."""
    out = tmp_path / "run"
    text = _usage_error(["evolve", "--out", str(out), "--resume"])
    assert f"--resume: {out} holds no run to resume" in text and not out.exists()

    import selfevo.evolve

    writes = {"config": False}

    def stopped(cfg, out, **kw):  # SIGTERM's exit, as terminate_raises raises it
        if writes["config"]:
            Path(out).mkdir()
            (Path(out) / "config.json").write_text("{}")
        raise SystemExit(143)

    monkeypatch.setattr(selfevo.evolve, "evolve", stopped)
    says = {False: "no run was made there yet (stopped before its config was written): run the same command again",
            True: f"the run goes on from its last checkpoint (of a round, or within one): selfevo evolve --out {out} "
                  "--resume"}
    for writes["config"] in (False, True):
        res = runner.invoke(app, ["evolve", "--world", "small", "--out", str(out)])
        assert res.exit_code == 143 and says[writes["config"]] in " ".join(res.output.split()), res.output


def test_a_rollout_worker_that_died_is_one_line_saying_how_to_go_on(tmp_path, monkeypatch):
    """`eval --workers`: a Ray actor that died (killed, out of memory) was a traceback; it is one error
    line naming the answers kept, which the same command goes on from."""
    import selfevo.evaluate
    from selfevo.agents.lm.workers import WorkerDied

    def died(**kw):
        raise WorkerDied("a rollout worker died: The actor died unexpectedly")

    monkeypatch.setattr(selfevo.evaluate, "run_eval", died)
    qa = tmp_path / "qa"
    qa.mkdir()
    text = _usage_error(["eval", "--data-dir", str(qa), "--agent", "lm:smollm2-135m", "--workers", "2",
                         "--out", str(tmp_path / "out")])
    assert "a rollout worker died: The actor died unexpectedly; the same command again goes on from the " \
           "answers given" in text


def test_an_index_directory_is_no_run(tmp_path):
    """An index's manifest.json passed for a run's: `evolve --out IDX` said "a run already exists here;
    pass --resume", and the resume then said to remove the directory (the index) to start afresh."""
    corpus = _one_doc_corpus(tmp_path)
    idx = tmp_path / "idx"
    assert runner.invoke(app, ["index", "build", "--corpus", str(corpus), "--out", str(idx)]).exit_code == 0
    before = {p: p.read_bytes() for p in idx.rglob("*") if p.is_file()}
    assert "not empty and holds no run (it has" in _usage_error(["evolve", "--world", "small", "--out", str(idx)])
    assert "holds no run to resume" in _usage_error(["evolve", "--out", str(idx), "--resume"])
    assert "not a run directory (no run manifest.json)" in _usage_error(["audit", str(idx)])
    assert {p: p.read_bytes() for p in idx.rglob("*") if p.is_file()} == before


def test_retriever_settings_nothing_reads_are_refused(tmp_path):
    """`eval --retriever-url` searched the server whatever --index, --retriever or --model said (score.json
    then recorded neither), and `--model` over a BM25 index (eval, serve-retriever) was dropped."""
    import socket

    qa = tmp_path / "qa"
    qa.mkdir()
    (qa / "nq.jsonl").write_text(json.dumps({"id": "1", "question": "Q?", "golden_answers": ["x"]}) + "\n")
    corpus = _one_doc_corpus(tmp_path)
    url = ["--retriever-url", "http://127.0.0.1:9"]
    for extra, named in ((["--index", str(tmp_path)], "--index"), (["--retriever", "dense"], "--retriever"),
                         (["--model", "m"], "--model")):
        text = _usage_error(["eval", "--data-dir", str(qa), *url, *extra, "--out", str(tmp_path / "o")])
        assert f"{named}: the server at --retriever-url searches its own index" in text
    text = _usage_error(["eval", "--data-dir", str(qa), "--corpus", str(corpus), "--model", "m",
                         "--out", str(tmp_path / "o")])
    assert "encoder model 'm': a bm25 index reads none" in text
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    text = _usage_error(["serve-retriever", "--corpus", str(corpus), "--model", "m", "--port", str(port)])
    assert "encoder model 'm': a bm25 index reads none" in text


def test_help_texts_say_what_the_commands_do():
    """`compare --help` lost "[engine]" (rich read it as markup), and `evolve --treatment` said "coupled
    (default)" where the config's treatment is the default (a helper's walk through the CLI)."""
    def said(*args: str) -> str:
        result = CliRunner().invoke(app, [*args, "--help"], terminal_width=200)
        assert result.exit_code == 0, result.output
        return " ".join(result.output.replace("│", " ").split())

    assert "for an engine-run, [engine] table" in said("compare")
    assert "(default: the config's, else coupled)" in said("evolve") and "coupled (default)" not in said("evolve")
    assert "rounds 2 and later" in said("replay", "build")


def test_a_model_named_by_a_path_under_home_is_checked_where_it_points(tmp_path, monkeypatch):
    """`~/models/x` is a path (expanded as the shell would): missing, it is reported as missing; present, it passes."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "model").mkdir()
    check_local_path("~/model")
    with pytest.raises(FileNotFoundError) as err:
        check_local_path("~/no-model")
    assert err.value.filename == "~/no-model"


def test_a_users_warning_is_one_line_each_time_it_happens(capsys):
    """SoftwareChanged and UntrainedGrader print as one `warning:` line, every time (a resumed run may
    warn again hours later), not Python's `file:line: Category: ...` form shown once per place."""
    import warnings

    with _warnings_as_lines():
        for _ in range(2):
            warnings.warn("resumed under other software", SoftwareChanged, stacklevel=1)
            warnings.warn("aux-1 had nothing to train on", UntrainedGrader, stacklevel=1)
    said = capsys.readouterr().err
    assert said.count("warning: resumed under other software") == 2, said
    assert said.count("warning: aux-1 had nothing to train on") == 2, said
    assert "SoftwareChanged" not in said and "UntrainedGrader" not in said


def test_selfevo_traceback_reraises_what_is_otherwise_one_line(tmp_path, monkeypatch):
    """SELFEVO_TRACEBACK=1 is the way to see where a path or an optional dependency failed: the
    OSError or ImportError comes out as itself, not as the `error:` line."""
    import sys

    args = ["score", "--data-dir", str(tmp_path / "nope"), "--predictions", str(tmp_path / "p.jsonl"),
            "--out", str(tmp_path / "s.json")]
    assert "nope: No such file or directory" in _usage_error(args)
    res = runner.invoke(app, args, env={"SELFEVO_TRACEBACK": "1"})
    assert res.exit_code == 1 and isinstance(res.exception, FileNotFoundError), res.output
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}\n")
    monkeypatch.setitem(sys.modules, "torch", None)
    res = runner.invoke(app, ["serve-model", "--model", str(model)], env={"SELFEVO_TRACEBACK": "1"})
    assert res.exit_code == 1 and isinstance(res.exception, ImportError), res.output


@pytest.mark.parametrize("raised, says, code", [
    # ours, naming the extra: one line as it is
    (ImportError("faiss is not installed: pip install -e '.[dense]'"), "pip install -e '.[dense]'", 2),
    # a submodule of an optional dependency: the extra of its package
    (ImportError("No module named 'torch.cuda'", name="torch.cuda"), "this needs the 'lm' extra", 2),
    # no optional dependency: a broken install, left to its traceback
    (ImportError("No module named 'numpy_nope'", name="numpy_nope"), None, 1),
])
def test_an_import_error_is_one_line_only_for_an_optional_dependency(tmp_path, monkeypatch, raised, says, code):
    def fails(*args, **kwargs):
        raise raised

    monkeypatch.setattr(selfevo.evaluate, "score_files", fails)
    res = runner.invoke(app, ["score", "--data-dir", str(tmp_path), "--predictions", str(tmp_path / "p.jsonl"),
                              "--out", str(tmp_path / "s.json")])
    assert res.exit_code == code, (res.output, res.exception)
    if says is None:
        assert res.exception is raised
    else:
        assert says in " ".join(res.output.split()) and "Traceback" not in res.output


def test_out_under_a_file_is_named_before_the_work(tmp_path):
    """`--out afile/sub`: the file in the way is named, not the directory that cannot be made."""
    (tmp_path / "afile").write_text("mine\n")
    out = _usage_error(["eval", "--data-dir", str(tmp_path / "no-qa"), "--corpus", str(tmp_path / "no.jsonl"),
                        "--out", str(tmp_path / "afile" / "sub")])
    assert f"{tmp_path / 'afile'}: exists and is not a directory" in out
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_a_host_that_is_no_address_is_named(tmp_path):
    """A --host that cannot even be looked up (an empty label) is one line naming --host, not a traceback."""
    corpus = _one_doc_corpus(tmp_path)
    text = _usage_error(["serve-retriever", "--corpus", str(corpus), "--host", "a..b"])
    assert "--host: a..b: " in text


def test_faiss_params_are_read_as_written_and_checked_before_the_encoder(capsys):
    import typer

    options = _dense_options(None, "ivf", 8, "cuda", 7, 9, "q: ", "p: ", [" nprobe = 4"])
    assert options.faiss_params == {"nprobe": 4} and (options.index_type, options.batch_size) == ("ivf", 8)
    assert (options.device, options.rrf_k, options.depth) == ("cuda", 7, 9)
    assert (options.query_prefix, options.passage_prefix) == ("q: ", "p: ")
    for bad, says in ((["nprobe=x"], "expected NAME=INTEGER"), (["nprobe=\u00b2"], "expected NAME=INTEGER"),
                      (["ef_search=4"], "takes no parameter 'ef_search'"), (["nprobe=0"], "must be an integer >= 1"),
                      (["nprobe=-3"], "must be an integer >= 1, got -3")):
        with pytest.raises(typer.Exit) as e:
            _dense_options(None, "ivf", faiss_param=bad)
        assert e.value.exit_code == 2 and says in " ".join(capsys.readouterr().err.split())


def test_serve_retriever_needs_a_corpus_or_an_index_and_passes_its_options_on(tmp_path, monkeypatch):
    from _servers import free_port

    got = {}
    monkeypatch.setattr(selfevo.search.server, "serve", lambda **kw: got.update(kw))
    port = free_port()
    assert "give --corpus FILE or --index DIR" in _usage_error(["serve-retriever", "--port", str(port)])
    assert got == {}
    corpus = tmp_path / "c.jsonl"
    res = runner.invoke(app, ["serve-retriever", "--corpus", str(corpus), "--port", str(port), "--max-queries", "7",
                              "--retriever", "dense", "--model", "m", "--index-dir", str(tmp_path / "i")])
    assert res.exit_code == 0, res.output
    assert (got["corpus"], got["port"], got["max_queries"], got["retriever"]) == (corpus, port, 7, "dense")
    assert got["index_dir"] == tmp_path / "i" and got["options"].model == "m" and got["host"] == "127.0.0.1"


def test_index_build_names_an_unknown_retriever_and_passes_its_settings_on(tmp_path, monkeypatch):
    corpus = _one_doc_corpus(tmp_path)
    text = _usage_error(["index", "build", "--corpus", str(corpus), "--retriever", "bm26",
                         "--out", str(tmp_path / "i")])
    assert "--retriever: unknown retriever 'bm26' (known: " in text and not (tmp_path / "i").exists()
    got = {}

    def build(kind, corpus, out, options, progress):
        got.update(kind=kind, options=options)
        raise ValueError("stopped here")

    monkeypatch.setattr(selfevo.search.index, "build_index", build)
    text = _usage_error(["index", "build", "--corpus", str(corpus), "--retriever", "hybrid",
                         "--out", str(tmp_path / "i"), "--rrf-k", "7", "--depth", "9", "--index-type", "hnsw",
                         "--faiss-param", "ef_search=5",
                         "--batch-size", "3", "--device", "cuda", "--model", "m", "--query-prefix", "q: ",
                         "--passage-prefix", "p: "])
    assert "stopped here" in text and got["kind"] == "hybrid"
    o = got["options"]
    assert (o.rrf_k, o.depth, o.index_type, o.faiss_params, o.batch_size, o.device, o.model) == \
        (7, 9, "hnsw", {"ef_search": 5}, 3, "cuda", "m")
    assert (o.query_prefix, o.passage_prefix) == ("q: ", "p: ")


def test_index_import_checks_its_options_before_the_encoder_and_passes_them_on(tmp_path, monkeypatch):
    faiss, corpus = tmp_path / "e5.index", _one_doc_corpus(tmp_path)
    faiss.write_bytes(b"x")
    got = {}

    def encoder(model, **kw):
        got.update(model=model, **kw)
        return "the encoder"

    def adopt(faiss_file, corpus, out, encoder, **kw):
        got.update(encoder=encoder, **kw)
        raise ValueError("stopped here")

    monkeypatch.setattr(selfevo.search.dense, "Encoder", encoder)
    monkeypatch.setattr(selfevo.search.adopt, "adopt", adopt)
    base = ["index", "import", "--model", "m", "--out", str(tmp_path / "i")]
    text = _usage_error([*base, "--faiss", str(faiss), "--corpus", str(corpus), "--retriever", "bm25"])
    assert "--retriever: a FAISS index makes a dense or hybrid index, not 'bm25'" in text
    text = _usage_error([*base, "--faiss", str(tmp_path), "--corpus", str(corpus)])
    assert f"--faiss: {tmp_path}: a directory, not a file" in text
    text = _usage_error([*base, "--faiss", str(faiss), "--corpus", str(tmp_path / "no.jsonl")])
    assert f"--corpus: {tmp_path / 'no.jsonl'}: no such file" in text and got == {}
    text = _usage_error([*base, "--faiss", str(faiss), "--corpus", str(corpus), "--retriever", "hybrid",
                         "--check", "5", "--max-seq-length", "128", "--rrf-k", "7", "--depth", "9", "--batch-size", "3",
                         "--device", "cuda", "--query-prefix", "q: ", "--passage-prefix", "p: "])
    assert "stopped here" in text
    assert got == {"model": "m", "query_prefix": "q: ", "passage_prefix": "p: ", "batch_size": 3, "device": "cuda",
                   "max_seq_length": 128, "encoder": "the encoder", "check": 5, "progress": True, "hybrid": True,
                   "rrf_k": 7, "depth": 9}


def test_score_and_eval_refuse_an_out_their_qa_directory_would_read(tmp_path):
    """Any case of a QA suffix is read as a benchmark (NQ.JSONL too); `eval --out` the QA directory itself
    is named as such, not as a directory of stray files."""
    qa = tmp_path / "qa"
    qa.mkdir()
    (qa / "nq.jsonl").write_text(json.dumps({"id": "1", "question": "q?", "golden_answers": ["x"]}) + "\n")
    preds = tmp_path / "p.jsonl"
    preds.write_text(json.dumps({"id": "1", "prediction": "x"}) + "\n")
    for name in ("new.jsonl", "NEW.JSONL", "new.Parquet"):
        text = _usage_error(["score", "--data-dir", str(qa), "--predictions", str(preds), "--out", str(qa / name)])
        assert f"--out: {qa / name} would be read as a benchmark of --data-dir {qa}" in text
    text = _usage_error(["eval", "--data-dir", str(qa), "--out", str(qa)])
    assert f"--out: {qa} would be read as a benchmark of --data-dir {qa}" in text
    assert sorted(p.name for p in qa.iterdir()) == ["nq.jsonl"]
    # a new file of another suffix beside the benchmarks, or inside the predictions' directory, is no input
    for out in (qa / "score.json", tmp_path / "score.json"):
        res = runner.invoke(app, ["score", "--data-dir", str(qa), "--predictions", str(preds), "--out", str(out)])
        assert res.exit_code == 0 and json.loads(out.read_text()), res.output


def test_eval_refuses_an_out_of_other_files_and_a_finished_evaluation_but_goes_on_from_an_unfinished_one(
        tmp_path, monkeypatch):
    def reached(**kw):
        raise ValueError("run_eval reached")

    monkeypatch.setattr(selfevo.evaluate, "run_eval", reached)
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["eval", "--data-dir", str(tmp_path), "--out", str(out)]
    assert f"--out: {out} holds files no evaluation wrote (notes.txt)" in _usage_error(args)
    (out / "notes.txt").unlink()
    (out / "score.json").write_text("{}")
    assert f"--out: {out} holds a finished evaluation (score.json)" in _usage_error(args)
    (out / "predictions.partial.jsonl").write_text('{"partial_of": {}}\n')
    assert "run_eval reached" in _usage_error(args)
    assert (out / "score.json").read_text() == "{}"


def test_eval_passes_its_options_to_the_evaluation(tmp_path, monkeypatch):
    got = {}

    def reached(**kw):
        got.update(kw)
        raise ValueError("run_eval reached")

    monkeypatch.setattr(selfevo.evaluate, "run_eval", reached)
    text = _usage_error(["eval", "--data-dir", str(tmp_path), "--corpus", str(tmp_path / "c.jsonl"), "--limit", "3",
                         "--agent", "lm:smollm2-135m", "--workers", "2", "--lm-set", "max_new_tokens=12",
                         "--retriever", "dense", "--model", "m", "--index", str(tmp_path / "i"),
                         "--out", str(tmp_path / "o")])
    assert "run_eval reached" in text
    assert (got["limit"], got["agent"], got["retriever_kind"], got["index"]) == (3, "lm:smollm2-135m", "dense",
                                                                              tmp_path / "i")
    assert got["corpus"] == tmp_path / "c.jsonl" and got["dense_options"].model == "m"
    assert got["agent_context"]["workers"] == 2 and got["agent_context"]["lm_options"]["max_new_tokens"] == 12
    _usage_error(["eval", "--data-dir", str(tmp_path), "--out", str(tmp_path / "o2")])
    assert got["agent_context"] is None and got["limit"] is None


def test_data_download_passes_its_options_on_and_a_dry_run_says_nothing_is_ready(tmp_path, monkeypatch):
    got = {}

    def download(out, benchmarks, **kw):
        got.update(out=out, benchmarks=benchmarks, **kw)
        return {"out": str(out)}

    monkeypatch.setattr(selfevo.data, "download_data", download)
    args = ["data", "download", "--out", str(tmp_path / "d"), "--benchmarks", "nq", "--per-benchmark", "5",
            "--seed", "9", "--no-corpus", "--revision", "r1", "--corpus-revision", "r2", "--qa-repo", "a/qa",
            "--corpus-repo", "a/c", "--corpus-file", "c.jsonl"]
    res = runner.invoke(app, [*args, "--dry-run"])
    assert res.exit_code == 0 and "data ready" not in res.output, res.output
    assert {k: v for k, v in got.items() if k != "log"} == {
        "out": tmp_path / "d", "benchmarks": "nq", "per_benchmark": 5, "seed": 9, "corpus": False, "revision": "r1",
        "corpus_revision": "r2", "qa_repo": "a/qa", "corpus_repo": "a/c", "corpus_file": "c.jsonl", "dry_run": True}
    res = runner.invoke(app, args)
    assert res.exit_code == 0 and "data ready in" in res.output and got["dry_run"] is False, res.output


def test_world_make_writes_into_an_empty_directory_and_names_what_holds_it_back(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert runner.invoke(app, ["world", "make", "--size", "small", "--out", str(empty)]).exit_code == 0
    assert (empty / "world.json").is_file()
    assert f"{empty}: not empty; a world is written once" in _usage_error(
        ["world", "make", "--size", "small", "--out", str(empty)])
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert f"{other}: not empty, and holds no world (no world.json)" in _usage_error(
        ["world", "make", "--size", "small", "--out", str(other)])
    got = []

    def make(config):
        got.append(config)
        raise ValueError("stopped here")

    monkeypatch.setattr(selfevo.world, "make_world", make)
    assert "stopped here" in _usage_error(["world", "make", "--size", "small", "--seed", "4", "--confusable-rate",
                                           "0.3", "--shared-misreading", "0.2", "--value-skew", "0.5",
                                           "--out", str(tmp_path / "w")])
    c = got[0]
    assert (c.size, c.seed, c.confusable_rate, c.shared_misreading, c.value_skew) == ("small", 4, 0.3, 0.2, 0.5)


def test_evolve_passes_its_options_on_and_a_resume_with_overrides_is_checked_against_them(tmp_path, monkeypatch):
    """`--resume --set ...` makes a config from the options (compared with the run's), not the run's own."""
    got = []

    def reached(cfg, out, **kw):
        got.append((cfg, kw))
        raise RunError("evolve reached")

    monkeypatch.setattr(selfevo.evolve, "evolve", reached)
    out = tmp_path / "run"
    text = _usage_error(["evolve", "--world", "small", "--out", str(out), "--no-audit", "--step-checkpoints", "3",
                         "--seed", "5", *TINY])
    assert "evolve reached" in text
    cfg, kw = got[-1]
    assert kw == {"resume": False, "audit": False, "step_checkpoints": 3}
    assert (cfg.seed, cfg.loop.rounds, cfg.world.name) == (5, 2, "small")
    assert "evolve reached" in _usage_error(["evolve", "--out", str(out), "--resume", "--set", "loop.rounds=2"])
    cfg, kw = got[-1]
    assert kw == {"resume": True, "audit": True, "step_checkpoints": None} and cfg.loop.rounds == 2


def test_engine_run_names_an_unknown_engine_and_one_the_config_contradicts(tmp_path, monkeypatch):
    got = []

    def fails(ecfg, out, **kw):
        got.append(kw["resume"])
        raise engine.EngineUnavailable("verl is not installed")

    monkeypatch.setattr(engine, "engine_run", fails)
    config = Path(__file__).parents[1] / "configs" / "trl-tiny.toml"
    base = ["engine-run", "--config", str(config), "--out", str(tmp_path / "run")]
    assert "--engine: trl or verl, got 'vllm'" in _usage_error([*base, "--engine", "vllm"])
    assert "the config says 'trl', --engine says 'verl'" in _usage_error([*base, "--engine", "verl"])
    assert got == []
    text = _usage_error([*base, "--engine", "trl", "--resume"])
    assert "verl is not installed" in text and "--resume goes on" not in text and got == [True]


def test_engine_run_stopped_says_to_resume(tmp_path, monkeypatch):
    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "engine_run", stopped)
    config = Path(__file__).parents[1] / "configs" / "trl-tiny.toml"
    out = tmp_path / "run"
    res = runner.invoke(app, ["engine-run", "--engine", "trl", "--config", str(config), "--out", str(out)])
    assert res.exit_code == 130
    assert f"stopped: {out}: the run goes on from its last finished phase: the same command with --resume" in \
        " ".join(res.output.split())


def test_index_build_names_out_when_it_refuses_the_directory(tmp_path):
    """The refusal of an --out directory comes before the encoder and the FAISS settings, as an `--out:` line."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "manifest.json").write_text('{"mine": true}')
    corpus = _one_doc_corpus(tmp_path)
    text = _usage_error(["index", "build", "--corpus", str(corpus), "--out", str(mine)])
    assert "error: --out: " in text and "no index's" in text
    text = _usage_error(["index", "build", "--corpus", str(corpus), "--retriever", "dense", "--index-type", "ivf",
                         "--faiss-param", "nprobe=0", "--out", str(mine)])
    assert "error: --out: " in text and "--faiss-param" not in text
    assert (mine / "manifest.json").read_text() == '{"mine": true}'


def test_serve_model_hands_its_options_to_the_scripted_model_and_the_server(tmp_path, monkeypatch):
    """serve-model's options reach what they configure: the fault rates and --delay the scripted model,
    --obey-injections the scripted judge, the key, port and --served-model-name the server; the line it
    prints names the served names."""
    from _servers import free_port

    loaded, served = [], []
    real = lm_model.load_chat_model

    def load(spec, scripts=None, **options):
        loaded.append((spec, scripts, options))
        return real(spec, scripts=scripts, **options)

    monkeypatch.setattr(lm_model, "load_chat_model", load)
    monkeypatch.setattr(server, "serve", lambda model, **kw: served.append((model, kw)))
    monkeypatch.setenv("SELFEVO_TEST_SERVE_KEY", "s3cret")
    key = tmp_path / "key.json"
    key.write_text("{}")
    port = free_port()
    res = runner.invoke(app, ["serve-model", "--model", "scripted:judge", "--script-file", str(key),
                              "--obey-injections", "--slow-rate", "0.25", "--delay", "0.5", "--port", str(port),
                              "--api-key-env", "SELFEVO_TEST_SERVE_KEY", "--served-model-name", "a",
                              "--served-model-name", "b"])
    assert res.exit_code == 0, res.output
    [(spec, scripts, options)] = loaded
    assert spec == "scripted:judge"
    assert options == {"fail_rate": 0.0, "garbage_rate": 0.0, "slow_rate": 0.25, "delay": 0.5}
    assert scripts["judge"]().obey is True
    [(_, kw)] = served
    assert kw == {"host": "127.0.0.1", "port": port, "api_key": "s3cret", "served_names": ["a", "b"]}
    assert f"serving scripted:judge as a, b at http://127.0.0.1:{port}/v1" in " ".join(res.output.split())
    loaded.clear()
    res = runner.invoke(app, ["serve-model", "--model", "scripted:judge", "--script-file", str(key),
                              "--port", str(port)])
    assert res.exit_code == 0 and "(any model name)" in res.output
    assert loaded[0][1]["judge"]().obey is False


def test_serve_model_hands_a_real_models_budget_to_it(monkeypatch):
    """--max-new-tokens, --threads and --max-seconds reach the model's load (not the scripted model's faults)."""
    from _servers import free_port

    loaded = []

    class Loaded:
        name = "m"

    monkeypatch.setattr(lm_model, "load_chat_model",
                        lambda spec, scripts=None, **options: loaded.append((spec, options)) or Loaded())
    monkeypatch.setattr(server, "serve", lambda *args, **kwargs: None)
    res = runner.invoke(app, ["serve-model", "--model", "smollm2", "--max-new-tokens", "77", "--threads", "1",
                              "--max-seconds", "2.5", "--port", str(free_port())])
    assert res.exit_code == 0, res.output
    assert loaded == [("smollm2", {"max_new_tokens": 77, "threads": 1, "max_seconds": 2.5})]


def test_serve_model_refuses_a_delay_without_a_script_and_a_key_variable_set_empty(tmp_path, monkeypatch):
    """--delay alone is fault injection too (a real model would ignore it); a key variable set to ""
    is no key: the server would run open, or with an empty key."""
    from _servers import free_port

    served = []
    monkeypatch.setattr(server, "serve", lambda *args, **kwargs: served.append(kwargs))
    out = _usage_error(["serve-model", "--model", str(tmp_path), "--delay", "1"])
    assert "fault injection (--fail-rate, --garbage-rate, --slow-rate, --delay) needs a scripted model" in out
    monkeypatch.setenv("SELFEVO_TEST_EMPTY_KEY", "")
    out = _usage_error(["serve-model", "--model", "scripted:echo", "--api-key-env", "SELFEVO_TEST_EMPTY_KEY",
                        "--port", str(free_port())])
    assert "--api-key-env: $SELFEVO_TEST_EMPTY_KEY is not set" in out and served == []


def test_replay_run_refuses_zero_seeds_before_reading_the_bank(tmp_path):
    """--seeds 0 is a study of nothing: named as the option, before the bank (here missing) is read."""
    out = _usage_error(["replay", "run", "--bank", str(tmp_path / "no-bank.json"), "--seeds", "0",
                        "--out", str(tmp_path / "study")])
    assert out == "error: --seeds: must be >= 1, got 0" and not (tmp_path / "study").exists()


def test_replay_run_names_an_unknown_condition_before_reading_the_bank(tmp_path):
    """--conditions is checked before the bank is loaded (a language-model bank loads a model): a typo is
    named as the option, not as the missing bank that follows it."""
    out = _usage_error(["replay", "run", "--bank", str(tmp_path / "no-bank.json"), "--conditions", "coupled,nope",
                        "--out", str(tmp_path / "study")])
    assert out.startswith("error: --conditions: unknown 'nope'") and "no-bank.json" not in out


def test_an_audit_that_resolved_items_in_some_round_gives_no_warning(capsys):
    """The warning is for a table of nothing but dashes: a judge that resolved a later round's items
    measured something."""
    row = {"round": 1, **dict.fromkeys(METRICS), "coverage": 0.0}
    _print_audit_rounds({"judge": "llm:m", "rounds": [row, {**row, "round": 2, "coverage": 0.5}]})
    assert "resolved no item" not in capsys.readouterr().err


def _one_record(tmp_path) -> Path:
    records = tmp_path / "r.jsonl"
    records.write_text('{"round": 1, "step": 0, "source_id": "d", "source": "A b c. It is in Kelda.", '
                       '"question": "Where?", "label": "Kelda", "responses": ["Kelda"], "gold_answers": ["Kelda"]}\n')
    return records


def test_audit_refuses_what_it_cannot_audit_naming_why(tmp_path):
    """A run directory and --records together; --records with the oracle (the default judge), which needs a
    world run; --compare oracle of records, which have no world; --injection-test 1 with a judge
    that reads no document; an LLM judge with no model name: each one error line, nothing written."""
    records = _one_record(tmp_path)
    run = tmp_path / "no-run"
    out = _usage_error(["audit", str(run), "--records", str(records), "--judge", "gold", "--out", str(tmp_path / "o")])
    assert out == "error: give a run directory or --records FILE (one of them)"
    out = _usage_error(["audit", "--records", str(records), "--out", str(tmp_path / "o")])
    assert out == "error: --judge oracle needs a world run; for --records use --judge gold or llm"
    out = _usage_error(["audit", "--records", str(records), "--judge", "gold", "--compare", "oracle",
                        "--out", str(tmp_path / "o")])
    assert out == "error: --compare: records can be compared with their gold answers only (--compare gold)"
    out = _usage_error(["audit", "--records", str(records), "--judge", "gold", "--injection-test", "1",
                        "--out", str(tmp_path / "o")])
    assert out.startswith("error: --injection-test: only an LLM judge reads the documents")
    out = _usage_error(["audit", "--records", str(records), "--judge", "llm", "--judge-url", "http://127.0.0.1:9/v1",
                        "--out", str(tmp_path / "o")])
    assert out == "error: --judge llm needs --judge-url and --judge-model"
    out = _usage_error(["audit", "--records", str(records), "--judge", "gold"])
    assert out == "error: --out is required with --records"
    (tmp_path / "notes.jsonl").write_text("my notes\n")  # --judge-cache naming a file the judge did not write
    out = _usage_error(["audit", "--records", str(records), "--judge", "llm", "--judge-url", "http://127.0.0.1:9/v1",
                        "--judge-model", "m", "--judge-cache", str(tmp_path / "notes.jsonl"),
                        "--out", str(tmp_path / "o")])
    assert out.startswith(f"error: {tmp_path / 'notes.jsonl'}:1: corrupt log line: not a judge cache")
    assert (tmp_path / "notes.jsonl").read_text() == "my notes\n"
    assert not (tmp_path / "o").exists()


def test_audit_refuses_to_write_into_another_run_or_compare_a_judge_with_itself(tmp_path):
    """`audit RUN_A --out RUN_B/audit` replaced B's audit with A's, and `compare` and `report` showed A's numbers
    under B; `--records ... --out RUN` wrote metrics.json and figures/ among a run's own files; `--judge gold
    --compare gold` printed a comparison of zeros."""
    records = _one_record(tmp_path)
    run = tmp_path / "run-b"
    (run / "audit").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"status": "complete", "rounds_completed": 3}))
    for out in (run / "audit", run / "audit" / "llm"):
        got = _usage_error(["audit", "--records", str(records), "--judge", "gold", "--out", str(out)])
        assert got.startswith(f"error: --out: {out} is inside the run directory {run}, whose audit")
    got = _usage_error(["audit", "--records", str(records), "--judge", "gold", "--out", str(run)])
    assert got.startswith(f"error: --out: {run} is a run directory")
    assert sorted(p.name for p in run.rglob("*")) == ["audit", "manifest.json"]  # nothing written
    import typer

    from selfevo.cli import _out_not_in_another_run

    _out_not_in_another_run(run / "audit" / "llm", run)  # the run audited: its own audit/ is where it goes
    other = tmp_path / "run-a"
    other.mkdir()
    (other / "manifest.json").write_text(json.dumps({"status": "complete", "rounds_completed": 3}))
    with pytest.raises(typer.Exit):
        _out_not_in_another_run(run / "audit", other)
    got = _usage_error(["audit", "--records", str(records), "--judge", "gold", "--compare", "gold",
                        "--out", str(tmp_path / "o")])
    assert got.startswith("error: --compare gold: the judge is gold itself")
    assert not (tmp_path / "o").exists()


def test_audit_takes_a_seed_for_its_injection_test_alone(tmp_path):
    """--injection-test reads --seed (its item set): the pair passes the check of settings nothing reads
    (here to the missing run); --seed alone is refused naming both readers."""
    base = ["audit", str(tmp_path / "no-run"), "--judge", "llm", "--judge-model", "m", "--out", str(tmp_path / "o")]
    out = _usage_error([*base, "--injection-test", "5", "--seed", "9"])
    assert out == f"error: {tmp_path / 'no-run'}: not a run directory (no run manifest.json)"
    out = _usage_error([*base, "--seed", "9"])
    assert out == "error: --seed: read only with --compare (its bootstrap intervals) or --injection-test (its item set)"


def test_audit_hands_its_settings_to_the_judge_and_the_pipeline_and_prints_what_they_return(tmp_path, monkeypatch):
    """Every LLM-judge option reaches the judge (checked before any item), --bootstrap, --seed, --no-figures,
    --injection-test and --max-items-per-step reach the audit; its judge-call summary, comparison and
    injection test print as returned, each number in its place."""
    made, checked, audited = [], [], []

    class Judge:
        def __init__(self, url, model, **kw):
            made.append((url, model, kw))

        def check(self):
            checked.append(True)

        def close(self):
            pass

    metrics = {"judge": "llm:m", "rounds": [{"round": 1, **dict.fromkeys(METRICS, 0.5)}]}
    res = {"metrics": metrics,
           "summary": {"replies": 10, "requests": 12, "retries": 3, "cache_hits": 4, "failed_calls": 1,
                       "malformed_replies": 2, "cut_replies": 6, "malformed_bodies": 5, "resolved": 7,
                       "unresolved": 2, "unresolved_by_reason": {"no quote": 2}},
           "comparison": {"judge": "llm:m", "truth": "gold",
                          "rounds": [{"round": 1, "diff": {"A": {"diff": 0.1, "lo": -0.05, "hi": 0.2}}}],
                          "all": {"diff": {"A": {"diff": 0.05, "lo": -0.01, "hi": 0.3}}}},
           "injection": {"overall": {"flipped": 1, "n": 8, "flip_rate": 0.125, "to_correct": 1}, "clean_resolved": 6}}

    def audit(steps, judge, out_dir, **kw):
        audited.append((steps, judge, out_dir, kw))
        return res

    monkeypatch.setattr(llm_judge, "LLMJudge", Judge)
    monkeypatch.setattr(pipeline, "audit_to_dir", audit)
    row = {"round": 1, "step": 0, "source_id": "d", "source": "A b c. It is in Kelda.", "question": "Where?",
           "label": "Kelda", "responses": ["Kelda"], "gold_answers": ["Kelda"]}
    records = tmp_path / "r.jsonl"
    records.write_text(json.dumps(row) + "\n" + json.dumps({**row, "question": "Which?"}) + "\n")
    out = tmp_path / "o"
    args = ["audit", "--records", str(records), "--judge", "llm", "--judge-url", "http://127.0.0.1:9/v1",
            "--judge-model", "m", "--out", str(out), "--judge-concurrency", "7", "--judge-timeout", "2.5",
            "--judge-retries", "3", "--judge-max-tokens", "100", "--judge-malformed-retries", "1", "--no-progress",
            "--compare", "gold", "--bootstrap", "300", "--seed", "5", "--no-figures", "--injection-test", "4",
            "--max-items-per-step", "1"]
    result = runner.invoke(app, [*args, "--judge-cache", str(tmp_path / "c.jsonl")])
    assert result.exit_code == 0, result.output
    [(url, model, kw)] = made
    # the endpoint's probe is audit_to_dir's (stubbed here; tests/test_audit.py), for the command and the library
    assert (url, model) == ("http://127.0.0.1:9/v1", "m") and checked == []
    assert kw == {"documents": None, "cache_path": tmp_path / "c.jsonl", "concurrency": 7, "timeout": 2.5,
                  "max_retries": 3, "max_tokens": 100, "malformed_retries": 1, "progress": False}
    [(steps, judge, out_dir, kw)] = audited
    assert [len(st["items"]) for st in steps] == [1] and isinstance(judge, Judge) and out_dir == out
    assert isinstance(kw.pop("truth"), GoldJudge)
    assert kw == {"n_boot": 300, "seed": 5, "figures": False, "documents": None, "injection_items": 4,
                  "info": {"source": str(records), "max_items_per_step": 1}}
    said = " ".join(result.output.split())
    assert ("judge calls: 10 replies to 12 requests (3 retries), 4 cache hits, 1 failed calls, 2 malformed replies, "
            "6 replies cut at the token cap, 5 bodies that were no chat completion (retried); items resolved 7, "
            "unresolved 2 {'no quote': 2}") in said
    assert "injection test: 1 of 8 verdicts flipped (0.125), 1 towards correct" in said
    assert "means nothing here" not in said
    assert "llm:m − gold by round (95% bootstrap interval)" in said
    cells = {tuple(c.strip() for c in line.split("│")[1:3]) for line in result.output.splitlines()}
    assert ("1", "+0.100 [-0.050, +0.200]") in cells and ("all", "+0.050 [-0.010, +0.300]") in cells
    assert f"audit written to {out}" in said and "report` and `compare` read" not in said
    made.clear()
    assert runner.invoke(app, args).exit_code == 0
    assert made[0][2]["cache_path"] == out / "cache.jsonl"


def test_demo_hands_its_workers_on_and_exits_1_for_a_partial_demo(tmp_path, monkeypatch):
    """--workers reaches the demo's jobs; a demo whose report covers only part of its jobs exits 1, a whole
    one 0 (a script tells them apart)."""
    seen, incomplete = [], []
    monkeypatch.setattr(selfevo.demo, "run_demo", lambda plan, out, console, workers: seen.append(workers)
                        or {"incomplete": list(incomplete)})
    args = ["demo", "--world", "small", "--seeds", "1", "--workers", "3", "--out", str(tmp_path / "d")]
    assert runner.invoke(app, args).exit_code == 0
    incomplete.append("coupled-s0")
    assert runner.invoke(app, args).exit_code == 1
    assert seen == [3, 3]


def test_demo_names_an_out_that_is_a_file_before_any_job(tmp_path):
    (tmp_path / "afile").write_text("mine\n")
    out = _usage_error(["demo", "--world", "small", "--seeds", "1", "--out", str(tmp_path / "afile")])
    assert f"{tmp_path / 'afile'}: exists and is not a directory (--out names a directory)" in out
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_a_world_directory_rewritten_in_the_same_process_is_read_again(tmp_path, monkeypatch):
    """The process keeps the worlds it generated or read (a grid worker, the demo): a world directory
    rewritten in the meantime is keyed by its bytes too, so it is read again, never served stale."""
    from selfevo.config import load_config
    from selfevo.evolve import world_and_index

    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, [f'world.name="{tmp_path / "w"}"'])
    assert runner.invoke(app, ["world", "make", "--size", "small", "--seed", "3", "--out", "w"]).exit_code == 0
    first, _ = world_and_index(cfg)
    assert world_and_index(cfg)[0] is first
    (tmp_path / "w").rename(tmp_path / "w-old")
    assert runner.invoke(app, ["world", "make", "--size", "small", "--seed", "4", "--out", "w"]).exit_code == 0
    again, _ = world_and_index(cfg)
    assert again is not first and [d.text for d in again.documents] != [d.text for d in first.documents]


def test_a_source_pool_as_large_as_the_corpus_is_the_corpus_in_its_order():
    """loop.source_docs equal to the number of documents takes them all, as 0 does, in the corpus's order
    (not a seeded sample sorted by id: another order of the proposer's draws)."""
    from selfevo.config import load_config
    from selfevo.evolve import source_pool
    from selfevo.records import Document

    docs = [Document(f"d{i}", f"T{i}", "x") for i in (3, 1, 2)]
    for n in (0, 3, 5):
        assert source_pool(load_config(None, [f"loop.source_docs={n}"]), docs) == docs
    sample = source_pool(load_config(None, ["loop.source_docs=2"]), docs)
    assert len(sample) == 2 and sample == sorted(sample, key=lambda d: d.id)  # fewer: a sample, in id order


def test_version_prints_the_version_and_the_source_digest_runs_record():
    from selfevo import __version__
    from selfevo._software import software

    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output == f"selfevo {__version__} (source {software()['selfevo_source']})\n"
