"""Where a decoding step of the language-model backend spends its time: milliseconds per generated
token for 1..N rows in one batch, with the policy's LoRA adapter off and on and with the backend's
stop strings, then a torch profile of the steps of one row (operator calls a step, time on the
device against wall time: a step whose device time is a small part of its wall time is bound by
launching operators, not by arithmetic, and batching rows is then nearly free).

    python benchmarks/decode_profile.py [--model smollm2-135m] [--rows 1,8,32] [--new-tokens 32]
                                        [--device cpu] [--dtype float32] [--threads 2] [--out docs/benchmarks.md]

A step's time is the decode time alone: (time of `new-tokens` tokens - time of one token) /
(`new-tokens` - 1), so the prompt's prefill is left out; every row generates the whole budget
(greedy, `min_new_tokens`), one benchmark question's first solver action repeated in every row.
Median of `--repeats` timings. Writes the "## Decoding step profile (LM backend[, GPU])" section.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from _common import REPO, device_line, machine_line, write_section
from rich.console import Console
from rich.table import Table

from selfevo.agents.lm.config import LMConfig
from selfevo.agents.lm.policy import LMPolicy
from selfevo.agents.lm.protocol import STOP_STRINGS, solver_messages
from selfevo.corpus import read_qa_dir

HEADING = "## Decoding step profile (LM backend"  # + ")" or ", GPU)"


def rows_label(n: int) -> str:
    return f"{n} row{'s' * (n > 1)}"


def generate(policy: LMPolicy, name: str | None, text: str, rows: int, tokens: int, stops: bool) -> None:
    """`rows` copies of `text` continued by policy `name` (None: the base model, the adapter off)."""
    tok = policy.tokenizer
    enc = tok([text] * rows, return_tensors="pt", padding=True, add_special_tokens=False).to(policy.device)
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, temperature=None, top_p=None,
                  top_k=None, pad_token_id=tok.pad_token_id, use_cache=True)
    if stops:  # never met with min_new_tokens, but checked at every step, as in LMPolicy.generate
        kwargs.update(stop_strings=list(STOP_STRINGS), tokenizer=tok)
    with torch.no_grad(), policy._active(name) as model:
        model.generate(**enc, **kwargs)
    if policy.device.startswith("cuda"):  # the kernels finished, not only queued
        torch.cuda.synchronize(torch.device(policy.device))


def step_ms(policy: LMPolicy, name: str | None, text: str, rows: int, tokens: int, stops: bool,
            repeats: int) -> float:
    def timed(n: int) -> float:
        start = time.perf_counter()
        generate(policy, name, text, rows, n, stops)
        return time.perf_counter() - start

    timed(2)  # warm-up: kernels chosen, caches allocated
    diffs = [timed(tokens) - timed(1) for _ in range(repeats)]
    return 1000 * statistics.median(diffs) / (tokens - 1)


def profile_rows(policy: LMPolicy, text: str, rows: int, tokens: int) -> tuple[list[tuple[str, int, float]], dict]:
    """A generation of `rows` rows (LoRA and stop strings on) under torch.profiler: the top operators
    by self time (name, calls a step, ms a step) and the totals a step: operator calls (nested ones
    counted), kernels launched, host time of the operators, device time of the kernels, wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gpu = policy.device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    generate(policy, "bench", text, rows, 2, True)
    with profile(activities=acts) as prof:
        start = time.perf_counter()
        generate(policy, "bench", text, rows, tokens, True)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:8]
    per = 1 / tokens  # the prefill is one of `tokens` forward passes: counted in
    table = [(e.key, round(e.count * per), getattr(e, key) / 1000 * per) for e in top]
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    totals = {"operator calls": round(sum(e.count for e in events if e.device_type == DeviceType.CPU) * per),
              "kernels": round(sum(e.count for e in kernels) * per) if gpu else None,
              "host ms": sum(e.self_cpu_time_total for e in events) / 1000 * per,
              "device ms": sum(e.self_device_time_total for e in events) / 1000 * per if gpu else None,
              "wall ms": 1000 * wall * per}
    return table, totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--qa-dir", type=Path, default=REPO.parent / "shared" / "data" / "qa")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md")
    args = ap.parse_args()
    if args.new_tokens < 2:
        ap.error("--new-tokens: at least 2 (a step's time is the difference to one token)")

    policy = LMPolicy(LMConfig(model=args.model, device=args.device, dtype=args.dtype, threads=args.threads))
    policy.new("bench")
    question = next(iter(read_qa_dir(args.qa_dir).values()))[0].question
    text = policy.render(solver_messages(question))
    variants = {"base model": (None, False), "LoRA": ("bench", False), "LoRA + stop strings": ("bench", True)}
    rows = [int(r) for r in args.rows.split(",")]
    ms = {label: [step_ms(policy, name, text, n, args.new_tokens, stops, args.repeats) for n in rows]
          for label, (name, stops) in variants.items()}
    profiles = {n: profile_rows(policy, text, n, args.new_tokens) for n in dict.fromkeys((rows[0], rows[-1]))}

    table = Table(title=f"ms per decoding step: {args.model}, {args.device}, {args.dtype}")
    table.add_column("variant")
    for n in rows:
        table.add_column(rows_label(n), justify="right")
    for label, values in ms.items():
        table.add_row(label, *(f"{v:.1f}" for v in values))
    Console().print(table)
    for n, (_, totals) in profiles.items():
        print(n, "rows:", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in totals.items()})

    gpu = policy.device.startswith("cuda")
    lines = [HEADING + (", GPU)" if gpu else ")"), "",
             f"`python benchmarks/decode_profile.py --model {args.model} --rows {args.rows} --new-tokens "
             f"{args.new_tokens} --repeats {args.repeats} --threads {args.threads} --device {args.device} "
             f"--dtype {args.dtype}` — {machine_line()}; torch {torch.__version__}; "
             f"{device_line(policy.device, args.dtype, args.threads)}; LoRA r="
             f"{policy.cfg.lora_r} on {', '.join(policy.cfg.lora_targets)}; greedy, every row the whole budget; "
             f"decode steps only (prefill left out); median of {args.repeats}.", "",
             "| ms per decoding step | " + " | ".join(rows_label(n) for n in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    lines += [f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + " |" for label, values in ms.items()]
    for n, (top, totals) in profiles.items():
        kernels = (f", {totals['kernels']} kernels launched, {totals['device ms']:.1f} ms of kernel time on the GPU"
                   if gpu else "")
        lines += ["", f"{rows_label(n)} with LoRA and stop strings under torch.profiler, a step (the prefill "
                  f"counted as one of {args.new_tokens}): {totals['operator calls']} operator calls (nested ones "
                  f"counted), {totals['host ms']:.1f} ms of operator time on the host{kernels}, "
                  f"{totals['wall ms']:.1f} ms of wall time (the profiler's own overhead included). Top operators by "
                  f"self {'GPU' if gpu else 'CPU'} time:", "",
                  "| operator | calls a step | ms a step |", "|---|---:|---:|"]
        lines += [f"| `{name[:80]}` | {calls} | {t:.2f} |" for name, calls, t in top]
    write_section(args.out, lines[0], "\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
