"""The resolved config: overrides, TOML files, strict errors naming the field, and the CLI's
usage errors (exit code 2, nothing half-written)."""

import json
import math
import re

import pytest
from _shared import REPO
from typer.testing import CliRunner

from selfevo.cli import app
from selfevo.config import ConfigError, RunConfig, config_from_dict, load_config, with_absolute_paths

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def flat(text: str) -> str:
    """CLI output with rich's line wrapping undone."""
    return " ".join(text.split())


# ------------------------------------------------------------------ overrides and files


def test_defaults():
    cfg = load_config()
    assert cfg == RunConfig()
    assert cfg.treatment == "coupled" and cfg.loop.rounds == 3 and cfg.solver.memory is True
    assert cfg.world.name == "default"


def test_overrides():
    cfg = load_config(None, ["solver.memory=false", "loop.rounds=2", "world.name=small",
                             "solver.lr_theta=0.1", "proposer.hop_ratio=[1, 1, 1, 1]"])
    assert cfg.solver.memory is False
    assert cfg.loop.rounds == 2
    assert cfg.world.name == "small"
    assert cfg.solver.lr_theta == 0.1 and isinstance(cfg.solver.lr_theta, float)
    assert cfg.proposer.hop_ratio == (1, 1, 1, 1)
    # untouched fields keep their defaults
    assert cfg.loop.solver_steps == RunConfig().loop.solver_steps
    assert cfg.solver.lr_memory == RunConfig().solver.lr_memory


def test_integer_given_for_a_float_is_a_float():
    cfg = load_config(None, ["solver.lr_theta=1"])
    assert cfg.solver.lr_theta == 1.0 and isinstance(cfg.solver.lr_theta, float)


def test_toml_file_then_overrides_then_top_level(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('seed = 4\n\n[world]\nname = "small"\nconfusable_rate = 0.3\n\n'
                    '[loop]\nrounds = 2\nproposer_steps = 6\n\n[solver]\nmemory = false\n', encoding="utf-8")
    cfg = load_config(path)
    assert (cfg.seed, cfg.world.name, cfg.world.confusable_rate) == (4, "small", 0.3)
    assert (cfg.loop.rounds, cfg.loop.proposer_steps, cfg.solver.memory) == (2, 6, False)
    cfg = load_config(path, ["loop.rounds=1", "seed=5"])
    assert (cfg.loop.rounds, cfg.seed, cfg.loop.proposer_steps) == (1, 5, 6)
    cfg = load_config(path, ["loop.rounds=1"], **{"loop.proposer_steps": 3, "seed": None})
    assert (cfg.loop.rounds, cfg.loop.proposer_steps, cfg.seed) == (1, 3, 4)  # None means "not given"


def test_round_trip_through_json():
    cfg = load_config(None, ["solver.memory=false", "loop.rounds=2", "world.name=small"])
    assert config_from_dict(json.loads(json.dumps(cfg.to_json()))) == cfg


def _keys(table: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in table.items():
        out |= _keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key}
    return out


def test_every_knob_is_written_out_in_a_documented_config():
    """configs/default.toml is every knob's default, one by one (the sim's and the language-model
    backend's); the Qwen recipes write out every language-model knob. A field added to the config
    without its line there fails here."""
    knobs = _keys(RunConfig().to_json())
    default = tomllib.loads((REPO / "configs" / "default.toml").read_text(encoding="utf-8"))
    assert load_config(REPO / "configs" / "default.toml") == RunConfig()
    assert knobs - _keys(default) == set()
    lm_knobs = {k for k in knobs if k == "backend" or k.split(".")[0] in ("data", "lm")}
    for name in ("qwen3.5-4b.toml", "qwen3.5-9b.toml"):
        recipe = tomllib.loads((REPO / "configs" / name).read_text(encoding="utf-8"))
        assert lm_knobs - _keys(recipe) == set(), name


def test_bad_toml_file_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[loop\nrounds = 2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(path)


# ------------------------------------------------------------------ errors name the field


@pytest.mark.parametrize("override, field", [
    ("loop.foo=1", "loop.foo"),
    ("foo=1", "foo"),
    ("world.size=small", "world.size"),
    ("solver.memory=3", "solver.memory"),
    ("solver.memory='yes'", "solver.memory"),
    ("loop.rounds=2.5", "loop.rounds"),
    ("loop.rounds=true", "loop.rounds"),
    ("loop.rounds=0", "loop.rounds"),
    ("loop=3", "loop"),
    ("solver.lr_theta=nan", "solver.lr_theta"),
    ("solver.lr_theta=inf", "solver.lr_theta"),
    ("solver.lr_theta='fast'", "solver.lr_theta"),
    ("solver.theta0=[1.0, 2.0]", "solver.theta0"),
    ("solver.temperature=0", "solver.temperature"),
    ("world.confusable_rate=2.0", "world.confusable_rate"),
    ("world.shared_misreading=-0.5", "world.shared_misreading"),
    ("world.value_skew=-1", "world.value_skew"),
    ('data.corpus="c.jsonl"', "data.corpus"),  # without data.qa_dir: the error names what was given
    ("treatment=bogus", "treatment"),
    ("treatment='crossfit-k500'", "treatment"),  # more folds than the 300 source documents
    ("seed='x'", "seed"),
    ("loop.rounds=1000000000000", "loop.rounds"),  # the schedule is listed at start-up: no hang
    ("solver.lr_theta='1e-5'", "solver.lr_theta"),
])
def test_bad_values_raise_config_error_naming_the_field(override, field):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    assert str(exc.value).startswith(f"{field}:"), str(exc.value)


def test_nan_is_never_accepted_anywhere():
    for key in ("solver.lr_memory", "solver.misread_scale", "proposer.lr", "world.confusable_rate"):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [f"{key}=nan"])
    assert not math.isnan(load_config(None, ["solver.lr_memory=1e-3"]).solver.lr_memory)


@pytest.mark.parametrize("override", ["lm.lora_targets=[q_proj,v_proj]", "lm.lr=.001", "seed=007", 'lm.model="x'])
def test_a_set_value_meant_as_toml_that_is_none_says_why(override):
    """A list, quoted string or number that is no TOML literal is an error about the literal, not
    "expected a list, got str" after it was taken for a bare word."""
    with pytest.raises(ConfigError, match="is not a TOML value"):
        load_config(None, ["backend='lm'", override])


def test_set_bare_words_are_strings_and_key_parts_are_trimmed():
    cfg = load_config(None, ["backend=lm", " lm . model = HuggingFaceTB/SmolLM2-135M-Instruct", "lm.device=cuda:1"])
    assert cfg.lm.model == "HuggingFaceTB/SmolLM2-135M-Instruct" and cfg.lm.device == "cuda:1"
    assert load_config(None, ["treatment=msv+crossfit", "loop.rounds = 2"]).loop.rounds == 2


def test_a_number_written_as_a_string_says_how_to_write_it():
    with pytest.raises(ConfigError, match=re.escape("write 1.0e-5")):
        load_config(None, ["solver.lr_theta='1e-5'"])  # what a YAML reader makes of `lr_theta: 1e-5`


@pytest.mark.parametrize("overrides, field", [
    (["lm.adapter=full", "lm.lora_r=64"], "lm.lora_r"),  # recorded, never used
    (["lm.adapter=full", "lm.lora_targets=['x']"], "lm.lora_targets"),
    (["lm.generator=vllm", "lm.lora_r=4096"], "lm.lora_r"),  # not only when vLLM starts on a GPU
    (['lm.model=""'], "lm.model"),
])
def test_bad_language_model_settings_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["backend=lm", *overrides])
    assert str(exc.value).startswith(f"{field}:"), str(exc.value)
    load_config(None, ["backend=lm", "lm.adapter=full"])  # the adapter alone is fine


def test_a_model_given_as_a_path_is_stored_absolute(tmp_path, monkeypatch):
    """As data.corpus is: a run resumed, audited or replayed from elsewhere loads the same model."""
    monkeypatch.chdir(tmp_path)
    assert load_config(None, ["backend=lm", "lm.model=./models/m"]).lm.model == str(tmp_path / "models" / "m")
    assert load_config(None, ["backend=lm", "lm.model=org/name"]).lm.model == "org/name"  # a hub id
    saved = {"backend": "lm", "lm": {"model": "./models/m"}}  # config.json of an older selfevo
    assert with_absolute_paths(saved)["lm"]["model"] == str(tmp_path / "models" / "m")


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, ["loop.rounds"])


@pytest.mark.parametrize("override", ["proposer.options=0", "proposer.hop_ratio=[1, -1]"])
def test_bad_proposer_values_raise_config_error(override):
    # regression: a component message without "field:" once made config._build raise IndexError
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(None, [override])


# ------------------------------------------------------------------ the CLI


def test_cli_bad_config_exits_2_and_leaves_no_run_directory(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["evolve", "--set", "loop.rounds=0", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "loop.rounds" in flat(result.output)
    assert "Traceback" not in result.output
    assert not out.exists()


@pytest.mark.parametrize("args, field", [
    (["--set", "loop.foo=1"], "loop.foo"),
    (["--set", "solver.lr_theta=nan"], "solver.lr_theta"),
    (["--set", "world.confusable_rate=2.0"], "world.confusable_rate"),
    (["--treatment", "bogus"], "treatment"),
    (["--rounds", "0"], "loop.rounds"),
])
def test_cli_config_errors(tmp_path, args, field):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["evolve", "--out", str(out), *args])
    assert result.exit_code == 2, result.output
    assert field in flat(result.output)
    assert not out.exists()


def test_cli_bad_search_budget_exits_2_and_leaves_no_run_directory(tmp_path):
    # regression: search.* was unvalidated; the tool's ValueError escaped after the run dir was written
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["evolve", "--world", "small", "--set", "search.topk=0", "--out", str(out)])
    assert (result.exit_code, "search.topk" in flat(result.output), (out / "manifest.json").exists()) == (
        2, True, False)


def test_cli_missing_world_directory_exits_2_and_leaves_no_run_directory(tmp_path):
    # regression: the world was loaded after the run dir was written, and its ValueError escaped the CLI
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["evolve", "--world", str(tmp_path / "no-such-world"), "--out", str(out)])
    assert (result.exit_code, (out / "manifest.json").exists()) == (2, False)


def test_cli_audit_on_a_missing_run(tmp_path):
    result = CliRunner().invoke(app, ["audit", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "not a run directory" in flat(result.output)


def test_cli_negative_world_seed_exits_2_naming_the_field(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["evolve", "--set", "world.seed=-1", "--out", str(out)])
    assert (result.exit_code, "world.seed" in flat(result.output)) == (2, True)
    assert not (out / "manifest.json").exists()


@pytest.mark.parametrize("overrides, field", [
    (["lm.lr=3e-5"], "lm.lr"),  # sim backend: no language model to train
    (['backend="lm"', "solver.lr_theta=0.5"], "solver.lr_theta"),  # lm backend: no sim learners
    (['backend="lm"', "proposer.lr=0.7"], "proposer.lr"),
    (['backend="lm"', "world.shared_misreading=0.9"], "world.shared_misreading"),  # only sim readers misread
])
def test_a_setting_the_backend_never_reads_is_refused(overrides, field):
    # it would be recorded in config.json and silently ignored
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}: read only by the .* would ignore it"):
        load_config(None, overrides)


@pytest.mark.parametrize("override", ['world.name="small"', "world.confusable_rate=0.2", "world.value_skew=0.0"])
def test_a_world_setting_on_a_corpus_run_is_refused(tmp_path, override):
    # `--world small --corpus FILE`: the corpus replaces the world, so the setting would be recorded
    # in config.json and silently ignored
    on_corpus = ['backend="lm"', f'data.corpus="{tmp_path / "c.jsonl"}"', f'data.qa_dir="{tmp_path / "qa"}"']
    field = override.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}: read only on the synthetic world"):
        load_config(None, [*on_corpus, override])
    assert load_config(None, on_corpus).data.corpus  # the defaults pass
    assert load_config(None, ['backend="lm"', override]).world  # the lm backend on the world reads it


def test_a_config_file_with_a_bom_is_read(tmp_path):
    """Windows editors save UTF-8 with a BOM: it read as `Invalid statement (at line 1, column 1)`."""
    path = tmp_path / "c.toml"
    path.write_bytes(b"\xef\xbb\xbftreatment = \"crossfit\"\nseed = 3\n")
    cfg = load_config(path)
    assert (cfg.treatment, cfg.seed) == ("crossfit", 3)


def test_an_option_and_a_set_override_that_disagree_are_refused():
    """`--set treatment=crossfit --treatment msv` ran msv, and `--set world.name=small --world default` the
    default world (an option was applied over the overrides): one of the two silently lost. Agreeing, both
    are fine."""
    with pytest.raises(ConfigError, match=r"--set treatment='crossfit' and the option for treatment \('msv'\) "
                                          "disagree"):
        load_config(None, ["treatment=crossfit"], treatment="msv")
    with pytest.raises(ConfigError, match=r"--set world.name='small' and the option for world.name"):
        load_config(None, ["world.name=small"], **{"world.name": "default"})
    assert load_config(None, ["treatment=msv", "seed=3"], treatment="msv", seed=3).treatment == "msv"


def test_one_path_written_two_ways_is_no_disagreement_and_a_set_qa_dir_is_not_overridden(tmp_path, monkeypatch):
    """The option's path went through str(Path(...)) (dropping "./") and the override did not: one path
    was refused as two. And `--corpus C --set data.qa_dir=Q` compared Q with the qa/ directory inferred
    beside the corpus, which no option named: refused. The inferred one is used only where nothing names one."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["data.corpus=./c.jsonl", "data.qa_dir=q"], backend="lm", **{"data.corpus": "c.jsonl"})
    assert cfg.data.corpus == str(tmp_path / "c.jsonl")
    (tmp_path / "data" / "corpus").mkdir(parents=True)
    (tmp_path / "data" / "qa").mkdir()
    (tmp_path / "other").mkdir()
    corpus = tmp_path / "data" / "corpus" / "c.jsonl"
    corpus.write_text("")
    seen = []

    def stopped(cfg, out, **kw):
        seen.append(cfg.data.qa_dir)
        raise SystemExit(143)

    monkeypatch.setattr("selfevo.evolve.evolve", stopped)
    for extra, want in ((["--set", "data.qa_dir=other"], tmp_path / "other"), ([], tmp_path / "data" / "qa")):
        res = CliRunner().invoke(app, ["evolve", "--backend", "lm", "--corpus", str(corpus), *extra,
                                       "--out", str(tmp_path / "run")])
        assert res.exit_code == 143, res.output
        assert seen[-1] == str(want)
        # the inferred one is said (it was taken without a word)
        assert ("the qa/ beside the corpus's directory" in res.output) == (not extra), res.output


def test_a_config_error_says_whether_the_file_a_set_or_an_option_set_the_field(tmp_path):
    """`evolve --config typo.toml` said "loop.round: unknown field" with no word of the file, beside
    `--set` overrides it could as well have come from; a demo or engine-run config given to evolve
    did not say which command reads it (a helper's walk through the CLI)."""
    typo = tmp_path / "typo.toml"
    typo.write_text("[loop]\nround = 3\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(typo))}: loop.round: unknown field"):
        load_config(typo)
    with pytest.raises(ConfigError, match=r"^loop.roundz: unknown field .*\(set by --set\)$"):
        load_config(None, ["loop.roundz=2"])
    with pytest.raises(ConfigError, match=r"^treatment: "):  # an option: its message names it already
        load_config(None, [], treatment="nope")
    # an item of a field set by --set is the --set's, not the file's; --lm-set is named as itself
    fine = tmp_path / "fine.toml"
    fine.write_text("[loop]\nrounds = 2\n")
    with pytest.raises(ConfigError, match=r"^proposer.theta\[1\]: .*\(set by --set\)$"):
        load_config(fine, ['proposer.theta=[1, "x", 1, 1]'])
    with pytest.raises(ConfigError, match=r"^--lm-set 'lm.max_new_tokens': expected KEY=VALUE"):
        load_config(None, ["lm.max_new_tokens"], set_by="--lm-set")
    demo = tmp_path / "demo.toml"
    demo.write_text("[demo]\nseeds = 3\n")
    with pytest.raises(ConfigError, match=r"demo: unknown field .*this is a config for `selfevo demo --config`"):
        load_config(demo)


def test_grid_overrides_sent_to_another_working_directory_carry_absolute_paths(tmp_path, monkeypatch):
    """A Ray worker runs in a directory of its own: `world.name=relworld` (a world directory beside the
    driver) was read there as its own relworld, "not a world directory" (a helper's review); names
    that are no path (a world size, a hub id) and other fields pass unchanged."""
    from selfevo.config import absolute_overrides, parse_override

    monkeypatch.chdir(tmp_path)
    given = ["world.name=relworld", "world.name=small", 'data.corpus="c.jsonl"', "lm.model=./m",
             "lm.model=HuggingFaceTB/SmolLM2-135M-Instruct", "seed=3", "solver.memory=false"]
    assert [parse_override(x)[1] for x in absolute_overrides(given)] == [
        str(tmp_path / "relworld"), "small", str(tmp_path / "c.jsonl"), str(tmp_path / "m"),
        "HuggingFaceTB/SmolLM2-135M-Instruct", 3, False]
    # a character past the BMP (JSON's surrogate-pair escape is no TOML escape), and an override that is
    # no KEY=VALUE left for its job to refuse, not raised out of the whole grid (a review of the diff)
    assert [parse_override(x)[1] for x in absolute_overrides(['world.name="wé😀"'])] == [str(tmp_path / "wé😀")]
    assert absolute_overrides(["no equals sign"]) == ("no equals sign",)


@pytest.mark.parametrize("overrides, says", [
    (["data.eval_limit=-1"], "data.eval_limit: must be >= 0"),  # else a bare ValueError at round 0's evaluation
    (["backend=lm", "search.max_calls=0"], "search.max_calls: must be >= 1"),  # (the sim's hop check hides it)
    (['data.index="idx"'], "data.index: only with data.corpus"),  # a world run would ignore it
    (["backend=gpu"], "backend: must be sim or lm"),
    (['data.corpus="c.jsonl"', 'data.qa_dir="qa"'], "data.corpus: the sim backend runs on the synthetic world only"),
    (["search.topk=true"], "search.topk: expected an integer"),  # True passed `>= 1`
    (["seed=true"], "seed: expected an integer"),
    (["solver.temperature=inf"], "solver.temperature: must be finite"),  # no check of its own refuses inf
    (["backend=lm", "lm.format_penalty=nan"], "lm.format_penalty: must be finite"),
    (["solver.temperature=true"], "solver.temperature: expected a number"),  # else float(True) = 1.0
    (["treatment=crossfit-k3", "loop.source_docs=2"], "treatment: 'crossfit-k3' asks for 3 source folds"),
    (["world.name=' '"], "world.name: empty"),  # else the directory "./ ", refused only at the run's start
])
def test_each_check_of_a_run_config_refuses_by_itself(overrides, says):
    """Checks no other check stands in for: each named by its field, before anything runs."""
    with pytest.raises(ConfigError, match=f"^{re.escape(says)}"):
        load_config(None, overrides)


# ------------------------------------------------------------------ pinned by a mutation sweep (forty-sixth session)


def test_a_huge_integer_for_a_float_field_names_the_field_not_an_overflow():
    """float(10**400) raises OverflowError: it must come out as the field's ConfigError, its size given by length."""
    with pytest.raises(ConfigError, match=r"^solver\.lr_theta: must be finite, got an integer of 401 digits"):
        load_config(None, ["solver.lr_theta=1" + "0" * 400])


def test_a_set_value_may_itself_hold_an_equals_sign():
    """Only the first '=' splits KEY from VALUE: a quoted value keeps the rest whole."""
    from selfevo.config import parse_override

    assert parse_override('data.corpus="a=b.jsonl"') == (["data", "corpus"], "a=b.jsonl")
    assert parse_override("lm.model=org/x=y") == (["lm", "model"], "org/x=y")


def test_a_set_without_a_field_name_says_so():
    with pytest.raises(ConfigError, match=r"^--set '=3': no field name before '='"):
        load_config(None, ["=3"])
    with pytest.raises(ConfigError, match=r"^--lm-set ' =x': no field name before '='"):
        load_config(None, [" =x"], set_by="--lm-set")


def test_an_error_inside_a_table_set_whole_by_set_is_the_sets():
    """`--set loop={rounds=0}` sets the table loop: an error about loop.rounds is the --set's."""
    with pytest.raises(ConfigError, match=r"^loop\.rounds: must be a positive integer, got 0 \(set by --set\)$"):
        load_config(None, ["loop={rounds = 0}"])


def test_an_option_left_unset_does_not_take_the_blame_from_a_set():
    """A command passes every option, None where not given: an error is then the --set's, said so."""
    with pytest.raises(ConfigError, match=r"^seed: expected an integer, got 'x' \(set by --set\)$"):
        load_config(None, ["seed='x'"], seed=None, treatment=None)


def test_a_components_own_message_without_a_field_is_prefixed_with_its_table():
    """config._build: a component check that names no field is said under its table ("config" at the top)."""
    import dataclasses

    from selfevo.config import _build

    @dataclasses.dataclass(frozen=True)
    class Picky:
        n: int = 1

        def __post_init__(self):
            if self.n > 1:
                raise ValueError("too many")

    with pytest.raises(ConfigError, match=r"^sec: too many$"):
        _build(Picky, {"n": 2}, "sec")
    with pytest.raises(ConfigError, match=r"^config: too many$"):
        _build(Picky, {"n": 2})
    with pytest.raises(ConfigError, match=r"^sec\.n: expected an integer"):
        _build(Picky, {"n": "2"}, "sec")


@pytest.mark.parametrize("path, overrides, options, said", [
    (True, ["loop.rounds=2"], {}, "{path}: loop: expected a table, got int; --set loop.rounds=2 sets a field in it"),
    (False, ["loop=3", "loop.rounds=2"], {},
     "loop: expected a table, got int (set by --set); --set loop.rounds=2 sets a field in it"),
    (False, ["loop=3"], {"loop.rounds": 2},
     "loop: expected a table, got int (set by --set); the option for loop.rounds sets a field in it"),
    (True, [], {"loop.rounds": 2},
     "{path}: loop: expected a table, got int; the option for loop.rounds sets a field in it"),
])
def test_a_value_where_a_later_setting_needs_a_table_names_both_settings(tmp_path, path, overrides, options, said):
    """A file's `loop = 3` (or `--set loop=3`) under `--set loop.rounds=2` (or an option for loop.rounds) said only
    "loop: expected a table, got int", not which of the file, a --set or an option set what."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("loop = 3\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(cfg if path else None, overrides, **options)
    assert str(e.value) == said.format(path=cfg)


def test_one_override_string_or_run_directory_is_refused_not_read_as_its_characters(tmp_path):
    """From a helper's use of the Python API: `load_config(None, "loop.rounds=2")` said "--set 'l': expected
    KEY=VALUE"; a grid's `common="..."` built jobs of single characters; `build_bank("runs/x")` said a run
    directory was named twice."""
    from selfevo.experiments import grid
    from selfevo.replay import build_bank

    with pytest.raises(TypeError, match=r"overrides: a list of KEY=VALUE strings, got one string"):
        load_config(None, "loop.rounds=2")
    assert load_config(None, ["loop.rounds=2"]).loop.rounds == 2
    with pytest.raises(TypeError, match=r"common: a list of KEY=VALUE strings"):
        grid(["coupled"], [0], tmp_path / "g", common="loop.rounds=2")
    for one in ("runs/coupled-0", tmp_path / "run"):
        with pytest.raises(TypeError, match="run_dirs: a list of run directories, got one"):
            build_bank(one, size=10)
