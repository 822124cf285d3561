"""Judges decide, after the fact, whether saved labels and responses are correct. They never feed
back into the loop. The oracle judge uses the synthetic world's exact truth."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from selfevo.evaluate import answers_match, normalize_answer
from selfevo.world.language import parse_question
from selfevo.world.truth import Truth


@dataclass(frozen=True)
class Verdict:
    resolved: bool
    label_correct: bool | None = None
    responses_correct: tuple[bool, ...] | None = None
    reference: tuple[str, ...] | None = None  # the answers the judge accepts
    reason: str = ""


class Judge(Protocol):
    name: str

    def judge(self, items: Sequence[dict]) -> list[Verdict]:
        """Items are step-record items: question, adopted_label, responses, source ids."""
        ...


def usable_answers(answers: Sequence[str | None]) -> list[str]:
    """The reference answers that can resolve an item: one that normalizes to nothing ("The The",
    "-") matches no answer under the matcher (as Cover-EM drops it), so it is no answer at all."""
    return [a for a in answers if a and normalize_answer(a)]


class OracleJudge:
    """Exact truth: parse the question in the world's language, follow the true facts. A question
    whose entity is unknown or ambiguous, or whose chain hits a missing fact, stays unresolved."""

    name = "oracle"

    def __init__(self, truth: Truth):
        self.truth = truth

    def reference(self, question: str) -> list[str] | None:
        query = parse_question(question)
        ref = None if query is None else self.truth.answer(query)
        # an entity with no usable name (a hand-edited truth.json) leaves its questions unresolved, as the
        # gold judge does, rather than every answer wrong
        return usable_answers(ref or []) or None

    def judge(self, items: Sequence[dict]) -> list[Verdict]:
        out = []
        for it in items:
            ref = self.reference(it["question"])
            if ref is None:
                out.append(Verdict(False, reason="no true answer for this question"))
                continue

            def correct(ans: str, ref=ref) -> bool:
                return any(answers_match(ans, g) for g in ref)

            out.append(Verdict(True, correct(it["adopted_label"]),
                               tuple(correct(r) for r in it["responses"]), tuple(ref)))
        return out


# where an installed package of a user's names its judge factories (its pyproject.toml:
# [project.entry-points."selfevo.judges"] NAME = "module:make"), for `selfevo audit --judge NAME[:ARG]`;
# a factory `make(arg: str, *, documents) -> Judge`, `documents` the audited run's {id: text} (None for --records)
JUDGES = "selfevo.judges"


BUILT_IN_JUDGES = ("oracle", "llm", "gold")


def installed_judges() -> list[str]:
    """The judges installed packages name (selfevo's own names win)."""
    from selfevo._plugins import installed

    return sorted(set(installed(JUDGES)) - set(BUILT_IN_JUDGES))


def load_judge(spec: str, documents=None) -> Judge:
    """The judge `NAME[:ARG]` names: built by the factory an installed package names NAME under the
    `selfevo.judges` entry points."""
    import inspect

    from selfevo._plugins import ContractError, load, qualified_name

    name, _, arg = spec.partition(":")
    make = load(JUDGES, name, "judge")
    try:
        inspect.signature(make).bind(arg, documents=documents)
    except TypeError as e:  # not callable, or of another signature (a TypeError inside it keeps its traceback)
        raise ContractError(f"judge '{name}': {qualified_name(make)} is no factory make(arg, *, documents) -> Judge "
                            f"({e})") from None
    except ValueError:  # a callable with no signature Python can read (a builtin): called as it is
        pass
    judge = make(arg, documents=documents)
    if not isinstance(getattr(judge, "name", None), str) or not callable(getattr(judge, "judge", None)):
        raise ContractError(f"judge '{name}': its factory returned {type(judge).__name__}, not a judge (an object "
                            "with a name and judge(items) -> list of Verdict)")
    return judge
