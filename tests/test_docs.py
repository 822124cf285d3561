"""The documentation as a contract with the code: every `selfevo ...` command that README.md, docs/ and
the comments of configs/ show names a command that exists and only options it takes; every config key
they name (`lm.generator`, `engine.save_steps`, `--set loop.rounds=1`) is a field of the schema; every
`python benchmarks/X.py --flag` names a flag of that script. A renamed option or field fails here
instead of in a user's shell. Parsing only: nothing runs."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest
import typer.main

from selfevo.cli import app
from selfevo.config import ConfigError, RunConfig, load_config

REPO = Path(__file__).resolve().parents[1]
# docs/reliability.md is left out: it quotes the wrong input each past defect was found with
DOCS = sorted([REPO / "README.md", *(p for p in (REPO / "docs").glob("*.md") if p.name != "reliability.md"),
               *(REPO / "configs").glob("*.toml"), *(REPO / "configs").glob("*.yaml")])
ROOT = typer.main.get_command(app)

# `selfevo` then a command, up to the end of the code span, line, comment or table cell
COMMAND = re.compile(r"(?<![\w./-])selfevo ([a-z][\w-]*(?: [^`\n#|]*)?)")
OPTION = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


def _text(path: Path) -> str:
    # a shell line continued with a backslash (also inside a config's `#` comment) is one command
    return re.sub(r"\\\n[ \t#]*", " ", path.read_text(encoding="utf-8"))


def command_problems(text: str, where: str) -> list[str]:
    """What is wrong with each `selfevo ...` command in `text`: an unknown command or option."""
    problems = []
    for m in COMMAND.finditer(text):
        words = m.group(1).split()
        if not OPTION.search(m.group(1)) and ROOT.get_command(None, words[0]) is None:
            continue  # prose ("selfevo implements the loop"): a command line here has an option
        cmd, path = ROOT, []
        for word in words:
            if not hasattr(cmd, "commands"):
                break
            sub = cmd.get_command(None, word)
            if sub is None:
                problems.append(f"{where}: `selfevo {' '.join([*path, word])}`: no such command")
                cmd = None
                break
            cmd, path = sub, [*path, word]
        if cmd is None or hasattr(cmd, "commands"):  # a group named alone ("selfevo index") is prose
            continue
        known = {"--help"} | {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        for option in OPTION.findall(m.group(1)):
            if option not in known:
                problems.append(f"{where}: `selfevo {' '.join(path)}` has no option {option}")
    return problems


def _schema() -> dict[str, set[str]]:
    from selfevo.demo import DemoPlan
    from selfevo.integrations.engine import EngineSpec

    tables = {k: set(v) for k, v in RunConfig().to_json().items() if isinstance(v, dict)}
    tables[""] = {k for k, v in RunConfig().to_json().items() if not isinstance(v, dict)}
    tables["engine"] = set(EngineSpec.model_fields)
    tables["demo"] = {f.name for f in dataclasses.fields(DemoPlan)}
    return tables


# dotted names in the docs that look like config keys and are not selfevo's: verl's own config keys
NOT_SELFEVO_KEYS = {"data.max_prompt_length", "data.max_response_length"}
# not a glob (`lm.lora_*`); a `--set KEY=VALUE` is checked as an override
KEY = re.compile(r"(?<![\w./-])(world|data|loop|search|solver|proposer|lm|engine|demo)\.([a-z_]+)(?![\w.*=])")
FILE_TYPES = {"json", "jsonl", "md", "toml", "yaml", "py", "png", "html"}  # `demo.json`, `engine.json`: files


def _is_code(table: str, name: str) -> bool:
    """`loop.feedback`, `search.dense.Encoder`, `loop.proposals_per_step`: a module or a method, not a key."""
    try:
        importlib.import_module(f"selfevo.{table}.{name}")
        return True
    except ImportError:
        pass
    from selfevo.loop.schedule import LoopConfig

    return table == "loop" and hasattr(LoopConfig, name)


def key_problems(text: str, where: str) -> list[str]:
    """Config keys the text names that the schema does not have, and `--set` / `--lm-set` overrides
    whose field does not exist."""
    tables, problems = _schema(), []
    for m in KEY.finditer(text):
        table, name = m.groups()
        if m.group(0) in NOT_SELFEVO_KEYS or name in FILE_TYPES or name in tables[table] or _is_code(table, name):
            continue
        problems.append(f"{where}: `{m.group(0)}` is no config field (known in [{table}]: "
                        f"{', '.join(sorted(tables[table]))})")
    for flag, key in re.findall(r"(--set|--lm-set)[ =]([\w.]+)=", text):
        path = ["lm", key] if flag == "--lm-set" else key.split(".")
        table, name = (path[0], path[1]) if len(path) > 1 else ("", path[0])
        if table not in tables or name not in tables[table]:
            problems.append(f"{where}: `{flag} {key}=...` names no config field")
    return problems


BENCH = re.compile(r"python3? benchmarks/(\w+)\.py((?: +--?[\w-]+(?: +[^\s`|-][^\s`|]*)*)*)")


def benchmark_problems(text: str, where: str) -> list[str]:
    """`python benchmarks/X.py --flag`: the script exists and it (or a benchmarks/ module it imports
    its arguments from) defines the flag."""
    problems = []
    for m in BENCH.finditer(text):
        script = REPO / "benchmarks" / f"{m.group(1)}.py"
        if not script.exists():
            problems.append(f"{where}: benchmarks/{script.name}: no such script")
            continue
        source = script.read_text(encoding="utf-8")
        for local in re.findall(r"^from (\w+) import", source, flags=re.M):  # shared argument parsers
            if (REPO / "benchmarks" / f"{local}.py").exists():
                source += (REPO / "benchmarks" / f"{local}.py").read_text(encoding="utf-8")
        for flag in OPTION.findall(m.group(2)):
            if f'"{flag}"' not in source and f"'{flag}'" not in source:
                problems.append(f"{where}: benchmarks/{script.name} has no flag {flag}")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(REPO)) for p in DOCS])
def test_every_documented_command_option_and_config_key_exists(path):
    where = str(path.relative_to(REPO))
    text = _text(path)
    problems = command_problems(text, where) + key_problems(text, where) + benchmark_problems(text, where)
    assert not problems, "\n".join(problems)


def test_the_checks_find_a_misspelt_command_option_key_or_flag():
    """The checks above can fail: each kind of drift, planted, is found."""
    text = ("selfevo evolve --world small --treatment crossfit --rounds 1 --out runs/x\n"
            "selfevo replay run --bank bank.json --seeds 5 --out r/\n")
    assert command_problems(text, "ok") == []
    assert command_problems("`selfevo evolve --world small --round 1 --out x`", "t") == [
        "t: `selfevo evolve` has no option --round"]
    assert command_problems("selfevo replay play --bank b.json", "t") == ["t: `selfevo replay play`: no such command"]
    assert command_problems("selfevo evolv --out x", "t") == ["t: `selfevo evolv`: no such command"]
    assert command_problems("selfevo eval --data-dir qa \\\n  --limt 20", "t") == []  # raw: not joined
    assert command_problems(re.sub(r"\\\n[ \t#]*", " ", "selfevo eval --data-dir qa \\\n  --limt 20"), "t") == [
        "t: `selfevo eval` has no option --limt"]
    assert key_problems("`lm.generator = \"vllm\"`, `engine.save_steps`, `loop.feedback`, `search.dense.Encoder`",
                        "t") == []
    assert len(key_problems("`lm.generater = \"vllm\"`", "t")) == 1
    assert len(key_problems("`engine.save_step`", "t")) == 1
    assert key_problems("--set solver.memory=false --lm-set max_new_tokens=128", "t") == []
    assert key_problems("--set solver.memroy=false", "t") == ["t: `--set solver.memroy=...` names no config field"]
    assert key_problems("--lm-set max_tokens=128", "t") == ["t: `--lm-set max_tokens=...` names no config field"]
    assert benchmark_problems("python benchmarks/dense_scale.py --sizes 100 --baseline-src OLD/src", "t") == []
    assert benchmark_problems("python benchmarks/retrieval.py --corpus c.jsonl --topk 3", "t") == [
        "t: benchmarks/retrieval.py has no flag --topk"]


def test_every_documented_lm_set_value_is_accepted():
    """`--lm-set KEY=VALUE` in the docs goes through the loader `selfevo eval` uses (typed, checked)."""
    for path in DOCS:
        for value in re.findall(r"--lm-set ([\w.]+=\S+)", _text(path)):
            value = value.rstrip("`")
            try:
                load_config(None, [f"lm.{value}"], backend="lm")
            except ConfigError as e:
                pytest.fail(f"{path.relative_to(REPO)}: --lm-set {value}: {e}")


def test_the_grpo_fields_integrations_md_says_a_job_sets_itself_are_the_ones_it_refuses():
    """docs/integrations.md lists the `[engine.trl]` keys an engine-run refuses because the job sets them
    itself (`trl_job.PINNED_GRPO`); a key added to or dropped from one and not the other fails here."""
    from selfevo.integrations.trl_job import PINNED_GRPO

    doc = (REPO / "docs" / "integrations.md").read_text(encoding="utf-8")
    start = doc.index("So is an `[engine.trl]` key the job sets itself")
    listed = set(re.findall(r"`([a-z_0-9]+)`", doc[start:doc.index("`bf16`/`fp16`", start)]))
    assert listed == set(PINNED_GRPO)
