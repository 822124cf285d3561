"""Bad input, generated (hypothesis): corpus and QA readers, writers, configs and the retriever API.

Every case must end in a successful read or in one clear error naming the file and line (or the
config field): never another exception, never a 5xx, never a half-written file. `max_examples`
is bounded so the whole module runs in well under a minute; `docs/reliability.md` says how many
examples each target saw (`pytest tests/test_fuzz.py --hypothesis-show-statistics`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import string
import typing
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import event as _event
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from test_config import flat
from test_search import server_url, small  # noqa: F401  (fixtures: a BM25 index, a real uvicorn on 127.0.0.1)
from typer.testing import CliRunner

from selfevo._io import check_local_path
from selfevo.cli import app
from selfevo.config import ConfigError, RunConfig, config_from_dict, load_config
from selfevo.corpus import DataError, count_lines, read_corpus, read_qa, read_qa_dir, write_corpus, write_qa
from selfevo.evaluate import scorable
from selfevo.records import Document, QAItem
from selfevo.search.server import make_app

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MAX_MESSAGE = 600  # one clear line, never an echo of a (possibly 10 MB) input


def event(label: str) -> None:
    """Count an outcome in hypothesis' statistics (`--hypothesis-show-statistics`)."""
    if currently_in_test_context():
        _event(label)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


# ------------------------------------------------------------------ strategies

ID = st.text(string.ascii_letters + string.digits + "-_.:", min_size=1, max_size=8)
TEXT = st.text(max_size=40)  # any code point except lone surrogates (hypothesis leaves those out)
SCALAR = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
JSON = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                           max_size=3), max_leaves=8)
BAD_UTF8 = st.sampled_from([b"\xff", b"\xfe\xff", b"\xc3(", b"\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"])


@st.composite
def corpus_rows(draw) -> list[dict]:
    ids = draw(st.lists(ID, min_size=1, max_size=6, unique=True))
    return [{"id": i, "contents": draw(TEXT)} for i in ids]


@st.composite
def qa_rows(draw) -> list[dict]:
    ids = draw(st.lists(ID, min_size=1, max_size=6, unique=True))
    rows = []
    for i in ids:
        row = {"id": i, "question": draw(TEXT.filter(str.strip)),
               # a valid row has a gold that survives normalisation (":" or "The" alone is refused)
               "golden_answers": draw(st.lists(TEXT.filter(str.strip), min_size=1, max_size=3).filter(scorable))}
        if draw(st.booleans()):
            row["metadata"] = {"benchmark": draw(st.sampled_from(["nq", "hotpotqa", "musique"]))}
        rows.append(row)
    return rows


def _line(obj, ascii_only: bool = False) -> bytes:
    return json.dumps(obj, ensure_ascii=ascii_only).encode("utf-8")


# Mutations of one line. "certain" ones must be refused at exactly that line; the others may
# read (a wrong type can be one the reader accepts, e.g. a numeric id) or be refused at that
# line or later (a numeric id can duplicate a later one).
CERTAIN = ("drop_field", "bad_utf8", "truncate", "not_object", "lone_surrogate", "duplicate_id", "deep_nesting")
OPS = (*CERTAIN, "retype", "garbage", "blank")


@st.composite
def mutated_file(draw, rows_strategy, required: tuple[str, ...]):
    """(file bytes, the mutation, 1-based line that may be refused or None, whether it must be)."""
    rows = draw(rows_strategy)
    lines = [_line(r) for r in rows]
    op = draw(st.sampled_from(("none", *OPS)))
    if op == "duplicate_id" and len(rows) < 2:
        op = "none"
    i = draw(st.integers(1 if op == "duplicate_id" else 0, len(rows) - 1))
    row = dict(rows[i])
    field = draw(st.sampled_from(required))
    if op == "drop_field":
        del row[field]
        lines[i] = _line(row)
    elif op == "retype":
        row[field] = draw(JSON.filter(lambda v: not isinstance(v, str)))
        lines[i] = _line(row)
    elif op == "bad_utf8":
        at = draw(st.integers(0, len(lines[i])))
        lines[i] = lines[i][:at] + draw(BAD_UTF8) + lines[i][at:]
    elif op == "truncate":
        lines[i] = lines[i][:draw(st.integers(1, len(lines[i]) - 1))]
    elif op == "not_object":
        lines[i] = _line(draw(JSON.filter(lambda v: not isinstance(v, dict))))
    elif op == "lone_surrogate":  # valid UTF-8, valid JSON, yet no text: "\ud800" never encodes
        row[field] = draw(TEXT) + draw(st.sampled_from(["\ud800", "\udfff", "\udc00x"]))
        lines[i] = _line(row, ascii_only=True)
    elif op == "duplicate_id":
        row["id"] = rows[draw(st.integers(0, i - 1))]["id"]
        lines[i] = _line(row)
    elif op == "deep_nesting":  # shallow: a wrong type; deep: past the JSON parser's recursion limit
        depth = draw(st.sampled_from([1, 2, 50, 5_000, 200_000]))
        lines[i] = _line(row)[:-1] + f', "{field}": '.encode() + b"[" * depth + b"]" * depth + b"}"
    elif op == "garbage":
        lines[i] = draw(st.binary(min_size=1, max_size=64).filter(lambda b: b"\n" not in b))
    elif op == "blank":
        lines[i] = draw(st.sampled_from([b"", b"   ", b"\t", b"\r"]))
    data = b"\n".join(lines) + draw(st.sampled_from([b"\n", b"", b"\r\n", b"\n\n"]))
    return data, op, (None if op in ("none", "blank") else i + 1), op in CERTAIN


def check_read(reader, path: Path, bad_line: int | None = None, certain: bool = False):
    """The reader's only acceptable outcomes: a value, or one DataError naming file (and line)."""
    try:
        out = reader(path)
    except DataError as e:
        event("outcome: DataError")
        msg = str(e)
        assert e.path == str(path) and msg.startswith(f"{path}"), msg
        assert len(msg) < MAX_MESSAGE and "\n" not in msg, msg[:MAX_MESSAGE]
        if e.line is None:  # only whole-file problems carry no line
            assert any(w in e.message for w in ("empty", "parquet", "not found", "cannot read", "archive")), msg
            assert not certain, (msg, bad_line)
        else:
            assert msg.startswith(f"{path}:{e.line}: ") and e.line >= 1, msg
            if bad_line is not None:
                assert e.line >= bad_line, (msg, bad_line)  # every line before it was valid
                if certain:
                    assert e.line == bad_line, (msg, bad_line)
        return e
    assert not certain, f"{path}: line {bad_line} should have been refused"
    event("outcome: read")
    return out


# ------------------------------------------------------------------ corpus and QA readers


@FUZZ
@given(case=mutated_file(corpus_rows(), ("id", "contents")))
def test_corpus_reader_on_mutated_lines(work, case):
    data, op, bad, certain = case
    event(f"mutation: {op}")
    path = work / "corpus.jsonl"
    path.write_bytes(data)
    out = check_read(read_corpus, path, bad, certain)
    if op in ("none", "blank"):  # valid: every non-blank line reads back
        ids = [json.loads(line)["id"] for line in data.splitlines() if line.strip()]
        assert [d.id for d in out] == ids if ids else isinstance(out, DataError)


@FUZZ
@given(case=mutated_file(qa_rows(), ("id", "question", "golden_answers")))
def test_qa_reader_on_mutated_lines(work, case):
    data, op, bad, certain = case
    event(f"mutation: {op}")
    path = work / "qa.jsonl"
    path.write_bytes(data)
    out = check_read(read_qa, path, bad, certain)
    if op in ("none", "blank"):
        assert [it.id for it in out] == [json.loads(line)["id"] for line in data.splitlines() if line.strip()]


@FUZZ
@given(data=st.binary(max_size=400) | st.lists(st.sampled_from(
    [b"{", b"}", b'"id"', b'"contents"', b'"question"', b'"golden_answers"', b":", b",", b"[", b"]", b'"x"', b"1",
     b"NaN", b"null", b"\n", b" ", b"\xff", b"\xef\xbb\xbf", b'"\\ud800"']), max_size=40).map(b"".join))
def test_readers_on_arbitrary_bytes(work, data):
    for reader, name in ((read_corpus, "bytes.corpus.jsonl"), (read_qa, "bytes.qa.jsonl")):
        path = work / name
        path.write_bytes(data)
        check_read(reader, path)


@settings(FUZZ, max_examples=60)
@given(rows=qa_rows(), cut=st.floats(0, 1), flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)),
                                                          max_size=4))
def test_parquet_reader_on_corrupted_files(work, rows, cut, flips):
    path = work / "qa.parquet"
    items = [QAItem(r["id"], r["question"], tuple(r["golden_answers"]), r.get("metadata", {})) for r in rows]
    write_qa(path, items)
    assert [it.id for it in read_qa(path)] == [it.id for it in items]  # the intact file reads
    data = bytearray(path.read_bytes())
    for where, byte in flips:
        data[int(where * (len(data) - 1))] = byte
    path.write_bytes(bytes(data[: max(1, int(cut * len(data)))] if cut < 1 else data))
    check_read(read_qa, path)


def test_parquet_reader_on_every_one_byte_damage(work):
    # found by a hypothesis draw that CI rarely makes: a damaged page header gave a DataError whose
    # message was pyarrow's, newlines and raw bytes included, and a damaged string a bare
    # UnicodeDecodeError; here every byte of a one-row file is damaged in turn
    path = work / "one.parquet"
    write_qa(path, [QAItem("q1", "Who?", ("x",), {})])
    data = path.read_bytes()
    for i in range(len(data)):
        for byte in (0, 255):
            path.write_bytes(data[:i] + bytes([byte]) + data[i + 1:])
            check_read(read_qa, path)


PARQUET_COLUMNS = {
    "id": st.sampled_from([pa.string(), pa.int64(), pa.float64(), pa.bool_()]),
    "question": st.sampled_from([pa.string(), pa.int64(), pa.list_(pa.string())]),
    "golden_answers": st.sampled_from([pa.list_(pa.string()), pa.list_(pa.int64()), pa.string(), pa.int64(),
                                       pa.struct([("a", pa.string())])]),
}


@settings(FUZZ, max_examples=60)
@given(types=st.fixed_dictionaries(PARQUET_COLUMNS), drop=st.sets(st.sampled_from(list(PARQUET_COLUMNS))),
       n=st.integers(0, 4), nulls=st.booleans(), dup=st.booleans())
def test_parquet_reader_on_wrong_column_types(work, types, drop, n, nulls, dup):
    def value(t: pa.DataType, i: int):
        if nulls and i == n - 1:
            return None
        if pa.types.is_list(t):
            return [value(t.value_type, i)]
        if pa.types.is_struct(t):
            return {"a": "x"}
        return {pa.string(): f"v{0 if dup else i}", pa.int64(): i if not dup else 0,
                pa.float64(): i + 0.5, pa.bool_(): i % 2 == 0}[t]

    cols = {c: pa.array([value(t, i) for i in range(n)], type=t) for c, t in types.items() if c not in drop}
    path = work / "typed.parquet"
    pq.write_table(pa.table(cols) if cols else pa.table({"other": pa.array([1] * n)}), path)
    out = check_read(read_qa, path)
    if isinstance(out, DataError) and out.line is not None:
        assert 1 <= out.line <= n


def test_huge_document_reads_and_a_broken_one_is_named_briefly(tmp_path):
    """A 10 MB document is valid input; a broken 10 MB line is one short error, not an echo."""
    big = "lorem ipsum dolor " * (10 * 2**20 // 18)
    assert len(big) >= 10_000_000
    path = tmp_path / "corpus.jsonl"
    write_corpus(path, [Document("a", "A", "small"), Document("big", "Big", big), Document("c", "C", "end")])
    docs = read_corpus(path)
    assert [d.id for d in docs] == ["a", "big", "c"] and docs[1].text == big
    qa = tmp_path / "qa.jsonl"
    write_qa(qa, [QAItem("q1", big, ("x",)), QAItem("q2", "short?", (big,))])
    assert [len(it.question) for it in read_qa(qa)] == [len(big), 6]

    lines = path.read_bytes().split(b"\n")
    lines[1] = lines[1][:-2]  # drop the closing quote and brace of the 10 MB line
    path.write_bytes(b"\n".join(lines))
    e = check_read(read_corpus, path, bad_line=2, certain=True)
    assert "malformed JSON" in e.message


def test_empty_inputs(tmp_path):
    for content in (b"", b"\n\n", b"   \n\t\n"):
        (tmp_path / "c.jsonl").write_bytes(content)
        e = check_read(read_corpus, tmp_path / "c.jsonl")
        assert isinstance(e, DataError) and e.line is None and "corpus is empty" in str(e)
        (tmp_path / "q.jsonl").write_bytes(content)
        assert read_qa(tmp_path / "q.jsonl") == []  # an empty QA file is an empty benchmark
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .jsonl, .jsonl.gz or .parquet"):
        read_qa_dir(tmp_path / "empty")
    for missing in (tmp_path / "nope.jsonl", tmp_path / "nope.parquet"):
        assert isinstance(check_read(read_qa, missing), DataError)
    # a directory where a file was expected is a usage error, not an IsADirectoryError
    (tmp_path / "dir.jsonl").mkdir()
    e = check_read(read_corpus, tmp_path / "dir.jsonl")
    assert isinstance(e, DataError)


def test_duplicate_ids_across_qa_files_name_both(tmp_path):
    write_qa(tmp_path / "a.jsonl", [QAItem("1", "q?", ("x",))])
    write_qa(tmp_path / "b.parquet", [QAItem("2", "q?", ("x",)), QAItem("1", "again?", ("y",))])
    with pytest.raises(DataError) as exc:
        read_qa_dir(tmp_path)
    assert str(exc.value).startswith(str(tmp_path / "b.parquet")) and str(tmp_path / "a.jsonl") in str(exc.value)


@pytest.mark.parametrize("row, problem", [
    ({"id": "1", "question": "q", "reward_model": "x"}, "reward_model"),
    ({"id": "1", "question": "q", "reward_model": {"ground_truth": ["x"]}}, "ground_truth"),
    ({"id": "1", "question": "q", "golden_answers": ["x"], "data_source": 5}, "data_source"),
    ({"id": "1", "question": "q", "golden_answers": ["x"], "metadata": {"benchmark": ["nq"]}}, "benchmark"),
])
def test_search_r1_fields_of_the_wrong_type_are_data_errors(tmp_path, row, problem):
    # found by test_qa_reader_on_mutated_lines: these once raised AttributeError, or read a
    # benchmark name that crashed read_qa_dir later (an unhashable list as a dict key)
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    e = check_read(read_qa, path, bad_line=1, certain=True)
    assert problem in e.message


# ------------------------------------------------------------------ writers: all or nothing


class Boom(RuntimeError):
    pass


@settings(FUZZ, max_examples=40)
@given(n_before=st.integers(0, 5), how=st.sampled_from(["raise", "surrogate"]), existing=st.booleans(),
       fmt=st.sampled_from(["corpus", "qa.jsonl", "qa.parquet"]))
def test_a_writer_that_fails_midway_leaves_the_old_file_or_nothing(work, n_before, how, existing, fmt):
    folder = work / f"writer-{fmt}-{existing}"
    folder.mkdir(exist_ok=True)
    for p in folder.iterdir():
        p.unlink()
    path = folder / ("corpus.jsonl" if fmt == "corpus" else f"out.{fmt.split('.')[1]}")
    old = b""
    if existing:
        if fmt == "corpus":
            write_corpus(path, [Document("old", "Old", "previous content")])
        else:
            write_qa(path, [QAItem("old", "previous?", ("yes",))])
        old = path.read_bytes()

    def items():
        for i in range(n_before):
            yield (Document(f"d{i}", "T", "text " * 100) if fmt == "corpus" else QAItem(f"q{i}", "q?", ("x",)))
        if how == "raise":
            raise Boom("the source failed midway")
        bad = "lone \ud800 surrogate"  # cannot be encoded: the writer itself fails midway
        yield Document("bad", bad, bad) if fmt == "corpus" else QAItem("bad", bad, (bad,))

    with pytest.raises((Boom, UnicodeEncodeError, pa.ArrowException)):
        (write_corpus if fmt == "corpus" else write_qa)(path, items())
    assert sorted(p.name for p in folder.iterdir()) == (["corpus.jsonl" if fmt == "corpus" else path.name]
                                                        if existing else [])  # no temp file left over
    if existing:
        assert path.read_bytes() == old


# ------------------------------------------------------------------ configs


def _schema_keys(cls=RunConfig, prefix: str = "") -> list[str]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        out.append(key)
        if dataclasses.is_dataclass(hints[f.name]):
            out += _schema_keys(hints[f.name], key + ".")
    return out


SCHEMA_KEYS = _schema_keys()
KEYS = (st.sampled_from(SCHEMA_KEYS) | st.sampled_from(SCHEMA_KEYS).map(lambda k: k + ".x")
        | st.sampled_from(["bogus", "loop.bogus", "loop..rounds", "solver.memory.deep.er", ".seed", "seed."]))
TOML_SCALAR = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["nan", "+nan", "-nan", "inf", "-inf", "1e400", "-0.0", "1e308", "0", "1" + "0" * 400,
                     "0x10", "1_000", "true", "false", "1979-05-27", "07:32:00", "1979-05-27T07:32:00Z",
                     "{a = 1}", "{}", "[]", "'[/x]'", '"\\ud800"', "", "=", "[1, 'a']", "[[1], [2]]"]),
    st.floats().map(repr),
    st.text(max_size=12).map(json.dumps),
    st.text(string.printable.replace("\n", "").replace("\r", ""), max_size=12),  # often not TOML: a bare string
)
TOML_VALUE = TOML_SCALAR | st.lists(TOML_SCALAR, max_size=5).map(lambda xs: "[" + ", ".join(xs) + "]")
OVERRIDES = st.lists(st.tuples(KEYS, TOML_VALUE), min_size=1, max_size=4)


def names_a_given_field(message: str, keys: list[str]) -> bool:
    field = message.split(": ", 1)[0]
    return any(k == field or k.startswith(field + ".") or field.startswith((k + ".", k + "["))
               for k in (k.strip() for k in keys))


@settings(FUZZ, max_examples=300)
@given(pairs=OVERRIDES)
@example(pairs=[("lm.top_p", "0")])  # once named lm.temperature: two fields' checks shared one message
@example(pairs=[("loop.proposer_steps", "333309")])  # once named loop.rounds alone
@example(pairs=[("world.name", '"~0"')])  # a home of no user here: once a RuntimeError traceback
def test_config_overrides_give_a_valid_config_or_an_error_naming_the_field(pairs):
    overrides = [f"{k}={v}" for k, v in pairs]
    try:
        cfg = load_config(None, overrides)
    except ConfigError as e:
        event("outcome: ConfigError")
        assert names_a_given_field(str(e), [k for k, _ in pairs]), (str(e), overrides)
        assert len(str(e)) < 2 * MAX_MESSAGE
        return
    assert isinstance(cfg, RunConfig)
    event("outcome: valid config")
    text = json.dumps(cfg.to_json(), allow_nan=False)  # no NaN or infinity survives parsing
    assert config_from_dict(json.loads(text)) == cfg


@pytest.mark.parametrize("key", SCHEMA_KEYS)
def test_every_field_with_an_out_of_range_value_is_named(key):
    """Exhaustive where the fuzzer samples: each field of the schema with each of a few boundary
    values either loads or fails naming that field (never a neighbour checked in the same line)."""
    for value in ("0", "-1", "-0.5", "0.5", "3", "1e9", "nan", "inf", "'x'", "true", "[]", "[-1, 0]"):
        try:
            load_config(None, [f"{key}={value}"])
        except ConfigError as e:
            assert names_a_given_field(str(e), [key]), (key, value, str(e))


@settings(FUZZ, max_examples=40)
@given(pairs=OVERRIDES)
def test_cli_bad_overrides_exit_2_and_write_nothing(work, pairs):
    overrides = [f"{k}={v}" for k, v in pairs]
    try:
        load_config(None, overrides)
        event("skipped: a valid config")
        return  # a valid config would start a real run; the property is about the bad ones
    except ConfigError as e:
        field = str(e).split(": ", 1)[0]
    event("ran the CLI")
    out = work / "cli-run"
    args = ["evolve", "--out", str(out)]
    for o in overrides:
        args += ["--set", o]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (overrides, result.output, result.exception)
    assert "Traceback" not in result.output and field in flat(result.output), (field, result.output)
    assert not (out / "manifest.json").exists() and not out.exists()


def test_cli_error_message_with_markup_like_text(tmp_path):
    # found by test_cli_bad_overrides_exit_2_and_write_nothing: cli._fail once printed the message as
    # rich markup, so a value like "[/x]" raised MarkupError (a traceback, exit 1)
    result = CliRunner().invoke(app, ["evolve", "--out", str(tmp_path / "r"), "--set", "treatment=[/x]"])
    assert result.exit_code == 2 and "[/x]" in result.output and "Traceback" not in result.output


@settings(FUZZ, max_examples=60)
@given(data=st.binary(max_size=200) | TOML_VALUE.map(lambda v: f"seed = 1\n[loop]\nrounds = {v}\n".encode()))
def test_config_files_give_a_config_or_an_error_naming_the_file_or_field(work, data):
    path = work / "fuzz.toml"
    path.write_bytes(data)
    try:
        load_config(path)
        event("outcome: valid config")
    except ConfigError as e:
        event("outcome: ConfigError")
        assert str(e).startswith((str(path), "loop.rounds:", "loop:", "seed:")), str(e)


def test_unreadable_config_file_is_a_config_error(tmp_path):
    for path in (tmp_path / "missing.toml", tmp_path):
        with pytest.raises(ConfigError, match=re.escape(str(path))):
            load_config(path)
    (tmp_path / "latin1.toml").write_bytes(b"treatment = \"caf\xe9\"\n")
    with pytest.raises(ConfigError, match="latin1.toml"):
        load_config(tmp_path / "latin1.toml")
    result = CliRunner().invoke(app, ["evolve", "--out", str(tmp_path / "r"), "--config", str(tmp_path / "no.toml")])
    assert result.exit_code == 2 and not (tmp_path / "r").exists()


# ------------------------------------------------------------------ bad data through the CLI


def test_cli_data_errors_exit_2_naming_file_and_line_and_write_nothing(tmp_path):
    qa = tmp_path / "qa"
    qa.mkdir()
    write_qa(qa / "nq.jsonl", [QAItem("1", "Who?", ("x",))])
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(b'{"id": "1", "contents": "\\"A\\"\\ntext"}\n{"id": "2", "contents": 3}\n')
    out = tmp_path / "eval"
    result = CliRunner().invoke(app, ["eval", "--data-dir", str(qa), "--corpus", str(corpus), "--out", str(out)])
    assert result.exit_code == 2 and f"{corpus}:2:" in flat(result.output), result.output
    assert not [p for p in out.rglob("*") if p.is_file()]

    (qa / "bad.jsonl").write_bytes(b'{"id": "2", "question": "Q", "golden_answers": ["x"]}\n{"id": \xff}\n')
    preds = tmp_path / "preds.jsonl"
    preds.write_text('{"id": "1", "prediction": "x"}\n', encoding="utf-8")
    result = CliRunner().invoke(app, ["score", "--data-dir", str(qa), "--predictions", str(preds),
                                      "--out", str(tmp_path / "score.json")])
    assert result.exit_code == 2 and f"{qa / 'bad.jsonl'}:2:" in flat(result.output), result.output
    assert not (tmp_path / "score.json").exists()

    result = CliRunner().invoke(app, ["serve-retriever", "--corpus", str(corpus), "--port", "1"])
    assert result.exit_code == 2 and f"{corpus}:2:" in flat(result.output), result.output


# ------------------------------------------------------------------ the retriever API

QUERY = st.text(max_size=30) | st.sampled_from(["zebra", "river Europe", "", " ", "x" * 2000, "x" * 2001])
RETRIEVE_BODY = st.one_of(
    JSON.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {"queries": st.lists(QUERY, max_size=10) | JSON},
        optional={"topk": st.integers(-3, 8) | JSON | st.sampled_from([3.0, "3", 1e400, True]),
                  "return_scores": st.booleans() | JSON, "extra": JSON},
    ).map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=200),
)


def check_retrieve_answer(r: httpx.Response, body: bytes) -> None:
    event(f"status: {r.status_code}")
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, body[:200], r.text[:300])
    if r.status_code == 200:
        req = json.loads(body)
        result = r.json()["result"]
        assert len(result) == len(req["queries"]) and all(len(hits) <= 5 for hits in result)
    else:
        assert "detail" in r.json() and len(r.content) < 20_000  # a clear refusal, no echo of the input


@pytest.fixture(scope="module")
def api(small):  # noqa: F811
    with TestClient(make_app(small, max_queries=8, max_topk=5), raise_server_exceptions=False) as client:
        yield client


@settings(FUZZ, max_examples=300)
@given(body=RETRIEVE_BODY, content_type=st.sampled_from(["application/json", "text/plain", None]))
def test_retrieve_answers_200_or_4xx_never_5xx(api, body, content_type):
    headers = {"content-type": content_type} if content_type else {}
    check_retrieve_answer(api.post("/retrieve", content=body, headers=headers), body)
    assert api.get("/health").status_code == 200


@settings(FUZZ, max_examples=25)
@given(body=RETRIEVE_BODY)
def test_retrieve_over_real_http_answers_200_or_4xx(server_url, body):  # noqa: F811
    r = httpx.post(f"{server_url}/retrieve", content=body, headers={"content-type": "application/json"})
    check_retrieve_answer(r, body)
    assert httpx.get(f"{server_url}/health").json()["status"] == "ok"


def test_gzipped_and_bom_files_read_as_plain_jsonl(tmp_path):
    """A QA file as `nq.jsonl.gz` was skipped by read_qa_dir without a word (the macro average lost a
    benchmark); a corpus gzipped under any name, or with the UTF-8 BOM Windows tools write, was refused."""
    import gzip

    write_qa(tmp_path / "qa" / "tq.jsonl", [QAItem("t1", "q?", ("x",))])
    plain = tmp_path / "nq.jsonl"
    write_qa(plain, [QAItem("n1", "q?", ("x",)), QAItem("n2", "q2?", ("y",))])
    (tmp_path / "qa" / "nq.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    got = read_qa_dir(tmp_path / "qa")
    assert {name: [it.id for it in items] for name, items in got.items()} == {"nq": ["n1", "n2"], "tq": ["t1"]}

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, [Document("a", "A", "alpha"), Document("b", "B", "beta")])
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + corpus.read_bytes())
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(corpus.read_bytes()))
    for path in (tmp_path / "bom.jsonl", tmp_path / "c.jsonl.gz"):
        assert read_corpus(path) == read_corpus(corpus)
    # a BOM anywhere but the file's start is still no JSON; a truncated gzip is one error naming the file
    (tmp_path / "bom2.jsonl").write_bytes(corpus.read_bytes() + b"\xef\xbb\xbf{}\n")
    assert check_read(read_corpus, tmp_path / "bom2.jsonl", bad_line=3, certain=True)
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(corpus.read_bytes() * 50)[:60])
    e = check_read(read_corpus, tmp_path / "cut.jsonl.gz")
    assert isinstance(e, DataError) and "damaged gzip" in e.message
    # FlashRAG ships wiki18_100w.zip: it was "invalid UTF-8 at byte 10" on line 1
    import bz2
    import lzma
    import zipfile

    with zipfile.ZipFile(tmp_path / "c.zip", "w") as zf:
        zf.writestr("c.jsonl", corpus.read_bytes())
    (tmp_path / "c.jsonl.bz2").write_bytes(bz2.compress(corpus.read_bytes()))
    (tmp_path / "c.jsonl.xz").write_bytes(lzma.compress(corpus.read_bytes()))
    for name, kind in (("c.zip", "zip"), ("c.jsonl.bz2", "bzip2"), ("c.jsonl.xz", "xz")):
        with pytest.raises(DataError, match=f"^{tmp_path / name}: a {kind} archive, which is not read: unpack it"):
            read_corpus(tmp_path / name)
    # a QA set may be Search-R1 parquet (read by its name), a corpus not: its bytes were "invalid UTF-8 at byte 7"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"id": "1", "contents": "x"}]), tmp_path / "c.parquet")
    with pytest.raises(DataError, match=f"^{tmp_path / 'c.parquet'}: a parquet file, which is read only as a QA set"):
        read_corpus(tmp_path / "c.parquet")


# Tests of a mutation sweep of the retrieval stack (forty-first session): each passes on the code and
# fails on the mutant its docstring names, or on the code before this session's fix.

@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_id_is_no_id(tmp_path, value):
    """Numeric ids are read as strings ("7"); a JSON true is not a number there: it would become the id
    "True" (and `true` in two lines a duplicate of nothing the file says)."""
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "a", "contents": "x"}) + "\n" + json.dumps({"id": value, "contents": "y"}) + "\n",
                    encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.jsonl:2: field 'id' must be a string, got bool"):
        read_corpus(path)
    qa = tmp_path / "q.jsonl"
    qa.write_text(json.dumps({"id": value, "question": "q?", "golden_answers": ["x"]}) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"q\.jsonl:1: field 'id' must be a string, got bool"):
        read_qa(qa)


def test_a_qa_line_whose_gold_is_one_string_reads_as_one_alias(tmp_path):
    """`"golden_answers": "Paris"` (a bare string, as some exports write one answer) is one alias, never
    five one-letter ones (each of which would be a substring of almost any prediction under Cover-EM)."""
    path = tmp_path / "nq.jsonl"
    path.write_text(json.dumps({"id": "1", "question": "q?", "golden_answers": "Paris"}) + "\n", encoding="utf-8")
    assert read_qa(path)[0].golden_answers == ("Paris",)


def test_parquet_rows_without_ids_are_numbered_from_zero_like_extra_info_index(tmp_path):
    """A Search-R1 parquet without an `id` column: a row's id is its `extra_info.index`, else its 0-based
    row number, the same numbering, so ids do not shift between files that carry the index and files that
    do not."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": f"q{i}?", "golden_answers": ["x"], "data_source": "nq"} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    assert [it.id for it in read_qa(tmp_path / "t.parquet")] == ["0", "1", "2"]
    indexed = [{**r, "extra_info": {"index": i}} for i, r in enumerate(rows)]
    pq.write_table(pa.Table.from_pylist(indexed), tmp_path / "u.parquet")
    assert [it.id for it in read_qa(tmp_path / "u.parquet")] == ["0", "1", "2"]


def test_a_merged_parquet_qualifies_only_the_ids_not_yet_qualified(tmp_path):
    """Ids repeated across benchmarks are qualified `<benchmark>-<id>`; one already so (as `selfevo data
    download` writes them) is kept, never `nq-nq-5`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": i, "question": "q?", "golden_answers": ["x"], "data_source": b}
            for i, b in (("test_0", "nq"), ("test_0", "hotpotqa"), ("nq-5", "nq"))]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    assert [it.id for it in read_qa(tmp_path / "test.parquet")] == ["nq-test_0", "hotpotqa-test_0", "nq-5"]


def test_the_qa_hash_changes_when_a_file_is_renamed(tmp_path):
    """A file's name is its benchmark when its rows name none: the same bytes as tq.jsonl instead of
    nq.jsonl are other questions for an evaluation to match, so the directory's hash must differ."""
    from selfevo.corpus import qa_sha256

    (tmp_path / "a").mkdir()
    write_qa(tmp_path / "a" / "nq.jsonl", [QAItem("1", "q?", ("x",))])
    before = qa_sha256(tmp_path / "a")
    (tmp_path / "a" / "nq.jsonl").rename(tmp_path / "a" / "tq.jsonl")
    assert qa_sha256(tmp_path / "a") != before


def test_a_qa_directory_reads_past_json_files_that_are_no_questions(tmp_path):
    """A *.json file is refused as an unread benchmark only when it holds JSON Lines of questions; a
    one-line JSON object of anything else (a config, a score.json) is not a benchmark."""
    write_qa(tmp_path / "nq.jsonl", [QAItem("1", "q?", ("x",))])
    (tmp_path / "notes.json").write_text(json.dumps({"source": "hand-made", "n": 1}) + "\n", encoding="utf-8")
    assert [it.id for it in read_qa_dir(tmp_path)["nq"]] == ["1"]
    (tmp_path / "tq.json").write_text(json.dumps({"id": "2", "question": "q?", "golden_answers": ["y"]}) + "\n")
    with pytest.raises(DataError, match=r"tq\.json: in a QA directory but not read"):
        read_qa_dir(tmp_path)


def test_an_empty_qa_file_in_a_directory_is_named_not_dropped(tmp_path):
    """read_qa of an empty file is an empty benchmark, but in a QA directory it would drop out of the macro
    average without a word: refused naming the file."""
    write_qa(tmp_path / "nq.jsonl", [QAItem("1", "q?", ("x",))])
    (tmp_path / "tq.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"tq\.jsonl: no questions"):
        read_qa_dir(tmp_path)


def test_a_parquet_written_for_several_benchmarks_keeps_each_rows_benchmark(tmp_path):
    """write_qa to parquet records each item's benchmark as `data_source`; the file's stem is only the
    fallback for items that name none."""
    items = [QAItem("nq-1", "q?", ("x",), {"benchmark": "nq"}), QAItem("hotpotqa-1", "r?", ("y",),
                                                                       {"benchmark": "hotpotqa"}),
             QAItem("3", "s?", ("z",))]
    write_qa(tmp_path / "test.parquet", items)
    assert [it.benchmark for it in read_qa(tmp_path / "test.parquet")] == ["nq", "hotpotqa", "test"]


# Tests of a mutation sweep of the corpus readers (forty-third session): each passes on the code and fails
# on the mutant its docstring names.

def test_a_data_error_quoting_an_id_with_control_characters_is_one_printable_line(tmp_path):
    """An id is quoted into the message ("duplicate id ..."): an escape sequence in it must not reach the
    terminal (mutant: only whitespace collapsed, the ESC kept)."""
    path = tmp_path / "c.jsonl"
    line = json.dumps({"id": "a\x1b[2J\x07b", "contents": "x"}) + "\n"
    path.write_text(line + line, encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.jsonl:2: duplicate id 'a\?\[2J\?b'") as e:
        read_corpus(path)
    assert str(e.value).isprintable()


def test_a_missing_file_is_named_as_missing(tmp_path):
    """(mutant: the existence check dropped: "cannot read: No such file or directory", from open)"""
    for reader in (read_corpus, read_qa):
        with pytest.raises(DataError, match=r"nope\.jsonl: file not found$"):
            reader(tmp_path / "nope.jsonl")


def test_a_bom_before_a_valid_line_past_the_first_is_refused_at_its_line(tmp_path):
    """Only the file's first line may start with a BOM (as Windows tools write one file); one before an
    otherwise valid line later on (two files concatenated) is malformed JSON there. The BOM test above puts it
    before `{}`, refused anyway for its missing id (mutant: the BOM stripped on every line, the file read)."""
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'{"id": "a", "contents": "x"}\n\xef\xbb\xbf{"id": "b", "contents": "y"}\n')
    with pytest.raises(DataError, match=r"c\.jsonl:2: malformed JSON"):
        read_corpus(path)


def test_json_nested_past_the_parsers_limit_is_a_data_error_at_its_line(tmp_path):
    """(mutant: the RecursionError branch dropped: a traceback; the fuzz test draws this depth only now and then)"""
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "a", "contents": "x"}) + '\n{"id": "b", "contents": "y", "z": '
                    + "[" * 100_000 + "]" * 100_000 + "}\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.jsonl:2: malformed JSON: nested too deeply"):
        read_corpus(path)


@pytest.mark.parametrize("escape", ["\\ud800", "\\udbff", "\\udc00", "\\uDFFF"])
def test_a_lone_surrogate_escape_high_or_low_is_refused_at_its_line(tmp_path, escape):
    """(mutant: the escape pattern limited to high surrogates \\ud8-\\udb: a lone low one read, to fail every
    later write)"""
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "a", "contents": "x"}) + '\n{"id": "b", "contents": "y' + escape + '"}\n',
                    encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.jsonl:2: invalid Unicode: a lone surrogate"):
        read_corpus(path)


def test_a_gold_list_with_a_non_string_after_a_string_is_a_data_error(tmp_path):
    """(mutant: the all-strings check dropped: `any(g.strip() ...)` stops at "x", then 7 .strip() is an
    AttributeError)"""
    path = tmp_path / "nq.jsonl"
    path.write_text(json.dumps({"id": "1", "question": "q?", "golden_answers": ["x", 7]}) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"nq\.jsonl:1: field 'golden_answers' must hold only strings"):
        read_qa(path)


@pytest.mark.parametrize("metadata", ['"nq"', '["ab"]', "5"])
def test_metadata_that_is_not_an_object_is_a_data_error_at_its_line(tmp_path, metadata):
    """(mutant: the check dropped: "nq" a bare ValueError from dict(), 5 a TypeError, and ["ab"] read silently
    as the metadata {"a": "b"})"""
    path = tmp_path / "nq.jsonl"
    path.write_text('{"id": "1", "question": "q?", "golden_answers": ["x"]}\n'
                    '{"id": "2", "question": "q?", "golden_answers": ["x"], "metadata": ' + metadata + "}\n",
                    encoding="utf-8")
    with pytest.raises(DataError, match=r"nq\.jsonl:2: field 'metadata' must be an object"):
        read_qa(path)


def test_parquet_rows_whose_id_is_null_are_numbered_like_rows_without_one(tmp_path):
    """An `id` column of nulls (a frame written with the column but no values) is no id: the row's
    `extra_info.index`, else its 0-based row number (mutant: only a missing column numbered, a null refused as
    "field 'id' must be a string")."""
    rows = [{"id": None, "question": f"q{i}?", "golden_answers": ["x"], "data_source": "nq"} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    assert [it.id for it in read_qa(tmp_path / "t.parquet")] == ["0", "1", "2"]
    rows[0] = {**rows[0], "extra_info": {"index": 7}}
    rows[1] = {**rows[1], "id": "b"}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "u.parquet")
    assert [it.id for it in read_qa(tmp_path / "u.parquet")] == ["7", "b", "2"]


def test_parquet_rows_without_ids_whose_extra_info_is_no_object_are_numbered_by_row(tmp_path):
    """An `extra_info` column of another type (a string) holds no index: rows are numbered from zero
    (mutant: `extra.get` called on it, an AttributeError)."""
    rows = [{"question": f"q{i}?", "golden_answers": ["x"], "data_source": "nq", "extra_info": "split=test"}
            for i in range(2)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    assert [it.id for it in read_qa(tmp_path / "t.parquet")] == ["0", "1"]


def test_a_parquet_written_carries_both_gold_fields_search_r1_and_flashrag_read(tmp_path):
    """Search-R1's reward reads `reward_model.ground_truth.target`, FlashRAG-style readers `golden_answers`:
    the file has both (mutant: `golden_answers` left out, which this reader's fallback hid on a round trip)."""
    write_qa(tmp_path / "t.parquet", [QAItem("1", "q?", ("x", "y"), {"benchmark": "nq"})])
    (row,) = pq.read_table(tmp_path / "t.parquet").to_pylist()
    assert row == {"id": "1", "question": "q?", "golden_answers": ["x", "y"], "data_source": "nq",
                   "reward_model": {"style": "rule", "ground_truth": {"target": ["x", "y"]}}}


def test_a_json_file_of_questions_after_a_blank_line_is_still_named_not_read(tmp_path):
    """The first line with text decides (mutant: the first line, blank, read as no JSON: the file of questions
    dropped out of the directory's averages without a word)."""
    write_qa(tmp_path / "nq.jsonl", [QAItem("1", "q?", ("x",))])
    (tmp_path / "tq.json").write_text("\n  \n" + json.dumps({"id": "2", "question": "q?", "golden_answers": ["y"]})
                                      + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"tq\.json: in a QA directory but not read"):
        read_qa_dir(tmp_path)


def test_count_lines_gives_no_total_for_a_gzip_stream_whatever_its_name(tmp_path):
    """Its compressed bytes' line breaks are not its lines (mutant: counted, a progress bar's total that is
    neither the corpus's size nor zero)."""
    import gzip

    from selfevo.corpus import count_lines

    plain = tmp_path / "c.jsonl"
    write_corpus(plain, [Document(str(i), "T", f"text {i}") for i in range(200)])
    assert count_lines(plain) == 200
    (tmp_path / "c.data").write_bytes(gzip.compress(plain.read_bytes(), mtime=0))
    assert count_lines(tmp_path / "c.data") is None


def test_count_lines_counts_a_last_line_without_its_line_break(tmp_path):
    """A corpus whose last document has no "\\n" (as an editor or `head -c` leaves it) has that document too:
    the progress bar's total was one short (mutant: `lines + (last != b"\\n")` -> `lines`). An empty file has
    none, and one ending in "\\n" is not counted twice."""
    path = tmp_path / "c.jsonl"
    for content, n in ((b'{"id": "a"}\n{"id": "b"}', 2), (b'{"id": "a"}\n{"id": "b"}\n', 2), (b"", 0), (b"x", 1)):
        path.write_bytes(content)
        assert count_lines(path) == n, content


@pytest.mark.parametrize("overrides, field", [
    (["world.name=~nosuchuser0/w"], "world.name"),
    (["backend=lm", "data.corpus=~nosuchuser0/c.jsonl", "data.qa_dir=/tmp"], "data.corpus"),
    (["lm.model=~nosuchuser0/m"], "lm.model"),
])
def test_a_path_under_the_home_of_a_user_that_does_not_exist_is_an_error_naming_the_field(overrides, field):
    """`--set world.name=~nosuchuser/w` was a RuntimeError traceback ("Could not determine home directory",
    pathlib's `expanduser`), where every other bad value is a ConfigError naming its field (hypothesis found
    `world.name="~0"`)."""
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}: ~nosuchuser0/\w+(\.jsonl)?: no home directory for "
                                          r"~nosuchuser0 here"):
        load_config(None, overrides)
    with pytest.raises(FileNotFoundError):  # a model checked before it loads: no such file, not a traceback
        check_local_path("~nosuchuser0/m")
