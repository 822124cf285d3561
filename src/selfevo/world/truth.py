"""The world's exact truth: entities and their facts. Only the audit's oracle judge, the world
generator and the evaluation's gold answers may read it; agents and the loop never import it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from selfevo.world.language import RELATIONS, ChainQuery, CompareQuery


@dataclass
class Entity:
    id: str
    type: str
    name: str
    aliases: list[str]  # every name the entity goes by, canonical name first
    popularity: float
    facts: dict[str, str] = field(default_factory=dict)  # relation -> entity id or year literal

    def to_json(self) -> dict:
        return {"id": self.id, "type": self.type, "name": self.name, "aliases": self.aliases,
                "popularity": self.popularity, "facts": self.facts}


class Truth:
    def __init__(self, entities: list[Entity]):
        self.entities = {e.id: e for e in entities}
        self._by_alias: dict[str, set[str]] = {}
        for e in entities:
            for a in e.aliases:
                self._by_alias.setdefault(a, set()).add(e.id)

    def resolve(self, mention: str) -> Entity | None:
        """The unique entity a mention names, else None (unknown or ambiguous)."""
        ids = self._by_alias.get(mention.strip())
        return self.entities[next(iter(ids))] if ids and len(ids) == 1 else None

    def value_aliases(self, value: str) -> list[str]:
        """A fact value's acceptable answers: an entity's aliases, or the literal (a year)."""
        ent = self.entities.get(value)
        return list(ent.aliases) if ent else [value]

    def top_value_share(self, relation: str) -> float:
        """The share of `relation` facts whose value is the most common one (how strongly values
        follow popularity: see WorldConfig.value_skew)."""
        values = Counter(e.facts[relation] for e in self.entities.values() if relation in e.facts)
        return values.most_common(1)[0][1] / sum(values.values())

    def follow(self, start: Entity, relations: tuple[str, ...]) -> list[str] | None:
        """The entity ids / literals visited along a chain (None where a fact is missing)."""
        path, cur = [], start
        for i, rel in enumerate(relations):
            value = cur.facts.get(rel)
            if value is None:
                return None
            path.append(value)
            if i < len(relations) - 1:
                cur = self.entities.get(value)
                if cur is None:
                    return None
        return path

    def answer(self, query: ChainQuery | CompareQuery) -> list[str] | None:
        """Gold aliases of the true answer, or None when the question cannot be resolved."""
        if isinstance(query, ChainQuery):
            start = self.resolve(query.mention)
            path = self.follow(start, query.relations) if start else None
            return self.value_aliases(path[-1]) if path else None
        ents = [self.resolve(m) for m in query.mentions]
        if any(e is None for e in ents):
            return None
        years = [e.facts.get(query.relation) for e in ents]
        if any(y is None for y in years) or years[0] == years[1]:
            return None
        return list(ents[0 if int(years[0]) < int(years[1]) else 1].aliases)

    def to_json(self) -> dict:
        return {"entities": [e.to_json() for e in self.entities.values()]}

    @classmethod
    def from_json(cls, obj: dict) -> Truth:
        entities = [Entity(**e) for e in obj["entities"]]
        for e in entities:  # a hand-edited year ("²" passes isdigit) would crash answer()'s int() later
            for rel, value in e.facts.items():
                if rel in RELATIONS and RELATIONS[rel][1] == "year" and not (
                        isinstance(value, str) and value.isascii() and value.isdigit()):
                    raise ValueError(f"truth.json: entity {e.id!r}: fact {rel!r} is {value!r}, not a year (0-9 only)")
        return cls(entities)
