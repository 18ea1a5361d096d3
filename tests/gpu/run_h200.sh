#!/bin/bash
# The GPU backends' checks on an H200, once vLLM and Megatron-core are installed (docs/gpu.md; SITE=DIR adds a
# `pip install --target DIR` folder to PYTHONPATH)
# (benchmarks/README.md, "GPU backends (H200)"). From the repo root: bash tests/gpu/run_h200.sh [OUT_DIR]
# Each test file runs in its own process (one vLLM engine per process); numbers land in OUT_DIR/*.json and *.log.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/out}}
mkdir -p "$OUT"
export PYTHONPATH=${SITE:+$SITE:}$PWD VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 ASYNCRL_GPU_RESULTS="$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, megatron.core, vllm, transformers; print('torch', torch.__version__, '| megatron-core',
megatron.core.__version__, '| vllm', vllm.__version__, '| transformers', transformers.__version__)" 2>&1 | tail -1
rc=0
for f in ${TESTS:-tests/test_vllm_backend.py tests/gpu/test_megatron_vllm.py tests/gpu/test_weight_sync.py}; do
  t=$SECONDS
  log="$OUT/$(basename "$f" .py).log"
  timeout "${TEST_TIMEOUT:-170}" python3 -m pytest -o addopts="" -p no:cacheprovider -q -rs -s -W ignore "$f" >"$log" 2>&1
  r=$?
  echo "=== $f: rc=$r, $((SECONDS - t)) s"
  grep -E "^RESULT|passed|failed|^E  |Error|SKIPPED" "$log" | cut -c1-400 | tail -n 25
  [ "$r" = 0 ] || rc=$r
done
exit $rc
