"""The spot check of `selfevo index import`: how far the vector stored for a passage may sit from the
encoder's own before the import refuses it, measured on what should pass and what should not.

    python benchmarks/adopt_check.py [--every 100] [--out docs/benchmarks.md]

Passages: every `--every`-th line of ../shared/data/corpus/wiki18-mini.jsonl. Encoder: the bundled
all-MiniLM-L6-v2 (offline), float32 on the CPU, as `search.dense.Encoder` runs it. For each way an
index built elsewhere can differ, each passage's stored vector is made that way and its cosine to
the encoder's vector is taken:

- should pass: the same model run in float16 or bfloat16 (FlashRAG's and Search-R1's builds use
  fp16), in other batches (other padding);
- should be refused: a "passage: " prefix the encoder does not add (or the reverse), a shorter token
  limit (64 tokens), rows shifted by one against the corpus's lines.

A stored row passes when its cosine is at least `adopt.MIN_COSINE`; an import is refused if any of
the rows it checks (64 by default) falls below. The table gives, for each case, the lowest and median
cosine, the share of rows below the threshold and the chance that 64 rows drawn like these all pass
(a case the check would miss). Writes "## Index import: the spot check" of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
from _common import REPO, machine_line, write_section  # noqa: E402

from selfevo.search.adopt import MIN_COSINE, SPOT_CHECK  # noqa: E402
from selfevo.search.dense import Encoder  # noqa: E402

HEADING = "## Index import: the spot check"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=int, default=100, help="take every N-th passage of the corpus")
    ap.add_argument("--corpus", type=Path, default=REPO.parent / "shared" / "data" / "corpus" / "wiki18-mini.jsonl")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md")
    args = ap.parse_args()
    with open(args.corpus, encoding="utf-8") as fh:
        texts = [json.loads(line)["contents"] for i, line in enumerate(fh) if i % args.every == 0]
    import torch

    enc = Encoder()
    st = enc._st

    def encode(items: list[str], batch: int = 32) -> np.ndarray:
        return st.encode(items, batch_size=batch, normalize_embeddings=True, convert_to_numpy=True).astype(np.float32)

    own = encode(texts)
    cases: dict[str, tuple[str, np.ndarray]] = {}
    for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        st.to(dtype)
        cases[f"same model in {name}"] = ("pass", encode(texts, batch=7))
        st.to(torch.float32)
    cases["same model, batches of 1"] = ("pass", encode(texts, batch=1))
    cases['a "passage: " prefix the encoder does not add'] = ("refuse", encode(["passage: " + t for t in texts]))
    limit = st.max_seq_length
    st.max_seq_length = 64
    cases[f"a 64-token limit (the encoder's: {limit})"] = ("refuse", encode(texts))
    st.max_seq_length = limit
    cases["rows shifted by one against the corpus"] = ("refuse", np.roll(own, 1, axis=0))
    tokens = [len(st.tokenizer(t)["input_ids"]) for t in texts]

    lines = [HEADING, "",
             f"Command: `python benchmarks/adopt_check.py --every {args.every}`  ",
             f"Machine: {machine_line()}  ",
             f"Passages: every {args.every}th of wiki18-mini ({len(texts)}; median {int(np.median(tokens))} tokens, "
             f"longest {max(tokens)}); encoder all-MiniLM-L6-v2 in float32 (`search.dense.Encoder`); threshold "
             f"`adopt.MIN_COSINE` = {MIN_COSINE}; a check reads {SPOT_CHECK} rows. `all {SPOT_CHECK} pass` = "
             f"(1 − share below)^{SPOT_CHECK}, the chance that the check misses a case that should be refused.", "",
             f"| stored vectors | should | lowest cosine | median | share below {MIN_COSINE} "
             f"| all {SPOT_CHECK} pass |",
             "|---|---|---:|---:|---:|---:|"]
    ok = True
    for name, (should, stored) in cases.items():
        cos = np.einsum("ij,ij->i", own, stored) / np.linalg.norm(stored, axis=1)
        below = float((cos < MIN_COSINE).mean())
        miss = (1 - below) ** SPOT_CHECK
        ok &= (below == 0) if should == "pass" else miss < 1e-3
        lines.append(f"| {name} | {should} | {cos.min():.4f} | {np.median(cos):.4f} | {below:.3f} | {miss:.2g} |")
    lines += ["", f"Every case on the side it should be (passes: no row below; refused: all {SPOT_CHECK} rows "
              f"passing less likely than 1 in 1,000): {'yes' if ok else 'NO'}."]
    write_section(args.out, HEADING, "\n".join(lines), title="# Benchmarks")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
