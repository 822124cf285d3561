"""Rollout throughput of the language-model backend on this machine: batched generation with the
KV cache (what `LMPolicy.generate` does) against one prompt at a time, same model, same prompts,
greedy, the same token budget.

    python benchmarks/rollout.py [--model smollm2-135m] [--prompts 16] [--new-tokens 64]
                                 [--repeats 3] [--threads 2] [--device cpu] [--dtype float32]
                                 [--out docs/benchmarks.md]

Three ways to generate the first solver action for `--prompts` benchmark questions
(../shared/data/qa, the Search-R1 system prompt, a LoRA adapter active as in training):
  batched      all prompts in one left-padded batch, KV cache on (the backend's path)
  sequential   one prompt at a time, KV cache on
  no-cache     one prompt at a time, KV cache off (every new token recomputes the whole prefix)
Stop strings are off so every row generates the same budget and the rates compare like with like;
tokens counted are the generated ones (eos padding excluded). Median of `--repeats` runs.
Writes the "## Rollout throughput (LM backend)" section of docs/benchmarks.md (with a device other
than the CPU: "## Rollout throughput (LM backend, GPU)").
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
from selfevo.agents.lm.protocol import solver_messages
from selfevo.corpus import read_qa_dir

HEADING = "## Rollout throughput (LM backend"  # + ")" or ", GPU)"


def prompts(qa_dir: Path, n: int) -> list[list[dict]]:
    data = read_qa_dir(qa_dir)
    per = -(-n // len(data))
    qs = [it.question for items in data.values() for it in items[:per]][:n]
    return [solver_messages(q) for q in qs]


def run_mode(policy: LMPolicy, convs: list[list[dict]], mode: str, new_tokens: int) -> tuple[int, float]:
    tok, model = policy.tokenizer, policy.peft
    policy.peft.set_adapter("bench")
    texts = [policy.render(c) for c in convs]
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, temperature=None,
                  top_p=None, top_k=None, pad_token_id=tok.pad_token_id, use_cache=mode != "no-cache")
    batches = [texts] if mode == "batched" else [[t] for t in texts]
    generated = 0
    start = time.perf_counter()
    with torch.no_grad():
        for batch in batches:
            enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            out = model.generate(**enc, **kwargs)
            generated += int((out[:, enc["input_ids"].shape[1]:] != tok.pad_token_id).sum())
    return generated, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--qa-dir", type=Path, default=REPO.parent / "shared" / "data" / "qa")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="batched,sequential,no-cache")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md")
    args = ap.parse_args()

    policy = LMPolicy(LMConfig(model=args.model, device=args.device, dtype=args.dtype, threads=args.threads))
    policy.new("bench")
    convs = prompts(args.qa_dir, args.prompts)
    rows = {}
    for mode in args.modes.split(","):
        runs = [run_mode(policy, convs, mode, args.new_tokens) for _ in range(args.repeats)]
        secs = statistics.median(s for _, s in runs)
        rows[mode] = (runs[0][0], secs, runs[0][0] / secs)
    base = rows.get("sequential", next(iter(rows.values())))[2]

    table = Table(title=f"rollout throughput: {args.model}, {args.prompts} prompts x {args.new_tokens} tokens")
    for col in ("mode", "tokens", "seconds (median)", "tokens/s", "vs sequential"):
        table.add_column(col, justify="right")
    for mode, (n, secs, rate) in rows.items():
        table.add_row(mode, str(n), f"{secs:.2f}", f"{rate:.1f}", f"{rate / base:.2f}x")
    Console().print(table)

    gpu = args.device != "cpu"
    where = device_line(args.device, args.dtype, args.threads)
    lines = [HEADING + (", GPU)" if gpu else ")"), "",
             f"`python benchmarks/rollout.py --model {args.model} --prompts {args.prompts} --new-tokens "
             f"{args.new_tokens} --repeats {args.repeats} --threads {args.threads} --device {args.device} --dtype "
             f"{args.dtype} --modes {args.modes}` — {machine_line()}; "
             f"{where}, a LoRA adapter (r={policy.cfg.lora_r}) active; greedy; "
             f"the first solver action of {args.prompts} benchmark questions; median of {args.repeats} runs.", "",
             "| mode | generated tokens | seconds | tokens/s | vs sequential |", "|---|---:|---:|---:|---:|"]
    for mode, (n, secs, rate) in rows.items():
        lines.append(f"| {mode} | {n} | {secs:.2f} | {rate:.1f} | {rate / base:.2f}x |")
    legend = {"batched": "one left-padded batch with the KV cache (`LMPolicy.generate`)",
              "sequential": "one prompt at a time with the KV cache",
              "no-cache": "one at a time, recomputing the prefix for every token"}
    lines += ["", "; ".join(f"{mode}: {legend[mode]}" for mode in rows) + "."]
    if gpu:
        peak = torch.cuda.max_memory_allocated(torch.device(args.device)) / 2**30
        lines.append(f"Peak GPU memory allocated by the process (model, adapter, KV caches): {peak:.2f} GiB.")
    write_section(args.out, lines[0], "\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
