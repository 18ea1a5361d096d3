#!/bin/bash
# issue 48: the changes after the 00:45 run on a GPU, checks only: the varlen kernel as one row (eager and in compiled
# layers) against the unfused path, and real vLLM's sampled-token logprobs (flat) against transformers'
export SITE=/tmp/site
GPU_TESTS="tests/gpu/test_flex_attention.py tests/test_vllm_backend.py::test_real_vllm_samples_groups_with_logprobs_of_the_sampled_tokens" \
  bash tests/gpu/run_gpu.sh $OUT/checks tests
