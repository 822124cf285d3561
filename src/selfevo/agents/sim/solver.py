"""The sim solver: search, read, and score candidate answers with a learned model.

logit(c) = theta . features(c)      generic reading skill (learned)
         + bias(page, c)            the reader's systematic misreadings (fixed)
         + memory[key][c]           parametric memory keyed on what the question says (learned,
                                      optionally bounded by memory_cap): key = (mention, rel) of
                                      the hop, or with memory_key="question" (first mention,
                                      relations so far)

Multi-hop questions are answered by chaining hops, the answer of one hop being the mention of
the next. Training is policy gradient on its own sampled rollouts, rewarded against the label it
is given (GRPO-normalised within the five rollouts of a question). With the default entity keys,
what the memory absorbs from one question (right or wrong) is repeated on every other question
that passes through the same (entity, relation); with question keys, only on questions that start
from the same mention with the same relations.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from selfevo.agents.base import Trajectory
from selfevo.agents.sim.reader import FEATURES, Reader, check_magnitude, features
from selfevo.algos import float_sum, group_advantages, sample_index, softmax
from selfevo.evaluate import answers_match
from selfevo.records import Document
from selfevo.search.tool import Hit, SearchBudgetExhausted, SearchSession, SearchTool
from selfevo.world.language import ChainQuery, CompareQuery, parse_question


@dataclass(frozen=True)
class SimSolverConfig:
    # initial reading weights (see FEATURES): trusts who a sentence is about, but has not yet
    # learned to prefer the page whose title is the mention (training teaches it that)
    theta0: tuple[float, ...] = (2.5, 0.0, 0.3, 0.2)
    misread_scale: float = 1.5  # std of the reader's page-specific bias
    memory: bool = True  # ablation switch: no parametric memory at all
    lr_memory: float = 4.0
    # bound on a memory logit (0 = unbounded): a bounded memory never becomes certain of a
    # pseudo-label, so agreement with a learned wrong label stays partial (k < 5) and keeps paying
    # the coupled proposer instead of saturating at k = 5, where the frontier reward is 0
    memory_cap: float = 0.0
    # what a memory row is keyed on: "entity" = (mention, relation) of every hop, so a fact learned
    # through one question is reused by any question whose chain passes the same entity;
    # "question" = (the question's first mention, its relations up to this hop), so it is reused
    # only by questions that start from the same entity (fine-tuned facts in language models
    # transfer to paraphrases but rarely ripple into other multi-hop questions)
    memory_key: str = "entity"
    lr_theta: float = 0.05
    temperature: float = 1.0  # sampling temperature for non-greedy rollouts

    def __post_init__(self):
        if len(self.theta0) != len(FEATURES):
            raise ValueError(f"solver.theta0: expected {len(FEATURES)} weights")
        # `not x > 0`, not `x <= 0`: a NaN (the Python API; a config file's NaN is refused when read) passes
        # the latter, and made NaN probabilities (a crash mid-run) or NaN memory written into a checkpoint
        if not self.temperature > 0:
            raise ValueError(f"solver.temperature: must be > 0, got {self.temperature}")
        if self.misread_scale < 0:
            raise ValueError(f"solver.misread_scale: must be >= 0, got {self.misread_scale}")
        if self.memory_key not in ("entity", "question"):
            raise ValueError(f"solver.memory_key: 'entity' or 'question', got {self.memory_key!r}")
        for name in ("lr_memory", "lr_theta"):
            if not getattr(self, name) >= 0:  # 0 freezes that part; below 0 learns away from reward
                raise ValueError(f"solver.{name}: must be >= 0, got {getattr(self, name)}")
        if not self.memory_cap >= 0:
            raise ValueError(f"solver.memory_cap: must be >= 0 (0 = unbounded), got {self.memory_cap}")
        check_magnitude("solver.theta0", *self.theta0)
        for name in ("misread_scale", "lr_memory", "lr_theta"):
            check_magnitude(f"solver.{name}", getattr(self, name))


@dataclass
class _Dist:
    """The solver's distribution over candidate answers for one (mention, relation) hop."""

    mkey: str
    cands: list[str]
    phis: list[tuple[float, ...]]
    probs: list[float]


def _weights(values) -> list[float]:
    """The reading weights, one per feature, checked where they come in: the reader's dot product (a hot
    path) zips them with the features, so a short list would read as zeros on the features it lacks."""
    theta = [float(x) for x in values]
    if len(theta) != len(FEATURES):
        raise ValueError(f"theta: expected {len(FEATURES)} weights, got {len(theta)}")
    return theta


@dataclass
class SimSolver:
    name: str
    config: SimSolverConfig
    reader: Reader
    theta: list[float] = field(default_factory=list)
    memory: dict[str, dict[str, float]] = field(default_factory=dict)
    frozen: bool = False
    updates: int = 0
    lineage: dict = field(default_factory=dict)  # which folds/rounds its training data came from

    def __post_init__(self):
        self.theta = _weights(self.theta or self.config.theta0)
        self._cache: dict[tuple[str, str, tuple[Document, ...]], _Dist | None] = {}
        self._parsed: dict[str, ChainQuery | CompareQuery | None] = {}

    # ---------------------------------------------------------------- Learner
    def snapshot(self, name: str | None = None) -> SimSolver:
        twin = SimSolver(name or self.name, self.config, self.reader, list(self.theta),
                         copy.deepcopy(self.memory), frozen=True, updates=self.updates,
                         lineage=copy.deepcopy(self.lineage))
        return twin

    def state_dict(self) -> dict:
        return {"name": self.name, "config": asdict(self.config), "theta": self.theta,
                "memory": self.memory, "updates": self.updates, "lineage": self.lineage}

    def load_state_dict(self, state: dict) -> None:
        self.theta = _weights(state["theta"])
        self.memory = {k: {c: float(v) for c, v in d.items()} for k, d in state["memory"].items()}
        self.updates = int(state["updates"])
        # a copy: the loop records training into lineage in place, which must not reach the state's owner
        self.lineage = copy.deepcopy(state.get("lineage", {}))
        self._cache.clear()

    # ---------------------------------------------------------------- reading
    def _dist(self, session: SearchSession, mention: str, rel: str, mkey: str,
              context: Document | None = None) -> _Dist | None:
        # a document given in context is read instead of searching; otherwise every hop costs
        # one budgeted search
        hits = [Hit(context, 0.0)] if context is not None else session.search(mention)
        # mkey names the relation; the pages themselves, not a context id: another tool (topk, index)
        # or world hands this solver other pages for the same mention
        key = (mention, mkey, tuple([h.document for h in hits]))
        if key in self._cache:
            return self._cache[key]
        best: dict[str, tuple[float, tuple[float, ...]]] = {}
        for rank, hit in enumerate(hits):
            page = self.reader.read(hit.document)
            title_match = mention in page.aliases
            for stmt in page.statements.get(rel, ()):
                phi = features(stmt, title_match, rank)
                score = self.reader.score(self.theta, phi, page.doc_id, stmt.object)
                if stmt.object not in best or score > best[stmt.object][0]:
                    best[stmt.object] = (score, phi)
        zero = (0.0,) * len(FEATURES)
        memory = self.memory.get(mkey, {}) if self.config.memory else {}
        for cand in memory:  # memory can recall an answer the pages did not show
            best.setdefault(cand, (0.0, zero))
        if not best:
            self._cache[key] = None
            return None
        cands = sorted(best)  # sorted: results must not depend on hash or page order
        logits = [best[c][0] + memory.get(c, 0.0) for c in cands]
        dist = _Dist(mkey, cands, [best[c][1] for c in cands], softmax(logits, self.config.temperature))
        self._cache[key] = dist
        return dist

    def _mkey(self, first: str, mention: str, rels: Sequence[str]) -> str:
        """The memory row of a hop that asks rels[-1] of `mention`, in a question whose first
        mention is `first` and whose relations so far are `rels`."""
        if self.config.memory_key == "question":
            return f"{first.strip().lower()}|{'/'.join(rels)}"
        return f"{mention.strip().lower()}|{rels[-1]}"

    @staticmethod
    def _pick(dist: _Dist, greedy: bool, rnd: random.Random) -> int:
        if greedy:
            return max(range(len(dist.cands)), key=lambda i: (dist.probs[i], -i))
        return sample_index(dist.probs, rnd.random())

    def _rollout(self, question: str, tool: SearchTool, greedy: bool, rnd: random.Random,
                 context: Document | None = None) -> Trajectory:
        if question not in self._parsed:
            self._parsed[question] = parse_question(question)
        query = self._parsed[question]
        session = tool.session()
        trace: list[tuple[_Dist, int]] = []
        try:
            if isinstance(query, ChainQuery):
                mention = query.mention
                for hop, rel in enumerate(query.relations):
                    mkey = self._mkey(query.mention, mention, query.relations[:hop + 1])
                    dist = self._dist(session, mention, rel, mkey, context if hop == 0 else None)
                    if dist is None:
                        return Trajectory("", session.queries, len(session.queries) + 1, trace)
                    i = self._pick(dist, greedy, rnd)
                    trace.append((dist, i))
                    mention = dist.cands[i]
                return Trajectory(mention, session.queries, len(session.queries) + 1, trace)
            if isinstance(query, CompareQuery):
                years = []
                for m in query.mentions:
                    dist = self._dist(session, m, query.relation, self._mkey(m, m, (query.relation,)))
                    if dist is None:
                        return Trajectory("", session.queries, len(session.queries) + 1, trace)
                    i = self._pick(dist, greedy, rnd)
                    trace.append((dist, i))
                    years.append(int(dist.cands[i]) if dist.cands[i].isdigit() else 10**6)
                answer = query.mentions[0] if years[0] <= years[1] else query.mentions[1]
                return Trajectory(answer, session.queries, len(session.queries) + 1, trace)
            # not a question of the world's language: fall back to the top page's title
            hits = session.search(question)
            return Trajectory(hits[0].document.title if hits else "", session.queries, 2, trace)
        except SearchBudgetExhausted:
            return Trajectory("", session.queries, len(session.queries), trace)

    # ---------------------------------------------------------------- Solver
    def answer(self, questions: Sequence[str], tool: SearchTool, *, greedy: bool = True,
               n: int = 1, seed: int | None = None,
               contexts: Sequence[Document] | None = None) -> list[list[Trajectory]]:
        rnd = random.Random(seed)
        contexts = contexts if contexts is not None else [None] * len(questions)
        return [[self._rollout(q, tool, greedy, rnd, c) for _ in range(n)]
                for q, c in zip(questions, contexts, strict=True)]

    def update(self, groups: Sequence[tuple[list[Trajectory], str]]) -> dict:
        """Policy gradient on the solver's own rollouts, reward = answer matches the label.

        d log p(c_t) / d (logits / temperature) = onehot(c_t) - p_t for every hop t of a rollout
        (the gradient through the tempered logits: at a temperature T other than 1 each step is T
        times the raw logits' gradient); the memory entry of the hop's (mention, relation) and the
        reading weights both move along it. paper: sequence-normalised (divided by the number of
        hops), GRPO advantage within the group.
        """
        if self.frozen:
            raise RuntimeError(f"{self.name} is a frozen snapshot")
        grad_theta = [0.0] * len(self.theta)
        signal = 0
        rewards_all = []
        for trajs, label in groups:
            rewards = [1.0 if answers_match(t.answer, label) else 0.0 for t in trajs]
            rewards_all.extend(rewards)
            advs = group_advantages(rewards)
            if not any(advs):
                continue
            signal += 1
            for traj, adv in zip(trajs, advs):
                if adv == 0.0 or not traj.trace:
                    continue
                w = adv / (len(traj.trace) * len(trajs))
                for dist, idx in traj.trace:
                    for j, (cand, p) in enumerate(zip(dist.cands, dist.probs)):
                        g = (1.0 if j == idx else 0.0) - p
                        if self.config.memory:
                            row = self.memory.setdefault(dist.mkey, {})
                            v = row.get(cand, 0.0) + self.config.lr_memory * w * g
                            cap = self.config.memory_cap
                            row[cand] = min(cap, max(-cap, v)) if cap else v
                        for f, phi in enumerate(dist.phis[j]):
                            grad_theta[f] += w * g * phi
        if groups:
            self.theta = [t + self.config.lr_theta * g / len(groups) for t, g in zip(self.theta, grad_theta)]
        self.updates += 1
        self._cache.clear()
        return {"groups": len(groups), "groups_with_signal": signal,
                "reward": float_sum(rewards_all) / max(1, len(rewards_all))}
