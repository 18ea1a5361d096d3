#!/bin/bash
# The GPU checks and the TRL comparison on one GPU of either size this project measures on (an H100 80GB, an H200
# 143GB), once vLLM and Megatron-core are importable (docs/gpu.md, "Checks on a GPU machine"). From the repo root:
#
#   bash tests/gpu/run_gpu.sh OUT_DIR [PART...]      PART: tests | trl | asyncrl | bench | all (default: tests)
#
#   tests    every file of tests/gpu in one process, as docs/gpu.md's line runs them: pytest_gpu.log and each file's
#            numbers (*.json, gpu_memory.json: what each file held before and after) in OUT_DIR.
#            ~200 s on an H200 (2026-12-04), ~330 s on an H100 (2026-12-05, before the files gave the card back).
#   trl      TRL's side of benchmarks/bench_trl_gpu.py (defaults: 3 warm-up + 8 timed steps) into $BENCH_DIR;
#            ~25 s for the model directory, ~125 s TRL's start, 11 steps of ~12 s: ~5 min on an H100.
#   asyncrl  asyncrl's side (sync then async, 3 + 8 steps each), reusing TRL's result in $BENCH_DIR: the run
#            directory of both (meta.json, rows.csv, steps.csv, trl.json, asyncrl.json) into OUT_DIR;
#            ~115 s to build, 11 steps of ~6.5 s (sync) and ~5.8 s (async): ~5 min on an H100.
#   bench    trl then asyncrl in one call (~10 min on an H100: over a 10-minute call's limit; there, two calls:
#            `trl`, then `asyncrl` on the same warm machine, since $BENCH_DIR and the model directory stay in /tmp)
#   peer     both sides in one invocation of bench_trl_gpu.py into OUT_DIR (what issue 48's targets ask; ~10 min:
#            under tests/gpu/run_bg.sh). TRL_ARGS are passed on to bench_trl_gpu.py (e.g. --set KEY=VALUE)
#   all      tests then bench
#   notebook notebooks/gpu_quickstart.ipynb (or $NOTEBOOK) through nbclient (tests/gpu/run_notebook.py; NB_WHEELS from tests/gpu/stage_notebook.sh go into $SITE if needed): <name>.summary.json, the executed notebook, notebook.log; ~2-3 min on an H100
#   lora     benchmarks/bench_lora_gpu.py --preset gpu_lora_8b (8B LoRA; 3 + LORA_STEPS=4 steps a mode): 5 files, ~7-10 min
#   agents   benchmarks/bench_agents_gpu.py (the countdown tool task: multi- vs single-turn tokens/s, prefix-cache hits, async/sync) into OUT_DIR: ~4 min on an H100
#   decode   benchmarks/bench_vllm_decode_gpu.py (vLLM alone on the peer bench's generation work; $DECODE_ARGS passed on) into OUT_DIR/decode: ~4 min
#   mfu      benchmarks/bench_mfu_gpu.py (Megatron step variants at the 0.5B shape; $MFU_ARGS passed on) into OUT_DIR/mfu: ~4.5 min
#
# GPU_TESTS (the tests part): the files to run instead of all of tests/gpu, in one process all the same.
# Environment: SITE=DIR puts a `pip install --target DIR` folder first on PYTHONPATH (kept: PYTHONPATH=$SITE:$PWD);
# TRL_WHEELS=DIR installs the wheels in DIR into $SITE first when trl is not importable (trl 1.16.0, datasets
# 5.2.0, multiprocess 0.70.19, xxhash 4.1.0 beside the vLLM image: /work/shared/gpu/README.md);
# BENCH_DIR (default /tmp/bench_trl_gpu), MODEL_DIR (default /tmp/qwen). The commit recorded is this project's
# (benchmarks/record.py: ASYNCRL_COMMIT, else a carried .asyncrl-commit stamp, else "unknown").
# Files back from a lent machine: at most 8 a call; each part writes at most 7 into OUT_DIR.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/out}}
shift || true
PARTS=${*:-tests}
[ "$PARTS" = all ] && PARTS="tests trl asyncrl"
[ "$PARTS" = bench ] && PARTS="trl asyncrl"
BENCH_DIR=${BENCH_DIR:-/tmp/bench_trl_gpu}
MODEL_DIR=${MODEL_DIR:-/tmp/qwen}
mkdir -p "$OUT" "$BENCH_DIR"
export PYTHONPATH=${SITE:+$SITE:}$PWD VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, megatron.core, vllm, transformers; print('torch', torch.__version__, '| megatron-core',
megatron.core.__version__, '| vllm', vllm.__version__, '| transformers', transformers.__version__)" 2>&1 | tail -1
python3 benchmarks/record.py  # the commit this run will record, and where it comes from
rc=0
for part in $PARTS; do
  t=$SECONDS
  case "$part" in
  tests)
    ASYNCRL_GPU_RESULTS="$OUT" ASYNCRL_TOOL_MODEL_DIR="${TOOL_MODEL_DIR:-/tmp/countdown-tools}" python3 -m pytest -o addopts="" -p no:cacheprovider -q -rs -s -W ignore ${GPU_TESTS:-tests/gpu} \
      >"$OUT/pytest_gpu.log" 2>&1
    r=$?
    grep -E "^RESULT gpu_memory|passed|failed|^E  |Error|SKIPPED|Free memory on device" "$OUT/pytest_gpu.log" | cut -c1-300 | tail -n 40 ;;
  trl|asyncrl|peer)
    if [ "$part" != asyncrl ] && ! python3 -c "import trl, datasets" 2>/dev/null; then
      [ -n "${TRL_WHEELS:-}" ] && [ -n "${SITE:-}" ] || { echo "trl is not importable: set SITE and TRL_WHEELS"; exit 2; }
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$TRL_WHEELS"/*.whl || exit 2
    fi
    sides=trl,asyncrl  # asyncrl: TRL's result of the earlier call is reused, then both go into one run directory
    [ "$part" = trl ] && sides=trl
    if [ "$part" = asyncrl ] && [ ! -f "$BENCH_DIR/trl.json" ]; then
      sides=asyncrl  # a fresh machine: TRL's side would not fit this call too (merge later: docs/gpu.md)
      echo "no TRL result in $BENCH_DIR (a fresh machine?): asyncrl's side alone"
    fi
    where="$BENCH_DIR"; reuse=--reuse
    [ "$part" = peer ] && { sides=trl,asyncrl; where="$OUT"; reuse=; }
    python3 benchmarks/bench_trl_gpu.py --sides "$sides" $reuse ${TRL_ARGS:-} \
      --model-dir "$MODEL_DIR" --out "$where" 2>&1 | tee "$OUT/call_$part.log" | \
      grep -v -E "^(INFO|WARNING|DEBUG) |^\[rank|it/s\]|^Writing|^Loading" | tail -n 60
    r=${PIPESTATUS[0]}
    if [ "$part" = peer ]; then :; elif [ "$part" = trl ]; then cp "$BENCH_DIR/trl.json" "$OUT/" 2>/dev/null; else
      cp "$BENCH_DIR"/{meta.json,rows.csv,steps.csv,trl.json,asyncrl.json} "$OUT/" 2>/dev/null; fi ;;
  notebook)
    if ! python3 -c "import nbclient, ipykernel, ipywidgets, matplotlib_inline" 2>/dev/null; then
      [ -n "${NB_WHEELS:-}" ] && [ -n "${SITE:-}" ] || { echo "nbclient is not importable: set SITE and NB_WHEELS"; exit 2; }
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$NB_WHEELS"/*.whl || exit 2
    fi
    python3 tests/gpu/run_notebook.py "${NOTEBOOK:-notebooks/gpu_quickstart.ipynb}" --out "$OUT" >"$OUT/notebook.log" 2>&1
    r=$?
    grep -v -E "^(INFO|WARNING|DEBUG) |^\[rank" "$OUT/notebook.log" | cut -c1-300 | tail -n 40 ;;
  lora)
    python3 benchmarks/bench_lora_gpu.py --preset gpu_lora_8b --steps "${LORA_STEPS:-4}" --warmup 3 --out "$OUT" \
      2>&1 | tee "$OUT/call_lora.log" | grep -v -E "^(INFO|WARNING|DEBUG) |^\[rank|it/s\]|^Writing|^Loading" | tail -n 60
    r=${PIPESTATUS[0]} ;;
  agents)
    python3 benchmarks/bench_agents_gpu.py --out "$OUT" --model-dir "${TOOL_MODEL_DIR:-/tmp/countdown-tools}" 2>&1 | \
      tee "$OUT/bench_agents_gpu.log" | grep -v -E "^(INFO|WARNING|DEBUG) |^\[rank|it/s\]|^Writing|^Loading" | tail -n 40
    r=${PIPESTATUS[0]} ;;
  mfu)
    mkdir -p "$OUT/mfu"
    python3 benchmarks/bench_mfu_gpu.py ${MFU_ARGS:-} --out "$OUT/mfu" 2>&1 | tee "$OUT/mfu/run.log" | \
      grep -v -E "^(INFO|WARNING|DEBUG) |Warning|warnings.warn|^USDT|^\[rank" | tail -n 70
    r=${PIPESTATUS[0]} ;;
  decode)
    mkdir -p "$OUT/decode"
    python3 benchmarks/bench_vllm_decode_gpu.py --model-dir "$MODEL_DIR" ${DECODE_ARGS:-} --out "$OUT/decode" 2>&1 | \
      tee "$OUT/decode/run.log" | grep -v -E "^(INFO|WARNING|DEBUG) |^\(EngineCore|Warning|warnings.warn" | tail -n 40
    r=${PIPESTATUS[0]} ;;
  *) echo "unknown part $part (the parts: this file's header)"; exit 2 ;;
  esac
  echo "=== $part: rc=$r, $((SECONDS - t)) s"
  [ "$r" = 0 ] || rc=$r
done
exit $rc
