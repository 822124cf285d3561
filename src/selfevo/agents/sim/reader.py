"""An imperfect page reader, shared by the sim proposer and solver.

A page states its subject's facts and, in confusable sentences, a related entity's facts of the
same relation. The reader extracts every fact-shaped statement (the world's language is known to
it, as English is to a pretrained model); which statement it *believes* is decided by a scoring
model plus a page-specific bias. The bias is a fixed function of (reader, page, candidate), so a
misreading is systematic for that page: re-reading the same page repeats it. Two readers'
biases are correlated by `shared` (the paper's "shared pretraining errors").
"""

from __future__ import annotations

import hashlib
import math
import operator
import struct
from dataclasses import dataclass

from selfevo.algos import float_sum
from selfevo.records import Document
from selfevo.world.language import Statement, read_statements

# Reading features of a candidate answer for (mention, relation), in this order.
FEATURES = ("about_page", "title_match", "about_and_title", "top_rank")

# The largest weight, bias scale or learning rate a sim config takes: far beyond any useful value
# (the defaults are below 5), yet small enough that no logit or update overflows a float in a run of
# any feasible length. Unbounded, 1e308 overflowed to inf mid-run: NaN probabilities, then a crash
# (random.choices) or Infinity written into a checkpoint.
MAX_MAGNITUDE = 1e6


def check_magnitude(where: str, *values: float) -> None:
    """A ValueError naming `where` if a value lies outside [-MAX_MAGNITUDE, MAX_MAGNITUDE]."""
    for v in values:
        if not abs(v) <= MAX_MAGNITUDE:
            raise ValueError(f"{where}: must be at most {MAX_MAGNITUDE:g} in size, got {given(v)}")


def given(v: float) -> object:
    """A value as an error quotes it: an integer of hundreds of digits by its length, not echoed."""
    return f"an integer of {len(str(abs(v)))} digits" if isinstance(v, int) and abs(v) > 10**12 else v


def hash_normal(*keys: object) -> float:
    """A standard normal that is a pure function of `keys` (Box-Muller on a hash)."""
    h = hashlib.blake2b("\x1f".join(map(str, keys)).encode(), digest_size=16).digest()
    a, b = struct.unpack("<QQ", h)
    u1 = (a + 1) / 2.0**64
    u2 = b / 2.0**64
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2 * math.pi * u2)


@dataclass(frozen=True)
class PageReading:
    doc_id: str
    title: str
    aliases: frozenset[str]
    statements: dict[str, tuple[Statement, ...]]  # relation -> statements, page order


class Reader:
    def __init__(self, name: str, misread_scale: float, shared: float, seed: int):
        if not misread_scale >= 0 or not 0 <= shared <= 1:  # `not >=`: a NaN scale is refused too
            raise ValueError("misread_scale must be >= 0 and shared in [0, 1]")
        self.name, self.scale, self.shared, self.seed = name, misread_scale, shared, seed
        self._pages: dict[Document, PageReading] = {}  # by the page itself: ids repeat across worlds
        self._bias: dict[tuple[str, str], float] = {}

    def read(self, doc: Document) -> PageReading:
        page = self._pages.get(doc)
        if page is None:
            statements, aliases = read_statements(doc.title, doc.text)
            by_rel: dict[str, list[Statement]] = {}
            for s in statements:
                by_rel.setdefault(s.relation, []).append(s)
            page = PageReading(doc.id, doc.title, frozenset(aliases),
                               {r: tuple(v) for r, v in by_rel.items()})
            self._pages[doc] = page
        return page

    def score(self, theta, phi, doc_id: str, candidate: str) -> float:
        """How strongly this reader believes `candidate`: weights . features + its own bias."""
        return float_sum(map(operator.mul, theta, phi)) + self.bias(doc_id, candidate)  # (map: the hot path)

    def bias(self, doc_id: str, candidate: str) -> float:
        """This reader's systematic pull towards `candidate` when reading page `doc_id`."""
        if self.scale == 0:
            return 0.0
        key = (doc_id, candidate)
        b = self._bias.get(key)
        if b is None:
            shared = hash_normal("shared", self.seed, doc_id, candidate)
            own = hash_normal(self.name, self.seed, doc_id, candidate)
            b = self.scale * (math.sqrt(self.shared) * shared + math.sqrt(1 - self.shared) * own)
            self._bias[key] = b
        return b


def features(stmt: Statement, title_match: bool, rank: int) -> tuple[float, float, float, float]:
    about = 1.0 if stmt.about_page else 0.0
    title = 1.0 if title_match else 0.0
    return (about, title, about * title, 1.0 if rank == 0 else 0.0)
