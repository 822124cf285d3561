"""Generate a seeded synthetic encyclopedia with exact truth, its corpus and its benchmarks.

Everything is drawn from one numpy Generator, so (size, seed, parameters) fixes the world byte
for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from selfevo.records import Document, QAItem
from selfevo.world.language import (
    COMPARE_TEMPLATES,
    FACT_TEMPLATES,
    POSSESSIVES,
    PRONOUNS,
    RELATED_NOUNS,
    ChainQuery,
    CompareQuery,
    render_chain,
    render_compare,
)
from selfevo.world.truth import Entity, Truth

SIZES = {  # entities per type
    "small": {"country": 8, "city": 50, "org": 60, "person": 220, "work": 60},
    "default": {"country": 30, "city": 300, "org": 450, "person": 1700, "work": 520},
}
BENCHMARK_SIZES = {"nq": 200, "triviaqa": 200, "popqa": 200, "hotpotqa": 200,
                   "2wikimultihopqa": 200, "musique": 200, "bamboogle": 125}


@dataclass(frozen=True)
class WorldConfig:
    size: str = "default"
    seed: int = 0
    # chance that a fact's page also states the same relation for a related entity (one of the
    # subject's type, at random); none is written when that entity lacks the relation or has the same
    # value, so fewer facts carry one: 54% at 0.6 and 89% at 1.0 (default world, seed 0)
    confusable_rate: float = 0.6
    # correlation of the proposer's and the solver's page-specific misreadings (the paper's
    # "shared pretraining errors" confound); low by default so the memory ablation isolates reuse
    shared_misreading: float = 0.1
    # how strongly a fact's value follows entity popularity: values are drawn with weight
    # popularity ** value_skew (1 = as popular entities are, Zipf 1.1, the most popular city is a
    # fifth of all birthplaces; 0 = uniform). Two independent errors agree on a popular value by
    # chance, so this sets part of the level at which an untrained grader agrees with wrong labels
    value_skew: float = 1.0

    def __post_init__(self):
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"world.seed: must be an integer >= 0, got {self.seed!r}")
        if self.size not in SIZES:
            raise ValueError(f"world.size: expected one of {sorted(SIZES)}, got {self.size!r}")
        if not 0.0 <= self.confusable_rate <= 1.0:
            raise ValueError(f"world.confusable_rate: must be in [0, 1], got {self.confusable_rate}")
        if not 0.0 <= self.shared_misreading <= 1.0:
            raise ValueError(f"world.shared_misreading: must be in [0, 1], got {self.shared_misreading}")
        if not 0.0 <= self.value_skew <= 4.0:
            raise ValueError(f"world.value_skew: must be in [0, 4], got {self.value_skew}")


_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr",
           "kr", "tr", "st", "th", "sh", "ch", "h", "j", "w", "y", "c"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ia", "ou", "ei", "y"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "m", "x", "nd", "rk", "st"]
_ORG_KINDS = ["Industries", "Institute", "Guild", "Company", "Bank", "Press", "Foundry", "Society"]
_WORK_NOUNS = ["Song", "Tale", "Book", "Chronicle", "Ballad", "Map", "Garden", "House", "River",
               "Lantern", "Mirror", "Winter", "Harvest", "Tower", "Voyage", "Letters"]
_EPITHETS = ["the Elder", "the Younger", "the Bold", "the Wise", "the Quiet", "the Red", "the Just"]
_TYPE_NOUNS = {"person": "a person", "city": "a city", "country": "a country",
               "org": "an organisation", "work": "a written work"}


class _Names:
    def __init__(self, rng: np.random.Generator):
        self.rng, self.used = rng, set()

    def word(self, syllables: int) -> str:
        r = self.rng
        while True:  # an English article as a name would break the question grammar
            w = self._draw(r, syllables)
            if w.lower() not in ("the", "a", "an", "of"):
                return w

    @staticmethod
    def _draw(r: np.random.Generator, syllables: int) -> str:
        w = "".join(_ONSETS[r.integers(len(_ONSETS))] + _VOWELS[r.integers(len(_VOWELS))]
                    for _ in range(syllables)) + _CODAS[r.integers(len(_CODAS))]
        return w.capitalize()

    def unique(self, make) -> str:
        for _ in range(1000):
            name = make()
            if name not in self.used and name.lower() not in {"the", "a", "an"}:
                self.used.add(name)
                return name
        raise RuntimeError("name space exhausted")


def _zipf(rng: np.random.Generator, n: int, a: float = 1.1) -> np.ndarray:
    """Zipf-like popularity over n entities in random order, normalised to sum 1."""
    w = 1.0 / np.arange(1, n + 1) ** a
    return rng.permutation(w / w.sum())


def _make_entities(cfg: WorldConfig, rng: np.random.Generator) -> list[Entity]:
    sizes, names = SIZES[cfg.size], _Names(rng)
    ents: dict[str, list[Entity]] = {}

    def add(type_: str, make_name, make_aliases=lambda n: []):
        pop = _zipf(rng, sizes[type_])
        out = []
        for i in range(sizes[type_]):
            name = names.unique(make_name)
            aliases = [name]
            for a in make_aliases(name):  # an alias that would collide with a name is dropped
                if a not in names.used:
                    names.used.add(a)
                    aliases.append(a)
            out.append(Entity(f"{type_}-{i:04d}", type_, name, aliases, float(pop[i])))
        ents[type_] = out

    add("country", lambda: names.word(int(rng.integers(2, 4))) + ["ia", "land", "or", ""][rng.integers(4)])
    add("city", lambda: (["", "", "", "Port ", "New ", "Fort "][rng.integers(6)] + names.word(int(rng.integers(2, 4)))))
    surnames = [names.word(2) for _ in range(max(1, sizes["person"] // 3))]
    add("person", lambda: f"{names.word(int(rng.integers(1, 3)))} {surnames[rng.integers(len(surnames))]}",
        lambda n: [f"{n.split()[0]} {_EPITHETS[rng.integers(len(_EPITHETS))]}"] if rng.random() < 0.4 else [])
    add("org", lambda: f"{names.word(2)} {_ORG_KINDS[rng.integers(len(_ORG_KINDS))]}")
    add("work", lambda: f"The {_WORK_NOUNS[rng.integers(len(_WORK_NOUNS))]} of {names.word(2)}",
        lambda n: [n[len('The '):]])

    weights: dict[str, np.ndarray] = {}

    def pick(type_: str) -> Entity:
        pool = ents[type_]
        if type_ not in weights:
            p = np.array([e.popularity for e in pool]) ** cfg.value_skew
            weights[type_] = p / p.sum()
        return pool[rng.choice(len(pool), p=weights[type_])]

    for city in ents["city"]:
        city.facts["located_in"] = pick("country").id
    for country in ents["country"]:
        cities = [c for c in ents["city"] if c.facts["located_in"] == country.id]
        if cities:
            country.facts["capital"] = max(cities, key=lambda c: c.popularity).id
    persons = ents["person"]
    for p in persons:
        p.facts["born_in"] = pick("city").id
        p.facts["birth_year"] = str(int(rng.integers(1780, 1990)))
        if rng.random() < 0.85:
            p.facts["employer"] = pick("org").id
    order = rng.permutation(len(persons))
    for a, b in zip(order[0::2], order[1::2]):
        if rng.random() < 0.6:
            persons[a].facts["spouse"], persons[b].facts["spouse"] = persons[b].id, persons[a].id
    for o in ents["org"]:
        o.facts["headquarters"] = pick("city").id
        o.facts["founder"] = pick("person").id
        o.facts["founded_year"] = str(int(rng.integers(1700, 2000)))
    for w in ents["work"]:
        w.facts["author"] = pick("person").id
        w.facts["published_year"] = str(int(rng.integers(1750, 2020)))
    return [e for t in ("country", "city", "org", "person", "work") for e in ents[t]]


def _page(e: Entity, truth: Truth, cfg: WorldConfig, rng: np.random.Generator,
          same_type: list[Entity], index: int) -> Document:
    """One page per entity: its facts in varied templates, links to the entities they name, and
    confusable sentences (a related entity's fact of the same relation). `same_type[index]` is e."""
    pronoun = PRONOUNS[int(rng.integers(2))] if e.type == "person" else "It"
    possessive = dict(zip(PRONOUNS, POSSESSIVES))[pronoun]
    sentences = [f"{e.name} is {_TYPE_NOUNS[e.type]}."]
    if len(e.aliases) > 1:
        sentences.append(f"{e.name} is also known as {' and '.join(e.aliases[1:])}.")
    body = []
    # The related entity of a confusable sentence is drawn at random, not from the subject's
    # family: a same-surname relative's own page would also rank for the subject's name and hand
    # every reader the same wrong value, making misreadings shared by construction.
    n_relatives = len(same_type) - 1  # every entity of e's type but e (not listed: that is quadratic)
    for rel, value in e.facts.items():
        obj = truth.entities[value].name if value in truth.entities else value
        subj = pronoun if rng.random() < 0.5 else e.name
        tmpl = FACT_TEMPLATES[rel][rng.integers(len(FACT_TEMPLATES[rel]))]
        body.append(tmpl.format(s=subj, o=obj))
        if rng.random() < cfg.confusable_rate and n_relatives:
            j = int(rng.integers(n_relatives))
            other = same_type[j + (j >= index)]
            ov = other.facts.get(rel)
            if ov is not None and ov != value:
                oobj = truth.entities[ov].name if ov in truth.entities else ov
                noun = RELATED_NOUNS[e.type][rng.integers(len(RELATED_NOUNS[e.type]))]
                tmpl = FACT_TEMPLATES[rel][rng.integers(len(FACT_TEMPLATES[rel]))]
                body.append(tmpl.format(s=f"{possessive} {noun} {other.name}", o=oobj))
    order = rng.permutation(len(body))
    return Document(id=e.id, title=e.name, text=" ".join(sentences + [body[i] for i in order]))


def _chain_paths(e: Entity, hops: int, truth: Truth, rng: np.random.Generator) -> list[tuple[str, ...]]:
    """Random valid relation chains of `hops` from e (no entity visited twice)."""
    out = []
    for _ in range(8):
        rels, cur, seen = [], e, {e.id}
        for h in range(hops):
            options = [r for r, v in cur.facts.items()
                       if v not in seen and (h == hops - 1 or v in truth.entities)]
            if not options:
                break
            r = options[rng.integers(len(options))]
            rels.append(r)
            seen.add(cur.facts[r])
            cur = truth.entities.get(cur.facts[r])
        if len(rels) == hops:
            out.append(tuple(rels))
    return out


def _benchmarks(truth: Truth, rng: np.random.Generator) -> dict[str, list[QAItem]]:
    ents = list(truth.entities.values())
    by_pop = sorted(ents, key=lambda e: -e.popularity)
    popular, longtail = by_pop[: len(by_pop) // 5], by_pop[len(by_pop) // 2:]
    aliased = [e for e in ents if len(e.aliases) > 1]
    years = {rel: [e for e in ents if rel in e.facts] for rel in COMPARE_TEMPLATES}

    def chain_item(pool, hops, use_alias=False):
        e = pool[rng.integers(len(pool))]
        paths = _chain_paths(e, hops, truth, rng)
        if not paths:
            return None
        mention = e.aliases[1 + rng.integers(len(e.aliases) - 1)] if use_alias and len(e.aliases) > 1 else e.name
        q = ChainQuery(mention, paths[0])
        return render_chain(q, variant=int(rng.integers(3))), truth.answer(q), hops

    def compare_item():
        rel = list(COMPARE_TEMPLATES)[rng.integers(len(COMPARE_TEMPLATES))]
        a, b = (years[rel][i] for i in rng.choice(len(years[rel]), 2, replace=False))
        q = CompareQuery((a.name, b.name), rel)
        return render_compare(q), truth.answer(q), 2

    makers = {
        "nq": lambda: chain_item(popular, 1),
        "triviaqa": lambda: chain_item(aliased, 1, use_alias=True),
        "popqa": lambda: chain_item(longtail, 1),
        "hotpotqa": lambda: chain_item(ents, 2),
        "2wikimultihopqa": lambda: compare_item() if rng.random() < 0.5 else chain_item(ents, 2),
        "musique": lambda: chain_item(ents, int(rng.integers(2, 5))),
        "bamboogle": lambda: chain_item(longtail, 3),
    }
    out = {}
    for bench, n in BENCHMARK_SIZES.items():
        items, seen = [], set()
        while len(items) < n:
            made = makers[bench]()
            if made is None or made[1] is None or made[0] in seen:
                continue
            question, golds, hops = made
            seen.add(question)
            items.append(QAItem(f"{bench}-{len(items)}", question, tuple(golds),
                                {"benchmark": bench, "hop": "single" if hops == 1 else "multi",
                                 "hops": hops}))
        out[bench] = items
    return out


@dataclass
class World:
    config: WorldConfig
    documents: list[Document]
    benchmarks: dict[str, list[QAItem]]
    truth: Truth


def make_world(config: WorldConfig) -> World:
    rng = np.random.default_rng(config.seed)
    entities = _make_entities(config, rng)
    truth = Truth(entities)
    by_type: dict[str, list[Entity]] = {}
    index = {}
    for e in entities:
        index[e.id] = len(by_type.setdefault(e.type, []))
        by_type[e.type].append(e)
    docs = [_page(e, truth, config, rng, by_type[e.type], index[e.id]) for e in entities]
    return World(config, docs, _benchmarks(truth, rng), truth)


