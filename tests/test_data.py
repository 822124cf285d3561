"""`selfevo data download`: conversion, subsampling and validation on the real files in
../shared/data, and the downloader's orchestration against a fake Hub (an injected `download`)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from _shared import CORPUS, QA_DIR
from typer.testing import CliRunner

from selfevo import data
from selfevo._io import file_sha256
from selfevo.cli import app
from selfevo.corpus import DataError, read_corpus, read_qa, read_qa_dir
from selfevo.data import (
    BENCHMARKS,
    MissingFileError,
    commit_of,
    convert_benchmark,
    convert_corpus,
    describe_hub_error,
    download_data,
    load_split,
    parse_benchmarks,
    subsample,
)

pytestmark = pytest.mark.skipif(not QA_DIR.is_dir(), reason="../shared/data is not there")
# the split each benchmark has on the Hub (FlashRAG_datasets): test where labelled, else dev
HUB_SPLIT = {"nq": "test", "triviaqa": "test", "popqa": "test", "bamboogle": "test",
             "hotpotqa": "dev", "2wikimultihopqa": "dev", "musique": "dev"}


# ---------------------------------------------------------------- a fake Hub


def make_hub(root: Path, corpus_lines: int = 1500, splits: dict[str, str] | None = None) -> Path:
    """Lay out FlashRAG_datasets and wiki-18-corpus as the Hub has them, from the shared files:
    FlashRAG ids (`test_0`, repeated across benchmarks) and FlashRAG's own metadata."""
    qa_repo = root / "RUC-NLPIR" / "FlashRAG_datasets"
    for name, split in (splits or HUB_SPLIT).items():
        rows = [json.loads(line) for line in (QA_DIR / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]
        out = qa_repo / name / f"{split}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", encoding="utf-8") as fh:
            for i, row in enumerate(rows):
                fh.write(json.dumps({"id": f"{split}_{i}", "question": row["question"],
                                     "golden_answers": row["golden_answers"],
                                     "metadata": {"type": "bridge", "level": "hard"}}) + "\n")
        (out.parent / "train.jsonl").write_text('{"id": "train_0"}\n')  # never read
    corpus_repo = root / "PeterJinGo" / "wiki-18-corpus"
    corpus_repo.mkdir(parents=True)
    with open(CORPUS, "rb") as src, gzip.open(corpus_repo / "wiki-18.jsonl.gz", "wb", compresslevel=1) as gz:
        for i, line in enumerate(src):
            if i == corpus_lines:
                break
            gz.write(line)
    return root


class FakeHub:
    """`download(repo_id, filename, revision) -> local path`, serving a directory; records calls."""

    def __init__(self, root: Path, fail_on: str | None = None):
        self.root, self.fail_on, self.calls = root, fail_on, []

    def __call__(self, repo_id: str, filename: str, revision: str | None) -> Path:
        self.calls.append((repo_id, filename, revision))
        if self.fail_on and self.fail_on in filename:
            raise data.DownloadError(f"cannot fetch {repo_id}/{filename}: the Hub is unreachable")
        path = self.root / repo_id / filename
        if not path.exists():
            raise MissingFileError(f"cannot fetch {repo_id}/{filename}: no such file in the repository")
        return path


def no_network(repo_id, filename, revision):
    raise AssertionError(f"fetched {repo_id}/{filename} though it was complete")


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    return make_hub(tmp_path_factory.mktemp("hub"))


# ---------------------------------------------------------------- conversion (pure, local files)


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_shared_files_convert_to_themselves(name, tmp_path):
    """The shared files are the FlashRAG format with selfevo ids: converting one (200 kept of 200,
    125 of Bamboogle) reproduces it byte for byte, and it reads back through the corpus readers."""
    src = QA_DIR / f"{name}.jsonl"
    info = convert_benchmark(src, name, tmp_path / f"{name}.jsonl", per_benchmark=200, seed=0)
    assert (tmp_path / f"{name}.jsonl").read_bytes() == src.read_bytes()
    assert info["items"] == info["available"] == (125 if name == "bamboogle" else 200)
    assert info["sha256"] == file_sha256(src) and info["skipped"] == 0
    assert [p.name for p in tmp_path.iterdir()] == [f"{name}.jsonl"]  # no staging file left


def test_flashrag_ids_are_prefixed_and_metadata_replaced(hub, tmp_path):
    src = hub / "RUC-NLPIR/FlashRAG_datasets/hotpotqa/dev.jsonl"
    items, skipped = load_split(src, "hotpotqa")
    assert skipped == 0 and len(items) == 200
    assert items[0].id == "hotpotqa-dev_0" and items[0].metadata == {"benchmark": "hotpotqa", "hop": "multi"}
    shared = read_qa(QA_DIR / "hotpotqa.jsonl")
    assert [(i.question, i.golden_answers) for i in items] == [(i.question, i.golden_answers) for i in shared]


def test_subsample_rule_is_the_documented_one():
    items, _ = load_split(QA_DIR / "nq.jsonl", "nq")
    picked = subsample(items, 20, seed=3, benchmark="nq")
    by_digest = sorted(items, key=lambda it: hashlib.sha256(f"3:nq:{it.id[3:]}".encode()).hexdigest())[:20]
    assert {it.id for it in picked} == {it.id for it in by_digest}
    assert picked == sorted(picked, key=items.index)  # source-file order
    assert subsample(items, 20, seed=3, benchmark="nq") == picked  # deterministic
    assert {it.id for it in subsample(items, 20, seed=4, benchmark="nq")} != {it.id for it in picked}
    # an item's selection depends on its own id only: dropping unpicked items changes nothing
    fewer = [it for i, it in enumerate(items) if it in picked or i % 2]
    assert subsample(fewer, 20, seed=3, benchmark="nq") == picked
    assert subsample(items, 0, 0, "nq") == items and subsample(items, 500, 0, "nq") == items


def test_bamboogle_is_never_subsampled(tmp_path):
    info = convert_benchmark(QA_DIR / "bamboogle.jsonl", "bamboogle", tmp_path / "b.jsonl", per_benchmark=10)
    assert info["items"] == 125
    info = convert_benchmark(QA_DIR / "musique.jsonl", "musique", tmp_path / "m.jsonl", per_benchmark=10)
    assert info["items"] == 10 and info["available"] == 200


def _qa_fixture(tmp_path, lines: list[str]) -> Path:
    path = tmp_path / "test.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


GOOD = '{"id": "test_%d", "question": "q%d?", "golden_answers": ["x"]}'


@pytest.mark.parametrize("bad, message", [
    # the column where the line was cut short (the line ending read as "column 1" of a next line)
    ('{"id": "test_9", "question": "q?", "golden_answers": ["x"]', "malformed JSON: Expecting ',' delimiter "
                                                                    "(column 59)"),
    ('["not", "an", "object"]', "expected a JSON object"),
    ('{"id": "test_9", "golden_answers": ["x"]}', "missing field 'question'"),
    ('{"id": "test_9", "question": "  ", "golden_answers": ["x"]}', "field 'question' is empty"),
    ('{"id": "test_9", "question": "q?"}', "missing field 'golden_answers'"),
    ('{"id": "test_9", "question": "q?", "golden_answers": {"a": 1}}', "must be a list of strings"),
    ('{"id": "test_9", "question": "q?", "golden_answers": [["a"]]}', "must hold only strings"),
    ('{"id": "test_0", "question": "q?", "golden_answers": ["x"]}', "duplicate id 'test_0'"),
    ('{"id": "test_9", "question": "q?", "golden_answers": [NaN]}', "holds nan, not an answer"),  # was "nan"
])
def test_malformed_split_names_file_and_line(tmp_path, bad, message):
    src = _qa_fixture(tmp_path, [GOOD % (0, 0), GOOD % (1, 1), bad, GOOD % (2, 2)])
    dest = tmp_path / "out" / "nq.jsonl"
    with pytest.raises(DataError) as err:
        convert_benchmark(src, "nq", dest)
    assert str(err.value).startswith(f"{src}:3: ") and message in str(err.value)
    assert not dest.parent.exists() or not any(dest.parent.iterdir())  # nothing written, nothing staged


def test_items_without_answers_are_skipped_and_numbers_kept(tmp_path):
    src = _qa_fixture(tmp_path, [
        '{"id": 7, "question": "q?", "golden_answers": [1969.0, "nineteen sixty-nine"]}',  # a numeric column
        '{"id": "test_1", "question": "q?", "golden_answers": ["", " "]}',
        '{"id": "test_2", "question": "q?", "answers": "only one"}',
    ])
    info = convert_benchmark(src, "popqa", tmp_path / "popqa.jsonl")
    assert (info["items"], info["skipped"]) == (2, 1)
    items = read_qa(tmp_path / "popqa.jsonl")
    assert [(i.id, i.golden_answers) for i in items] == [("popqa-7", ("1969", "nineteen sixty-nine")),
                                                        ("popqa-test_2", ("only one",))]


# ---------------------------------------------------------------- the corpus


def test_corpus_copies_the_shared_corpus_exactly(tmp_path):
    info = convert_corpus(CORPUS, tmp_path / "wiki.jsonl")
    assert info["passages"] == 21845 and info["sha256"] == file_sha256(CORPUS) == info["source_sha256"]
    assert (tmp_path / "wiki.jsonl").read_bytes() == CORPUS.read_bytes()


def _gz(path: Path, lines: list[bytes]) -> Path:
    with gzip.open(path, "wb") as fh:
        fh.writelines(lines)
    return path


def _head(n: int) -> list[bytes]:
    with open(CORPUS, "rb") as fh:
        return [next(fh) for _ in range(n)]


def test_corpus_gz_and_zip_are_streamed(tmp_path):
    lines = _head(300)
    src = _gz(tmp_path / "wiki-18.jsonl.gz", lines[:150] + [b"\n"] + lines[150:-1] + [lines[-1].rstrip(b"\n")])
    info = convert_corpus(src, tmp_path / "a.jsonl")
    assert info["passages"] == 300 and info["source_sha256"] == file_sha256(src)
    assert (tmp_path / "a.jsonl").read_bytes() == b"".join(lines)
    with zipfile.ZipFile(tmp_path / "wiki18_100w.zip", "w") as zf:
        zf.writestr("wiki18_100w.jsonl", b"".join(lines))
    info = convert_corpus(tmp_path / "wiki18_100w.zip", tmp_path / "b.jsonl")
    assert info["passages"] == 300 and len(read_corpus(tmp_path / "b.jsonl")) == 300
    # a BOM, which the corpus reader reads past, is read past here too (before: malformed JSON), not copied
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + b"".join(lines))
    assert convert_corpus(tmp_path / "bom.jsonl", tmp_path / "c.jsonl")["passages"] == 300
    assert (tmp_path / "c.jsonl").read_bytes() == b"".join(lines)


@pytest.mark.parametrize("bad, message", [
    (b'{"id": "x", "contents": "\\"T\\"\\ntext"\n', "malformed JSON"),
    (b'{"id": "x"}\n', "missing field 'contents'"),
    (b'{"id": "x", "contents": 5}\n', "field 'contents' must be a string"),
    (b'{"id": "x", "contents": "\\ud800"}\n', "lone surrogate"),
    (b'{"id": "x", "contents": "\xff"}\n', "invalid UTF-8"),
])
def test_malformed_corpus_line_names_the_archive_and_line(tmp_path, bad, message):
    lines = _head(3)
    src = _gz(tmp_path / "wiki-18.jsonl.gz", [lines[0], bad, lines[1]])
    with pytest.raises(DataError) as err:
        convert_corpus(src, tmp_path / "out" / "wiki-18.jsonl")
    assert str(err.value).startswith(f"{src}:2: ") and message in str(err.value)
    assert not any((tmp_path / "out").iterdir())


def test_corpus_duplicate_ids_numeric_and_not(tmp_path):
    for ids in (["5", "12", "5"], ["a", "b", "a"]):
        src = tmp_path / "c.jsonl"
        src.write_text("".join(json.dumps({"id": i, "contents": '"T"\nx'}) + "\n" for i in ids))
        with pytest.raises(DataError, match=r"c\.jsonl:3: duplicate id"):
            convert_corpus(src, tmp_path / "out.jsonl")
    src.write_text("".join(json.dumps({"id": i, "contents": '"T"\nx'}) + "\n" for i in ["7", "07", 8, "8x"]))
    assert convert_corpus(src, tmp_path / "out.jsonl")["passages"] == 4  # "7" and "07" are different ids


def test_truncated_gzip_is_one_clear_error(tmp_path):
    src = _gz(tmp_path / "wiki-18.jsonl.gz", _head(2000))
    src.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(DataError, match="corrupt or truncated archive"):
        convert_corpus(src, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


# ---------------------------------------------------------------- orchestration (fake Hub)


def test_download_converts_validates_and_records(hub, tmp_path):
    fake, out, logs = FakeHub(hub), tmp_path / "data", []
    res = download_data(out, per_benchmark=50, seed=0, download=fake, log=logs.append)
    # the known split first: no test.jsonl request for the dev-split benchmarks
    assert sorted(f for _, f, _ in fake.calls) == sorted(
        [f"{n}/{s}.jsonl" for n, s in HUB_SPLIT.items()] + ["wiki-18.jsonl.gz"])
    qa = read_qa_dir(out / "qa")
    assert {n: len(v) for n, v in qa.items()} == {n: 125 if n == "bamboogle" else 50 for n in BENCHMARKS}
    nq = read_qa(out / "qa" / "nq.jsonl")
    assert all(i.id.startswith("nq-test_") and i.metadata == {"benchmark": "nq", "hop": "single"} for i in nq)
    assert {i.metadata["hop"] for i in qa["musique"]} == {"multi"}
    assert len(read_corpus(out / "corpus" / "wiki-18.jsonl")) == 1500

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest == res["manifest"]
    files = manifest["files"]
    assert set(files) == {f"qa/{n}.jsonl" for n in BENCHMARKS} | {"corpus/wiki-18.jsonl"}
    for rel, entry in files.items():
        assert entry["sha256"] == file_sha256(out / rel) and entry["bytes"] == (out / rel).stat().st_size
    assert files["qa/hotpotqa.jsonl"]["source"] == {
        "repo_id": "RUC-NLPIR/FlashRAG_datasets", "repo_type": "dataset", "filename": "hotpotqa/dev.jsonl",
        "revision": None, "commit": None, "sha256": file_sha256(hub / "RUC-NLPIR/FlashRAG_datasets/hotpotqa/dev.jsonl")}
    assert (files["qa/nq.jsonl"]["split"], files["qa/nq.jsonl"]["items"], files["qa/nq.jsonl"]["available"]) == \
        ("test", 50, 200)
    corpus = files["corpus/wiki-18.jsonl"]
    assert corpus["passages"] == 1500 and corpus["source"]["repo_id"] == "PeterJinGo/wiki-18-corpus"
    assert corpus["source"]["sha256"] == file_sha256(hub / "PeterJinGo/wiki-18-corpus/wiki-18.jsonl.gz")
    assert any(line.startswith("wrote qa/nq.jsonl: 50 of 200 items") for line in logs)
    assert not [p for p in out.rglob(".*")]  # no temp or staging files

    # a second run finds everything complete and touches no network
    again = download_data(out, per_benchmark=50, seed=0, download=no_network, log=logs.append)
    assert {p["action"] for p in again["plan"]} == {"skip"}

    # a damaged file is fetched again, and only that one
    (out / "qa" / "nq.jsonl").write_text((out / "qa" / "nq.jsonl").read_text()[:-40])
    fake2 = FakeHub(hub)
    download_data(out, per_benchmark=50, seed=0, download=fake2, log=logs.append)
    assert [f for _, f, _ in fake2.calls] == ["nq/test.jsonl"]
    assert file_sha256(out / "qa" / "nq.jsonl") == files["qa/nq.jsonl"]["sha256"]

    # other settings make other files: the QA sets are redone, the corpus is kept
    fake3 = FakeHub(hub)
    download_data(out, benchmarks="nq,musique", per_benchmark=20, seed=1, download=fake3, log=logs.append)
    assert sorted(f for _, f, _ in fake3.calls) == ["musique/dev.jsonl", "nq/test.jsonl"]
    assert len(read_qa(out / "qa" / "nq.jsonl")) == 20
    assert json.loads((out / "manifest.json").read_text())["files"]["qa/hotpotqa.jsonl"]["items"] == 50


def test_missing_split_falls_back_to_the_other(tmp_path):
    hub = make_hub(tmp_path / "hub", corpus_lines=10, splits={"nq": "dev", "hotpotqa": "test"})
    fake = FakeHub(hub)
    res = download_data(tmp_path / "out", "nq,hotpotqa", download=fake, corpus=False, log=lambda m: None)
    assert [f for _, f, _ in fake.calls] == ["nq/test.jsonl", "nq/dev.jsonl", "hotpotqa/dev.jsonl",
                                             "hotpotqa/test.jsonl"]
    assert res["manifest"]["files"]["qa/nq.jsonl"]["split"] == "dev"
    with pytest.raises(MissingFileError, match="popqa/dev.jsonl: no such file"):
        download_data(tmp_path / "out", "popqa", download=fake, corpus=False, log=lambda m: None)


def test_a_second_download_into_the_same_out_is_refused_and_touches_nothing(hub, tmp_path):
    """Two `data download` into one --out: the second removed the first's temp file under it (the first
    failed after converting the whole corpus) and rewrote the manifest from its own copy."""
    import fcntl
    import os

    out = tmp_path / "data"
    download_data(out, "nq", download=FakeHub(hub), corpus=False, log=lambda m: None)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, as a download in progress holds it
        fake = FakeHub(hub)
        with pytest.raises(ValueError, match="another `selfevo data download` is writing here"):
            download_data(out, "nq,popqa", download=fake, corpus=False, log=lambda m: None)
        assert fake.calls == [] and {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
        download_data(out, "nq,popqa", download=fake, corpus=False, dry_run=True, log=lambda m: None)  # reads only
    finally:
        os.close(fd)
    download_data(out, "nq,popqa", download=FakeHub(hub), corpus=False, log=lambda m: None)  # released


def test_network_failure_keeps_what_was_finished(hub, tmp_path):
    out = tmp_path / "data"
    with pytest.raises(data.DownloadError, match="unreachable"):
        download_data(out, download=FakeHub(hub, fail_on="musique"), log=lambda m: None)
    done = json.loads((out / "manifest.json").read_text())["files"]
    assert set(done) == {"qa/nq.jsonl", "qa/triviaqa.jsonl", "qa/popqa.jsonl", "qa/hotpotqa.jsonl",
                         "qa/2wikimultihopqa.jsonl"}
    assert not (out / "qa" / "musique.jsonl").exists()
    fake = FakeHub(hub)
    download_data(out, download=fake, log=lambda m: None)  # resumes where it stopped
    assert [f for _, f, _ in fake.calls] == ["musique/dev.jsonl", "bamboogle/test.jsonl", "wiki-18.jsonl.gz"]


def test_dry_run_fetches_and_writes_nothing(tmp_path):
    logs = []
    res = download_data(tmp_path / "out", "nq,bamboogle", revision="v1", download=no_network, dry_run=True,
                        log=logs.append)
    assert [p["output"] for p in res["plan"]] == ["qa/nq.jsonl", "qa/bamboogle.jsonl", "corpus/wiki-18.jsonl"]
    assert {p["action"] for p in res["plan"]} == {"fetch"}
    assert logs[0] == f"would fetch RUC-NLPIR/FlashRAG_datasets@v1: nq/test.jsonl or nq/dev.jsonl -> " \
                      f"{tmp_path / 'out' / 'qa' / 'nq.jsonl'}"
    assert not (tmp_path / "out").exists()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark"):
        download_data(tmp_path, "nq,squad", download=no_network)
    with pytest.raises(ValueError, match=">= 0"):
        download_data(tmp_path, per_benchmark=-1, download=no_network)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="unreadable manifest"):
        download_data(tmp_path, download=no_network)


# ---------------------------------------------------------------- the Hub adapter and the CLI


def test_hub_errors_become_one_line():
    LocalEntryNotFoundError = pytest.importorskip("huggingface_hub.errors").LocalEntryNotFoundError

    msg = str(describe_hub_error(LocalEntryNotFoundError("long\nstory"), "o/r", "nq/test.jsonl", None))
    assert msg.startswith("cannot fetch o/r/nq/test.jsonl: ") and "\n" not in msg and "cache" in msg

    def named(name, base=Exception):  # matched by class name, so any huggingface_hub version maps alike
        return type(name, (base,), {})("detail")

    assert isinstance(describe_hub_error(named("RemoteEntryNotFoundError"), "o/r", "f", None), MissingFileError)
    assert "gated" in str(describe_hub_error(named("GatedRepoError"), "o/r", "f", None))
    assert "no such dataset repository" in str(describe_hub_error(named("RepositoryNotFoundError"), "o/r", "f", None))
    assert "no such revision 'v9'" in str(describe_hub_error(named("RevisionNotFoundError"), "o/r", "f", "v9"))
    other = describe_hub_error(ConnectionError("boom\n  twice"), "o/r", "f", "main")
    assert str(other) == "cannot fetch o/r/f@main: boom twice" and not isinstance(other, MissingFileError)


def test_commit_of_reads_the_hf_cache_path():
    sha = "a" * 40
    assert commit_of(f"/c/datasets--o--r/snapshots/{sha}/nq/test.jsonl") == sha
    assert commit_of("/somewhere/nq/test.jsonl") is None


def test_cli_offline_fails_in_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "COLUMNS": "200"}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-m", "selfevo.cli", "data", "download", "--out", str(tmp_path / "d"),
                           "--benchmarks", "bamboogle"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot fetch RUC-NLPIR/FlashRAG_datasets/bamboogle/")
    assert "HF_HUB_OFFLINE" in lines[0]
    assert not (tmp_path / "d").exists()


def test_cli_downloads_through_the_hub_function(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "hub_download", FakeHub(hub))
    runner = CliRunner()
    out = tmp_path / "d"
    res = runner.invoke(app, ["data", "download", "--out", str(out), "--benchmarks", "nq,bamboogle",
                              "--per-benchmark", "30", "--no-corpus"])
    assert res.exit_code == 0, res.output
    assert "wrote qa/nq.jsonl: 30 of 200 items" in res.output and "data ready" in res.output
    assert {n: len(v) for n, v in read_qa_dir(out / "qa").items()} == {"nq": 30, "bamboogle": 125}
    res = runner.invoke(app, ["data", "download", "--out", str(out), "--benchmarks", "nq,bamboogle",
                              "--per-benchmark", "30", "--no-corpus", "--dry-run"])
    assert res.exit_code == 0 and res.output.count("skip qa/") == 2
    res = runner.invoke(app, ["data", "download", "--out", str(out), "--benchmarks", "nope"])
    assert res.exit_code == 2 and "unknown benchmark(s) nope" in res.output


def test_a_rerun_clears_the_temp_files_a_killed_conversion_left(hub, tmp_path):
    out = tmp_path / "data"
    # what kill -9 inside convert_corpus / convert_benchmark leaves: atomic_writer's temp file beside
    # the output (`.NAME.XXXXXXXX.tmp`; wiki-18's is ~14 GB) and the QA staging file
    leftovers = [out / "corpus" / ".wiki-18.jsonl.k1ll3d00.tmp", out / "corpus" / ".wiki-18.jsonl.k1ll3d01.tmp",
                 out / "qa" / ".nq.jsonl.staged", out / "qa" / ".nq.jsonl.staged.k1ll3d02.tmp",
                 # the staging file's own temp file, as atomic_writer names it: "." + ".nq.jsonl.staged" + ...
                 out / "qa" / f".{data._staged(out / 'qa' / 'nq.jsonl').name}.k1ll3d03.tmp"]
    for p in leftovers:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b'{"id": "1", "contents": "half a li')
    keep = out / "corpus" / "notes.tmp"  # not a temp file of ours
    keep.write_text("mine")
    download_data(out, benchmarks="nq", per_benchmark=50, download=FakeHub(hub), log=lambda m: None)
    assert [p for p in leftovers if p.exists()] == []
    assert keep.read_text() == "mine"
    assert sorted(p.name for p in (out / "corpus").iterdir()) == ["notes.tmp", "wiki-18.jsonl"]


def test_a_benchmark_named_like_a_standard_one_but_for_case_is_refused(tmp_path):
    """`NQ` beside `nq` became two benchmarks: `NQ` counted in the macro average, outside the
    single-hop group, with no message."""
    qa = tmp_path / "qa"
    qa.mkdir()
    rows = [{"id": "a", "question": "q", "golden_answers": ["x"], "metadata": {"benchmark": "nq"}},
            {"id": "b", "question": "q", "golden_answers": ["x"], "metadata": {"benchmark": "NQ"}}]
    (qa / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(DataError, match="mixed.jsonl:2: benchmark 'NQ' differs from the standard 'nq' only in case"):
        read_qa_dir(qa)
    (qa / "mixed.jsonl").write_text(json.dumps({**rows[1], "metadata": {"benchmark": "mybench"}}) + "\n")
    assert list(read_qa_dir(qa)) == ["mybench"]  # a benchmark of one's own is fine
    # "nq " was a benchmark of its own too, shown as a second "nq" row
    (qa / "mixed.jsonl").write_text(json.dumps(rows[0]) + "\n" + json.dumps(
        {"id": "b", "question": "q", "golden_answers": ["x"], "data_source": "nq "}) + "\n")
    with pytest.raises(DataError, match="mixed.jsonl:2: field 'data_source' has spaces around it: 'nq '"):
        read_qa_dir(qa)
    (qa / "mixed.jsonl").rename(qa / "nq .jsonl")  # a name from the file's: no field to point at
    (qa / "nq .jsonl").write_text(json.dumps({"id": "b", "question": "q", "golden_answers": ["x"]}) + "\n")
    with pytest.raises(DataError, match=r"nq .jsonl:1: the file's name, the benchmark of its rows, has spaces"):
        read_qa_dir(qa)


def test_an_item_no_answer_could_score_is_left_out_and_said(tmp_path):
    """Golds of articles and punctuation alone ("The", "?!", an option letter "A") normalise to nothing:
    the item counted in every average and no prediction could be right. The reader leaves it out and says
    so (refusing it would refuse the whole directory for one line); a download skips it, as a blank one."""
    qa = tmp_path / "qa"
    qa.mkdir()
    (qa / "nq.jsonl").write_text('{"id": "1", "question": "q?", "golden_answers": ["x"]}\n'
                                 '{"id": "2", "question": "q?", "golden_answers": ["The", "?!"]}\n'
                                 '{"id": "3", "question": "Which option?", "golden_answers": ["A"]}\n')
    with pytest.warns(UserWarning, match=r"nq.jsonl: 2 item\(s\) left out whose every gold answer normalises to "
                                         r"nothing, so that no answer could score \(line 2: 'The'"):
        assert [it.id for it in read_qa_dir(qa)["nq"]] == ["1"]
    src = _qa_fixture(tmp_path, ['{"id": "a", "question": "q?", "golden_answers": ["."]}',
                                 '{"id": "b", "question": "q?", "golden_answers": ["The", "Paris"]}'])
    info = convert_benchmark(src, "nq", tmp_path / "nq.jsonl")
    assert (info["items"], info["skipped"]) == (1, 1)
    assert [i.id for i in read_qa(tmp_path / "nq.jsonl")] == ["nq-b"]


def test_search_r1s_merged_test_parquet_reads_with_ids_qualified_by_benchmark(hub, tmp_path):
    """Search-R1's test.parquet (`qa_search_test_merge.py`: the seven FlashRAG splits concatenated,
    each row keeping FlashRAG's id, `data_source` and `extra_info.index` counting within its split)
    was refused: "duplicate id 'test_0'" at the first row of the second benchmark."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for name, split in HUB_SPLIT.items():
        lines = (hub / data.QA_REPO / name / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            row = json.loads(line)
            rows.append({**row, "data_source": name, "prompt": [{"role": "user", "content": row["question"]}],
                         "ability": "fact-reasoning",
                         "reward_model": {"style": "rule", "ground_truth": {"target": row["golden_answers"]}},
                         "extra_info": {"split": "test", "index": i}})
    (tmp_path / "merged").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "merged" / "test.parquet")
    got = read_qa_dir(tmp_path / "merged")
    assert {b: len(items) for b, items in got.items()} == {b: 125 if b == "bamboogle" else 200 for b in HUB_SPLIT}
    for name, split in HUB_SPLIT.items():  # the ids `selfevo data download` gives the same items
        items, _ = load_split(hub / data.QA_REPO / name / f"{split}.jsonl", name)
        assert [(it.id, it.question, it.golden_answers) for it in got[name]] == \
               [(it.id, it.question, it.golden_answers) for it in items]
    # without the id column, ids come from extra_info.index, which repeats across benchmarks too
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in r.items() if k != "id"} for r in rows]),
                   tmp_path / "merged" / "test.parquet")
    assert [it.id for it in read_qa_dir(tmp_path / "merged")["musique"][:2]] == ["musique-0", "musique-1"]
    # one benchmark's id twice is still an error at its row; a file of one benchmark keeps its ids
    twice = rows[:3] + [{**rows[1], "question": "again?"}]
    pq.write_table(pa.Table.from_pylist(twice), tmp_path / "twice.parquet")
    with pytest.raises(DataError, match=r"twice.parquet:4: duplicate id 'test_1' \(first on line 2\)"):
        read_qa(tmp_path / "twice.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:3]), tmp_path / "one.parquet")
    assert [it.id for it in read_qa(tmp_path / "one.parquet")] == ["test_0", "test_1", "test_2"]


def test_an_id_in_two_qa_files_names_both_lines(tmp_path):
    """The readers name file and line in every error; an id repeated across two files of a QA
    directory named the files only (no line in a file of 200 questions)."""
    (tmp_path / "a.jsonl").write_text('{"id": "x1", "question": "q?", "golden_answers": ["x"]}\n\n'
                                      '{"id": "dup", "question": "q?", "golden_answers": ["x"]}\n')
    (tmp_path / "b.jsonl").write_text('{"id": "y1", "question": "q?", "golden_answers": ["x"]}\n'
                                      '{"id": "dup", "question": "q?", "golden_answers": ["x"]}\n')
    with pytest.raises(DataError) as exc:
        read_qa_dir(tmp_path)
    assert str(exc.value) == f"{tmp_path / 'b.jsonl'}:2: id 'dup' also appears in {tmp_path / 'a.jsonl'}:3"


def test_a_parquet_row_without_metadata_benchmark_reads_as_its_jsonl_does(tmp_path):
    """A parquet struct holds a field some rows lack as null: `metadata.benchmark` null was refused
    ("must be a string") where the same rows as JSONL read, the row's benchmark the file's name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": "a", "question": "q?", "golden_answers": ["x"], "metadata": {"benchmark": "nq"}},
            {"id": "b", "question": "q?", "golden_answers": ["y"], "metadata": {"level": "hard"}}]
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mine.parquet")
    for name in ("mine.jsonl", "mine.parquet"):
        assert [(it.id, it.benchmark) for it in read_qa(tmp_path / name)] == [("a", "nq"), ("b", "mine")]
    pq.write_table(pa.Table.from_pylist([{**rows[1], "data_source": 3}]), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="bad.parquet:1: field 'data_source' must be a string"):
        read_qa(tmp_path / "bad.parquet")


def test_a_manifest_entry_that_is_not_an_object_is_one_error_naming_it(tmp_path):
    """Such an entry (a manifest edited by hand) was an AttributeError traceback in the completeness check."""
    out = tmp_path / "data"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"format": 1, "files": {"qa/nq.jsonl": "done"}}))
    with pytest.raises(DataError, match="files.qa/nq.jsonl: expected an object, got a JSON str"):
        download_data(out, "nq", corpus=False, download=no_network, log=lambda m: None)
    (out / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)  # nested past the parser's limit
    with pytest.raises(DataError, match="unreadable manifest"):
        download_data(out, "nq", corpus=False, download=no_network, dry_run=True, log=lambda m: None)


@pytest.mark.parametrize("gzipped", [False, True])
def test_a_corpus_rewritten_while_it_is_indexed_is_refused(tmp_path, gzipped):
    """An index recorded the sha256 of one read of the corpus and indexed a second read: a file rewritten
    between them was recorded as the new one. The stream now hashes what it reads and compares."""
    from selfevo.corpus import corpus_documents

    path = tmp_path / ("c.jsonl.gz" if gzipped else "c.jsonl")
    lines = "".join(json.dumps({"id": f"d{i}", "contents": f'"T{i}"\n' + "word " * 40}) + "\n" for i in range(3000))
    path.write_bytes(gzip.compress(lines.encode()) if gzipped else lines.encode())
    digest = file_sha256(path)
    assert len(list(corpus_documents(path, digest))) == 3000  # every byte hashed, a gzip stream's too
    stream = corpus_documents(path, digest)
    next(stream)  # the reader has the file open and a buffer read
    if gzipped:  # another member appended: the stream reads on into it
        with open(path, "ab") as fh:
            fh.write(gzip.compress(json.dumps({"id": "new", "contents": "New."}).encode() + b"\n"))
    else:  # rewritten in place, as an editor or a second download would
        with open(path, "r+b") as fh:
            fh.write(lines.replace("word", "wort").encode())
    with pytest.raises(DataError, match="changed while it was read"):
        list(stream)


def test_a_string_gold_is_one_alias_not_its_letters(tmp_path):
    """QAItem kept `golden_answers="Paris"` as given: written, it became ["P", "a", "r", "i", "s"], and any
    prediction holding one of those letters then scored Cover-EM 1 (a helper's review)."""
    from selfevo.corpus import write_qa
    from selfevo.evaluate import score_item
    from selfevo.records import QAItem

    item = QAItem("nq-1", "capital of France?", "Paris")
    assert item.golden_answers == ("Paris",) and item.to_json()["golden_answers"] == ["Paris"]
    write_qa(tmp_path / "nq.jsonl", [item])
    (back,) = read_qa(tmp_path / "nq.jsonl")
    assert back.golden_answers == ("Paris",) and score_item("a", back.golden_answers).cover_em == 0.0
    with pytest.raises(TypeError, match="golden_answers must be strings"):
        QAItem("nq-2", "q", ["Paris", 7])


def test_qa_and_corpus_lines_of_odd_shapes_are_named_by_file_and_line(tmp_path):
    """An integer of more than 4,300 digits escaped as a bare ValueError (a traceback from `score`); one past
    10**308 in an answer as an OverflowError; a line of Unicode whitespace crashed convert_corpus."""
    from selfevo.data import _answers, convert_corpus

    qa = tmp_path / "qa"
    qa.mkdir()
    (qa / "nq.jsonl").write_text('{"id": "1", "question": "q?", "golden_answers": ["x"], "x": ' + "9" * 5000 + "}\n")
    with pytest.raises(DataError, match=r"nq.jsonl:1: malformed JSON"):
        read_qa_dir(qa)
    assert _answers({"golden_answers": [10**400]}, "f", 1) == [str(10**400)]
    src = tmp_path / "c.jsonl"
    src.write_text('{"id": "1", "contents": "A\\nText."}\n\u00a0\u2003\n{"id": "2", "contents": "B\\nText."}\n')
    convert_corpus(src, tmp_path / "out.jsonl")
    assert [d.id for d in read_corpus(tmp_path / "out.jsonl")] == ["1", "2"]


@pytest.mark.parametrize("name", ["nq.json", "popqa.JSONL", "hotpotqa.json.gz", "musique.jsonl.bz2",
                                  "bamboogle.jsonl.zip", "hotpotqa.zip", "musique.bz2", "nq.gz",
                                  "nq.JSON", "hotpotqa.JSON.GZ", "musique.JSONL.BZ2", "nq.ZIP"])
def test_a_benchmark_file_of_another_name_is_named_not_skipped(tmp_path, name):
    """`nq.json` (Dataset.to_json writes JSON Lines so), `popqa.JSONL` or a compression other than
    gzip (`.json.gz`, `.jsonl.bz2`) dropped out of every average silently; the name is compared in lower
    case for every check, not only the QA suffixes (`nq.JSON`, `musique.JSONL.BZ2`)."""
    qa = tmp_path / "qa"
    qa.mkdir()
    for file in ("triviaqa.jsonl", name):
        (qa / file).write_text(json.dumps({"id": file, "question": "q?", "golden_answers": ["x"]}) + "\n")
    with pytest.raises(DataError, match=f"{name}: in a QA directory but not read"):
        read_qa_dir(qa)
    (qa / name).unlink()
    (qa / "score.json").write_text(json.dumps({"macro": {"cover_em": 0.5}}, indent=1))  # no benchmark: read past
    assert list(read_qa_dir(qa)) == ["triviaqa"]


def test_eval_and_score_refuse_an_out_read_as_a_benchmark(tmp_path):
    """`eval --out QA_DIR` wrote predictions.jsonl among the benchmarks, and `score --out QA_DIR/s.jsonl` a
    file read as one: every later command on the directory failed."""
    qa = tmp_path / "qa"
    qa.mkdir()
    (qa / "nq.jsonl").write_text('{"id": "1", "question": "q?", "golden_answers": ["x"]}\n')
    (tmp_path / "p.jsonl").write_text('{"id": "1", "prediction": "a"}\n')
    for args in (["eval", "--data-dir", str(qa), "--corpus", str(CORPUS), "--out", str(qa)],
                 ["score", "--data-dir", str(qa), "--predictions", str(tmp_path / "p.jsonl"),
                  "--out", str(qa / "score.jsonl")]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2 and "would be read as a benchmark" in res.output, res.output
    assert sorted(p.name for p in qa.iterdir()) == ["nq.jsonl"]


# Tests of a mutation sweep (forty-first session): each passes on the code and fails on the mutant its docstring names.

def test_golden_answers_wins_over_answers_and_a_null_field_is_absent():
    """FlashRAG's field first (mutant: `answers` tried first); a null `golden_answers` falls through to the
    next field, as if absent (mutant: null read as the value, "must be a list")."""
    from selfevo.data import _answers

    assert _answers({"golden_answers": ["a"], "answers": ["b"]}, "f", 1) == ["a"]
    assert _answers({"golden_answers": None, "answers": ["b"]}, "f", 1) == ["b"]
    with pytest.raises(DataError, match="f:1: missing field 'golden_answers'"):
        _answers({"golden_answers": None}, "f", 1)


def test_a_boolean_answer_is_refused_not_read_as_true(tmp_path):
    """(mutant: the bool exclusion dropped, [true] became the answer "True")"""
    src = _qa_fixture(tmp_path, ['{"id": "test_0", "question": "q?", "golden_answers": [true]}'])
    with pytest.raises(DataError, match=r"test.jsonl:1: field 'golden_answers' must hold only strings, got bool"):
        convert_benchmark(src, "nq", tmp_path / "out" / "nq.jsonl")


def test_an_item_with_one_blank_alias_keeps_its_others(tmp_path):
    """One alias with text is enough (mutant: `all` for `any`, which skipped the item); `available`
    counts the usable items, not the skipped ones."""
    src = _qa_fixture(tmp_path, ['{"id": "test_0", "question": "q?", "golden_answers": ["Paris", ""]}',
                                 '{"id": "test_1", "question": "q?", "golden_answers": [" "]}'])
    info = convert_benchmark(src, "nq", tmp_path / "nq.jsonl")
    assert (info["items"], info["available"], info["skipped"]) == (1, 1, 1)
    assert [it.golden_answers for it in read_qa(tmp_path / "nq.jsonl")] == [("Paris",)]


def test_a_split_with_no_usable_item_is_an_error_and_writes_nothing(tmp_path):
    """(mutant: the "no usable QA items" check dropped: an empty benchmark file was written)"""
    src = _qa_fixture(tmp_path, ['{"id": "test_0", "question": "q?", "golden_answers": ["The"]}',
                                 '{"id": "test_1", "question": "q?", "golden_answers": [""]}'])
    dest = tmp_path / "out" / "nq.jsonl"
    with pytest.raises(DataError, match="no usable QA items"):
        convert_benchmark(src, "nq", dest)
    assert not dest.exists()


def test_convert_benchmark_refuses_an_unknown_name(tmp_path):
    """(mutant: the check dropped: a KeyError from the table)"""
    src = _qa_fixture(tmp_path, ['{"id": "test_0", "question": "q?", "golden_answers": ["x"]}'])
    with pytest.raises(ValueError, match="unknown benchmark 'squad'"):
        convert_benchmark(src, "squad", tmp_path / "squad.jsonl")


def test_a_benchmark_file_that_does_not_read_back_is_refused_and_nothing_is_left(tmp_path, monkeypatch):
    """The read-back guard (mutant: dropped) and the staging file's removal when it fires (mutant: kept)."""
    src = _qa_fixture(tmp_path, ['{"id": "test_0", "question": "q?", "golden_answers": ["x"]}'])
    monkeypatch.setattr(data, "iter_qa", lambda path: iter(()))  # as if the writer had lost the lines
    out = tmp_path / "out"
    with pytest.raises(DataError, match="does not read back as written"):
        convert_benchmark(src, "nq", out / "nq.jsonl")
    assert list(out.iterdir()) == []


def test_corpus_ids_of_other_digits_are_ids_like_any_other(tmp_path):
    """"²" is a digit to str.isdigit but not to int() (mutant: the isascii() guard dropped: a ValueError)."""
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"id": i, "contents": "T\nx"}) + "\n" for i in ("²", "٣", "3", "2")))
    assert convert_corpus(src, tmp_path / "out.jsonl")["passages"] == 4


def test_corpus_lines_as_the_corpus_reader_takes_them(tmp_path):
    """Empty contents are a passage (mutant: refused), a BOM past line 1 is malformed JSON as the reader has
    it (mutant: stripped on every line), CRLF lines are written with LF (mutant: the CR kept)."""
    src = tmp_path / "c.jsonl"
    src.write_bytes(b'{"id": "1", "contents": ""}\r\n{"id": "2", "contents": "T\\nx"}\r\n')
    assert convert_corpus(src, tmp_path / "out.jsonl")["passages"] == 2
    assert (tmp_path / "out.jsonl").read_bytes() == b'{"id": "1", "contents": ""}\n{"id": "2", "contents": "T\\nx"}\n'
    src.write_bytes(b'{"id": "1", "contents": "a"}\n\xef\xbb\xbf{"id": "2", "contents": "b"}\n')
    with pytest.raises(DataError, match=r"c.jsonl:2: malformed JSON"):
        convert_corpus(src, tmp_path / "bom.jsonl")


def test_an_empty_or_missing_corpus_is_one_data_error(tmp_path):
    """(mutants: "corpus is empty" dropped, an empty file written; the existence check dropped, a
    FileNotFoundError traceback)"""
    src = tmp_path / "c.jsonl"
    src.write_text("\n  \n")
    with pytest.raises(DataError, match="corpus is empty"):
        convert_corpus(src, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()
    with pytest.raises(DataError, match="nope.jsonl: file not found"):
        convert_corpus(tmp_path / "nope.jsonl", tmp_path / "out.jsonl")


def test_corpus_progress_is_reported_every_n_passages(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "contents": "T\nx"}) + "\n" for i in range(5)))
    seen = []
    convert_corpus(src, tmp_path / "out.jsonl", progress=seen.append, every=2)
    assert seen == [2, 4]


def test_a_zip_corpus_names_its_one_jsonl_and_is_hashed_whole(tmp_path):
    """macOS's `__MACOSX/._x.jsonl` is not a second corpus (mutant: counted), two real ones are an error
    (mutant: the first taken), and the source sha256 is the archive's (mutant: not checked anywhere)."""
    lines = b"".join(_head(5))
    mac = tmp_path / "mac.zip"
    with zipfile.ZipFile(mac, "w") as zf:
        zf.writestr("wiki.jsonl", lines)
        zf.writestr("__MACOSX/._wiki.jsonl", b"\x00\x05\x16\x07")
    info = convert_corpus(mac, tmp_path / "a.jsonl")
    assert info["passages"] == 5 and info["source_sha256"] == file_sha256(mac)
    two = tmp_path / "two.zip"
    with zipfile.ZipFile(two, "w") as zf:
        zf.writestr("a.jsonl", lines)
        zf.writestr("b.jsonl", lines)
    with pytest.raises(DataError, match="expected one .jsonl file in the archive"):
        convert_corpus(two, tmp_path / "b.jsonl")


def test_parse_benchmarks_any_case_canonical_order_and_slips_refused():
    """(mutants: no lower(); the order as given; an empty list returning []; "all" among others)"""
    assert parse_benchmarks(" HotpotQA , NQ ") == ["nq", "hotpotqa"]
    assert parse_benchmarks(["bamboogle", "nq"]) == ["nq", "bamboogle"]
    assert parse_benchmarks(None) == parse_benchmarks("all") == list(data.BENCHMARKS)
    for spec in ("", ",", " , "):
        with pytest.raises(ValueError, match="name at least one"):
            parse_benchmarks(spec)
    with pytest.raises(ValueError, match="unknown benchmark.s. all"):
        parse_benchmarks("all,nq")


def test_a_file_changed_in_place_at_the_same_size_is_fetched_again(hub, tmp_path):
    """The sha256 is compared, not only the size (mutant: the sha256 check dropped)."""
    out = tmp_path / "data"
    download_data(out, "nq", per_benchmark=20, corpus=False, download=FakeHub(hub), log=lambda m: None)
    path = out / "qa" / "nq.jsonl"
    good = path.read_bytes()
    i = good.index(b'"question": "') + len(b'"question": "')
    path.write_bytes(good[:i] + (b"X" if good[i:i + 1] != b"X" else b"Y") + good[i + 1:])
    fake = FakeHub(hub)
    download_data(out, "nq", per_benchmark=20, corpus=False, download=fake, log=lambda m: None)
    assert [f for _, f, _ in fake.calls] == ["nq/test.jsonl"] and path.read_bytes() == good


def test_per_benchmark_0_keeps_every_item_and_seed_chooses_them(hub, tmp_path):
    """per_benchmark=0 is "keep all" (mutant: refused as < 1); the seed given is the seed used (mutant: 0)."""
    out = tmp_path / "data"
    download_data(out, "nq,popqa", per_benchmark=0, corpus=False, download=FakeHub(hub), log=lambda m: None)
    assert {b: len(v) for b, v in read_qa_dir(out / "qa").items()} == {"nq": 200, "popqa": 200}
    download_data(tmp_path / "s", "nq", per_benchmark=20, seed=7, corpus=False, download=FakeHub(hub),
                  log=lambda m: None)
    items, _ = load_split(hub / data.QA_REPO / "nq" / "test.jsonl", "nq")
    want = [it.id for it in subsample(items, 20, seed=7, benchmark="nq")]
    assert [it.id for it in read_qa(tmp_path / "s" / "qa" / "nq.jsonl")] == want


def test_bamboogle_is_not_fetched_again_for_another_per_benchmark(hub, tmp_path):
    """Bamboogle is kept whole, so its request leaves out per_benchmark and seed (mutant: they were in it,
    and every other --per-benchmark refetched it)."""
    out = tmp_path / "data"
    download_data(out, "nq,bamboogle", per_benchmark=50, corpus=False, download=FakeHub(hub), log=lambda m: None)
    fake = FakeHub(hub)
    download_data(out, "nq,bamboogle", per_benchmark=20, seed=3, corpus=False, download=fake, log=lambda m: None)
    assert [f for _, f, _ in fake.calls] == ["nq/test.jsonl"]


def test_the_downloaded_qa_directory_is_read_back_whole(hub, tmp_path):
    """After the downloads every QA file reads back, ids unique across files (mutant: the read-back dropped:
    a file of one's own in qa/ with an id of the download's went unsaid until `eval`)."""
    out = tmp_path / "data"
    (out / "qa").mkdir(parents=True)
    (out / "qa" / "mine.jsonl").write_text('{"id": "nq-test_0", "question": "q?", "golden_answers": ["x"]}\n')
    with pytest.raises(DataError, match="id 'nq-test_0' also appears in"):
        download_data(out, "nq", per_benchmark=0, corpus=False, download=FakeHub(hub), log=lambda m: None)


def test_a_manifest_without_a_files_object_is_one_error(tmp_path):
    """(mutant: only the top level checked: a KeyError / AttributeError traceback)"""
    out = tmp_path / "data"
    out.mkdir()
    for manifest in ({"format": 1}, {"format": 1, "files": []}):
        (out / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(DataError, match="not a manifest written by `selfevo data download`"):
            download_data(out, "nq", corpus=False, download=no_network, dry_run=True, log=lambda m: None)


def test_hub_download_asks_for_a_dataset_repo(monkeypatch, tmp_path):
    """Both repos are dataset repos (mutant: repo_type "model": every real download a 404)."""
    hf = pytest.importorskip("huggingface_hub")
    asked = []
    monkeypatch.setattr(hf, "hf_hub_download", lambda **kw: asked.append(kw) or str(tmp_path / "f"))
    assert data.hub_download("o/r", "nq/test.jsonl", "v1") == tmp_path / "f"
    assert asked == [{"repo_id": "o/r", "filename": "nq/test.jsonl", "repo_type": "dataset", "revision": "v1"}]


def test_hub_errors_of_other_versions_and_shapes():
    """EntryNotFoundError (huggingface_hub 0.2x) is a missing file, so the other split is tried (mutant: only
    RemoteEntryNotFoundError); OfflineModeIsEnabled says HF_HUB_OFFLINE (mutant: its branch dropped); an error
    with no text says its type (mutant: "cannot fetch ...: " and nothing); a snapshots path whose next part is
    no commit gives none (mutant: its length not checked)."""
    def named(name):
        return type(name, (Exception,), {})("detail")

    assert isinstance(describe_hub_error(named("EntryNotFoundError"), "o/r", "f", None), MissingFileError)
    assert str(describe_hub_error(named("OfflineModeIsEnabled"), "o/r", "f", None)) == \
        "cannot fetch o/r/f: HF_HUB_OFFLINE is set"
    assert str(describe_hub_error(ConnectionError(), "o/r", "f", None)) == "cannot fetch o/r/f: ConnectionError"
    assert commit_of("/c/datasets--o--r/snapshots/main/nq/test.jsonl") is None


def test_a_corpus_is_gzip_by_its_content_whatever_its_name_as_the_reader_takes_it(tmp_path):
    """convert_corpus chose gzip by the file's name while selfevo.corpus reads by content: a gzip stream
    named .jsonl was "invalid UTF-8 at byte 1", a plain file named .jsonl.gz a "corrupt or truncated archive",
    where the reader took both (a mutation sweep's finding)."""
    line = b'{"id": "1", "contents": "T\\nx"}\n'
    for name, blob in (("wiki.jsonl", gzip.compress(line)), ("wiki.jsonl.gz", line)):
        src = tmp_path / name
        src.write_bytes(blob)
        assert [d.id for d in read_corpus(src)] == ["1"]
        out = tmp_path / f"out-{name}.jsonl"
        convert_corpus(src, out)
        assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["1"]


def test_a_question_without_metadata_is_written_without_it():
    """FlashRAG's QA format: `metadata` only where there is some (an empty object is no field of the format)."""
    from selfevo.records import QAItem

    assert QAItem("nq-1", "capital of France?", ("Paris",)).to_json() == \
        {"id": "nq-1", "question": "capital of France?", "golden_answers": ["Paris"]}
    assert QAItem("nq-1", "q", ("Paris",), {"benchmark": "nq"}).to_json()["metadata"] == {"benchmark": "nq"}
