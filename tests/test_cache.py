"""selfevo's cache (`selfevo cache list | prune`): what corpus stores record of the files they were made
from, what a prune removes (stores no file holds any more, killed builds' leftovers) and what it keeps
(stores in use or of files that still hold them, converted models, stores that record nothing)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from selfevo._fmt import size_text
from selfevo._io import file_sha256, hold_directory
from selfevo.cache import entries, remove, stale
from selfevo.cli import app
from selfevo.corpus import write_corpus
from selfevo.records import Document
from selfevo.search.docstore import SOURCES_FILE, _whole_store, corpus_store, file_record, store_sources

DOCS = [Document("d1", "Alpha", "Alpha is a town."), Document("d2", "Beta", "Beta is a river.")]
runner = CliRunner()


def _states(root):
    return {e.path.name: dict(e.made_from) for e in entries(root, confirm=True) if e.kind == "corpus store"}


def test_size_text():
    assert [size_text(n) for n in (0, 1023, 1024, 35_000, 2**20 * 516.5, 2**30 * 13.1, 2**40 * 3)] == \
        ["0 B", "1023 B", "1.0 KiB", "34.2 KiB", "516.5 MiB", "13.1 GiB", "3,072.0 GiB"]


def test_a_store_records_the_files_it_was_made_and_opened_from(tmp_path):
    """Each corpus file a store was made or opened from, once a path (its latest size and time); a file
    touched since shows as such, and as the same content once hashed; rewritten and missing ones too."""
    root = tmp_path / "cache" / "corpora"
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_corpus(a, DOCS)
    shutil.copy(a, b)  # the same content under another name: the same store
    store = corpus_store(a, root).path.parent
    assert store_sources(store) == [file_record(a)]
    corpus_store(b, root)
    corpus_store(a, root)
    assert [r["path"] for r in store_sources(store)] == [str(a), str(b)]
    assert _states(root.parent) == {store.name: {str(a): "as recorded", str(b): "as recorded"}}
    os.utime(a, ns=(1, 1))  # touched: the same bytes, another time
    assert dict(entries(root.parent)[0].made_from)[str(a)] == "touched"  # not hashed unless confirmed
    assert _states(root.parent)[store.name][str(a)] == "same content"
    corpus_store(a, root)  # opened again: its record now has the new time
    assert _states(root.parent)[store.name][str(a)] == "as recorded"
    write_corpus(b, DOCS[:1])
    os.utime(a, ns=(2, 2))
    a.write_bytes(a.read_bytes().replace(b"town", b"city"))  # the same size, other bytes
    assert _states(root.parent)[store.name] == {str(a): "rewritten", str(b): "rewritten"}
    b.unlink()
    assert _states(root.parent)[store.name][str(b)] == "missing"
    # a record that cannot be read is no record (a cache is rebuilt, never trusted)
    (store / SOURCES_FILE).write_text("{not json")
    assert store_sources(store) == [] and stale(entries(root.parent)[0]) is None


def test_prune_removes_what_no_file_holds_and_what_killed_builds_left(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFEVO_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "cache"
    kept, gone = tmp_path / "kept.jsonl", tmp_path / "gone.jsonl"
    write_corpus(kept, DOCS)
    write_corpus(gone, DOCS[:1])
    kept_store = corpus_store(kept, root / "corpora").path.parent
    gone_store = corpus_store(gone, root / "corpora").path.parent
    old = root / "corpora" / ("0" * 64)  # a store made before stores recorded their files: kept
    shutil.copytree(kept_store, old)
    (old / SOURCES_FILE).unlink()
    model = root / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model.parent / "selfevo-source.json").write_text("{}")  # (a stray file: not an entry)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    killed_model = root / "models" / f".m.tmp-{dead}-1"  # a conversion whose process is gone
    converting = root / "models" / f".m.tmp-{os.getpid()}-1"  # one whose process runs: not a leftover
    killed_copy = root / "corpora" / f".{'1' * 64}.tmp"
    for d in (killed_model, converting, killed_copy):
        d.mkdir()
        (d / "part").write_text("x" * 100)
    copying = root / "corpora" / f".{'2' * 64}.tmp"  # a copy in progress: its builder holds the lock
    copying.mkdir()
    builder = contextlib.ExitStack()
    builder.enter_context(hold_directory(root / "corpora" / f".{'2' * 64}.lock", None))
    gone.write_text("")  # rewritten: nothing holds gone_store's content any more
    os.utime(kept, ns=(1, 1))  # touched, its content the store's: kept

    res = runner.invoke(app, ["cache", "list"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert f"{gone} (rewritten)" in out and f"{kept} (touched)" in out and "made before stores" in out
    assert "a killed conversion of m" in out and f"tmp-{os.getpid()}" not in out and "2222.tmp" not in out

    before = sorted(p.name for p in (root / "corpora").iterdir())
    res = runner.invoke(app, ["cache", "prune", "--dry-run"])
    assert res.exit_code == 0 and sorted(p.name for p in (root / "corpora").iterdir()) == before
    assert " ".join(res.output.split()).count("would remove") == 3

    with hold_directory(root / "corpora" / f".{gone_store.name}.lock", None):  # a process holds it: left
        res = runner.invoke(app, ["cache", "prune"])
    assert res.exit_code == 0 and gone_store.is_dir() and "in use by another process" in res.output
    assert not killed_model.exists() and not killed_copy.exists() and converting.is_dir() and copying.is_dir()
    builder.close()
    res = runner.invoke(app, ["cache", "prune"])
    assert res.exit_code == 0 and f"removed {gone_store}" in " ".join(res.output.split())
    assert not gone_store.exists() and kept_store.is_dir() and old.is_dir() and model.is_dir()
    assert list(corpus_store(kept, root / "corpora")) == DOCS
    assert "nothing to remove" in runner.invoke(app, ["cache", "prune"]).output
    # the store of a rewritten file, pruned, is made again from the file's new content when next needed
    write_corpus(gone, DOCS[1:])
    assert list(corpus_store(gone, root / "corpora")) == DOCS[1:]


def test_a_store_removed_while_it_is_opened_is_built_again(tmp_path):
    """`cache prune` of a store another process is about to open (looked at, not yet opened): the opener
    finds it gone and builds it again; one that had it open reads on."""
    root = tmp_path / "corpora"
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, DOCS)
    store = corpus_store(corpus, root)
    entry = next(e for e in entries(tmp_path) if e.kind == "corpus store")
    assert remove(entry) and not entry.path.exists()
    assert list(store) == DOCS  # its files are open: the reader reads on
    (entry.path).mkdir()
    (entry.path / "docs.offsets.npy").write_bytes(b"")  # the look saw a store; its documents are gone
    assert _whole_store(entry.path) is None
    shutil.rmtree(entry.path)
    assert list(corpus_store(corpus, root)) == DOCS and file_sha256(corpus) == entry.path.name


@pytest.mark.parametrize("body", ["[1, 2]", json.dumps({"path": "x"}), json.dumps([{"path": "x"}])])
def test_a_malformed_sources_record_is_no_record(tmp_path, body):
    (tmp_path / SOURCES_FILE).write_text(body)
    assert store_sources(tmp_path) == []


def test_a_store_in_a_cache_this_process_cannot_write_is_read_as_it_is(tmp_path, monkeypatch):
    """A store another user made, opened through a path it has not recorded: read, the record left unwritten
    (it only guides a prune), not a failed run."""
    from selfevo.search import docstore

    root = tmp_path / "corpora"
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_corpus(a, DOCS)
    shutil.copy(a, b)
    corpus_store(a, root)

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(docstore, "write_json", read_only)
    assert list(corpus_store(b, root)) == DOCS
    assert [r["path"] for r in store_sources(root / file_sha256(a))] == [str(a)]
