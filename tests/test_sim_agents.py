"""The sim backends: SimSolver (search, read, memory, policy gradient) and SimProposer."""

import json
import math
import random
import statistics
from collections import Counter

import pytest

from selfevo.agents.base import Trajectory
from selfevo.agents.baseline import RetrievalBaseline, _spans
from selfevo.agents.sim import Reader, SimProposer, SimProposerConfig, SimSolver, SimSolverConfig
from selfevo.agents.sim.reader import check_magnitude, features, hash_normal
from selfevo.audit import OracleJudge
from selfevo.config import ConfigError, load_config
from selfevo.evaluate import answers_match, normalize_answer
from selfevo.loop.feedback import record_training
from selfevo.search.bm25 import BM25Index
from selfevo.search.tool import SearchTool
from selfevo.world import WorldConfig, make_world
from selfevo.world.language import ChainQuery, Statement, parse_question, render_chain


@pytest.fixture(scope="module")
def env():
    world = make_world(WorldConfig(size="small", seed=0))
    index = BM25Index.build(world.documents)
    return world, index, SearchTool(index, topk=3, max_calls=5)


def make_solver(name: str = "main", **config) -> SimSolver:
    cfg = SimSolverConfig(**config)
    return SimSolver(name, cfg, Reader("solver", cfg.misread_scale, 0.1, 0))


def make_proposer(sources, misread_scale: float = 1.6) -> SimProposer:
    cfg = SimProposerConfig(misread_scale=misread_scale)
    return SimProposer("proposer", cfg, Reader("proposer", misread_scale, 0.1, 0), sources)


def questions(world, n_per_bench: int = 15) -> list[str]:
    return [it.question for items in world.benchmarks.values() for it in items[:n_per_bench]]


def answers_of(solver, qs, tool, **kw) -> list[list[str]]:
    return [[t.answer for t in ts] for ts in solver.answer(qs, tool, **kw)]


# ------------------------------------------------------------------ SimSolver: answering


def test_greedy_answers_are_deterministic(env):
    world, _, tool = env
    qs = questions(world)
    a = answers_of(make_solver(), qs, tool, greedy=True)
    b = answers_of(make_solver(), qs, tool, greedy=True)
    assert a == b
    assert all(len(x) == 1 for x in a)
    # the untrained solver already answers a fair share correctly (it can read)
    gold = {it.question: it.golden_answers for items in world.benchmarks.values() for it in items}
    correct = sum(any(answers_match(x[0], g) for g in gold[q]) for q, x in zip(qs, a))
    assert 0.2 < correct / len(qs) < 0.95


def test_sampled_answers_follow_the_seed(env):
    world, _, tool = env
    qs = questions(world, 10)
    solver = make_solver()
    a = answers_of(solver, qs, tool, greedy=False, n=5, seed=7)
    b = answers_of(solver, qs, tool, greedy=False, n=5, seed=7)
    c = answers_of(solver, qs, tool, greedy=False, n=5, seed=8)
    assert a == b
    assert a != c
    assert all(len(x) == 5 for x in a)
    # sampling is not greedy: some question gets more than one distinct answer
    assert any(len(set(x)) > 1 for x in a)


def test_search_budget_is_respected(env):
    world, index, tool = env
    solver = make_solver()
    qs = [it.question for items in world.benchmarks.values() for it in items]
    for ts in solver.answer(qs, tool, greedy=False, n=2, seed=0):
        for t in ts:
            assert len(t.searches) <= tool.max_calls
    four_hop = [it.question for it in world.benchmarks["musique"] if it.metadata["hops"] == 4]
    assert len(four_hop) >= 10
    tight = SearchTool(index, topk=3, max_calls=2)
    for q, ts in zip(four_hop, solver.answer(four_hop, tight, greedy=True)):
        assert ts[0].answer == "", q
        assert len(ts[0].searches) == 2
    # with the normal budget the same questions are answered
    answered = [ts[0].answer for ts in solver.answer(four_hop, tool, greedy=True)]
    assert sum(a != "" for a in answered) >= 0.8 * len(four_hop)


# ------------------------------------------------------------------ SimSolver: memory


def _label_prob(solver, question, label, tool, hop: int = 0) -> float:
    """The solver's probability of `label` at hop `hop` of `question` (read off a greedy trace)."""
    traj = solver.answer([question], tool, greedy=True)[0][0]
    dist = traj.trace[hop][0]
    return dist.probs[dist.cands.index(label)] if label in dist.cands else 0.0


@pytest.fixture(scope="module")
def wrong_candidate(env):
    """A person, and a wrong birthplace the untrained solver samples with moderate probability."""
    world, _, tool = env
    probe = make_solver()
    for e in world.truth.entities.values():
        if e.type != "person" or world.truth.resolve(e.name) is not e:
            continue
        q = render_chain(ChainQuery(e.name, ("born_in",)), variant=0)
        dist = probe.answer([q], tool, greedy=True)[0][0].trace[0][0]
        truth = world.truth.value_aliases(e.facts["born_in"])
        for cand, p in zip(dist.cands, dist.probs):
            if cand not in truth and 0.2 < p < 0.45:
                return e, cand, p
    raise AssertionError("no person with a moderately likely wrong birthplace")


def _train_on_wrong_label(solver, question, label, tool, steps: int = 4) -> int:
    signal = 0
    for s in range(steps):
        trajs = solver.answer([question], tool, greedy=False, n=5, seed=100 + s)[0]
        signal += solver.update([(trajs, label)])["groups_with_signal"]
    return signal


def test_memory_generalises_a_wrong_label_to_other_phrasings(env, wrong_candidate):
    """Co-cheating's mechanism: a wrong label absorbed from one question is repeated on every
    other question that passes through the same (entity, relation)."""
    world, _, tool = env
    person, wrong, _ = wrong_candidate
    trained_on = render_chain(ChainQuery(person.name, ("born_in",)), variant=0)  # Where was X born?
    rephrased = render_chain(ChainQuery(person.name, ("born_in",)), variant=2)  # What is the birthplace of X?
    two_hop = render_chain(ChainQuery(person.name, ("born_in", "located_in")))  # country of the birthplace
    assert len({trained_on, rephrased, two_hop}) == 3

    deltas = {}
    for memory in (True, False):
        solver = make_solver(memory=memory)
        before = (_label_prob(solver, rephrased, wrong, tool), _label_prob(solver, two_hop, wrong, tool, hop=0))
        # >= 1: with memory, one update can already make the label certain (no signal after it)
        assert _train_on_wrong_label(solver, trained_on, wrong, tool) >= 1
        after = (_label_prob(solver, rephrased, wrong, tool), _label_prob(solver, two_hop, wrong, tool, hop=0))
        deltas[memory] = (after[0] - before[0], after[1] - before[1])

    # with memory: the wrong birthplace becomes much more likely on both other phrasings
    assert deltas[True][0] > 0.25
    assert deltas[True][1] > 0.25
    # without memory only the generic reading weights move: a far smaller effect
    assert abs(deltas[False][0]) < 0.25 * deltas[True][0]
    assert abs(deltas[False][1]) < 0.25 * deltas[True][1]


def test_memory_shows_in_sampled_answers_of_the_rephrased_question(env, wrong_candidate):
    world, _, tool = env
    person, wrong, _ = wrong_candidate
    rephrased = render_chain(ChainQuery(person.name, ("born_in",)), variant=2)
    solver = make_solver()
    before = answers_of(solver, [rephrased], tool, greedy=False, n=200, seed=1)[0].count(wrong)
    _train_on_wrong_label(solver, render_chain(ChainQuery(person.name, ("born_in",)), variant=0), wrong, tool)
    after = answers_of(solver, [rephrased], tool, greedy=False, n=200, seed=1)[0].count(wrong)
    assert after > before + 50


def test_bounded_memory_keeps_a_learned_wrong_label_uncertain(env, wrong_candidate):
    """memory_cap bounds every memory logit, so many updates towards a wrong label leave the
    solver partly agreeing (the co-cheating that keeps paying the proposer), where an unbounded
    memory makes it certain."""
    world, _, tool = env
    person, wrong, _ = wrong_candidate
    q = render_chain(ChainQuery(person.name, ("born_in",)), variant=0)
    probs = {}
    for cap in (0.0, 1.0):
        solver = make_solver(memory_cap=cap)
        assert _train_on_wrong_label(solver, q, wrong, tool, steps=12) >= 2
        if cap:
            assert all(abs(v) <= cap for row in solver.memory.values() for v in row.values())
        probs[cap] = _label_prob(solver, q, wrong, tool)
    assert probs[0.0] > 0.95
    assert probs[1.0] < 0.9
    with pytest.raises(ValueError, match="solver.memory_cap"):
        SimSolverConfig(memory_cap=-1.0)


def test_question_keyed_memory_does_not_ripple_through_an_intermediate_entity(env):
    """memory_key="entity" reuses a learned wrong value on any chain passing the same (entity,
    relation); memory_key="question" keeps it to questions starting from the same mention."""
    world, _, tool = env
    probe = make_solver()
    found = None
    for x in world.truth.entities.values():
        if x.type != "person" or world.truth.resolve(x.name) is not x:
            continue
        two_hop = render_chain(ChainQuery(x.name, ("born_in", "located_in")))
        trace = probe.answer([two_hop], tool, greedy=True)[0][0].trace
        if len(trace) < 2:
            continue
        city = trace[0][0].cands[trace[0][1]]
        if city not in world.truth.value_aliases(x.facts["born_in"]):
            continue  # the chain must pass the true birthplace, so hop 1 asks its country
        one_hop = render_chain(ChainQuery(city, ("located_in",)), variant=0)
        dist = probe.answer([one_hop], tool, greedy=True)[0][0].trace[0][0]
        truth = world.truth.value_aliases(world.truth.resolve(city).facts["located_in"])
        wrong = [c for c, p in zip(dist.cands, dist.probs) if c not in truth and 0.15 < p < 0.5]
        if wrong:
            found = (two_hop, one_hop, wrong[0])
            break
    assert found, "no birthplace with a moderately likely wrong country"
    two_hop, one_hop, wrong = found
    deltas = {}
    for key in ("entity", "question"):
        solver = make_solver(memory_key=key)
        before = (_label_prob(solver, one_hop, wrong, tool), _label_prob(solver, two_hop, wrong, tool, hop=1))
        assert _train_on_wrong_label(solver, one_hop, wrong, tool) >= 1
        after = (_label_prob(solver, one_hop, wrong, tool), _label_prob(solver, two_hop, wrong, tool, hop=1))
        deltas[key] = (after[0] - before[0], after[1] - before[1])
    assert deltas["entity"][0] > 0.25 and deltas["question"][0] > 0.25  # the trained question itself
    assert deltas["entity"][1] > 0.25  # ripples into the chain through that city
    assert abs(deltas["question"][1]) < 0.25 * deltas["entity"][1]
    with pytest.raises(ValueError, match="solver.memory_key"):
        SimSolverConfig(memory_key="page")


def test_update_without_signal_changes_nothing(env, wrong_candidate):
    world, _, tool = env
    person, _, _ = wrong_candidate
    solver = make_solver()
    q = render_chain(ChainQuery(person.name, ("born_in",)), variant=0)
    trajs = solver.answer([q], tool, greedy=True, n=5)[0]  # five identical answers
    stats = solver.update([(trajs, "Nowhere At All")])  # all rewards 0: no advantage
    assert stats["groups_with_signal"] == 0 and stats["reward"] == 0.0
    assert solver.memory == {} and solver.theta == list(solver.config.theta0)


def test_frozen_snapshot_refuses_update_and_does_not_move(env, wrong_candidate):
    world, _, tool = env
    person, wrong, _ = wrong_candidate
    solver = make_solver(lr_memory=0.5)  # small steps: the label is not yet all five samples say
    q = render_chain(ChainQuery(person.name, ("born_in",)), variant=0)
    # a memory row that the training below moves on
    assert _train_on_wrong_label(solver, q, wrong, tool, steps=1) and solver.memory
    snap = solver.snapshot(name="main@r0")
    assert snap.frozen and snap.name == "main@r0"
    trajs = snap.answer([q], tool, greedy=False, n=5, seed=0)[0]
    with pytest.raises(RuntimeError, match="frozen"):
        snap.update([(trajs, wrong)])
    p0 = _label_prob(snap, q, wrong, tool)
    frozen = json.dumps(snap.state_dict(), sort_keys=True)
    _train_on_wrong_label(solver, q, wrong, tool)
    # the grader does not change while it grades: not its weights (a shallow copy of the memory would
    # move with the trained solver), nor what a solver of those weights reads (the snapshot's own
    # answers are cached, so re-asking it alone could not tell)
    assert json.dumps(snap.state_dict(), sort_keys=True) == frozen
    fresh = make_solver(lr_memory=0.5)
    fresh.load_state_dict(snap.state_dict())
    assert _label_prob(fresh, q, wrong, tool) == p0
    assert _label_prob(solver, q, wrong, tool) > p0


def test_state_dict_json_round_trip(env, wrong_candidate):
    world, _, tool = env
    person, wrong, _ = wrong_candidate
    solver = make_solver()
    _train_on_wrong_label(solver, render_chain(ChainQuery(person.name, ("born_in",))), wrong, tool)
    qs = questions(world, 10)
    trajs = solver.answer(qs, tool, greedy=False, n=5, seed=3)
    solver.update([(ts, it) for ts, it in zip(trajs, [ts[0].answer for ts in trajs])])
    assert solver.memory and solver.updates == 5

    state = json.loads(json.dumps(solver.state_dict()))
    twin = make_solver()
    twin.load_state_dict(state)
    assert json.loads(json.dumps(twin.state_dict())) == state
    assert answers_of(twin, qs, tool, greedy=True) == answers_of(solver, qs, tool, greedy=True)
    assert (answers_of(twin, qs, tool, greedy=False, n=5, seed=11)
            == answers_of(solver, qs, tool, greedy=False, n=5, seed=11))
    # and the trained solver really differs from a fresh one
    assert answers_of(make_solver(), qs, tool, greedy=False, n=5, seed=11) != answers_of(
        solver, qs, tool, greedy=False, n=5, seed=11)


# ------------------------------------------------------------------ SimProposer


@pytest.fixture(scope="module")
def proposals(env):
    world, _, tool = env
    return make_proposer(world.documents).propose(400, tool, seed=0)


def test_proposals_are_well_formed(env, proposals):
    world, _, _ = env
    titles = {d.id: d.title for d in world.documents}
    assert len(proposals) == 400
    for p in proposals:
        q = parse_question(p.question)
        assert isinstance(q, ChainQuery), p.question
        assert 1 <= p.hops <= 4 and q.hops == p.hops
        assert q.mention == titles[p.source_id]
        label = normalize_answer(p.draft_label)
        assert label and label not in normalize_answer(p.question)
        assert p.source_ids[0] == p.source_id and len(p.source_ids) == p.hops
        assert all(s in titles for s in p.source_ids)


def test_proposals_are_deterministic_per_seed(env):
    world, _, tool = env
    a = make_proposer(world.documents).propose(50, tool, seed=5)
    b = make_proposer(world.documents).propose(50, tool, seed=5)
    c = make_proposer(world.documents).propose(50, tool, seed=6)
    key = [(p.question, p.draft_label, p.source_ids) for p in a]
    assert key == [(p.question, p.draft_label, p.source_ids) for p in b]
    assert key != [(p.question, p.draft_label, p.source_ids) for p in c]


def test_hop_mix_roughly_follows_4_3_2_1(proposals):
    counts = Counter(p.hops for p in proposals)
    share = [counts[h] / len(proposals) for h in (1, 2, 3, 4)]
    assert share[0] > share[1] > share[2] > share[3] > 0
    for got, want in zip(share, (0.4, 0.3, 0.2, 0.1)):
        assert abs(got - want) < 0.1, share


def test_update_raises_the_rewarded_sources_choice_probability(env):
    world, _, tool = env
    pool = [d for d in world.documents if d.id.startswith("person-")][:20]
    proposer = make_proposer(pool)
    before = Counter(p.source_id for p in make_proposer(pool).propose(300, tool, seed=999))
    target = before.most_common()[len(before) // 2][0]  # an ordinary source, not the favourite
    for step in range(6):
        batch = proposer.propose(60, tool, seed=step)
        rewards = [1.0 if p.source_id == target else 0.0 for p in batch]
        stats = proposer.update(batch, rewards)
        assert stats["proposals"] == 60
    assert proposer.updates == 6
    w = proposer.w_source
    assert w[target] > 0 and w[target] == max(w.values())
    after = Counter(p.source_id for p in proposer.propose(300, tool, seed=999))
    assert after[target] > 2 * before[target]


def test_frozen_proposer_refuses_update(env, proposals):
    world, _, _ = env
    snap = make_proposer(world.documents).snapshot()
    with pytest.raises(RuntimeError, match="frozen"):
        snap.update(proposals[:3], [1.0, 0.0, 0.5])


def test_proposer_state_dict_round_trip(env):
    world, _, tool = env
    pool = world.documents[:60]
    p = make_proposer(pool)
    batch = p.propose(40, tool, seed=0)
    p.update(batch, [float(i % 3 == 0) for i in range(len(batch))])
    twin = make_proposer(pool)
    twin.load_state_dict(json.loads(json.dumps(p.state_dict())))
    key = lambda ps: [(x.question, x.draft_label) for x in ps]  # noqa: E731
    assert key(twin.propose(40, tool, seed=1)) == key(p.propose(40, tool, seed=1))


def _label_truth(world, props) -> float:
    verdicts = OracleJudge(world.truth).judge(
        [{"question": p.question, "adopted_label": p.draft_label, "responses": []} for p in props])
    resolved = [v for v in verdicts if v.resolved]
    assert len(resolved) >= 0.9 * len(props)
    return sum(v.label_correct for v in resolved) / len(resolved)


def test_label_truth_depends_on_the_readers_misreadings(env, proposals):
    world, _, tool = env
    careful = make_proposer(world.documents, misread_scale=0.0).propose(400, tool, seed=0)
    assert _label_truth(world, careful) >= 0.97
    assert 0.55 <= _label_truth(world, proposals) <= 0.92


def test_answers_depend_on_this_tool_and_world_not_an_earlier_one(env):
    """The solver's and reader's caches are keyed by the pages read, not by a mention or a page id:
    the same solver asked through another tool (another topk) or on another world (the same page
    ids, other pages) answers as a fresh solver does there."""
    world, index, tool = env
    qs = questions(world, 10)
    narrow = SearchTool(index, topk=1, max_calls=5)
    solver = make_solver()
    through_narrow = answers_of(solver, qs, narrow, greedy=True)
    wide = answers_of(make_solver(), qs, tool, greedy=True)
    assert through_narrow != wide  # else a cache keyed by the mention alone would pass too
    assert answers_of(solver, qs, tool, greedy=True) == wide
    other = make_world(WorldConfig(size="small", seed=1))
    assert {d.id for d in other.documents} == {d.id for d in world.documents}
    other_tool = SearchTool(BM25Index.build(other.documents), topk=3, max_calls=5)
    other_qs = questions(other, 10)
    assert (answers_of(solver, other_qs, other_tool, greedy=True)
            == answers_of(make_solver(), other_qs, other_tool, greedy=True))


# ------------------------------------------------------------------ settings the learners cannot run with


@pytest.mark.parametrize("override, field", [
    ("proposer.lr=1e308", "proposer.lr"),  # weights overflowed to inf: random.choices raised mid-run
    ("solver.lr_theta=1e308", "solver.lr_theta"),  # theta = inf written into the round checkpoint
    ("solver.theta0=[1e308, 0, 1e308, 0]", "solver.theta0"),  # logits inf - inf: NaN probabilities
    ("solver.misread_scale=1e308", "solver.misread_scale"),
    ("solver.lr_memory=1e308", "solver.lr_memory"),
    ("proposer.theta=[-1e10, 0, 0, 0]", "proposer.theta"),
    ("proposer.misread_scale=1e308", "proposer.misread_scale"),
    ("proposer.hop_ratio=[1" + "0" * 400 + ", 1]", "proposer.hop_ratio"),  # OverflowError in the hop draw
    ("proposer.options=1" + "0" * 400, "proposer.options"),  # every proposal drew that many pages: no end
])
def test_a_sim_setting_too_large_to_compute_with_is_a_config_error(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(f"{field}: ") and len(str(e.value)) < 200, str(e.value)
    # the largest allowed values still make a config
    load_config(None, ["proposer.lr=1e6", "solver.theta0=[-1e6, 1e6, 0, 0]", "proposer.options=10000",
                       "proposer.hop_ratio=[1000000, 1]"])


def test_a_hop_count_the_search_budget_cannot_compose_is_refused(env):
    """An h-hop question takes the sim proposer h - 1 searches: with fewer, every draw of that hop
    count fails and is retried until the step's attempts run out, so the proposer wrote a fraction of
    its questions (6 of 20 at search.max_calls=2) and the run still exited 0."""
    world, index, _ = env
    tight = SearchTool(index, topk=3, max_calls=2)
    assert len(make_proposer(world.documents).propose(20, tight, seed=0)) < 10  # why it is refused
    with pytest.raises(ConfigError, match=r"^search\.max_calls: 2 searches cannot compose the 4-hop .*\[4, 3, 2\]"):
        load_config(None, ["search.max_calls=2"])
    with pytest.raises(ConfigError, match=r"^proposer\.hop_ratio: asks for 7-hop questions"):
        load_config(None, ["proposer.hop_ratio=[1, 1, 1, 1, 1, 1, 1]"])
    # what fits the budget runs in full; the lm backend has no hop ratio
    cfg = load_config(None, ["search.max_calls=2", "proposer.hop_ratio=[4, 3, 2, 0]"])
    proposer = SimProposer("proposer", cfg.proposer, Reader("proposer", 1.6, 0.1, 0), world.documents)
    assert len(proposer.propose(20, tight, seed=0)) == 20
    load_config(None, ["search.max_calls=1"], backend="lm")


class _LowScoringReader(Reader):
    """A reader whose every score lies far below zero (what a strongly negative reading weight gives)."""

    def bias(self, doc_id: str, candidate: str) -> float:
        return -2e9 if candidate == self.favourite else -3e9


def test_the_proposers_reading_follows_its_scores_however_low(env):
    """A reading is a softmax over the statements' scores; a floor of -1e9 under them made two
    scores below it equal, so the proposer read such a page at random."""
    world, _, _ = env
    doc = next(d for d in world.documents if len({s.object for s in Reader("r", 0, 0, 0).read(d)
                                                  .statements.get("born_in", ())}) > 1)
    reader = _LowScoringReader("proposer", 1.0, 0.1, 0)
    page = reader.read(doc)
    reader.favourite = sorted({s.object for s in page.statements["born_in"]})[-1]
    proposer = SimProposer("proposer", SimProposerConfig(), reader, [doc])
    reads = Counter(proposer._read_value(page, "born_in", random.Random(i)) for i in range(50))
    assert reads == {reader.favourite: 50}


# ------------------------------------------------------------------ the retrieval baseline


def test_the_baseline_keeps_a_name_after_a_sentence_opener_and_punctuation():
    """A run of stopwords ended by punctuation ("However,") used to skip the token after it, the
    first word of the next name: "Capitol Records" was read as "Records", "It. Paris" as nothing."""
    assert [s for *_, s in _spans("However, Capitol Records signed him.")] == ["Capitol Records"]
    assert [s for *_, s in _spans("It. Paris")] == ["Paris"]
    assert [s for *_, s in _spans("In 1933, Paris was big")] == ["1933", "Paris"]


@pytest.mark.parametrize("make, field", [
    (lambda: SimSolverConfig(temperature=float("nan")), "solver.temperature"),  # NaN probabilities: crash mid-run
    (lambda: SimSolverConfig(memory_cap=float("nan")), "solver.memory_cap"),  # NaN memory in the checkpoint
    (lambda: SimProposerConfig(read_temperature=float("nan")), "proposer.read_temperature"),
    (lambda: Reader("solver", float("nan"), 0.1, 0), "misread_scale"),
])
def test_a_nan_setting_is_refused_in_python_too(make, field):
    """A config file's NaN is refused when read; the dataclasses' own checks (`x <= 0`) let a NaN
    through, so a Python caller's NaN temperature crashed the first sampled answer and a NaN memory
    cap wrote NaN into every memory entry the first update touched."""
    with pytest.raises(ValueError, match=field):
        make()


def test_a_proposer_without_sources_says_so(env):
    _, _, tool = env
    with pytest.raises(ValueError, match="no source documents"):
        make_proposer([]).propose(3, tool, seed=0)
    assert make_proposer([]).propose(0, tool, seed=0) == []


# ------------------------------------------------------------------ mutation-sweep additions: state, snapshots, edges


class _NoHits:
    """A retriever that finds nothing: what the solver answers then comes from its memory alone."""

    def retrieve(self, queries, topk=3):
        return [[] for _ in queries]


def _with_memory(memory: dict, **config) -> SimSolver:
    solver = make_solver(**config)
    solver.load_state_dict({**solver.state_dict(), "memory": memory})
    return solver


def test_a_solver_snapshot_is_a_faithful_copy_that_shares_no_mutable_state(env, wrong_candidate):
    """The grader must not move while the solver it was taken from trains: not its memory, nor its
    lineage (the loop's `record_training` writes into `solver.lineage` in place), nor its counts."""
    world, _, tool = env
    person, wrong, _ = wrong_candidate
    q = render_chain(ChainQuery(person.name, ("born_in",)), variant=0)
    solver = make_solver(lr_memory=0.5)
    assert _train_on_wrong_label(solver, q, wrong, tool, steps=1)
    record_training(solver, [1], 1)
    snap = solver.snapshot(name="main@r1")
    assert {**snap.state_dict(), "name": solver.name} == solver.state_dict()
    frozen = json.dumps(snap.state_dict(), sort_keys=True)
    _train_on_wrong_label(solver, q, wrong, tool)
    record_training(solver, [2], 2)
    assert json.dumps(snap.state_dict(), sort_keys=True) == frozen
    assert snap.lineage == {"folds": [1], "rounds": [1]} and snap.updates == 1


def test_load_state_dict_forgets_what_was_read_with_the_old_weights(env, wrong_candidate):
    """A solver that already answered (its readings cached) and then loads a trained state answers
    as the trained solver does, not from its cache."""
    world, _, tool = env
    person, wrong, _ = wrong_candidate
    q = render_chain(ChainQuery(person.name, ("born_in",)), variant=0)
    trained = make_solver()
    _train_on_wrong_label(trained, q, wrong, tool)
    solver = make_solver()
    p0 = _label_prob(solver, q, wrong, tool)
    solver.load_state_dict(json.loads(json.dumps(trained.state_dict())))
    assert _label_prob(solver, q, wrong, tool) == _label_prob(trained, q, wrong, tool) > p0


def test_a_loaded_solver_does_not_train_the_state_it_was_loaded_from(env, wrong_candidate):
    world, _, tool = env
    person, wrong, _ = wrong_candidate
    q = render_chain(ChainQuery(person.name, ("born_in",)), variant=0)
    source = make_solver(lr_memory=0.5)
    assert _train_on_wrong_label(source, q, wrong, tool, steps=1) and source.memory
    before = json.dumps(source.state_dict(), sort_keys=True)
    twin = make_solver(lr_memory=0.5)
    twin.load_state_dict(source.state_dict())  # in process, not through JSON: nothing may be shared
    assert _train_on_wrong_label(twin, q, wrong, tool)
    assert json.dumps(source.state_dict(), sort_keys=True) == before


def test_an_update_with_nothing_to_learn_from_counts_and_moves_nothing():
    solver = make_solver()
    assert solver.update([]) == {"groups": 0, "groups_with_signal": 0, "reward": 0.0}
    # rollouts without a trace (another backend's): an advantage, but no choice of this solver to move
    stats = solver.update([([Trajectory("Paris"), Trajectory("Rome")], "Paris")])
    assert stats == {"groups": 1, "groups_with_signal": 1, "reward": 0.5}
    assert solver.updates == 2 and solver.theta == list(solver.config.theta0) and solver.memory == {}


def test_a_solver_without_memory_neither_writes_nor_reads_one(env, wrong_candidate):
    world, _, tool = env
    person, wrong, _ = wrong_candidate
    q = render_chain(ChainQuery(person.name, ("born_in",)), variant=0)
    off = make_solver(memory=False)
    assert _train_on_wrong_label(off, q, wrong, tool) >= 1
    assert off.memory == {}
    trained = make_solver()
    _train_on_wrong_label(trained, q, wrong, tool)
    assert trained.memory
    loaded = make_solver(memory=False)
    loaded.load_state_dict(trained.state_dict())  # a checkpoint with memory, read by the ablation
    bare = make_solver(memory=False)
    bare.load_state_dict({**trained.state_dict(), "memory": {}})
    assert _label_prob(loaded, q, wrong, tool) == _label_prob(bare, q, wrong, tool)


def test_memory_rows_are_keyed_by_the_lowercased_mention_or_the_questions_start(env, wrong_candidate):
    world, _, tool = env
    person, _, _ = wrong_candidate
    two_hop = render_chain(ChainQuery(person.name, ("born_in", "located_in")))
    name = person.name.lower()
    assert name != person.name
    trace = make_solver().answer([two_hop], tool, greedy=True)[0][0].trace
    city = trace[0][0].cands[trace[0][1]]
    assert [d.mkey for d, _ in trace] == [f"{name}|born_in", f"{city.lower()}|located_in"]
    trace = make_solver(memory_key="question").answer([two_hop], tool, greedy=True)[0][0].trace
    assert [d.mkey for d, _ in trace] == [f"{name}|born_in", f"{name}|born_in/located_in"]


def test_memory_alone_answers_chains_and_comparisons():
    """With no page found, the candidates are what memory holds: it recalls an answer no page shows;
    greedy ties go to the first candidate (sorted); a comparison's tie goes to the first option and
    a year it cannot read counts as later than any year."""
    tool = SearchTool(_NoHits(), topk=3, max_calls=5)
    q = render_chain(ChainQuery("Ann Ash", ("born_in",)), variant=0)
    assert answers_of(make_solver(), [q], tool) == [[""]]
    assert answers_of(_with_memory({"ann ash|born_in": {"Bree": 1.0, "Arda": 1.0}}), [q], tool) == [["Arda"]]
    compare = "Who was born first, Ann Ash or Bo Birch?"
    tie = {"ann ash|birth_year": {"1900": 1.0}, "bo birch|birth_year": {"1900": 1.0}}
    assert answers_of(_with_memory(tie), [compare], tool) == [["Ann Ash"]]
    unread = {"ann ash|birth_year": {"unknown": 1.0}, "bo birch|birth_year": {"1950": 1.0}}
    assert answers_of(_with_memory(unread), [compare], tool) == [["Bo Birch"]]
    # not a question of the world's language, and no page: no answer (not an IndexError)
    assert answers_of(make_solver(), ["zzz qqq"], tool) == [[""]]


def test_contexts_must_match_the_questions_one_to_one(env):
    world, _, tool = env
    qs = questions(world, 1)[:2]
    for agent in (make_solver(), RetrievalBaseline()):
        with pytest.raises(ValueError):
            agent.answer(qs, tool, contexts=[world.documents[0]])


def test_a_proposer_snapshot_is_a_faithful_copy_that_shares_no_weights(env):
    world, _, tool = env
    p = make_proposer(world.documents[:60])
    batch = p.propose(40, tool, seed=0)
    p.update(batch, [float(i % 3 == 0) for i in range(len(batch))])
    snap = p.snapshot(name="proposer@r1")
    assert snap.frozen and snap.name == "proposer@r1"
    assert {**snap.state_dict(), "name": p.name} == p.state_dict()
    frozen = json.dumps(snap.state_dict(), sort_keys=True)
    p.update(batch, [float(i % 2 == 0) for i in range(len(batch))])
    assert json.dumps(snap.state_dict(), sort_keys=True) == frozen
    # and a checkpoint's round trip restores every weight and the count of updates
    state = json.loads(json.dumps(p.state_dict()))
    twin = make_proposer(world.documents[:60])
    twin.load_state_dict(state)
    assert json.loads(json.dumps(twin.state_dict())) == state and twin.updates == 2


def test_a_proposer_update_with_no_proposals_counts_and_moves_nothing(env):
    world, _, _ = env
    p = make_proposer(world.documents[:5])
    assert p.update([], []) == {"proposals": 0, "reward": 0.0}
    assert p.updates == 1 and p.w_source == p.w_fact == p.w_relation == {}


def test_a_proposal_whose_question_names_its_answer_is_dropped(env):
    """Dr. Zero's format rule: "Where was Paris Vale born?" - "Paris" gives its answer away."""
    from selfevo.records import Document

    _, _, tool = env
    cfg = SimProposerConfig(hop_ratio=(1,), options=1, misread_scale=0.0)
    for title, want in (("Paris Vale", []), ("Oren Vale", ["Paris"])):
        doc = Document("person-x", title, f"{title} was born in Paris.")
        proposer = SimProposer("proposer", cfg, Reader("proposer", 0.0, 0.1, 0), [doc])
        assert sorted({p.draft_label for p in proposer.propose(3, tool, seed=0)}) == want


@pytest.mark.parametrize("make, field", [
    (lambda: SimSolverConfig(misread_scale=-0.5), "solver.misread_scale"),
    (lambda: SimProposerConfig(misread_scale=-0.5), "proposer.misread_scale"),
    (lambda: SimProposerConfig(theta=(1.0, 2.0)), "proposer.theta"),
    (lambda: SimProposerConfig(hop_ratio=(2, -1)), "proposer.hop_ratio"),
    (lambda: SimProposerConfig(hop_ratio=(0, 0)), "proposer.hop_ratio"),
    (lambda: SimProposerConfig(hop_ratio=()), "proposer.hop_ratio"),
])
def test_a_sim_setting_the_learners_cannot_use_is_refused_in_python(make, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        make()


def test_a_zero_learning_rate_freezes_rather_than_being_refused():
    assert SimSolverConfig(lr_memory=0.0, lr_theta=0.0).lr_theta == 0.0
    assert SimProposerConfig(lr=0.0).lr == 0.0


def test_a_loaded_solvers_lineage_is_its_own():
    """`load_state_dict` copies theta and memory but kept the state's lineage dict itself: loading
    another solver's `state_dict()` in process, then recording training (in place, as the loop's
    `record_training` does) rewrote the other solver's lineage too."""
    source = make_solver()
    record_training(source, [1], 1)
    twin = make_solver("twin")
    twin.load_state_dict(source.state_dict())
    record_training(twin, [2], 2)
    assert source.lineage == {"folds": [1], "rounds": [1]}
    assert twin.lineage == {"folds": [1, 2], "rounds": [1, 2]}


# ------------------------------------------------------------------ the reader: biases, features, weights


def test_reader_biases_correlate_by_shared():
    """Two readers' page-specific biases are equal at shared=1 and independent at shared=0; each is a fixed
    function of (page, candidate), differing between pages and candidates."""
    keys = [(f"person-{i:04d}", c) for i in range(200) for c in ("Kell", "Port Drax")]

    def corr(shared):
        a, b = Reader("proposer", 1.0, shared, 0), Reader("solver", 1.0, shared, 0)
        xs, ys = [a.bias(*k) for k in keys], [b.bias(*k) for k in keys]
        return xs, ys, statistics.correlation(xs, ys)

    xs, ys, r = corr(1.0)
    assert xs == pytest.approx(ys) and r == pytest.approx(1.0)
    _, _, r = corr(0.0)
    assert abs(r) < 0.2
    _, _, r = corr(0.5)
    assert 0.3 < r < 0.7
    reader = Reader("solver", 2.0, 0.1, 0)
    assert reader.bias("person-0001", "Kell") != reader.bias("person-0002", "Kell")
    assert reader.bias("person-0001", "Kell") != reader.bias("person-0001", "Port Drax")
    assert reader.bias("person-0002", "Kell") == Reader("solver", 2.0, 0.1, 0).bias("person-0002", "Kell")
    assert Reader("solver", 2.0, 0.1, 1).bias("person-0002", "Kell") != reader.bias("person-0002", "Kell")
    assert Reader("solver", 0.0, 0.1, 0).bias("person-0002", "Kell") == 0.0


@pytest.mark.parametrize("shared", [-0.1, 1.5, float("nan")])
def test_reader_refuses_a_shared_correlation_outside_0_1(shared):
    with pytest.raises(ValueError, match="shared"):
        Reader("solver", 1.0, shared, 0)


def test_hash_normal_is_a_standard_normal_of_its_keys():
    xs = [hash_normal("k", i) for i in range(4000)]
    assert abs(statistics.mean(xs)) < 0.1 and 0.9 < statistics.pstdev(xs) < 1.1
    assert min(xs) < -2.5 and max(xs) > 2.5  # both tails
    assert hash_normal("a", 1) == hash_normal("a", 1) != hash_normal("a", 2)
    assert hash_normal("ab", "c") != hash_normal("a", "bc")  # the keys are kept apart


def test_reading_features():
    about = Statement("born_in", "He", "Kell", True, 2)
    other = Statement("born_in", "His brother Tam Vale", "Dun", False, 3)
    assert features(about, True, 0) == (1.0, 1.0, 1.0, 1.0)
    assert features(about, False, 1) == (1.0, 0.0, 0.0, 0.0)
    assert features(other, True, 1) == (0.0, 1.0, 0.0, 0.0)
    assert features(other, False, 0) == (0.0, 0.0, 0.0, 1.0)


@pytest.mark.parametrize("make, field", [
    (lambda: SimSolverConfig(theta0=(float("nan"), 0.0, 0.0, 0.0)), "solver.theta0"),
    (lambda: SimSolverConfig(theta0=(math.inf, 0.0, 0.0, 0.0)), "solver.theta0"),
    (lambda: SimProposerConfig(theta=(0.0, float("nan"), 0.0, 0.0)), "proposer.theta"),
])
def test_a_nan_or_infinite_weight_is_refused(make, field):
    with pytest.raises(ValueError, match=field):
        make()
    with pytest.raises(ValueError, match="where.x"):
        check_magnitude("where.x", 1.0, float("nan"))
    check_magnitude("where.x", 1e6, -1e6, 0.0)
