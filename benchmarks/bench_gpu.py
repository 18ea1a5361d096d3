"""The GPU path through the controller, in one process on one GPU: Megatron-core trains, vLLM generates (colocated).

    python benchmarks/bench_gpu.py [--out DIR] [--steps 40] [--reps 8] [--run-steps 20]
    python benchmarks/bench_gpu.py --cpu-dry-run      # the same code paths on CPU (see below), small sizes

One engine of each kind is built once, by ``Controller.from_config(load_config("gpu_quickstart"))``; every later
section builds a fresh ``Controller`` (new buffer and sampler) around the same policy and generator, so the process
holds one vLLM engine. Sections, in order:

1. ``learn``  — the preset as it is (``weight_fifo`` W=1, tis), ``ctrl.run(steps)`` from fresh weights: the reward
   curve, first vs last mean, held-out greedy accuracy (``eval_every``), lag, ``sync_time_s``.
2. ``gen``    — raw vLLM vs generation inside the controller, on identical requests. *Inside the controller* is one
   ``rollout_tick``: admit, dispatch (prompt encoding, buffer reservation), ``VLLMGenerator.poll`` (SamplingParams,
   ``LLM.generate``, per-token logprob extraction), decode, reward scoring, commit. *Raw* is one
   ``vllm.LLM.generate`` call with the same token-id prompts and the same ``SamplingParams`` (same per-group seeds,
   so the same tokens come out). Completion tokens per second, median over ``--reps``, prefix cache reset before
   each. Two lengths: the preset's ``max_new_tokens`` and 32 new tokens. Target: controller >= 0.9x raw.
3. ``train``  — a raw Megatron step vs the same step inside the controller, on the same batch. *Raw*:
   ``make_train_batch`` + ``policy.logprobs`` (the old-policy forward every GRPO step needs) + ``begin_train_step``
   / ``train_microbatches`` / ``finish_train_step``; also reported without the logprobs forward. *Inside the
   controller*: one ``train_tick`` that trains that batch and finishes the step (evict, select, the same backend
   calls, metrics), minus its weight sync (``sync_time_s``, reported in section 4). The policy is wrapped in a
   timer, so the controller's own overhead (tick time minus time inside backend calls) is reported too.
   Target: controller <= 1.1x raw.
4. ``sync``   — ``sync_time_s`` from the controller's metrics (export from Megatron + in-place vLLM load).
5. ``runs``   — synchronous (``in_order`` L=0) vs asynchronous (``weight_fifo`` W=1) steps/s through
   ``Controller.run``, alternating, ``--run-steps`` each after 3 warm-up steps, no evaluation.

Everything printed also goes to CSV/JSON files under ``--out`` (default ``$OUT`` or ``runs/bench_gpu``).

``--cpu-dry-run`` runs the same code on the CPU so that only GPU questions are left for the GPU: Megatron on CPU
(gloo, with the two CPU workarounds of ``tests/test_megatron_backend.py``), and ``VLLMGenerator`` around a small
stand-in for the ``vllm.LLM`` surface (a transformers model sampling on the CPU); model and batch sizes shrink.
Its numbers mean nothing.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
import json
import os
from pathlib import Path
import statistics
import sys
import time
import traceback
from types import SimpleNamespace

import pandas as pd
import torch
from record import DATA, meta, save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl import Controller, load_config  # noqa: E402
from asyncrl.algorithms import GRPOLoss, make_train_batch  # noqa: E402
from asyncrl.data import GenerationRequest  # noqa: E402

SYNC = {"name": "in_order", "max_lookahead_versions": 0}
ASYNC = {"name": "weight_fifo", "max_staleness_versions": 1}
RESULTS: dict = {}


# per-step throughput the controller reports (asyncrl.metrics), printed by the train and runs sections
THROUGHPUT_COLUMNS = ("train_tokens", "train_padded_tokens", "train_tflops", "mfu", "gen_tokens_per_s")


def say(*args) -> None:
    print(*args, flush=True)


def record(key: str, value) -> None:
    RESULTS[key] = value
    say(f"RESULT {key} = {json.dumps(value, default=str)}")


def sync_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def med(xs) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


# ---- the CPU dry run's stand-ins (never used on the GPU) -----------------------------------------------------------


class _SamplingParams:
    def __init__(self, n=1, temperature=1.0, top_p=1.0, max_tokens=16, logprobs=None, seed=None,
                 stop_token_ids=None, detokenize=True, output_kind=None):
        self.n, self.temperature, self.top_p, self.max_tokens = n, temperature, top_p, max_tokens
        self.logprobs, self.seed, self.stop_token_ids = logprobs, seed, stop_token_ids


class _CpuEngine:
    """``LLM.llm_engine``'s request API over ``_CpuLLM.generate``: a step generates every request added so far."""

    def __init__(self, llm):
        self.llm, self.waiting = llm, {}

    def add_request(self, request_id, prompt, params):
        self.waiting[request_id] = ({"prompt_token_ids": prompt["prompt_token_ids"]}, params)

    def has_unfinished_requests(self):
        return bool(self.waiting)

    def abort_request(self, request_ids, internal=False):
        for rid in request_ids:
            self.waiting.pop(rid, None)

    def step(self):
        ids = list(self.waiting)
        outs = []
        for rid in ids:  # one request at a time: each its own seed, as vLLM's per-request seeds
            prompt, params = self.waiting.pop(rid)
            (out,) = self.llm.generate([prompt], [params])
            outs.append(SimpleNamespace(request_id=rid, finished=True, outputs=out.outputs))
        return outs


class _CpuLLM:
    """The part of ``vllm.LLM`` that ``VLLMGenerator`` and this bench use, on a transformers model on the CPU."""

    def __init__(self, model_cfg, tokenizer, seed):
        from asyncrl.backends.hf import build_model

        self.model = build_model(model_cfg, len(tokenizer), seed).eval()
        self.pad = tokenizer.pad_token_id
        self.llm_engine = _CpuEngine(self)

    def generate(self, prompts, params, use_tqdm=True):
        from asyncrl.backends.torch import _sample_from, decode

        params = params if isinstance(params, list) else [params] * len(prompts)
        rows = [list(p["prompt_token_ids"]) for p, sp in zip(prompts, params) for _ in range(sp.n)]
        sp0 = params[0]
        rng = torch.Generator().manual_seed(sp0.seed or 0)
        choose = (lambda lg: lg.argmax(-1)) if sp0.temperature == 0 else (
            lambda lg: _sample_from(lg, sp0.temperature, sp0.top_p, rng))
        eos = (sp0.stop_token_ids or [-1])[0]
        ids, lps, reasons = decode(self.model, rows, sp0.max_tokens, choose, eos, self.pad)
        outs, row = [], 0
        for p, sp in zip(prompts, params):
            comps = [SimpleNamespace(index=i, token_ids=ids[row + i], finish_reason=reasons[row + i],
                                     logprobs=[{t: SimpleNamespace(logprob=lp)} for t, lp in
                                               zip(ids[row + i], lps[row + i])]) for i in range(sp.n)]
            row += sp.n
            outs.append(SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], outputs=comps))
        return outs

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert method == "reload_weights"
        self.model.load_state_dict({k: v.float() for k, v in kwargs["weights_iterator"]}, strict=True)
        return [None]

    def apply_model(self, fn):  # weight_load: load_weights
        model = SimpleNamespace(load_weights=lambda items: self.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": list(items)}) and {name for name, _ in items})
        return [fn(model)]

    def reset_prefix_cache(self, *a, **k):
        return True


def _cpu_megatron_setup() -> None:
    """What tests/test_megatron_backend.py does before building a MegatronPolicy on the CPU."""
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    torch.cuda.current_device = lambda: "cpu"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def build_first_controller(cfg, dry: bool) -> Controller:
    if not dry:
        return Controller.from_config(cfg)  # the real thing: build_backends (policy, then the vLLM engine)
    from asyncrl.backends.megatron import MegatronPolicy
    from asyncrl.backends.vllm import VLLMGenerator
    from asyncrl.tasks import build_task
    from asyncrl.tokenizer import build_tokenizer

    _cpu_megatron_setup()
    torch.manual_seed(cfg.seed)
    tok = build_tokenizer()
    task = build_task(cfg.task)
    policy = MegatronPolicy(cfg.model, cfg.trainer, GRPOLoss(cfg.loss), cfg.seed, tok)
    gen = VLLMGenerator(cfg.model, cfg.generation, cfg.seed, tok, llm=_CpuLLM(cfg.model, tok, cfg.seed),
                        sampling_params_cls=_SamplingParams)
    return Controller(cfg, task, policy, gen, tok)


# ---- helpers -------------------------------------------------------------------------------------------------------


class TimedPolicy:
    """Forwards everything to the policy; accumulates the seconds spent inside its calls (device synchronised)."""

    TIMED = ("logprobs", "begin_train_step", "train_microbatches", "finish_train_step", "export_weights")

    def __init__(self, policy):
        self._policy = policy
        self.seconds = {name: 0.0 for name in self.TIMED}

    def __getattr__(self, name):
        attr = getattr(self._policy, name)
        if name not in self.TIMED:
            return attr

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = attr(*args, **kwargs)
            sync_device()
            self.seconds[name] += time.perf_counter() - t0
            return out

        return timed

    def reset(self) -> None:
        self.seconds = {name: 0.0 for name in self.TIMED}


def fresh_controller(base: Controller, cfg, policy=None) -> Controller:
    """A new controller (buffer, sampler, history) around the backends ``base`` built. The generator is drained
    first: nothing from an earlier controller may come back under a reused group id."""
    base.generator.poll(0.0)
    ctrl = Controller(cfg, base.task, policy if policy is not None else base.policy, base.generator, base.tokenizer)
    base.generator.poll(0.0)
    return ctrl


def completion_tokens(groups) -> int:
    return sum(len(c) for g in groups for c in g.completion_ids)


# ---- sections ------------------------------------------------------------------------------------------------------


def section_learn(ctrl: Controller, steps: int, out: Path) -> None:
    say(f"\n=== 1. learn: {steps} asynchronous steps of the preset ({ctrl.sampler!r}), from fresh weights")
    t0 = time.perf_counter()
    m = ctrl.run(steps, progress=False)
    wall = time.perf_counter() - t0
    m.to_csv(out / "learn_metrics.csv", index=False)
    r = m.reward_mean.round(3).tolist()
    k = max(1, min(5, len(r) // 4))
    first, last = float(m.reward_mean.head(k).mean()), float(m.reward_mean.tail(k).mean())
    ev = m[["step", "eval_accuracy"]].dropna() if "eval_accuracy" in m else pd.DataFrame()
    say("reward curve:", r)
    say(f"reward mean: first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
    if len(ev):
        say("held-out greedy accuracy by step:", {int(s) + 1: round(a, 3) for s, a in zip(ev.step, ev.eval_accuracy)})
    record("learn", {
        "steps": len(m), "wall_s": round(wall, 2), "steps_per_s": round(len(m) / wall, 3),
        "reward_first": round(first, 4), "reward_last": round(last, 4), "reward_rose": last > first,
        "eval_accuracy_last": float(ev.eval_accuracy.iloc[-1]) if len(ev) else None,
        "constant_answer_accuracy": round(ctrl.task.constant_answer_accuracy, 4),
        "lag_mean": round(float(m.lag_mean.mean()), 3), "lag_max": int(m.lag_max.max()),
        "sync_time_s_median": round(float(m.sync_time_s.median()), 5),
        "is_truncated_frac_mean": round(float(m.get("is_truncated_frac", pd.Series([float("nan")])).mean()), 4),
    })


def section_gen(base: Controller, cfg, reps: int, long_tokens: int) -> list[dict]:
    gen = base.generator
    rows = []
    original = gen.gen_cfg
    for new_tokens in (cfg.generation.max_new_tokens, long_tokens):
        gen.gen_cfg = original.model_copy(update={"max_new_tokens": new_tokens})  # bench only: same engine
        N = cfg.groups_per_step
        gcfg = load_config(None, **{**cfg.model_dump(mode="json"), "eval_every": None,
                                    "max_buffered_groups": N * (reps + 3),
                                    "sampler": {"name": "windowed", "max_staleness_versions": 1}})
        ctrl = fresh_controller(base, gcfg)
        say(f"\n=== 2. gen: {N} prompts x {cfg.group_size} samples, max_new_tokens {new_tokens}; "
            f"{reps} reps (+2 warm-up), controller rollout_tick vs raw LLM.generate")
        for rep in range(reps + 2):
            # Raw replays the requests of the controller's tick (same prompts, same per-group seeds), so the
            # controller goes first; every other rep replays the previous tick's requests before the new tick,
            # so that neither side always runs right after the other (order effects would bias the ratio).
            raw_first = rep % 2 == 1 and rep >= 2

            def raw_wave(requests):
                prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
                params = [gen._params(r) for r in requests]  # the generator's own SamplingParams: same seeds
                gen.llm.reset_prefix_cache()
                sync_device()
                t0 = time.perf_counter()
                outs = gen.llm.generate(prompts, params, use_tqdm=False)
                return outs, time.perf_counter() - t0

            if raw_first:
                outs, t_raw = raw_wave(last_requests)
            gen.llm.reset_prefix_cache()
            sync_device()
            t0 = time.perf_counter()
            report = ctrl.rollout_tick()
            t_ctrl = time.perf_counter() - t0
            assert len(report.committed) == N, report
            groups = [ctrl.buffer[g].rollouts for g in report.committed]
            requests = [GenerationRequest(g.group_id, list(g.prompt_ids), cfg.group_size) for g in groups]
            if not raw_first:
                outs, t_raw = raw_wave(requests)
                n_raw_groups = groups
            else:
                n_raw_groups = last_groups
            last_requests, last_groups = requests, groups
            n_ctrl = completion_tokens(n_raw_groups)  # the controller's tokens for the requests raw replayed
            n_raw = sum(len(c.token_ids) for o in outs for c in o.outputs)
            n_ctrl_now = completion_tokens(groups)
            if rep >= 2:
                rows.append({"max_new_tokens": new_tokens, "rep": rep - 2, "raw_first": raw_first,
                             "sequences": N * cfg.group_size,
                             "tokens_controller": n_ctrl, "tokens_raw": n_raw, "s_controller": t_ctrl, "s_raw": t_raw,
                             "tok_s_controller": n_ctrl_now / t_ctrl, "tok_s_raw": n_raw / t_raw})
        sub = pd.DataFrame([r for r in rows if r["max_new_tokens"] == new_tokens])
        # The GPU's speed drifts during a run (other tenants), so the ratio is taken per rep (each rep's two waves
        # run back to back) and its median reported; the ratio of the two medians is kept for reference.
        ratio = (sub.tok_s_controller / sub.tok_s_raw).median()
        ratio_of_medians = sub.tok_s_controller.median() / sub.tok_s_raw.median()
        say(sub.round(4).to_string(index=False))
        record(f"gen_{new_tokens}tok", {
            "sequences": int(sub.sequences.iloc[0]), "tokens_per_wave": int(sub.tokens_raw.median()),
            "same_tokens": bool((sub.tokens_controller == sub.tokens_raw).all()),
            "tok_s_raw": round(float(sub.tok_s_raw.median())), "tok_s_controller": round(float(sub.tok_s_controller.median())),
            "s_raw": round(float(sub.s_raw.median()), 5), "s_controller": round(float(sub.s_controller.median()), 5),
            "ratio": round(float(ratio), 3), "ratio_of_medians": round(float(ratio_of_medians), 3),
            "target_met": bool(ratio >= 0.9),
        })
    gen.gen_cfg = original
    return rows


def section_train(base: Controller, cfg, reps: int) -> list[dict]:
    N = cfg.groups_per_step
    tcfg = load_config(None, **{**cfg.model_dump(mode="json"), "eval_every": None, "sampler": SYNC})
    policy = TimedPolicy(base.policy)
    ctrl = fresh_controller(base, tcfg, policy=policy)
    raw_policy, gen = base.policy, base.generator
    say(f"\n=== 3. train: a step of {N} groups x {cfg.group_size}; raw MegatronPolicy vs controller train_tick; "
        f"{reps} reps (+2 warm-up)")
    rows = []
    for rep in range(reps + 2):
        report = ctrl.rollout_tick()
        assert len(report.committed) == N, report
        groups = [s.rollouts for s in ctrl.buffer.ready_slots()]
        # raw: the same batch through the backend calls alone
        sync_device()
        t0 = time.perf_counter()
        batch = make_train_batch(groups, cfg.loss, base.tokenizer.pad_token_id)
        batch = replace(batch, prev_logprobs=raw_policy.logprobs(batch))
        sync_device()
        t1 = time.perf_counter()
        raw_policy.begin_train_step()
        raw_policy.train_microbatches(batch)
        raw_policy.finish_train_step()
        sync_device()
        t2 = time.perf_counter()
        # the controller: one train tick trains this batch and finishes the step (with a weight sync)
        policy.reset()
        t3 = time.perf_counter()
        tick = ctrl.train_tick()
        t_tick = time.perf_counter() - t3
        assert tick.step_finished and len(tick.selected) == N, tick
        row = ctrl.metrics.iloc[-1]
        sync_s = float(row.sync_time_s)
        backend_s = sum(v for k, v in policy.seconds.items() if k != "export_weights")
        if rep >= 2:
            rows.append({
                "rep": rep - 2, "tokens": int(batch.num_tokens), "sequences": int(batch.num_sequences),
                "raw_logprobs_s": t1 - t0, "raw_step_s": t2 - t1, "raw_total_s": t2 - t0,
                "ctrl_tick_s": t_tick, "ctrl_sync_s": sync_s, "ctrl_tick_excl_sync_s": t_tick - sync_s,
                "ctrl_backend_calls_s": backend_s, "ctrl_overhead_s": t_tick - sync_s - backend_s,
                "ctrl_export_s": policy.seconds["export_weights"], "ctrl_load_s": gen.last_sync_seconds,
                **{c: float(row.get(c, float("nan"))) for c in THROUGHPUT_COLUMNS},  # the controller's own counts
            })
    df = pd.DataFrame(rows)
    say(df.round(5).to_string(index=False))
    raw_total, raw_step = df.raw_total_s.median(), df.raw_step_s.median()
    excl = df.ctrl_tick_excl_sync_s.median()
    record("train", {
        "tokens": int(df.tokens.iloc[0]), "sequences": int(df.sequences.iloc[0]),
        "raw_step_s": round(raw_step, 5), "raw_logprobs_plus_step_s": round(raw_total, 5),
        "ctrl_tick_s": round(df.ctrl_tick_s.median(), 5), "ctrl_tick_excl_sync_s": round(excl, 5),
        "ctrl_overhead_s": round(df.ctrl_overhead_s.median(), 5),
        "ratio_vs_raw_logprobs_plus_step": round(excl / raw_total, 3),
        "ratio_vs_raw_step_only": round(excl / raw_step, 3),
        "target_met": bool(excl / raw_total <= 1.1),
        "sync_s_median": round(df.ctrl_sync_s.median(), 5), "export_s_median": round(df.ctrl_export_s.median(), 5),
        "load_s_median": round(float(df.ctrl_load_s.median()), 5),
        **{f"{c}_median": round(float(df[c].median()), 4) for c in THROUGHPUT_COLUMNS},
    })
    return rows


def section_runs(base: Controller, cfg, run_steps: int, repeats: int) -> list[dict]:
    say(f"\n=== 5. runs: sync (in_order L=0) vs async (weight_fifo W=1) through Controller.run, {run_steps} steps "
        f"each after 3 warm-up steps, x{repeats}, alternating")
    rows = []
    for r in range(repeats):
        for mode, sampler in (("sync in_order L=0", SYNC), ("async weight_fifo W=1", ASYNC)):
            rcfg = load_config(None, **{**cfg.model_dump(mode="json"), "eval_every": None, "sampler": sampler})
            ctrl = fresh_controller(base, rcfg)
            ctrl.run(3, progress=False)
            sync_device()
            t0 = time.perf_counter()
            m = ctrl.run(run_steps, progress=False)
            wall = time.perf_counter() - t0
            rows.append({"mode": mode, "repeat": r, "steps": len(m), "seconds": wall, "steps_per_s": len(m) / wall,
                         "lag_mean": float(m.lag_mean.mean()), "reward_mean": float(m.reward_mean.mean()),
                         "step_time_s_median": float(m.step_time_s.median()),
                         "sync_time_s_median": float(m.sync_time_s.median()),
                         **{f"{c}_median": float(m[c].median()) if c in m else float("nan")
                            for c in THROUGHPUT_COLUMNS}})
            say(f"  {mode} #{r}: {len(m)} steps in {wall:.2f} s = {len(m) / wall:.2f} steps/s, lag {rows[-1]['lag_mean']:.2f}"
                + "".join(f", {c} {rows[-1][c + '_median']:.4g}" for c in THROUGHPUT_COLUMNS))
    df = pd.DataFrame(rows)
    best = df.groupby("mode").steps_per_s.max()
    record("runs", {"sync_steps_per_s": round(float(best["sync in_order L=0"]), 3),
                    "async_steps_per_s": round(float(best["async weight_fifo W=1"]), 3),
                    "async_over_sync": round(float(best["async weight_fifo W=1"] / best["sync in_order L=0"]), 3),
                    "async_lag_mean": round(float(df[df["mode"].str.startswith("async")].lag_mean.mean()), 3)})
    return rows


# ---- main ----------------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT"),
                        help="run directory (default benchmarks/data/bench_gpu/<UTC time>)")
    parser.add_argument("--name", default=None, help="the run directory's name under benchmarks/data/bench_gpu")
    parser.add_argument("--steps", type=int, default=40, help="steps of the asynchronous learning run")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--run-steps", type=int, default=20)
    parser.add_argument("--run-repeats", type=int, default=2)
    parser.add_argument("--long-tokens", type=int, default=32)
    parser.add_argument("--cpu-dry-run", action="store_true")
    parser.add_argument("--sections", default="learn,gen,train,runs", help="which sections to run, in order")
    args = parser.parse_args()
    before = meta("bench_gpu")
    stamp = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
    out = Path(args.out) if args.out else DATA / "bench_gpu" / (args.name or stamp)
    out.mkdir(parents=True, exist_ok=True)
    for k, v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1",
                 "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}.items():
        os.environ.setdefault(k, v)

    dry = args.cpu_dry_run
    if dry:
        cfg = load_config("gpu_quickstart", groups_per_step=4, group_size=4,
                          model={"hidden_size": 64, "intermediate_size": 176, "dtype": "float32"},
                          trainer={"device": "cpu"}, generation={"device": "cpu"}, eval_every=2)
        args.steps, args.reps, args.run_steps, args.long_tokens = min(args.steps, 4), min(args.reps, 2), 3, 8
        machine = "CPU dry run (numbers mean nothing)"
    else:
        if not torch.cuda.is_available():
            say("no CUDA device: run with --cpu-dry-run, or on the GPU machine")
            return 2
        cfg = load_config("gpu_quickstart")
        machine = torch.cuda.get_device_name(0)
    versions = {"torch": torch.__version__}
    record("setup", {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine,
                     "versions": versions, "preset": "gpu_quickstart", "groups_per_step": cfg.groups_per_step,
                     "group_size": cfg.group_size, "steps": args.steps, "reps": args.reps})

    t0 = time.perf_counter()
    ctrl = build_first_controller(cfg, dry)
    build_s = time.perf_counter() - t0
    gen, policy = ctrl.generator, ctrl.policy
    for mod in ("vllm", "megatron.core", "transformers"):
        try:
            versions[mod] = __import__(mod, fromlist=["__version__"]).__version__
        except Exception:  # noqa: BLE001
            pass
    record("build", {"seconds": round(build_s, 2), "parameters": int(getattr(policy, "num_parameters", 0)),
                     "vllm_init_s": getattr(gen, "init_seconds", None), "optimizer": getattr(policy, "optimizer_kind", None),
                     "versions": versions,
                     "gpu_memory_utilization": cfg.generation.gpu_memory_utilization})

    failures = []
    sections = [
        ("learn", lambda: section_learn(ctrl, args.steps, out)),
        ("gen", lambda: pd.DataFrame(section_gen(ctrl, cfg, args.reps, args.long_tokens)).to_csv(out / "gen.csv", index=False)),
        ("train", lambda: pd.DataFrame(section_train(ctrl, cfg, args.reps)).to_csv(out / "train.csv", index=False)),
        ("runs", lambda: pd.DataFrame(section_runs(ctrl, cfg, args.run_steps, args.run_repeats)).to_csv(out / "runs.csv", index=False)),
    ]
    wanted = args.sections.split(",")
    for name, fn in sections:
        if name not in wanted:
            continue
        t = time.perf_counter()
        try:
            fn()
        except Exception:  # noqa: BLE001 - one broken section must not cost the others' numbers
            failures.append(name)
            say(f"!!! section {name} failed:\n{traceback.format_exc()}")
        say(f"--- section {name}: {time.perf_counter() - t:.1f} s")
        (out / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))

    if "learn" in RESULTS or "train" in RESULTS:
        syncs = [v for v in (RESULTS.get("learn", {}).get("sync_time_s_median"),
                             RESULTS.get("train", {}).get("sync_s_median")) if v is not None]
        record("sync", {"sync_time_s_median": syncs})
    say("\n=== summary")
    g1 = RESULTS.get(f"gen_{cfg.generation.max_new_tokens}tok", {})
    g2 = RESULTS.get(f"gen_{args.long_tokens}tok", {})
    tr, ru, le = RESULTS.get("train", {}), RESULTS.get("runs", {}), RESULTS.get("learn", {})
    table = [
        ("generation tok/s, controller / raw vLLM", f"max_new_tokens {cfg.generation.max_new_tokens}",
         f"{g1.get('tok_s_controller')} / {g1.get('tok_s_raw')} = {g1.get('ratio')}", ">= 0.9", g1.get("target_met")),
        ("generation tok/s, controller / raw vLLM", f"max_new_tokens {args.long_tokens}",
         f"{g2.get('tok_s_controller')} / {g2.get('tok_s_raw')} = {g2.get('ratio')}", ">= 0.9", g2.get("target_met")),
        ("train step s, controller tick excl. sync / raw", "raw = logprobs + begin/train/finish",
         f"{tr.get('ctrl_tick_excl_sync_s')} / {tr.get('raw_logprobs_plus_step_s')} = {tr.get('ratio_vs_raw_logprobs_plus_step')}",
         "<= 1.1", tr.get("target_met")),
        ("  (same vs begin/train/finish alone)", "", f"/ {tr.get('raw_step_s')} = {tr.get('ratio_vs_raw_step_only')}", "", ""),
        ("  controller overhead per train tick (s)", "", tr.get("ctrl_overhead_s"), "", ""),
        ("weight sync s (export + vLLM load)", f"{RESULTS['build']['parameters']} params",
         f"{tr.get('sync_s_median')} (export {tr.get('export_s_median')}, load {tr.get('load_s_median')}); "
         f"learn run median {le.get('sync_time_s_median')}", "< 0.5", None),
        ("steps/s sync in_order L=0 vs async weight_fifo W=1", "Controller.run",
         f"{ru.get('sync_steps_per_s')} vs {ru.get('async_steps_per_s')} (x{ru.get('async_over_sync')})", "", None),
        ("learn: reward first -> last, held-out acc", f"{le.get('steps')} async steps",
         f"{le.get('reward_first')} -> {le.get('reward_last')}, acc {le.get('eval_accuracy_last')} "
         f"(constant answer {le.get('constant_answer_accuracy')})", "rises", le.get("reward_rose")),
    ]
    pd.set_option("display.width", 250)
    pd.set_option("display.max_colwidth", 120)
    summary = pd.DataFrame(table, columns=["what", "setting", "value", "target", "met"])
    say(summary.to_string(index=False))
    (out / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    save("bench_gpu", summary, RESULTS, before=before, out=out)  # rows.csv + meta.json beside the sections' CSVs
    say(f"raw data: {out}")
    if failures:
        say(f"FAILED sections: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip vLLM / NCCL teardown at interpreter exit (it can hang); everything is written
