"""Search room: BM25 index, its on-disk cache, the budgeted tool, the HTTP server and client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import pickle
import shutil
import time

import bm25s
import httpx
import pytest
from _servers import free_port, serve_app, trickling_app
from _shared import CORPUS, loop_that_trains_nothing

from selfevo._http import read_body
from selfevo._io import file_sha256
from selfevo.corpus import write_corpus
from selfevo.records import Document
from selfevo.search import SearchBudgetExhausted, SearchTool
from selfevo.search.bm25 import MANIFEST, BM25Index
from selfevo.search.client import RetrieverClient, RetrieverError
from selfevo.search.server import body_cap, make_app, serve
from selfevo.search.tool import Hit

DOCS = [
    Document("d0", "Zebra", "The zebra is an African equine with black and white stripes."),
    Document("d1", "Horse", "The horse is a domesticated, one-toed, hoofed mammal."),
    Document("d2", "Danube", "The Danube is a major river of central Europe."),
    Document("d3", "Volga", "The Volga is the longest river in Europe, flowing into the Caspian."),
    Document("d4", "Stripes", "Stripes appear on zebras, tigers and some fish."),
    Document("d5", "Empty page", ""),
]


@pytest.fixture(scope="module")
def small() -> BM25Index:
    return BM25Index.build(DOCS)


def ids(hits: list[Hit]) -> list[str]:
    return [h.document.id for h in hits]


# ------------------------------------------------------------------ BM25 index


def test_retrieve_ranks_the_matching_document_first(small):
    [hits] = small.retrieve(["Which river is the longest in Europe?"], topk=3)
    assert ids(hits)[0] == "d3"  # "longest" only occurs in the Volga passage
    assert ids(hits)[1] == "d2"
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True) and scores[-1] > 0
    assert hits[0].document == DOCS[3]  # the full document comes back, title included


def test_retrieve_is_batched_and_matches_single_calls(small):
    queries = ["zebra stripes", "river Europe", "hoofed mammal"]
    batched = small.retrieve(queries, topk=2)
    assert len(batched) == 3
    assert batched == [small.retrieve([q], topk=2)[0] for q in queries]
    assert ids(batched[2]) == ["d1"]  # only the horse passage mentions "hoofed"/"mammal"


def test_topk_is_clipped_and_degenerate_queries_get_no_hits(small):
    [hits] = small.retrieve(["the zebra and the river"], topk=50)
    # topk 50 > 6 documents: only the three sharing a term come back ("zebras" in d4 is
    # another token: no stemming)
    assert sorted(ids(hits)) == ["d0", "d2", "d3"]
    # empty, whitespace, stopwords only, unknown words only: no crash, no arbitrary hits
    assert small.retrieve(["", "   ", "the of and", "qwertyuiop"], topk=3) == [[], [], [], []]
    assert small.retrieve([], topk=3) == []
    with pytest.raises(ValueError, match="topk"):
        small.retrieve(["zebra"], topk=0)


def test_ties_are_broken_by_corpus_order():
    twins = [Document(f"t{i}", "Twin", "identical text about comets") for i in range(6)]
    index = BM25Index.build([Document("x", "Other", "nothing relevant here")] + twins)
    [hits] = index.retrieve(["comets"], topk=4)
    assert ids(hits) == ["t0", "t1", "t2", "t3"]
    assert len({h.score for h in hits}) == 1


def test_scores_equal_bm25s_own_pipeline(small):
    """Our tokenizer mirrors bm25s.tokenize(stopwords="en"), so scores must be identical."""
    ref = bm25s.BM25()
    ref.index(bm25s.tokenize([f"{d.title} {d.text}" for d in DOCS], stopwords="en",
                             show_progress=False), show_progress=False)
    query = "zebra river Europe stripes"
    ref_scores = ref.get_scores(bm25s.tokenize([query], stopwords="en", return_ids=False,
                                               show_progress=False)[0])
    [hits] = small.retrieve([query], topk=len(DOCS))
    pos = {d.id: i for i, d in enumerate(DOCS)}
    for h in hits:
        assert h.score == pytest.approx(float(ref_scores[pos[h.document.id]]), rel=1e-6)
    assert len(hits) == int((ref_scores > 0).sum())


def _matrix_by_token(model: bm25s.BM25) -> dict[str, tuple[list[int], list[float]]]:
    """Each token's column of a bm25s score matrix: (document rows, float32 weights)."""
    sc = model.scores
    return {tok: (sc["indices"][sc["indptr"][j]:sc["indptr"][j + 1]].tolist(),
                  sc["data"][sc["indptr"][j]:sc["indptr"][j + 1]].tolist())
            for tok, j in model.vocab_dict.items() if tok}


def test_streaming_build_equals_bm25s_bit_for_bit(monkeypatch):
    """The streaming build computes the score matrix itself; every (term, document) weight must be
    the float32 bm25s's own `index` computes, over batches (several here), empty documents and
    repeated terms alike; so must the document count and the empty token bm25s adds."""
    import selfevo.search.bm25 as bm25_mod

    monkeypatch.setattr(bm25_mod, "_BATCH", 2)
    docs = DOCS + [Document("d6", "Zebra zebra", "zebra Zebra stripes stripes stripes river"),
                   Document("d7", "", "")]
    ours = BM25Index.build(docs).model
    ref = bm25s.BM25()
    ref.index([bm25_mod._tokens(f"{d.title} {d.text}") for d in docs], show_progress=False)
    assert _matrix_by_token(ours) == _matrix_by_token(ref)
    assert ours.scores["num_docs"] == ref.scores["num_docs"] == len(docs)
    assert ours.vocab_dict[""] == len(ours.vocab_dict) - 1  # bm25s's empty token, last


def test_streamed_file_build_never_holds_the_corpus(tmp_path, monkeypatch):
    """`build_index` streams the corpus file into the index's document store: no list of the
    corpus is ever made, and the saved index reads its documents back on demand."""
    import selfevo.corpus as corpus_mod
    from selfevo.search.docstore import DocStore
    from selfevo.search.index import build_index

    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, DOCS)
    monkeypatch.setattr(corpus_mod, "read_corpus", lambda *a: pytest.fail("read the whole corpus"))
    index = build_index("bm25", corpus, tmp_path / "idx")
    assert isinstance(index.docs, DocStore) and list(index.docs) == DOCS
    assert not (tmp_path / "idx" / ".docs-building").exists()
    assert index.retrieve(["zebra stripes"], 2) == BM25Index.build(DOCS).retrieve(["zebra stripes"], 2)
    assert index.corpus_sha256 == file_sha256(corpus)


def test_a_build_with_progress_knows_its_total(tmp_path, monkeypatch):
    """`selfevo index build` counts the corpus's lines first (no parse), so its progress bar shows
    the time left of an hours-long build rather than a bare count."""
    from selfevo.corpus import count_lines
    from selfevo.search import bm25 as bm25_mod
    from selfevo.search.index import build_index

    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, DOCS)
    assert count_lines(corpus) == len(DOCS)
    (tmp_path / "x").write_bytes(b"a\n\nb")  # a blank line counts; so does a last line without newline
    (tmp_path / "empty").write_bytes(b"")
    assert count_lines(tmp_path / "x") == 3 and count_lines(tmp_path / "empty") == 0
    totals = []
    real = bm25_mod.ProgressBar

    def recording(show, total, what):
        totals.append(total)
        return real(False, total, what)

    monkeypatch.setattr(bm25_mod, "ProgressBar", recording)
    build_index("bm25", corpus, tmp_path / "idx", progress=True)
    build_index("bm25", corpus, tmp_path / "idx2")
    assert totals == [len(DOCS), None]


def test_a_malformed_corpus_leaves_the_saved_index_as_it_was(tmp_path):
    """A corpus that turns out malformed half-way through the stream: the error names file and line,
    and the index already in the directory still loads, documents and all (bad input loses nothing)."""
    from selfevo.corpus import DataError
    from selfevo.search.index import build_index, open_index

    good = tmp_path / "good.jsonl"
    write_corpus(good, DOCS)
    build_index("bm25", good, tmp_path / "idx")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text() + '{"id": "d9", "contents": \n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl:7"):
        build_index("bm25", bad, tmp_path / "idx")
    kept = open_index(tmp_path / "idx", expected_corpus_sha256=file_sha256(good))
    assert list(kept.docs) == DOCS and ids(kept.retrieve(["Danube"], 1)[0]) == ["d2"]
    with pytest.raises(DataError, match="corpus is empty"):
        (tmp_path / "empty.jsonl").write_text("\n")
        build_index("bm25", tmp_path / "empty.jsonl", tmp_path / "idx2")


def test_doc_store_reads_on_demand_and_opens_older_indexes(tmp_path):
    from selfevo.corpus import DataError
    from selfevo.search.docstore import DOCS_FILE, OFFSETS_FILE, DocStore

    store = DocStore.write(tmp_path / "a", iter(DOCS))  # any iterable, streamed
    assert len(store) == len(DOCS) and store[0] == DOCS[0] and store[-1] == DOCS[-1]
    assert store[1:3] == DOCS[1:3] and list(store) == DOCS and store == DOCS
    assert pickle.loads(pickle.dumps(store)) == store  # a worker process reopens the same file
    with pytest.raises(IndexError):
        store[len(DOCS)]
    # an index saved before offsets existed: docs.jsonl alone is scanned once
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / DOCS_FILE).write_bytes((tmp_path / "a" / DOCS_FILE).read_bytes())
    old = DocStore(tmp_path / "old")
    assert list(old) == DOCS and old == store
    # offsets of another file (a docs.jsonl replaced by hand) are not trusted
    (tmp_path / "a" / DOCS_FILE).write_bytes((tmp_path / "a" / DOCS_FILE).read_bytes()[:-1] + b" \n")
    assert list(DocStore(tmp_path / "a")) == DOCS and (tmp_path / "a" / OFFSETS_FILE).exists()
    other = DocStore.write(tmp_path / "b", DOCS[:-1] + [Document("d5", "Empty page", "x")])
    assert other != store and other != DOCS
    # a damaged line is a DataError naming the file and the document's line
    raw = (tmp_path / "b" / DOCS_FILE).read_bytes().replace(b'"d2"', b'"d2\x00', 1)
    (tmp_path / "b" / DOCS_FILE).write_bytes(raw)
    with pytest.raises(DataError, match=r"docs\.jsonl:3"):
        DocStore(tmp_path / "b")[2]


# ------------------------------------------------------------------ persistence


def test_save_load_round_trip(small, tmp_path):
    small.save(tmp_path / "idx")
    manifest = json.loads((tmp_path / "idx" / MANIFEST).read_text())
    assert manifest["num_docs"] == len(DOCS)
    assert manifest["format_version"] == 2
    assert manifest["corpus_sha256"] == small.corpus_sha256 and len(small.corpus_sha256) == 64
    assert not list((tmp_path / "idx").glob("*.pkl")) and not list((tmp_path / "idx").glob("*.pickle"))

    loaded = BM25Index.load(tmp_path / "idx", expected_corpus_sha256=small.corpus_sha256)
    assert list(loaded.docs) == DOCS
    queries = ["zebra", "river Europe longest", "domesticated horse", ""]
    assert loaded.retrieve(queries, topk=3) == small.retrieve(queries, topk=3)


def test_a_loaded_index_outlives_a_rebuild_of_its_directory(tmp_path):
    """bm25s maps the score matrix: `save` renames new files over the old, so a server that loaded the
    directory keeps answering (a file rewritten in place under a map would change or kill it)."""
    BM25Index.build(DOCS).save(tmp_path / "idx")
    loaded = BM25Index.load(tmp_path / "idx")
    queries = ["zebra stripes", "river Europe longest", "domesticated horse"]
    before = loaded.retrieve(queries, topk=3)
    BM25Index.build(DOCS[::-1]).save(tmp_path / "idx")  # same sizes, every row moved
    assert loaded.retrieve(queries, topk=3) == before
    assert list(BM25Index.load(tmp_path / "idx").docs) == DOCS[::-1]


def test_load_refuses_a_mismatched_or_incomplete_index(small, tmp_path):
    small.save(tmp_path / "idx")
    with pytest.raises(ValueError, match="corpus sha256"):
        BM25Index.load(tmp_path / "idx", expected_corpus_sha256="0" * 64)

    manifest_path = tmp_path / "idx" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(ValueError, match="format version"):
        BM25Index.load(tmp_path / "idx")

    manifest_path.write_text(json.dumps({**manifest, "num_docs": 5}))
    with pytest.raises(ValueError, match="6"):
        BM25Index.load(tmp_path / "idx")

    manifest_path.unlink()
    with pytest.raises(ValueError, match="manifest"):
        BM25Index.load(tmp_path / "idx")


def test_from_corpus_file_caches_and_rebuilds_on_change(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, DOCS)
    built = BM25Index.from_corpus_file(corpus, index_dir=tmp_path / "idx")
    assert built.corpus_sha256 == file_sha256(corpus)
    assert json.loads((tmp_path / "idx" / MANIFEST).read_text())["corpus_sha256"] == file_sha256(corpus)

    # Second call must come from the cache: building is forbidden.
    real_build = BM25Index.build.__func__

    def no_build(cls, *a, **k):
        raise AssertionError("rebuilt although the cache matches")

    monkeypatch.setattr(BM25Index, "build", classmethod(no_build))
    cached = BM25Index.from_corpus_file(corpus, index_dir=tmp_path / "idx")
    assert cached.retrieve(["zebra"], 2) == built.retrieve(["zebra"], 2)

    # A changed corpus file has another hash: the stale cache is rebuilt and overwritten.
    monkeypatch.setattr(BM25Index, "build", classmethod(real_build))
    write_corpus(corpus, DOCS + [Document("d6", "Okapi", "The okapi is related to the giraffe.")])
    rebuilt = BM25Index.from_corpus_file(corpus, index_dir=tmp_path / "idx")
    assert len(rebuilt) == 7 and ids(rebuilt.retrieve(["okapi"], 1)[0]) == ["d6"]
    assert BM25Index.load(tmp_path / "idx", expected_corpus_sha256=file_sha256(corpus)).docs[-1].id == "d6"


# ------------------------------------------------------------------ the real corpus


@pytest.fixture(scope="module")
def wiki() -> BM25Index:
    if not CORPUS.exists():
        pytest.skip(f"real corpus not found at {CORPUS}")
    return BM25Index.from_corpus_file(CORPUS)


def test_real_corpus_index(wiki, tmp_path):
    assert len(wiki) == 21_845
    [hits] = wiki.retrieve(["Vanuatu Labor Corps"], topk=3)
    assert hits[0].document.id == "17840574"
    assert hits[0].document.title == "Vanuatu Labor Corps"
    assert len(hits) == 3

    wiki.save(tmp_path / "wiki")
    loaded = BM25Index.load(tmp_path / "wiki", expected_corpus_sha256=file_sha256(CORPUS))
    queries = ["Who wrote The Book of the Law?", "Melbourne Cup 1930 racehorse"]
    assert loaded.retrieve(queries, 3) == wiki.retrieve(queries, 3)


def test_a_single_query_builds_no_progress_bar_and_no_tokenizer(wiki, monkeypatch):
    """Simulated agents issue thousands of single queries: no per-call overhead (a progress bar, a
    tokenizer built) — checked by what a call constructs, not by a timing; the single-query rate is
    benchmarks/retrieval.py's (docs/benchmarks.md)."""
    import bm25s
    import rich.progress
    import tqdm.std

    wiki.retrieve(["warm up"], 3)
    made = []
    for owner, name in ((rich.progress.Progress, "__init__"), (tqdm.std.tqdm, "__init__"),  # bm25s's bars: tqdm
                        (bm25s.tokenization.Tokenizer, "__init__"), (bm25s, "tokenize")):
        monkeypatch.setattr(owner, name, lambda *a, _n=f"{owner.__name__}.{name}", **k: made.append(_n))
    for i in range(20):
        assert len(wiki.retrieve([f"history of golf tournament {i}"], 3)[0]) == 3
    assert made == []


# ------------------------------------------------------------------ SearchTool


class CountingRetriever:
    def __init__(self, inner: BM25Index):
        self.inner, self.calls, self.queries = inner, 0, 0

    def retrieve(self, queries, topk=3):
        self.calls += 1
        self.queries += len(queries)
        return self.inner.retrieve(queries, topk)


def test_search_tool_budget(small):
    tool = SearchTool(CountingRetriever(small), topk=2, max_calls=3)
    session = tool.session()
    for q in ["zebra", "river", "horse"]:
        assert len(session.search(q)) >= 1
    assert session.calls_left == 0
    with pytest.raises(SearchBudgetExhausted):
        session.search("stripes")
    assert session.queries == ["zebra", "river", "horse"]
    assert len(tool.session().search("stripes")) == 2  # a new trajectory gets a new budget


def test_search_tool_cache_skips_the_retriever(small):
    counting = CountingRetriever(small)
    tool = SearchTool(counting, topk=2, max_calls=5)
    first = tool.session().search("zebra stripes")
    again = tool.session().search("zebra stripes")
    assert again == first and ids(first)[0] in {"d0", "d4"}
    assert counting.calls == 1 and tool.queries_issued == 1 and tool.calls == 2
    tool.lookup(["zebra stripes", "river", "river"])
    assert counting.calls == 2 and counting.queries == 2  # only "river" was new, asked once


def test_search_tool_cache_drops_the_least_recently_used_query_past_its_size(small):
    counting = CountingRetriever(small)
    tool = SearchTool(counting, topk=2, cache_size=2)
    want = {q: tool.lookup([q])[0] for q in ("zebra", "river", "horse")}  # "zebra" dropped for "horse"
    assert counting.queries == 3
    assert tool.lookup(["river"]) == [want["river"]] and counting.queries == 3  # kept; now the most recent
    assert tool.lookup(["zebra"]) == [want["zebra"]] and counting.queries == 4  # asked again; drops "horse"
    assert tool.lookup(["river"]) == [want["river"]] and counting.queries == 4
    assert tool.lookup(["horse"]) == [want["horse"]] and counting.queries == 5
    # a batch of more new queries than the cache holds is answered whole, then trimmed to the size
    batch = tool.lookup(["a zebra", "a river", "a horse"])
    assert len(batch) == 3 and len(tool._cache) == 2 and list(tool._cache) == ["a river", "a horse"]


# ------------------------------------------------------------------ server over real HTTP


@pytest.fixture(scope="module")
def server_url(small):
    with serve_app(make_app(small, max_queries=8, max_topk=5, max_body_bytes=1 << 20)) as url:
        yield url


def test_health(server_url):
    r = httpx.get(f"{server_url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "documents": len(DOCS)}
    with RetrieverClient(server_url) as client:
        assert client.health()["documents"] == 6


def test_client_round_trip_equals_local(small, server_url):
    queries = ["river Europe longest", "zebra", "", "hoofed", "stripes tigers"]
    # batch_size=2 forces three requests; a trailing /retrieve in the URL is accepted
    with RetrieverClient(f"{server_url}/retrieve", batch_size=2) as client:
        remote = client.retrieve(queries, topk=3)
    local = small.retrieve(queries, topk=3)
    assert [ids(h) for h in remote] == [ids(h) for h in local]
    assert ids(remote[0])[:2] == ["d3", "d2"] and remote[2] == []
    for r_hits, l_hits in zip(remote, local):
        for r, loc in zip(r_hits, l_hits):
            assert r.document == loc.document and r.score == pytest.approx(loc.score, rel=1e-6)


def test_raw_api_shapes(server_url):
    r = httpx.post(f"{server_url}/retrieve",
                   json={"queries": ["longest river"], "topk": 2, "return_scores": True})
    assert r.status_code == 200
    [[first, second]] = r.json()["result"]
    assert first["document"] == {"id": "d3", "contents": DOCS[3].contents}
    assert first["score"] > second["score"] > 0

    r = httpx.post(f"{server_url}/retrieve", json={"queries": ["longest river"], "topk": 1,
                                                   "return_scores": False})
    assert r.json() == {"result": [[{"id": "d3", "contents": DOCS[3].contents}]]}
    # Search-R1 defaults: return_scores false; topk defaults to 3 here
    r = httpx.post(f"{server_url}/retrieve", json={"queries": ["zebra stripes river Europe"]})
    assert r.status_code == 200 and len(r.json()["result"][0]) == 3
    assert set(r.json()["result"][0][0]) == {"id", "contents"}


def test_an_empty_batch_is_answered_as_search_r1_answers_it(server_url):
    """Search-R1's trainer posts a turn's searches over its whole rollout batch, an empty list in a
    turn where no trajectory searched, and reads `["result"]` of the reply: a 422 was a KeyError there."""
    r = httpx.post(f"{server_url}/retrieve", json={"queries": [], "topk": 3, "return_scores": True})
    assert r.status_code == 200 and r.json() == {"result": []}


@pytest.mark.parametrize("body, status", [
    (b"{not json", 422),
    (b"\xff\xfe", 422),
    (b"[]", 422),
    (json.dumps({"topk": 3}).encode(), 422),  # no queries
    (json.dumps({"queries": "zebra"}).encode(), 422),  # not a list
    (json.dumps({"queries": [1, 2]}).encode(), 422),
    (json.dumps({"queries": ["q"] * 9}).encode(), 422),  # max_queries=8
    (json.dumps({"queries": ["q"], "topk": 0}).encode(), 422),
    (json.dumps({"queries": ["q"], "topk": 6}).encode(), 422),  # max_topk=5
    (json.dumps({"queries": ["q"], "topk": "many"}).encode(), 422),
    (json.dumps({"queries": ["x" * 2001]}).encode(), 422),
    (json.dumps({"queries": ["x" * 2000]}).encode(), 200),  # the limit itself is allowed
    (json.dumps({"queries": ["q"], "pad": "y" * (2 << 20)}).encode(), 413),  # max_body_bytes=1 MiB
])
def test_malformed_requests_get_4xx(server_url, body, status):
    r = httpx.post(f"{server_url}/retrieve", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text


def test_oversized_chunked_body_gets_413(server_url):
    def chunks():  # no Content-Length: the cap must hold while the body streams in
        yield b'{"queries": ["q"], "pad": "'
        for _ in range(40):
            yield b"y" * 65_536
        yield b'"}'

    r = httpx.post(f"{server_url}/retrieve", content=chunks(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_a_request_within_the_caps_fits_the_body_cap(small):
    """4,096 queries of 2,000 characters each were promised but the body cap (16 MiB) left 4 KB a
    query: CJK text (6 bytes a character escaped) or characters outside the BMP (12) got a 413. The cap
    is now what the query caps can need, escapes and indentation included; a byte more is a 413."""
    from fastapi.testclient import TestClient

    from selfevo.search.server import body_cap

    client = TestClient(make_app(small, max_queries=3))
    queries = ["\U0001F600" * 2000, "\u6cb3" * 2000, "x" * 2000]  # an emoji, a CJK character, ASCII
    body = json.dumps({"queries": queries, "topk": 5, "return_scores": True}, indent=8).encode()
    assert len(body) > 3 * 4096  # what the old cap gave them
    r = client.post("/retrieve", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200 and len(r.json()["result"]) == 3
    padded = body[:-1] + b" " * (body_cap(3) - len(body) + 1) + b"}"
    r = client.post("/retrieve", content=padded, headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_serve_binds_loopback_by_default():
    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"


# ------------------------------------------------------------------ client errors and retries


def _mock_client(handler, **kwargs) -> tuple[RetrieverClient, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(len(seen), request)

    return RetrieverClient("http://fake", backoff_s=0, transport=httpx.MockTransport(record),
                           **kwargs), seen


GOOD = {"result": [[{"document": {"id": 7, "contents": '"T"\nbody'}, "score": 1.5}]]}


def test_client_retries_transient_errors():
    client, seen = _mock_client(
        lambda n, req: httpx.Response(503 if n == 1 else 429 if n == 2 else 200, json=GOOD))
    [[hit]] = client.retrieve(["q"], topk=1)
    assert len(seen) == 3
    assert hit == Hit(Document("7", "T", "body"), 1.5)
    assert json.loads(seen[-1].content) == {"queries": ["q"], "topk": 1, "return_scores": True}


def test_client_waits_as_long_as_retry_after_asks(monkeypatch):
    """A 429 or 503 with Retry-After (seconds or an HTTP date) is retried after the wait it asks
    for, when that is longer than the backoff, and never after more than MAX_WAIT_S."""
    import email.utils

    from selfevo.search import client as client_mod
    from selfevo.search.client import MAX_WAIT_S, retry_after_seconds

    waits: list[float] = []
    monkeypatch.setattr(client_mod.time, "sleep", waits.append)
    soon = email.utils.formatdate(time.time() + 30, usegmt=True)
    asks = {1: "2", 2: "3600", 3: soon}
    client, seen = _mock_client(lambda n, req: httpx.Response(
        429 if n < 4 else 200, headers={"Retry-After": asks[n]} if n in asks else {}, json=GOOD))
    assert len(client.retrieve(["q"])) == 1 and len(seen) == 4
    assert waits[:2] == [2.0, MAX_WAIT_S] and 20 < waits[2] <= 30  # whole seconds, and a loaded machine
    assert retry_after_seconds("soon") is None and retry_after_seconds(None) is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: at once


def test_client_gives_up_after_retries_and_on_4xx():
    client, seen = _mock_client(lambda n, req: httpx.Response(500, text="boom"), retries=2)
    with pytest.raises(RetrieverError, match="HTTP 500"):
        client.retrieve(["q"])
    assert len(seen) == 3

    client, seen = _mock_client(lambda n, req: httpx.Response(422, json={"detail": "bad topk"}))
    with pytest.raises(RetrieverError, match="bad topk"):
        client.retrieve(["q"])
    assert len(seen) == 1  # a client error is not retried


def test_client_connection_refused_is_retried_then_reported():
    client = RetrieverClient(f"http://127.0.0.1:{free_port()}", retries=1, backoff_s=0)
    with pytest.raises(RetrieverError, match="after 2 attempts"):
        client.retrieve(["q"])


def test_client_names_damaged_replies_without_a_traceback_or_the_password():
    """A body that does not decode as its Content-Encoding says, or JSON nested past the parser's limit,
    escaped as a traceback (eval exited 1 after 160 lines); a NaN score was taken; a password in the
    URL was printed in every error (a helper's review)."""
    bad_gzip = lambda n, req: httpx.Response(200, headers={"content-encoding": "gzip"}, content=b"not gzip")  # noqa: E731
    client, seen = _mock_client(bad_gzip, retries=1)
    with pytest.raises(RetrieverError, match="DecodingError.*after 2 attempts"):
        client.retrieve(["q"])
    assert len(seen) == 2  # (a proxy's fault: asked again)
    deep = b"[" * 100_000 + b"]" * 100_000
    client, _ = _mock_client(lambda n, req: httpx.Response(200, content=deep))
    with pytest.raises(RetrieverError, match="not JSON"):
        client.retrieve(["q"])
    nan = b'{"result": [[{"document": {"id": "1", "contents": "c"}, "score": NaN}]]}'
    client, _ = _mock_client(lambda n, req: httpx.Response(200, content=nan))
    with pytest.raises(RetrieverError, match="malformed"):
        client.retrieve(["q"])
    client = RetrieverClient(f"http://user:s3cret@127.0.0.1:{free_port()}", retries=0, backoff_s=0)
    with pytest.raises(RetrieverError) as err:
        client.retrieve(["q"])
    assert "s3cret" not in str(err.value) and "http://***@127.0.0.1" in str(err.value)


def test_eval_writes_no_retriever_password(server_url, tmp_path):
    """`eval --retriever-url http://user:PW@host` scrubbed the agent's URL, not the retriever's: score.json
    held the password."""
    from _shared import QA_DIR

    from selfevo.evaluate import run_eval

    secret = server_url.replace("http://", "http://user:s3cret@")
    run_eval(QA_DIR, None, "retrieval-baseline", tmp_path / "ev", limit=1, retriever_url=secret, progress=False)
    score = (tmp_path / "ev" / "score.json").read_text()
    assert "s3cret" not in score and '"retriever_url": "http://***@127.0.0.1' in score


def test_client_timeout_bounds_a_reply_trickled_in():
    """httpx's timeout bounds each read: a server sending a byte every half second held a call with a 2 s
    timeout for 40 s (the chat client's fix, now shared)."""
    trickler = trickling_app(json.dumps(GOOD).encode(), {"/retrieve": "POST"}, 1, 0.1)  # ~8 s in all
    with serve_app(trickler) as url, RetrieverClient(url, timeout=1.0, retries=0) as client:
        start = time.monotonic()
        with pytest.raises(RetrieverError, match="ReadTimeout"):
            client.retrieve(["q"])
        assert time.monotonic() - start < 3


@pytest.mark.parametrize("payload, match", [
    ({"results": []}, "malformed"),
    ({"result": [[{"document": {"id": "1"}, "score": 1.0}]]}, "malformed"),
    ({"result": [[{"document": {"id": "1", "contents": "c"}, "score": "high"}]]}, "malformed"),
    ({"result": [[], []]}, "2 result lists for 1 queries"),
])
def test_client_rejects_malformed_responses(payload, match):
    client, _ = _mock_client(lambda n, req: httpx.Response(200, json=payload))
    with pytest.raises(RetrieverError, match=match):
        client.retrieve(["q"])


def test_client_rejects_non_json():
    client, _ = _mock_client(lambda n, req: httpx.Response(200, text="<html>"))
    with pytest.raises(RetrieverError, match="not JSON"):
        client.retrieve(["q"])


def test_client_batches_queries():
    def echo(n, req):
        qs = json.loads(req.content)["queries"]
        return httpx.Response(200, json={"result": [
            [{"document": {"id": q, "contents": f'"{q}"\ntext'}, "score": 1.0}] for q in qs]})

    client, seen = _mock_client(echo, batch_size=3)
    out = client.retrieve([f"q{i}" for i in range(7)])
    assert [len(json.loads(r.content)["queries"]) for r in seen] == [3, 3, 1]
    assert [hits[0].document.id for hits in out] == [f"q{i}" for i in range(7)]
    assert [hits[0].document.title for hits in out] == [f"q{i}" for i in range(7)]


def test_a_runaway_query_searches_the_same_locally_and_through_the_server():
    """A model that writes a search query past the server's 2,000-character cap must not end the
    batch (and the evaluation) with RetrieverError: every retriever sees the query cut to the cap."""
    from selfevo.agents.lm.rollout import run_rollouts

    index = BM25Index.build([Document("d0", "Danube", "The Danube is a major river of central Europe."),
                             Document("d1", "Volga", "The Volga is the longest river in Europe.")])
    query = " ".join(["longest river in europe"] * 100)  # 2,399 characters

    def generate(convs, seed):
        return [("<answer> Volga </answer>", "stop") if any(m["role"] == "assistant" for m in c)
                else (f"<search> {query} </search>", "stop") for c in convs]

    local = run_rollouts([[{"role": "user", "content": "q"}]], SearchTool(index), generate)
    with serve_app(make_app(index)) as url, RetrieverClient(url) as client:
        remote = run_rollouts([[{"role": "user", "content": "q"}]], SearchTool(client), generate)
        assert [h.document.id for h in client.retrieve([query], topk=2)[0]] == ["d1", "d0"]
    assert local[0].answer == remote[0].answer == "Volga"
    assert local[0].read == remote[0].read == ["d1", "d0"]


# ------------------------------------------------------------------ corpus runs on a saved index


def test_a_corpus_run_searches_a_saved_index_reading_documents_on_demand(tmp_path, monkeypatch):
    """`data.index` (`evolve --index`): a corpus run searches the saved index of its corpus (any kind),
    whose documents stay on disk; its folds are the source pool's (every other page hashes alike), and
    the index of another corpus, or an index without a corpus, is refused naming `data.index`."""

    import selfevo.evolve
    from selfevo.config import ConfigError, load_config
    from selfevo.evolve import environment, evolve, source_pool
    from selfevo.loop.folds import fold_of
    from selfevo.runs import RunDir
    from selfevo.search.docstore import DocStore
    from selfevo.search.index import build_index

    corpus, qa = tmp_path / "data" / "corpus" / "c.jsonl", tmp_path / "data" / "qa"
    corpus.parent.mkdir(parents=True)
    qa.mkdir()
    docs = [Document(str(i), f"Page {i}", f"Page {i} was founded in {1900 + i}.") for i in range(40)]
    write_corpus(corpus, docs)
    (qa / "nq.jsonl").write_text(json.dumps({"id": "q0", "question": "When was Page 1 founded?",
                                             "golden_answers": ["1901"]}) + "\n", encoding="utf-8")
    build_index("bm25", corpus, tmp_path / "idx")
    on = {"data.corpus": str(corpus), "data.qa_dir": str(qa), "data.index": str(tmp_path / "idx"),
          "loop.source_docs": 10}
    cfg = load_config(None, [], backend="lm", treatment="crossfit", **on)
    env = environment(cfg)
    assert isinstance(env.documents, DocStore) and env.index.docs is env.documents
    assert list(env.documents) == docs
    in_memory = BM25Index.build(docs)
    assert env.index.retrieve(["Page 7 founded"], 3) == in_memory.retrieve(["Page 7 founded"], 3)
    assert source_pool(cfg, env.documents) == source_pool(cfg, docs)  # the same sample, never a copy

    monkeypatch.setattr(selfevo.evolve, "build_loop", loop_that_trains_nothing)  # not what is checked here
    out = tmp_path / "run"
    evolve(cfg, out, progress=False, audit=False)
    folds = json.loads((out / "folds.json").read_text())
    pool = source_pool(cfg, docs)
    assert folds["folds"] == {d.id: fold_of(d.id, cfg.seed, 2) for d in pool}
    assert RunDir(out).manifest()["corpus_sha256"] == file_sha256(corpus)

    other = tmp_path / "other.jsonl"
    write_corpus(other, docs[:5])
    build_index("bm25", other, tmp_path / "other-idx")
    with pytest.raises(ConfigError, match="data.index: .*corpus sha256"):
        environment(load_config(None, [], backend="lm", **{**on, "data.index": str(tmp_path / "other-idx")}))
    with pytest.raises(ConfigError, match="data.index"):
        load_config(None, [], **{"data.index": str(tmp_path / "idx")})


def test_a_passage_keeps_the_corpus_contents_verbatim(tmp_path):
    """1,587 wiki18-mini passages start `Lokma\\n...`, without the quotes FlashRAG writes: an index
    re-quoted them, so it served, and a dense index embedded, text the corpus does not hold (an
    adopted FlashRAG FAISS index was then refused as another encoder's)."""
    raw = ['Lokma\nLokma is a pastry.', '"Baklava"\nBaklava is a pastry too.', 'No title line at all', '']
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "contents": c}) + "\n" for i, c in enumerate(raw)),
                    encoding="utf-8")
    docs = [Document.from_contents(str(i), c) for i, c in enumerate(raw)]
    assert [d.contents for d in docs] == raw
    assert (docs[0].title, docs[0].text) == ("Lokma", "Lokma is a pastry.")  # parsed as before
    assert docs[1] == Document("1", "Baklava", "Baklava is a pastry too.")  # the quoted form: nothing extra
    assert docs[3].contents == ""  # an empty passage is served empty (was '""\n': an empty quoted title)
    index = BM25Index.from_corpus_file(path, index_dir=tmp_path / "idx")
    again = BM25Index.load(tmp_path / "idx")
    assert [d.contents for d in again.docs] == raw
    with serve_app(make_app(again)) as url, RetrieverClient(url) as client:
        hits = client.retrieve(["Lokma pastry"], topk=1)[0]
    assert hits[0].document.contents == raw[0] == index.retrieve(["Lokma pastry"], topk=1)[0][0].document.contents


def test_a_query_with_a_lone_surrogate_gets_the_same_hits_in_process_and_over_http(tmp_path):
    """A lone surrogate cannot be sent as UTF-8: the client raised UnicodeEncodeError (no
    RetrieverError), while an index in the process answered. Both now search U+FFFD in its place."""
    index = BM25Index.build([Document("1", "Lokma", "Lokma is a pastry."), Document("2", "Rome", "A city.")])
    with serve_app(make_app(index)) as url, RetrieverClient(url) as client:
        remote = client.retrieve(["Lokma\ud800 pastry"], topk=2)
    local = SearchTool(index, topk=2).lookup(["Lokma\ud800 pastry"])[0]
    assert [h.document.id for h in remote[0]] == [h.document.id for h in local] == ["1"]


@pytest.mark.parametrize("text, message", [
    ("[1]", "manifest.json: expected a JSON object, got a JSON list"),
    ('{"kind": "bm25", ', "manifest.json: unreadable, not a JSON manifest"),
    ('{"format_version": 2, "kind": "dense"}', "manifest.json: field(s) corpus_sha256, model, query_prefix"),
    ('{"format_version": 2, "kind": "hybrid", "corpus_sha256": "x"}', "manifest.json: field(s) parts, rrf_k, depth"),
])
def test_a_damaged_or_foreign_index_manifest_is_named(tmp_path, text, message):
    """(before: AttributeError, KeyError 'model', or a JSON error naming no file)"""
    from selfevo.search.index import open_index

    (tmp_path / "manifest.json").write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=f"{tmp_path}/{message}".replace("(", r"\(").replace(")", r"\)")):
        open_index(tmp_path)


def test_a_cache_with_a_damaged_manifest_is_rebuilt(tmp_path):
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, [Document("1", "Lokma", "Lokma is a pastry."), Document("2", "Rome", "A city.")])
    BM25Index.from_corpus_file(corpus, index_dir=tmp_path / "cache")
    (tmp_path / "cache" / MANIFEST).write_text("null", encoding="utf-8")
    from selfevo.search.index import get_retriever

    again = get_retriever(corpus=corpus, cache_dir=tmp_path / "cache")
    assert len(again) == 2 and json.loads((tmp_path / "cache" / MANIFEST).read_text())["format_version"] == 2


def test_a_retry_after_of_digits_float_cannot_read_is_ignored(monkeypatch):
    """`str.isdigit` takes "²" (a digit to Unicode, not to float): the client raised a bare ValueError
    out of `retrieve` on such a header; it is unreadable, and the client's own backoff applies."""
    from selfevo.search import client as client_mod
    from selfevo.search.client import retry_after_seconds

    assert retry_after_seconds("²") is None and retry_after_seconds("2") == 2.0
    waits: list[float] = []
    monkeypatch.setattr(client_mod.time, "sleep", waits.append)
    client, seen = _mock_client(lambda n, req: httpx.Response(
        503 if n == 1 else 200, headers={"Retry-After": "²".encode()} if n == 1 else {}, json=GOOD))
    assert len(client.retrieve(["q"])) == 1 and len(seen) == 2 and len(waits) == 1


@pytest.mark.parametrize("name, damage", [
    ("params.index.json", b"["),  # JSON that does not parse: bm25s's error named no file
    ("params.index.json", b"[]"),  # not bm25s's object: a TypeError
    ("vocab.index.json", b"[1, 2]"),  # an AttributeError
    ("data.csc.index.npy", b"\x93NUMPY"),  # a truncated array
])
def test_damaged_bm25_files_are_named_and_a_damaged_cache_is_rebuilt(tmp_path, name, damage):
    """A BM25 directory whose manifest is whole but whose bm25s files are damaged raised bm25s's
    own error (TypeError / AttributeError, or a JSON or numpy error naming no file): a traceback from
    the CLI, and a cache in that state was not rebuilt. Now a ValueError naming the directory."""
    from selfevo.search.index import get_retriever, open_index

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, DOCS)
    BM25Index.from_corpus_file(corpus, index_dir=tmp_path / "cache")
    (tmp_path / "cache" / name).write_bytes(damage)
    with pytest.raises(ValueError, match=f"{tmp_path / 'cache'}: damaged BM25 index files"):
        open_index(tmp_path / "cache")
    again = get_retriever(corpus=corpus, cache_dir=tmp_path / "cache")
    assert ids(again.retrieve(["zebra stripes"], 1)[0]) == ["d0"]
    assert ids(open_index(tmp_path / "cache").retrieve(["zebra stripes"], 1)[0]) == ["d0"]  # rewritten whole


def test_an_html_error_page_is_said_in_one_line():
    """A proxy's error page (nginx's 502 after the retries, its 404 for a wrong path) was quoted raw in
    the RetrieverError, markup and line breaks, ending `eval` with a multi-line HTML message."""
    page = ("<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway"
            "</h1></center>\r\n<hr><center>nginx/1.18.0</center>\r\n</body>\r\n</html>\r\n")
    client, seen = _mock_client(lambda n, req: httpx.Response(502, text=page), retries=1)
    with pytest.raises(RetrieverError) as e:
        client.retrieve(["q"])
    assert str(e.value).endswith("/retrieve: HTTP 502: 502 Bad Gateway") and len(seen) == 2
    client, _ = _mock_client(lambda n, req: httpx.Response(422, text='{"detail":\n "bad topk"}'))
    with pytest.raises(RetrieverError, match='HTTP 422: {"detail": "bad topk"}$'):
        client.retrieve(["q"])


# Tests of a mutation sweep of the retrieval stack (forty-first session): each passes on the code and
# fails on the mutant its docstring names, or on the code before this session's fix.

def test_the_tokenizer_is_bm25s_own_on_one_letter_words_digits_and_accents():
    """An index built here must score as `bm25s.tokenize(..., stopwords="en")` would: that splitter keeps
    words of two or more characters only (\\w\\w+), lowercases, and keeps digits and accented letters."""
    from selfevo.search.bm25 import _tokens

    text = "A 1 b 42 X-ray Café THE Über naïve 3D I a vitamin C"
    ref = bm25s.tokenize([text], stopwords="en", return_ids=False, show_progress=False)[0]
    assert _tokens(text) == ref == ["42", "ray", "café", "über", "naïve", "3d", "vitamin"]
    index = BM25Index.build([Document("v", "Vitamin C", "Vitamin C is ascorbic acid."),
                             Document("x", "X", "c c c c c")])
    assert index.retrieve(["c"], 3) == [[]]  # a one-letter word is no term


def test_a_repeated_query_word_counts_each_time_as_in_bm25s(small):
    """bm25s sums a query's token weights with repeats (a query is a bag of words): "river river Europe"
    weighs "river" twice. Deduplicating the query's terms would change scores and rankings."""
    ref = bm25s.BM25()
    ref.index(bm25s.tokenize([f"{d.title} {d.text}" for d in DOCS], stopwords="en", show_progress=False),
              show_progress=False)
    query = "river river river Europe stripes"
    ref_scores = ref.get_scores(bm25s.tokenize([query], stopwords="en", return_ids=False,
                                               show_progress=False)[0])
    [hits] = small.retrieve([query], topk=len(DOCS))
    pos = {d.id: i for i, d in enumerate(DOCS)}
    assert [h.score for h in hits] == [pytest.approx(float(ref_scores[pos[h.document.id]]), rel=1e-6)
                                       for h in hits]
    [once] = small.retrieve(["river"], topk=2)
    [twice] = small.retrieve(["river river"], topk=2)
    assert [h.score for h in twice] == [pytest.approx(2 * h.score) for h in once]


def test_ties_among_many_hits_keep_corpus_order():
    """Ties are broken by corpus order however many hits there are: an unstable sort keeps the order of
    a handful of equal scores (numpy sorts short arrays by insertion) but not of a few dozen at several levels."""
    texts = ["comets", "comets comets", "comets comets comets"]
    docs = [Document(f"c{i:02d}", "Sky", f"{texts[i % 3]} seen tonight") for i in range(45)]
    index = BM25Index.build(docs)
    [hits] = index.retrieve(["comets"], topk=40)
    assert len(hits) == 40 and len({h.score for h in hits}) == 3
    pos = {d.id: i for i, d in enumerate(docs)}
    assert [(-h.score, pos[h.document.id]) for h in hits] == sorted((-h.score, pos[h.document.id]) for h in hits)


def test_an_index_refuses_a_document_list_of_another_length(small):
    """A score matrix over n documents with a list of n-1 would return positions past the list's end
    (an IndexError at some query) or the wrong passages: refused when the index is made."""
    with pytest.raises(ValueError, match="index holds 6 documents, document list 5"):
        BM25Index(small.model, DOCS[:-1], small.corpus_sha256)


def test_an_interrupted_save_leaves_a_directory_load_refuses(small, tmp_path, monkeypatch):
    """`save` removes the manifest first and writes it last: a save killed half-way leaves no manifest
    (load refuses it) rather than the old manifest over a mix of old and new files."""
    import selfevo.search.bm25 as bm25_mod

    BM25Index.build(DOCS[::-1]).save(tmp_path / "idx")
    assert (tmp_path / "idx" / MANIFEST).exists()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(bm25_mod.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        small.save(tmp_path / "idx")
    monkeypatch.undo()
    assert not (tmp_path / "idx" / MANIFEST).exists()
    with pytest.raises(ValueError, match="no manifest.json"):
        BM25Index.load(tmp_path / "idx")


def test_a_saved_build_reads_its_documents_from_the_index_directory(tmp_path):
    """A streamed build stages its documents in .docs-building; once saved, the index must read them
    from the index directory itself: a worker process reopens them there (a DocStore pickles as its
    directory), and the staging directory is gone."""
    from selfevo.search.docstore import STAGING, DocStore
    from selfevo.search.index import build_index

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, DOCS)
    index = build_index("bm25", corpus, tmp_path / "idx")
    assert isinstance(index.docs, DocStore) and index.docs.path == tmp_path / "idx" / "docs.jsonl"
    assert not (tmp_path / "idx" / STAGING).exists()
    assert list(pickle.loads(pickle.dumps(index.docs))) == DOCS


def test_an_in_memory_build_names_its_corpus_by_the_hash_of_its_jsonl(tmp_path):
    """Without `corpus_sha256` a build hashes the documents as `write_corpus` writes them: the index of a
    list and the index of that list's file carry the same corpus hash, and other documents another."""
    from selfevo._io import file_sha256

    docs = DOCS + [Document("u", "Café Über", "Naïve façade, 東京.")]  # written as UTF-8, not \u escapes
    write_corpus(tmp_path / "c.jsonl", docs)
    assert BM25Index.build(docs).corpus_sha256 == file_sha256(tmp_path / "c.jsonl")
    assert BM25Index.build(DOCS[::-1]).corpus_sha256 != BM25Index.build(DOCS).corpus_sha256
    # a saved index's docs.jsonl is that same JSONL, byte for byte
    BM25Index.build(docs).save(tmp_path / "idx")
    assert (tmp_path / "idx" / "docs.jsonl").read_bytes() == (tmp_path / "c.jsonl").read_bytes()


def test_doc_store_rescans_a_docs_file_replaced_by_one_of_another_size(tmp_path):
    """Offsets are trusted only for the file they were written for (their last one is its size): a
    docs.jsonl replaced by hand by one of other lengths is scanned again, never sliced at old offsets."""
    from selfevo.search.docstore import DOCS_FILE, OFFSETS_FILE, DocStore

    DocStore.write(tmp_path / "a", DOCS)
    other = [Document(d.id, d.title + " longer title", d.text) for d in DOCS[:4]]
    DocStore.write(tmp_path / "b", other)
    (tmp_path / "a" / DOCS_FILE).write_bytes((tmp_path / "b" / DOCS_FILE).read_bytes())
    assert (tmp_path / "a" / OFFSETS_FILE).exists()  # the old offsets are still there
    store = DocStore(tmp_path / "a")
    assert len(store) == 4 and list(store) == other


def test_a_corpus_store_is_written_once_a_corpus_file_and_reopened(tmp_path, monkeypatch):
    """`corpus_store` (a run searching through a /retrieve server reads its corpus's documents from it):
    the corpus's documents, numeric ids as strings and a gzipped file read through as everywhere; a store
    per file content (its sha256), opened as it is on the next use (nothing written), another for a
    rewritten file; a bad corpus a DataError naming file and line, leaving nothing under the root."""
    import gzip

    from selfevo.corpus import DataError
    from selfevo.search import docstore
    from selfevo.search.docstore import corpus_store

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, DOCS)
    root = tmp_path / "cache"
    store = corpus_store(corpus, root)
    assert list(store) == DOCS and store.path == root / file_sha256(corpus) / "docs.jsonl"
    assert sorted(p.name for p in root.iterdir()) == [file_sha256(corpus)]  # no build directory left

    def no_write(*args, **kwargs):
        raise AssertionError("a store that exists was written again")

    with monkeypatch.context() as m:
        m.setattr(docstore.DocStore, "write", no_write)
        assert corpus_store(corpus, root) == store
    # a build killed part way left its directory beside the store's place: the next build replaces it
    shutil.rmtree(store.path.parent)
    leftover = root / f".{file_sha256(corpus)}.tmp"
    leftover.mkdir()
    (leftover / "docs.jsonl").write_text('{"id": "half')
    assert list(corpus_store(corpus, root)) == DOCS and not leftover.exists()
    # two builders at once (two runs of a grid starting together): one writes, the other waits and opens it
    shutil.rmtree(store.path.parent)
    real_write, writes = docstore.DocStore.write, []

    def slow_write(directory, docs):
        writes.append(directory)
        time.sleep(0.3)  # the other builder arrives while this one writes
        return real_write(directory, docs)

    with monkeypatch.context() as m, concurrent.futures.ThreadPoolExecutor(2) as pool:
        m.setattr(docstore.DocStore, "write", slow_write)
        built = [f.result() for f in [pool.submit(corpus_store, corpus, root) for _ in range(2)]]
    assert len(writes) == 1 and all(list(b) == DOCS for b in built)
    gz = tmp_path / "c.jsonl.gz"  # the same documents gzipped: another file, another store, the same documents
    gz.write_bytes(gzip.compress(corpus.read_bytes()))
    assert list(corpus_store(gz, root)) == DOCS and len(list(root.iterdir())) == 2
    numeric = tmp_path / "n.jsonl"
    numeric.write_text(json.dumps({"id": 7, "contents": '"Seven"\nA number.'}) + "\n")
    assert [(d.id, d.title) for d in corpus_store(numeric, root)] == [("7", "Seven")]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(corpus.read_bytes() + b'{"id": "x"}\n')
    with pytest.raises(DataError, match=rf"bad\.jsonl:{len(DOCS) + 1}: missing field 'contents'"):
        corpus_store(bad, root)
    with pytest.raises(DataError, match="file not found"):
        corpus_store(tmp_path / "nope.jsonl", root)
    assert len(list(root.iterdir())) == 3  # the bad corpus left neither a store nor its build directory


@pytest.mark.parametrize("line", [
    b'{"id": "d2"}', b'["d2", "contents"]',
    b'{"id": "d2", "contents": 5}',
])
def test_doc_store_names_a_line_that_is_json_but_no_document(tmp_path, line):
    """A docs.jsonl line that parses but is no document (a field missing, a list, a number for the
    contents) is a DataError naming file and line, as a line that does not parse is, not a KeyError or
    TypeError traceback."""
    from selfevo.corpus import DataError
    from selfevo.search.docstore import DOCS_FILE, OFFSETS_FILE, DocStore

    DocStore.write(tmp_path / "a", DOCS)
    lines = (tmp_path / "a" / DOCS_FILE).read_bytes().splitlines(keepends=True)
    lines[2] = line + b"\n"
    (tmp_path / "a" / DOCS_FILE).write_bytes(b"".join(lines))
    (tmp_path / "a" / OFFSETS_FILE).unlink()
    store = DocStore(tmp_path / "a")
    assert store[1] == DOCS[1]
    with pytest.raises(DataError, match=r"docs\.jsonl:3: not a document line"):
        store[2]


def test_a_build_batch_of_documents_without_any_term_is_indexed(monkeypatch):
    """A batch (20,000 documents; 2 here) whose documents are all empty or stopwords only made
    `score_matrix` index an empty array (`heads[col[starts]]`): IndexError. Wiki-18-sized corpora whose last
    20,000-block is one empty passage hit it (20,001 passages, the last empty)."""
    import selfevo.search.bm25 as bm25_mod

    monkeypatch.setattr(bm25_mod, "_BATCH", 2)
    docs = DOCS[:4] + [Document("e1", "", ""), Document("e2", "The", "of the and")]
    index = BM25Index.build(docs)
    assert len(index) == 6 and ids(index.retrieve(["zebra"], 1)[0]) == ["d0"]


def test_doc_store_equals_a_list_only_of_the_same_length(tmp_path):
    from selfevo.search.docstore import DocStore

    store = DocStore.write(tmp_path / "a", DOCS)
    assert store == DOCS and store != DOCS[:3] and store != DOCS + [Document("x", "X", "x")]
    assert DocStore.write(tmp_path / "b", DOCS[:3]) != DOCS


def test_a_failed_streamed_build_leaves_no_staged_documents(tmp_path):
    """A corpus malformed half-way: the documents staged so far (`.docs-building`) are removed with the
    error, so the directory holds the saved index as it was and nothing else."""
    from selfevo.corpus import DataError, corpus_documents
    from selfevo.search.docstore import STAGING

    bad = tmp_path / "bad.jsonl"
    write_corpus(bad, DOCS)
    bad.write_text(bad.read_text() + '{"id": "d9"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl:7"):
        BM25Index.build(corpus_documents(bad), store=tmp_path / "idx")
    assert not (tmp_path / "idx" / STAGING).exists()


def test_an_index_over_no_document_is_refused_by_name(tmp_path):
    from selfevo.search.docstore import STAGING

    for store in (None, tmp_path / "idx"):
        with pytest.raises(ValueError, match="cannot build an index over zero documents"):
            BM25Index.build([], store=store)
    assert not (tmp_path / "idx" / STAGING).exists()  # nothing staged is left behind


def test_client_refuses_a_reply_larger_than_its_bound():
    """The client bounded a reply's time, not its size: a server sending hundreds of MB fast filled memory
    before the reply failed to parse. A body past `max_reply_bytes` (as decoded: a gzip stream inflating
    past it too) is refused at once, not retried."""
    import gzip

    big = json.dumps({"result": [[{"document": {"id": "1", "contents": "x" * 5000}, "score": 1.0}]]}).encode()
    bomb = gzip.compress(b" " * 200_000)  # 200 kB of JSON whitespace in well under 1 kB
    replies = iter([big, bomb, json.dumps(GOOD).encode()])

    def handler(n, req):
        body = next(replies)
        headers = {"content-encoding": "gzip"} if body is bomb else {}
        return httpx.Response(200, headers=headers, stream=httpx.ByteStream(body))  # read as a stream, as on a socket

    client, calls = _mock_client(handler, retries=3)
    client.max_reply_bytes = 4000
    with pytest.raises(RetrieverError, match="larger than 4,000 bytes"):
        client.retrieve(["q"])
    assert len(calls) == 1  # not retried
    assert len(bomb) < 4000
    with pytest.raises(RetrieverError, match="larger than 4,000 bytes"):
        client.retrieve(["q"])
    assert client.retrieve(["q"])[0][0].score == 1.5  # a small one reads


# Tests of a mutation sweep of the HTTP client (forty-second session, search/client.py): each passes on
# the code and fails on the mutant its comment names.

def test_retry_after_reads_padding_fractions_and_a_date_without_a_zone():
    """RFC 9110 values as servers write them: surrounding spaces, a fraction of a second, and an HTTP
    date whose zone is -0000 (no zone to Python: a naive datetime, subtracted from an aware one)."""
    import email.utils

    from selfevo.search.client import retry_after_seconds

    assert retry_after_seconds(" 2 ") == 2.0  # (mutant: no strip -> None)
    assert retry_after_seconds("1.5") == 1.5
    zoneless = email.utils.formatdate(time.time() + 30)  # "... -0000"
    assert zoneless.endswith("-0000")
    assert 20 < retry_after_seconds(zoneless) <= 30  # (mutant: no tz fix -> TypeError)


def test_an_error_page_is_one_line_whatever_its_markup():
    """An upper-case <TITLE>, a title over several lines, and a page with no title at all: each said as
    its words, without tags or line breaks."""
    from selfevo.search.client import body_text

    assert body_text("<HTML><HEAD><TITLE>503 Service Unavailable</TITLE></HEAD>"
                     "<BODY><H1>Unavailable</H1>nginx</BODY></HTML>") == "503 Service Unavailable"
    assert body_text("<title>\r\n  502 Bad\r\n  Gateway\r\n</title><h1>Bad Gateway</h1>") == "502 Bad Gateway"
    assert body_text("<html><body><h1>Not here</h1>\n<p>try &amp; see</p></body></html>") == "Not here try & see"
    client, _ = _mock_client(lambda n, req: httpx.Response(404, text="<html><body><h1>No route</h1></body></html>"))
    with pytest.raises(RetrieverError, match=r"HTTP 404: No route$"):
        client.retrieve(["q"])


def test_client_reads_a_compressed_reply_over_http():
    """A server (or proxy) gzipping its JSON: the body is read raw and decoded once, by its
    Content-Encoding (reading it decoded, then decoding again, was a DecodingError after the retries)."""
    import gzip

    from fastapi import FastAPI
    from fastapi.responses import Response

    gz = FastAPI()

    @gz.post("/retrieve")
    def retrieve():
        return Response(gzip.compress(json.dumps(GOOD).encode()), media_type="application/json",
                        headers={"content-encoding": "gzip"})

    with serve_app(gz) as url, RetrieverClient(url, retries=0) as client:
        [[hit]] = client.retrieve(["q"], topk=1)
    assert hit == Hit(Document("7", "T", "body"), 1.5)


def test_client_refuses_a_zero_batch_size_or_negative_retries_at_once():
    for kwargs in ({"batch_size": 0}, {"retries": -1}):
        with pytest.raises(ValueError, match="batch_size must be >= 1 and retries >= 0"):
            RetrieverClient("http://fake", **kwargs)
    RetrieverClient("http://fake", batch_size=1, retries=0).close()  # the limits themselves are fine


def test_client_accepts_a_server_url_with_trailing_slashes():
    """`http://host/` and `http://host/retrieve/` name the same server as `http://host`."""
    for given in ("http://fake/", "http://fake/retrieve/"):
        seen: list[httpx.Request] = []
        transport = httpx.MockTransport(lambda req, seen=seen: seen.append(req) or httpx.Response(200, json=GOOD))
        with RetrieverClient(given, transport=transport) as client:
            client.retrieve(["q"], topk=1)
        assert str(seen[0].url) == "http://fake/retrieve", given


def test_client_defaults_batch_64_and_back_off_exponentially_from_half_a_second(monkeypatch):
    """The documented defaults: 64 queries a request; 3 retries waiting 0.5, 1 and 2 s; a Retry-After
    shorter than the backoff does not shorten it; no wait is longer than a minute."""
    from selfevo.search import client as client_mod

    waits: list[float] = []
    monkeypatch.setattr(client_mod.time, "sleep", waits.append)
    seen: list[httpx.Request] = []

    def echo(req):
        seen.append(req)
        qs = json.loads(req.content)["queries"]
        return httpx.Response(200, json={"result": [[] for _ in qs]})

    with RetrieverClient("http://fake", transport=httpx.MockTransport(echo)) as client:
        assert len(client.retrieve([f"q{i}" for i in range(65)])) == 65
    assert [len(json.loads(r.content)["queries"]) for r in seen] == [64, 1]

    def always_503(req):
        seen.append(req)
        return httpx.Response(503, text="busy")

    seen.clear()
    with RetrieverClient("http://fake", transport=httpx.MockTransport(always_503)) as client:
        with pytest.raises(RetrieverError, match="HTTP 503"):
            client.retrieve(["q"])
    assert len(seen) == 4 and waits == [0.5, 1.0, 2.0]
    waits.clear()
    client, _ = _mock_client(lambda n, req: httpx.Response(503, headers={"Retry-After": "1"}), retries=1)
    client.backoff_s = 4.0
    with pytest.raises(RetrieverError):
        client.retrieve(["q"])
    assert waits == [4.0]  # the longer of the backoff and the Retry-After
    waits.clear()
    client, _ = _mock_client(lambda n, req: httpx.Response(429, headers={"Retry-After": "3600"}), retries=1)
    with pytest.raises(RetrieverError):
        client.retrieve(["q"])
    assert waits == [60.0]


def test_client_says_a_redirect_as_an_http_status():
    """A 3xx (a proxy sending http to https) is no answer: said as its status, not parsed as one."""
    client, seen = _mock_client(lambda n, req: httpx.Response(
        301, headers={"location": "https://fake/retrieve"}, json={"result": [[]]}))
    with pytest.raises(RetrieverError, match="HTTP 301"):
        client.retrieve(["q"])
    assert len(seen) == 1


def test_client_errors_never_show_the_urls_password():
    """Every error names the URL without its password: an HTTP error, a reply that is no JSON, and a
    transport error whose own text quotes the URL."""
    def client_for(handler):
        return RetrieverClient("http://user:s3cret@fake", retries=0, backoff_s=0,
                               transport=httpx.MockTransport(handler))

    def unreachable(req):
        raise httpx.ConnectError(f"cannot reach {req.url}", request=req)

    for handler in (lambda req: httpx.Response(503, text="down"), lambda req: httpx.Response(200, text="<html>"),
                    unreachable):
        with pytest.raises(RetrieverError) as err:
            client_for(handler).retrieve(["q"])
        assert "s3cret" not in str(err.value) and "http://***@fake" in str(err.value)


def test_client_closes_its_connections_when_its_with_block_ends():
    with RetrieverClient("http://fake", transport=httpx.MockTransport(lambda req: httpx.Response(200))) as client:
        assert not client._http.is_closed
    assert client._http.is_closed


# Tests of a mutation sweep of search/index.py (forty-second session): each passes on the code and fails on
# the mutant its comment names.

def test_a_manifest_of_an_unknown_index_kind_is_no_index(tmp_path):
    """A manifest naming a kind this code does not know is refused by name, and `--out` will not write
    over its directory as if it held an index (mutant: only a missing kind refused)."""
    from selfevo.search.index import check_index_out, index_kind

    (tmp_path / "manifest.json").write_text('{"kind": "splade"}', encoding="utf-8")
    with pytest.raises(ValueError, match="unknown index kind 'splade'"):
        index_kind(tmp_path)
    with pytest.raises(ValueError, match="holds a manifest.json that is no index's"):
        check_index_out(tmp_path)
    # a run directory's manifest (`eval --index runs/x`): said to be no index, not "unknown index kind None"
    (tmp_path / "manifest.json").write_text('{"status": "complete", "rounds_completed": 3}', encoding="utf-8")
    with pytest.raises(ValueError, match="not an index directory"):
        index_kind(tmp_path)


def test_index_out_is_a_directory_empty_or_of_an_index_or_of_a_killed_build(tmp_path):
    """`--out` rules: a file is refused; so is a directory holding an unrelated (empty) subdirectory; a
    hybrid save killed after its dense half (dense/docs.jsonl, no top manifest yet) may be rebuilt over
    (mutants: the file check dropped, any hidden-only directory taken for a half, only a top docs.jsonl
    taken for an index's)."""
    from selfevo.search.index import check_index_out

    afile = tmp_path / "afile"
    afile.write_text("keep")
    with pytest.raises(ValueError, match="afile: a file, not a directory"):
        check_index_out(afile)
    other = tmp_path / "other"
    (other / "photos").mkdir(parents=True)
    with pytest.raises(ValueError, match="not empty, and holds no index"):
        check_index_out(other)
    killed = tmp_path / "killed"
    (killed / "dense").mkdir(parents=True)
    (killed / "dense" / "docs.jsonl").write_text("{}\n")
    (killed / "dense" / "manifest.json").write_text("{}")
    (killed / "bm25" / ".docs-building").mkdir(parents=True)
    check_index_out(killed)  # no error


def test_a_hybrid_index_is_never_written_over_its_corpus_in_a_half(tmp_path, monkeypatch):
    """A corpus at OUT/bm25/docs.jsonl (or dense/) is where a hybrid index writes a half's documents:
    refused before anything is built (mutant: only OUT/docs.jsonl compared)."""
    from selfevo.search.index import DenseOptions, build_index, index_from_corpus_file

    monkeypatch.setattr(DenseOptions, "encoder", lambda self: pytest.fail("an encoder was made: a build began"))
    for part in ("bm25", "dense"):
        out = tmp_path / part / "idx"
        (out / part).mkdir(parents=True)
        corpus = out / part / "docs.jsonl"
        corpus.write_text('{"id": "1", "contents": "Alpha\\nalpha text", "meta": "keep me"}\n')
        before = corpus.read_bytes()
        with pytest.raises(ValueError, match="would write its docs.jsonl over this corpus file"):
            build_index("hybrid", corpus, out)
        with pytest.raises(ValueError, match="would write its docs.jsonl over this corpus file"):
            index_from_corpus_file("hybrid", corpus, out)
        assert corpus.read_bytes() == before


def test_build_index_refuses_an_out_of_other_files_itself(tmp_path):
    """The library call checks `out` as the CLI does, before reading the corpus (mutant: only the CLI
    checked; the build wrote its docs.jsonl and manifest.json beside someone's files)."""
    from selfevo.search.index import build_index

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, DOCS)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("keep")
    with pytest.raises(ValueError, match="not empty, and holds no index"):
        build_index("bm25", corpus, mine)
    assert sorted(p.name for p in mine.iterdir()) == ["keep.txt"]


def test_get_retriever_says_what_is_missing_or_unknown(tmp_path):
    """Neither a corpus nor an index is named as such; an unknown retriever kind is said as unknown, with
    a saved index too (mutants: either check dropped: a TypeError, or 'a bm25 index, but retriever ...')."""
    from selfevo.search.index import get_retriever

    with pytest.raises(ValueError, match="need a corpus file or a saved index directory"):
        get_retriever()
    BM25Index.build(DOCS).save(tmp_path / "idx")
    with pytest.raises(ValueError, match="unknown retriever 'splade'; known: bm25, dense, hybrid"):
        get_retriever(index=tmp_path / "idx", kind="splade")


def test_get_retriever_without_a_cache_dir_writes_nothing(tmp_path, monkeypatch):
    """No `cache_dir`: the index is built in memory and no file is written anywhere (mutant: a cache
    written in the working directory)."""
    from selfevo.search.index import get_retriever

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, DOCS)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    index = get_retriever(corpus=corpus)
    assert len(index) == len(DOCS) and ids(index.retrieve(["longest river"], 1)[0]) == ["d3"]
    assert list(cwd.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "cwd"]


def test_index_size_counts_every_file_below_and_no_directory(tmp_path):
    """(mutants: only the top level counted; directories' own sizes added)"""
    from selfevo.search.index import index_size_bytes

    (tmp_path / "bm25" / "deep").mkdir(parents=True)
    (tmp_path / "manifest.json").write_bytes(b"x" * 10)
    (tmp_path / "bm25" / "docs.jsonl").write_bytes(b"y" * 200)
    (tmp_path / "bm25" / "deep" / "f").write_bytes(b"z" * 3000)
    assert index_size_bytes(tmp_path) == 3210


# Tests of a mutation sweep of the document store (forty-third session): each passes on the code and fails on
# the mutant its docstring names.

def test_doc_store_rescans_an_offsets_file_of_another_shape(tmp_path):
    """Offsets are one row of int64s; a file of another shape whose last entry happens to be the size is
    not trusted (mutant: the ndim check dropped: one "document" spanning the whole file, a DataError)."""
    import numpy as np

    from selfevo.search.docstore import DOCS_FILE, OFFSETS_FILE, DocStore

    DocStore.write(tmp_path / "a", DOCS)
    size = (tmp_path / "a" / DOCS_FILE).stat().st_size
    np.save(tmp_path / "a" / OFFSETS_FILE, np.array([[0], [size]], dtype=np.int64))
    store = DocStore(tmp_path / "a")
    assert len(store) == len(DOCS) and list(store) == DOCS


def test_doc_store_written_over_its_own_file_is_left_as_it_is(tmp_path):
    """The documented no-op (mutant: dropped: wiki-18's 13 GB read and written again, a new file in its place)."""
    from selfevo.search.docstore import DOCS_FILE, DocStore

    store = DocStore.write(tmp_path / "a", DOCS)
    before = (tmp_path / "a" / DOCS_FILE).stat().st_ino
    assert DocStore.write(tmp_path / "a", store) is store
    assert (tmp_path / "a" / DOCS_FILE).stat().st_ino == before


def test_by_id_over_a_repeated_id_keeps_the_last_as_a_dict_would():
    """(mutant: the first kept)"""
    from selfevo.search.docstore import ById, contents_by_id

    docs = [Document("a", "A", "first"), Document("b", "B", "b"), Document("a", "A", "last")]
    assert ById(docs)["a"] is docs[2] and list(ById(docs)) == ["a", "b"] and len(ById(docs)) == 2
    assert contents_by_id(docs)["a"] == docs[2].contents and "c" not in contents_by_id(docs)


@pytest.mark.parametrize("contents, title", [
    ('"Paris" \nCapital of France.', "Paris"),  # spaces around the quoted title: the title without them
    ('  "Paris"\nCapital of France.', "Paris"),
    ('"\nA lone quote.', '"'),  # one quote is no quoted title
    ('""\nNo title.', ""),
])
def test_a_title_is_read_from_its_first_line_and_the_contents_kept_verbatim(contents, title):
    doc = Document.from_contents("1", contents)
    assert doc.title == title and doc.contents == contents and doc.to_json() == {"id": "1", "contents": contents}


# ------------------------------------------------------------------ server limits and defaults, pinned


def test_queries_at_the_caps_outside_the_bmp_fit_the_body_cap_for_any_max_queries(small):
    """body_cap promises room for max_queries queries of MAX_QUERY_CHARS characters, each escaped as
    12 bytes a character, indented, plus the envelope: one such query alone (max_queries=1) needs the
    envelope's room too."""
    from fastapi.testclient import TestClient

    for max_queries in (1, 3):
        client = TestClient(make_app(small, max_queries=max_queries))
        queries = ["\U0001F600" * 2000] * max_queries
        body = json.dumps({"queries": queries, "topk": 5, "return_scores": True}, indent=8).encode()
        r = client.post("/retrieve", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200 and len(r.json()["result"]) == max_queries, (max_queries, len(body), r.text[:200])


def test_the_default_app_takes_4096_queries_and_topk_50_and_no_more(small):
    """The documented defaults: Search-R1's trainer sends 4,096 queries a turn; topk is capped at 50."""
    from fastapi.testclient import TestClient

    client = TestClient(make_app(small))
    r = client.post("/retrieve", json={"queries": ["zebra"] * 4096, "topk": 1})
    assert r.status_code == 200 and len(r.json()["result"]) == 4096
    assert client.post("/retrieve", json={"queries": ["zebra"] * 4097, "topk": 1}).status_code == 422
    assert client.post("/retrieve", json={"queries": ["zebra"], "topk": 50}).status_code == 200
    assert client.post("/retrieve", json={"queries": ["zebra"], "topk": 51}).status_code == 422


def test_topk_at_the_cap_and_unknown_fields_are_accepted(server_url):
    """max_topk is inclusive (5 here); a Search-R1 client's extra fields are ignored, not refused."""
    r = httpx.post(f"{server_url}/retrieve", json={"queries": ["zebra stripes river Europe hoofed"], "topk": 5})
    assert r.status_code == 200 and len(r.json()["result"][0]) == 5
    r = httpx.post(f"{server_url}/retrieve", json={"queries": ["zebra"], "topk": 1, "return_scores": True,
                                                   "session_id": "s1", "meta": {"step": 3}})
    assert r.status_code == 200 and r.json()["result"][0][0]["document"]["id"] == "d0"


def test_a_refused_request_never_echoes_the_query(server_url):
    """A 422 names the field and the rule, never the offending value (which may be megabytes)."""
    secret = "needle-" + "x" * 2000  # one character over MAX_QUERY_CHARS
    r = httpx.post(f"{server_url}/retrieve", json={"queries": [secret]})
    assert r.status_code == 422 and "needle-" not in r.text
    [err] = r.json()["detail"]
    assert err["loc"] == ["queries", 0] and "input" not in err


def test_serve_builds_the_app_with_the_asked_query_limit_on_loopback(tmp_path, monkeypatch):
    """`serve(..., max_queries=N)` (serve-retriever --max-queries) reaches the app it runs."""
    import uvicorn
    from fastapi.testclient import TestClient

    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, DOCS)
    ran = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.append((app, kw)))
    serve(corpus, max_queries=2)
    [(served, kw)] = ran
    assert kw["host"] == "127.0.0.1"
    client = TestClient(served)
    assert client.post("/retrieve", json={"queries": ["zebra"] * 2, "topk": 1}).status_code == 200
    assert client.post("/retrieve", json={"queries": ["zebra"] * 3, "topk": 1}).status_code == 422


def test_the_app_times_out_at_the_limit_the_client_waits_past():
    """The client's read timeout exceeds TIMEOUT_S so that it reads the server's 408/504 instead of
    giving up first: that holds only while the app's default is that limit."""
    from selfevo.search.client import TIMEOUT_S as CLIENT_TIMEOUT_S
    from selfevo.search.server import TIMEOUT_S

    assert inspect.signature(make_app).parameters["timeout_s"].default == TIMEOUT_S < CLIENT_TIMEOUT_S


class _Request:
    """What read_body reads of a request: its headers and its body's chunks (counted as they are read)."""

    def __init__(self, chunks, length=None):
        self.headers = {} if length is None else {"content-length": length}
        self.chunks, self.read = chunks, 0

    async def stream(self):
        for chunk in self.chunks:
            self.read += 1
            yield chunk


def test_read_body_allows_the_cap_itself_and_refuses_a_byte_more_before_or_while_reading():
    from fastapi import HTTPException


    assert asyncio.run(read_body(_Request([b"ab", b"cd"], "4"), 4)) == b"abcd"  # the cap itself, declared
    assert asyncio.run(read_body(_Request([b"ab", b"cd"]), 4)) == b"abcd"  # and chunked
    assert asyncio.run(read_body(_Request([b"abc"], "many"), 4)) == b"abc"  # no number declared: the stream decides
    declared = _Request([b"x"] * 5, "5")
    with pytest.raises(HTTPException) as refused:
        asyncio.run(read_body(declared, 4))
    assert (refused.value.status_code, refused.value.detail) == (413, "request body over 4 bytes")
    assert declared.read == 0  # refused on its Content-Length, nothing read
    chunked = _Request([b"xx"] * 10)
    with pytest.raises(HTTPException) as refused:
        asyncio.run(read_body(chunked, 4))
    assert (refused.value.status_code, refused.value.detail) == (413, "request body over 4 bytes")
    assert chunked.read == 3  # stopped at the chunk that went over, not read to its end


def test_an_empty_batch_never_reaches_the_retriever(small):
    """An empty `queries` is answered by the server itself: a retriever (a dense encoder, a remote one)
    need not take an empty batch, and Search-R1's trainer posts one in every turn no trajectory searched."""
    from fastapi.testclient import TestClient

    class Refusing:
        def __init__(self):
            self.calls = []

        def retrieve(self, queries, topk=3):
            self.calls.append(list(queries))
            if not queries:
                raise ValueError("an empty batch")
            return small.retrieve(queries, topk)

    retriever = Refusing()
    client = TestClient(make_app(retriever))
    r = client.post("/retrieve", json={"queries": [], "topk": 3, "return_scores": True})
    assert r.status_code == 200 and r.json() == {"result": []}
    assert retriever.calls == []
    assert client.post("/retrieve", json={"queries": ["zebra"], "topk": 1}).json()["result"][0][0]["id"] == "d0"


def test_max_body_bytes_is_the_cap_whether_above_or_below_the_query_caps_need(small):
    """`max_body_bytes` replaces the cap `body_cap(max_queries)` would give: a smaller one refuses a body
    the query caps allow, a larger one admits a body (an extra field) past it."""
    from fastapi.testclient import TestClient

    padded = json.dumps({"queries": ["zebra"], "topk": 1, "pad": "y" * (2 * body_cap(1))}).encode()
    headers = {"content-type": "application/json"}
    assert TestClient(make_app(small, max_queries=1)).post("/retrieve", content=padded,
                                                           headers=headers).status_code == 413
    big = TestClient(make_app(small, max_queries=1, max_body_bytes=len(padded)))
    r = big.post("/retrieve", content=padded, headers=headers)
    assert r.status_code == 200 and r.json()["result"][0][0]["id"] == "d0"
    small_cap = TestClient(make_app(small, max_body_bytes=16))
    assert small_cap.post("/retrieve", json={"queries": ["zebra"], "topk": 1}).status_code == 413


def test_one_query_string_is_refused_not_searched_as_its_characters(small):
    """`retrieve("capital of France")` returned 17 empty lists, one a character; `SearchTool.lookup` cached
    each character as a query and counted 5 searches."""
    tool = SearchTool(small)
    for call in (lambda: small.retrieve("capital of France"), lambda: tool.lookup("Paris"),
                 lambda: RetrieverClient("http://127.0.0.1:9").retrieve("Paris")):
        with pytest.raises(TypeError, match=r"a list of query strings, got one string .*pass \[query\]"):
            call()
    assert (tool.calls, tool.queries_issued) == (0, 0)
    assert ids(tool.lookup(["capital of France"])[0]) == ids(small.retrieve(["capital of France"])[0])
