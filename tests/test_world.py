"""The synthetic world: determinism, benchmarks with exact answers, the language, save/load, CLI."""

import json
import re
import stat
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from selfevo._io import _UMASK
from selfevo.cli import app
from selfevo.corpus import read_corpus, read_qa_dir
from selfevo.world import WorldConfig, WorldError, load_world, make_world, resolve_world, save_world, world_fingerprint
from selfevo.world.generate import BENCHMARK_SIZES, _Names
from selfevo.world.language import (
    COMPARE_TEMPLATES,
    POSSESSIVES,
    RELATED_NOUNS,
    RELATIONS,
    SINGLE_HOP_TEMPLATES,
    ChainQuery,
    CompareQuery,
    noun_phrase,
    parse_question,
    read_statements,
    render_chain,
    render_compare,
)
from selfevo.world.truth import Entity, Truth

SMALL = WorldConfig(size="small", seed=0)


@pytest.fixture(scope="module")
def world():
    return make_world(SMALL)


def _dump(w) -> str:
    return json.dumps({"docs": [d.to_json() for d in w.documents],
                       "bench": {b: [it.to_json() for it in items] for b, items in w.benchmarks.items()},
                       "truth": w.truth.to_json()}, sort_keys=True)


# ------------------------------------------------------------------ determinism


def test_make_world_is_deterministic(world):
    again = make_world(WorldConfig(size="small", seed=0))
    assert _dump(again) == _dump(world)


def test_different_seed_gives_a_different_world(world):
    other = make_world(WorldConfig(size="small", seed=1))
    assert [d.text for d in other.documents] != [d.text for d in world.documents]
    assert other.truth.to_json() != world.truth.to_json()
    assert [it.question for it in other.benchmarks["nq"]] != [it.question for it in world.benchmarks["nq"]]


def test_confusable_rate_changes_pages_not_truth(world):
    other = make_world(replace(SMALL, confusable_rate=0.0))
    # entities and facts are drawn before any page is written: the rate only changes the pages
    assert other.truth.to_json() == world.truth.to_json()
    assert sum(len(d.text) for d in other.documents) < sum(len(d.text) for d in world.documents)


def test_value_skew_flattens_fact_values_and_keeps_entities(world):
    flat = make_world(replace(SMALL, value_skew=0.0))
    # the same entities (names, popularity), only the values drawn for their facts change
    assert [(e.id, e.name, e.popularity) for e in flat.truth.entities.values()] == \
        [(e.id, e.name, e.popularity) for e in world.truth.entities.values()]
    assert flat.truth.top_value_share("born_in") < 0.5 * world.truth.top_value_share("born_in")
    assert make_world(replace(SMALL, value_skew=0.5)).truth.top_value_share("born_in") < \
        world.truth.top_value_share("born_in")


# ------------------------------------------------------------------ benchmarks


def test_benchmark_sizes_and_metadata(world):
    sizes = {b: len(items) for b, items in world.benchmarks.items()}
    assert sizes == {"nq": 200, "triviaqa": 200, "popqa": 200, "hotpotqa": 200,
                     "2wikimultihopqa": 200, "musique": 200, "bamboogle": 125}
    assert sum(sizes.values()) == 1325 == sum(BENCHMARK_SIZES.values())
    for bench, items in world.benchmarks.items():
        assert len({it.id for it in items}) == len(items)
        assert len({it.question for it in items}) == len(items)
        for it in items:
            assert it.metadata["benchmark"] == bench
            expected_hop = "single" if bench in ("nq", "triviaqa", "popqa") else "multi"
            assert it.metadata["hop"] == expected_hop
            assert (it.metadata["hops"] == 1) == (expected_hop == "single")
            assert it.golden_answers and all(g.strip() for g in it.golden_answers)
    assert {it.metadata["hops"] for it in world.benchmarks["bamboogle"]} == {3}
    assert {it.metadata["hops"] for it in world.benchmarks["musique"]} <= {2, 3, 4}


def test_every_benchmark_question_parses_and_truth_gives_its_gold(world):
    kinds = {"chain": 0, "compare": 0}
    for items in world.benchmarks.values():
        for it in items:
            q = parse_question(it.question)
            assert q is not None, it.question
            assert q.hops == it.metadata["hops"], it.question
            kinds["compare" if isinstance(q, CompareQuery) else "chain"] += 1
            assert world.truth.answer(q) == list(it.golden_answers), it.question
            # and by hand, from the entities' facts (the golds were made with truth.answer itself)
            assert hand_answer(world, q) == list(it.golden_answers), it.question
    assert kinds["compare"] > 50  # 2WikiMQA mixes in comparison questions


def hand_answer(world, q) -> list[str]:
    """The gold aliases of a question, walked through the entities' facts here, not by `Truth`."""
    ents = world.truth.entities
    named = {}
    for e in ents.values():
        for a in e.aliases:
            named.setdefault(a, []).append(e)

    def one(mention):
        (e,) = named[mention]  # the generator asks only about mentions that name one entity
        return e

    if isinstance(q, CompareQuery):
        a, b = (one(m) for m in q.mentions)
        return list(min((a, b), key=lambda e: int(e.facts[q.relation])).aliases)
    value = one(q.mention).id
    for rel in q.relations:
        value = ents[value].facts[rel]
    return list(ents[value].aliases) if value in ents else [value]


def test_triviaqa_asks_by_alias(world):
    names = {e.name for e in world.truth.entities.values()}
    by_alias = [it for it in world.benchmarks["triviaqa"] if parse_question(it.question).mention not in names]
    assert len(by_alias) == len(world.benchmarks["triviaqa"])


# ------------------------------------------------------------------ the language


RELATION_CHAINS = [
    ("born_in",),
    ("employer", "headquarters"),
    ("author", "born_in", "located_in"),
    ("founder", "spouse", "born_in", "located_in"),
    ("author", "employer", "founder", "birth_year"),
]


@pytest.mark.parametrize("relations", RELATION_CHAINS)
@pytest.mark.parametrize("variant", [0, 1, 2])
def test_render_parse_round_trip_chain(relations, variant):
    for mention in ("Oren Vale", "The Song of Kell", "Port Drax"):
        q = ChainQuery(mention, relations)
        text = render_chain(q, variant)
        assert text.endswith("?")
        assert parse_question(text) == q, text


def test_render_parse_every_single_hop_template():
    for rel, templates in SINGLE_HOP_TEMPLATES.items():
        texts = {render_chain(ChainQuery("Mira Stone", (rel,)), v) for v in range(len(templates) + 1)}
        # every template plus the nested-noun fallback
        assert len(texts) == len(templates) + 1
        for t in texts:
            assert parse_question(t) == ChainQuery("Mira Stone", (rel,)), t


@pytest.mark.parametrize("rel", sorted(COMPARE_TEMPLATES))
def test_render_parse_round_trip_compare(rel):
    q = CompareQuery(("Oren Vale", "The Map of Dun"), rel)
    assert parse_question(render_compare(q)) == q


@pytest.mark.parametrize("text", ["", "Hello there.", "What is?", "What is Oren Vale?", "Who is the best?"])
def test_parse_rejects_text_outside_the_language(text):
    assert parse_question(text) is None


PAGE_TITLE = "Oren Vale"
PAGE = ("Oren Vale is a person. Oren Vale is also known as Oren the Bold. "
        "He was born in Port Drax. His brother Tam Vale was born in Kell. "
        "Oren the Bold worked for Gibym Bank. His cousin Ada Moor was employed by Zor Press. "
        "He was born in the year 1901. Oren Vale is married to Ada Moor.")


def test_read_statements_about_page():
    stmts, aliases = read_statements(PAGE_TITLE, PAGE)
    assert aliases == ["Oren Vale", "Oren the Bold"]
    got = {(s.relation, s.subject, s.object, s.about_page) for s in stmts}
    assert got == {
        ("born_in", "He", "Port Drax", True),
        ("born_in", "His brother Tam Vale", "Kell", False),
        ("employer", "Oren the Bold", "Gibym Bank", True),
        ("employer", "His cousin Ada Moor", "Zor Press", False),
        ("birth_year", "He", "1901", True),
        ("spouse", "Oren Vale", "Ada Moor", True),
    }
    # sentence indices point at the page's sentences (0: type sentence, 1: aliases)
    assert sorted(s.sentence for s in stmts) == [2, 3, 4, 5, 6, 7]


def test_birth_year_sentences_are_not_birthplaces():
    stmts, _ = read_statements("X", "X was born in the year 1850. X came into the world in 1851.")
    assert [(s.relation, s.object) for s in stmts] == [("birth_year", "1850"), ("birth_year", "1851")]
    # a bare year after a place template is not read as a place either
    stmts, _ = read_statements("X", "X was born in 1850.")
    assert all(s.relation != "born_in" for s in stmts)
    # and a place is not read as a year
    stmts, _ = read_statements("X", "X was founded in the year Kell.")
    assert all(s.relation != "founded_year" for s in stmts)


def test_confusable_rate_zero_pages_only_state_their_subject():
    w = make_world(replace(SMALL, confusable_rate=0.0))
    n_statements = 0
    for d in w.documents:
        stmts, _ = read_statements(d.title, d.text)
        n_statements += len(stmts)
        assert all(s.about_page for s in stmts), d.title
    assert n_statements > 2 * len(w.documents)


def test_default_pages_carry_confusable_statements(world):
    wrong = total = 0
    for d in world.documents:
        stmts, _ = read_statements(d.title, d.text)
        total += len(stmts)
        wrong += sum(not s.about_page for s in stmts)
    assert 0.1 < wrong / total < 0.5


def test_pages_state_exactly_the_true_facts(world):
    """Every about-page statement is a true fact of the page's entity, and every fact is stated."""
    for d in world.documents:
        e = world.truth.entities[d.id]
        stmts, aliases = read_statements(d.title, d.text)
        assert aliases == e.aliases
        about = {(s.relation, s.object) for s in stmts if s.about_page}
        true = {(rel, world.truth.entities[v].name if v in world.truth.entities else v)
                for rel, v in e.facts.items()}
        assert about == true, d.title
        for s in stmts:
            assert s.relation in RELATIONS


# ------------------------------------------------------------------ save / load / CLI


def test_save_load_round_trip(world, tmp_path):
    out = save_world(world, tmp_path / "w")
    loaded = load_world(out)
    assert loaded.config == world.config
    assert loaded.documents == world.documents
    assert loaded.truth.to_json() == world.truth.to_json()
    assert set(loaded.benchmarks) == set(world.benchmarks)
    for b, items in world.benchmarks.items():
        assert [it.to_json() for it in loaded.benchmarks[b]] == [it.to_json() for it in items]
    # the files are ordinary FlashRAG data
    assert read_corpus(out / "corpus.jsonl") == world.documents
    qa = read_qa_dir(out / "qa")
    assert {b: len(v) for b, v in qa.items()} == {b: len(v) for b, v in world.benchmarks.items()}
    # resolve_world takes a directory as well as a size
    assert resolve_world(str(out)).truth.to_json() == world.truth.to_json()


def test_load_world_rejects_a_non_world_directory(tmp_path):
    with pytest.raises(ValueError, match="world.json"):
        load_world(tmp_path)


def test_load_world_without_its_qa_directory_is_a_world_error(world, tmp_path):
    """A world directory missing qa/ raised read_qa_dir's bare FileNotFoundError, where a missing
    truth.json is a WorldError naming the directory."""
    out = save_world(world, tmp_path / "w")
    for f in (out / "qa").iterdir():
        f.unlink()
    (out / "qa").rmdir()
    with pytest.raises(WorldError, match="broken world directory.*qa/"):
        load_world(out)


def test_a_non_ascii_digit_on_a_hand_edited_page_is_not_a_year(world, tmp_path):
    """"²" passes str.isdigit(): a hand-edited page's "was published in ²" was read as a year, and the
    sim solver's int() on it crashed (ValueError) when it answered a comparison over that page. Now
    it is no year (as "was born in Kell" is none), and a truth.json with such a year is a WorldError."""
    from selfevo.agents.sim import Reader, SimSolver, SimSolverConfig
    from selfevo.search.bm25 import BM25Index
    from selfevo.search.tool import SearchTool

    stmts, _ = read_statements("Ana Vel", "Ana Vel was born in the year \u00b2. He was born in the year 1901.")
    assert [s.object for s in stmts if s.relation == "birth_year"] == ["1901"]
    question = next(it.question for items in world.benchmarks.values() for it in items
                    if isinstance(parse_question(it.question), CompareQuery))
    mentions = parse_question(question).mentions
    docs = [replace(d, text=re.sub(r"\b[0-9]{4}\b", "\u00b2", d.text)) if d.title in mentions else d
            for d in world.documents]
    cfg = SimSolverConfig()
    solver = SimSolver("main", cfg, Reader("solver", cfg.misread_scale, 0.1, 0))
    [[traj]] = solver.answer([question], SearchTool(BM25Index.build(docs), topk=3, max_calls=5))
    assert traj.answer in mentions

    out = save_world(world, tmp_path / "w")
    truth = json.loads((out / "truth.json").read_text())
    person = next(e for e in truth["entities"] if "birth_year" in e["facts"])
    person["facts"]["birth_year"] = "19\u00b2"
    (out / "truth.json").write_text(json.dumps(truth))
    with pytest.raises(WorldError, match=f"truth.*{person['id']}.*birth_year.*not a year"):
        load_world(out)


def test_cli_world_make(tmp_path):
    out = tmp_path / "w"
    result = CliRunner().invoke(app, ["world", "make", "--size", "small", "--seed", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "corpus.jsonl").exists() and (out / "truth.json").exists()
    qa_files = sorted(p.name for p in (out / "qa").iterdir())
    assert qa_files == sorted(f"{b}.jsonl" for b in BENCHMARK_SIZES)
    w = load_world(out)
    assert w.config.seed == 3 and w.config.size == "small"
    assert len(read_corpus(out / "corpus.jsonl")) == len(w.documents) == 398
    assert sum(len(v) for v in read_qa_dir(out / "qa").values()) == 1325
    assert "398 pages" in result.output and "1325" in result.output


def test_cli_world_make_bad_value_exits_2(tmp_path):
    result = CliRunner().invoke(app, ["world", "make", "--size", "huge", "--out", str(tmp_path / "w")])
    assert result.exit_code == 2
    assert "world.size" in result.output
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("kwargs, field", [
    ({"size": "huge"}, "world.size"),
    ({"confusable_rate": 1.5}, "world.confusable_rate"),
    ({"confusable_rate": -0.1}, "world.confusable_rate"),
    ({"shared_misreading": 2.0}, "world.shared_misreading"),
    ({"shared_misreading": -1.0}, "world.shared_misreading"),
    ({"value_skew": -0.5}, "world.value_skew"),
])
def test_bad_world_config_raises_naming_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        WorldConfig(**kwargs)


def test_a_world_directory_rewritten_in_the_same_process_is_read_again(tmp_path):
    import shutil

    from selfevo.config import load_config
    from selfevo.evolve import world_and_index

    path = tmp_path / "w"
    save_world(make_world(WorldConfig(size="small", seed=1)), path)
    cfg = load_config(None, [f"world.name={path}"])
    first = world_and_index(cfg)[0]
    assert world_and_index(cfg)[0] is first  # cached while its files stay the same
    shutil.rmtree(path)
    save_world(make_world(WorldConfig(size="small", seed=2)), path)
    again = world_and_index(cfg)[0]
    assert again is not first and again.documents == load_world(path).documents != first.documents


def test_the_world_parameters_have_one_default_everywhere():
    # `selfevo world make`, a run's [world] table and make_world() in Python build the same world
    import dataclasses
    import inspect

    from selfevo.cli import world_make
    from selfevo.config import WorldSpec

    options = inspect.signature(world_make).parameters
    spec = {f.name: f.default for f in dataclasses.fields(WorldSpec)}
    for f in dataclasses.fields(WorldConfig):
        if f.name != "size":
            assert options[f.name].default.default == spec[f.name] == f.default, f.name


# ------------------------------------------------------------------ the world's invariants


@pytest.mark.parametrize("kwargs, field", [
    ({"seed": True}, "world.seed"),  # a bool is an int in Python: True would silently be seed 1
    ({"seed": 1.5}, "world.seed"),
    ({"value_skew": 4.5}, "world.value_skew"),
])
def test_more_bad_world_configs_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        WorldConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"confusable_rate": 0.0}, {"confusable_rate": 1.0}, {"shared_misreading": 0.0}, {"shared_misreading": 1.0},
    {"value_skew": 0.0}, {"value_skew": 4.0}, {"seed": 0},
])
def test_world_config_accepts_the_ends_of_its_ranges(kwargs):
    WorldConfig(size="small", **kwargs)


def test_every_name_and_alias_names_exactly_one_entity(world):
    """Mentions in questions are resolved by name: a repeated name or an alias colliding with another
    entity's name would leave a question without a unique subject."""
    names = [a for e in world.truth.entities.values() for a in e.aliases]
    assert len(names) == len(set(names))
    for e in world.truth.entities.values():
        assert e.aliases[0] == e.name
        for a in e.aliases:
            assert world.truth.resolve(a) is e
    assert sum(len(e.aliases) > 1 for e in world.truth.entities.values() if e.type == "person") > 0


def test_facts_are_typed_and_consistent(world):
    ents = world.truth.entities
    married = 0
    for e in ents.values():
        for rel, v in e.facts.items():
            subject_type, object_type = RELATIONS[rel]
            assert e.type == subject_type, (e.id, rel)
            if object_type == "year":
                assert v.isascii() and v.isdigit() and len(v) == 4, (e.id, rel, v)
            else:
                assert ents[v].type == object_type, (e.id, rel, v)
        if "spouse" in e.facts:  # marriage is symmetric and never to oneself
            married += 1
            assert e.facts["spouse"] != e.id and ents[e.facts["spouse"]].facts["spouse"] == e.id
        if e.type == "country":  # the capital is the most popular city located in the country
            cities = [c for c in ents.values() if c.type == "city" and c.facts["located_in"] == e.id]
            if cities:
                assert e.facts["capital"] == max(cities, key=lambda c: c.popularity).id
            else:
                assert "capital" not in e.facts
    assert married > 20
    assert any("capital" in e.facts for e in ents.values())
    # popularity is Zipf-like but not in id order
    pops = [e.popularity for e in ents.values() if e.type == "person"]
    assert pops != sorted(pops, reverse=True)


def test_confusable_sentences_state_a_related_entitys_different_value(world):
    """Every statement not about the page's subject is "<His/Her/Its> <related noun> <other entity of the
    same type> ...", stating that entity's true value of the relation, which differs from the subject's."""
    ents = world.truth.entities
    by_name = {e.name: e for e in ents.values()}
    n = 0
    for d in world.documents:
        e = ents[d.id]
        stmts, _ = read_statements(d.title, d.text)
        for s in stmts:
            if s.about_page:
                continue
            n += 1
            possessive, rest = s.subject.split(" ", 1)
            assert possessive in POSSESSIVES, s
            noun = next(x for x in RELATED_NOUNS[e.type] if rest.startswith(x + " "))
            other = by_name[rest[len(noun) + 1:]]
            assert other.type == e.type and other is not e, s
            ov = other.facts[s.relation]
            assert s.object == (ents[ov].name if ov in ents else ov), s
            assert ov != e.facts[s.relation], s
    assert n > 100


def test_confusable_rate_sets_the_share_of_facts_with_a_confusable_sentence():
    def share(rate):
        w = make_world(replace(SMALL, confusable_rate=rate))
        facts = sum(len(e.facts) for e in w.truth.entities.values())
        wrong = sum(not s.about_page for d in w.documents for s in read_statements(d.title, d.text)[0])
        return wrong / facts

    # fewer than `rate`: none is written when the related entity lacks the relation or shares the value
    assert 0.8 < share(1.0) <= 1.0
    assert 0.45 < share(0.6) < 0.6


def test_benchmark_hop_counts_per_benchmark(world):
    hops = {b: {it.metadata["hops"] for it in items} for b, items in world.benchmarks.items()}
    assert hops == {"nq": {1}, "triviaqa": {1}, "popqa": {1}, "hotpotqa": {2}, "2wikimultihopqa": {2},
                    "musique": {2, 3, 4}, "bamboogle": {3}}
    for items in world.benchmarks.values():
        for it in items:
            q = parse_question(it.question)
            if isinstance(q, ChainQuery):
                assert len(q.relations) == it.metadata["hops"], it.question


def test_benchmark_ids_number_the_items_in_order(world):
    for bench, items in world.benchmarks.items():
        assert [it.id for it in items] == [f"{bench}-{i}" for i in range(len(items))]


def test_chain_questions_never_revisit_an_entity(world):
    ents = world.truth.entities
    for items in world.benchmarks.values():
        for it in items:
            q = parse_question(it.question)
            if not isinstance(q, ChainQuery):
                continue
            start = world.truth.resolve(q.mention)
            path = [start.id, *world.truth.follow(start, q.relations)]
            visited = [v for v in path if v in ents]
            assert len(visited) == len(set(visited)), it.question


def test_benchmarks_draw_their_subjects_by_popularity(world):
    """nq asks about the most popular fifth of entities, popqa and bamboogle about the long tail (bottom half)."""
    by_pop = sorted(world.truth.entities.values(), key=lambda e: -e.popularity)
    head, tail = by_pop[len(by_pop) // 5 - 1].popularity, by_pop[len(by_pop) // 2].popularity

    def subjects(bench):
        return [world.truth.resolve(parse_question(it.question).mention) for it in world.benchmarks[bench]]

    assert all(e.popularity >= head for e in subjects("nq"))
    for bench in ("popqa", "bamboogle"):
        assert all(e.popularity <= tail for e in subjects(bench)), bench


def test_render_chain_variant_cycles_through_templates_and_the_nested_form():
    for rel, templates in SINGLE_HOP_TEMPLATES.items():
        q = ChainQuery("Mira Stone", (rel,))
        for v in range(3 * (len(templates) + 1)):
            assert render_chain(q, v) == render_chain(q, v % (len(templates) + 1)), (rel, v)
        assert render_chain(q, len(templates)) == f"What is {noun_phrase((rel,), 'Mira Stone')}?"


def test_parse_question_ignores_surrounding_whitespace():
    assert parse_question("  Who wrote The Map of Dun?\n") == ChainQuery("The Map of Dun", ("author",))


def test_read_statements_aliases_only_of_the_page_subject_and_split_on_and():
    stmts, aliases = read_statements("Ana Vel", "Ana Vel is also known as Ana the Wise and Ani. "
                                                "Bo Dun is also known as Bo the Red. Bo the Red was born in Kell.")
    assert aliases == ["Ana Vel", "Ana the Wise", "Ani"]
    assert [(s.relation, s.subject, s.object, s.about_page) for s in stmts] == \
        [("born_in", "Bo the Red", "Kell", False)]


def _tiny_truth():
    ana = Entity("person-0000", "person", "Ana Vel", ["Ana Vel", "Ana the Wise"], 0.5,
                 {"birth_year": "1000", "born_in": "city-0000"})
    bo = Entity("person-0001", "person", "Bo Dun", ["Bo Dun", "Twin"], 0.3, {"birth_year": "999"})
    cy = Entity("person-0002", "person", "Cy Dun", ["Cy Dun", "Twin"], 0.2, {"birth_year": "1000"})
    kell = Entity("city-0000", "city", "Kell", ["Kell"], 1.0, {"located_in": "country-0000"})
    return Truth([ana, bo, cy, kell])


def test_truth_resolve_is_unique_and_strips():
    truth = _tiny_truth()
    assert truth.resolve(" Ana the Wise ") is truth.entities["person-0000"]
    assert truth.resolve("Twin") is None  # two entities go by it
    assert truth.resolve("Nobody") is None
    assert truth.answer(ChainQuery("Twin", ("birth_year",))) is None


def test_truth_compare_answers_by_number_and_refuses_a_tie():
    truth = _tiny_truth()
    # 999 < 1000 as numbers (as strings "1000" < "999")
    assert truth.answer(CompareQuery(("Ana Vel", "Bo Dun"), "birth_year")) == ["Bo Dun", "Twin"]
    assert truth.answer(CompareQuery(("Ana Vel", "Cy Dun"), "birth_year")) is None  # a tie has no answer
    assert truth.answer(CompareQuery(("Ana Vel", "Twin"), "birth_year")) is None
    assert truth.answer(ChainQuery("Ana Vel", ("born_in", "located_in"))) == ["country-0000"]


def test_top_value_share_is_the_most_common_values_share_of_all():
    truth = _tiny_truth()
    assert truth.top_value_share("birth_year") == pytest.approx(2 / 3)
    assert truth.top_value_share("born_in") == 1.0


def test_world_fingerprint_covers_qa_files_and_their_names(world, tmp_path):
    out = save_world(world, tmp_path / "w")
    before = world_fingerprint(out)
    qa = out / "qa" / "nq.jsonl"
    qa.rename(out / "qa" / "nq2.jsonl")
    renamed = world_fingerprint(out)
    assert renamed != before
    (out / "qa" / "nq2.jsonl").rename(qa)
    assert world_fingerprint(out) == before
    qa.write_text(qa.read_text().replace("nq-0", "nq-x", 1))
    assert world_fingerprint(out) != before


def test_load_world_with_a_world_json_lacking_its_config_is_a_world_error(world, tmp_path):
    out = save_world(world, tmp_path / "w")
    (out / "world.json").write_text(json.dumps({"format": 1}))
    with pytest.raises(WorldError, match="broken world directory: world.json: KeyError"):
        load_world(out)
    save_world(world, tmp_path / "w2")
    (tmp_path / "w2" / "truth.json").write_text('{"facts": [1,')  # cut short: the file is named, not only the line
    with pytest.raises(WorldError, match="broken world directory: truth.json: JSONDecodeError"):
        load_world(tmp_path / "w2")


def test_a_saved_world_directory_has_ordinary_permissions(world, tmp_path):
    """The world is written in a mkdtemp directory (mode 0700) and renamed into place: it must not stay
    private to its writer."""
    out = save_world(world, tmp_path / "w")
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~_UMASK


def test_names_are_drawn_unique_and_refuse_an_exhausted_name_space():
    names = _Names(np.random.default_rng(0))
    drawn = iter(["Ana Vel", "Ana Vel", "The", "Bo Dun"])
    assert [names.unique(lambda: next(drawn)) for _ in range(2)] == ["Ana Vel", "Bo Dun"]
    with pytest.raises(RuntimeError, match="exhausted"):
        names.unique(lambda: "Ana Vel")


def test_resolve_world_refuses_parameters_for_a_world_directory(world, tmp_path):
    """`resolve_world("worlds/w1", seed=5)` returned the world made with seed 1, the seed ignored."""
    from selfevo.world import resolve_world

    out = save_world(world, tmp_path / "w")
    assert resolve_world(str(out)).truth.to_json() == world.truth.to_json()
    with pytest.raises(WorldError, match="seed are for a generated world"):
        resolve_world(str(out), seed=5)
