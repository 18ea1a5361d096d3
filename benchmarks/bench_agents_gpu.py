"""The countdown tool task on one GPU (``gpu_countdown_tools``: vLLM and Megatron-core colocated), in one
invocation: the generator's tokens/s multi-turn against the same model single-turn, vLLM's prefix-cache hits, and
asynchronous against synchronous steps/s.

    python benchmarks/bench_agents_gpu.py [--out DIR] [--model-dir DIR] [--groups 16] [--warmup 2] [--steps 6]

The model: the chat model directory ``benchmarks/tool_model.py`` builds offline (~23M parameters, warm-started on
synthetic transcripts that call the tool; ``--model-dir`` reuses one an earlier call left whole). One vLLM engine and
one Megatron policy are built and serve every part (``bench_two_gpus.one_run`` rebuilds the policy between runs).

- **Generator, multi-turn against single-turn** (no training; the directory's weights): ``--groups`` groups of the
  preset's group size, the task's first training prompts. *multi_turn*: the ``TurnGenerator`` the controller would
  wrap the generator in (``asyncrl.multiturn.with_environment``: the calculator in its worker process, up to
  ``max_turns`` turns, each later turn a request whose prompt is the trajectory's whole token prefix), polled until
  every group came back. *single_turn*: the environment off, the same groups' first-turn prompts (the tools rendered)
  as one request each, ``n`` = the group size. ``tokens_per_s``: sampled tokens (the trained ones: observations
  excluded) over the pass's wall seconds (the environment's round trips included); ``engine_tokens_per_s``: the
  generator's own rate per second its engine stepped (``step_metrics``). The prefix cache is reset before each pass,
  so each counts its own hits. An untimed single-turn pass on other prompts warms the engine first.
- **Prefix-cache hits**: prompt tokens looked up / found cached, before and after each pass or run
  (``prefix_cache_counts``): the generator's sum of each finished request's ``num_cached_tokens``, else vLLM's
  counters ``vllm:prefix_cache_queries`` / ``_hits`` through ``LLM.get_metrics()`` (they need vLLM's stats on:
  ``generation.llm_kwargs: {disable_log_stats: false}``, which this bench sets). Within a weight version: the
  generator resets the cache at every weight load.
- **Async against sync**: ``bench_two_gpus.one_run`` of the preset with ``in_order`` L=0 (sync) and its own
  ``weight_fifo`` W=1 (async), ``--warmup`` then ``--steps`` timed steps each: steps/s and each engine's busy time a
  step. On one GPU a ratio from a few steps is noisy (docs/gpu.md, "Before comparing asynchronous with synchronous
  on one GPU"): the steps are few here so the whole bench fits ~4 minutes; raise ``--steps`` for a claim.

Rows through ``benchmarks/record.py`` (``--out``, default ``$OUT``, else ``benchmarks/data/bench_agents_gpu/<UTC>``):
``rows.csv`` (one row per pass or run: ``part`` generator / controller, ``mode``), ``meta.json`` (machine,
versions, commit, the model's build info and ``results``: the ratios and hit rates).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
from record import DATA, meta, save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRESET = "gpu_countdown_tools"
STATS_ON = {"llm_kwargs": {"disable_log_stats": False}}  # vLLM's counters (prefix-cache hits) need its stats on
COLUMNS = ["part", "mode", "groups", "trajectories", "turns_mean", "tool_calls_mean", "sampled_tokens", "env_tokens",
           "wall_s", "tokens_per_s", "engine_tokens_per_s", "prefix_cache_queries", "prefix_cache_hits",
           "prefix_cache_hit_rate", "steps", "steps_per_s", "gen_busy_per_step_s", "train_busy_per_step_s"]


def say(*args) -> None:
    print(*args, flush=True)


def prefix_cache_counts(generator) -> dict | None:
    """Prompt tokens looked up and found in vLLM's prefix cache so far, ``{"queries", "hits"}``, of the engine under
    ``generator`` (a ``VLLMGenerator``, or a ``TurnGenerator`` over one): the generator's own count from each
    finished request's ``num_cached_tokens`` (``VLLMGenerator.prefix_cache_tokens``; a request of ``n`` > 1 counts
    its prompt once), else vLLM's counters ``vllm:prefix_cache_queries`` / ``_hits`` (``LLM.get_metrics()``, stats
    on). None where neither is kept. (The 2026-12-05 H100 data read the counters alone: they did not move within
    the generator passes of ~1-2 s, though they did over the ~10 s controller runs, hence the request counts.)"""
    own = getattr(generator, "prefix_cache_tokens", None)
    if own is not None:
        return own()
    llm = getattr(generator, "llm", None)
    if llm is None:
        return None
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - stats off ("Stat logging disabled") or another vLLM: no counts
        return None
    out = {"queries": 0, "hits": 0}
    for m in metrics:
        if m.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
            out[m.name.rsplit("_", 1)[-1]] += int(getattr(m, "value", 0))
    return out


def cache_delta(before: dict | None, after: dict | None) -> dict:
    """Queries, hits and hit rate between two ``prefix_cache_counts`` (NaN where vLLM kept no counts)."""
    if before is None or after is None:
        return {"prefix_cache_queries": float("nan"), "prefix_cache_hits": float("nan"),
                "prefix_cache_hit_rate": float("nan")}
    queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
    return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else float("nan")}


def engine_rate(generator) -> float:
    """The generator's tokens per second its engine stepped since the last call (NaN where it does not say)."""
    metrics = getattr(generator, "step_metrics", None)
    return metrics()["gen_tokens_per_s"] if metrics is not None else float("nan")


def generator_row(mode: str, groups: list, wall: float, engine_rate: float, cache: dict) -> dict:
    """A generator pass's row from the ``GroupRollouts`` it returned (multi-turn ones carry ``turns``)."""
    sampled = sum(sum(m) if m else len(c) for g in groups
                  for c, m in zip(g.completion_ids, g.trained_mask or [None] * len(g.completion_ids)))
    one = {"turns": 1, "tool_calls": 0, "env_tokens": 0}  # a single-turn completion
    turns = [t for g in groups for t in (g.turns or [one] * len(g.completion_ids))]
    return {"part": "generator", "mode": mode, "groups": len(groups), "trajectories": len(turns),
            "turns_mean": sum(t["turns"] for t in turns) / max(len(turns), 1),
            "tool_calls_mean": sum(t["tool_calls"] for t in turns) / max(len(turns), 1),
            "sampled_tokens": sampled, "env_tokens": sum(t["env_tokens"] for t in turns), "wall_s": wall,
            "tokens_per_s": sampled / wall if wall > 0 else float("nan"), "engine_tokens_per_s": engine_rate, **cache}


def results_of(frame: pd.DataFrame) -> dict:
    """The ratios and hit rates the README reads: multi-turn over single-turn tokens/s (wall and engine), each
    pass's prefix-cache hit rate, async over sync steps/s."""
    def one(part: str, mode: str, column: str) -> float:
        hit = frame[(frame.part == part) & (frame["mode"] == mode)]
        return float(hit[column].iloc[0]) if len(hit) and column in hit else float("nan")

    out = {
        "multi_over_single_tokens_per_s": one("generator", "multi_turn", "tokens_per_s")
        / one("generator", "single_turn", "tokens_per_s"),
        "multi_over_single_engine_tokens_per_s": one("generator", "multi_turn", "engine_tokens_per_s")
        / one("generator", "single_turn", "engine_tokens_per_s"),
        "async_over_sync_steps_per_s": one("controller", "async", "steps_per_s") / one("controller", "sync", "steps_per_s"),
    }
    for part, mode in (("generator", "multi_turn"), ("generator", "single_turn"), ("controller", "sync"),
                       ("controller", "async")):
        out[f"prefix_cache_hit_rate_{mode}"] = one(part, mode, "prefix_cache_hit_rate")
    for mode in ("multi_turn",):
        out["tool_calls_per_trajectory"] = one("generator", mode, "tool_calls_mean")
        out["turns_per_trajectory"] = one("generator", mode, "turns_mean")
    return {k: (None if v != v else v) for k, v in out.items()}  # NaN -> null in meta.json


def table(frame: pd.DataFrame) -> str:
    return frame[[c for c in COLUMNS if c in frame]].to_string(index=False, float_format=lambda x: f"{x:.4g}")


# ---- the passes -------------------------------------------------------------------------------------------------

def multi_turn_pass(cfg, generator, tok, task, prompts: list, first_id: int) -> tuple[dict, list[list[int]]]:
    """The multi-turn pass (module docstring); also each group's first-turn prompt ids (for the single-turn one)."""
    from asyncrl.data import GenerationRequest
    from asyncrl.multiturn import with_environment

    slots = {first_id + i: SimpleNamespace(prompt=p) for i, p in enumerate(prompts)}
    turns, _ = with_environment(cfg, generator, tok, None, lambda gid: slots[gid], task)
    failed = []
    turns.bind(lambda *e: None, lambda gid, turn: False, lambda gid, why: failed.append((gid, why)))
    before, _ = prefix_cache_counts(generator), engine_rate(generator)
    t0 = time.perf_counter()
    turns.submit([GenerationRequest(gid, [], cfg.group_size) for gid in slots])
    out = []
    try:
        while turns.num_inflight():
            out += turns.poll(0.0)  # one turn of every trajectory in flight
    finally:
        turns.host.close()  # the generator under it serves the next pass
    wall = time.perf_counter() - t0
    if failed:
        say(f"  multi-turn: {len(failed)} groups failed, e.g. {failed[0]}")
    row = generator_row("multi_turn", out, wall, engine_rate(generator),
                        cache_delta(before, prefix_cache_counts(generator)))
    order = {g.group_id: g.prompt_ids for g in out}
    return row, [order[gid] for gid in sorted(order)]


def single_turn_pass(cfg, generator, prompt_ids: list[list[int]], first_id: int, mode: str = "single_turn") -> dict:
    from asyncrl.data import GenerationRequest

    before, _ = prefix_cache_counts(generator), engine_rate(generator)
    t0 = time.perf_counter()
    generator.submit([GenerationRequest(first_id + i, ids, cfg.group_size) for i, ids in enumerate(prompt_ids)])
    out = []
    while generator.num_inflight():
        out += generator.poll(0.0)
    wall = time.perf_counter() - t0
    return generator_row(mode, out, wall, engine_rate(generator),
                         cache_delta(before, prefix_cache_counts(generator)))


def reset_cache(generator) -> None:
    """Empty vLLM's prefix cache between passes (nothing runs then, so the reset holds)."""
    llm = getattr(generator, "llm", None)
    if llm is not None and not llm.reset_prefix_cache():
        say("  !!! the prefix cache was not reset (requests still held blocks)")


def controller_rows(cfg_of, generator, policy, task, tok, warmup: int, steps: int) -> tuple[list[dict], object]:
    """Sync then async runs on the engines already built (``bench_two_gpus.one_run``); the rows and the policy
    (rebuilt for the second run)."""
    import bench_two_gpus as b2

    rows = []
    for i, mode in enumerate(("sync", "async")):
        before = prefix_cache_counts(generator)
        row, curve, policy = b2.one_run(cfg_of(mode), mode, 0, generator, policy, task, tok, warmup, steps, i > 0)
        rows.append({"part": "controller", "mode": mode, "steps": row["steps"], "steps_per_s": row["steps_per_s"],
                     "wall_s": row["wall_s"], "gen_busy_per_step_s": row["gen_busy_per_step_s"],
                     "train_busy_per_step_s": row["train_busy_per_step_s"],
                     "reward_last5": row["reward_last5"], "peak_allocated_gib": row.get("peak_allocated_gib"),
                     **cache_delta(before, prefix_cache_counts(generator))})
        say(f"  {mode}: {json.dumps({k: v for k, v in rows[-1].items() if k != 'part'}, default=str)}")
    return rows, policy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--name", default=None)
    parser.add_argument("--model-dir", default="/tmp/countdown-tools", help="the chat model directory: reused if an "
                        "earlier build left it whole, else built there (benchmarks/tool_model.py)")
    parser.add_argument("--sft-steps", type=int, default=500)
    parser.add_argument("--groups", type=int, default=16, help="groups of each generator pass (default 16)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps of each controller run (default 2)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each controller run (default 6)")
    args = parser.parse_args()
    if args.groups < 1 or args.steps < 1 or args.warmup < 0:
        parser.error(f"--groups and --steps >= 1, --warmup >= 0 (got {args.groups}, {args.steps}, {args.warmup})")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    before = meta("bench_agents_gpu")
    out = Path(args.out) if args.out else DATA / "bench_agents_gpu" / (
        args.name or time.strftime("%Y-%m-%dT%H%MZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    from tool_model import ensure_tool_model_dir

    info = ensure_tool_model_dir(args.model_dir, steps=args.sft_steps)
    say(f"model directory {args.model_dir}: {json.dumps(info)}")

    from asyncrl import load_config
    from asyncrl.backends import build_backends
    from asyncrl.tasks import build_task

    def cfg_of(mode: str | None = None):
        import bench_two_gpus as b2

        sampler = {} if mode in (None, "async") else {"sampler": b2.SAMPLERS[mode]}
        return load_config(PRESET, model={"hf_path": args.model_dir}, generation=STATS_ON, eval_every=None, **sampler)

    cfg = cfg_of()
    t0 = time.perf_counter()
    policy, generator, tok = build_backends(cfg)
    say(f"engines built in {time.perf_counter() - t0:.1f} s")
    task = build_task(cfg.task)
    from asyncrl.chat import prepare_task

    prompts = prepare_task(task, tok, cfg.model, cfg.generation.max_new_tokens).train_prompts
    rows = []
    try:
        multi_turn_pass(cfg, generator, tok, task, prompts[args.groups:2 * args.groups], 1 << 30)  # warm-up, untimed
        reset_cache(generator)
        multi, first_turns = multi_turn_pass(cfg, generator, tok, task, prompts[:args.groups], 1 << 31)
        reset_cache(generator)
        single = single_turn_pass(cfg, generator, first_turns, 1 << 32)
        rows += [multi, single]
        say(table(pd.DataFrame(rows)))
        reset_cache(generator)
        more, policy = controller_rows(cfg_of, generator, policy, task, tok, args.warmup, args.steps)
        rows += more
    finally:
        for backend in (generator, policy):
            backend.close()
    frame = pd.DataFrame(rows)
    results = results_of(frame)
    say("\n" + table(frame))
    say(json.dumps(results))
    save("bench_agents_gpu", frame, {**results, "groups": args.groups, "group_size": cfg.group_size,
                                     "max_turns": cfg.environment.max_turns, "warmup": args.warmup,
                                     "steps": args.steps, "tool_model": info, "preset": PRESET,
                                     "total_s": round(time.perf_counter() - t_all, 1)},
         before=before, out=out)
    say(f"raw data: {out} ({time.perf_counter() - t_all:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
