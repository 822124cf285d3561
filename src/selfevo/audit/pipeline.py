"""One audit into one directory, as `selfevo audit` runs it:

    DIR/metrics.json        A / T_P / T_S / F / L / coverage per step and round (the oracle's schema)
    DIR/judge.json          the judge's settings and its call summary (LLM judges)
    DIR/judgements.jsonl    per distinct item: the verified reference and quote, or why unresolved (LLM)
    DIR/comparison.json|md  with a truth judge: side by side per round, bootstrap intervals, confusion
    DIR/injection.json      with an injection test: verdict flip rates
    DIR/figures/*.png       metrics by step and round, F against L, the comparison
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from selfevo._io import atomic_writer, write_json, write_jsonl
from selfevo.audit import Judge, audit_steps, checked_verdicts

# what an audit may write besides metrics.json and judge.json, by its options and judge (the call
# cache is not among them: a rerun needs it)
EARLIER_OUTPUTS = ("comparison.json", "comparison.md", "injection.json", "judgements.jsonl",
                   "figures/metrics.png", "figures/f_vs_l.png", "figures/comparison.png")


def limit_items(steps: Sequence[dict], per_step: int | None) -> list[dict]:
    """The first `per_step` items of every step (None: all), for audits on a budget."""
    if per_step is None:
        return list(steps)
    return [{**st, "items": st["items"][:per_step]} for st in steps]


# a judge's optional hooks, called with no argument (the LLM judge has all four; docs/extending.md): `check`
# before any item (an endpoint that is down), `describe` -> judge.json's dict, `summary` -> its call counts,
# `judgements` -> judgements.jsonl's rows
HOOKS = {"check": None, "describe": dict, "summary": dict, "judgements": list}


def _hook(judge: Judge, hook: str) -> str:
    return f"judge {getattr(judge, 'name', type(judge).__name__)!r}: {hook}"


def check_hooks(judge: Judge) -> None:
    """Each hook the judge has takes no argument: one of another signature (a user's judge with a method of a
    hook's name for something else) is a ContractError naming it before any item is judged."""
    import inspect

    from selfevo._plugins import ContractError

    for hook in HOOKS:
        if (method := getattr(judge, hook, None)) is None:
            continue
        try:
            inspect.signature(method).bind()
        except TypeError as e:  # not callable, or it needs an argument
            raise ContractError(f"{_hook(judge, hook)} is an audit hook, called with no argument ({e}; "
                                "docs/extending.md)") from None
        except ValueError:  # a callable with no signature Python can read: called as it is
            pass


def call_hook(judge: Judge, hook: str) -> Any:
    """What the judge's `hook` returns (`check_hooks` checked it takes no argument), or None where it has
    none; an answer of another shape is a ContractError naming the judge and the hook."""
    from selfevo._io import json_problem
    from selfevo._plugins import ContractError

    if (method := getattr(judge, hook, None)) is None:
        return None
    value, kind = method(), HOOKS[hook]
    if kind is None:
        return value
    got = type(value).__name__
    if kind is list and isinstance(value, (tuple, Iterator)):  # rows given as a tuple or a generator
        value = list(value)
    if not isinstance(value, kind) or (kind is list and not all(isinstance(r, dict) for r in value)):
        raise ContractError(f"{_hook(judge, hook)} returns {'a list of dicts' if kind is list else 'a dict'} "
                            f"(docs/extending.md), got {got}")
    if problem := json_problem(value):
        raise ContractError(f"{_hook(judge, hook)}: what it returns is written as JSON: {problem}")
    return value


def audit_to_dir(steps: Sequence[dict], judge: Judge, out_dir: str | os.PathLike, *, truth: Judge | None = None,
                 n_boot: int = 2000, seed: int = 0, figures: bool = True,
                 documents: Mapping[str, str] | None = None, injection_items: int = 0,
                 info: Mapping[str, Any] | None = None) -> dict:
    from selfevo.audit.compare import compare_judges, comparison_markdown

    out = Path(out_dir)
    flat = [it for st in steps for it in st["items"]]
    # an endpoint that is down or refuses the key (an LLM judge's `check`): stop before any item, not
    # write every item unresolved over the audit there
    check_hooks(judge)
    call_hook(judge, "check")
    # judge first (the slow part, the one that can fail): a failed audit leaves the earlier one whole
    verdicts = checked_verdicts(judge, flat, judge.judge(flat))
    result = audit_steps(steps, judge, verdicts=verdicts)
    done: dict[str, Any] = {"metrics": result, "out": str(out)}
    cmp = None
    if truth is not None:
        cmp = compare_judges(steps, verdicts, checked_verdicts(truth, flat, truth.judge(flat)), judge.name, truth.name,
                             n_boot=n_boot, seed=seed)
        done["comparison"] = cmp
    judge_json = {**(call_hook(judge, "describe") or {"judge": judge.name}), **(info or {})}
    judgements = call_hook(judge, "judgements")
    if (summary := call_hook(judge, "summary")) is not None:
        done["summary"] = summary
    if injection_items:
        from selfevo.audit.injection import flip_report, injection_set

        clean, injected = injection_set(flat, documents, n=injection_items, truth=truth, seed=seed)
        done["injection"] = flip_report(judge, clean, injected, truth=truth)
        if (summary := call_hook(judge, "summary")) is not None:  # the calls so far, the injection test's included
            done["injection"]["judge_summary_after"] = summary

    # an earlier audit into this directory (another judge, --compare, --injection-test, other records)
    # may have written outputs this one does not: beside the new metrics they would contradict them
    out.mkdir(parents=True, exist_ok=True)
    for name in EARLIER_OUTPUTS:
        (out / name).unlink(missing_ok=True)
    write_json(out / "metrics.json", result)
    if cmp is not None:
        write_json(out / "comparison.json", cmp)
        with atomic_writer(out / "comparison.md") as fh:
            fh.write(comparison_markdown(cmp) + "\n")
    write_json(out / "judge.json", judge_json)
    if judgements is not None:
        write_jsonl(out / "judgements.jsonl", judgements)
    if injection_items:
        write_json(out / "injection.json", done["injection"])
    if figures:
        from selfevo.audit.figures import write_figures

        done["figures"] = [str(p) for p in write_figures(result, out / "figures", cmp)]
    return done
