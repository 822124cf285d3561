"""`selfevo evolve`: build the world, the search tool, the agents and the treatment's rules from
one resolved config, run the loop into a run directory, then audit it with the oracle judge.

This is the one place that holds both the world's truth (for the audit and the evaluation's gold
answers) and the agents; it hands the agents only documents, questions and the search tool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from selfevo._io import cache_root, file_sha256, write_json
from selfevo._plugins import ContractError, load, qualified_name, recorded_name
from selfevo.agents.sim import Reader, SimProposer, SimSolver
from selfevo.audit import OracleJudge, audit_run
from selfevo.config import ConfigError, RunConfig, WorldSpec, config_from_dict
from selfevo.corpus import DataError, qa_sha256, read_qa_dir
from selfevo.evaluate import PartialFileError, evaluate_solver
from selfevo.loop import treatments
from selfevo.loop.admission import MSV, AdmitAll
from selfevo.loop.engine import BadStepState, Loop
from selfevo.loop.feedback import AuxFeedback, CoupledFeedback
from selfevo.loop.folds import FoldAssignment, assign_folds, fold_of
from selfevo.loop.schedule import derive_seed
from selfevo.loop.treatments import feedback_options, parse_treatment
from selfevo.runs import RunDir, RunError
from selfevo.search.bm25 import BM25Index
from selfevo.search.docstore import contents_by_id, corpus_store, hashed
from selfevo.search.index import index_identity
from selfevo.search.tool import Retriever, SearchTool
from selfevo.world import World, resolve_world, world_fingerprint
from selfevo.world.generate import SIZES


def load_run_world(cfg: RunConfig) -> World:
    return world_and_index(cfg)[0]


# A process that runs many jobs on the same world (a grid, the demo) generates and indexes it once.
# A generated world is a pure function of its spec; a world directory is keyed by its files' bytes
# too, so one rewritten in the meantime is read again, never served stale.
_WORLDS: dict[tuple[str, str | None], tuple[World, BM25Index]] = {}


def world_and_index(cfg: RunConfig) -> tuple[World, BM25Index]:
    key = (repr(cfg.world), world_sha256(cfg))
    if key not in _WORLDS:
        params = cfg.world.params() if cfg.world.name in SIZES else {}
        world = resolve_world(cfg.world.name, **params)
        if len(_WORLDS) >= 4:
            _WORLDS.pop(next(iter(_WORLDS)))
        _WORLDS[key] = (world, BM25Index.build(world.documents))
    return _WORLDS[key]


# a treatment of a user's (`loop.treatments.USER_TREATMENTS`): `rules(cfg, sources, folds, make_solver) ->
# (admission, feedback)`, the arguments as `make_rules` gets them (docs/extending.md)
Rules = Callable[[RunConfig, list, FoldAssignment, Callable[[str], Any]], tuple[Any, Any]]


def user_rules(cfg: RunConfig) -> Rules | None:
    """The function that makes a user's treatment's rules (None: a treatment of selfevo's). `cfg` was parsed:
    a name of none of selfevo's is a user's, whose package `treatments.user_rules` finds, or says is gone."""
    if parse_treatment(cfg.treatment, recorded=True).feedback != "user":
        return None
    try:
        return treatments.user_rules(cfg.treatment)
    except ValueError as e:  # not installed, its import failed, no function
        raise ConfigError(str(e)) from None


def make_rules(cfg: RunConfig, sources, folds: FoldAssignment, make_solver):
    """The treatment: an admission rule and a feedback rule for the one loop (`sources`: the
    proposer's source pool, the documents MSV shows its with-source samples)."""
    if (rules := user_rules(cfg)) is not None:
        made = rules(cfg, sources, folds, make_solver)
        if not (isinstance(made, tuple) and len(made) == 2):
            raise ContractError(f"treatment {cfg.treatment!r} ({qualified_name(rules)}): returns (admission, "
                                f"feedback), got {type(made).__name__}")
        return made
    t = parse_treatment(cfg.treatment)
    admission = MSV({d.id: d for d in sources}, samples=cfg.loop.msv_samples) if t.msv else AdmitAll()
    options = feedback_options(t)  # the one treatment -> aux-solver options mapping
    if options is None:
        return admission, CoupledFeedback(folds)
    return admission, AuxFeedback(t.name, folds, make_solver, cfg.loop.solver_steps, cfg.loop.grader_samples,
                                  **dataclasses.asdict(options))


def fold_assignment(cfg: RunConfig, documents, pool=None) -> FoldAssignment:
    """The run's permanent folds. With `pool` (a corpus run's source pool) and source-level folds, the
    pool's folds are written out and every other page hashes alike (`FoldAssignment.of`), so a
    21M-passage corpus is not walked; link-graph clusters (`connected`) need the whole corpus."""
    t = parse_treatment(cfg.treatment)
    if pool is not None and t.grouping == "source":
        return FoldAssignment(t.k, cfg.seed, "source", {d.id: fold_of(d.id, cfg.seed, t.k) for d in pool})
    return assign_folds(documents, cfg.seed, t.k, t.grouping)


def check_folds(cfg: RunConfig, folds: FoldAssignment, pool) -> None:
    """Every fold of a source-level split holds a document of the proposer's source `pool`: an empty
    fold's auxiliary solver never trains, and it would grade the other folds' questions untrained
    (the base model) with no word. Link-graph clusters can leave folds empty with K far below the
    pool's size (config_from_dict checks only that)."""
    options = feedback_options(parse_treatment(cfg.treatment))
    if options is None or options.trains == "everything" or options.split == "question":
        return  # no aux solver per source fold (coupled, full-data) or folds of questions, not sources
    used = {folds.of(d.id) for d in pool}
    if len(used) < folds.k:
        # K may be huge (loop.source_docs = 0 leaves it unbounded by the config): name the first few
        # empty folds and their count, never build range(K) or an error line of megabytes
        n_empty = folds.k - len(used)
        first = list(itertools.islice((j for j in range(folds.k) if j not in used), 8))
        shown = ", ".join(map(str, first)) + (f", … ({n_empty} in all)" if n_empty > len(first) else "")
        raise ConfigError(f"treatment: {cfg.treatment!r} leaves fold(s) {shown} of {folds.k} "
                          f"without any of the proposer's {len(pool)} source documents (loop.source_docs; "
                          f"grouping {folds.grouping}): their auxiliary solvers would never train, and grade "
                          "untrained; use fewer folds or more source documents")


def source_pool(cfg: RunConfig, documents) -> list:
    """The proposer's seed documents: a fixed, seeded sample of the corpus (or all of it)."""
    n = cfg.loop.source_docs
    if n == 0 or n >= len(documents):
        return list(documents)
    rng = random.Random(derive_seed(cfg.seed, "source-pool"))
    return sorted(rng.sample(documents, n), key=lambda d: d.id)  # any sequence: a corpus is never copied


@dataclass
class Environment:
    """What a run works on: documents and their index, the benchmarks it is evaluated on, and
    exact truth where there is one (the synthetic world; None for a real corpus)."""

    documents: list
    index: object
    benchmarks: dict
    world: World | None = None

    @property
    def truth(self):
        return None if self.world is None else self.world.truth


_CORPORA: dict[tuple, Retriever] = {}


def searched_through_a_server(cfg: RunConfig, manifest: Mapping) -> bool:
    """Did the run (its config and manifest) search its corpus through a /retrieve server, with no index of
    it here (engine-run's `retriever_url`; its manifest records no index)? What reads such a run's documents
    reads them as the run did (`served_environment`), and builds no index."""
    return bool(cfg.data.corpus) and not cfg.data.index and manifest.get("index", False) is None


def served_environment(cfg: RunConfig, benchmarks: bool = True, progress: bool = True) -> Environment:
    """A corpus searched through a /retrieve server (no index here): its documents (the proposer's sources,
    the judge's evidence) read by id from a copy on disk made once a corpus file (`corpus_store`, in
    selfevo's cache), as a saved index's are; and its benchmarks (`benchmarks=False`: none). `progress`: a
    bar while the copy is made."""
    root = cache_root() / "corpora"
    try:
        docs = corpus_store(cfg.data.corpus, root, progress=progress)
    except OSError as e:  # the store's directory: not writable, or no room for the copy
        raise ConfigError(f"{root}: cannot write the store of {cfg.data.corpus}'s documents ({e.strerror or e}); "
                          "set SELFEVO_CACHE_DIR to a writable directory with room for a copy of the corpus") from None
    return Environment(docs, None, read_qa_dir(cfg.data.qa_dir) if benchmarks else {})


def _file_key(path: str) -> tuple:
    """A corpus file as a cache key: its path and what a rewrite changes (size, mtime, inode), so a file
    rewritten while a process runs is read again, never served stale (hashing wiki-18 would take minutes)."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError:  # missing: _corpus_index names it
        return (str(p),)
    return (str(p), st.st_size, st.st_mtime_ns, st.st_ino)


def environment(cfg: RunConfig, benchmarks: bool = True) -> Environment:
    """The synthetic world, or (data.corpus) a real corpus and QA directory (`benchmarks=False`:
    the documents and their index only, for work that evaluates nothing, like the replay)."""
    if not cfg.data.corpus:
        world, index = world_and_index(cfg)
        return Environment(list(world.documents), index, world.benchmarks, world)
    key = (_file_key(cfg.data.corpus), cfg.data.index)
    if key not in _CORPORA:
        _CORPORA.clear()  # a real corpus is large: keep one
        _CORPORA[key] = _corpus_index(cfg.data.corpus, cfg.data.index)
    index = _CORPORA[key]
    return Environment(index.docs, index, read_qa_dir(cfg.data.qa_dir) if benchmarks else {})


def _corpus_index(corpus: str, index_dir: str):
    """What a corpus run searches: the saved index `index_dir` (any kind; refused unless it was built
    from this very corpus file), whose documents are read from disk on demand, else a BM25 index of
    the corpus built in memory."""
    if not Path(corpus).is_file():
        raise DataError(corpus, None, "not a file" if Path(corpus).exists() else "file not found")
    if not index_dir:  # (named by the file's sha256, as a saved index is: was its documents' serialisation's)
        return BM25Index.from_corpus_file(corpus)
    from selfevo.search.index import open_index

    try:
        return open_index(index_dir, expected_corpus_sha256=file_sha256(corpus))
    except ValueError as e:  # not an index, another corpus's, another format
        raise ConfigError(f"data.index: {e}") from None


# `evolve(agents=...)`: a user's learners in the loop, `agents(cfg, sources) -> (proposer, make_solver)`
# (sources: the proposer's source documents; make_solver(name): a fresh trainable solver, the main one and
# every auxiliary one); the treatment's admission and feedback rules are its own (`make_rules`)
Agents = Callable[[RunConfig, list], tuple[Any, Callable[[str], Any]]]


# where an installed package of a user's names its learners (its pyproject.toml:
# [project.entry-points."selfevo.learners"] NAME = "module:function"), for `selfevo evolve --learners NAME`
LEARNERS = "selfevo.learners"


def agents_name(agents: Agents | None) -> str | None:
    """How a run records the user's learners it was made with (None: selfevo's own, `cfg.backend`)."""
    return None if agents is None else recorded_name(agents, "learners:", "(cfg, sources) -> (proposer, make_solver)")


def load_learners(name: str) -> Agents:
    """The learners an installed package names `name` under the `selfevo.learners` entry points."""
    agents = load(LEARNERS, name, "learners")
    try:
        agents_name(agents)
    except ValueError as e:
        raise ValueError(f"learners '{name}'{str(e).removeprefix('learners')}") from None
    return agents


def user_pieces(cfg: RunConfig, agents: Agents | None = None) -> tuple[Agents | None, str | None, str | None]:
    """A run's learners of a user's (`agents`, or the config's `learners`), and how the manifest records them
    and a user's treatment's rules (None: selfevo's own)."""
    if cfg.learners:
        if agents is not None:
            raise ConfigError(f"learners: {cfg.learners!r} in the config, and evolve(agents=...) given; one of them")
        try:
            agents = load_learners(cfg.learners)
        except ValueError as e:  # not installed, its import failed, no function
            raise ConfigError(f"learners: {str(e).removeprefix('learners ')}") from None
    rules = user_rules(cfg)
    # refused now (a partial, a wrapper), not once the run is made, where no name can record them
    return agents, agents_name(agents), None if rules is None else qualified_name(rules)


def check_made_by(run: RunDir, cfg: RunConfig, learners_name: str | None, rules_name: str | None) -> None:
    """A run goes on (or counts as this config's, finished) only with the functions it was made by: a name an
    entry point now points elsewhere is refused. Another config's learners or treatment: the config check
    names the field."""
    made, manifest = run.config(), run.manifest()
    if made["learners"] == cfg.learners and (made_with := manifest.get("agents")) != learners_name:
        raise RunError(f"{run.path}: made with the learners {made_with or cfg.backend!r}, resumed with "
                       f"{learners_name or cfg.backend!r}; a run goes on with the learners it began with")
    if made["treatment"] == cfg.treatment and (made_by := manifest.get("rules")) != rules_name:
        raise RunError(f"{run.path}: treatment {cfg.treatment!r} was made by {made_by}, and is now made by "
                       f"{rules_name}; a run goes on with the rules it began with")


def build_loop(cfg: RunConfig, env: Environment, tool: SearchTool, folds: FoldAssignment, evaluate=None,
               store: Path | None = None, agents: Agents | None = None) -> Loop:
    """The loop of `cfg.backend` (`store`: where an lm backend keeps its checkpointed tensors), or of the
    user's learners `agents` makes."""
    pool = source_pool(cfg, env.documents)
    if agents is not None:
        made = agents(cfg, pool)
        if not (isinstance(made, tuple) and len(made) == 2 and callable(made[1])):
            raise ContractError(f"learners {agents_name(agents)}: return (proposer, make_solver), make_solver(name) "
                                f"a fresh trainable solver; got {type(made).__name__}")
        proposer, make_user_solver = made
        admission, feedback = make_rules(cfg, pool, folds, make_user_solver)
        return Loop(cfg.loop, cfg.seed, proposer, make_user_solver("main"), admission, feedback, tool, folds,
                    evaluate=evaluate)
    if cfg.backend == "lm":
        from selfevo.agents.lm.agents import LMProposer, LMSolver
        from selfevo.agents.lm.policy import LMPolicy

        try:
            policy = LMPolicy(cfg.lm, store=store, seed=cfg.seed)
        except ValueError as e:  # e.g. lm.device: cuda on a machine without one; a model with no chat template
            raise ConfigError(str(e)) from None

        def make_lm_solver(name: str) -> LMSolver:  # every solver starts as the same base model
            return LMSolver.trainable(policy, name)

        admission, feedback = make_rules(cfg, pool, folds, make_lm_solver)
        return Loop(cfg.loop, cfg.seed, LMProposer(policy, "proposer", pool), make_lm_solver("main"),
                    admission, feedback, tool, folds, evaluate=evaluate)
    world = env.world
    shared = world.config.shared_misreading
    solver_reader = Reader("solver", cfg.solver.misread_scale, shared, cfg.seed)
    proposer_reader = Reader("proposer", cfg.proposer.misread_scale, shared, cfg.seed)

    def make_solver(name: str) -> SimSolver:  # every solver starts as the same base model
        return SimSolver(name, cfg.solver, solver_reader)

    main = make_solver("main")
    proposer = SimProposer("proposer", cfg.proposer, proposer_reader, pool)
    admission, feedback = make_rules(cfg, pool, folds, make_solver)
    return Loop(cfg.loop, cfg.seed, proposer, main, admission, feedback, tool, folds, evaluate=evaluate)


def world_sha256(cfg: RunConfig) -> str | None:
    """The fingerprint of the world directory a run is made on (None: a generated world, which is
    a pure function of its spec, or a real corpus)."""
    if cfg.data.corpus or cfg.world.name in SIZES:
        return None
    return world_fingerprint(cfg.world.name)


def check_world_params(cfg: RunConfig, world: World | None) -> None:
    """A world directory's parameters were fixed when it was made (its world.json); a run config that
    asks for other values would be recorded in config.json but not used. Refuse it, naming the field."""
    if world is None or cfg.data.corpus or cfg.world.name in SIZES:
        return
    default = WorldSpec()
    for name in ("seed", "confusable_rate", "shared_misreading", "value_skew"):
        asked, made = getattr(cfg.world, name), getattr(world.config, name)
        if asked != getattr(default, name) and asked != made:
            raise ConfigError(f"world.{name}: {asked} asked, but the world directory {cfg.world.name} was made "
                              f"with {made} (its world.json fixes it); make a world with "
                              f"`selfevo world make --{name.replace('_', '-')} {asked}`")


def _corpus_made_on(cfg: RunConfig, index) -> dict:
    """What a corpus run is made on: the corpus's sha256 (as its index took it when it was indexed;
    the file's bytes where the run searches through a /retrieve server and has no index here) and
    what searches it (the index kind and encoder; None without an index here)."""
    if index is None:
        return {"corpus_sha256": file_sha256(cfg.data.corpus), "index": None}
    return {"corpus_sha256": index.corpus_sha256, "index": index_identity(index)}


def note_made_on(run: RunDir, cfg: RunConfig, index, world: World | None = None) -> None:
    """Note in the manifest what the run is made on (`check_world` holds a resume, audit or replay to
    it), where it does not say yet and no round is done: a run with rounds done keeps what it has (one
    made before these fields existed has none), and a resume before any round is done notes what a kill
    after the run's creation left out. A world directory's own parameters (`world`: its world.json) go
    with its sha256: config.json's [world] values are the defaults wherever the command left them."""
    made = run.manifest()
    if made.get("rounds_completed"):
        return
    if (sha := world_sha256(cfg)) is not None and "world_sha256" not in made:
        run.note(world_sha256=sha, **({"world_params": asdict(world.config)} if world is not None else {}))
    if cfg.data.corpus and "corpus_sha256" not in made:
        run.note(**_corpus_made_on(cfg, index))
    if cfg.data.qa_dir and "qa_sha256" not in made:
        run.note(qa_sha256=qa_sha256(cfg.data.qa_dir))


def check_made_on(saved: Mapping, cfg: RunConfig, index, since: str, remedy: str) -> dict | None:
    """The world directory and corpus `cfg` names now against the sha256 `saved` recorded (a run's
    manifest, a replay bank's `made_on`): one remade or rewritten since is refused (RunError), saying
    since when (`since`: "run was made on it") and what to do (`remedy`, formatted with `what`: world,
    corpus). `index`: the corpus's index as opened now (None: searched through a server; False: opened
    here). Returns what the corpus is made on now (`_corpus_made_on`), None without a recorded corpus."""
    world = saved.get("world_sha256")
    if world is not None and world != world_sha256(cfg):
        raise RunError(f"{cfg.world.name}: the world directory has changed since {since} (its files no longer "
                       f"match the sha256 recorded); {remedy.format(what='world')}")
    corpus = saved.get("corpus_sha256")
    if corpus is None or not cfg.data.corpus:
        return None
    try:
        if index is False:
            index = environment(cfg, benchmarks=False).index
        now = _corpus_made_on(cfg, index)
    except (DataError, OSError) as e:
        raise RunError(str(e)) from None
    if corpus != now["corpus_sha256"] and corpus != _serialised_sha256(index):
        raise RunError(f"{cfg.data.corpus}: the corpus has changed since {since} (its documents no longer match "
                       f"the sha256 recorded); {remedy.format(what='corpus')}")
    return now


def _serialised_sha256(index) -> str | None:
    """What a run whose BM25 index was built in memory recorded as its corpus's sha256 before it recorded
    the file's: the hash of the documents' JSONL serialisation (so such a run still resumes)."""
    if not isinstance(index, BM25Index) or not isinstance(index.docs, list):
        return None
    h = hashlib.sha256()
    for _ in hashed(index.docs, h):
        pass
    return h.hexdigest()


def check_world(run: RunDir, cfg: RunConfig, index=False, evaluation: bool = False, held: bool = False) -> None:
    """A run's records are judged against the truth of the world they were made on: a world
    directory rewritten since (say by another `selfevo world make`) is refused, and so is a corpus
    file whose documents have changed since (its sources, the judge's evidence), or its index rebuilt
    in place. `index`: as `check_made_on`'s. `evaluation` (a resume, which evaluates the rounds to
    come): its QA set must be the one its earlier rounds were evaluated on too."""
    manifest = run.manifest()
    if index is False and searched_through_a_server(cfg, manifest):
        index = None  # no index to open or build: the corpus file's own hash is what the run recorded
    saved = manifest.get("qa_sha256")
    if evaluation and saved is not None and cfg.data.qa_dir:
        try:
            now = qa_sha256(cfg.data.qa_dir)
        except OSError as e:
            raise RunError(f"{cfg.data.qa_dir}: {e.strerror}") from None
        if saved != now:
            raise RunError(f"{cfg.data.qa_dir}: the QA files have changed since {run.path} was made (the sha256 "
                           "the run recorded): its rounds to come would be evaluated on other questions than "
                           "those before; resume with the QA set it was made with")
    made = check_made_on(manifest, cfg, index, f"{run.path} was made on it",
                         "the run can only be audited or resumed on the {what} it was made on")
    if held and made is not None and manifest.get("corpus_sha256") != made["corpus_sha256"]:
        # the serialisation's hash, taken as the same documents: the file's from now on, as runs made since
        # record it (else `report` and `replay build` saw other data beside them). `held`: the caller holds
        # the run's lock (a resume, an audit), so the manifest is its to write
        run.note(corpus_sha256=made["corpus_sha256"])
    searched = manifest.get("index")  # runs record it since 2026-12-03
    if made is not None and searched is not None and made["index"] is not None and searched != made["index"]:
        raise RunError(f"{cfg.data.index or cfg.data.corpus}: the index is not the one {run.path} searched "
                       f"({searched} then, {made['index']} now: rebuilt in place?); the run can only be resumed "
                       "with the index it was made with")


def evolve(cfg: RunConfig, out: str | os.PathLike, resume: bool = False, progress: bool = True,
           audit: bool = True, judge=None, step_checkpoints: int | None = None, agents: Agents | None = None) -> RunDir:
    """Run, then audit: with the world's exact truth (OracleJudge), or on a real corpus with
    `judge` (e.g. an LLMJudge; None: `selfevo.evolve.default_judge`, the base model served on
    loopback). The judge only reads the finished records: it never feeds back.
    `step_checkpoints`: a checkpoint within each round every this many steps, which a resume goes
    on from (0: only at round ends; None: every step with language models, whose rounds take hours,
    else 0). It changes no result, so a resume may use another.
    `agents`: learners of the user's in place of `cfg.backend`'s (`Agents`, docs/extending.md); the run
    records them (manifest.json's `agents`), a resume must give the same, and `report` and `replay build`
    keep such runs apart from selfevo's own."""
    started = time.perf_counter()
    if not isinstance(cfg, RunConfig):
        raise TypeError(f"cfg: expected a RunConfig (selfevo.config.load_config), got {type(cfg).__name__}")
    # a RunConfig built or replaced in code skipped the parser's checks (a str seed, an unknown
    # treatment): check it as config.json will be read back, before anything is written (a resume of a user's
    # treatment whose package is gone is told so by `user_pieces`)
    cfg = config_from_dict(cfg.to_json(), recorded=resume and cfg.treatment == RunDir(out).users_treatment())
    if step_checkpoints is None:
        step_checkpoints = 1 if cfg.backend == "lm" else 0
    if not isinstance(step_checkpoints, int) or step_checkpoints < 0:
        raise ValueError(f"step_checkpoints: must be an integer >= 0, got {step_checkpoints!r}")
    # Everything that can fail at start-up (bad data, a model that does not load) happens before
    # a new run directory is written: a failed start leaves nothing to block the corrected retry.
    agents, learners_name, rules_name = user_pieces(cfg, agents)
    env = environment(cfg)
    tool = SearchTool(env.index, topk=cfg.search.topk, max_calls=cfg.search.max_calls)
    run = RunDir(out)
    with run.lock():  # one writer: a second (a rerun beside a live orphan) would interleave its records
        resuming = resume and run.exists()
        kept_folds = None
        if resuming:
            check_made_by(run, cfg, learners_name, rules_name)
            done = run.open_for_resume(cfg.to_json(), defaults=RunConfig().to_json())
            check_world(run, cfg, evaluation=True, held=True)
            kept_folds = saved_folds(run, cfg)
        else:
            check_world_params(cfg, env.world)
            run.check_new()  # now, not after the model load it would waste
            done = 0

        def evaluate(solver, round_: int) -> dict:
            # the base model's, made before a kill (a later round's is redone: its model is retrained)
            if round_ == 0 and (made := run.recorded_evaluation(0)) is not None:
                return made
            # A kill during it (1,325 questions: hours at 4B) keeps the answers given: the resumed run
            # goes on from them where its model is the one that gave them (the base model's is the
            # config's; a trained one's, its state's hash). Timings live in compute.json, so that eval
            # files are byte-identical across reruns.
            model = "base" if round_ == 0 else hashlib.sha256(json.dumps(solver.state_dict()).encode()).hexdigest()
            try:
                # round 0's bar is its own: the base model is evaluated before the loop's bar exists
                # (later rounds show in that bar as "round R evaluation")
                return evaluate_solver(solver, env.benchmarks, tool, progress=progress and round_ == 0,
                                       run_info={"round": round_},
                                       limit=cfg.data.eval_limit or None,
                                       predictions_path=run.eval_predictions_path(round_),
                                       score_path=run.eval_path(round_), per_invocation=False,
                                       partial_key={"round": round_, "model": model},
                                       partial_path=run.eval_partial_path(round_), restart_stale=True,
                                       remove_partial=False)  # removed with the round's checkpoint
            except PartialFileError as e:  # damaged (a line before the last): no kill does that
                raise RunError(str(e)) from None

        folds_path = run.path / "folds.json"
        if kept_folds is not None:  # permanent: a resumed run keeps the assignment it started with
            folds = kept_folds
        else:
            pool = source_pool(cfg, env.documents)
            folds = fold_assignment(cfg, env.documents, pool if cfg.data.corpus else None)
            check_folds(cfg, folds, pool)
        loop = build_loop(cfg, env, tool, folds, evaluate, store=run.tensors_dir, agents=agents)
        loop.step_checkpoints = step_checkpoints
        if not resuming:
            # a user's learners (config.json's [solver]/[proposer]/[lm] are not what ran) and the code behind a
            # user's treatment's name
            run.create(cfg.to_json(), **{k: v for k, v in (("agents", learners_name), ("rules", rules_name)) if v})
        # what the run is made on, noted right after its creation (else its world or corpus would never be
        # checked, and the report would not pool it with its peers)
        note_made_on(run, cfg, env.index, env.world)
        if not folds_path.exists():
            write_json(folds_path, folds.to_json())
        if done:
            _restore(loop, run, done)
        if resuming and done < cfg.loop.rounds:
            # once its checkpoint loaded: a refused resume has not resumed (no warning, nothing noted), nor
            # has a finished loop, which only audits again
            run.check_software()
        if not done:
            loop.evaluate_main(0)  # the base model, before any training (counted in compute.json)
        try:
            loop.run(run, start_round=done + 1, progress=progress, step_state=run.step_state)
        except BadStepState as e:
            raise RunError(f"{run.step_checkpoint_path}: not a step checkpoint this run can load ({e}); remove it "
                           f"to redo round {done + 1} from its start") from None
        del loop  # its models are checkpointed: their memory is free before a judge loads one
        if audit:
            if env.truth is not None:
                audit_run(run, OracleJudge(env.truth))
            elif judge is not None:
                audit_run(run, judge)
            else:
                with default_judge(cfg, env, run.path / "audit" / "cache.jsonl", progress=progress) as j:
                    audit_run(run, j)
        run.finish()  # after the audit: a run killed in it is resumed (rounds done, audit again), not skipped
        run.note(wall_seconds_last_invocation=round(time.perf_counter() - started, 3))
        return run


def saved_folds(run: RunDir, cfg: RunConfig) -> FoldAssignment | None:
    """The fold assignment a run being resumed started with (None: killed before writing it). A value
    no assignment of this config writes (a fold outside 0..k-1 ran on silently, graded by some aux
    solver and training none) is refused, naming the file and field."""
    path = run.path / "folds.json"
    if not path.exists():
        return None
    data = run.folds()  # its fields' types checked, naming the file
    try:
        folds = FoldAssignment.from_json(data)
    except ValueError as e:
        raise RunError(f"{path}: {e}") from None
    t = parse_treatment(cfg.treatment)
    for name, made, want in (("k", folds.k, t.k), ("grouping", folds.grouping, t.grouping),
                             ("seed", folds.seed, cfg.seed)):
        if made != want:
            raise RunError(f"{path}: field {name!r} is {made!r}, but the run's config makes {want!r}")
    return folds


# what Loop.state_dict writes; each is an object
_CHECKPOINT_PARTS = ("proposer", "main", "feedback", "compute")


def _restore(loop: Loop, run: RunDir, round_: int) -> None:
    """Load round `round_`'s checkpoint into `loop`. Written atomically, so a checkpoint that does
    not load was edited or damaged: an error naming the file, not a traceback."""
    path = run.checkpoint_path(round_)
    state = run.load_checkpoint(round_)
    for part in _CHECKPOINT_PARTS:
        if not isinstance(state.get(part), dict):
            what = "is missing" if part not in state else "should be an object"
            raise RunError(f"{path}: field {part!r} {what}")
    try:
        loop.load_state_dict(state)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise RunError(f"{path}: not a checkpoint this run can load ({type(e).__name__}: {e})") from None


@contextlib.contextmanager
def default_judge(cfg: RunConfig, env: Environment, cache_path: str | os.PathLike | None = None,
                  progress: bool = False):
    """A real corpus has no exact truth: the LLM judge (evidence-checked references, see
    audit/llm_judge.py), here over the run's own base model served on loopback for the audit's
    duration (`cache_path`: its call cache). A stronger judge is one flag away: `selfevo audit RUN
    --judge llm --judge-url ...`. `progress`: the judge's bar (where no other is shown)."""
    from selfevo.agents.lm.model import TransformersChatModel
    from selfevo.agents.lm.policy import resolve_device, resolve_model
    from selfevo.agents.lm.server import make_app, running
    from selfevo.audit.llm_judge import LLMJudge

    # on the run's device, in its dtype: a 4B recipe's judge in float32 on the CPU would need ~17 GB
    model = TransformersChatModel(resolve_model(cfg.lm.model), name=cfg.lm.model,
                                  max_new_tokens=cfg.lm.judge_max_tokens, device=resolve_device(cfg.lm.device),
                                  dtype=cfg.lm.dtype, threads=cfg.lm.threads or None)
    docs = contents_by_id(env.documents)  # read on demand: a corpus stays on disk
    with (running(make_app(model)) as url,
          LLMJudge(url, cfg.lm.model, documents=docs, concurrency=1, cache_path=cache_path,
                   max_tokens=cfg.lm.judge_max_tokens, progress=progress) as judge):  # the cap the model keeps
        yield judge
