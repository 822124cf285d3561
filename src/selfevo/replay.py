"""The fixed replay bank (DESIGN.md §1): freeze questions, adopted labels, matcher and evaluation,
and vary only the training provenance of the feedback solver.

    build_bank(run dirs)          round >= 2 proposals of completed runs with their adopted labels
                                  (wrong ones included: that is what a grader can learn to agree with)
    run_replay(bank, conditions)  per (condition, seed): train the feedback solver(s) on the bank under
                                  the condition's provenance, let them grade every bank item, audit

In the loop, a change of grader also changes what the proposer writes next (the curriculum), so
a lower F there could come from easier questions. Here the questions are fixed: the only thing a
condition changes is which bank items each feedback solver trained on (and with which label under
MSV). `check_invariants` asserts that.

Like `evolve.py`, this room holds the world's truth (the oracle judge, read at replay time only)
and the agents; the agents get questions, documents and the search tool. The bank holds no truth.
Either backend: a bank of sim runs replays through sim solvers; a bank of language-model runs
through fresh adapters on the runs' base model, and when those runs worked on a real corpus (no
truth) the grading is judged by an LLM judge (`replay_judge`), as `selfevo evolve` audits them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from selfevo._fmt import mean_std_text, num
from selfevo._io import append_jsonl, atomic_writer, read_json, read_jsonl_log, write_json
from selfevo._software import software, software_changes
from selfevo.agents.base import Proposal
from selfevo.agents.sim import Reader, SimSolver
from selfevo.algos import summary
from selfevo.audit import JudgedItem, OracleJudge, audit_metrics
from selfevo.evaluate import answers_match
from selfevo.experiments import worker_pool
from selfevo.loop.admission import MSV
from selfevo.loop.feedback import other_fold, trains_on
from selfevo.loop.folds import FoldAssignment, assign_folds, fold_of, link_graph, question_fold
from selfevo.loop.schedule import MAX_SAMPLES, MAX_SEEDS, MAX_STEPS, derive_seed
from selfevo.runs import RunDir, RunError, check_loop_run, config_json, made_on
from selfevo.search.docstore import ById, contents_by_id
from selfevo.search.tool import SearchTool

__all__ = ["CONDITIONS", "MATCHER", "Bank", "BankItem", "Condition", "InvariantError", "ReplayError",
           "ReplaySettings", "build_bank", "check_invariants", "parse_conditions", "plot_results",
           "replay_judge", "results_markdown", "results_table", "run_replay", "write_results"]

FORMAT = 2  # results.json (2: the invariants' digest covers the questions: items_sha256)
# bank files: 2 added the runs' backend, data and language-model config (format 1 banks are sim
# banks on a world and still load); 3 added base_seed (older banks replay with their sampling seed's
# base model, as they did)
BANK_FORMAT = 3
# The one answer matcher (DESIGN §2). Referenced through this name at grading time so that the
# invariant check can see which function actually graded (and a test can break it).
MATCHER = answers_match
_CANONICAL_MATCHER = "selfevo.evaluate.answers_match"

# what results.json reports per condition; "solver_truth" is the audit's T_S
REPORTED = ("F", "solver_truth", "replay_accuracy", "A", "coverage", "L")


class ReplayError(ValueError):
    """Bad input to the replay (run dirs, bank file, conditions); the message says what to fix."""


def creation_times_ok(created: object, sources: int) -> bool:
    """A bank's `source_created`: one manifest creation time (a number, or null) per source."""
    return isinstance(created, list) and len(created) == sources and all(
        c is None or (isinstance(c, (int, float)) and not isinstance(c, bool)) for c in created)


class OtherStudyJournal(ReplayError):
    """A journal of another bank, settings, judge or software than the study's."""


class InvariantError(AssertionError):
    """The replay changed something other than the feedback solver's training data."""


# ---------------------------------------------------------------- conditions


@dataclass(frozen=True)
class Condition:
    """One provenance of the feedback solver.

    split   how bank items are divided among feedback solvers: "none" (one solver on everything),
            "source" (by source document), "question" (by question text, `question_fold`),
            "connected" (by link-graph cluster, over every page a question read: `_provenance`)
    grades  "all" (the one solver grades everything), "own-fold" or "other-fold"
    budget  share of the full update budget each solver gets
    stream  the rollout seed stream: full-data is a second solver with the same data as coupled
    """

    name: str
    split: str
    grades: str
    budget: float = 1.0
    stream: str = "a"
    msv: bool = False


_BASE = (
    Condition("coupled", "none", "all"),  # the grader trained on the graded item itself
    Condition("same-source", "source", "own-fold"),
    Condition("full-data", "none", "all", stream="b"),  # paper: more data is not the cure
    Condition("question-split", "question", "other-fold"),
    Condition("source-id", "source", "other-fold"),  # CrossFit
    Condition("source-id-half", "source", "other-fold", budget=0.5),
    Condition("connected", "connected", "other-fold"),
)
CONDITIONS: dict[str, Condition] = {c.name: c for c in _BASE}
CONDITIONS.update({f"{c.name}+msv": replace(c, name=f"{c.name}+msv", msv=True) for c in _BASE})


def parse_conditions(names: Iterable[str] | str | None) -> list[Condition]:
    """Names (a list, or one comma-separated string; None or "all" = every condition) in the
    table's order; an unknown name is an error listing the known ones."""
    if names is None or names == "all":
        return list(CONDITIONS.values())
    if isinstance(names, str):
        names = names.split(",")
    wanted = [n.strip() for n in names if n.strip()]
    unknown = [n for n in wanted if n not in CONDITIONS and n != "all"]  # before "all": `all,cupled` is a typo
    if unknown:
        raise ReplayError(f"--conditions: unknown {', '.join(map(repr, unknown))} "
                          f"(known: {', '.join(CONDITIONS)}, or all)")
    if "all" in wanted:
        return list(CONDITIONS.values())
    if not wanted:
        raise ReplayError("--conditions: no condition named")
    return [c for c in CONDITIONS.values() if c.name in wanted]


@dataclass(frozen=True)
class ReplaySettings:
    # paper: each aux solver gets 25 updates a round over the two rounds it is trained = 50
    updates: int = 50
    rollouts: int = 5  # training rollouts per question (GRPO group)
    samples: int = 5  # grader samples per bank item, as in the loop
    msv_samples: int = 3  # paper: 3 with the source, 3 without

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ReplayError(f"{f.name}: must be a positive integer, got {v!r}")
        for name, most in (("updates", MAX_STEPS), ("rollouts", MAX_SAMPLES), ("samples", MAX_SAMPLES),
                           ("msv_samples", MAX_SAMPLES)):  # a typo's 10**12 would run until stopped
            if getattr(self, name) > most:
                raise ReplayError(f"{name}: must be at most {most:,}, got {getattr(self, name):,}")
        if self.updates < 2:
            raise ReplayError(f"updates: must be >= 2 (the half budget halves it), got {self.updates}")
        if self.rollouts < 2:  # one answer a question: every advantage 0, nothing trains (counted all the same)
            raise ReplayError(f"rollouts: must be >= 2 (a group of one has no advantage), got {self.rollouts}")


# ---------------------------------------------------------------- the bank


@dataclass(frozen=True)
class BankItem:
    item_id: str  # unique in the bank: "run<i>/<the run's item id>"
    question: str
    label: str  # the adopted label (what the loop trained on and graded against)
    draft_label: str
    source_id: str
    source_ids: tuple[str, ...]
    group: str  # connected-source group (link-graph cluster) of the source, clustered at the bank's seed
    run: str
    round: int
    hops: int

    def to_json(self) -> dict:
        return {**asdict(self), "source_ids": list(self.source_ids)}


@dataclass
class Bank:
    world: dict  # the runs' `world` config block
    seed: int  # sampling seed (and of the connected-source clustering)
    sources: list[str]
    items: list[BankItem]
    # the runs' solver and search config: the replay's feedback solvers start as their base model
    solver: dict
    search: dict
    backend: str = "sim"  # "lm": the feedback solvers are adapters on the runs' language model
    data: dict = field(default_factory=dict)  # the runs' data block: data.corpus = a real corpus, no truth
    lm: dict = field(default_factory=dict)  # the runs' lm config block (backend "lm")
    # the seed of the runs its items came from (None: runs of several seeds, language-model banks
    # only): a simulated base model's misreadings are seeded by the run seed, and the replay's base
    # model must be the one that wrote and graded the items
    base_seed: int | None = None
    # what the runs were made on (their manifests' `made_on`: the sha256 of a world directory or corpus;
    # empty for a bank from before it was kept): a replay run checks the world or corpus it opens
    made_on: dict = field(default_factory=dict)
    # each source run's manifest `created` time (None: not kept, or a bank from before it was): a report
    # knows its runs by it after the directory that holds runs and study was moved or copied
    source_created: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {"format": BANK_FORMAT, "world": self.world, "seed": self.seed, "base_seed": self.base_seed,
                "sources": self.sources, "solver": self.solver, "search": self.search, "backend": self.backend,
                "data": self.data, "lm": self.lm, "made_on": self.made_on,
                # (left out where not kept: an older bank's digest, which keys its study's journal, stays)
                **({"source_created": self.source_created} if self.source_created else {}),
                "items": [it.to_json() for it in self.items]}

    @property
    def corpus(self) -> str:
        return self.data.get("corpus", "")

    @property
    def documents_from(self) -> str:
        """Where its runs' documents came from, for messages: "corpus" or "world"."""
        return "corpus" if self.corpus else "world"

    def run_config(self, where: str = "bank"):
        """The config the replay rebuilds the runs' documents, search tool and base model from; an error
        in it is `where`'s (the bank file's path, where it was read from one)."""
        from selfevo.config import ConfigError, config_from_dict

        block = {"backend": self.backend, "world": self.world, "solver": self.solver, "search": self.search,
                 "data": self.data}
        if self.lm:
            block["lm"] = self.lm
        try:
            return config_from_dict(block)
        except ConfigError as e:
            raise ReplayError(f"{where}: {e}") from None

    @classmethod
    def from_json(cls, obj: dict, where: str = "bank") -> Bank:
        if not isinstance(obj, dict) or "format" not in obj:
            raise ReplayError(f"{where}: not a replay bank (no format field)")
        # (2.0 or true passed for format 2 or 1: an older bank's base model, read from another field)
        if type(obj["format"]) is not int or obj["format"] not in range(1, BANK_FORMAT + 1):
            raise ReplayError(f"{where}: bank format {obj['format']!r}, this selfevo reads formats 1 "
                              f"to {BANK_FORMAT}")
        if "items" not in obj:  # a study's results.json, another tool's JSON with a format field
            raise ReplayError(f"{where}: not a replay bank (no items; a bank is the file `selfevo replay build` "
                              "writes)")
        missing = [k for k in ("world", "seed", "sources", "solver", "search", "items") if k not in obj]
        if missing:
            raise ReplayError(f"{where}: missing field(s) {', '.join(missing)}")
        if not isinstance(obj["items"], list) or not obj["items"]:
            raise ReplayError(f"{where}: the bank holds no items")
        names = [f.name for f in fields(BankItem)]
        items = []
        for i, it in enumerate(obj["items"]):
            lost = [k for k in names if not isinstance(it, dict) or k not in it]
            if lost:
                raise ReplayError(f"{where}: item {i}: missing field(s) {', '.join(lost)}")
            # a bank edited by hand: a null label or question graded as "no answer" or crashed the
            # solver mid-study, a float hop count was truncated; name the item and field instead
            which = f"{where}: item {i} ({it['item_id']!r})" if isinstance(it["item_id"], str) else f"{where}: item {i}"
            for k in names:
                v = it[k]
                if k in ("round", "hops"):
                    ok, want = isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"
                elif k == "source_ids":
                    ok = isinstance(v, list) and bool(v) and all(isinstance(s, str) and s for s in v)
                    want = "a non-empty list of document ids"
                else:
                    ok, want = isinstance(v, str), "a string"
                    if k in ("item_id", "source_id"):
                        ok, want = ok and bool(v), "a non-empty string"
                if not ok:
                    raise ReplayError(f"{which}: field {k} should be {want}, got {json.dumps(v)[:80]}")
            items.append(BankItem(**{**{k: it[k] for k in names}, "source_ids": tuple(it["source_ids"])}))
        seen: set[str] = set()
        for it in items:
            if it.item_id in seen:
                raise ReplayError(f"{where}: duplicate item id {it.item_id!r}")
            seen.add(it.item_id)
        if obj.get("backend", "sim") not in ("sim", "lm"):
            raise ReplayError(f"{where}: backend {obj['backend']!r} (known: sim, lm)")
        base_seed = obj.get("base_seed") if obj["format"] >= 3 else obj["seed"]
        if base_seed is None and obj.get("backend", "sim") == "sim":
            raise ReplayError(f"{where}: field base_seed is missing (the seed of a simulated bank's runs)")
        for k, v in (("seed", obj["seed"]), ("base_seed", base_seed)):  # int() truncated 1.5 and took true
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ReplayError(f"{where}: field {k} should be an integer, got {json.dumps(v)[:80]}")
        for k in ("world", "solver", "search", "data", "lm", "made_on"):
            if not isinstance(obj.get(k, {}), dict):
                raise ReplayError(f"{where}: field {k} should be an object, got {json.dumps(obj[k])[:80]}")
        if obj.get("backend", "sim") == "lm" and not obj.get("lm"):  # its graders would be the default model's
            raise ReplayError(f"{where}: backend 'lm' with field lm empty: a language-model bank keeps its runs' "
                              "lm config (replay build writes it)")
        if not isinstance(obj["sources"], list) or not all(isinstance(s, str) for s in obj["sources"]):
            raise ReplayError(f"{where}: field sources should be a list of run directories, "
                              f"got {json.dumps(obj['sources'])[:80]}")
        created = obj.get("source_created", [])
        if created != [] and not creation_times_ok(created, len(obj["sources"])):
            raise ReplayError(f"{where}: field source_created should be a list of numbers (or null), one per "
                              f"source, got {json.dumps(created)[:80]}")
        bank = cls(dict(obj["world"]), obj["seed"], list(obj["sources"]), items, dict(obj["solver"]),
                   dict(obj["search"]), obj.get("backend", "sim"), dict(obj.get("data", {})), dict(obj.get("lm", {})),
                   base_seed, dict(obj.get("made_on", {})), list(created))
        bank.run_config(where)  # its config blocks, checked where the file is named, not when a replay starts
        return bank

    def save(self, path: str | os.PathLike) -> Path:
        write_json(path, self.to_json())
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Bank:
        path = Path(path)
        if not path.is_file():
            raise ReplayError(f"{path}: no bank file; make one with `selfevo replay build`")
        try:
            obj = read_json(path)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ReplayError(f"{path}: not valid JSON ({e})") from None
        return cls.from_json(obj, str(path))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()


def _environment(cfg, where: str = "bank", served: bool = False):
    """The runs' documents and index, as `selfevo evolve` resolves them (a generated world, a world
    directory, or a corpus file). `served`: the documents only, as runs that searched through a /retrieve
    server read them (`evolve.served_environment`: no index built)."""
    from selfevo.config import ConfigError
    from selfevo.corpus import DataError
    from selfevo.evolve import environment, served_environment
    from selfevo.world import WorldError

    try:
        if served:
            return served_environment(cfg, benchmarks=False, progress=False)
        return environment(cfg, benchmarks=False)
    except (ConfigError, DataError, WorldError, OSError) as e:  # ConfigError: data.index is no index (removed?)
        raise ReplayError(f"{where}: {e}") from None


def served_retriever(bank: Bank, url: str):
    """A /retrieve server as the retriever of `bank`'s feedback solvers, asked one query first: one that
    answers nothing is refused before any model loads or trains (`replay run` asks before its judge loads
    too). A bank of runs on a world is refused: its feedback solvers search the world's own index."""
    from selfevo._io import shown_url
    from selfevo.search.client import RetrieverError, probed_client

    if not bank.corpus:
        raise ReplayError("--retriever-url: this bank's runs worked on a world, whose own index its feedback "
                          "solvers search; a /retrieve server is for a bank of runs on a corpus")
    try:
        return probed_client(url)
    except RetrieverError as e:
        raise ReplayError(f"--retriever-url {shown_url(url)}: {e}") from None


def _bank_parts(cfg: dict) -> dict:
    """What of a run's config a bank keeps (and its runs must share): where the documents come
    from, the search tool (a saved index of the corpus too: the bank keeps the first run's data
    block, and another index finds other pages), and the base model its feedback solvers start as."""
    backend, data = cfg.get("backend", "sim"), cfg.get("data", {})
    return {"backend": backend, "world": cfg["world"], "corpus": data.get("corpus", ""), "index": data.get("index", ""),
            "solver": cfg["solver"], "search": cfg["search"], "lm": cfg.get("lm", {}) if backend == "lm" else {}}


def build_bank(run_dirs: Sequence[str | os.PathLike], size: int = 3000, seed: int = 0,
               min_round: int = 2, allow_fewer: bool = False, hops: Iterable[int] | None = None,
               distinct: bool = False) -> Bank:
    """Admitted proposer-step items of rounds >= `min_round` of completed runs (one world), then a
    seeded sample of `size`. `hops`: keep only questions of these hop counts (e.g. {1}: every page
    a question read is its source). `distinct`: keep identical (question, label) pairs once.

    Rounds >= 2 because by then the coupled grader has trained on pseudo-labels, so the bank
    holds the wrong labels co-cheating agrees with (round 1 is graded by the base model). By
    default a question the proposer asked several times is in the bank as often as the loop
    trained on it (paper: 3,000 of one run's 3,200 round-2/3 admitted questions); the question
    split keeps such repeats on one side (`question_fold`)."""
    if isinstance(run_dirs, (str, os.PathLike)):  # a string was read as its characters' run directories
        raise TypeError(f"run_dirs: a list of run directories, got one ({str(run_dirs)!r}): pass [it]")
    if not run_dirs:
        raise ReplayError("--from: name at least one run directory")
    if size < 1:
        raise ReplayError(f"--size: must be >= 1, got {size}")
    from selfevo.config import ConfigError
    from selfevo.corpus import DataError
    from selfevo.evolve import check_world, searched_through_a_server
    from selfevo.world import WorldError

    hops = set(hops) if hops is not None else None
    if hops is not None and (not hops or min(hops) < 1):
        raise ReplayError(f"--hops: hop counts must be >= 1, got {sorted(hops)}")
    named: dict[Path, str] = {}
    for d in run_dirs:  # one run named twice would put every question in the pool twice
        key = Path(d).resolve()
        if key in named:
            raise ReplayError(f"--from: run directory {key} is named twice ({named[key]}, {d}); name each "
                              "run once")
        named[key] = str(d)
    configs, made, created, served = [], [], [], []
    for d in run_dirs:
        run = RunDir(d)
        if not run.exists():
            raise ReplayError(f"{d}: not a run directory (no run manifest.json)")
        try:  # a damaged file: its name, line and field
            manifest = run.manifest()
            check_loop_run(manifest, d)
            status = manifest.get("status")
            if status != "complete":
                raise ReplayError(f"{d}: the run is not complete (status {status!r}); finish it with "
                                  "`selfevo evolve --resume`")
            if manifest.get("agents"):  # the replay trains selfevo's learners of the run's config
                raise ReplayError(f"{d}: made with learners of the user's ({manifest['agents']}); a replay bank's "
                                  "feedback solvers are selfevo's learners of the run's config, not those")
            cfg = run.run_config()
            configs.append(config_json(cfg))
            check_world(run, cfg)  # its truth judges the replay
            made.append(made_on(manifest))
            served.append(searched_through_a_server(cfg, manifest))
            c = manifest.get("created")
            created.append(c if isinstance(c, (int, float)) and not isinstance(c, bool) else None)
        except RunError as e:
            raise ReplayError(str(e)) from None
        # its data.index no longer an index (removed, or half rebuilt); its world directory moved or broken
        except (ConfigError, DataError, WorldError) as e:
            raise ReplayError(f"{d}: {e}") from None
    parts = [_bank_parts(cfg) for cfg in configs]
    for key in parts[0]:
        for d, other in zip(run_dirs[1:], parts[1:]):
            if other[key] != parts[0][key]:
                raise ReplayError(f"runs differ in their {key} config: {run_dirs[0]} has {parts[0][key]}, "
                                  f"{d} has {other[key]}; a bank is built from runs of one {key}")
    p = parts[0]
    run_seeds = sorted({c["seed"] for c in configs})
    if p["backend"] == "sim" and len(run_seeds) > 1:
        raise ReplayError(f"runs of seeds {', '.join(map(str, run_seeds))}: a simulated run's base model is "
                          "seeded by the run seed, so these runs started from different base models, and the "
                          "replay has one; build the bank from runs of one seed (one run holds the paper's "
                          "3,000 round-2/3 questions)")
    # the data block only says where a corpus is (a world's documents come from the world block)
    for d, other in zip(run_dirs[1:], made[1:]):  # one world directory or corpus path, remade between the runs
        if other != made[0]:
            raise ReplayError(f"runs made on different data under one path: {run_dirs[0]} and {d} (the sha256 "
                              "their manifests record); a bank is built from runs on one world or corpus")
    shell = Bank(p["world"], seed, [], [], p["solver"], p["search"], p["backend"],
                 configs[0]["data"] if p["corpus"] else {}, p["lm"], run_seeds[0] if len(run_seeds) == 1 else None,
                 {k: v for k, v in made[0].items() if v is not None})
    # the documents only (the link graph's groups; no search): those of runs that searched through a server
    # are read as they read them, with no index built
    env = _environment(shell.run_config(), where=str(run_dirs[0]), served=all(served))
    groups = assign_folds(env.documents, seed, 2, "connected").groups
    sources = [str(key) for key in named]  # absolute: a report or a reader elsewhere finds the runs
    pool: list[BankItem] = []
    seen: set[tuple[str, str]] = set()
    for i, d in enumerate(run_dirs):
        try:
            rows = RunDir(d).steps()
        except RunError as e:
            raise ReplayError(str(e)) from None
        for row in rows:
            if row["kind"] != "proposer" or row["round"] < min_round:
                continue
            for it in row["items"]:
                if not it["admitted"] or (hops is not None and it["hops"] not in hops):
                    continue
                if distinct:
                    key = (it["question"], it["adopted_label"])
                    if key in seen:
                        continue
                    seen.add(key)
                if it["source_id"] not in groups:
                    raise ReplayError(f"{d}: source {it['source_id']!r} is not a document of the run's "
                                      f"{shell.documents_from}")
                read = it.get("source_ids")
                if not isinstance(read, list) or not read or any(not isinstance(p, str) or p not in groups
                                                                 for p in read):
                    # else written, and refused by `replay run` when it loads the bank
                    raise ReplayError(f"{d}: item {it.get('item_id')!r}: source_ids should be a non-empty list of "
                                      f"documents of the run's {shell.documents_from}, got {json.dumps(read)[:80]}")
                pool.append(BankItem(f"run{i}/{it['item_id']}", it["question"], it["adopted_label"],
                                     it["draft_label"], it["source_id"], tuple(it["source_ids"]),
                                     groups[it["source_id"]], sources[i], int(row["round"]), int(it["hops"])))
    if len(pool) < size:
        which = f" with hops in {sorted(hops)}" if hops is not None else ""
        kind = "distinct admitted" if distinct else "admitted"
        if not pool:  # no --size helps: the runs stopped before round `min_round`, or it admitted nothing
            raise ReplayError(f"no {kind} items{which} of rounds >= {min_round} in {len(run_dirs)} run(s): a bank "
                              f"needs runs of at least {min_round} rounds (round 1 is graded before any "
                              "training) that admitted questions in them")
        if not allow_fewer:
            raise ReplayError(f"only {len(pool)} {kind} items{which} of rounds >= {min_round} in "
                              f"{len(run_dirs)} run(s), fewer than --size {size}; lower --size, or add runs (of the "
                              "same seed, for a simulated bank)")
        size = len(pool)  # a demo on a small world takes what there is
    chosen = sorted(random.Random(derive_seed(seed, "bank")).sample(range(len(pool)), size))
    bank = replace(shell, sources=sources, source_created=created, items=[pool[j] for j in chosen])
    Bank.from_json(bank.to_json(), where="the bank built")  # what `replay run` will check, checked before writing
    return bank


# ---------------------------------------------------------------- one process's world


class _Context:
    """What every replay job of a process shares: the documents, the BM25 tool (the expensive part,
    built once per process), the base model (the sim reader, or the runs' language model with one
    adapter per feedback solver) and the judge (the world's oracle unless one is given)."""

    def __init__(self, bank: Bank, settings: ReplaySettings, retriever_url: str | None = None):
        from selfevo.evolve import check_made_on

        self.bank, self.settings = bank, settings
        cfg = bank.run_config()
        retriever = served_retriever(bank, retriever_url) if retriever_url else None
        self.env = _environment(cfg, served=bool(retriever_url))
        try:  # the world or corpus its runs were made on: else their questions are graded on other pages
            check_made_on(bank.made_on, cfg, None if retriever_url else self.env.index, "its runs were made on it",
                          "replay on the {what} they were made on")
        except RunError as e:
            raise ReplayError(f"bank: {e}") from None
        self.documents = ById(self.env.documents)  # read on demand: a corpus stays on disk
        # the source too: a fold is a hash of any id, so a source that is no document would be split silently
        absent = sorted({s for it in bank.items for s in (it.source_id, *it.source_ids) if s not in self.documents})
        if absent:
            raise ReplayError(f"bank: {len(absent)} source document(s) (e.g. {absent[0]!r}) are not in its "
                              f"{bank.documents_from}")
        self.tool = SearchTool(self.env.index if retriever is None else retriever, topk=cfg.search.topk,
                               max_calls=cfg.search.max_calls)
        self.policy = None
        if cfg.backend == "lm":
            from selfevo.agents.lm.policy import LMPolicy

            self.policy = LMPolicy(cfg.lm)  # adapters live in memory: a replay keeps no checkpoints
        else:
            # One base model for every replay seed, as the paper replays with one pretrained model: the
            # one the bank's runs started from (the run seed seeds its misreadings), so replay seeds vary
            # only folds, orders and sampling. (A reader seeded per replay seed would be a different base
            # model per seed; one of another run seed, a model that neither wrote nor graded the items.)
            self.reader = Reader("solver", cfg.solver.misread_scale, self.env.world.config.shared_misreading,
                                 bank.base_seed)
        self.solver_config = cfg.solver
        self.oracle = OracleJudge(self.env.truth) if self.env.truth is not None else None
        self.judge = self.oracle  # _InProcess may put a given judge here
        self._connected: dict[int, FoldAssignment] = {}
        self._links: list[tuple[str, str]] | None = None

    def make_solver(self, name: str, seed: int = 0):
        """A trainable solver that starts as the base model. A language model's adapter is named by
        `seed` too, which seeds its initialisation and dropout: the same solver of two replay seeds
        does not draw the same masks."""
        if self.policy is not None:
            from selfevo.agents.lm.agents import LMSolver

            return LMSolver.trainable(self.policy, name, policy_name=f"{name}#{seed}")
        return SimSolver(name, self.solver_config, self.reader)

    def connected_folds(self, seed: int) -> FoldAssignment:
        """The `connected` condition's folds for a replay seed, as a crossfit-connected run of that
        seed places them (link-graph clusters, balanced); the link graph is walked once per process,
        the clusters computed once per seed."""
        if self._links is None:
            self._links = link_graph(self.env.documents)
        if seed not in self._connected:
            self._connected[seed] = assign_folds(self.env.documents, seed, 2, "connected", self._links)
        return self._connected[seed]

    def release(self, solvers: Sequence) -> None:
        """A finished job's solvers: their adapters are freed (the sim's are garbage)."""
        if self.policy is not None:
            for sv in solvers:
                self.policy.drop(sv.policy_name)


_CONTEXT: tuple[str, _Context] | None = None


def _set_context(bank: Bank, settings: ReplaySettings, retriever_url: str | None = None) -> _Context:
    global _CONTEXT
    key = f"{bank.digest()}:{settings}:{retriever_url}"
    if _CONTEXT is None or _CONTEXT[0] != key:
        _CONTEXT = None  # the old one's model goes before the new one loads
        _CONTEXT = (key, _Context(bank, settings, retriever_url))
    ctx = _CONTEXT[1]
    # a judge an earlier study of this process gave (_InProcess) is not this study's: a fork pool's
    # workers inherit this context and grade with the oracle, as results.json says they do
    ctx.judge = ctx.oracle
    return ctx


_INIT_ERROR: Exception | None = None  # a pool worker's failure to set its context, raised by its first job


def _init_worker(bank_json: dict, settings: ReplaySettings, retriever_url: str | None = None) -> None:
    global _INIT_ERROR
    _INIT_ERROR = None
    try:
        _set_context(Bank.from_json(bank_json), settings, retriever_url)
    except Exception as e:  # raised in an initializer it would break the pool, saying nothing of why
        _INIT_ERROR = e


def _ctx() -> _Context:
    if _INIT_ERROR is not None:  # the job's error, as `workers=1` raises it (a bank its world no longer fits)
        raise _INIT_ERROR
    assert _CONTEXT is not None, "replay context not set"
    return _CONTEXT[1]


# ---------------------------------------------------------------- jobs


def _msv_job(seed: int, conditions: Sequence[str] = ()) -> dict[str, str | None]:
    """MSV by the untrained base solver over the whole bank: item id -> replacement label, or
    None when rejected. Computed once per seed and shared by every +msv condition; the training
    sets of `conditions` (the study's +msv ones) are checked here, before any of them trains."""
    ctx = _ctx()
    msv = MSV(ctx.documents, samples=ctx.settings.msv_samples)
    base = ctx.make_solver("base")
    msv.begin_round(1, base)
    proposals = [Proposal(it.question, it.label, it.source_id, it.source_ids, it.hops) for it in ctx.bank.items]
    decisions = msv.decide(proposals, ctx.tool, derive_seed(seed, "replay-msv"))
    ctx.release([base, msv.model])  # its snapshot too: with lm.adapter = "full", a copy of the model
    labels = {it.item_id: (d.label if d.admitted else None) for it, d in zip(ctx.bank.items, decisions, strict=True)}
    for name in conditions:
        _train_sets(ctx, CONDITIONS[name], seed, labels)
    return labels


def _provenance(cond: Condition, seed: int, connected: FoldAssignment | None = None):
    """`(trains, grader)` for one condition and seed: `trains(h, item)` says whether feedback solver
    h trains on the item, `grader(item)` gives `(the solver that grades it, fallback)`.

    The `connected` split is the loop's crossfit-connected rule (`loop/feedback.py`) on `connected`,
    the link-graph clusters placed in folds: a solver trains only on items all of whose pages lie
    in its fold, and an item is graded by a fold none of its pages lies in -- where it read pages of
    both, by the other fold all the same (`fallback`). So the grader never trained on a label
    derived from any page the graded question touched, which holding out the source's cluster alone
    does not give (a multi-hop item of the other fold reads pages of this one)."""
    if cond.split == "none":
        return (lambda h, it: True), (lambda it: (0, False))
    if cond.split == "connected":
        def fold(it):
            return connected.of(it.source_id)

        def touched(it):  # (the source too: a bank's source_ids hold it, but it is not checked at load)
            return connected.lineage({it.source_id, *it.source_ids})
    else:
        def fold(it):
            if cond.split == "source":
                return fold_of(it.source_id, seed, 2)
            return question_fold(it.question, seed, 2)

        def touched(it):  # the source rule: the fold of the question is all that counts
            return {fold(it)}

    def trains(h: int, it) -> bool:
        return trains_on(h, fold(it), touched(it), lineage_aware=cond.split == "connected")

    def grader(it) -> tuple[int, bool]:
        return (fold(it), False) if cond.grades == "own-fold" else other_fold(fold(it), touched(it), 2)

    return trains, grader


def _train(ctx: _Context, name: str, train: list, updates: int, seed: int):
    """`updates` policy-gradient steps on `train` [(item, label)] in a seeded order. The batches
    are the full budget's even split, so a smaller budget sees fewer batches (as AuxFeedback)."""
    s = ctx.settings
    solver = ctx.make_solver(name, seed)
    order = list(train)
    random.Random(derive_seed(seed, "order")).shuffle(order)
    for u in range(updates):
        batch = order[u * len(order) // s.updates:(u + 1) * len(order) // s.updates]
        trajs = solver.answer([it.question for it, _ in batch], ctx.tool, greedy=False, n=s.rollouts,
                              seed=derive_seed(seed, "rollout", u))
        solver.update([(ts, label) for ts, (_, label) in zip(trajs, batch, strict=True)])
    return solver


def _graded_digest(items: Iterable[tuple[str, str, str]]) -> str:
    """The digest of what a job graded: (item id, question, label) of every item, in order."""
    return hashlib.sha256(json.dumps(list(items)).encode()).hexdigest()


def _train_sets(ctx: _Context, cond: Condition, seed: int,
                msv_labels: Mapping[str, str | None] | None) -> tuple[list, list[str], list[list], object]:
    """`(train_pool, solver names, each solver's training set, grader)` of a condition and seed;
    a solver with fewer items than updates is refused, naming the condition and seed."""
    s, items = ctx.settings, ctx.bank.items
    if cond.msv:  # MSV filters the training items and replaces their labels; grading does not change
        train_pool = [(it, msv_labels[it.item_id]) for it in items if msv_labels[it.item_id] is not None]
    else:
        train_pool = [(it, it.label) for it in items]
    trains, grader = _provenance(cond, seed, ctx.connected_folds(seed) if cond.split == "connected" else None)
    k = 1 if cond.split == "none" else 2
    names = [("all" if cond.stream == "a" else f"all-{cond.stream}") if k == 1 else f"{cond.split}-fold{h}"
             for h in range(k)]
    train_sets = [[p for p in train_pool if trains(h, p[0])] for h in range(k)]
    neither = len(train_pool) - sum(map(len, train_sets))  # connected: items that read both folds train none
    for label, train in zip(names, train_sets):
        if len(train) < s.updates:
            why = f" ({neither} of the {len(train_pool)} items read pages of both folds and train neither solver)"
            msv = f" (MSV admitted {len(train_pool)} of the {len(items)} items)" if cond.msv else ""
            fix = "a larger bank" if len(train) < 2 else "a larger bank or fewer updates (`replay run --updates`)"
            raise ReplayError(f"feedback solver {label} of {cond.name} seed {seed}: {len(train)} training items{msv}, "
                              f"fewer than the {s.updates} updates{why if neither else ''}; use {fix}")
    return train_pool, names, train_sets, grader


def _preflight(names: Sequence[str], seeds: Sequence[int],
               msv_labels: Mapping[int, Mapping[str, str | None]] | None = None) -> None:
    """Every training set known before any job trains, checked: a fold too small for the updates was
    refused only when its job ran, after the jobs queued before it (hours of training on a
    language-model bank, all lost with the refusal). MSV decides the +msv sets: those of the seeds
    whose MSV labels a journal holds (`msv_labels`) are checked here, the others by `_msv_job`."""
    ctx = _ctx()
    for name in names:
        for seed in seeds:
            if not CONDITIONS[name].msv:
                _train_sets(ctx, CONDITIONS[name], seed, None)
            elif seed in (msv_labels or {}):
                _train_sets(ctx, CONDITIONS[name], seed, msv_labels[seed])


def _condition_job(name: str, seed: int, msv_labels: Mapping[str, str | None] | None) -> dict:
    """Train the condition's feedback solver(s), grade every bank item, audit with the oracle."""
    ctx, s = _ctx(), _ctx().settings
    cond = CONDITIONS[name]
    items = ctx.bank.items
    train_pool, names, train_sets, grader = _train_sets(ctx, cond, seed, msv_labels)
    n_updates = math.floor(s.updates * cond.budget)
    # the seed names the training data, not the condition: same-source and source-id train the
    # same fold solvers and differ only in who grades; the half budget is the first half of it
    solvers = [_train(ctx, label, train, n_updates, derive_seed(seed, "train", cond.split, h, cond.stream))
               for h, (label, train) in enumerate(zip(names, train_sets))]
    routes = {it.item_id: grader(it) for it in items}  # (grading solver, fallback)
    outcome = _grade(ctx, solvers, lambda it: routes[it.item_id][0],
                     derive_seed(seed, "grade", cond.split, cond.stream))
    ctx.release(solvers)
    return {"condition": name, "seed": seed, **outcome,
            "updates": {sv.name: sv.updates for sv in solvers},
            "train_items": {sv.name: len(train) for sv, train in zip(solvers, train_sets)},
            "fallback_graded": sum(fallback for _, fallback in routes.values())}


def _base_job(seed: int) -> dict:
    """Reference, not a condition: the untrained base model grades the bank. Its F is what a
    grader that learned nothing from the bank already shows (misreadings it shares with the
    proposer's reader), the level against which a provenance's leak is measured."""
    ctx = _ctx()
    base = ctx.make_solver("base")
    outcome = _grade(ctx, [base], lambda it: 0, derive_seed(seed, "grade", "base"))
    ctx.release([base])
    return {"seed": seed, **outcome}


def replay_accuracy(greedy: Sequence[str], labels: Sequence[str], resolved: Sequence[bool],
                    matcher=answers_match) -> float | None:
    """The share of the items the judge resolved whose one greedy answer matches the bank label
    (None when it resolved none)."""
    return share_of_hits([matcher(g, y) for g, y in zip(greedy, labels, strict=True)], resolved)


def share_of_hits(hits: Sequence[bool], resolved: Sequence[bool]) -> float | None:
    """The share of hits among the resolved items (None when none is resolved)."""
    kept = [h for h, ok in zip(hits, resolved, strict=True) if ok]
    return sum(kept) / len(kept) if kept else None


def _grade(ctx: _Context, solvers: Sequence, grader, seed: int) -> dict:
    """Every bank item answered `samples` times (sampled) and once greedily by its grader
    (`grader(item)` indexes `solvers`), judged (the oracle, or the judge given) against the bank's
    adopted label."""
    s, items = ctx.settings, ctx.bank.items
    by_grader: dict[int, list[int]] = {}
    for i, it in enumerate(items):
        by_grader.setdefault(grader(it), []).append(i)
    responses: list[list[str]] = [[] for _ in items]
    greedy: list[str] = [""] * len(items)
    for g, idx in sorted(by_grader.items()):
        questions = [items[i].question for i in idx]
        sampled = solvers[g].answer(questions, ctx.tool, greedy=False, n=s.samples, seed=derive_seed(seed, g))
        best = solvers[g].answer(questions, ctx.tool, greedy=True, n=1)
        for i, ts, bs in zip(idx, sampled, best, strict=True):
            responses[i] = [t.answer for t in ts]
            greedy[i] = bs[0].answer
    graded = [(it.item_id, it.question, it.label) for it in items]  # exactly what the judge and the matcher see
    matcher = MATCHER
    verdicts = ctx.judge.judge([{"question": question, "adopted_label": label, "responses": rs,
                                 "source_id": it.source_id, "source_ids": list(it.source_ids)}
                                for it, (_, question, label), rs in zip(items, graded, responses)])
    judged = [JudgedItem(tuple(matcher(r, label) for r in rs), v.resolved, v.label_correct, v.responses_correct)
              for (_, _, label), rs, v in zip(graded, responses, verdicts)]
    hits = [matcher(g, label) for g, (_, _, label) in zip(greedy, graded)]
    out = {"metrics": _metrics(judged, hits), "graded": _graded_digest(graded), "n_graded": len(graded),
           "matcher": f"{matcher.__module__}.{matcher.__qualname__}"}
    if not isinstance(ctx.judge, OracleJudge):
        # which items a judge resolves may depend on the answers (an LLM judge's), so on the grader: each item
        # is kept, and the study compares every condition over the items resolved in all of its jobs
        out["items"] = [_item_code(j, h) for j, h in zip(judged, hits)]
    return out


def _metrics(judged: Sequence[JudgedItem], hits: Sequence[bool]) -> dict:
    """A job's reported numbers from its judged items and greedy hits (replay accuracy over the resolved)."""
    m = audit_metrics(judged)
    accuracy = share_of_hits(hits, [j.resolved for j in judged])
    return {"F": m["F"], "solver_truth": m["T_S"], "replay_accuracy": accuracy, "A": m["A"],
            "coverage": m["coverage"], "L": m["L"], "T_P": m["T_P"]}


def _item_code(j: JudgedItem, hit: bool) -> str:
    """One judged item in a journal line: "-" unresolved, else label_correct, greedy hit, then each sample's
    match and correctness as 0/1 ("1 0 10110 10010")."""
    if not j.resolved:
        return "-"
    return (f"{int(j.label_correct)} {int(hit)} {''.join(str(int(x)) for x in j.matches)} "
            f"{''.join(str(int(x)) for x in j.responses_correct)}")


_ITEM_CODE = re.compile(r"-|[01] [01] [01]+ [01]+")  # `_item_code`'s form, as a journal row is checked


def _item_decode(code: str) -> tuple[JudgedItem, bool]:
    if code == "-":
        return JudgedItem((), False), False
    label, hit, matches, correct = code.split()
    judged = JudgedItem(tuple(c == "1" for c in matches), True, label == "1", tuple(c == "1" for c in correct))
    return judged, hit == "1"


def compare_on_common_items(results: Sequence[dict]) -> int | None:
    """Every job's metrics over the items resolved in all of them (in place; each keeps its own coverage):
    an LLM judge may resolve an item for one grader's answers and not for another's, and F or A over
    different items would not compare. Returns how many items that is (None: the oracle's jobs, which
    resolve by the question alone and keep no items)."""
    kept = ["items" in r for r in results]
    if not results or not any(kept):
        return None
    if not all(kept):  # each over its own items would not compare: a journal row that lost them
        raise ReplayError(f"{kept.count(False)} of {len(results)} jobs kept no judged items, the others did")
    decoded = [[_item_decode(c) for c in r["items"]] for r in results]
    common = [i for i in range(len(decoded[0])) if all(d[i][0].resolved for d in decoded)]
    for r, d in zip(results, decoded):
        own = r["metrics"]["coverage"]
        r["metrics"] = {**_metrics([d[i][0] for i in common], [d[i][1] for i in common]), "coverage": own}
    return len(common)


# ---------------------------------------------------------------- the study


def check_invariants(outcomes: Mapping[tuple[str, int], dict], bank: Bank, settings: ReplaySettings) -> dict:
    """Between conditions only the feedback solver's training data may change: every outcome
    graded the bank's items (their questions and labels) under the one matcher, and every feedback
    solver made the full number of updates (half for the half-budget condition)."""
    want_graded = _graded_digest((it.item_id, it.question, it.label) for it in bank.items)
    first = min((s for _, s in outcomes), default=None)
    for (name, seed), out in sorted(outcomes.items()):
        where = f"replay invariant broken in {name} seed {seed}"
        if out["graded"] != want_graded or out["n_graded"] != len(bank.items):
            raise InvariantError(f"{where}: graded items, questions or labels differ from the bank's")
        if out["matcher"] != _CANONICAL_MATCHER:
            raise InvariantError(f"{where}: graded with {out['matcher']}, not {_CANONICAL_MATCHER}")
        # stated here independently of the condition table, so a wrong table entry is caught
        want = settings.updates // 2 if name.startswith("source-id-half") else settings.updates
        wrong = {k: v for k, v in out["updates"].items() if v != want}
        if wrong or not out["updates"]:
            raise InvariantError(f"{where}: feedback solver updates {out['updates']}, expected {want} each")
    return {"items": len(bank.items), "items_sha256": want_graded, "matcher": _CANONICAL_MATCHER,
            # one seed's (checked above for all): the first, whichever it is (was seed 0's: none without it)
            "updates": {name: out["updates"] for (name, seed), out in sorted(outcomes.items()) if seed == first}}


class _InProcess:
    """workers=1: the same job code path as the pool, in this process; a job runs when the
    study loop asks for the next finished one (so the progress bar moves)."""

    def __init__(self, bank: Bank, settings: ReplaySettings, judge=None, retriever_url: str | None = None):
        ctx = _set_context(bank, settings, retriever_url)
        ctx.judge = judge if judge is not None else ctx.oracle
        if ctx.judge is None:
            raise ReplayError("bank: its runs worked on a real corpus, which has no exact truth; give a judge "
                              "(`selfevo replay run` serves the base model as an LLM judge, or --judge-url)")
        self._calls: dict[Future, tuple] = {}

    def submit(self, fn, *args) -> Future:
        f: Future = Future()
        self._calls[f] = (fn, args)
        return f

    def run_next(self, pending: Iterable[Future]) -> list[Future]:
        f = next(iter(pending))
        fn, args = self._calls.pop(f)
        try:
            f.set_result(fn(*args))
        except BaseException as e:  # re-raised by f.result(), as a pool would
            f.set_exception(e)
        return [f]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._calls.clear()


def _mean_std(values: list) -> dict:
    """results.json's cell: mean and std over seeds (the issue's schema: no interval)."""
    s = summary(values)
    return {"mean": s["mean"], "std": s["std"]}


def _jobs(conds: list[Condition], seeds: list[int]) -> set[tuple[str, int]]:
    """Every job of a study, (job, seed): per seed, its base reference, its MSV labels if a condition
    needs them, and each condition."""
    names = ["base", *(["msv"] if any(c.msv for c in conds) else []), *(c.name for c in conds)]
    return {(name, s) for s in seeds for name in names}


def _run_jobs(pool, conds: list[Condition], seeds: list[int], bar, done: Mapping[tuple[str, int], dict] | None = None,
              record=None) -> tuple[dict, dict, dict]:
    """Submit every job not in `done` (finished jobs of this study, `_jobs`, by (job, seed)),
    collect results as they finish, handing each to `record(job, seed, result)`; a seed's MSV result
    releases its +msv conditions. Returns (condition outcomes, MSV labels, base reference) keyed by seed."""
    need_msv = any(c.msv for c in conds)
    done = done or {}
    task = bar.add_task("replay", total=len(_jobs(conds, seeds)))
    outcomes: dict[tuple[str, int], dict] = {}
    msv: dict[int, dict] = {}
    base: dict[int, dict] = {}
    pending: dict[Future, tuple[str, int]] = {}

    def submit(name: str, s: int, fn, *args) -> None:
        if (name, s) not in done:
            pending[pool.submit(fn, *args)] = (name, s)

    def finished(name: str, s: int, result: dict) -> None:
        if name == "msv":
            msv[s] = result
            for c in conds:
                if c.msv:
                    submit(c.name, s, _condition_job, c.name, s, result)
        elif name == "base":
            base[s] = result
        else:
            outcomes[(name, s)] = result
        bar.update(task, advance=1, description=f"replay {name} seed {s}")

    for s in seeds:  # short jobs first: MSV unblocks the +msv conditions
        if need_msv:
            submit("msv", s, _msv_job, s, [c.name for c in conds if c.msv])
        submit("base", s, _base_job, s)
    for c in conds:
        for s in seeds:
            if not c.msv:
                submit(c.name, s, _condition_job, c.name, s, None)
    for (name, s), result in sorted(done.items(), key=lambda kv: kv[0][0] != "msv"):  # MSV first: it releases
        finished(name, s, result)
    try:
        while pending:
            if isinstance(pool, _InProcess):
                ready = pool.run_next(pending)
            else:
                ready, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            for f in sorted(ready, key=lambda f: pending[f]):
                name, s = pending.pop(f)
                result = f.result()
                if record is not None:
                    record(name, s, result)
                finished(name, s, result)
    except BaseException:  # fail fast: do not let the pool finish the queued jobs first
        if isinstance(pool, _InProcess):
            for f in pending:
                f.cancel()
        # a fork pool's workers are killed by worker_pool, which fails its queued jobs; cancelled
        # here, they made the pool's own thread raise InvalidStateError (a traceback after the error)
        raise
    return outcomes, msv, base


def _study(bank: Bank, settings: ReplaySettings, judge_name: str, served: bool = False) -> dict:
    """What a job's result depends on besides its condition and seed (and that seed's MSV labels,
    themselves a job): a journal of another bank, settings, judge or software is not this study's, nor
    one whose feedback solvers searched otherwise (`served`: through a /retrieve server, whose address
    may change between a stop and a rerun, as engine-run's may)."""
    study = {"format": FORMAT, "bank": bank.digest(), "settings": asdict(settings), "judge": judge_name,
             "software": software()}
    return {**study, "retriever": "server"} if served else study  # (a key written before servers stays)


def _journal_key(study: dict) -> str:
    return hashlib.sha256(json.dumps(study, sort_keys=True).encode()).hexdigest()


def _study_changes(was: dict | None, now: dict) -> str:
    """What differs between a journal row's study and this one, in words (a row written before rows
    named their study: the list of what may differ)."""
    if not isinstance(was, dict):
        return "another bank, --updates, --rollouts, --samples, judge or software version"
    said = []
    for part, name in (("format", "journal format"), ("bank", "bank"), ("judge", "judge")):
        if was.get(part) != now[part]:
            said.append(f"{name} {was.get(part)} → {now[part]}")
    settings = was.get("settings") if isinstance(was.get("settings"), dict) else {}
    said += [f"--{k} {settings.get(k)} → {v}" for k, v in now["settings"].items() if settings.get(k) != v]
    if was.get("retriever") != now.get("retriever"):
        said.append("searched " + " → ".join("through a /retrieve server" if s.get("retriever") else "in process"
                                             for s in (was, now)))
    if isinstance(was.get("software"), dict):
        said += software_changes(was["software"], now["software"])
    return "; ".join(said) or "its key"


def _read_journal(path: Path, study: dict, item_ids: Sequence[str] = (),
                  items_kept: bool = False) -> dict[tuple[str, int], dict]:
    """The finished jobs of this study in `path` (a torn last line, a kill's, is cut off). `item_ids`: the
    bank's, every one of which an MSV row labels; `items_kept`: a judge other than the oracle, whose
    jobs keep every judged item (`compare_on_common_items`)."""
    key = _journal_key(study)
    try:
        rows = read_jsonl_log(path, repair=True)
    except ValueError as e:
        raise ReplayError(str(e)) from None
    done = {}
    for i, row in enumerate(rows, 1):
        if not (isinstance(row.get("job"), str) and isinstance(row.get("seed"), int)
                and isinstance(row.get("result"), dict)):
            raise ReplayError(f"{path}:{i}: not a replay job (job, seed, result)")
        if row.get("study") != key:
            raise OtherStudyJournal(f"{path}: holds the finished jobs of another study "
                              f"({_study_changes(row.get('of'), study)}); remove it to start afresh, or choose "
                              "another --out")
        if (wrong := _journal_result_problem(row["job"], row["result"], item_ids, items_kept)) is not None:
            # else a KeyError, or an InvariantError blaming the replay, far from the line
            raise ReplayError(f"{path}:{i}: job {row['job']!r} seed {row['seed']}: {wrong}; remove the line to run "
                              "that job again")
        done[(row["job"], row["seed"])] = row["result"]
    return done


def _journal_result_problem(job: str, result: dict, item_ids: Sequence[str] = (),
                            items_kept: bool = False) -> str | None:
    """What is missing from a journal row's result, or of the wrong type (a damaged file), or None."""
    if job == "msv":
        bad = next((k for k, v in result.items() if not (v is None or isinstance(v, str))), None)
        if bad is not None:
            return f"the label of item {bad!r} is neither a string nor null"
        missing = next((i for i in item_ids if i not in result), None)
        return None if missing is None else f"no label (nor null) for item {missing!r}"
    metrics = result.get("metrics")
    if not isinstance(metrics, dict):
        return "no metrics of its own (" + ", ".join(REPORTED) + ")"

    def rate(v) -> bool:  # (NaN fails both comparisons; a bool is no rate, nor an infinity)
        return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1)

    bad = next((m for m in REPORTED if not rate(metrics.get(m))), None)
    if bad is not None:
        return f"field metrics.{bad} is not what a job writes (a rate from 0 to 1, or null)"

    def counts(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def per_solver(v) -> bool:
        return isinstance(v, dict) and all(counts(n) for n in v.values())

    need = {"graded": lambda v: isinstance(v, str), "n_graded": counts, "matcher": lambda v: isinstance(v, str)}
    if job != "base":
        need |= {"updates": per_solver, "train_items": per_solver}
        if job in CONDITIONS and CONDITIONS[job].split == "connected":
            need["fallback_graded"] = counts
    if items_kept:  # each judged item, as `_item_code` writes it
        need["items"] = lambda v: (isinstance(v, list) and len(v) == len(item_ids)
                                   and all(isinstance(c, str) and _ITEM_CODE.fullmatch(c) for c in v))
    wrong = next((k for k, ok in need.items() if k not in result or not ok(result[k])), None)
    if wrong is None:
        return None
    return f"no field {wrong}" if wrong not in result else f"field {wrong} is not what a job writes"



def check_seed_count(n: int) -> None:
    """A study's number of seeds (`--seeds`): at least one, and at most MAX_SEEDS (10**14 exhausted memory
    listing them); the command checks it before the bank is read or a judge set up."""
    if n < 1:
        raise ReplayError(f"--seeds: must be >= 1, got {n}")
    if n > MAX_SEEDS:
        raise ReplayError(f"--seeds: must be at most {MAX_SEEDS:,}, got {n:,}")


def run_replay(bank: Bank, conditions: Iterable[str] | str | None = None, seeds: int | Sequence[int] = 5,
               settings: ReplaySettings | None = None, workers: int = 1, progress: bool = False,
               judge=None, journal: str | os.PathLike | None = None, log=None,
               retriever_url: str | None = None) -> dict:
    """Every (condition, seed) job, checked against the invariants, summarised over seeds.

    Results are identical for any `workers`: each job is a pure function of the bank, the
    condition, the seed and that seed's MSV labels (computed once per seed, before its +msv jobs).
    `judge` (any `selfevo.audit.Judge`, e.g. an LLMJudge) grades instead of the world's oracle; a
    bank of runs on a real corpus needs one. A language-model bank, or a judge given here, runs
    every job in this process (one model on one device; the judge's client lives here), whatever
    `workers` says.

    `journal` (a JSONL file, append-only) keeps every finished job: a study stopped part way and run
    again with the same bank, settings and judge reruns only the jobs it lacks (a job is hours of
    training on a language-model bank), and a study asked for more conditions or seeds runs only
    those. Its results are the same bytes as those of a study never stopped (of the same conditions and
    seeds: with a judge that resolves by the answers, every job's metrics are over the items all of
    them resolved, `compare_on_common_items`). `log` gets one line
    saying how many jobs the journal held.

    `retriever_url`: the feedback solvers search through this /retrieve server (a bank of runs on a corpus:
    those of `engine-run` with `engine.retriever_url`, say), the corpus's documents read from its store
    (`evolve.served_environment`), instead of the bank's `[data] index` or a BM25 index built here; a
    journal of a study that searched otherwise is not this one's.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from selfevo._bar import Progress

    settings = settings or ReplaySettings()
    conds = parse_conditions(conditions)
    check_seed_count(seeds if isinstance(seeds, int) else len(seeds))  # before a list of 10**14 is made
    seeds = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    dup = next((s for s in seeds if seeds.count(s) > 1), None)
    if dup is not None:  # one seed's jobs are one result: counted twice, it would pass for two seeds that agree
        raise ReplayError(f"--seeds: seed {dup!r} is named twice; name each seed once")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ReplayError(f"--workers: must be a positive integer, got {workers!r}")
    workers = min(workers, len(_jobs(conds, seeds)))  # never more processes than jobs: the rest would sit idle
    if workers == 1 or bank.backend == "lm" or judge is not None:
        executor = _InProcess(bank, settings, judge, retriever_url)
    else:  # the grid's pool: its workers die with this process (SIGTERM, Ctrl-C, kill -9)
        executor = worker_pool(workers, _init_worker, (bank.to_json(), settings, retriever_url))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with executor as pool:
        judge_name = _ctx().judge.name if isinstance(pool, _InProcess) else OracleJudge.name
        done, record = {}, None
        if journal is not None:
            study = _study(bank, settings, judge_name, served=bool(retriever_url))
            key = _journal_key(study)
            # only this study's jobs: the journal may hold more seeds or conditions than it asks for
            jobs = _jobs(conds, seeds)
            done = {k: v for k, v in _read_journal(Path(journal), study, [it.item_id for it in bank.items],
                                                   items_kept=judge_name != OracleJudge.name).items()
                    if k in jobs}
            if done and log is not None:
                log(f"{journal}: {len(done)} finished job(s) of this study, not run again")

            def record(job: str, seed: int, result: dict) -> None:
                # `of`: what the key is made of, so a study that differs can be told in what
                append_jsonl(journal, [{"study": key, "of": study, "job": job, "seed": seed, "result": result}])
        preflight = ([c.name for c in conds], seeds, {s: r for (job, s), r in done.items() if job == "msv"})
        if not isinstance(pool, _InProcess):  # a fork pool starts every worker now, before the bar's thread
            pool.submit(_preflight, *preflight).result()
        else:
            _preflight(*preflight)
        with Progress(*columns, disable=not progress, transient=True) as bar:
            outcomes, msv, base = _run_jobs(pool, conds, seeds, bar, done, record)
    invariants = check_invariants(outcomes, bank, settings)
    ref = base[seeds[0]]["metrics"]  # (the bank's: `compare_on_common_items` gives each job metrics anew)
    compared = compare_on_common_items([*outcomes.values(), *(base[s] for s in seeds)])
    # T_P and coverage of the bank, as the base reference's answers were judged (the oracle resolves by the
    # question alone: the same for every grader; an LLM judge may leave another grader's answers unresolved,
    # so each condition's coverage is its own column, and its other metrics are over the items every job
    # resolved: `compared_items`)
    out = {"format": FORMAT, "settings": asdict(settings), "seeds": seeds,
           "bank": {"items": len(bank.items), "seed": bank.seed, "sources": bank.sources,
                    "source_created": bank.source_created, "backend": bank.backend,
                    "world": bank.world, "corpus": bank.corpus,
                    "T_P": ref["T_P"], "coverage": ref["coverage"], "sha256": bank.digest(),
                    "compared_items": compared},
           "conditions": {}, "reference": {"base": _summary([base[s] for s in seeds])},
           "judge": judge_name, "invariants": invariants, "software": software()}
    for c in conds:
        entry = _summary([outcomes[(c.name, s)] for s in seeds])
        entry["train_items"] = {str(s): outcomes[(c.name, s)]["train_items"] for s in seeds}
        if c.split == "connected":  # items that read pages of both folds: graded by a fold they touched
            entry["fallback_graded"] = {str(s): outcomes[(c.name, s)]["fallback_graded"] for s in seeds}
        if c.msv:
            entry["msv_admitted"] = _mean_std([sum(v is not None for v in msv[s].values()) for s in seeds])
        out["conditions"][c.name] = entry
    return out


@contextlib.contextmanager
def replay_judge(bank: Bank, url: str | None = None, model: str | None = None,
                 cache_path: str | os.PathLike | None = None, concurrency: int = 4, served: bool = False):
    """The judge a replay of `bank` grades with, for its duration: an LLM judge at `url` (any
    OpenAI-compatible endpoint serving `model`); else None (the world's exact-truth oracle); on a
    real corpus, which has no truth, the runs' base model served on 127.0.0.1 as an LLM judge, as
    `selfevo evolve` audits such runs (see `selfevo.evolve.default_judge`). `served`: the replay searches
    through a /retrieve server, so the sources the judge reads come from the corpus's store, no index built."""
    if (url is None) != (model is None):
        raise ReplayError("--judge-url and --judge-model go together")
    if url is None and not bank.corpus:  # a world has exact truth: nothing to load here
        yield None
        return
    cfg = bank.run_config()
    env = _environment(cfg, served=served)  # an LLM judge reads the sources (cached: the replay reuses it)
    if url is not None:
        from selfevo.audit.llm_judge import LLMJudge

        with LLMJudge(url, model, documents=contents_by_id(env.documents), cache_path=cache_path,
                      concurrency=concurrency) as judge:
            judge.check()  # an endpoint that is down or refuses the key: say so now, not after the training
            yield judge
    else:
        from selfevo.evolve import default_judge

        with default_judge(cfg, env, cache_path) as judge:
            yield judge


def _summary(rows: list[dict]) -> dict:
    entry = {m: _mean_std([r["metrics"][m] for r in rows]) for m in REPORTED}
    entry["seeds"] = len(rows)
    entry["per_seed"] = {m: [r["metrics"][m] for r in rows] for m in REPORTED}
    return entry


# ---------------------------------------------------------------- reporting

# the study's table (its own and the report's): (results.json field, title)
TABLE_COLUMNS = (("F", "F"), ("solver_truth", "solver truth"), ("replay_accuracy", "replay accuracy"),
                 ("A", "A"), ("coverage", "coverage"))


def _bank_line(results: dict) -> str:
    """'N items, bank T_P x (coverage c)': T_P is unknown where the judge resolved no item."""
    bank = results["bank"]
    return f"{bank['items']} items, bank T_P {num(bank['T_P'])} (judge coverage {bank['coverage']:.3f})"


BASE_ROW = "base model (untrained, reference)"


def table_rows(results: dict) -> list[tuple[str, dict]]:
    """(name, its mean-and-std entry) per condition, then the untrained base model's where recorded."""
    rows = list(results["conditions"].items())
    if "base" in results.get("reference", {}):
        rows.append((BASE_ROW, results["reference"]["base"]))
    return rows


def results_markdown(results: dict) -> str:
    head = "| condition | " + " | ".join(t for _, t in TABLE_COLUMNS) + " |"
    lines = [head, "|---|" + "---:|" * len(TABLE_COLUMNS)]
    for name, entry in table_rows(results):
        cells = (mean_std_text(entry[k], n=entry["seeds"]) for k, _ in TABLE_COLUMNS)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _seeds_text(results: dict) -> str:
    n = len(results["seeds"])
    return f"{n} seed{'s' if n != 1 else ''}"


def results_table(results: dict):
    from rich.table import Table

    table = Table(title=f"fixed replay bank: {_bank_line(results)}, {_seeds_text(results)} (mean ± std)")
    table.add_column("condition")
    for _, title in TABLE_COLUMNS:
        table.add_column(title, justify="right")
    for name, entry in table_rows(results):
        table.add_row(name, *[mean_std_text(entry[k], n=entry["seeds"]) for k, _ in TABLE_COLUMNS],
                      style="dim" if name == BASE_ROW else None)
    return table


def plot_results(results: dict, path: str | os.PathLike) -> Path:
    """Grouped bars like the paper's Figure 7: F, solver truth and replay accuracy per condition,
    std error bars, MSV variants hatched."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state, Agg canvas
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    conds = results["conditions"]
    bases = list(dict.fromkeys(n.removesuffix("+msv") for n in conds))
    metrics = (("F", "F (false agreement)"), ("solver_truth", "solver truth"),
               ("replay_accuracy", "replay accuracy"))
    fig = Figure(figsize=(4.2 * len(metrics), 3.8), layout="constrained")
    axes = fig.subplots(1, len(metrics))
    width = 0.4
    for ax, (key, title) in zip(axes, metrics):
        for j, (suffix, hatch) in enumerate((("", None), ("+msv", "//"))):
            xs, means, stds, colors = [], [], [], []
            for i, b in enumerate(bases):
                e = conds.get(b + suffix)
                if e is None or e[key]["mean"] is None:
                    continue
                xs.append(i + (j - 0.5) * width)
                means.append(e[key]["mean"])
                stds.append(e[key]["std"] or 0)  # one seed: no spread to draw
                colors.append(f"C{i}")
            if xs:
                ax.bar(xs, means, width, yerr=stds, color=colors, hatch=hatch, edgecolor="black",
                       linewidth=0.5, capsize=2)
        base = results.get("reference", {}).get("base", {}).get(key, {}).get("mean")
        if base is not None:  # the floor: what the untrained base model already agrees on
            ax.axhline(base, color="gray", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(bases)), bases, rotation=40, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    handles = [Patch(facecolor="lightgray", edgecolor="black", label="without MSV"),
               Patch(facecolor="lightgray", edgecolor="black", hatch="//", label="with MSV (+msv)"),
               Line2D([], [], color="gray", linestyle="--", label="untrained base model")]
    axes[0].legend(handles=handles, fontsize=7)
    fig.suptitle(f"Fixed replay bank ({results['bank']['items']} items, {_seeds_text(results)})",
                 fontsize=11)
    with atomic_writer(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=130)
    return Path(path)


# what `replay run` writes in its --out (the journal, the results, the judge's default cache)
REPLAY_FILES = ("jobs.jsonl", "results.json", "results.md", "replay.png", "judge-cache.jsonl")


def write_results(results: dict, out: str | os.PathLike) -> Path:
    """DIR/results.json, DIR/results.md (the table) and DIR/replay.png."""
    out = Path(out)
    write_json(out / "results.json", results)
    with atomic_writer(out / "results.md") as fh:
        fh.write(f"# Fixed replay bank\n\n{_bank_line(results)}, judge {results.get('judge', 'oracle')}, "
                 f"seeds {results['seeds']}, mean ± std over seeds.\n\n")
        fh.write(results_markdown(results) + "\n")
    plot_results(results, out / "replay.png")
    return out
