"""Permanent source-level fold assignment (CrossFit's unit of cross-fitting is the source).

Plain CrossFit hashes each source document into a fold. A question composed through several pages
can still reach a grader that trained on pseudo-labels from one of those pages (the paper's open
problem). The `connected` grouping first clusters the link graph (pages that mention each other's
titles) and assigns whole clusters to folds, so multi-hop questions mostly stay inside one fold.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from selfevo.loop.schedule import derive_seed
from selfevo.records import Document


def fold_of(source_id: str, seed: int, k: int = 2) -> int:
    """Stable fold of a source document: a hash of (seed, source id), never of the question."""
    if k < 2:
        raise ValueError(f"folds: k must be >= 2, got {k}")
    return derive_seed(seed, source_id) % k


def question_fold(question: str, seed: int, k: int = 2) -> int:
    """Fold of a question under the question-level split control: a hash of its text (lowercased,
    whitespace collapsed), so a question asked again lands in the fold it landed in before. The
    control splits questions, not proposals; paraphrases and other questions from the same source
    still fall on both sides, which is the leak the control exists to show."""
    return fold_of("question\x1f" + " ".join(question.lower().split()), seed, k)


@dataclass
class FoldAssignment:
    k: int
    seed: int
    grouping: str  # "source" | "connected"
    folds: dict[str, int] = field(default_factory=dict)  # source id -> fold
    groups: dict[str, str] = field(default_factory=dict)  # source id -> cluster id (connected)

    def of(self, source_id: str) -> int:
        fold = self.folds.get(source_id)
        return fold if fold is not None else fold_of(source_id, self.seed, self.k)

    def lineage(self, source_ids: Iterable[str]) -> set[int]:
        """Every fold a question touched (the folds of all pages read while composing it)."""
        return {self.of(s) for s in source_ids}

    def to_json(self) -> dict:
        # copies: a caller editing what it got would change the assignment
        return {"k": self.k, "seed": self.seed, "grouping": self.grouping, "folds": dict(self.folds),
                "groups": dict(self.groups)}

    @classmethod
    def from_json(cls, obj: dict) -> FoldAssignment:
        """Read back `to_json`; a value no assignment writes is a ValueError naming the field (a fold
        outside 0..k-1 ran on silently: graded by some aux solver, trained none)."""
        missing = [f for f in ("k", "seed", "grouping", "folds", "groups") if f not in obj]
        if missing:
            raise ValueError(f"field '{missing[0]}': missing")
        k, grouping, seed = obj["k"], obj["grouping"], obj["seed"]
        if not isinstance(seed, int) or isinstance(seed, bool):  # "7" or 7.9 was read as 7
            raise ValueError(f"field 'seed': must be an integer, got {seed!r}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 2:
            raise ValueError(f"field 'k': must be an integer >= 2, got {k!r}")
        if grouping not in ("source", "connected"):
            raise ValueError(f"field 'grouping': must be source or connected, got {grouping!r}")
        for sid, fold in obj["folds"].items():
            if not isinstance(fold, int) or isinstance(fold, bool) or not 0 <= fold < k:
                raise ValueError(f"field 'folds.{sid}': must be a fold 0..{k - 1}, got {fold!r}")
        return cls(k, seed, grouping, dict(obj["folds"]), dict(obj["groups"]))


_WORD = re.compile(r"[\w'-]+")


def link_graph(docs: Sequence[Document], max_title_words: int = 6) -> list[tuple[str, str]]:
    """Edges (a, b) where page a's text mentions page b's title (word n-gram lookup, so it is
    linear in the corpus size rather than pages × titles). A title several pages share names the one
    with the least id, so the graph does not depend on the order the corpus lists its pages in."""
    by_title: dict[tuple[str, ...], str] = {}
    for d in sorted(docs, key=lambda d: d.id):
        key = tuple(_WORD.findall(d.title))
        if key and len(key) <= max_title_words:
            by_title.setdefault(key, d.id)
    edges = set()
    for d in docs:
        words = _WORD.findall(d.text)
        for i in range(len(words)):
            for n in range(1, max_title_words + 1):
                target = by_title.get(tuple(words[i:i + n]))
                if target is not None and target != d.id:
                    edges.add((d.id, target) if d.id < target else (target, d.id))
    return sorted(edges)


def louvain(nodes: Sequence[str], edges: Iterable[tuple[str, str]], seed: int) -> list[list[str]]:
    """Louvain communities (Blondel et al. 2008, modularity at resolution 1) of an unweighted graph:
    each community's nodes in id order, the communities in the order of their least id. Every level
    moves each node, in an order a hash of (seed, level, its least original id) sets, to the
    neighbouring community of the greatest modularity gain while some move gains, then merges each
    community into one node; it stops at a level where no node moves.

    The gains are compared as exact integers: the gain of moving node i into community C, times 2m²
    (m edges), is 2m·k_iC − Σ_C·k_i (k_iC: i's edge weight into C, Σ_C: C's total degree, k_i: i's
    degree), so the clusters depend on the graph and the seed alone, not on a library's floating-point
    arithmetic: networkx's Louvain, used before, gave other clusters under networkx 3.7 (which pip installs
    on Python 3.12 and later) than under 3.6, for every world and seed tried.
    A tie keeps the node where it is, or goes to the community of least index."""
    nodes = sorted(set(nodes))
    index = {v: i for i, v in enumerate(nodes)}
    members = [[v] for v in nodes]  # original nodes of each node of the current level
    adj: list[dict[int, int]] = [{} for _ in nodes]  # node -> {neighbour: edge weight}, no self loops
    for a, b in edges:
        i, j = index[a], index[b]
        if i != j:  # a simple graph: an edge given twice is one edge
            adj[i][j] = adj[j][i] = 1
    degree = [sum(a.values()) for a in adj]  # a merged node's includes its inner edges (twice)
    two_m = sum(degree)
    level = 0
    while two_m:
        community = list(range(len(adj)))
        total = degree[:]  # Σ_C: the degree of every node in community C
        order = sorted(range(len(adj)), key=lambda i: derive_seed(seed, "louvain", level, members[i][0]))
        moved, improved = False, True
        while improved:
            improved = False
            for i in order:
                own, k = community[i], degree[i]
                into: dict[int, int] = {}
                for j, w in adj[i].items():
                    into[community[j]] = into.get(community[j], 0) + w
                total[own] -= k
                best, best_gain = own, two_m * into.get(own, 0) - total[own] * k
                for c in sorted(into):
                    gain = two_m * into[c] - total[c] * k
                    if gain > best_gain:
                        best, best_gain = c, gain
                total[best] += k
                if best != own:
                    community[i] = best
                    improved = moved = True
        if not moved:
            break
        # merge: one node per community, numbered by its least original id
        least: dict[int, str] = {}
        for i, c in enumerate(community):
            least[c] = min(least.get(c, members[i][0]), members[i][0])
        kept = sorted(least, key=least.get)
        renumber = {c: n for n, c in enumerate(kept)}
        merged_members: list[list[str]] = [[] for _ in kept]
        merged_adj: list[dict[int, int]] = [{} for _ in kept]
        merged_degree = [0] * len(kept)
        for i in range(len(adj)):
            c = renumber[community[i]]
            merged_members[c].extend(members[i])
            merged_degree[c] += degree[i]
            for j, w in adj[i].items():
                d = renumber[community[j]]
                if d != c:
                    merged_adj[c][d] = merged_adj[c].get(d, 0) + w
        members = [sorted(m) for m in merged_members]
        adj, degree = merged_adj, merged_degree
        level += 1
    return sorted(members, key=lambda m: m[0])


def connected_groups(docs: Sequence[Document], seed: int,
                     links: Sequence[tuple[str, str]] | None = None) -> dict[str, str]:
    """Clusters of the link graph (`louvain`, seeded by the run's seed): source id -> cluster id, the
    cluster's least source id. `links`: `link_graph(docs)` computed before (it does not depend on the
    seed; over a corpus it is the expensive part)."""
    communities = louvain([d.id for d in docs], link_graph(docs) if links is None else links, seed)
    return {m: members[0] for members in communities for m in members}


def assign_folds(docs: Sequence[Document], seed: int, k: int = 2, grouping: str = "source",
                 links: Sequence[tuple[str, str]] | None = None) -> FoldAssignment:
    """`source`: each document hashed to a fold. `connected`: link-graph clusters assigned whole,
    largest first, to the fold with the fewest documents so far (balanced, deterministic)."""
    if k < 2:
        raise ValueError(f"folds: k must be >= 2, got {k}")
    if grouping == "source":
        return FoldAssignment(k, seed, grouping, {d.id: fold_of(d.id, seed, k) for d in docs})
    if grouping != "connected":
        raise ValueError(f"folds: unknown grouping {grouping!r} (source | connected)")
    groups = connected_groups(docs, seed, links)
    members: dict[str, list[str]] = {}
    for sid, cid in groups.items():
        members.setdefault(cid, []).append(sid)
    order = sorted(members, key=lambda c: (-len(members[c]), fold_of(c, seed, 2**31 - 1)))
    load = [0] * k
    folds = {}
    for cid in order:
        f = min(range(k), key=lambda j: (load[j], j))
        for sid in members[cid]:
            folds[sid] = f
        load[f] += len(members[cid])
    return FoldAssignment(k, seed, grouping, folds, groups)
