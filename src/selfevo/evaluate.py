"""Downstream evaluation: answer normalization, Cover-EM / EM / F1, and the benchmark runner.

One normalizer and one matcher serve the whole project: `answers_match` is the loop's answer
matcher (proposer reward, MSV majorities, audit A) and `cover_em` is the evaluation metric of
every results row. Both follow FlashRAG / Search-R1 (`normalize_answer`) exactly, so numbers are
comparable with the papers that report them.

The runner gives every agent the same thing: one greedy trajectory per question through one
`SearchTool` (top-3 passages, at most 5 searches), and the same scorer on the answer it returns.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import string
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from selfevo._bar import Progress
from selfevo._fmt import num
from selfevo._io import (
    append_jsonl,
    encodable,
    hold_directory,
    json_problem,
    read_jsonl_log,
    shown_url,
    write_json,
    write_jsonl,
)
from selfevo._plugins import ContractError
from selfevo.algos import float_sum
from selfevo.corpus import DataError, _require_str, iter_json_lines, read_qa_dir
from selfevo.records import QAItem
from selfevo.search.tool import SearchBudgetExhausted

if TYPE_CHECKING:  # only for annotations: importing agents here would be a cycle later
    from selfevo.agents.base import Solver
    from selfevo.search.tool import SearchTool

BENCHMARKS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
SINGLE_HOP = BENCHMARKS[:3]
MULTI_HOP = BENCHMARKS[3:]

METRICS = ("cover_em", "em", "f1")

# ---------------------------------------------------------------- normalization and metrics

_DROP_PUNCTUATION = str.maketrans("", "", string.punctuation)  # ASCII only, as FlashRAG: "’" and "é" survive
_ARTICLES = re.compile(r"\b(a|an|the)\b")


@functools.lru_cache(maxsize=1 << 16)  # the loop matches the same few answers hundreds of thousands of times
def normalize_answer(s: str) -> str:
    """FlashRAG / Search-R1 / SQuAD normalization, in their order:
    lower → remove punctuation → articles to a space → collapse whitespace."""
    s = s.lower().translate(_DROP_PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _normalized_golds(golds: str | Iterable[str]) -> list[str]:
    """Normalized gold aliases, empty ones dropped.

    Departure from FlashRAG: there an alias that normalizes to "" (e.g. "The") is a substring of
    every prediction and scores 1.0 for anything; here it is simply not an alias. (No gold of the
    seven shipped benchmarks normalizes to "".)
    """
    if isinstance(golds, str):
        golds = [golds]
    return [g for g in (normalize_answer(x) for x in golds) if g]


def scorable(golds: str | Iterable[str]) -> bool:
    """Can any answer be right: does an alias survive normalization ("The" alone does not)?"""
    return bool(_normalized_golds(golds))


def _cover_em(pred: str, golds: list[str]) -> float:
    return 1.0 if pred and any(g in pred for g in golds) else 0.0


def _exact_match(pred: str, golds: list[str]) -> float:
    return 1.0 if pred and pred in golds else 0.0


# FlashRAG (after the HotpotQA script) gives no partial F1 credit around yes/no answers:
# "yes it is" against gold "yes" scores 0, not 0.67, so a yes/no guess cannot farm F1.
_NO_PARTIAL_CREDIT = ("yes", "no", "noanswer")


def _token_f1(pred: str, golds: list[str]) -> float:
    best = 0.0
    pred_tokens = pred.split()
    for gold in golds:
        if (pred in _NO_PARTIAL_CREDIT or gold in _NO_PARTIAL_CREDIT) and pred != gold:
            continue
        gold_tokens = gold.split()
        same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if same == 0:
            continue
        precision, recall = same / len(pred_tokens), same / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def cover_em(prediction: str | None, golds: str | Iterable[str]) -> float:
    """1.0 iff some normalized gold alias is a substring of the normalized prediction
    (FlashRAG's `acc` / Search-R1's `subem`). An empty or missing prediction scores 0."""
    return _cover_em(normalize_answer(prediction or ""), _normalized_golds(golds))


def exact_match(prediction: str | None, golds: str | Iterable[str]) -> float:
    """1.0 iff the normalized prediction equals some normalized gold alias."""
    return _exact_match(normalize_answer(prediction or ""), _normalized_golds(golds))


def token_f1(prediction: str | None, golds: str | Iterable[str]) -> float:
    """SQuAD token F1 on normalized tokens, max over gold aliases, with FlashRAG's yes/no rule."""
    return _token_f1(normalize_answer(prediction or ""), _normalized_golds(golds))


def answers_match(a: str | None, b: str | None) -> bool:
    """The loop's answer matcher (reward, MSV, audit A): normalized exact match.

    Two answers that normalize to nothing never match: agreeing on "no answer" is not agreement
    on an answer, and counting it would let two failures look like consensus.
    """
    na, nb = normalize_answer(a or ""), normalize_answer(b or "")
    return bool(na) and na == nb


def mentions(text: str, answer: str) -> bool:
    """`answer` appears in `text` as whole words, both normalized (an answer given away in a
    question, a reference inside its quote). An answer that normalizes to nothing is in no text."""
    a = normalize_answer(answer)
    return bool(a) and f" {a} " in f" {normalize_answer(text)} "


@dataclass(frozen=True)
class ItemScore:
    cover_em: float
    em: float
    f1: float


def score_item(prediction: str | None, golds: str | Iterable[str]) -> ItemScore:
    """All three metrics for one answer, normalizing once."""
    pred, gold = normalize_answer(prediction or ""), _normalized_golds(golds)
    return ItemScore(_cover_em(pred, gold), _exact_match(pred, gold), _token_f1(pred, gold))


# ---------------------------------------------------------------- aggregation


def benchmark_order(names: Iterable[str]) -> list[str]:
    """The paper's column order first, then any other benchmark alphabetically."""
    names = set(names)
    return [b for b in BENCHMARKS if b in names] + sorted(names - set(BENCHMARKS))


def _mean_over(per_bench: Mapping[str, Mapping[str, Any]], names: Sequence[str]) -> dict:
    """Equal-weight mean over benchmarks (not items); None where no benchmark is present."""
    if not names:
        return {m: None for m in METRICS}
    return {m: float_sum(per_bench[b][m] for b in names) / len(names) for m in METRICS}


def _check_questions(data: Mapping[str, Sequence[QAItem]]) -> None:
    """Every benchmark has questions, and every id names one question: predictions and answers are
    keyed by id, so an id in two places would score one answer for both (a Python caller's data;
    `read_qa_dir` refuses both)."""
    empty = [b for b, items in data.items() if not items]
    if empty:
        raise ValueError(f"benchmark(s) with no questions: {', '.join(empty)}")
    where: dict[str, str] = {}
    for bench, items in data.items():
        for it in items:
            if it.id in where:
                raise ValueError(f"question id '{it.id}' is in {where[it.id]} and in {bench}"
                                 if where[it.id] != bench else f"question id '{it.id}' is twice in {bench}")
            where[it.id] = bench


def score_items(data: Mapping[str, Sequence[QAItem]],
                predictions: Mapping[str, str]) -> dict[str, ItemScore]:
    """Per-item scores keyed by id. A prediction for an id the data does not hold is an error
    (it usually means the wrong predictions file); an item with no prediction scores 0."""
    _check_questions(data)
    known = {it.id for items in data.values() for it in items}
    unknown = [pid for pid in predictions if pid not in known]
    if unknown:
        raise DataError("predictions", None,
                        f"{len(unknown)} prediction id(s) not in the data, e.g. '{unknown[0]}'")
    return {it.id: score_item(predictions.get(it.id), it.golden_answers)
            for items in data.values() for it in items}


def score_predictions(data: Mapping[str, Sequence[QAItem]],
                      predictions: Mapping[str, str]) -> dict:
    """Cover-EM / EM / F1 per benchmark, macro, single-hop and multi-hop.

    Schema: `{"benchmarks": {NAME: {"cover_em","em","f1","n","missing"}},
    "macro"|"single_hop"|"multi_hop": {"cover_em","em","f1"}}`. Macro is the equal-weight mean over
    the benchmarks present; the hop groups average those present of each group (`hop_group`).
    """
    scores = score_items(data, predictions)
    per_bench: dict[str, dict] = {}
    for name in benchmark_order(data):
        items = data[name]
        n = len(items)
        row: dict[str, Any] = {m: float_sum(getattr(scores[it.id], m) for it in items) / n
                               for m in METRICS}
        row["n"] = n
        row["missing"] = sum(1 for it in items if it.id not in predictions)
        per_bench[name] = row
    return {
        "benchmarks": per_bench,
        "macro": _mean_over(per_bench, list(per_bench)),
        "single_hop": _mean_over(per_bench, [b for b in per_bench if hop_group(b, data[b]) == "single"]),
        "multi_hop": _mean_over(per_bench, [b for b in per_bench if hop_group(b, data[b]) == "multi"]),
    }


def hop_group(name: str, items: Sequence[QAItem]) -> str | None:
    """A benchmark's hop group, "single" or "multi": a standard benchmark's own, else the `metadata.hop`
    every item of a benchmark of one's own carries alike (a QA set of one's own was in no group, whatever
    its items said); None where they differ or say none."""
    if name in BENCHMARKS:
        return "single" if name in SINGLE_HOP else "multi"
    hops = {it.metadata.get("hop") for it in items}
    return next(iter(hops)) if len(hops) == 1 and hops <= {"single", "multi"} else None


# ---------------------------------------------------------------- files


def _read_predictions(path: str | os.PathLike) -> tuple[dict[str, str], dict[str, int], dict[str, str]]:
    """Predictions, the line each came from (so later errors can name file:line) and the question of
    those that carry one (`selfevo eval` writes it)."""
    preds: dict[str, str] = {}
    lines: dict[str, int] = {}
    questions: dict[str, str] = {}
    for lineno, obj in iter_json_lines(path):
        pid = _require_str(obj, "id", path, lineno)
        pred = _require_str(obj, "prediction", path, lineno, allow_empty=True)
        if pid in preds:
            raise DataError(path, lineno, f"duplicate id '{pid}' (first on line {lines[pid]})")
        preds[pid], lines[pid] = pred, lineno
        if obj.get("question") is not None:
            questions[pid] = _require_str(obj, "question", path, lineno)
    if not preds:
        raise DataError(path, None, "no predictions in file")
    return preds, lines, questions


def read_predictions(path: str | os.PathLike) -> dict[str, str]:
    """Read `{"id","prediction"}` JSONL; every problem is a DataError naming file:line."""
    return _read_predictions(path)[0]


def score_files(data_dir: str | os.PathLike, predictions_path: str | os.PathLike,
                out_path: str | os.PathLike) -> dict:
    """Score a predictions file against a QA directory and write the result JSON atomically."""
    data = read_qa_dir(data_dir)
    preds, lines, questions = _read_predictions(predictions_path)
    known = {it.id: it for items in data.values() for it in items}
    for pid, lineno in lines.items():
        if pid not in known:
            raise DataError(predictions_path, lineno, f"id '{pid}' is not in {data_dir}")
        # ids such as nq-0 recur across question sets (a world's, the shared benchmarks'): scored against
        # another set's answers, its predictions scored near 0 without a word
        asked = questions.get(pid)
        if asked is not None and " ".join(asked.split()) != " ".join(known[pid].question.split()):
            raise DataError(predictions_path, lineno, f"id '{pid}' answers {asked!r}, but {data_dir} asks "
                                                      f"{known[pid].question!r}: predictions of another question set?")
    result = score_predictions(data, preds)
    write_json(out_path, result)
    return result


_GROUP_ROWS = (("macro", "macro"), ("single-hop", "single_hop"), ("multi-hop", "multi_hop"))


def print_score_table(result: Mapping[str, Any], console: Console) -> None:
    """One row per benchmark, then macro / single-hop / multi-hop."""
    table = Table(title="Cover-EM / EM / F1")
    table.add_column("benchmark")
    table.add_column("n", justify="right")
    table.add_column("Cover-EM", justify="right")
    table.add_column("EM", justify="right")
    table.add_column("F1", justify="right")
    for name, row in result["benchmarks"].items():
        n = str(row["n"]) + (f" ({row['missing']} missing)" if row.get("missing") else "")
        # a name from the data (metadata.benchmark, a file stem): "nq[dev]" is no markup
        table.add_row(escape(name), n, num(row["cover_em"]), num(row["em"]), num(row["f1"]))
    table.add_section()
    n_total = sum(row["n"] for row in result["benchmarks"].values())
    for label, key in _GROUP_ROWS:
        group = result[key]
        table.add_row(f"[bold]{label}[/bold]", str(n_total) if key == "macro" else "",
                      num(group["cover_em"]), num(group["em"]), num(group["f1"]))
    console.print(table)


# ---------------------------------------------------------------- the benchmark runner


def _select(data: Mapping[str, Sequence[QAItem]], limit: int | None) -> dict[str, list[QAItem]]:
    """The first `limit` questions of every benchmark (file order, so runs are comparable)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    return {b: list(data[b][:limit]) for b in benchmark_order(data)}


def evaluate_solver(solver: Solver, data: Mapping[str, Sequence[QAItem]], tool: SearchTool,
                    out_dir: str | os.PathLike | None = None, limit: int | None = None,
                    batch_size: int = 64, console: Console | None = None,
                    progress: bool = True, run_info: Mapping[str, Any] | None = None,
                    predictions_path: str | os.PathLike | None = None,
                    score_path: str | os.PathLike | None = None, per_invocation: bool = True,
                    partial_key: Mapping[str, Any] | None = None,
                    partial_path: str | os.PathLike | None = None, restart_stale: bool = False,
                    remove_partial: bool = True) -> dict:
    """Run `solver` once, greedily, on every question and score it.

    Every agent gets the same `tool` (its budget, e.g. 5 searches of top-3, is the tool's, so it
    is identical for every row) and the same scorer. Writes `predictions.jsonl` and `score.json`
    to `out_dir` when given (or to the explicit paths); returns the score dict plus a `run` block
    (tool budget, whatever the caller passes in `run_info`, and unless `per_invocation=False` what
    depends on this invocation: its seconds, the questions it took from a stopped evaluation, the
    agent's `describe()` (a remote solver's URL and call counters); a run directory's evaluation files
    leave them out, so a resumed run writes the same bytes).

    With `partial_key` (what makes two evaluations the same: the agent, data, retriever) and
    `out_dir` (or `partial_path`), each answered batch is appended to `predictions.partial.jsonl`
    (`partial_path`) as it comes: an evaluation stopped part way (a kill, Ctrl-C, an endpoint that
    stopped answering) continues from there when run again with the same key, and the file is
    removed once the results are written, unless some calls failed for good: run again, it asks only
    those questions again. With `remove_partial=False` it is left for the caller (a run directory's
    evaluation, which is made once: the run removes it once the round is recorded, so that a kill
    before that asks nothing again; its predictions mark a failed call's row `failed`, its score
    counts them). One of other settings is refused, or with `restart_stale` set aside with a warning
    (a resumed run whose model came out otherwise than before the kill).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    data = _select(data, limit)
    _check_questions(data)  # now, not after every question has been answered
    items = [(bench, it) for bench, its in data.items() for it in its]
    partial = None
    if partial_path is None and out_dir is not None:
        partial_path = Path(out_dir) / "predictions.partial.jsonl"
    if partial_key is not None and partial_path is not None:
        # the questions by what they ask and accept, not only their ids: a QA file edited in place keeps them
        asked = [[it.id, it.question, list(it.golden_answers)] for _, it in items]
        key = {**partial_key, "limit": limit, "tool": {"topk": tool.topk, "max_calls": tool.max_calls},
               "questions": hashlib.sha256(json.dumps(asked).encode()).hexdigest()}
        partial = Path(partial_path)
        answers: dict[str, Any] = _read_partial(partial, key, restart_stale)
        if not partial.exists():
            append_jsonl(partial, [{"partial_of": key}])  # its first line says what it is a part of
    else:
        answers = {}
    resumed = len(answers)
    console = console or Console(stderr=True)
    if resumed:
        console.print(escape(f"continuing the evaluation stopped in {partial}: {resumed} of {len(items)} "
                             "questions answered before"))
    started = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    todo = [(bench, it) for bench, it in items if it.id not in answers]
    with Progress(*columns, console=console, disable=not progress) as bar:
        task = bar.add_task(escape(f"eval {getattr(solver, 'name', type(solver).__name__)}"),  # lm:PATH
                            total=len(items), completed=resumed)
        for start in range(0, len(todo), batch_size):
            batch = todo[start:start + batch_size]
            try:
                trajs = solver.answer([it.question for _, it in batch], tool, greedy=True, n=1)
            except SearchBudgetExhausted as e:  # a solver of a user's that searched past its budget
                raise ValueError(f"agent {getattr(solver, 'name', type(solver).__name__)!r}: {e}; an agent "
                                 "answers once its search session refuses") from None
            check_answers(getattr(solver, "name", type(solver).__name__), trajs, len(batch))
            for (_, it), (traj, *_) in zip(batch, trajs):
                answers[it.id] = traj
            if partial is not None:
                append_jsonl(partial, [_prediction_row(b, it, answers[it.id]) for b, it in batch])
            bar.advance(task, len(batch))
    elapsed = time.perf_counter() - started

    predictions = {qid: encodable(traj.answer or "") for qid, traj in answers.items()}
    failed = sum(bool(getattr(t.trace, "failed", False)) for t in answers.values())
    result = score_predictions(data, predictions)
    result["run"] = {
        "agent": getattr(solver, "name", type(solver).__name__),
        "questions": len(items),
        "limit": limit,
        "tool": {"topk": tool.topk, "max_calls": tool.max_calls},
        "searches": sum(len(t.searches) for t in answers.values()),
        **({"answer_seconds": round(elapsed, 3)} if per_invocation else {}),
        **({"resumed_questions": resumed} if resumed and per_invocation else {}),
        **({"failed_questions": failed} if failed else {}),
        **(run_info or {}),
    }
    describe = getattr(solver, "describe", None)
    if describe is not None and per_invocation:  # e.g. a remote solver's URL and its calls' counters: this invocation's
        result["run"]["agent_detail"] = describe()
    if out_dir is not None:
        predictions_path = predictions_path or Path(out_dir) / "predictions.jsonl"
        score_path = score_path or Path(out_dir) / "score.json"
    if predictions_path is not None:
        write_jsonl(predictions_path, [_prediction_row(b, it, answers[it.id]) for b, it in items])
    if score_path is not None:
        write_json(score_path, result)
    if partial is not None:
        if failed:  # run again, only those are asked again (`_read_partial` leaves them out)
            console.print(escape(f"{failed} question(s) got no answer (calls that failed for good, scored as none)"
                                 + (f"; the same command again asks only those ({partial})" if remove_partial
                                    else "")))
        elif remove_partial:
            partial.unlink()  # its rows are in predictions.jsonl now
    return result


def check_answers(agent: str, trajs: Any, n_questions: int, n: int | None = None) -> Any:
    """A solver's answer to `answer(questions, n=...)`: one list a question, each of `n` (None: at least one)
    `Trajectory`s whose answer is a string and whose searches a list of strings; returned as it is. An agent
    of a user's that returns another shape is named here, not met as a TypeError deep in scoring or a reward
    of k samples counted out of the wrong number (or, an answer of None, scored as no answer without a word)."""
    from selfevo.agents.base import Trajectory

    shape = f"answer() returns a list of {n or 'one'} Trajectory a question, in a list"
    if not isinstance(trajs, list | tuple) or len(trajs) != n_questions:
        got = f"{len(trajs)} items" if isinstance(trajs, list | tuple) else f"a {type(trajs).__name__}"
        raise ContractError(f"agent {agent!r}: {shape}; got {got} for {n_questions} questions")
    for i, ts in enumerate(trajs):
        if not isinstance(ts, (list, tuple)) or not ts or not all(isinstance(t, Trajectory) for t in ts):
            raise ContractError(f"agent {agent!r}: {shape}; question {i + 1} got {type(ts).__name__} {str(ts)[:80]!r}")
        if n is not None and len(ts) != n:
            raise ContractError(f"agent {agent!r}: {shape}; question {i + 1} got {len(ts)}")
        for t in ts:
            if not isinstance(t.answer, str):
                raise ContractError(f"agent {agent!r}: question {i + 1}: a Trajectory's answer is a string (got "
                                    f"{t.answer!r})")
            if not isinstance(t.searches, list | tuple) or not all(isinstance(q, str) for q in t.searches):
                raise ContractError(f"agent {agent!r}: question {i + 1}: a Trajectory's searches are a list of the "
                                    f"queries it sent (strings), got {t.searches!r}")
    return trajs


def _prediction_row(bench: str, it: QAItem, traj: Any) -> dict:
    prediction = encodable(traj.answer or "")
    # a trajectory the backend could not generate (a remote call that failed for good) is scored as
    # no answer, and marked: a resumed evaluation asks it again
    failed = {"failed": True} if getattr(traj.trace, "failed", False) else {}
    return {"id": it.id, "benchmark": bench, "question": it.question, "prediction": prediction,
            "golden_answers": list(it.golden_answers), "cover_em": cover_em(prediction, it.golden_answers),
            "searches": [encodable(q) for q in traj.searches], **failed}


class PartialFileError(ValueError):
    """A stopped evaluation's answers file that cannot be gone on from (damaged, or of other settings)."""


def _read_partial(path: Path, key: dict, restart_stale: bool = False) -> dict[str, Any]:
    """The answers an earlier, stopped evaluation with the same `key` appended to `path` (its first
    line is the key), less those whose call failed (asked again); none if there is no such file. A
    file of other settings that holds no answer (a start whose first call failed) is removed, as is
    one that does with `restart_stale` (a warning); else it is refused."""
    from selfevo.agents.base import Trajectory

    if not path.exists():
        return {}
    try:
        rows = read_jsonl_log(path, repair=True)  # a kill may have torn the last line
    except ValueError as e:
        raise PartialFileError(f"{e}; remove it to start the evaluation over") from None
    want = json.loads(json.dumps(key))
    if not rows or rows[0].get("partial_of") != want:
        if len(rows) > 1 and restart_stale:
            warnings.warn(f"{path}: a stopped evaluation of other settings (or another model); it is started over",
                          stacklevel=3)
        if len(rows) <= 1 or restart_stale:  # nothing answered: the corrected command starts afresh
            path.unlink()
            return {}
        had = rows[0].get("partial_of")
        differ = sorted(k for k in {*had, *want} if had.get(k) != want.get(k)) if isinstance(had, dict) else []
        names = {"agent_settings": "agent settings", "agent_files": "the lm: agent's model or policy files",
                 "data_dir": "data", "corpus_sha256": "corpus content", "encoder_fingerprint": "encoder",
                 "tool": "search settings", "agent_identity": "the agent's identity"}
        which = ", ".join(names.get(k, k) for k in differ) or ("agent and its settings, an lm: agent's model or "
                                                               "policy files, data, retriever, encoder, limit or "
                                                               "questions")
        raise PartialFileError(f"{path}: a stopped evaluation of other settings ({which} differ); remove "
                               "it to start over, or choose another --out")
    answers = {}
    for i, row in enumerate(rows[1:], start=2):
        if not (isinstance(row.get("id"), str) and isinstance(row.get("prediction"), str)
                and isinstance(row.get("searches"), list)):
            raise PartialFileError(f"{path}:{i}: not a prediction row (id, prediction, searches); remove the "
                                   "file to start the evaluation over")
        if not row.get("failed"):
            answers[row["id"]] = Trajectory(answer=row["prediction"], searches=[str(q) for q in row["searches"]])
    return answers


def run_eval(data_dir: str | os.PathLike, corpus: str | os.PathLike | None, agent: str,
             out_dir: str | os.PathLike, limit: int | None = None,
             retriever_url: str | None = None, index_dir: str | os.PathLike | None = None,
             progress: bool = True, retriever_kind: str | None = None,
             index: str | os.PathLike | None = None, dense_options: Any = None,
             agent_context: Mapping[str, Any] | None = None, search: Any = None) -> dict:
    """`selfevo eval`: QA dir + retriever + agent spec → predictions.jsonl and score.json.

    The retriever is a remote `/retrieve` server (`retriever_url`), a saved index directory of
    any kind (`index`, checked against `corpus` when given), or an index of `retriever_kind`
    (bm25 | dense | hybrid, default bm25) over `corpus`, cached in `index_dir` (by default
    `out_dir/<kind>-index`, so a rerun skips indexing). `dense_options` (a
    `selfevo.search.index.DenseOptions`) choose the encoder of a dense or hybrid index.
    `agent_context` goes to the agent's factory (e.g. `{"workers": 4}` for `lm:` agents). `search` (a
    `selfevo.config.SearchConfig`; default the paper's 3 passages a search, 5 searches) is every question's
    tool budget: a run's own per-round evaluation takes its config's `[search]`, which this matches when given.
    """
    out_dir = Path(out_dir)
    # one evaluation in out_dir at a time: a second would append to the first's predictions.partial.jsonl
    # (or remove it, and have its answers taken for its own on a resume), build its index cache beside it,
    # and leave predictions.jsonl and score.json of two different evaluations
    with hold_directory(out_dir, lambda: ValueError(f"{out_dir}: another evaluation is writing here; wait for it "
                                                    "to end (or stop it), or choose another --out")):
        return _run_eval(data_dir, corpus, agent, out_dir, limit, retriever_url, index_dir, progress,
                         retriever_kind, index, dense_options, agent_context, search)


# what `selfevo eval` writes in its --out, besides its index cache (`<kind>-index`)
EVAL_FILES = ("predictions.jsonl", "score.json", "predictions.partial.jsonl")


def _close(resource: Any) -> None:
    if (close := getattr(resource, "close", None)) is not None:
        close()


def _run_eval(data_dir, corpus, agent, out_dir: Path, limit, retriever_url, index_dir, progress, retriever_kind,
              index, dense_options, agent_context, search) -> dict:
    from selfevo.agents import agent_files, load_agent
    from selfevo.config import SearchConfig
    from selfevo.search.tool import SearchTool

    started = time.perf_counter()
    data = read_qa_dir(data_dir)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    # the agent and the retriever closed however this ends (an error, or an interrupt in the index's build,
    # included): HTTP clients hold connection pools, an lm: agent with workers its Ray actors
    with contextlib.ExitStack() as closing:
        # fail on a bad spec before indexing anything
        solver = load_agent(agent, corpus=corpus, retriever_url=retriever_url, **(agent_context or {}))
        closing.callback(_close, solver)
        if retriever_url:
            from selfevo.search.client import RetrieverError, probed_client

            try:
                retriever = probed_client(retriever_url)
            except RetrieverError as e:
                raise ValueError(f"retriever URL {shown_url(retriever_url)}: {e}") from None
        else:
            if corpus is None and index is None:
                raise ValueError("a corpus or a saved index is needed unless a retriever URL is given")
            from selfevo.search.index import get_retriever, index_kind

            retriever_kind = index_kind(index) if index is not None and retriever_kind is None else retriever_kind
            index_dir = index_dir or out_dir / f"{retriever_kind or 'bm25'}-index"
            retriever = get_retriever(corpus=corpus, index=index, kind=retriever_kind, cache_dir=index_dir,
                                      options=dense_options, progress=progress)
        closing.callback(_close, retriever)
        search = search or SearchConfig()  # paper: identical budget for every row (3 passages, 5 searches)
        tool = SearchTool(retriever, topk=search.topk, max_calls=search.max_calls)
        # paths by where they are, not how they were written (./qa and /home/me/qa are one directory; "qa" names
        # nothing read from another directory): the resume key's and score.json's, as a run's config.json
        run_info = {
            "agent": shown_url(agent),  # score.json's: a remote endpoint's credentials are not written
            "data_dir": str(Path(data_dir).resolve()),
            "corpus": None if retriever_url or corpus is None else str(Path(corpus).resolve()),
            "retriever_url": shown_url(retriever_url) if retriever_url else None,  # (as the agent: no password)
            "retriever": None if retriever_url else getattr(retriever, "kind", "bm25"),
            "index": None if index is None or retriever_url else str(Path(index).resolve()),
            "setup_seconds": round(time.perf_counter() - started, 3),  # loading + indexing
        }
        # what makes a stopped evaluation in out_dir this one, so that a rerun continues it: what the
        # agent is and how it is set up (not how many workers run it), and what it searches
        same = {k: run_info[k] for k in ("agent", "retriever_url", "retriever", "data_dir", "corpus", "index")}
        same["agent_settings"] = {k: v for k, v in (agent_context or {}).items() if k != "workers"}
        # an lm: agent's model rewritten (retrained) between the two
        same["agent_files"] = files = agent_files(agent)
        if files is not None:  # an lm: agent is its files (`lm:model` and `lm:/abs/model` are one), not its spec
            same["agent"] = "lm"
        # an agent of a user's says what it is beyond its spec (a version, its weights' digest) by an `identity`:
        # a stopped evaluation goes on only with the same one, where answers of two versions were mixed
        if (identity := getattr(solver, "identity", None)) is not None:
            same["agent_identity"] = identity() if callable(identity) else identity
            if problem := json_problem(same["agent_identity"]):
                raise ValueError(f"agent {agent!r}: its identity is written to score.json and the resume key, so a "
                                 f"JSON value: {problem}")
        # score.json's too: two evaluations of one lm: agent with other --lm-set values (or a policy file retrained
        # under one name) wrote score files no one could tell apart
        run_info |= {k: same[k] for k in ("agent_settings", "agent_files") if same[k]}
        if "agent_identity" in same:  # whatever it is (0 and "" too)
            run_info["agent_identity"] = same["agent_identity"]
        if run_info["retriever"] in ("dense", "hybrid") and dense_options is not None:
            same["encoder"] = {k: v for k, v in asdict(dense_options).items()
                               if k not in ("batch_size", "device")}
        # what the paths held: a corpus rewritten in place, an index rebuilt with other weights
        from selfevo.search.index import index_identity

        same["corpus_sha256"] = getattr(retriever, "corpus_sha256", None)
        same["encoder_fingerprint"] = index_identity(retriever)["encoder"]
        return evaluate_solver(solver, data, tool, out_dir=out_dir, limit=limit,
                               progress=progress, run_info=run_info, partial_key=same)
