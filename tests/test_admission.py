"""MSV, the admission rule (DESIGN §1): the majority of 3 under the loop's matcher, with and without
the source; admit iff both exist and match; the majority replaces the draft label."""

import pytest

from selfevo.agents.base import Proposal, Trajectory
from selfevo.loop.admission import MSV, AdmitAll, majority
from selfevo.records import Document


@pytest.mark.parametrize("answers, want", [
    (["Paris", "paris", "Rome"], "Paris"),  # 2 of 3 is a majority, under the matcher
    (["Rome", "The Beatles", "beatles"], "The Beatles"),  # the first answer that has one
    (["x", "y", "z"], None),
    (["", "", "x"], None),  # agreeing on no answer is no majority
    (["a", "an", "the"], None),  # articles normalize to nothing
    (["x", "x", "x"], "x"),
])
def test_majority_is_two_of_three_under_the_matcher(answers, want):
    assert majority(answers) == want


def test_majority_min_count():
    assert majority(["x", "y", "x"], min_count=3) is None and majority(["x"], min_count=1) == "x"


class _Fake:
    """A solver whose sampled answers are scripted per (question, source given or not)."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def snapshot(self, name=None):
        return self

    def answer(self, questions, tool, *, greedy=True, n=1, seed=None, contexts=None):
        self.calls.append((greedy, n, seed, contexts is not None))
        return [[Trajectory(a) for a in self.script[(q, contexts is not None)]] for q in questions]


def _proposal(q, draft):
    return Proposal(q, draft, "d1", ("d1",), 1)


def test_msv_admits_matching_majorities_and_adopts_them():
    script = {("q1", True): ["Paris", "paris", "Rome"], ("q1", False): ["Paris", "x", "PARIS"],   # match
              ("q2", True): ["Paris", "Paris", "y"], ("q2", False): ["Rome", "Rome", "z"],        # differ
              ("q3", True): ["x", "y", "z"], ("q3", False): ["x", "x", "x"],                      # no majority
              ("q4", True): ["x", "x", "y"], ("q4", False): ["", "", "x"]}                        # empty
    fake = _Fake(script)
    msv = MSV({"d1": Document("d1", "T", "text")})
    msv.begin_round(2, fake)
    out = msv.decide([_proposal("q1", "Lyon"), _proposal("q2", "Paris"), _proposal("q3", "x"),
                      _proposal("q4", "x")], tool=None, seed=7)
    assert [d.admitted for d in out] == [True, False, False, False]
    assert out[0].label == "Paris"  # the majority replaces the draft ("Lyon"), which neither side saw
    assert [d.label for d in out[1:]] == ["Paris", "x", "x"]  # a rejection keeps the draft, untrained on
    assert out[0].detail == {"with_source": ["Paris", "paris", "Rome"], "without_source": ["Paris", "x", "PARIS"],
                             "majority_with": "Paris", "majority_without": "Paris"}
    # 3 sampled answers with the source and 3 without, independently seeded: 6 generations a candidate
    assert [(g, n, ctx) for g, n, _, ctx in fake.calls] == [(False, 3, True), (False, 3, False)]
    assert fake.calls[0][2] != fake.calls[1][2] and msv.generations_per_candidate == 6


def test_admit_all_keeps_the_draft():
    d = AdmitAll().decide([_proposal("q", "draft")], tool=None, seed=0)
    assert [(x.admitted, x.label) for x in d] == [(True, "draft")]


@pytest.mark.parametrize("samples, with_src, without, want", [
    (3, ["Paris", "paris", "Rome"], ["Paris", "x", "PARIS"], (True, "Paris")),  # the paper's 2 of 3
    # 2 of 5 is no majority: two answers tie and the sample order would pick the label
    (5, ["Paris", "Paris", "Rome", "Rome", "Lyon"], ["Paris", "Paris", "Rome", "Rome", "Nice"], (False, "draft")),
    (5, ["Rome", "Rome", "Paris", "Paris", "Lyon"], ["Rome", "Paris", "Paris", "Rome", "Nice"], (False, "draft")),
    (5, ["Rome", "Rome", "Rome", "Paris", "Lyon"], ["Rome", "Paris", "Rome", "Rome", "Nice"], (True, "Rome")),
    (1, ["Paris"], ["paris"], (True, "Paris")),  # one sample a side: it is the majority
    (1, ["Paris"], ["Rome"], (False, "draft")),
    (2, ["Paris", "Rome"], ["Paris", "Rome"], (False, "draft")),  # 1 of 2 is no majority
    (2, ["Paris", "paris"], ["PARIS", "Paris"], (True, "Paris")),
    (4, ["Paris", "Paris", "Rome", "Rome"], ["Paris", "Paris", "Rome", "Rome"], (False, "draft")),  # a 2-2 tie
    (4, ["Rome", "Paris", "Paris", "Paris"], ["Paris", "Rome", "paris", "Paris"], (True, "Paris")),
])
def test_msv_majority_is_a_strict_majority_of_its_samples(samples, with_src, without, want):
    fake = _Fake({("q", True): with_src, ("q", False): without})
    msv = MSV({"d1": Document("d1", "T", "text")}, samples=samples)
    msv.begin_round(1, fake)
    d = msv.decide([_proposal("q", "draft")], tool=None, seed=0)[0]
    assert (d.admitted, d.label) == want
    # `samples` answers with the source and `samples` without: 2 * samples extra generations a candidate
    assert [n for _, n, _, _ in fake.calls] == [samples, samples] and msv.generations_per_candidate == 2 * samples


def test_msv_puts_each_candidates_own_source_in_context():
    """M(.|x, q): the page the proposer was given (source_id), not another page of its lineage; the samples
    without the source get no context at all."""
    seen = []

    class _Seeing(_Fake):
        def answer(self, questions, tool, **kw):
            seen.append(kw.get("contexts"))
            return super().answer(questions, tool, **kw)

    docs = {d: Document(d, d.upper(), f"text of {d}") for d in ("d1", "d2", "d3")}
    fake = _Seeing({(q, c): ["x", "x", "x"] for q in ("q1", "q2") for c in (True, False)})
    msv = MSV(docs)
    msv.begin_round(1, fake)
    msv.decide([Proposal("q1", "x", "d2", ("d2", "d3"), 2), Proposal("q2", "x", "d1", ("d3", "d1"), 2)],
               tool=None, seed=0)
    assert seen == [[docs["d2"], docs["d1"]], None]


def test_msv_names_a_proposal_written_from_no_source_it_was_given():
    """A proposer of a user's that wrote from a page outside the run's sources got a bare KeyError."""
    docs = {d: Document(d, d.upper(), f"text of {d}") for d in ("d1", "d2")}
    msv = MSV(docs)
    msv.begin_round(1, _Fake({}))
    with pytest.raises(ValueError, match="source_id is none of the source documents it was given \\('d9'\\)"):
        msv.decide([Proposal("q1", "x", "d1", ("d1",), 1), Proposal("q2", "x", "d9", ("d9",), 1)], tool=None, seed=0)


def test_admit_all_checks_no_format_and_takes_an_empty_draft_or_none():
    """AdmitAll admits whatever reaches it, an empty draft label included (the label it trains on is then '');
    a format check is the caller's (the loop passes only proposals without a format_error). No proposals:
    no decisions."""
    d = AdmitAll().decide([_proposal("q", ""), _proposal("", "x")], tool=None, seed=0)
    assert [(x.admitted, x.label, x.detail) for x in d] == [(True, "", {}), (True, "x", {})]
    assert AdmitAll().decide([], tool=None, seed=0) == []
    assert AdmitAll().generations_per_candidate == 0
