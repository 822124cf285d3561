"""The language of the synthetic world: how facts are written on pages and how questions are
phrased. Agents may import this module (it is the world's "English", what a pretrained model
knows); they may not import the world's truth (`selfevo.world.truth`).

A fact sentence is `<subject> <predicate> <object>.`. Pages also carry *confusable* sentences:
the same predicate about a related entity ("His brother X was born in Y."). A careful reader
attributes them to the related entity; a careless one misreads them as the page subject's fact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# relation -> (subject type, object type); object type "year" is a literal, else an entity type
RELATIONS: dict[str, tuple[str, str]] = {
    "born_in": ("person", "city"),
    "birth_year": ("person", "year"),
    "employer": ("person", "org"),
    "spouse": ("person", "person"),
    "located_in": ("city", "country"),
    "capital": ("country", "city"),
    "headquarters": ("org", "city"),
    "founder": ("org", "person"),
    "founded_year": ("org", "year"),
    "author": ("work", "person"),
    "published_year": ("work", "year"),
}

# How a page states a fact. Several phrasings per relation; the reader knows them all.
FACT_TEMPLATES: dict[str, tuple[str, ...]] = {
    "born_in": ("{s} was born in {o}.", "{s} is a native of {o}."),
    "birth_year": ("{s} was born in the year {o}.", "{s} came into the world in {o}."),
    "employer": ("{s} worked for {o}.", "{s} was employed by {o}."),
    "spouse": ("{s} is married to {o}.", "{s} married {o}."),
    "located_in": ("{s} is a city in {o}.", "{s} lies in the country of {o}."),
    "capital": ("{s} has its capital at {o}.", "{s} is governed from {o}."),
    "headquarters": ("{s} has its headquarters in {o}.", "{s} is headquartered in {o}."),
    "founder": ("{s} was founded by {o}.", "{s} was established by {o}."),
    "founded_year": ("{s} was founded in the year {o}.", "{s} dates its founding to {o}."),
    "author": ("{s} was written by {o}.", "{s} is a work by {o}."),
    "published_year": ("{s} was published in {o}.", "{s} first appeared in print in {o}."),
}

# Who the confusable sentence is about, by the page subject's type.
RELATED_NOUNS: dict[str, tuple[str, ...]] = {
    "person": ("brother", "sister", "cousin", "colleague"),
    "city": ("twin city", "neighbouring city"),
    "country": ("neighbour",),
    "org": ("rival", "parent company"),
    "work": ("sequel", "companion volume"),
}
POSSESSIVES = ("His", "Her", "Its", "Their")
PRONOUNS = ("He", "She", "It", "They")

# Noun phrases for nesting questions: "the birthplace of X".
RELATION_NOUNS: dict[str, str] = {
    "born_in": "birthplace",
    "birth_year": "birth year",
    "employer": "employer",
    "spouse": "spouse",
    "located_in": "country",
    "capital": "capital",
    "headquarters": "headquarters city",
    "founder": "founder",
    "founded_year": "founding year",
    "author": "author",
    "published_year": "publication year",
}
_NOUN_TO_REL = {v: k for k, v in RELATION_NOUNS.items()}

SINGLE_HOP_TEMPLATES: dict[str, tuple[str, ...]] = {
    "born_in": ("Where was {x} born?", "In which city was {x} born?"),
    "birth_year": ("In what year was {x} born?", "When was {x} born?"),
    "employer": ("Which organisation did {x} work for?", "Who employed {x}?"),
    "spouse": ("Who is {x} married to?",),
    "located_in": ("In which country is {x}?", "Which country is {x} located in?"),
    "capital": ("Which city is the capital of {x}?",),
    "headquarters": ("Where is {x} headquartered?", "In which city is {x} based?"),
    "founder": ("Who founded {x}?", "Who established {x}?"),
    "founded_year": ("When was {x} founded?", "In what year was {x} established?"),
    "author": ("Who wrote {x}?", "Who is the author of {x}?"),
    "published_year": ("When was {x} published?", "In what year did {x} appear?"),
}
COMPARE_TEMPLATES: dict[str, str] = {
    "birth_year": "Who was born first, {a} or {b}?",
    "founded_year": "Which was founded first, {a} or {b}?",
    "published_year": "Which was published first, {a} or {b}?",
}


@dataclass(frozen=True)
class ChainQuery:
    """`mention`, then follow `relations` in order: ("born_in", "located_in") = the country of
    the birthplace of mention."""

    mention: str
    relations: tuple[str, ...]

    @property
    def hops(self) -> int:
        return len(self.relations)


@dataclass(frozen=True)
class CompareQuery:
    """Which of `mentions` has the smallest value of the year `relation`."""

    mentions: tuple[str, str]
    relation: str

    @property
    def hops(self) -> int:
        return 2


def noun_phrase(relations: tuple[str, ...], mention: str) -> str:
    """("born_in", "located_in") -> 'the country of the birthplace of X'."""
    np = mention
    for rel in relations:
        np = f"the {RELATION_NOUNS[rel]} of {np}"
    return np


def render_chain(query: ChainQuery, variant: int = 0) -> str:
    """A question text for a chain query. Single hops use a natural template when `variant`
    selects one; multi-hop questions nest noun phrases."""
    if query.hops == 1:
        templates = SINGLE_HOP_TEMPLATES[query.relations[0]]
        if variant % (len(templates) + 1) < len(templates):
            return templates[variant % (len(templates) + 1)].format(x=query.mention)
    return f"What is {noun_phrase(query.relations, query.mention)}?"


def render_compare(query: CompareQuery) -> str:
    a, b = query.mentions
    return COMPARE_TEMPLATES[query.relation].format(a=a, b=b)


def _template_regex(template: str, slots: dict[str, str]) -> re.Pattern:
    pattern = re.escape(template)
    for slot, group in slots.items():
        pattern = pattern.replace(re.escape("{" + slot + "}"), group)
    return re.compile("^" + pattern + "$")


_SINGLE_HOP_PARSERS = [
    (_template_regex(t, {"x": "(?P<x>.+)"}), rel)
    for rel, ts in SINGLE_HOP_TEMPLATES.items() for t in ts
]
_COMPARE_PARSERS = [
    (_template_regex(t, {"a": "(?P<a>.+?)", "b": "(?P<b>.+)"}), rel)
    for rel, t in COMPARE_TEMPLATES.items()
]
_NP = re.compile(r"^the (" + "|".join(sorted(map(re.escape, _NOUN_TO_REL), key=len, reverse=True))
                 + r") of (.+)$")


def parse_question(text: str) -> ChainQuery | CompareQuery | None:
    """Invert the templates. Returns None for text that is not a question of this language."""
    text = text.strip()
    for rx, rel in _COMPARE_PARSERS:
        m = rx.match(text)
        if m:
            return CompareQuery((m["a"], m["b"]), rel)
    for rx, rel in _SINGLE_HOP_PARSERS:
        m = rx.match(text)
        if m:
            return ChainQuery(m["x"], (rel,))
    if text.startswith("What is ") and text.endswith("?"):
        np, relations = text[len("What is "):-1], []
        while (m := _NP.match(np)) is not None:
            relations.append(_NOUN_TO_REL[m[1]])
            np = m[2]
        if relations and np:
            return ChainQuery(np, tuple(reversed(relations)))
    return None


# ---------------------------------------------------------------- reading pages

@dataclass(frozen=True)
class Statement:
    """One fact-shaped sentence read off a page."""

    relation: str
    subject: str  # the subject as written ("He", the title, "His brother Oren Vale")
    object: str
    about_page: bool  # the subject is the page's own entity (title, alias or bare pronoun)
    sentence: int  # index of the sentence on the page


def _fact_regex(template: str) -> re.Pattern:
    return _template_regex(template, {"s": "(?P<s>.+?)", "o": "(?P<o>.+)"})


# Longest templates first, so "was born in the year 1901" is not read as a birthplace.
_FACT_PARSERS = sorted(((_fact_regex(t), rel) for rel, ts in FACT_TEMPLATES.items() for t in ts),
                       key=lambda p: -len(p[0].pattern))
_ALIAS = re.compile(r"^(?P<s>.+?) is also known as (?P<a>.+)\.$")
_SENTENCE_SPLIT = re.compile(r"(?<=\.)\s+")


def split_sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_SPLIT.split(text.strip()) if s]


def read_statements(title: str, text: str) -> tuple[list[Statement], list[str]]:
    """All fact statements on a page and the aliases it declares for its subject. The reader
    decides `about_page` from the grammatical subject only; whether to trust it is up to the
    agent's reading model."""
    aliases = [title]
    statements = []
    for i, sent in enumerate(split_sentences(text)):
        m = _ALIAS.match(sent)
        if m and m["s"] == title:
            aliases.extend(a.strip() for a in m["a"].split(" and "))
            continue
        for rx, rel in _FACT_PARSERS:
            m = rx.match(sent)
            if m is None:
                continue
            subj, obj = m["s"], m["o"]
            if RELATIONS[rel][1] == "year" and not (obj.isascii() and obj.isdigit()):
                continue  # "was born in Kell" is a place, not a year; nor is "²" (isdigit, but no int())
            if RELATIONS[rel][1] != "year" and obj.isdigit():
                continue
            about = subj in PRONOUNS or subj in aliases or subj == title
            statements.append(Statement(rel, subj, obj, about, i))
            break
    return statements, aliases
