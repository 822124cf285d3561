"""Pieces of a user's that an installed package names under selfevo's entry points, found by the commands:
learners (`selfevo evolve --learners`) and judges (`selfevo audit --judge`). Agents (`selfevo eval --agent`):
tests/test_evaluate.py. Each package here is installed as pip would: a module and a dist-info directory with
its entry_points.txt, on sys.path."""

from __future__ import annotations

import functools
import html
import json
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from selfevo.cli import app
from selfevo.runs import RunDir

TINY = ["--world", "small", "--set", "loop.rounds=2", "--set", "loop.proposer_steps=2", "--set",
        "loop.solver_steps=2", "--set", "loop.admit_per_round=40", "--set", "data.eval_limit=2", "--seed", "1"]

LEARNERS = '''
from selfevo.agents.sim.proposer import SimProposer
from selfevo.agents.sim.reader import Reader
from selfevo.agents.sim.solver import SimSolver


def make(cfg, sources):
    """selfevo's sim learners, built as a user's package would build its own."""
    solver_reader = Reader("solver", cfg.solver.misread_scale, 0.1, cfg.seed)
    proposer_reader = Reader("proposer", cfg.proposer.misread_scale, 0.1, cfg.seed)
    return SimProposer("proposer", cfg.proposer, proposer_reader, sources), \\
        lambda name: SimSolver(name, cfg.solver, solver_reader)


NUMBER = 3


def proposer_only(cfg, sources):
    return make(cfg, sources)[0]
'''

JUDGES = '''
from selfevo.audit.judges import Verdict


class Says:
    """Calls every label and response right (`yes`) or wrong (`no`): a judge whose errors are known."""

    def __init__(self, arg, documents):
        if arg not in ("yes", "no", "dicts"):
            raise ValueError(f"says: yes, no or dicts, got {arg!r}")
        self.name, self.arg, self.documents = f"says-{arg}", arg, documents

    def judge(self, items):
        if self.arg == "dicts":
            return [{"resolved": True} for _ in items]
        right = self.arg == "yes"
        return [Verdict(True, right, tuple(right for _ in it["responses"])) for it in items]


def make(arg, *, documents):
    return Says(arg, documents)


def make_without_documents(arg):
    return Says(arg, None)


class Hooked(Says):
    """Has the audit's optional hooks, `describe` (judge.json) and `judgements`, answering as `arg` says: right
    (`yes`), or a string (`str`), a dict (`dict`) or nothing (`none`)."""

    def __init__(self, arg, documents):
        super().__init__("yes", documents)
        self.hook = arg

    def describe(self):
        return "a judge of mine" if self.hook == "str" else {"judge": self.name, "by": "me"}

    def judgements(self):
        return {"dict": {"item": 0}, "none": None}.get(self.hook, [{"item": 0}])


class Checking(Says):
    def check(self, item):  # a method of a hook's name, for something else
        return item


class Asking(Says):
    def describe(self, run):  # a hook's name taking an argument: named before any item is judged
        return {}

    def judge(self, items):
        raise AssertionError("judged before its hooks were checked")


TWO = 2
'''


def _install(site, dist, module, source, group, entries):
    """A package as pip installs it: `module`.py and dist-info naming `entries` under `group`."""
    info = site / f"{dist}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))
    (site / f"{module}.py").write_text(source)
    return info


def _cli(*args):
    res = CliRunner().invoke(app, [str(a) for a in args])
    return res.exit_code, res.output


def test_the_command_runs_an_installed_packages_learners_and_resumes_with_them(tmp_path, monkeypatch):
    """`evolve(agents=...)` ran a user's learners from Python only: the command `selfevo evolve` had no way
    to load them, nor a demo plan or a grid. The config's `learners` (`--learners NAME`) names what a package
    gives under `selfevo.learners`; a resume reads it from the run's config, and the manifest records the
    function behind the name."""
    from selfevo.demo import DemoPlan

    site = tmp_path / "site"
    info = _install(site, "mylearners", "mylearners_mod", LEARNERS, "selfevo.learners",
                    {"mine": "mylearners_mod:make", "broken": "mylearners_missing:make",
                     "number": "mylearners_mod:NUMBER", "half": "mylearners_mod:proposer_only"})
    monkeypatch.syspath_prepend(str(site))
    run = tmp_path / "run"
    code, out = _cli("evolve", "--out", run, "--learners", "mine", "--treatment", "crossfit", *TINY)
    assert code == 0, out
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["agents"] == "mylearners_mod.make" and manifest["status"] == "complete"
    assert json.loads((run / "config.json").read_text())["learners"] == "mine"
    assert json.loads((run / "audit" / "metrics.json").read_text())["rounds"][1]["F"] is not None
    assert _cli("evolve", "--out", run, "--resume")[0] == 0  # a finished run: audited again, as itself
    # [solver], [proposer] and [lm] are the learners' to read, whatever the backend
    code, out = _cli("evolve", "--out", tmp_path / "lm-table", "--learners", "mine", "--set", "lm.max_actions=3",
                     *TINY)
    assert code == 0, out

    ours = tmp_path / "ours"
    assert _cli("evolve", "--out", ours, *TINY)[0] == 0
    code, out = _cli("evolve", "--out", ours, "--resume", "--learners", "mine", *TINY)
    assert code != 0 and "fields: learners" in " ".join(out.split())

    code, out = _cli("evolve", "--out", tmp_path / "x", "--learners", "nope", *TINY)
    assert code != 0 and "learners: 'nope': no installed package names it under the selfevo.learners" \
        in " ".join(out.split()) and not (tmp_path / "x").exists()
    code, out = _cli("evolve", "--out", tmp_path / "y", "--learners", "broken", *TINY)
    assert code != 0 and "loading mylearners_missing:make (entry point selfevo.learners) failed: " \
                         "ModuleNotFoundError" in " ".join(out.split())
    code, out = _cli("evolve", "--out", tmp_path / "z", "--learners", "number", *TINY)
    assert code != 0 and "learners: 'number': an object of type int (builtins.int), not a function" \
        in " ".join(out.split())
    code, out = _cli("evolve", "--out", tmp_path / "h", "--learners", "half", *TINY)
    assert code != 0 and "learners mylearners_mod.proposer_only: return (proposer, make_solver)" \
        in " ".join(out.split()) and "Traceback" not in out
    # a run records its learners by module and name, and a resume finds them by it: a partial has neither
    from selfevo.evolve import agents_name
    with pytest.raises(ValueError, match="type partial \\(functools.partial\\), not a function defined at a"):
        agents_name(functools.partial(sys.modules["mylearners_mod"].make))

    @functools.wraps(sys.modules["mylearners_mod"].make)  # a wrapper with another's name: two would share it
    def scaled(cfg, sources):
        return sys.modules["mylearners_mod"].make(cfg, sources)

    with pytest.raises(ValueError, match="not a function defined at a module's top level under its own name"):
        agents_name(scaled)
    # one of the script running: any other script's function of that name would pass for it
    script = {"__name__": "__main__"}
    exec("def my_learners(cfg, sources):\n    return None", script)
    monkeypatch.setattr(sys.modules["__main__"], "my_learners", script["my_learners"], raising=False)
    with pytest.raises(ValueError, match="my_learners, a function of the script or notebook running"):
        agents_name(script["my_learners"])

    other = _install(site, "otherlearners", "otherlearners_mod", LEARNERS, "selfevo.learners",
                     {"mine": "otherlearners_mod:make"})
    code, out = _cli("evolve", "--out", tmp_path / "two", "--learners", "mine", *TINY)
    assert code != 0 and "'mine': named by several installed packages under the selfevo.learners entry points " \
        "(mylearners_mod:make in mylearners, otherlearners_mod:make in otherlearners)" in " ".join(out.split())
    shutil.rmtree(other)
    # two packages giving the name, pointing at one module's function alike: still two, refused
    other = _install(site, "samelearners", "samelearners_mod", LEARNERS, "selfevo.learners",
                     {"mine": "mylearners_mod:make"})
    code, out = _cli("evolve", "--out", tmp_path / "same", "--learners", "mine", *TINY)
    assert code != 0 and "(mylearners_mod:make in mylearners, mylearners_mod:make in samelearners)" \
        in " ".join(out.split())
    shutil.rmtree(other)

    # a demo plan runs them in every job; its replay study (selfevo's learners) is refused with them
    DemoPlan(treatments=("coupled", "crossfit"), seeds=1, replay_conditions=(), run={"learners": "mine"})
    with pytest.raises(ValueError, match="the replay study trains selfevo's own learners"):
        DemoPlan(treatments=("coupled",), seeds=1, run={"learners": "mine"})
    with pytest.raises(ValueError, match="learners: 'broken': loading"):
        DemoPlan(treatments=("coupled",), seeds=1, replay_conditions=(), run={"learners": "broken"})

    (info / "entry_points.txt").write_text("[selfevo.learners]\nmine = mylearners_mod:proposer_only\n")
    code, out = _cli("evolve", "--out", run, "--resume")  # the name now points at other code
    assert code != 0 and "made with the learners 'mylearners_mod.make', resumed with " \
                         "'mylearners_mod.proposer_only'" in " ".join(out.split())
    shutil.rmtree(info)  # the package uninstalled: the run cannot go on with learners nobody names
    code, out = _cli("evolve", "--out", run, "--resume")
    assert code != 0 and "learners: 'mine': no installed package names it" in " ".join(out.split())
    assert _cli("audit", run, "--no-figures", "--no-progress")[0] == 0  # its records are read without it


@pytest.fixture(scope="module")
def world_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("judged") / "run"
    code, out = _cli("evolve", "--out", run, *TINY)
    assert code == 0, out
    return run


def test_the_command_audits_with_an_installed_packages_judge_and_compares_it_with_truth(world_run, tmp_path,
                                                                                         monkeypatch):
    """`selfevo audit` knew the oracle, an LLM judge and gold answers: a user's judge was audited from Python
    only (`audit_run`). `--judge NAME[:ARG]` builds it through the factory its package names under
    `selfevo.judges`, into RUN/audit/NAME, and `--compare oracle` validates it against exact truth."""
    site = tmp_path / "site"
    _install(site, "myjudges", "myjudges_mod", JUDGES, "selfevo.judges",
             {"says": "myjudges_mod:make", "figures": "myjudges_mod:make", "oracle": "myjudges_mod:make",
              "two": "myjudges_mod:TWO", "older": "myjudges_mod:make_without_documents",
              "metrics.json": "myjudges_mod:make", "hooked": "myjudges_mod:Hooked",
              "checking": "myjudges_mod:Checking", "asking": "myjudges_mod:Asking"})
    monkeypatch.syspath_prepend(str(site))
    oracle = json.loads((world_run / "audit" / "metrics.json").read_text())

    code, out = _cli("audit", world_run, "--judge", "says:yes", "--compare", "oracle", "--no-figures",
                     "--no-progress")
    assert code == 0, out
    audit = world_run / "audit" / "says"
    metrics = json.loads((audit / "metrics.json").read_text())
    # every label and response called right: by this judge no agreement is false, and its error is measured
    assert metrics["judge"] == "says-yes"
    assert all(r["T_P"] == 1.0 and r["T_S"] == 1.0 and r["F"] == 0.0 for r in metrics["rounds"])
    assert json.loads((audit / "judge.json").read_text())["judge_spec"] == "says:yes"
    cmp = json.loads((audit / "comparison.json").read_text())
    truth_tp = oracle["rounds"][1]["T_P"]
    assert cmp["rounds"][1]["diff"]["T_P"]["diff"] == pytest.approx(1.0 - truth_tp) and truth_tp < 1.0
    assert json.loads((world_run / "audit" / "metrics.json").read_text()) == oracle  # the run's own audit stands

    code, out = _cli("audit", world_run, "--judge", "says:maybe", "--out", tmp_path / "a")
    assert code != 0 and "--judge: says: yes, no or dicts, got 'maybe'" in out
    code, out = _cli("audit", world_run, "--judge", "says:dicts", "--out", tmp_path / "b")
    assert code != 0 and "says-dicts" in out and not (tmp_path / "b" / "metrics.json").exists()
    code, out = _cli("audit", world_run, "--judge", "nobody", "--out", tmp_path / "c")
    assert code != 0 and "unknown judge 'nobody' (known: oracle, llm, gold, asking[:ARG], checking[:ARG]" in out
    for spec, message in (("two", "judge 'two': builtins.int is no factory make(arg, *, documents) -> Judge"),
                          ("older:yes", "myjudges_mod.make_without_documents is no factory make(arg, *, documents)"),
                          ("figures:yes", "its audit would go to RUN_DIR/audit/figures, which cannot be its own"),
                          ("metrics.json:yes", "would go to " + str(world_run / "audit" / "metrics.json") + ", a file"),
                          ("oracle:yes", "unknown judge 'oracle:yes' (known: oracle, llm, gold, asking[:ARG], "
                                         "checking[:ARG], figures[:ARG], hooked[:ARG], metrics.json[:ARG], "
                                         "older[:ARG], says[:ARG], two[:ARG])"),
                          # the audit's optional hooks (check, describe, summary, judgements): a method of one's
                          # name for another use, or answering in another shape, is named before anything is written
                          ("checking:yes", "judge 'says-yes': check is an audit hook, called with no argument"),
                          ("hooked:str", "judge 'says-yes': describe returns a dict (docs/extending.md), got str"),
                          ("hooked:dict", "judge 'says-yes': judgements returns a list of dicts (docs/extending.md), "
                                          "got dict"),
                          ("hooked:none", "judgements returns a list of dicts (docs/extending.md), got NoneType"),
                          ("asking:yes", "judge 'says-yes': describe is an audit hook, called with no argument")):
        code, out = _cli("audit", world_run, "--judge", spec)
        assert code != 0 and message in " ".join(out.split()) and "Traceback" not in out, out
    assert not (world_run / "audit" / "hooked").exists() and not (world_run / "audit" / "checking").exists()
    code, out = _cli("audit", world_run, "--judge", "hooked:yes", "--no-figures", "--no-progress")
    assert code == 0, out
    hooked = world_run / "audit" / "hooked"
    assert json.loads((hooked / "judge.json").read_text()) == {
        "judge": "says-yes", "by": "me", "source": str(world_run), "max_items_per_step": None,
        "judge_spec": "hooked:yes"}
    assert (hooked / "judgements.jsonl").read_text() == '{"item": 0}\n'
    code, out = _cli("audit", world_run, "--judge", "says:yes", "--injection-test", "5")
    assert code != 0 and "--injection-test: for an LLM judge (--judge llm)" in out
    code, out = _cli("audit", world_run, "--judge", "says:yes", "--judge-url", "http://127.0.0.1:1/v1")
    assert code != 0 and "--judge-url: a setting of the LLM judge" in out

    records = tmp_path / "records.jsonl"  # another system's steps: the judge reads them with no documents
    records.write_text(json.dumps({"round": 1, "step": 0, "source_id": "d", "source": "It is in Kelda.",
                                   "question": "Where?", "label": "Kelda", "responses": ["Kelda", "Oslo"],
                                   "gold_answers": ["Kelda"]}) + "\n")
    code, out = _cli("audit", "--records", records, "--judge", "says:no", "--compare", "gold", "--out",
                     tmp_path / "rec", "--no-figures", "--no-progress")
    assert code == 0, out
    cmp = json.loads((tmp_path / "rec" / "comparison.json").read_text())["all"]["diff"]
    assert cmp["T_P"]["diff"] == -1.0 and cmp["T_S"]["diff"] == -0.5  # gold: the label and one response right
    sys.modules.pop("myjudges_mod", None)


def _treatment_example() -> str:
    """docs/extending.md's example treatment, as its package's module: the page's code is what runs here."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    section = page[page.index("## A treatment of your own"):]
    return section.split("```python\n", 1)[1].split("```", 1)[0] + "\nNOT_A_FUNCTION = 3\n" \
        "def other(cfg, sources, folds, make_solver):\n    return grounded(cfg, sources, folds, make_solver)\n" \
        "def swapped(cfg, sources, folds, make_solver):\n" \
        "    return grounded(cfg, sources, folds, make_solver)[::-1]\n" \
        "class Costly(Grounded):\n    name = 'evaluation'\n" \
        "def costly(cfg, sources, folds, make_solver):\n    return Costly(sources), CoupledFeedback(folds)\n" \
        "class Buggy(Grounded):\n    def decide(self, proposals, tool, seed):\n        return 1 + proposals[0]\n" \
        "def buggy(cfg, sources, folds, make_solver):\n    return Buggy(sources), CoupledFeedback(folds)\n" \
        "def listed(cfg, sources, folds, make_solver):\n    return list(grounded(cfg, sources, folds, make_solver))\n"


def test_a_treatment_of_an_installed_package_runs_resumes_and_is_reported_beside_selfevos(tmp_path, monkeypatch):
    """A user's admission or feedback rule ran only in a `Loop` assembled by hand: no resume, no audit, no
    evaluation, a config.json to fill by hand, no report beside coupled. A name an installed package gives
    under `selfevo.treatments` is now a treatment: `--treatment NAME` runs its rules in `selfevo evolve`
    with everything else of a run, and `report` sets it beside coupled with its gain."""
    site = tmp_path / "site"
    info = _install(site, "mytreatments", "mytreatments_mod", _treatment_example(), "selfevo.treatments",
                    {"grounded": "mytreatments_mod:grounded", "three": "mytreatments_mod:NOT_A_FUNCTION",
                     "swapped": "mytreatments_mod:swapped", "costly": "mytreatments_mod:costly",
                     "coupled": "mytreatments_mod:other", "../up": "mytreatments_mod:other",
                     "buggy": "mytreatments_mod:buggy", "listed": "mytreatments_mod:listed"})
    monkeypatch.syspath_prepend(str(site))
    runs = tmp_path / "runs"
    for treatment in ("coupled", "grounded"):
        code, out = _cli("evolve", "--out", runs / treatment, "--treatment", treatment, *TINY)
        assert code == 0, out
    run = runs / "grounded"
    assert json.loads((run / "config.json").read_text())["treatment"] == "grounded"
    assert json.loads((run / "manifest.json").read_text())["rules"] == "mytreatments_mod.grounded"
    items = [it for st in RunDir(run).steps() if st["kind"] == "proposer" for it in st["items"]]
    stated = [it["admitted"] for it in items if "stated_on_source" in json.dumps(it)]
    assert items and len(stated) == len(items) and 0 < sum(stated) < len(stated)  # the rule decided, both ways
    assert _cli("evolve", "--out", run, "--resume")[0] == 0  # a finished run: audited again, by the same rules

    code, out = _cli("report", runs)
    assert code == 0, out
    results = json.loads((runs / "results.json").read_text())
    assert results["treatments"] == ["coupled", "grounded"]
    assert results["rules"] == {"grounded": "mytreatments_mod.grounded"}
    assert "gain_vs_coupled" in results["downstream"]["grounded"]

    from selfevo.demo import _check_field  # a demo's plan may list treatments of a user's, each its own
    assert _check_field("treatments", ["coupled", "grounded", "swapped"]) == ("coupled", "grounded", "swapped")
    with pytest.raises(ValueError, match="'three' names an object of type int"):
        _check_field("treatments", ["coupled", "three"])
    with pytest.raises(ValueError, match="unknown '../up'"):  # no path component: a grid names a directory after it
        _check_field("treatments", ["coupled", "../up"])
    for name, message in (("listed", "treatment 'listed' (mytreatments_mod.listed): returns (admission, feedback), "
                                     "got list"),
                          ("swapped", "admission rule 'coupled' (CoupledFeedback): has no generations_per_candidate"),
                          ("costly", "its purpose, else its name, 'evaluation': that must be a name other than")):
        code, out = _cli("evolve", "--out", tmp_path / name, "--treatment", name, *TINY)
        assert code != 0 and message in " ".join(out.split()) and "Traceback" not in out, out
    # a bug of its own, not a broken contract, keeps its traceback (which locates it); the run goes on once fixed
    res = CliRunner().invoke(app, ["evolve", "--out", str(tmp_path / "buggy"), "--treatment", "buggy", *TINY])
    assert res.exit_code == 1 and isinstance(res.exception, TypeError) and "unsupported operand" in str(res.exception)
    code, out = _cli("evolve", "--out", runs / "coupled", "--resume", "--treatment", "grounded", *TINY)
    assert code != 0 and "fields: treatment" in " ".join(out.split()), out  # the config differs: said so
    code, out = _cli("evolve", "--out", tmp_path / "x", "--treatment", "three", *TINY)
    assert code != 0 and "not a function defined at a module's top level under its own name (cfg, sources, " \
                         "folds, make_solver)" \
        in " ".join(out.split())
    code, out = _cli("evolve", "--out", tmp_path / "y", "--treatment", "nope", *TINY)
    assert code != 0 and "grounded, listed, swapped, three; a treatment of yours: a name an installed package " \
                         "gives under the selfevo.treatments entry points" in " ".join(out.split())

    from selfevo.config import ConfigError
    from selfevo.integrations.engine import load_engine_config
    trl = Path(__file__).resolve().parents[1] / "configs" / "trl-tiny.toml"
    with pytest.raises(ConfigError, match="engine-run runs selfevo's own"):
        load_engine_config(trl, ["treatment=grounded"])

    (info / "entry_points.txt").write_text("[selfevo.treatments]\ngrounded = mytreatments_mod:other\n")
    code, out = _cli("evolve", "--out", run, "--resume")  # the name now points at other code
    assert code != 0 and "treatment 'grounded' was made by mytreatments_mod.grounded, and is now made by " \
                         "mytreatments_mod.other" in " ".join(out.split())
    assert _cli("evolve", "--out", runs / "grounded-2", "--treatment", "grounded", *TINY, "--seed", "2")[0] == 0
    code, out = _cli("report", runs)  # two functions under one name are not pooled
    assert code != 0 and "treatment 'grounded' made by mytreatments_mod.grounded and by mytreatments_mod.other" \
        in " ".join(out.split())
    shutil.rmtree(runs / "grounded-2")

    shutil.rmtree(info)  # uninstalled: its finished records are still read; only running it needs its rules
    code, out = _cli("evolve", "--out", run, "--resume")
    assert code != 0 and "'grounded' is a treatment of a package that is not installed" in " ".join(out.split())
    import dataclasses

    from selfevo.evolve import evolve
    typo = dataclasses.replace(RunDir(run).run_config(), treatment="groundd")  # no name the run recorded
    with pytest.raises(ConfigError, match="unknown 'groundd'"):
        evolve(typo, run, resume=True, progress=False)
    damaged = tmp_path / "damaged"
    shutil.copytree(run, damaged)
    (damaged / "config.json").write_text((damaged / "config.json").read_text().replace('"grounded"', "5"))
    code, out = _cli("audit", damaged)
    assert code != 0 and "config.json: treatment: expected a string, got 5" in " ".join(out.split()), out
    assert _cli("report", runs)[0] == 0 and _cli("compare", runs / "coupled", run)[0] == 0
    assert _cli("audit", run, "--no-figures", "--no-progress")[0] == 0
    # runs read in this process leave no treatment name behind them (a process-wide set of them did)
    from selfevo.config import load_config
    with pytest.raises(ConfigError, match="unknown 'grounded'"):
        load_config(None, ["treatment=grounded"])


def test_a_demo_plan_runs_a_users_learners_and_treatment_beside_selfevos(tmp_path, monkeypatch):
    """The paper's protocol on a user's pieces: a demo plan naming learners and a treatment of installed
    packages runs every job with them (worker processes, which find the packages as the parent does), and
    the report sets the user's treatment beside coupled."""
    site = tmp_path / "site"
    learners = _install(site, "mylearners", "mylearners_mod", LEARNERS, "selfevo.learners",
                        {"mine": "mylearners_mod:make"})
    _install(site, "mytreatments", "mytreatments_mod", _treatment_example(), "selfevo.treatments",
             {"grounded": "mytreatments_mod:grounded"})
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", str(site))  # the grid's worker processes
    plan = tmp_path / "demo.toml"
    plan.write_text('learners = "mine"\n[demo]\ntreatments = ["coupled", "grounded"]\nseeds = 2\nworld = "small"\n'
                    "replay_conditions = []\n[loop]\nrounds = 2\nadmit_per_round = 40\nproposer_steps = 2\n"
                    "solver_steps = 2\n[data]\neval_limit = 2\n")
    code, out = _cli("demo", "--config", plan, "--out", tmp_path / "demo")
    assert code == 0, out
    results = json.loads((tmp_path / "demo" / "results.json").read_text())
    assert results["treatments"] == ["coupled", "grounded"] and results["seeds"] == [0, 1]
    assert results["rules"] == {"grounded": "mytreatments_mod.grounded"}
    manifests = [json.loads(p.read_text()) for p in (tmp_path / "demo").rglob("manifest.json")]
    assert len(manifests) == 4 and all(m["agents"] == "mylearners_mod.make" for m in manifests)
    assert results["learners"] == "mylearners_mod.make"  # the report says whose learners made its numbers
    for page in ("report.md", "report.html"):
        assert "Made with: learners mylearners_mod.make (a user's: every run); treatment grounded's rules " \
               "mytreatments_mod.grounded (a user's)." in html.unescape((tmp_path / "demo" / page).read_text())

    # the name now points at other code: a rerun does not count the finished runs as the plan's
    (learners / "entry_points.txt").write_text("[selfevo.learners]\nmine = mylearners_mod:proposer_only\n")
    code, out = _cli("demo", "--config", plan, "--out", tmp_path / "demo")
    assert code != 0 and "made with the learners 'mylearners_mod.make', resumed with 'mylearners_mod.proposer_only'" \
        in " ".join(out.split()), out
