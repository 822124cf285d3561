"""The resolved configuration of an `evolve` run: frozen dataclasses, strictly parsed.

An unknown field, a wrong type or a NaN is an error naming the field (`loop.rounds: ...`); a
config is parsed, never evaluated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from selfevo._io import absolute, is_path
from selfevo.agents.lm.config import LMConfig
from selfevo.agents.sim import SimProposerConfig, SimSolverConfig
from selfevo.loop.schedule import LoopConfig
from selfevo.loop.treatments import feedback_options, parse_treatment
from selfevo.world.generate import SIZES, WorldConfig


class ConfigError(ValueError):
    """A bad configuration value; the message names the field."""


NEEDS_QA_DIR = "data.corpus: needs data.qa_dir as well (the benchmarks to evaluate on)"


# Fields that name a file or directory. Stored absolute: a run audited, resumed or replayed from
# another directory (or on a Ray worker) must read the same files, not whatever is there.
PATH_FIELDS = (("world", "name"), ("data", "corpus"), ("data", "qa_dir"), ("data", "index"))


def with_absolute_paths(config: dict) -> dict:
    """A config dict (e.g. one saved by an older selfevo, relative to its working directory) with
    its path fields as a config now stores them."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    for table, key in PATH_FIELDS:
        value = out.get(table, {}).get(key) if isinstance(out.get(table), dict) else None
        if isinstance(value, str) and value and not (table == "world" and value in SIZES):
            out[table][key] = absolute(value, f"{table}.{key}")
    model = out.get("lm", {}).get("model") if isinstance(out.get("lm"), dict) else None
    if isinstance(model, str) and is_path(model):  # a hub id or the shipped name is no path
        out["lm"]["model"] = absolute(model, "lm.model")
    return out


@dataclass(frozen=True)
class WorldSpec:
    name: str = "default"  # "small" | "default" | a world directory
    seed: int = 0  # the world parameters' defaults are the generator's (one home)
    confusable_rate: float = WorldConfig.confusable_rate
    shared_misreading: float = WorldConfig.shared_misreading
    value_skew: float = WorldConfig.value_skew

    def __post_init__(self):
        if not self.name.strip():
            raise ValueError("world.name: empty (small, default or a world directory)")
        if self.name not in SIZES:
            object.__setattr__(self, "name", absolute(self.name, "world.name"))
        # validate the world parameters here, so a bad one is reported before anything runs
        WorldConfig(size="small", **self.params())

    def params(self) -> dict:
        return {"seed": self.seed, "confusable_rate": self.confusable_rate,
                "shared_misreading": self.shared_misreading, "value_skew": self.value_skew}


@dataclass(frozen=True)
class SearchConfig:
    topk: int = 3
    max_calls: int = 5

    def __post_init__(self):
        if self.topk < 1:
            raise ValueError(f"search.topk: must be >= 1, got {self.topk}")
        if self.max_calls < 1:
            raise ValueError(f"search.max_calls: must be >= 1, got {self.max_calls}")


@dataclass(frozen=True)
class DataSpec:
    """A real corpus instead of the synthetic world (the lm backend only: sim agents read the
    world's language)."""

    corpus: str = ""  # FlashRAG corpus JSONL: the proposer's sources and the search index ("": the world)
    qa_dir: str = ""  # FlashRAG QA directory for the per-round evaluation (needed with a corpus)
    eval_limit: int = 0  # at most N questions per benchmark in the per-round evaluation (0: all)
    # a saved index of data.corpus (`selfevo index build`, any kind: bm25 | dense | hybrid) that the
    # agents search, its documents read on demand ("": a BM25 index built in memory at start-up)
    index: str = ""

    def __post_init__(self):
        if self.eval_limit < 0:
            raise ValueError(f"data.eval_limit: must be >= 0, got {self.eval_limit}")
        if self.index and not self.corpus:
            raise ValueError("data.index: only with data.corpus (the corpus the index was built from)")
        if self.corpus and not self.qa_dir:
            raise ValueError(NEEDS_QA_DIR)
        if self.qa_dir and not self.corpus:  # a world run is evaluated on its world's benchmarks only
            raise ValueError("data.qa_dir: only with data.corpus (a run on the synthetic world is evaluated on "
                             "the world's own seven benchmarks)")
        for name in ("corpus", "qa_dir", "index"):
            if getattr(self, name):
                object.__setattr__(self, name, absolute(getattr(self, name), f"data.{name}"))


@dataclass(frozen=True)
class RunConfig:
    treatment: str = "coupled"
    seed: int = 0
    backend: str = "sim"  # sim: the embedded numpy learners | lm: language models (transformers)
    # "": the backend's | the name an installed package gives its learners under selfevo.learners
    learners: str = ""
    world: WorldSpec = field(default_factory=WorldSpec)
    data: DataSpec = field(default_factory=DataSpec)
    loop: LoopConfig = field(default_factory=LoopConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    solver: SimSolverConfig = field(default_factory=SimSolverConfig)
    proposer: SimProposerConfig = field(default_factory=SimProposerConfig)
    lm: LMConfig = field(default_factory=LMConfig)

    def __post_init__(self):
        if self.backend not in ("sim", "lm"):
            raise ValueError(f"backend: must be sim or lm, got {self.backend!r}")
        if self.backend == "sim" and self.data.corpus:
            raise ValueError("data.corpus: the sim backend runs on the synthetic world only; use backend = \"lm\"")
        # a setting only the other backend reads would be recorded in config.json and silently ignored (learners
        # of a user's read what they read: [solver], [proposer], [lm] and the world's settings are theirs)
        for table in () if self.learners else ("lm",) if self.backend == "sim" else ("solver", "proposer"):
            default = type(getattr(self, table))()
            for f in dataclasses.fields(default):
                if getattr(getattr(self, table), f.name) != getattr(default, f.name):
                    reader = "lm backend (--backend lm)" if table == "lm" else "sim backend's learners"
                    raise ValueError(f"{table}.{f.name}: read only by the {reader}; backend {self.backend!r} "
                                     "would ignore it")
        if self.backend == "sim" and not self.learners:
            self._check_hops_fit_search_budget()
        if self.backend == "lm" and not self.learners and self.world.shared_misreading != WorldSpec.shared_misreading:
            raise ValueError("world.shared_misreading: read only by the sim backend's readers; backend 'lm' "
                             "would ignore it")
        if self.data.corpus:  # the corpus replaces the synthetic world: a [world] setting would be ignored too
            for f in dataclasses.fields(WorldSpec):
                if getattr(self.world, f.name) != getattr(WorldSpec(), f.name):
                    raise ValueError(f"world.{f.name}: read only on the synthetic world; a run on a corpus "
                                     "(data.corpus) would ignore it")

    def _check_hops_fit_search_budget(self) -> None:
        """The sim proposer follows a link with one search a hop, so an h-hop question takes h - 1
        searches. A hop count the budget cannot compose is drawn and retried until the step's attempts
        run out: the proposer then writes a fraction of its questions (none if only such hop counts
        have weight), and the run goes on with exit 0."""
        ratio, budget = self.proposer.hop_ratio, self.search.max_calls
        too_long = [h for h, w in enumerate(ratio, 1) if w > 0 and h - 1 > budget]
        if not too_long:
            return
        # name the field that was changed from its default (the other one is as shipped)
        if ratio != SimProposerConfig.hop_ratio:
            raise ValueError(f"proposer.hop_ratio: asks for {too_long[0]}-hop questions, which take "
                             f"{too_long[0] - 1} searches to compose, but search.max_calls is {budget}; "
                             f"give weight only to questions of 1 to {budget + 1} hops, or raise search.max_calls")
        raise ValueError(f"search.max_calls: {budget} searches cannot compose the {too_long[0]}-hop questions "
                         f"proposer.hop_ratio {list(ratio)} asks for ({too_long[0] - 1} searches); "
                         f"set proposer.hop_ratio = {list(ratio[:budget + 1])} as well, or raise search.max_calls")

    def to_json(self) -> dict:
        return asdict(self)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def coerce(value: Any, typ: Any, where: str) -> Any:
    """`value` as type `typ` (a dataclass, tuple[T, ...], bool, int, float, str...), or a ConfigError
    naming `where`: the one type check of every config value."""
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {type(value).__name__}")
        return _build(typ, value, where)
    if typing.get_origin(typ) is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        inner = typing.get_args(typ)[0]
        return tuple(coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value))
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, str) and _is_number(value):
            raise ConfigError(f"{where}: expected a number, got the string {value!r} (write it unquoted; YAML "
                              "reads 1e-5 as a string: write 1.0e-5)")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            value = float(value)
        except OverflowError:  # an integer literal too large for a float
            raise ConfigError(f"{where}: must be finite, got an integer of {len(str(value))} digits") from None
        if not math.isfinite(value):
            raise ConfigError(f"{where}: must be finite, got {value!r}")
        return value
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {typ}")


def check_known(data: dict, names, prefix: str = "") -> None:
    """A key of a config table that is none of its fields: an error naming it and the known ones."""
    for key in data:
        if key not in names:
            raise ConfigError(f"{prefix + '.' if prefix else ''}{key}: unknown field (known: {', '.join(names)})")


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    check_known(data, names, prefix)
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else key
        kwargs[key] = coerce(value, hints[key], where)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        # the components' own checks say "section.field: problem"; keep that, else name the section
        msg = str(e)
        if not re.match(r"^[\w.]+: ", msg):
            msg = f"{prefix or 'config'}: {msg}"
        raise ConfigError(msg) from None


def config_from_dict(data: dict, *, recorded: bool = False) -> RunConfig:
    """`data` as a RunConfig, checked (`recorded`: `parse_treatment`'s, for a finished run's config)."""
    cfg = _build(RunConfig, data)
    try:
        t = parse_treatment(cfg.treatment, recorded=recorded)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if t.feedback == "crossfit" and 0 < cfg.loop.source_docs < t.k:
        # more folds than sources: the extra folds' auxiliary solvers would train on nothing, ever
        raise ConfigError(f"treatment: {cfg.treatment!r} asks for {t.k} source folds, but the proposer draws "
                          f"from {cfg.loop.source_docs} source documents (loop.source_docs); K can be at most that")
    options = feedback_options(t)
    if options is not None:
        from selfevo.loop.feedback import aux_count, fewest_aux_updates

        n_aux = aux_count(options.trains, t.k)
        if fewest_aux_updates(cfg.loop.solver_steps, n_aux, options.budget) == 0:
            # a split budget too small for every aux solver: one would grade untrained
            raise ConfigError(f"loop.solver_steps: {cfg.loop.solver_steps} leaves one of the {n_aux} auxiliary "
                              f"solvers of {cfg.treatment!r} with no updates a round, and it would grade untrained; "
                              "raise loop.solver_steps")
    return cfg


# a value that fails to parse as TOML and reads as an attempt at a list, table, quoted string or number
_MEANT_AS_TOML = re.compile(r"[\[{\"'].*|(?=.*[0-9])[+-]?[0-9_]*\.?[0-9_]*(?:[eE][+-]?[0-9_]+)?")


def parse_override(text: str, set_by: str = "--set") -> tuple[list[str], Any]:
    """`solver.memory=false` -> (["solver", "memory"], False); values are TOML literals. `set_by`: the
    option that gave it, as its errors name it."""
    if "=" not in text:
        raise ConfigError(f"{set_by} {text!r}: expected KEY=VALUE")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"{set_by} {text!r}: no field name before '='")
    path, raw = [part.strip() for part in key.split(".")], raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError as e:
        if _MEANT_AS_TOML.fullmatch(raw):
            # a list, a quoted string or a number that is no TOML literal ([a,b], .001, 007): say why,
            # rather than pass it on as a string that the field then refuses for its type
            raise ConfigError(f"{'.'.join(path)}: {raw!r} ({set_by}) is not a TOML value ({e}); write lists and "
                              "strings in them quoted ([\"a\", \"b\"]) and numbers as TOML does (0.001, 7)") from None
        value = raw  # a bare word is a string: a name, a hub id, a path
    return path, value


def absolute_overrides(overrides: Sequence[str]) -> tuple[str, ...]:
    """`--set` texts with their path fields absolute (`with_absolute_paths`), for a process whose working
    directory is not this one's (a Ray worker: on a cluster, not even this machine)."""
    out = []
    for text in overrides:
        try:
            keys, value = parse_override(text)
        except ConfigError:  # left as it is: the job fails in its worker and says why there
            keys, value = [], None
        if isinstance(value, str) and len(keys) == 2:
            fixed = with_absolute_paths({keys[0]: {keys[1]: value}})[keys[0]][keys[1]]
            if fixed != value:  # a JSON string is a TOML basic string (a non-BMP character written as it is:
                # JSON's surrogate-pair escape is no TOML escape)
                text = f"{'.'.join(keys)}={json.dumps(fixed, ensure_ascii=False)}"
        out.append(text)
    return tuple(out)


def merge(base: dict, path: list[str], value: Any, _where: str = "") -> dict:
    out = dict(base)
    where = f"{_where}.{path[0]}" if _where else path[0]
    if len(path) == 1:
        out[path[0]] = value
    else:
        inner = out.get(path[0], {})
        if not isinstance(inner, dict):  # e.g. `--set loop=3 --set loop.rounds=2`
            raise ConfigError(f"{where}: expected a table, got {type(inner).__name__}")
        out[path[0]] = merge(inner, path[1:], value, where)
    return out


def read_toml(path: str | Path) -> dict:
    """A TOML config file; any reason it cannot be read is one ConfigError naming it."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8-sig"))  # a BOM (Windows editors) is no error
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: invalid UTF-8 at byte {e.start}") from None
    except OSError as e:  # missing, a directory, no permission
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None


def _same_setting(key: str, a: Any, b: Any) -> bool:
    """Two values of one field, a path field's as the config stores it (absolute: "./c.jsonl" is "c.jsonl")."""
    if isinstance(a, str) and isinstance(b, str) and a and b and (
            tuple(key.split(".")) in PATH_FIELDS or (key == "lm.model" and is_path(a) and is_path(b))):
        return absolute(a, key) == absolute(b, key)
    return a == b


# a table another command reads, met by `evolve --config`: which command the file is for
_OTHER_COMMAND = {"demo": "selfevo demo --config", "engine": "selfevo engine-run --config"}


def blame(e: ConfigError, path: str | Path | None, overridden: Sequence[str] = (),
          given: Sequence[str] = (), set_by: str = "--set") -> ConfigError:
    """`e` saying where its field was set: the file (its path first, as for a damaged config.json), a
    `--set`, or a command's option (its message names the field already). The message starts with
    the field it is about ("loop.round: unknown field ...")."""
    field = str(e).split(":", 1)[0].split("[", 1)[0]  # "proposer.theta[1]": an item of the field set

    def touches(key: str) -> bool:
        return key == field or key.startswith(field + ".") or field.startswith(key + ".")

    # an option sets its own key only: an error about the table above it (`engine: expected a table`
    # under --engine, which gives engine.engine) is the file's or a --set's
    if any(k == field or field.startswith(k + ".") for k in given):
        return e
    if any(touches(k) for k in overridden):
        return ConfigError(f"{e} (set by {set_by})")
    if path is None:
        return e
    hint = (f"; this is a config for `{_OTHER_COMMAND[field]}`"
            if field in _OTHER_COMMAND and "unknown field" in str(e) else "")
    return ConfigError(f"{path}: {e}{hint}")


def _merge_into(data: dict, keys: list[str], value: Any, setter: str, path: str | Path | None,
                overridden: Mapping[str, Any], set_by: str) -> dict:
    """`merge`, whose error (a field above `keys` holds a value, not a table) says who set that value (the
    file or a `--set`, as `blame` does) and who (`setter`) sets a field inside it."""
    try:
        return merge(data, keys, value)
    except ConfigError as e:
        raise ConfigError(f"{blame(e, path, list(overridden), (), set_by)}; {setter} sets a field in it") from None


def apply_overrides(data: dict, overrides: Sequence[str], set_by: str = "--set",
                    path: str | Path | None = None) -> tuple[dict, dict]:
    """`data` (read from `path`, if any) with each `--set` text merged in, and the fields they set (dotted
    key -> value)."""
    if isinstance(overrides, str):  # else read as its characters: "--set 'l': expected KEY=VALUE"
        raise TypeError(f"overrides: a list of KEY=VALUE strings, got one string ({overrides!r}): pass [{overrides!r}]")
    overridden = {}
    for text in overrides:
        keys, value = parse_override(text, set_by)
        data = _merge_into(data, keys, value, f"{set_by} {text}", path, overridden, set_by)
        overridden[".".join(keys)] = value
    return data, overridden


def load_config(path: str | Path | None = None, overrides: list[str] = (), set_by: str = "--set",
                **top: Any) -> RunConfig:
    """A TOML file (optional), then `--set` overrides, then explicit top-level values (a command's options;
    one that disagrees with an override of the same field is refused). An error says which of the three
    set the field (`blame`)."""
    data, overridden = apply_overrides(read_toml(path) if path is not None else {}, overrides, set_by, path)
    for key, value in top.items():
        if value is not None:
            if key in overridden and not _same_setting(key, overridden[key], value):  # else one silently lost
                raise ConfigError(f"--set {key}={overridden[key]!r} and the option for {key} ({value!r}) "
                                  "disagree; give one of them")
            data = _merge_into(data, key.split("."), value, f"the option for {key}", path, overridden, set_by)
    try:
        return config_from_dict(data)
    except ConfigError as e:
        raise blame(e, path, list(overridden), [k for k, v in top.items() if v is not None], set_by) from None
