"""Architecture boundaries (DESIGN.md §2), enforced by scanning the source's imports.

- Agents never see truth: agents/ and loop/ import nothing of the world but its language.
- The audit never feeds back: nothing in loop/ (or agents/) imports the audit.
- One answer matcher: reward, admission and audit use `selfevo.evaluate.answers_match`.
"""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "selfevo"

# modules agents/ and loop/ must not import (a module or anything inside it)
FORBIDDEN = ("selfevo.audit", "selfevo.world.truth", "selfevo.world.generate", "selfevo.evolve",
             "selfevo.cli")
ALLOWED_WORLD = ("selfevo.world.language",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    """`from ..x import y` inside `module` -> absolute name of `..x`."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(package):
        raise ImportError(f"relative import beyond top-level package in {module}")
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """Every module name a source file may bind by import: for `from A import b` both `A` and
    `A.b` (b may be a submodule). String literals naming selfevo modules (importlib) count too."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = (_resolve_relative(module, is_package, node.level, node.module) if node.level
                    else node.module)
            out.append((node.lineno, base))
            out.extend((node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"selfevo(\.\w+)+", node.value):
                out.append((node.lineno, node.value))
    return out


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    bad = []
    for lineno, name in imported_modules(source, module, is_package):
        if any(_is_within(name, f) for f in FORBIDDEN):
            bad.append(f"{module}:{lineno}: imports {name}")
        elif _is_within(name, "selfevo.world") and not any(_is_within(name, a) for a in ALLOWED_WORLD):
            # `from selfevo.world import language` binds selfevo.world and selfevo.world.language:
            # the bare package is fine only when everything taken from it is the language
            if name == "selfevo.world" and _only_language_from_world(source, module, is_package, lineno):
                continue
            bad.append(f"{module}:{lineno}: imports {name}")
    return bad


def _only_language_from_world(source: str, module: str, is_package: bool, lineno: int) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.lineno == lineno:
            base = (_resolve_relative(module, is_package, node.level, node.module) if node.level
                    else node.module)
            if base == "selfevo.world":
                return all(a.name == "language" for a in node.names)
    return False


def scanned_files() -> list[Path]:
    files = sorted((PKG / "agents").rglob("*.py")) + sorted((PKG / "loop").rglob("*.py"))
    # what TRL and verl train with: rewards, admission, routing, datasets, rollouts (engine.py, which
    # audits after the phases, and verl_launch.py, which writes their configs, stay outside)
    files += [PKG / "integrations" / f"{m}.py" for m in ("rewards", "admit", "routing", "datasets", "trl_env",
                                                         "trl_job", "verl_search")]
    assert len(files) >= 10, files  # the scan must actually see the rooms
    return files


# ------------------------------------------------------------------ the scanner itself


@pytest.mark.parametrize("snippet, module", [
    ("from selfevo.world import truth", "selfevo.agents.sim.solver"),
    ("import selfevo.world.truth as t", "selfevo.agents.sim.solver"),
    ("import selfevo.world.truth", "selfevo.loop.engine"),
    ("from selfevo.world.truth import Truth", "selfevo.loop.engine"),
    ("from selfevo.world import Truth", "selfevo.loop.engine"),
    ("from selfevo.world import language, truth", "selfevo.loop.engine"),
    ("from selfevo.world.generate import make_world", "selfevo.agents.base"),
    ("import selfevo.world", "selfevo.agents.base"),
    ("from selfevo import world", "selfevo.agents.base"),
    ("from selfevo import audit", "selfevo.loop.engine"),
    ("from selfevo.audit.metrics import audit_metrics", "selfevo.loop.engine"),
    ("import selfevo.audit.judges as j", "selfevo.loop.feedback"),
    ("from selfevo.evolve import evolve", "selfevo.loop.engine"),
    ("from ..world import truth", "selfevo.loop.engine"),
    ("from ..audit import OracleJudge", "selfevo.loop.engine"),
    ("from .. import audit", "selfevo.loop.engine"),
    ("from ...world.truth import Truth", "selfevo.agents.sim.solver"),
    ("from ...world import generate", "selfevo.agents.sim.solver"),
    ("def f():\n    from selfevo.world import truth\n    return truth", "selfevo.loop.engine"),
    ("import importlib\nT = importlib.import_module('selfevo.world.truth')", "selfevo.loop.engine"),
])
def test_scanner_catches_forbidden_imports(snippet, module):
    assert violations(snippet, module), snippet


def test_scanner_resolves_relative_imports_in_packages():
    # in selfevo/loop/__init__.py, `from ..audit import x` is selfevo.audit
    assert violations("from ..audit import x", "selfevo.loop", is_package=True)
    # in selfevo/agents/sim/__init__.py, `from .. import base` is selfevo.agents.base: allowed
    assert not violations("from .. import base", "selfevo.agents.sim", is_package=True)


@pytest.mark.parametrize("snippet, module", [
    ("from selfevo.world.language import parse_question", "selfevo.agents.sim.solver"),
    ("import selfevo.world.language as lang", "selfevo.agents.sim.solver"),
    ("from selfevo.world import language", "selfevo.loop.engine"),
    ("from ...world.language import RELATIONS", "selfevo.agents.sim.proposer"),
    ("from ..world.language import RELATIONS", "selfevo.loop.engine"),
    ("from ..world import language", "selfevo.loop.engine"),
    ("from selfevo.evaluate import answers_match", "selfevo.loop.engine"),
    ("from selfevo.auditing_tools import x", "selfevo.loop.engine"),  # a prefix, not the module
    ("from .feedback import lineage_of", "selfevo.loop.engine"),
    ("x = 'the selfevo.world.truth module is off limits'", "selfevo.loop.engine"),  # prose, not a name
])
def test_scanner_allows_permitted_imports(snippet, module):
    assert violations(snippet, module) == []


# ------------------------------------------------------------------ the real source


def test_agents_and_loop_never_import_truth_audit_or_evolve():
    bad = []
    for path in scanned_files():
        bad += violations(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py")
    assert bad == []


@pytest.mark.parametrize("agents", ["selfevo.agents.sim", "selfevo.agents.lm.agents"])
def test_loading_the_agents_loads_no_truth(agents):
    """The scan above sees direct imports; this runs the import chain itself. A helper the lm
    policy once imported from selfevo.config pulled in the world generator and its truth."""
    code = f"import sys, {agents}; print(sorted(m for m in sys.modules if m.startswith(('selfevo.world.truth', "
    code += "'selfevo.world.generate', 'selfevo.audit', 'selfevo.evolve'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_scan_would_see_a_real_violation(tmp_path):
    """Guard against a scanner that silently reads nothing: a real file with a planted import."""
    engine = PKG / "loop" / "engine.py"
    planted = engine.read_text(encoding="utf-8") + "\nfrom selfevo.audit import audit_run\n"
    assert violations(planted, "selfevo.loop.engine")


def _imports_answers_match(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = any(isinstance(n, ast.ImportFrom) and n.module == "selfevo.evaluate"
                   and any(a.name == "answers_match" and a.asname is None for a in n.names)
                   for n in ast.walk(tree))
    called = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "answers_match"
                 for n in ast.walk(tree))
    return imported and called


@pytest.mark.parametrize("rel", ["loop/engine.py", "loop/admission.py", "audit/__init__.py", "audit/judges.py",
                                 "agents/sim/solver.py", "integrations/rewards.py"])
def test_reward_admission_and_audit_use_the_one_matcher(rel):
    assert _imports_answers_match(PKG / rel)


def test_no_module_defines_its_own_matcher():
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        if path.name == "evaluate.py" and path.parent == PKG:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                name = getattr(node, "name", "")
                if re.search(r"match|normali[sz]e|same_answer|agree", name, re.I):
                    offenders.append(f"{path.relative_to(SRC)}:{node.lineno}: def {name}")
    assert offenders == []


def test_answers_match_is_defined_once_in_evaluate():
    defs = [p for p in PKG.rglob("*.py")
            if re.search(r"^\s*def answers_match\b", p.read_text(encoding="utf-8"), re.M)]
    assert defs == [PKG / "evaluate.py"]


# ------------------------------------------------------------------ the same rule, run


class _Untouchable:
    """Exact truth that raises when anything reads it."""

    def __getattr__(self, name):
        raise AssertionError(f"the loop read truth (.{name})")


class _Sink:
    def __init__(self):
        self.rows, self.checkpoints = [], {}

    def append_steps(self, rows):
        self.rows.extend(json.loads(json.dumps(rows)))

    def checkpoint(self, round, state):
        state = json.loads(json.dumps(state))
        del state["compute"]["seconds"]  # wall time, which an evaluation adds to
        # and its generations (an evaluation's own count; the totals with them)
        state["compute"]["generations"].pop("evaluation", None)
        del state["compute"]["total_generations"]
        self.checkpoints[round] = state


@pytest.mark.parametrize("treatment", ["coupled", "msv", "crossfit", "msv+crossfit", "same-source", "full-data",
                                       "question-split", "half-budget", "crossfit-k3", "crossfit-connected"])
def test_the_loop_runs_without_truth_and_its_evaluation_never_feeds_back(treatment):
    """The import scan above, run: the loop works with a world whose truth raises on any read, and
    its step records and checkpoints are the same whether the main solver is evaluated after every
    round against the benchmarks' gold answers, against wrong ones, or not at all."""
    from dataclasses import replace

    from selfevo.config import load_config
    from selfevo.evaluate import evaluate_solver
    from selfevo.evolve import build_loop, environment, fold_assignment
    from selfevo.records import QAItem
    from selfevo.search.tool import SearchTool

    cfg = load_config(overrides=[f"treatment={treatment}", "world.name=small", "seed=3", "loop.rounds=2",
                                 "loop.proposer_steps=2", "loop.solver_steps=2", "loop.admit_per_round=40"])
    env = environment(cfg)
    env = replace(env, world=replace(env.world, truth=_Untouchable()))
    tool = SearchTool(env.index, topk=cfg.search.topk, max_calls=cfg.search.max_calls)
    wrong = {b: [QAItem(q.id, q.question, ("no such answer",), q.metadata) for q in items[:30]]
             for b, items in env.benchmarks.items()}
    gold = {b: items[:30] for b, items in env.benchmarks.items()}
    outcomes, scores = [], []
    for benchmarks in (None, gold, wrong):
        def evaluate(solver, round, benchmarks=benchmarks):
            result = evaluate_solver(solver, benchmarks, tool, progress=False, per_invocation=False)
            scores.append(result["macro"]["cover_em"])
            return result

        loop = build_loop(cfg, env, tool, fold_assignment(cfg, env.documents),
                          evaluate=None if benchmarks is None else evaluate)
        sink = _Sink()
        loop.run(sink, progress=False)
        outcomes.append((sink.rows, sink.checkpoints))
    assert scores and max(scores) > 0 and not any(scores[len(scores) // 2:])  # gold scored, wrong 0
    assert outcomes[0] == outcomes[1] == outcomes[2]
