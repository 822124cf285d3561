"""The sim proposer: reads a source page, composes a 1-4 hop question by following links with the
search tool, and learns *what to ask* by policy gradient on the frontier reward.

Its policy scores (page, relation) options with per-page, per-fact and per-relation weights, for the
source fact and for the fact it follows at every later page, so its curriculum can concentrate on
what pays, as a language-model proposer's can. Its
draft answer is what its imperfect reader believes the page says, so a systematic misreading of a
page becomes a wrong pseudo-label every time the page is used.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from selfevo.agents.base import Proposal
from selfevo.agents.sim.reader import FEATURES, PageReading, Reader, check_magnitude, features, given
from selfevo.algos import bucket_advantages, float_sum, sample_index, softmax
from selfevo.evaluate import mentions, normalize_answer
from selfevo.records import Document
from selfevo.search.tool import SearchBudgetExhausted, SearchSession, SearchTool
from selfevo.world.language import RELATIONS, ChainQuery, render_chain

MAX_OPTIONS = 10_000  # every option is a page drawn and read, for every proposal


@dataclass(frozen=True)
class SimProposerConfig:
    theta: tuple[float, ...] = (0.8, 0.8, 0.8, 0.5)  # reading weights (fixed), see FEATURES
    misread_scale: float = 1.6  # std of the reader's page-specific bias
    read_temperature: float = 0.3  # low: re-reading a page mostly repeats the same reading
    # paper: the proposer is handed one source document; here it draws `options` pages a proposal and its
    # policy picks among their facts (1 = the paper's uniform source; co-cheating and CrossFit's cut of F
    # appear either way, most of CrossFit's T_P gain comes from the source choice: docs/results.md,
    # "Downstream sensitivity", the given-source variant)
    options: int = 8  # candidate (source, relation) options the policy chooses among
    hop_ratio: tuple[int, ...] = (4, 3, 2, 1)  # paper (Dr. Zero): n-hop ratio 4:3:2:1
    lr: float = 0.5

    def __post_init__(self):
        if len(self.theta) != len(FEATURES):
            raise ValueError(f"proposer.theta: expected {len(FEATURES)} weights")
        if self.options < 1:
            raise ValueError(f"proposer.options: must be >= 1, got {self.options}")
        if not self.hop_ratio or min(self.hop_ratio) < 0 or sum(self.hop_ratio) <= 0:
            raise ValueError(f"proposer.hop_ratio: must be non-negative with a positive sum, got {self.hop_ratio}")
        if not self.lr >= 0:  # 0 freezes the policy; below 0 learns away from the reward
            raise ValueError(f"proposer.lr: must be >= 0, got {self.lr}")
        if not self.read_temperature > 0:  # a NaN passes `<= 0`, and made every reading NaN probabilities
            raise ValueError(f"proposer.read_temperature: must be > 0, got {self.read_temperature}")
        if self.misread_scale < 0:
            raise ValueError(f"proposer.misread_scale: must be >= 0, got {self.misread_scale}")
        check_magnitude("proposer.theta", *self.theta)
        for name in ("misread_scale", "lr"):
            check_magnitude(f"proposer.{name}", getattr(self, name))
        # a weight past a float's range crashed the hop draw; 10**400 options never finished a proposal
        check_magnitude("proposer.hop_ratio", *self.hop_ratio)
        if self.options > MAX_OPTIONS:
            raise ValueError(f"proposer.options: must be at most {MAX_OPTIONS}, got {given(self.options)}")


@dataclass
class _Choice:
    """One decision of the policy: which (page, relation) to ask about next."""

    options: list[tuple[str, str]]  # (page id, relation)
    probs: list[float]
    chosen: int


@dataclass
class SimProposer:
    name: str
    config: SimProposerConfig
    reader: Reader
    sources: Sequence[Document]
    w_source: dict[str, float] = field(default_factory=dict)  # keyed "source id"
    w_fact: dict[str, float] = field(default_factory=dict)  # keyed "source id|relation"
    w_relation: dict[str, float] = field(default_factory=dict)
    frozen: bool = False
    updates: int = 0

    # ---------------------------------------------------------------- Learner
    def snapshot(self, name: str | None = None) -> SimProposer:
        return SimProposer(name or self.name, self.config, self.reader, self.sources,
                           dict(self.w_source), dict(self.w_fact), dict(self.w_relation), True, self.updates)

    def state_dict(self) -> dict:
        return {"name": self.name, "config": asdict(self.config), "w_source": self.w_source,
                "w_fact": self.w_fact, "w_relation": self.w_relation, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.w_source = {k: float(v) for k, v in state["w_source"].items()}
        self.w_fact = {k: float(v) for k, v in state["w_fact"].items()}
        self.w_relation = {k: float(v) for k, v in state["w_relation"].items()}
        self.updates = int(state["updates"])

    # ---------------------------------------------------------------- reading
    def _read_value(self, page: PageReading, rel: str, rnd: random.Random) -> str | None:
        """What the proposer believes page says for `rel`: a low-temperature sample of its
        reading model over the page's statements of that relation."""
        stmts = page.statements.get(rel)
        if not stmts:
            return None
        cands = sorted({s.object for s in stmts})
        scores: dict[str, float] = {}
        for s in stmts:
            sc = self.reader.score(self.config.theta, features(s, True, 0), page.doc_id, s.object)
            # no finite floor: one under every score (-1e9 once) flattened a reading of low scores
            scores[s.object] = max(scores.get(s.object, -math.inf), sc)
        probs = softmax([scores[c] for c in cands], self.config.read_temperature)
        return cands[sample_index(probs, rnd.random())]

    @staticmethod
    def _usable(page: PageReading, last_hop: bool) -> list[str]:
        """Relations the page states (as the reader sees it) that can continue the chain."""
        return [r for r in sorted(page.statements) if last_hop or RELATIONS[r][1] != "year"]

    def _choose(self, options: list[tuple[str, str]], rnd: random.Random) -> _Choice:
        probs = softmax([self._score(page, rel) for page, rel in options])
        return _Choice(options, probs, rnd.choices(range(len(options)), weights=probs)[0])

    def _compose(self, doc: Document, first_rel: str, hops: int, session: SearchSession,
                 rnd: random.Random) -> tuple[tuple[str, ...], str, tuple[str, ...], list[_Choice]] | None:
        """Follow links from the source, choosing at every page which fact to follow with the
        same learned policy: returns (relations, draft answer, pages read, choices made)."""
        page = self.reader.read(doc)
        rels, pages, seen, choices = [first_rel], [doc.id], {doc.title}, []
        value = self._read_value(page, first_rel, rnd)
        while value is not None and len(rels) < hops:
            if value in seen:
                return None
            seen.add(value)
            hits = session.search(value)
            if not hits:
                return None
            nxt = next((h.document for h in hits if h.document.title == value), hits[0].document)
            page = self.reader.read(nxt)
            pages.append(nxt.id)
            usable = self._usable(page, len(rels) == hops - 1)
            if not usable:
                return None
            choice = self._choose([(nxt.id, r) for r in usable], rnd)
            choices.append(choice)
            rel = usable[choice.chosen]
            rels.append(rel)
            value = self._read_value(page, rel, rnd)
        if value is None or value in seen:
            return None
        return tuple(rels), value, tuple(pages), choices

    # ---------------------------------------------------------------- Proposer
    def _score(self, source: str, rel: str) -> float:
        """The policy's preference for asking about `rel` on page `source`."""
        return (self.w_source.get(source, 0.0) + self.w_fact.get(f"{source}|{rel}", 0.0)
                + self.w_relation.get(rel, 0.0))

    def propose(self, n: int, tool: SearchTool, seed: int) -> list[Proposal]:
        if n > 0 and not self.sources:  # else a bare "empty range for randrange()" from the first draw
            raise ValueError(f"{self.name}: no source documents to propose from")
        rnd = random.Random(seed)
        out: list[Proposal] = []
        hop_values = list(range(1, len(self.config.hop_ratio) + 1))
        attempts = 0
        hops = None
        while len(out) < n and attempts < 20 * n:
            attempts += 1
            # a failed attempt keeps its hop count, so the produced questions follow the ratio
            hops = hops or rnd.choices(hop_values, weights=self.config.hop_ratio)[0]
            docs = {}
            options = []
            for _ in range(self.config.options):
                doc = self.sources[rnd.randrange(len(self.sources))]
                docs[doc.id] = doc
                options += [(doc.id, rel) for rel in self._usable(self.reader.read(doc), hops == 1)]
            if not options:
                continue
            first = self._choose(options, rnd)
            doc, rel = docs[options[first.chosen][0]], options[first.chosen][1]
            try:
                composed = self._compose(doc, rel, hops, tool.session(), rnd)
            except SearchBudgetExhausted:
                composed = None
            if composed is None:
                continue
            rels, label, pages, later = composed
            question = render_chain(ChainQuery(doc.title, rels), variant=rnd.randrange(3))
            # format rules (Dr. Zero): a non-empty short answer that the question does not give away (as
            # whole words: the language-model backend's rule, `protocol.check_proposal`)
            if not normalize_answer(label) or mentions(question, label):
                continue
            out.append(Proposal(question, label, doc.id, pages, len(rels), [first, *later]))
            hops = None
        return out

    def update(self, proposals: Sequence[Proposal], rewards: Sequence[float]) -> dict:
        """REINFORCE over every choice a proposal made (the source fact, then the fact followed
        at each later page), advantages normalised within the hop bucket."""
        if self.frozen:
            raise RuntimeError(f"{self.name} is a frozen snapshot")
        advs = bucket_advantages(list(rewards), [p.hops for p in proposals])
        for prop, adv in zip(proposals, advs):
            if adv == 0.0:
                continue
            for ch in prop.trace:
                for j, ((page, rel), p) in enumerate(zip(ch.options, ch.probs)):
                    g = self.config.lr * adv * ((1.0 if j == ch.chosen else 0.0) - p)
                    self.w_source[page] = self.w_source.get(page, 0.0) + g
                    key = f"{page}|{rel}"
                    self.w_fact[key] = self.w_fact.get(key, 0.0) + g
                    # a relation is shared by every page: its weight moves by the batch's mean gradient,
                    # a page's and a fact's by the sum (each is chosen by a few proposals of a batch)
                    self.w_relation[rel] = self.w_relation.get(rel, 0.0) + g / len(proposals)
        self.updates += 1
        return {"proposals": len(proposals), "reward": float_sum(rewards) / max(1, len(rewards))}
