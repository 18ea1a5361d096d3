"""Where an asynchronous run's generation goes on one GPU: every vLLM engine step of sync and async runs, timed.

    python benchmarks/bench_engine_steps.py --preset gpu_gen_heavy --repeats 2 \
        --modes sync,async,async_sliced,async_inflight --out $OUT/steps

Needs CUDA, vLLM and Megatron-core (a one-GPU preset: both engines in this process). The engines are built once;
each run is ``bench_two_gpus.one_run`` (3 warm-up and 6 timed steps, fresh policy weights from the second run on),
the modes alternating, the order rotated every repeat. The generator's ``engine.step`` is wrapped: each call's
thread, seconds, and the sequences running and waiting in vLLM's scheduler when it began.

Modes (async is ``weight_fifo`` W=1, sync ``in_order`` L=0, as in bench_two_gpus):
- ``sync``, ``async`` (the preset's own settings, ``pump_threads: auto``);
- ``async_lockstep`` / ``async_two_threads``: ``pump_threads`` 1 / 2;
- ``async_inflight``: ``generation.weight_update: inflight`` (a load waits for the engine step in progress only);
- ``async_si``: the interpreter's switch interval at 0.5 ms (from 5 ms) during the run;
- ``async_sliced``: an experiment, not a setting: the weight load's drain stepped in slices of ~30 ms, each its own
  device block, as a synchronous run's polls step (the load is replaced on the generator for that run).

Prints per run the bench_two_gpus row's steps/s and device times, and per mode: engine steps, their seconds, the
sequences decoded per millisecond of engine step, and the median step time by running sequences (buckets of 32).
Files (``record.save``): ``rows.csv`` (bench_two_gpus' row per run), ``steps.csv.gz`` (one row per engine step),
``threads.csv`` (CPU seconds per thread over each run, from /proc), ``meta.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_two_gpus as B  # noqa: E402
from record import DATA, meta, save  # noqa: E402

MODES = ("sync", "async", "async_lockstep", "async_two_threads", "async_inflight", "async_si", "async_sliced")
CONFIGS = {"async_lockstep": {"pump_threads": 1}, "async_two_threads": {"pump_threads": 2},
           "async_inflight": {"generation": {"weight_update": "inflight"}}}
SLICE_S = 0.03


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds of every thread of this process (Python's name where it has one, else ``~`` + the OS name)."""
    names, tick, out = {t.native_id: t.name for t in threading.enumerate()}, os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(tid)] = (names.get(int(tid), "~" + comm), (int(fields[11]) + int(fields[12])) / tick)
    return out


def sliced_drain(gen):
    """``load_weights`` whose drain steps the engine in ~SLICE_S blocks (nothing else submits meanwhile: one pump
    thread), then loads."""
    def load_weights(weights, version):
        with gen._engine_turn():
            while gen._has_work():
                start = time.monotonic()
                gen._run_engine(lambda finished: time.monotonic() - start >= SLICE_S)
            gen._load(weights, version, {"receive_s": 0.0, "swap_wait_s": 0.0})
    return load_weights


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpu_gen_heavy")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default="sync,async,async_sliced,async_inflight",
                        help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="run directory (default benchmarks/data/...)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        raise SystemExit(f"unknown mode(s) {unknown}; modes: {', '.join(MODES)}")
    before = meta("bench_engine_steps")
    out = Path(args.out) if args.out else DATA / "bench_engine_steps" / time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
    cfgs = B.configs(args.preset, False)
    cfgs.update({m: B.load_config(args.preset, sampler=B.SAMPLERS["async"], **B.merge_overrides(
        {"eval_every": None}, c)) for m, c in CONFIGS.items()})
    cfg = cfgs["sync"]
    task, tok = B.build_task(cfg.task), B.load_tokenizer(cfg.model)
    policy = B.build(cfg.trainer.backend, B.POLICIES, (cfg.model, cfg.trainer, B.GRPOLoss(cfg.loss), cfg.seed, tok),
                     cfg.trainer)
    gen = B.build(cfg.generation.backend, B.GENERATORS, (cfg.model, cfg.generation, cfg.seed, tok), cfg.generation)
    sched = gen.engine.engine_core.engine_core.scheduler  # vLLM's in-process scheduler (V1, no multiprocessing)
    steps, cpu, rows, current = [], [], [], {"run": None}
    step = gen.engine.step

    def timed_step():
        running, waiting, start = len(sched.running), len(sched.waiting), time.perf_counter()
        outputs = step()
        steps.append((current["run"], threading.current_thread().name, start, time.perf_counter() - start,
                      running, waiting))
        return outputs

    gen.engine.step = timed_step
    try:
        for r in range(args.repeats):
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                current["run"] = f"{mode}#{r}"
                if mode == "async_sliced":
                    gen.load_weights = sliced_drain(gen)
                if mode == "async_si":
                    sys.setswitchinterval(0.0005)
                cpu0, t0 = thread_cpu(), time.perf_counter()
                try:
                    row, _, policy = B.one_run(cfgs.get(mode, cfgs["async"]), mode, r, gen, policy, task, tok, 3, 6,
                                               rebuild=bool(rows))
                finally:
                    gen.__dict__.pop("load_weights", None)
                    sys.setswitchinterval(0.005)
                wall = time.perf_counter() - t0
                for tid, (name, s) in thread_cpu().items():
                    if (d := s - cpu0.get(tid, (name, 0.0))[1]) > 0:
                        cpu.append({"run": current["run"], "mode": mode, "tid": tid, "thread": name, "cpu_s": d,
                                    "wall_s": wall})
                rows.append(row)
                B.say(f"{row['run']}: steps/s {row['steps_per_s']:.4f}, generation busy {row['gen_busy_per_step_s']:.4f}"
                      f" s, training busy {row['train_busy_per_step_s']:.4f} s a step")
    finally:
        gen.close()
        policy.close()
    st = pd.DataFrame(steps, columns=["run", "thread", "t0", "dt", "running", "waiting"])
    st["mode"] = st.run.str.split("#").str[0]
    per_run = st.groupby("run").agg(engine_steps=("dt", "size"), engine_s=("dt", "sum"), seq_steps=("running", "sum"))
    per_run["seqs_per_ms"] = per_run.seq_steps / per_run.engine_s / 1e3
    runs = pd.DataFrame(rows).merge(per_run, left_on="run", right_index=True, how="left")
    by_bucket = st.assign(bucket=st.running // 32 * 32).groupby(["bucket", "mode"]).dt.median().unstack()
    B.say("\n" + runs[["run", "steps_per_s", "gen_busy_per_step_s", "engine_steps", "engine_s", "seqs_per_ms"]]
          .to_string(index=False))
    B.say("\nmedian engine step ms by sequences running (bucket of 32):\n" + by_bucket.mul(1e3).round(2).to_string())
    save("bench_engine_steps", runs, {"preset": args.preset, "modes": modes, "repeats": args.repeats,
                                      "slice_s": SLICE_S}, before=before, out=out,
         files={"steps.csv.gz": st.drop(columns="mode"), "threads.csv": pd.DataFrame(cpu)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
