#!/usr/bin/env bash
# Packs what benchmarks/gpu_check.sh needs on a lent GPU machine that reaches no network and takes at
# most 64 MiB a call (the device tool's limit): the shipped SmolLM2 GGUF (94 MiB) split in two, the
# corpus (gzip) and benchmarks, and Python 3.12 wheels of selfevo's dependencies that machine may lack.
#   bash benchmarks/gpu_pack.sh          # here, in the repository root; writes .dev1/ and .dev2/
# Then two calls to the same warm machine, the second within its idle time (30 s) of the first:
#   1. carry [".dev1"]:  bash benchmarks/gpu_unpack.sh keep
#   2. carry [".dev2"]:  source benchmarks/gpu_unpack.sh && STEPS="2 3 4" bash benchmarks/gpu_check.sh
# Both folders are ignored by git (.git/info/exclude) and never committed; they hold data from ../shared.
set -euo pipefail
SHARED=${SHARED:-../shared/data}
PY=${PY:-python3}
grep -qx '/.dev1/' .git/info/exclude 2>/dev/null || printf '/.dev1/\n/.dev2/\n/.devkeep/\n' >> .git/info/exclude
rm -rf .dev1 .dev2 && mkdir -p .dev1 .dev2/whl
gguf=$($PY -c "from selfevo.agents.lm.model import smollm2_gguf; print(smollm2_gguf())")
split -b 50M "$gguf" .dev1/gguf.part-
mv .dev1/gguf.part-ab .dev2/
[ ! -e .dev1/gguf.part-ac ] || { echo "the GGUF is larger than two parts" >&2; exit 1; }
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > .dev2/gguf.sha256
gzip -c "$SHARED/corpus/wiki18-mini.jsonl" > .dev1/wiki18-mini.jsonl.gz
cp -r "$SHARED/qa" .dev1/qa
# the versions this venv runs (pure Python but pydantic-core); `pip install --target` there puts them
# ahead of that machine's own, so the code runs on what it was tested with
names="bm25s peft gguf typer click shellingham tenacity networkx fastapi starlette uvicorn httpx httpcore h11 anyio
sniffio pydantic pydantic_core annotated-types typing-inspection annotated-doc rich markdown-it-py mdurl pygments
certifi idna typing_extensions opentelemetry-api"
pins=$($PY -c "import importlib.metadata as m, sys; print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" $names)
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .dev2/whl $pins
du -sh .dev1 .dev2
