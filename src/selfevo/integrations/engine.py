"""`selfevo engine-run`: the paper's rounds as engine jobs (TRL or verl), resumable phase by phase.

    r0/eval                      the base model on the benchmarks
    for each round r:
      r{r}/proposer              serve the graders the round allows (main@r-1; CrossFit from round 2:
                                 aux-j@r-1), train the proposer with GRPO; every rollout is a proposal,
                                 graded by its lineage's grader and paid f(k) (rewards.FrontierReward)
      r{r}/admit                 admission over the round's proposals (all | MSV on main@r-1), capped
                                 at the budget; proposer step records -> records/steps.jsonl; the
                                 solver training sets, split by fold for the auxiliary solvers (an
                                 MSV call that fails for good stops the phase: GradingFailed)
      r{r}/main                  train the main solver on every admitted question (solver step records)
      r{r}/aux-j                 train each auxiliary solver on its fold's questions (not after the
                                 last round: nobody would be graded by them)
      r{r}/eval                  the main solver on the benchmarks; round checkpoint
    audit                        the post-hoc audit (oracle on the synthetic world; an LLM judge on a corpus)

Proposal generation happens inside proposer training, as in the loop (`Loop.proposer_step`: the
proposals a step writes are graded, paid and offered for admission); the phase list above is the
issue's (proposer training, proposal generation, admission, main and aux solver training, grader
serving, evaluation) with generation folded into the proposer phase.

Resume: `engine/phases.jsonl` logs every finished phase with its outputs; a rerun with `--resume`
skips them. An unfinished TRL phase with `engine.save_steps` goes on from its newest checkpoint
(`trl_job.resume`: what it staged for the steps before it is kept, the rest cut and made again);
otherwise, and always under verl, it restarts from its start (what it staged is discarded). The step
records a phase commits replace any a killed attempt left. The run directory is `selfevo evolve`'s:
config.json, manifest.json, folds.json, records/steps.jsonl, eval/round-R.json, compute.json,
checkpoints/round-R.json, audit/metrics.json -- plus engine/ (jobs, datasets, staged items, the
phase log) and models/<role>/round-R/ (HF directories).

TRL jobs run in this process (CPU, one GPU) or under `engine.launcher` (e.g. `accelerate launch …`).
verl jobs are shell scripts (`verl_launch.py`) run where verl and GPUs are present; elsewhere the
phase stops with `EngineUnavailable`, naming the script it wrote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util
import json
import math
import os
import shlex
import shutil
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from selfevo import _proc
from selfevo._io import (
    append_jsonl,
    read_json,
    read_jsonl_log,
    remove_leftover_temps,
    shown_url,
    write_json,
    write_jsonl,
)
from selfevo.agents.lm.config import LMConfig
from selfevo.agents.lm.model import model_identity
from selfevo.config import ConfigError, RunConfig, apply_overrides, blame, check_known, config_from_dict, read_toml
from selfevo.integrations.admit import (
    admit_round,
    commit_records,
    merge_step_records,
    msv_filter,
    read_staged,
    trim_staged,
)
from selfevo.integrations.datasets import aux_training_sets, one_pass, proposer_rows, solver_rows, write_verl
from selfevo.integrations.routing import Grader, aux_roles, options_of
from selfevo.integrations.verl_launch import pinned_verl
from selfevo.loop.engine import EVAL_GENERATIONS, Compute
from selfevo.loop.feedback import aux_updates, touched_folds, untrained_grader
from selfevo.loop.schedule import MAX_SAMPLES, LoopConfig, derive_seed
from selfevo.loop.treatments import parse_treatment
from selfevo.runs import RunDir, RunError, check_fields, differences, read_object, with_new_defaults

AUDIT_PHASE = "audit"  # the phase log's last phase (not counted in compute.json)

# [engine] fields that say where and how a run executes, not what it computes: a resumed run may change
# them (another node's GPUs, ports, launcher; how often it checkpoints; whether it audits at the end)
WHERE_NOT_WHAT = frozenset({"grader_gpus", "train_gpus", "grader_port", "grader_gpu_memory", "grader_concurrency",
                            "launcher", "save_steps", "audit"})


def _where_not_what(field: str, before: Any, now: Any) -> bool:
    """May a resumed run change this [engine] field? The retriever may move to another address, but
    not from the run's own index to a server or back."""
    return field in WHERE_NOT_WHAT or (field == "retriever_url" and bool(before) and bool(now))


def computed_setting(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A saved [engine] table less where the run executed and logged: what its numbers depend on besides
    config.json (`report` and `compare` pool and pair engine runs by it). Which server it searched is
    where; whether it searched one (or its own index) is what, as `_where_not_what` has it."""
    from selfevo.integrations.trl_job import TRL_LOGGING
    from selfevo.integrations.verl_launch import FREE_VERL

    out = {k: v for k, v in spec.items() if k not in WHERE_NOT_WHAT}
    out["retriever_url"] = bool(out.get("retriever_url"))
    for table, where in (("verl", FREE_VERL), ("trl", TRL_LOGGING)):  # where a job logs, not what it trains
        if isinstance(out.get(table), dict):
            out[table] = {k: v for k, v in out[table].items() if k not in where}
    return out


class EngineUnavailable(RuntimeError):
    """A phase needs what this machine lacks (verl, GPUs, vLLM)."""


class EngineSpec(BaseModel):
    """The `[engine]` table of an engine-run config."""

    # strict: `save_steps = true` or `grader_port = "8100"` is an error naming the field, not a quiet 1 or 8100
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    engine: Literal["trl", "verl"] = "trl"
    proposer_generations: int = Field(4, ge=2, le=MAX_SAMPLES)  # GRPO group size of the proposer (completions a prompt)
    proposer_prompts: int = Field(0, ge=0)  # prompts a proposer update (0: fill loop.proposals_per_step)
    solver_generations: int = Field(5, ge=2, le=MAX_SAMPLES)  # paper: five responses to each admitted question
    graders: Literal["local", "vllm"] = "local"  # local: transformers servers in this process
    grader_gpus: str = ""  # GPUs of the vllm grader servers, e.g. "6,7" (server i gets the i-th, cycling)
    train_gpus: str = ""  # CUDA_VISIBLE_DEVICES of training jobs run as subprocesses ("": inherited)
    train_processes: int = Field(1, ge=1)  # data-parallel processes of a training job (batches split evenly)
    grader_port: int = Field(8100, ge=1024, le=65535)
    grader_gpu_memory: float = Field(0.4, gt=0, lt=1)
    grader_concurrency: int = Field(8, ge=1)
    retriever_url: str = ""  # a Search-R1 /retrieve server ("": the run's own index, in process)
    msv_samples: int = Field(3, ge=1, le=MAX_SAMPLES)  # paper: 3 with the source, 3 without
    audit: Literal["auto", "none"] = "auto"
    launcher: str = ""  # TRL: "" in process, else e.g. "accelerate launch --config_file FILE"
    rollout_backend: Literal["hf", "vllm"] = "hf"  # TRL rollouts: the training model, or colocated vLLM
    trl: dict[str, Any] = Field(default_factory=dict)  # more GRPOConfig fields
    # TRL: checkpoint a training phase every N steps, and go on from the newest checkpoint when a
    # resumed run finds the phase unfinished (0: no checkpoints; the phase starts over)
    save_steps: int = Field(0, ge=0)
    verl: dict[str, Any] = Field(default_factory=dict)  # more main_ppo overrides (dotted key -> value)
    verl_gpus: int = Field(8, ge=1)
    verl_max_prompt_length: int = Field(1024, ge=1)
    verl_max_response_length: int = Field(2048, ge=1)


@dataclass(frozen=True)
class EngineConfig:
    run: RunConfig
    engine: EngineSpec

    def to_json(self) -> dict:
        return {**self.run.to_json(), "engine": self.engine.model_dump()}


def engine_config_from_dict(data: Mapping, engine: str | None = None) -> EngineConfig:
    data = dict(data)
    # a misspelt table ([engin]) is named against every table the file may hold, [engine] included
    check_known(data, ["engine", *(f.name for f in dataclasses.fields(RunConfig))])
    spec_data = data.pop("engine", None)
    if spec_data is None:
        spec_data = {}
    if not isinstance(spec_data, Mapping):  # e.g. `engine = "trl"` at the top level, or `--set engine=verl`
        raise ConfigError(f"engine: expected a table ([engine]), got {type(spec_data).__name__}; the engine "
                          "itself is engine.engine or --engine")
    spec_data = dict(spec_data)
    if isinstance(spec_data.get("verl"), Mapping):
        # a TOML table's dotted keys (and `--set engine.verl.a.b=...`) nest; verl's overrides are dotted keys
        spec_data["verl"] = _dotted(spec_data["verl"])
    if engine is not None:
        if spec_data.get("engine", engine) != engine:
            raise ConfigError(f"engine.engine: the config says {spec_data['engine']!r}, --engine says {engine!r}")
        spec_data["engine"] = engine
    run = config_from_dict(data)
    if run.backend != "lm":
        raise ConfigError('backend: engine-run trains language models; set backend = "lm"')
    if run.learners:  # its jobs train the language model of [lm]
        raise ConfigError(f"learners: {run.learners!r}: engine-run trains selfevo's language-model learners; "
                          "learners of yours run in `selfevo evolve`")
    if parse_treatment(run.treatment).feedback == "user":  # its jobs route selfevo's own rules only
        raise ConfigError(f"treatment: {run.treatment!r} is a treatment of an installed package's; engine-run runs "
                          "selfevo's own (its rules run in `selfevo evolve`)")
    check_known(spec_data, list(EngineSpec.model_fields), "engine")  # pydantic's own error lists no field
    for k, v in spec_data.items():  # pydantic would say of a NaN "should be less than 1", of no bound at all
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"engine.{k}: must be finite, got {v!r}")
    try:
        spec = EngineSpec(**spec_data)
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(f"engine.{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    if spec.retriever_url and not spec.retriever_url.startswith(("http://", "https://")):
        # else accepted, and the first search (in r0/eval) failed after its retries
        raise ConfigError(f"engine.retriever_url: expected http(s)://HOST:PORT/retrieve, got {spec.retriever_url!r}")
    try:
        shlex.split(spec.launcher)  # else split when the first training phase starts, after r0/eval
    except ValueError as e:
        raise ConfigError(f"engine.launcher: {e} in {spec.launcher!r}") from None
    if spec.launcher and not spec.retriever_url:
        raise ConfigError("engine.retriever_url: a launched TRL job searches through a /retrieve server; set it")
    if spec.engine == "trl" and not spec.launcher and run.lm.device.startswith("cuda:") and run.lm.device != "cuda:0":
        # HF's Trainer, in a single process, trains on cuda:0 (and DataParallel over every visible GPU),
        # whatever device it is asked for; only the visible devices pin it
        raise ConfigError(f"lm.device: {run.lm.device}: TRL training in this process always uses cuda:0; start "
                          f"engine-run with CUDA_VISIBLE_DEVICES={run.lm.device.split(':')[1]} and lm.device = "
                          "\"cuda\", or run training jobs as subprocesses on that GPU (engine.launcher and "
                          "engine.train_gpus)")
    if spec.engine == "trl" and not spec.launcher and spec.train_processes > 1:
        # an in-process job is one process: the first one refused it, after r0/eval, and no resume could mend it
        raise ConfigError(f"engine.train_processes: {spec.train_processes} processes need a launcher "
                          "(engine.launcher, e.g. accelerate launch, and engine.retriever_url); in this process "
                          "TRL trains as 1")
    if run.loop.msv_samples != LoopConfig.msv_samples:  # else ignored: the engine's MSV filter reads its own
        raise ConfigError(f"loop.msv_samples: engine-run samples engine.msv_samples ({spec.msv_samples}); set that "
                          "and leave loop.msv_samples as it is")
    if spec.engine == "trl":
        _check_trl(spec, run)
    if spec.engine == "verl" and run.lm.proposer_scaffold:
        # the scaffold forces a prefix into each of two generations; verl's agent loop generates each
        # action whole (TRL's hf rollout can, engine = "trl" with rollout_backend = "hf")
        raise ConfigError("lm.proposer_scaffold: verl's agent loop cannot force the scaffold's prefixes; set "
                          "lm.proposer_scaffold = false, or use engine = \"trl\" with rollout_backend = \"hf\"")
    if pinned := sorted(k for k in spec.verl if pinned_verl(k)):
        # else it replaced the engine's own (verl_launch.phase_overrides): the group size behind the counted
        # generations, the step count the merge reads, Eq. (1)'s settings, the reward itself
        raise ConfigError(f"engine.verl.{pinned[0]}: set by the engine from the run's config (the method's settings "
                          "and the phase's bookkeeping); remove it from [engine.verl]")
    if spec.engine == "verl" and not spec.retriever_url:
        raise ConfigError("engine.retriever_url: verl's search tool needs a /retrieve server "
                          "(selfevo serve-retriever --corpus ... --port 8000 -> http://127.0.0.1:8000/retrieve)")
    if spec.engine == "verl" and run.lm.adapter != "full":
        # verl's phase is merged into a full model (verl.model_merger); lm.lora_* never reached it
        raise ConfigError("lm.adapter: verl trains and merges full models here (lm.lora_* are not passed to it); "
                          "set lm.adapter = \"full\", as configs/verl-*.yaml do")
    if spec.engine == "verl" and run.lm.max_grad_norm != LMConfig.max_grad_norm:
        raise ConfigError("lm.max_grad_norm: verl clips by its own setting, which this is not passed to; set "
                          "verl's key in [engine.verl] (its actor's grad_clip) and leave lm.max_grad_norm as it is")
    return EngineConfig(run, spec)


def _dotted(table: Mapping, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}, "c.d": 2} -> {"a.b": 1, "c.d": 2}."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        out.update(_dotted(value, name + ".") if isinstance(value, Mapping) else {name: value})
    return out


def _check_trl(spec: EngineSpec, run: RunConfig) -> None:
    """What the first TRL job would otherwise refuse, after r0/eval and as a traceback."""
    from selfevo.integrations.trl_job import PINNED_GRPO, grpo_fields

    pinned = sorted(set(spec.trl) & set(PINNED_GRPO))
    if pinned:
        raise ConfigError(f"engine.trl.{pinned[0]}: {PINNED_GRPO[pinned[0]]}; remove it from [engine.trl]")
    fields = grpo_fields() if spec.trl else None  # importing trl takes seconds: only with keys to check
    unknown = sorted(set(spec.trl) - fields) if fields is not None else []  # no trl here: the job says so
    if unknown:
        near = difflib.get_close_matches(unknown[0], fields, n=1)
        raise ConfigError(f"engine.trl.{unknown[0]}: not a field of TRL's GRPOConfig"
                          + (f" (did you mean {near[0]}?)" if near else ""))
    if spec.rollout_backend == "vllm":
        if not spec.trl.get("use_vllm"):  # TRL builds its vLLM engine only with use_vllm
            raise ConfigError('engine.rollout_backend: "vllm" needs engine.trl.use_vllm = true')
        if run.lm.proposer_scaffold:  # the scaffold's forced prefixes are written with transformers
            raise ConfigError('engine.rollout_backend: "vllm" cannot roll out lm.proposer_scaffold = true; '
                              'use rollout_backend = "hf" or turn the scaffold off')


def load_engine_config(path: str | Path, overrides: list[str] = (), engine: str | None = None) -> EngineConfig:
    """A TOML or YAML file: the run config's tables plus an `[engine]` table; then `--set` overrides
    (read and applied as `config.load_config` does)."""
    path = Path(path)
    data = _read_yaml(path) if path.suffix in (".yaml", ".yml") else read_toml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table at the top level")
    data, overridden = apply_overrides(data, overrides, path=path)
    try:
        return engine_config_from_dict(data, engine)
    except ConfigError as e:
        raise blame(e, path, overridden, ["engine.engine"] if engine else []) from None


def _read_yaml(path: Path):
    """A YAML config file; any reason it cannot be read is one ConfigError naming it (as `read_toml`):
    one line, `FILE: problem (at line L, column C)` as TOML's say it; a key given twice in one mapping is
    refused, as TOML does (YAML's loader kept the last, silently)."""
    import yaml

    class UniqueKeysSafeLoader(yaml.SafeLoader):  # ("Safe": the deserialisation scan's rule)
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: the loader merges it below
                    continue
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, Hashable):  # refused by the loader's own check, named as it names it
                    continue
                if key in seen:
                    raise yaml.MarkedYAMLError(problem=f"duplicate key {key!r}", problem_mark=key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeysSafeLoader) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: invalid UTF-8 at byte {e.start}") from None
    except OSError as e:  # missing, a directory, no permission
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" (at line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{path}: {' '.join(str(e.problem or e).split())}{at}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: {' '.join(str(e).split())}") from None


# ---------------------------------------------------------------- the phase log


class PhaseLog:
    """Append-only: one line per finished phase, with its outputs."""

    def __init__(self, path: Path):
        self.path = path
        self.entries = {e["phase"]: e for e in _checked_phases(path)} if path.exists() else {}

    def get(self, name: str) -> dict | None:
        return self.entries.get(name)

    def add(self, entry: dict) -> None:
        append_jsonl(self.path, [entry])
        self.entries[entry["phase"]] = entry

    def compute(self) -> dict:
        c = Compute()
        for e in self.entries.values():
            if e["phase"] == AUDIT_PHASE:
                # a measurement, not training (`evolve` does not count its audit either): its time, a judge's
                # pass or a cache's seconds, the same in every arm, would move every overhead ratio
                continue
            for table in ("generations", "updates"):
                for key, value in (e.get(table) or {}).items():
                    c.add(table, key, value)
            c.add("seconds", e["phase"].split("/")[-1], e.get("seconds", 0.0))
        return c.to_json()

    def lineage(self, role: str, upto_round: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(folds, rounds) the role trained on up to the end of `upto_round`."""
        folds, rounds = set(), set()
        for e in self.entries.values():
            t = e.get("trained_on")
            if t and t["role"] == role and e["round"] <= upto_round:
                folds |= set(t["folds"])
                rounds |= set(t["rounds"])
        return tuple(sorted(folds)), tuple(sorted(rounds))


def _checked_phases(path: Path) -> list[dict]:
    """The phase log's entries, each with what resume reads of it (a torn last line, a kill's, is cut).
    A line damaged before the last, or an entry without its fields, is no kill's doing: a RunError
    naming file and line, not a traceback (as `RunDir.steps` refuses a damaged step log)."""
    try:
        rows = read_jsonl_log(path, repair=True)
    except ValueError as e:
        raise RunError(f"{e}; refusing to resume over it") from None
    for i, row in enumerate(rows, 1):
        where = f"{path}:{i}"
        check_fields(row, {"phase": str, "round": int}, where)
        check_fields(row, {"generations": dict, "updates": dict, "seconds": (int, float), "trained_on": dict},
                     where, optional=True)
        if "trained_on" in row:
            check_fields(row["trained_on"], {"role": str, "folds": list, "rounds": list}, f"{where}: trained_on")
    return rows


# ---------------------------------------------------------------- the orchestrator


class EngineRun:
    def __init__(self, ecfg: EngineConfig, out: str | os.PathLike, resume: bool = False,
                 log: Callable[[str], None] = print):
        from selfevo.evolve import (
            check_folds,
            check_world,
            environment,
            fold_assignment,
            note_made_on,
            saved_folds,
            served_environment,
            source_pool,
        )

        self.cfg, self.spec, self.say = ecfg.run, ecfg.engine, log
        self.treatment = parse_treatment(self.cfg.treatment)
        if self.spec.graders == "local" or (self.spec.engine == "trl" and not self.spec.launcher):
            # a device this machine lacks fails now, not at the first training job (verl and launched
            # jobs may run where this process is not)
            from selfevo.agents.lm.policy import resolve_device

            try:
                resolve_device(self.cfg.lm.device)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        # bad data fails before anything is written; with a /retrieve server no local index is built (a
        # saved one, data.index, is only opened: its documents stay on disk)
        local = not (self.spec.retriever_url and self.cfg.data.corpus) or self.cfg.data.index
        self.run = RunDir(out)
        engine_json = self.run.path / "engine" / "engine.json"
        if self.run.exists():
            if not resume:
                raise RunError(f"{self.run.path}: a run already exists here; pass --resume to continue it")
            self._check_resume(engine_json)
            if not local:  # a served run's corpus needs no index to be checked: checked before it is copied
                # into its store, so that a corpus rewritten since is refused, not copied first
                check_world(self.run, self.cfg, None, evaluation=True, held=True)
        self.env = environment(self.cfg) if local else served_environment(self.cfg)
        self.pool = source_pool(self.cfg, self.env.documents)
        self.tool = self._tool()
        new_folds = None
        if self.run.exists():
            if local:  # the world or corpus (and index) it was made on, as evolve holds a resume to them
                check_world(self.run, self.cfg, self.env.index, evaluation=True, held=True)
            if self.run.manifest().get("status") != "complete":  # once refusals are past; a finished run,
                self.run.check_software()  # audited again, runs no phase
        else:
            self.run.check_new()
            new_folds = fold_assignment(self.cfg, self.env.documents, self.pool)
            # as evolve refuses it, before anything is written (else round 1 trained, hours at 4B, and round
            # 2 graded by auxiliary solvers that never trained)
            check_folds(self.cfg, new_folds, self.pool)
            # engine.json before the manifest (which makes the run exist): a kill between them leaves
            # no run to resume, but a place a rerun starts afresh
            write_json(engine_json, self.spec.model_dump())
            self.run.create(self.cfg.to_json())
            self.run.note(engine=self.spec.engine)
        note_made_on(self.run, self.cfg, self.env.index, self.env.world)
        # permanent: a resumed run keeps the assignment it started with, checked as evolve checks it
        self.folds = saved_folds(self.run, self.cfg)
        if self.folds is None:  # a new run, or one killed before its folds were written
            self.folds = new_folds or fold_assignment(self.cfg, self.env.documents, self.pool)
            write_json(self.run.path / "folds.json", self.folds.to_json())
        self.phases = PhaseLog(self.run.path / "engine" / "phases.jsonl")
        L = self.cfg.loop
        self.steps_per_round = L.proposer_steps + L.solver_steps

    def _check_resume(self, engine_json: Path) -> None:
        """The saved config and [engine] must match this invocation's; a difference is named by field.
        Not `RunDir.open_for_resume`: that also drops the step records after the last round
        checkpoint, but this run resumes phase by phase -- a finished r/admit or r/main phase of the
        unfinished round has committed its records, and the phase log skips it (`commit_records`
        replaces what a killed phase left)."""
        try:
            saved = self.run.config()  # the checking reader; a field added since reads as its default
            saved_engine = read_object(engine_json)
            self.run.manifest()
            # the step log with its checking reader: a line damaged before the last is refused now, not
            # when a phase commits its records after hours of training (a torn last line is a kill's: kept)
            self.run.steps()
        except RunError as e:
            raise RunError(f"{e}; cannot resume") from None
        now = json.loads(json.dumps(self.cfg.to_json()))  # tuples -> lists, as saved
        spec, defaults = self.spec.model_dump(), EngineSpec().model_dump()
        saved_engine = with_new_defaults(saved_engine, spec, defaults)
        was = {k: saved_engine.get(k, defaults.get(k)) for k in differences(saved_engine, spec)}
        moved = [k for k in was if _where_not_what(k, was[k], spec.get(k))]
        diff = differences(saved, now) + [f"engine.{k}" for k in was if k not in moved]
        if diff:
            raise RunError(f"{self.run.path}: config differs from the saved run (fields: {', '.join(diff)}); "
                           "refusing to resume")
        if moved:  # e.g. a preempted run resumed on another node: engine.json says where it runs now
            self.say("resuming with " + ", ".join(f"engine.{k} {was[k]!r} -> {spec[k]!r}" for k in moved))
            write_json(engine_json, spec)
        remove_leftover_temps(self.run.path, recursive=True)  # a kill inside an atomic write leaves one

    # ------------------------------------------------------------ plumbing
    def _tool(self):
        from selfevo.search.tool import SearchTool

        retriever = self.env.index
        if self.spec.retriever_url:
            from selfevo.search.client import RetrieverClient

            retriever = RetrieverClient(self.spec.retriever_url)
        return SearchTool(retriever, topk=self.cfg.search.topk, max_calls=self.cfg.search.max_calls)

    def base_model(self) -> str:
        from selfevo.agents.lm.policy import resolve_model

        return resolve_model(self.cfg.lm.model)

    def model_dir(self, role: str, round: int) -> str:
        """The role's model after `round` (the latest round it trained in; the base model before)."""
        for r in range(round, 0, -1):
            d = self.run.path / "models" / role / f"round-{r}"
            if (d / "config.json").exists():
                return str(d)
        return self.base_model()

    def round_dir(self, r: int) -> Path:
        d = self.run.path / "engine" / f"round-{r}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def phase(self, name: str, round: int, fn: Callable[[], dict]) -> dict:
        done = self.phases.get(name)
        if done is not None:
            self.say(f"{name}: done, skipped")
            self._drop_checkpoints(done)  # a kill between logging the phase and dropping them
            return done
        self.say(f"{name}: running")
        t = time.perf_counter()
        out = fn()
        entry = {"phase": name, "round": round, **out, "seconds": _seconds(time.perf_counter() - t)}
        self.phases.add(entry)
        write_json(self.run.path / "compute.json", self.phases.compute())
        self._drop_checkpoints(entry)
        return entry

    def _drop_checkpoints(self, entry: dict) -> None:
        """A training phase's checkpoints, once it is logged (`trl_job.trainer_dir` says why not
        sooner): TRL's, and verl's (merged into the model by then; with full fine-tuning it holds the
        weights and the optimizer state, one a phase)."""
        from selfevo.integrations.trl_job import trainer_dir

        model = entry.get("model")
        if model and Path(model).is_relative_to(self.run.path / "models"):  # not the base model's directory
            shutil.rmtree(trainer_dir(model), ignore_errors=True)
            shutil.rmtree(self._verl_ckpt_dir(Path(model).parent.name, entry["round"]), ignore_errors=True)

    def _verl_ckpt_dir(self, role: str, r: int) -> Path:
        return self.run.path / "engine" / f"round-{r}" / f"{role}.verl-ckpt"

    # ------------------------------------------------------------ serving graders
    @contextlib.contextmanager
    def serving(self, models: Mapping[str, tuple[str, str]]) -> Iterator[dict[str, tuple[str, str]]]:
        """role -> (model dir, name)  =>  role -> (OpenAI base URL, served model name), for the block's
        duration. Roles with the same model directory share one server (and its name)."""
        with contextlib.ExitStack() as stack:
            out, by_dir = {}, {}
            for role, (path, name) in sorted(models.items()):
                if path not in by_dir:  # numbered by server, not role: no port skipped, no GPU left idle
                    by_dir[path] = (stack.enter_context(self._serve(path, name, len(by_dir))), name)
                out[role] = by_dir[path]
            yield out

    @contextlib.contextmanager
    def _serve(self, path: str, name: str, i: int) -> Iterator[str]:
        lm = self.cfg.lm
        if self.spec.graders == "local":
            from selfevo.agents.lm.model import TransformersChatModel
            from selfevo.agents.lm.policy import resolve_device
            from selfevo.agents.lm.server import make_app, running

            model = TransformersChatModel(path, name=name, max_new_tokens=lm.max_new_tokens,
                                          device=resolve_device(lm.device), dtype=lm.dtype, threads=lm.threads or None)
            with running(make_app(model, max_n=max(8, self.cfg.loop.grader_samples))) as url:
                yield url
            return
        gpus = [g.strip() for g in self.spec.grader_gpus.split(",") if g.strip()]
        yield from _vllm_server(path, name, self.spec.grader_port + i, gpus[i % len(gpus)] if gpus else "",
                                self.spec.grader_gpu_memory, self.say)

    def graders_for(self, r: int) -> dict[str, tuple[str, str, tuple, tuple]]:
        """role -> (model dir, served name, folds, rounds) of the graders round r allows (the main
        solver in round 1 and under coupled feedback; the auxiliary solvers after that)."""
        aux = aux_roles(self.treatment)
        roles = aux if aux and r > 1 else ["main"]
        out = {}
        for role in roles:
            folds, rounds = self.phases.lineage(role, r - 1)
            out[role] = (self.model_dir(role, r - 1), f"{role}@r{r - 1}", folds, rounds)
        return out

    def remote_options(self) -> dict:
        lm = self.cfg.lm
        return {"max_tokens": lm.max_new_tokens, "max_actions": lm.max_actions,
                "concurrency": self.spec.grader_concurrency, "temperature": lm.temperature, "top_p": lm.top_p}

    # ------------------------------------------------------------ training jobs
    def train(self, name: str, kind: str, role: str, r: int, rows: list[dict], steps: int, prompts_per_step: int,
              generations: int, reward: dict) -> dict:
        from selfevo.agents.lm.policy import resolve_device
        from selfevo.integrations.trl_job import resume, run_job

        out = self.run.path / "models" / role / f"round-{r}"
        # exactly one pass over the rows (datasets.one_pass says why): the engines' samplers and a
        # resume from a checkpoint then agree on every batch
        rows = one_pass(rows, steps * prompts_per_step, derive_seed(self.cfg.seed, "one-pass", r, role))
        if self.spec.engine == "verl":
            return self._train_verl(name, kind, role, r, rows, steps, prompts_per_step, generations, reward, out)
        lm = self.cfg.lm
        d = self.round_dir(r)
        write_jsonl(d / f"{role}.rows.jsonl", rows)
        job = {"kind": kind, "model": self.model_dir(role, r - 1), "out": str(out),
               "rows": str(d / f"{role}.rows.jsonl"),
               "steps": steps, "prompts_per_step": prompts_per_step, "generations": generations, "lr": lm.lr,
               "max_grad_norm": lm.max_grad_norm, "seed": self.cfg.seed, "dtype": lm.dtype,
               "device": resolve_device(lm.device),
               "threads": lm.threads,
               "lora": ({"r": lm.lora_r, "alpha": lm.lora_alpha, "dropout": lm.lora_dropout,
                         "targets": list(lm.lora_targets)} if lm.adapter == "lora" else None),
               "rollout": {"max_actions": lm.max_actions, "max_new_tokens": lm.max_new_tokens,
                           "max_tokens": lm.max_train_tokens, "temperature": lm.temperature, "top_p": lm.top_p,
                           "scaffold": kind == "proposer" and lm.proposer_scaffold, "search": lm.proposer_search,
                           "backend": self.spec.rollout_backend},
               "search": {"retriever_url": self.spec.retriever_url, "topk": self.cfg.search.topk,
                          "max_calls": self.cfg.search.max_calls},
               "reward": reward, "grpo": dict(self.spec.trl), "save_steps": self.spec.save_steps,
               "processes": self.spec.train_processes}
        job = resume(job)  # a phase a kill interrupted goes on from its last checkpoint, or starts over
        if job["start_step"]:
            self.say(f"  {name}: resuming from {job['resume_from']} ({job['start_step']} of {steps} steps done)")
        path = d / f"{role}.job.json"
        write_json(path, job)
        if not self.spec.launcher:
            return run_job(job, tool=self.tool)
        cmd = [*shlex.split(self.spec.launcher), "-m", "selfevo.integrations.trl_job", str(path)]
        self.say("  $ " + " ".join(shlex.quote(c) for c in cmd))
        _proc.run(cmd, env=self._train_env())  # a launcher's workers stop with it (`selfevo._proc`)
        return read_json(path.with_suffix(".result.json"))

    def _train_verl(self, name, kind, role, r, rows, steps, prompts_per_step, generations, reward, out) -> dict:
        from selfevo.integrations.rewards import reward_settings
        from selfevo.integrations.verl_launch import VerlPhase, phase_script, write_reward_shim
        from selfevo.integrations.verl_search import agent_loop_config, tool_config, write_yaml

        lm, d = self.cfg.lm, self.round_dir(r)
        eng = self.run.path / "engine"
        # verl's rewards stage items without their step, so a phase cannot go on from a checkpoint
        # with what it staged cut to match: it starts over (the script also clears verl's checkpoints)
        trim_staged(reward, 0)
        write_yaml(tool_config(self.spec.retriever_url, self.cfg.search.topk, self.cfg.search.max_calls),
                   eng / "verl-tool.yaml")
        # lm.proposer_search = false: the proposer writes at once, as the loop's (one action, no tool);
        # verl ends a trajectory at max_assistant_turns whatever the action
        searching = kind != "proposer" or lm.proposer_searches
        write_yaml(agent_loop_config(), eng / "verl-agent-loop.yaml")
        write_reward_shim(eng / "verl_reward.py")
        data = write_verl(rows, d / f"{role}.parquet")
        settings = ""
        if kind == "proposer":
            settings = str(reward_settings(
                d / "reward-settings.json", treatment=reward["treatment"], round=r, folds=self.folds,
                graders={g["role"]: Grader.from_json(g) for g in reward["graders"]}, items_path=reward["items_path"],
                retriever_url=self.spec.retriever_url, topk=self.cfg.search.topk,
                max_calls=self.cfg.search.max_calls, samples=reward["samples"],
                format_penalty=reward["format_penalty"], seed=reward["seed"], step_base=reward["step_base"],
                remote=reward["remote"]))
        phase = VerlPhase(name=name.replace("/", "-"), model=self.model_dir(role, r - 1), train_files=str(data),
                          out=str(out), ckpt_dir=str(self._verl_ckpt_dir(role, r)), steps=steps,
                          prompts_per_step=prompts_per_step, n=generations, lr=lm.lr,
                          tool_config=str(eng / "verl-tool.yaml") if searching else "",
                          agent_loop_config=str(eng / "verl-agent-loop.yaml"), reward_file=str(eng / "verl_reward.py"),
                          settings=settings, max_prompt_length=self.spec.verl_max_prompt_length,
                          max_response_length=self.spec.verl_max_response_length,
                          max_actions=lm.max_actions if searching else 1,
                          temperature=lm.temperature, top_p=lm.top_p, gpus=self.spec.verl_gpus, extra=self.spec.verl)
        script = phase_script(phase, d / f"{role}.verl.sh",
                              {"CUDA_VISIBLE_DEVICES": self.spec.train_gpus} if self.spec.train_gpus else None)
        missing = verl_missing()
        if missing:
            raise EngineUnavailable(f"{name}: verl training needs {missing}; the launch script is written: {script}")
        self.say(f"  $ bash {script}")
        _proc.run(["bash", str(script)])  # the script sets CUDA_VISIBLE_DEVICES itself; its python stops with it
        return {"steps": steps, "completions": steps * prompts_per_step * generations}

    def _train_env(self) -> dict:
        return {**os.environ, **({"CUDA_VISIBLE_DEVICES": self.spec.train_gpus} if self.spec.train_gpus else {})}

    def per_step(self, n_rows: int, steps: int) -> int:
        """Prompts a step so the steps cover the rows once (the loop's even split), rounded up to a
        multiple of the training processes so every process gets the same share (`train` tops the
        rows up to fill the last batches)."""
        p = self.spec.train_processes
        return math.ceil(_per_step(n_rows, steps) / p) * p

    # ------------------------------------------------------------ the phases
    def run_all(self) -> RunDir:
        started = time.perf_counter()
        R = self.cfg.loop.rounds
        self.phase("r0/eval", 0, lambda: self.evaluate(0))
        for r in range(1, R + 1):
            self.phase(f"r{r}/proposer", r, lambda r=r: self.proposer(r))
            self.phase(f"r{r}/admit", r, lambda r=r: self.admit(r))
            self.phase(f"r{r}/main", r, lambda r=r: self.main(r))
            if r < R:  # after the last round nobody would be graded by them
                for role in aux_roles(self.treatment):
                    self.phase(f"r{r}/{role}", r, lambda r=r, role=role: self.aux(r, role))
            self.phase(f"r{r}/eval", r, lambda r=r: self.evaluate(r))
        if self.spec.audit == "none":  # not logged as done: resumed with engine.audit = "auto", it audits
            self.say("audit: engine.audit = none, skipped")
        else:
            self.phase(AUDIT_PHASE, R, self.audit)
        # each phase rewrites compute.json after logging itself; a kill between the two, at the last phase,
        # left it without that phase, and a resume that finds every phase done would not rewrite it
        write_json(self.run.path / "compute.json", self.phases.compute())
        self.run.finish()  # after the audit, as `evolve` does
        self.run.note(wall_seconds_last_invocation=_seconds(time.perf_counter() - started))
        return self.run

    def proposer(self, r: int) -> dict:
        cfg, spec, lm = self.cfg, self.spec, self.cfg.lm
        G = spec.proposer_generations
        prompts = spec.proposer_prompts or math.ceil(cfg.loop.proposals_per_step / G)
        prompts = math.ceil(prompts / spec.train_processes) * spec.train_processes
        truncate = _truncator(self.model_dir("proposer", r - 1), lm.doc_tokens)
        rows = proposer_rows(self.pool, self.folds, r, cfg.loop.proposer_steps * prompts, cfg.seed, truncate,
                             search=lm.proposer_searches)
        items_path = self.round_dir(r) / "proposer-items.jsonl"  # `train` cuts what a killed attempt staged
        graders = self.graders_for(r)
        with self.serving({role: (g[0], g[1]) for role, g in graders.items()}) as served:
            reward = {"treatment": cfg.treatment, "round": r, "folds": self.folds.to_json(),
                      "graders": [Grader(role, *served[role], name, folds, rounds).to_json()
                                  for role, (_, name, folds, rounds) in graders.items()],
                      "items_path": str(items_path), "samples": cfg.loop.grader_samples,
                      "format_penalty": lm.format_penalty, "seed": cfg.seed,
                      "step_base": (r - 1) * self.steps_per_round, "remote": self.remote_options()}
            res = self.train(f"r{r}/proposer", "proposer", "proposer", r, rows, cfg.loop.proposer_steps, prompts, G,
                             reward)
        graded = sum(1 for row in read_staged(items_path) if "item" in row)
        return {"model": self.model_dir("proposer", r), "prompts_per_step": prompts,
                "updates": {"proposer": res["steps"]},
                "generations": {"proposer": res["completions"], "grader": graded * cfg.loop.grader_samples}}

    def admit(self, r: int) -> dict:
        cfg = self.cfg
        staged = read_staged(self.round_dir(r) / "proposer-items.jsonl")
        wellformed = sum(1 for row in staged if "item" in row)
        kwargs = dict(round=r, step_base=(r - 1) * self.steps_per_round, proposer_steps=cfg.loop.proposer_steps,
                      budget=cfg.loop.admit_per_round, seed=cfg.seed)
        if self.treatment.msv:
            from selfevo.agents.remote import RemoteSolver

            docs = {d.id: d for d in self.pool}  # proposals are written from the pool's documents
            path, name = self.model_dir("main", r - 1), f"main@r{r - 1}"  # MSV samples the main solver
            with self.serving({"main": (path, name)}) as served, \
                    RemoteSolver(*served["main"], **self.remote_options(),
                                 context=_truncator(path, cfg.lm.doc_tokens)) as model:  # the loop's LMSolver view
                records, admitted = admit_round(staged, decide=lambda items, seed: msv_filter(
                    items, model, docs, self.tool, seed, self.spec.msv_samples), **kwargs)
        else:
            records, admitted = admit_round(staged, **kwargs)
        commit_records(self.run.steps_path, records, r, "proposer")
        write_jsonl(self.round_dir(r) / "admitted.jsonl", admitted)
        msv = 2 * self.spec.msv_samples * wellformed if self.treatment.msv else 0
        return {"candidates": wellformed, "admitted": len(admitted), "generations": {"msv": msv}}

    def _admitted_rows(self, r: int) -> list[dict]:
        path = self.round_dir(r) / "admitted.jsonl"
        return solver_rows(read_jsonl_log(path), self.folds, r)

    def main(self, r: int) -> dict:
        cfg = self.cfg
        rows = self._admitted_rows(r)
        staging = self.round_dir(r) / "solver-steps.jsonl"  # `train` cuts what a killed attempt staged
        S = cfg.loop.solver_steps
        if not rows:  # nothing admitted: the loop writes empty solver steps and trains nothing
            from selfevo.records import step_record

            base = (r - 1) * self.steps_per_round + cfg.loop.proposer_steps
            commit_records(self.run.steps_path, [
                step_record(round=r, step=base + j, step_in_round=cfg.loop.proposer_steps + j, kind="solver",
                            items=[], stats={}) for j in range(1, S + 1)], r, "solver")
            return {"trained": False}
        folds, rounds = self.phases.lineage("main", r - 1)
        reward = {"records_path": str(staging), "round": r, "step_base": (r - 1) * self.steps_per_round,
                  "first_step_in_round": cfg.loop.proposer_steps + 1,
                  "grader": Grader("main", "", "main", "main", folds, rounds).lineage()}
        G = self.spec.solver_generations
        res = self.train(f"r{r}/main", "solver", "main", r, rows, S, self.per_step(len(rows), S), G, reward)
        commit_records(self.run.steps_path, merge_step_records(read_staged(staging)), r, "solver")
        return {"model": self.model_dir("main", r), "updates": {"main": res["steps"]},
                "generations": {"solver_rollouts": res["completions"]},
                "trained_on": {"role": "main", "folds": sorted({f for x in rows for f in x["source_folds"]}),
                               "rounds": [r]}}

    def aux(self, r: int, role: str) -> dict:
        cfg, opts = self.cfg, options_of(self.treatment)  # the loop's AuxFeedback options
        rows = aux_training_sets(self._admitted_rows(r), [role], opts.lineage_aware)[role]
        if not rows:
            self.say(f"  warning: {untrained_grader(role, r, bool(self.phases.lineage(role, r)[1]))}")
            return {"trained": False}
        roles = aux_roles(self.treatment)
        updates = aux_updates(cfg.loop.solver_steps, len(roles), opts.budget)[roles.index(role)]
        per = self.per_step(len(rows), cfg.loop.solver_steps)  # the full-budget batch; less budget, fewer batches
        res = self.train(f"r{r}/{role}", "solver", role, r, rows, updates, per, self.spec.solver_generations,
                         {"records_path": None, "round": r})
        # its lineage, as the loop's record_training writes it
        folds = sorted({f for x in rows for f in touched_folds(x["fold"], x["source_folds"], opts.lineage_aware)})
        return {"model": self.model_dir(role, r), "updates": {role: res["steps"]},
                "generations": {"aux_rollouts": res["completions"]},
                "trained_on": {"role": role, "folds": folds, "rounds": [r]}}

    def evaluate(self, r: int) -> dict:
        # recorded where a kill came after its files were written and before the phase was logged
        # (round r's main solver, trained and logged before it, is the one that answered)
        result = self.run.recorded_evaluation(r)
        if result is None:
            result = self._evaluate(r)
        if r > 0:  # written again where a kill came after the evaluation (inside this write, say)
            self.run.checkpoint(r, {"models": {role: self.model_dir(role, r)
                                               for role in ["proposer", "main", *aux_roles(self.treatment)]},
                                    "lineage": {role: dict(zip(("folds", "rounds"), self.phases.lineage(role, r),
                                                               strict=True))
                                                for role in ["main", *aux_roles(self.treatment)]},
                                    "compute": self.phases.compute()})
        macro = result.get("macro", {})
        return {"macro_cover_em": macro.get("cover_em") if isinstance(macro, dict) else macro,
                "generations": {EVAL_GENERATIONS: result["run"]["questions"]}}  # one trajectory a question

    def _evaluate(self, r: int) -> dict:
        from selfevo.agents.remote import RemoteSolver
        from selfevo.evaluate import PartialFileError, evaluate_solver

        path, name = self.model_dir("main", r), f"main@r{r}"
        with self.serving({"main": (path, name)}) as served, \
                RemoteSolver(*served["main"], **self.remote_options()) as solver:
            # named without the loopback port it was served on this time: a run's files, and a resumed
            # run's, are the same whatever port it got
            solver.name = f"remote:{name} (served)"
            try:
                # a kill during it (1,325 questions of a served 4B model: hours) keeps the answers given:
                # the resumed phase goes on from them while the model's files are the ones that gave them
                # (removed with the round's checkpoint, as the loop's)
                return evaluate_solver(solver, self.env.benchmarks, self.tool, progress=False,
                                       run_info={"round": r}, limit=self.cfg.data.eval_limit or None,
                                       predictions_path=self.run.eval_predictions_path(r),
                                       score_path=self.run.eval_path(r), per_invocation=False,
                                       partial_key={"round": r, "model": model_identity(path)},
                                       partial_path=self.run.eval_partial_path(r), restart_stale=True,
                                       remove_partial=False)
            except PartialFileError as e:  # damaged (a line before the last): no kill does that
                raise RunError(str(e)) from None

    def audit(self) -> dict:
        from selfevo.audit import OracleJudge, audit_run

        if self.env.truth is not None:
            result = audit_run(self.run, OracleJudge(self.env.truth))
        else:
            from selfevo.evolve import default_judge

            with default_judge(self.cfg, self.env, self.run.path / "audit" / "cache.jsonl", progress=True) as judge:
                result = audit_run(self.run, judge)
        return {"audit": result["judge"], "rounds": len(result["rounds"])}


def engine_run(ecfg: EngineConfig, out: str | os.PathLike, resume: bool = False,
               log: Callable[[str], None] = print) -> RunDir:
    if url := ecfg.engine.retriever_url:  # a server that answers nothing fails before anything is written
        from selfevo.search.client import RetrieverError, probed_client

        try:
            probed_client(url).close()
        except RetrieverError as e:
            raise ConfigError(f"engine.retriever_url {shown_url(url)}: {e}") from None
    with RunDir(out).lock():  # one writer, as for `evolve`
        return EngineRun(ecfg, out, resume=resume, log=log).run_all()


# ---------------------------------------------------------------- helpers


def _seconds(x: float) -> float:
    return round(x, 3)


def _per_step(n_rows: int, steps: int) -> int:
    return max(1, math.ceil(n_rows / max(1, steps)))


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def verl_missing() -> str:
    """What a verl phase lacks here ('' when it can run)."""
    lacks = []
    if importlib.util.find_spec("verl") is None:
        lacks.append("the verl package")
    if not _cuda():
        lacks.append("CUDA GPUs (none here)")
    return " and ".join(lacks)


def _truncator(model_dir: str, n_tokens: int) -> Callable[[str], str]:
    """Dr. Zero: the proposer sees the first `n_tokens` tokens of its source."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)

    def cut(text: str) -> str:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return text if len(ids) <= n_tokens else tok.decode(ids[:n_tokens])
    return cut


def _port_free(port: int, path: str) -> None:
    """A port something listens on already is refused: a `vllm serve` left by a killed run answers /health
    there, and the new one, failing to bind, would go unnoticed while the grading went to the old one."""
    import socket

    from selfevo._io import bind_once

    try:
        bind_once(socket.AF_INET, ("127.0.0.1", port))
    except OSError as e:
        raise EngineUnavailable(f"vllm serve {path}: 127.0.0.1:{port} is in use ({e.strerror}); a vllm serve "
                                "an earlier run left when it was killed? Stop it (pgrep -af 'vllm serve') or "
                                "set engine.grader_port") from None


def _vllm_server(path: str, name: str, port: int, gpus: str, memory: float, say) -> Iterator[str]:
    """`vllm serve` in a subprocess for the block's duration (an OpenAI-compatible endpoint)."""
    import httpx

    exe = shutil.which("vllm")
    if exe is None or not _cuda():
        raise EngineUnavailable(f"graders = 'vllm' needs the vllm command and CUDA GPUs "
                                f"(vllm: {'found' if exe else 'missing'}, GPUs: {'yes' if _cuda() else 'none'}); "
                                "use graders = 'local' on a CPU")
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": gpus} if gpus else {})}
    # --generation-config vllm: vLLM's neutral sampling defaults, not the model's generation_config.json
    # (Qwen's sets top_k=20, for one); a grader samples at lm.temperature and lm.top_p only, as the loop's
    cmd = [exe, "serve", path, "--served-model-name", name, "--port", str(port), "--host", "127.0.0.1",
           "--gpu-memory-utilization", str(memory), "--generation-config", "vllm"]
    say("  $ " + " ".join(shlex.quote(c) for c in cmd))
    _port_free(port, path)
    with _proc.running(cmd, env, grace=60) as proc:  # stopped with its engine processes, whatever stops this
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise EngineUnavailable(f"vllm serve {path} exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"vllm serve {path}: not healthy after 900 s")
            time.sleep(2)
        yield f"http://127.0.0.1:{port}/v1"

