"""Where a generation batch of ``bench_trl_gpu.py``'s work goes on one GPU: vLLM alone (no trainer), 32 prompts x 8
completions of ``--completion`` tokens, the ``gpu_real_shape`` generation settings on the model directory the peer
bench writes (a randomly initialised Qwen2.5-0.5B shape, 152k vocabulary).

    python benchmarks/bench_vllm_decode_gpu.py [--model-dir /tmp/qwen] [--reps 3] [--out DIR] [VARIANT ...]

Each engine variant builds its own engine (the previous one shut down first) and times, after one warm-up batch:
- ``generator``: asyncrl's ``VLLMGenerator`` (submit 32 groups, ``poll`` until all finished): the seconds a batch,
  the engine steps it took and the milliseconds a step;
- ``generate``: the same requests through ``LLM.generate`` (vLLM's own loop; TRL's colocated side calls it), with
  the sampled token's logprob (``logprobs=0``) and, as ``generate_nolp``, without any.
The first variant also profiles one ``generator`` batch: its CUDA kernels' summed time over the batch's wall time
(``gpu_busy``: how much of decoding the GPU is busy for; the rest is the CPU's work) and the CPU's 30 most expensive
functions by their own time (``profile.txt``).

Engine variants (``VARIANTS``): ``default`` (the preset as it is), ``async_scheduling=false`` (vLLM's scheduler
overlapping the next step's CPU work with the GPU's, turned off: what it buys), ``engine_process`` (vLLM's engine
core in a process of its own, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``: the output handling in this process overlaps
the engine's loop; asyncrl runs the engine in-process so that weights pass by reference), ``flat_logprobs=false``
(the requests ask for vLLM's per-position logprob dicts instead of its flat lists).
Rows through ``benchmarks/record.py`` (``--out``, default ``$OUT``, else
``benchmarks/data/bench_vllm_decode_gpu/<UTC>``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import pandas as pd
from record import meta, save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GROUPS, GROUP_SIZE = 32, 8
VARIANTS = {  # name -> (vllm.LLM keyword arguments, environment, flat logprobs)
    "default": ({}, {}, True),
    "async_scheduling=false": ({"async_scheduling": False}, {}, True),
    "engine_process": ({}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, True),
    "flat_logprobs=false": ({}, {}, False),
}


def build(model_dir: str, completion: int, llm_kwargs: dict):
    from asyncrl import load_config
    from asyncrl.backends.hf import load_tokenizer
    from asyncrl.backends.vllm import VLLMGenerator

    cfg = load_config("gpu_real_shape", model={"hf_path": model_dir}, generation={
        "max_new_tokens": completion, "min_new_tokens_tail": None, "llm_kwargs": llm_kwargs})
    tok = load_tokenizer(cfg.model)
    return VLLMGenerator(cfg.model, cfg.generation, cfg.seed, tok), tok


def requests(tok, batch: int):
    from asyncrl.data import GenerationRequest
    from bench_trl_gpu import prompts

    texts = prompts(GROUPS * (batch + 1))[GROUPS * batch:GROUPS * (batch + 1)]
    return [GenerationRequest(group_id=batch * GROUPS + i, prompt_ids=tok.encode(t), n=GROUP_SIZE)
            for i, t in enumerate(texts)]


class StepClock:
    """Counts the engine's steps and their seconds (wraps ``engine.step``)."""

    def __init__(self, engine):
        self.steps, self.seconds, inner = 0, 0.0, engine.step

        def step():
            t0 = time.perf_counter()
            try:
                return inner()
            finally:
                self.steps += 1
                self.seconds += time.perf_counter() - t0

        engine.step = step


def generator_batch(gen, tok, batch: int, clock: StepClock) -> dict:
    reqs = requests(tok, batch)
    steps0, secs0 = clock.steps, clock.seconds
    t0 = time.perf_counter()
    gen.submit(reqs)
    done = []
    while len(done) < len(reqs):
        done += gen.poll(None)
    wall = time.perf_counter() - t0
    tokens = sum(len(c) for g in done for c in g.completion_ids)
    steps = clock.steps - steps0
    return {"wall_s": wall, "tokens": tokens, "engine_steps": steps,
            "ms_per_step": 1e3 * (clock.seconds - secs0) / max(steps, 1)}


def generate_batch(gen, tok, batch: int, completion: int, logprobs: bool) -> dict:
    import vllm
    from asyncrl.backends import vllm_requests

    lp = {"logprobs": 0, **vllm_requests.flat_logprobs(vllm.SamplingParams)} if logprobs else {}
    sp = vllm.SamplingParams(n=GROUP_SIZE, temperature=1.0, max_tokens=completion, detokenize=False,
                             stop_token_ids=[gen.eos_id], **lp)
    prompts = [{"prompt_token_ids": r.prompt_ids} for r in requests(tok, batch)]
    t0 = time.perf_counter()
    outs = gen.llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": sum(len(c.token_ids) for o in outs for c in o.outputs)}


def gpu_busy(gen, tok, batch: int, clock: StepClock) -> tuple[float, dict]:
    """(kernel seconds over wall seconds, the batch's row) for one generator batch under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        row = generator_batch(gen, tok, batch, clock)
    kernel_us = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0
                    and not e.key.startswith("cuda"))
    return kernel_us / 1e6 / row["wall_s"], row


def run_variant(name: str, args, first: bool, notes: list[str]) -> list[dict]:
    from asyncrl.backends import vllm_requests

    llm_kwargs, env, flat = VARIANTS[name]
    flat_fn = vllm_requests.flat_logprobs
    if not flat:  # the requests (the generator's and generate's) ask for vLLM's per-position logprob dicts
        vllm_requests.flat_logprobs = lambda sp_cls: {}
    try:
        return _run_variant(name, args, first, notes, llm_kwargs, env)
    finally:
        vllm_requests.flat_logprobs = flat_fn


def _run_variant(name: str, args, first: bool, notes: list[str], llm_kwargs: dict, env: dict) -> list[dict]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    t0 = time.perf_counter()
    try:
        gen, tok = build(args.model_dir, args.completion, llm_kwargs)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    build_s = time.perf_counter() - t0
    rows, clock, batch = [], StepClock(gen.engine), 0
    try:
        generator_batch(gen, tok, batch, clock)  # warm-up
        for kind in ("generator", "generate", "generate_nolp"):
            for rep in range(args.reps):
                batch += 1
                row = (generator_batch(gen, tok, batch, clock) if kind == "generator" else
                       generate_batch(gen, tok, batch, args.completion, kind == "generate"))
                rows.append({"variant": name, "run": kind, "rep": rep, "build_s": build_s, **row,
                             "tokens_per_s": row["tokens"] / row["wall_s"]})
                print(f"  {name} {kind} {rep}: {row}", flush=True)
        if first and args.profile:
            batch += 1
            busy, row = gpu_busy(gen, tok, batch, clock)
            rows.append({"variant": name, "run": "generator (profiled: CUDA)", "rep": 0, "build_s": build_s, **row,
                         "tokens_per_s": row["tokens"] / row["wall_s"], "gpu_busy": busy})
            batch += 1
            prof = cProfile.Profile()
            prof.enable()
            row = generator_batch(gen, tok, batch, clock)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
            notes.append(f"# {name}: one generator batch under cProfile ({row['wall_s']:.2f} s)\n{text.getvalue()}")
    finally:
        gen.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="*", metavar="VARIANT", help=f"of {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--model-dir", default="/tmp/qwen")
    parser.add_argument("--completion", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiled batches")
    args = parser.parse_args()
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}: choose from {list(VARIANTS)}")
    args.variants = args.variants or list(VARIANTS)
    if not Path(args.model_dir, "config.json").exists():
        from bench_trl_gpu import build_model_dir

        build_model_dir(Path(args.model_dir), dry=False)
    before = meta("bench_vllm_decode_gpu")
    rows, notes = [], []
    for i, name in enumerate(args.variants):
        try:
            rows += run_variant(name, args, i == 0, notes)
        except Exception as exc:  # noqa: BLE001 - a variant that cannot run is a row saying why
            rows.append({"variant": name, "run": "failed", "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(f"  {name} failed: {exc}", flush=True)
    table = pd.DataFrame(rows)
    summary = (table[table.run != "failed"].groupby(["variant", "run"], sort=False)
               [["wall_s", "tokens_per_s", "engine_steps", "ms_per_step"]].median())
    print(summary.round(3).to_string())
    out = save("bench_vllm_decode_gpu", table, {"completion": args.completion, "groups": GROUPS,
                                                "group_size": GROUP_SIZE, "reps": args.reps,
                                                "summary": summary.reset_index().to_dict("records")},
               before=before, out=args.out)
    if notes:
        Path(out, "profile.txt").write_text("\n".join(notes))


if __name__ == "__main__":
    main()
