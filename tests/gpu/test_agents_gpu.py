"""The countdown tool task end to end on one GPU (issue 46): ``gpu_countdown_tools`` with vLLM generating and
Megatron-core training, colocated, asynchronously (``weight_fifo`` W=1), through the controller, on the chat model
directory ``benchmarks/tool_model.py`` builds offline (warm-started so that tool calls happen).

Asserted: trajectories of more than one turn and tool calls; the tool results' tokens in the train batches have
loss mask 0 and no logprob; ``turn_versions`` and ``token_versions`` filled and consistent; every admitted group
trained, evicted, aborted or skipped exactly once, or still held; vLLM's prefix cache hit (prefix caching within a
weight version). Numbers go to stdout and, with ``ASYNCRL_GPU_RESULTS``, to ``agents_gpu.json`` there.
``ASYNCRL_TOOL_MODEL_DIR`` reuses a directory an earlier build left whole (default: a fresh one, ~30 s on an H100).
Skipped without CUDA, vLLM and Megatron-core."""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core")
pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_agents_gpu import STATS_ON, cache_delta, prefix_cache_counts  # noqa: E402
from tool_model import ensure_tool_model_dir  # noqa: E402

from asyncrl import Controller, load_config  # noqa: E402
from tests.gpu.results import Results  # noqa: E402
from tests.test_countdown_tools import assert_observations_masked  # noqa: E402

STEPS = 4
RESULTS = Results("agents_gpu")
record = RESULTS.record


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = os.environ.get("ASYNCRL_TOOL_MODEL_DIR") or str(tmp_path_factory.mktemp("countdown_tools"))
    info = ensure_tool_model_dir(path)
    record("tool_model", info)
    torch.cuda.empty_cache()
    return path


def test_the_countdown_tool_task_runs_end_to_end_on_vllm_and_megatron_asynchronously(model_dir):
    cfg = load_config("gpu_countdown_tools", model={"hf_path": model_dir}, generation=STATS_ON)
    t0 = time.perf_counter()
    with Controller.from_config(cfg) as ctrl:
        record("controller_build_s", round(time.perf_counter() - t0, 1))
        assert type(ctrl.generator).__name__ == "TurnGenerator" and type(ctrl.policy).__name__ == "MegatronPolicy"
        groups, batches = [], []
        poll, train = ctrl.generator.poll, ctrl.policy.train_microbatches
        ctrl.generator.poll = lambda *a, **k: (lambda out: (groups.extend(out), out)[1])(poll(*a, **k))
        ctrl.policy.train_microbatches = lambda batch: (batches.append(batch), train(batch))[1]
        before = prefix_cache_counts(ctrl.generator)
        t1 = time.perf_counter()
        ctrl.run(STEPS, progress=False)
        wall = time.perf_counter() - t1
        cache = cache_delta(before, prefix_cache_counts(ctrl.generator))
        assert ctrl.trainer_version == STEPS and groups and batches

        # multi-turn, with tool calls, every turn's version
        trajectories = [t for g in groups for t in g.turns]
        assert max(t["turns"] for t in trajectories) > 1, "no trajectory went past its first turn"
        assert sum(t["tool_calls"] for t in trajectories) > 0, "no tool call"
        for g in groups:
            for ids, mask, versions, meta in zip(g.completion_ids, g.trained_mask, g.token_versions, g.turns):
                assert len(mask) == len(ids) and len(ids) - sum(mask) == meta["env_tokens"]
                assert len(versions) == sum(mask) and len(meta["turn_versions"]) == meta["turns"]
                assert set(versions) == set(meta["turn_versions"])
            assert g.gen_start_version == min(v for t in g.turns for v in t["turn_versions"])
        rows = ctrl.completions
        assert {"turns", "tool_calls", "env_tokens", "turn_versions"} <= set(rows.columns)
        assert (rows.turns > 1).any() and (rows.tool_calls > 0).any()
        assert all(len(v) == t for v, t in zip(rows.turn_versions, rows.turns))

        # the tool results are context: loss mask 0 and no logprob in what Megatron trained on, row by row
        observed = assert_observations_masked(batches, groups)
        assert observed > 0, "no tool result reached a train batch"

        # nothing lost: every admitted group ends exactly once, or is still held
        trace = ctrl.trace
        ends = Counter(trace[trace.event.isin(["select", "evict", "abort", "skip"])].group_id.astype(int))
        for gid in set(trace[trace.event == "dispatch"].group_id.astype(int)):
            assert ends[gid] + int(gid in ctrl.buffer) == 1, f"group {gid}"
        faults = trace[trace.event == "fault"]
        assert faults.empty, faults.detail.tolist()[:3]  # a tool's error is the model's to read, never a fault
        if cache["prefix_cache_queries"] == cache["prefix_cache_queries"]:  # vLLM kept counts (stats on)
            assert cache["prefix_cache_hits"] > 0, cache

        m = ctrl.metrics
        record("agents_gpu", {
            "steps": STEPS, "wall_s": round(wall, 2), "steps_per_s": round(STEPS / wall, 3),
            "groups": len(groups), "trajectories": len(trajectories),
            "turns_mean": sum(t["turns"] for t in trajectories) / len(trajectories),
            "multi_turn_share": sum(t["turns"] > 1 for t in trajectories) / len(trajectories),
            "tool_calls_per_trajectory": sum(t["tool_calls"] for t in trajectories) / len(trajectories),
            "env_tokens_mean": sum(t["env_tokens"] for t in trajectories) / len(trajectories),
            "spanning_groups": sum(g.gen_start_version != g.gen_end_version for g in groups),
            "reward_mean": float(m.reward_mean.mean()), "lag_max": int(m.lag_max.max()),
            "gen_tokens_per_s_median": float(m.gen_tokens_per_s.median()) if "gen_tokens_per_s" in m else None,
            "observation_tokens_in_batches": observed, **cache})
