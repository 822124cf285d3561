"""The figures docs/reliability.md's "Known and left alone" cites about the worlds and the corpus.

    python benchmarks/known_items.py [--corpus ../shared/data/corpus/wiki18-mini.jsonl] [--seeds 2]
                                     [--out docs/reliability.md]

- Repeated benchmark questions: a world's benchmarks ask some facts twice (the same entity and
  relations, in another wording or through another alias), within a benchmark and across them. Keyed
  by what a question asks (`parse_question`, its mention resolved to an entity): a chain's entity and
  relations, a comparison's pair and relation. Also the one-hop facts the small world's popular
  entities hold, the pool nq draws from.
- The corpus's link graph (`loop.folds.link_graph`): its edges, best-linked pages and time, and
  the Louvain clustering `crossfit-connected` and the replay's `connected` condition run once per seed.
- `index build`'s second hash of the corpus: one sha256 pass over the file, against the whole build.

Writes the "## Measured for the known items" section of docs/reliability.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

from _common import REPO, machine_line, write_section

from selfevo._io import file_sha256
from selfevo.corpus import read_corpus
from selfevo.loop.folds import connected_groups, link_graph
from selfevo.search.index import build_index
from selfevo.world import resolve_world
from selfevo.world.language import ChainQuery, parse_question

HEADING = "## Measured for the known items"


def question_key(truth, question: str) -> tuple | None:
    """What a world question asks, whatever its wording: (entity id, relations) of a chain, (the pair's
    entity ids, relation) of a comparison; None for a question the world's language does not parse."""
    q = parse_question(question)
    if q is None:
        return None
    if isinstance(q, ChainQuery):
        e = truth.resolve(q.mention)
        return None if e is None else ("chain", e.id, q.relations)
    ids = [truth.resolve(m) for m in q.mentions]
    return None if None in ids else ("compare", frozenset(e.id for e in ids), q.relation)


def repeats(world_name: str) -> dict:
    """Questions per benchmark that ask what an earlier question of the same benchmark asked, and the
    questions whose fact another benchmark also asks."""
    world = resolve_world(world_name)
    keys = {b: [question_key(world.truth, it.question) for it in items] for b, items in world.benchmarks.items()}
    within = {b: len(k) - len(set(k)) for b, k in keys.items()}
    benches_of = Counter(key for k in keys.values() for key in set(k))
    across = sum(1 for k in keys.values() for key in k if benches_of[key] > 1)
    ents = sorted(world.truth.entities.values(), key=lambda e: -e.popularity)
    popular = ents[: len(ents) // 5]  # the pool generate._benchmarks gives nq
    return {"world": world_name, "sizes": {b: len(v) for b, v in keys.items()}, "within": within,
            "across": across, "unparsed": sum(key is None for k in keys.values() for key in k),
            "popular_one_hop": sum(len(e.facts) for e in popular)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=REPO.parent / "shared" / "data" / "corpus" / "wiki18-mini.jsonl")
    ap.add_argument("--seeds", type=int, default=2, help="clustering seeds timed")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "reliability.md")
    args = ap.parse_args()

    worlds = [repeats(w) for w in ("default", "small")]
    for w in worlds:
        print(w)

    docs = read_corpus(args.corpus)
    t = time.perf_counter()
    links = link_graph(docs)
    graph_s = time.perf_counter() - t
    degree = Counter(x for edge in links for x in edge)
    title = {d.id: d.title for d in docs}
    hubs = ", ".join(f"{title[i]} {n:,}" for i, n in degree.most_common(5))
    cluster_s = []
    for seed in range(args.seeds):
        t = time.perf_counter()
        connected_groups(docs, seed, links)
        cluster_s.append(time.perf_counter() - t)
    print(f"links {len(links)} in {graph_s:.1f} s; hubs {hubs}; clustering {cluster_s}")

    t = time.perf_counter()
    file_sha256(args.corpus)
    digest_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        build_index("bm25", args.corpus, Path(tmp) / "idx")
        build_s = time.perf_counter() - t
    size_mb = args.corpus.stat().st_size / 1e6
    print(f"sha256 {digest_s:.2f} s; build {build_s:.2f} s")

    lines = [HEADING, "",
             f"Command: `python benchmarks/known_items.py --seeds {args.seeds}`  ",
             f"Machine: {machine_line()}  ",
             f"Worlds: `default` and `small`, world seed 0; corpus: {args.corpus.name} ({len(docs):,} passages, "
             f"{size_mb:.0f} MB).", "",
             "Repeated benchmark questions (keyed by what a question asks: a chain's entity and relations, a "
             "comparison's pair and relation, whatever the wording or alias):", "",
             "| world | " + " | ".join(worlds[0]["sizes"]) + " | asked by another benchmark too | "
             "one-hop facts of the popular fifth |",
             "|---|" + "---:|" * (len(worlds[0]["sizes"]) + 2)]
    for w in worlds:
        cells = [f"{w['within'][b]} of {n}" for b, n in w["sizes"].items()]
        lines.append(f"| {w['world']} | " + " | ".join(cells) + f" | {w['across']} | {w['popular_one_hop']} |")
    lines += ["", "A cell counts a benchmark's questions that ask what an earlier question of it asked; nq draws "
              "its 200 one-hop questions from the popular fifth's facts (last column)."
              + (f" Questions not parsed: {sum(w['unparsed'] for w in worlds)}." if any(w["unparsed"] for w in worlds)
                 else ""), "",
              f"Link graph of the corpus (`loop.folds.link_graph`): {len(links):,} edges in {graph_s:.1f} s; the "
              f"best-linked pages: {hubs}. Louvain clustering of it (`connected_groups`), per seed: "
              + ", ".join(f"{s:.1f} s" for s in cluster_s) + ".", "",
              f"`index build`'s second read of the corpus: one sha256 pass over the file {digest_s:.2f} s, the whole "
              f"BM25 build {build_s:.2f} s.", ""]
    write_section(args.out, HEADING, "\n".join(lines), title="# Reliability")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
