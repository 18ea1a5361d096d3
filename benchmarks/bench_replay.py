"""Replay speed and fidelity (asyncrl/replay): how fast a recording replays, and how close a replay comes to a real
run of the sampler it replays into.

    python benchmarks/bench_replay.py                       # both sections (~10 minutes on 2 loaded cores)
    python benchmarks/bench_replay.py --only speed --steps 1000
    python benchmarks/bench_replay.py --only fidelity --fidelity-steps 200

Every run is real: ``asyncrl run quickstart`` in a process of its own (the CPU torch backends, the pumps in two
threads), with completions of up to 8 tokens whose limits are long-tailed (``generation.min_new_tokens_tail=2``),
written as a run directory; the replays are ``asyncrl.replay.compare``'s.

1. ``speed``: three ``--steps`` recordings, two real CPU runs (``in_order`` L=1 and ``weight_fifo`` W=1) and one of
   the simulated backends with 128-token completions (``asyncrl run what_if``: a replay's cost grows with the
   tokens a step trains), each replayed under the five samplers (the four built in and
   ``notebooks/my_sampler.NewestFirst``): the wall seconds of each replay (the recording read once, before the
   clock starts), and for the run's own sampler whether the replayed schedule (every ``select``: step, group,
   weight version) equals the recorded one. The goal: under 10 s a sampler at 1,000 steps.
2. ``fidelity``: ``--repeats`` real runs of each of the five samplers and ``windowed`` W=1 (``--fidelity-steps``
   each, round robin so the machine's load drifts alike over all of them); then every run's recording replayed
   under every sampler and compared with that sampler's real runs (medians over the repeats): steps/s (simulated
   against wall), mean lag, the lag distribution (total variation distance between the shares of groups trained at
   each lag, all repeats pooled), the share of dispatched groups dropped. The diagonal (recordings replayed into
   their own sampler) is the fit's own error; the real runs' range says how much the machine moved.

The box is shared: wall-clock figures move with its load (``meta.json`` has the load before the run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path[:0] = [str(ROOT), str(ROOT / "notebooks")]  # the custom sampler lives next to the notebooks

import pandas as pd  # noqa: E402

from record import meta, save  # noqa: E402

SAMPLERS = [{"name": "in_order", "max_lookahead_versions": 1}, {"name": "weight_fifo", "max_staleness_versions": 1},
            {"name": "windowed", "max_staleness_versions": 0}, {"name": "ready_first", "max_staleness_versions": 1},
            {"name": "custom", "target": "my_sampler:NewestFirst", "max_lag": 1}]
# fidelity: the five, and windowed with a window (it evicts at lag 2 and mixes lags 0 and 1: a timing-dependent mix)
FIDELITY = SAMPLERS[:2] + [{"name": "windowed", "max_staleness_versions": 1}] + SAMPLERS[2:]
SETTINGS = ["eval_every=null", "torch_threads=1", "generation.max_new_tokens=8", "generation.min_new_tokens_tail=2"]


def record(out: Path, sampler: dict, steps: int, seed: int, preset: str = "quickstart") -> float:
    """``asyncrl run PRESET`` with ``sampler`` into ``out`` (the quickstart with ``SETTINGS``); returns its wall
    seconds."""
    import json

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "notebooks")]), HF_HUB_OFFLINE="1")
    settings = SETTINGS if preset == "quickstart" else []
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", preset, "--steps", str(steps), "--out", str(out),
           "--quiet", "--no-plot", "--set", f"sampler={json.dumps(sampler)}", "--set", f"seed={seed}",
           *[a for s in settings for a in ("--set", s)]]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def trained(frame) -> list[tuple]:
    return list(zip(frame.step, frame.group_id, frame.weight_version))


def speed(work: Path, steps: int, seed: int, rows: list[dict]) -> None:
    from asyncrl import Recording
    from asyncrl.replay import replay
    from asyncrl.replay.comparison import label
    from asyncrl.replay.recorded import read

    for preset, sampler in [("quickstart", SAMPLERS[0]), ("quickstart", SAMPLERS[1]), ("what_if", SAMPLERS[0])]:
        out = work / f"speed-{preset}-{sampler['name']}"
        record_s = record(out, sampler, steps, seed, preset)
        rec = Recording(out)
        run = read(rec)
        for target in SAMPLERS:
            start = time.perf_counter()
            replayed = replay(rec, target, recorded=run)
            seconds = time.perf_counter() - start
            own = target == sampler
            rows.append({"recording": f"{preset} {label(sampler)}", "sampler": label(target),
                         "steps": len(replayed.metrics), "tokens_per_step": round(run.metrics.completion_tokens.mean()),
                         "replay_s": round(seconds, 2), "record_s": round(record_s, 1), "own_sampler": own,
                         "same_schedule": trained(replayed.schedule) == trained(run.schedule) if own else None,
                         "source": run.source, "drawn_fraction": round(replayed.drawn_fraction, 4),
                         "groups_trained": len(replayed.schedule)})
            print(rows[-1], flush=True)


def _lag_shares(frame: pd.DataFrame) -> dict[int, float]:
    counts = frame.lag.value_counts(normalize=True)
    return {int(k): float(v) for k, v in counts.items()}


def fidelity(work: Path, steps: int, seed: int, repeats: int, rows: list[dict]) -> None:
    from asyncrl import Recording
    from asyncrl.replay import replay
    from asyncrl.replay.comparison import label, summarize
    from asyncrl.replay.recorded import read, schedule

    real: dict[str, list] = {label(s): [] for s in FIDELITY}
    for repeat in range(repeats):  # round robin: the machine's load drifts alike over every sampler's runs
        for sampler in FIDELITY:
            out = work / f"fidelity-{repeat}-{label(sampler).replace(' ', '_').replace(':', '_')}"
            record(out, sampler, steps, seed)
            rec = Recording(out)
            real[label(sampler)].append((rec, read(rec), sampler))
    for source, recordings in real.items():
        for target, targets in real.items():
            knobs = targets[0][2]
            mine = [(replay(rec, knobs, recorded=run)) for rec, run, _ in recordings]
            ours = [summarize(r.trace, r.metrics) for r in mine]
            theirs = [summarize(run.trace, run.metrics) for _, run, _ in targets]
            a = _lag_shares(pd.concat([r.schedule for r in mine]))
            b = _lag_shares(pd.concat([schedule(run.trace) for _, run, _ in targets]))
            tv = 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))
            med = lambda runs, key: float(pd.Series([r[key] for r in runs]).median())  # noqa: E731
            real_rate, replay_rate = med(theirs, "steps_per_s"), med(ours, "steps_per_s")
            rows.append({
                "recording": source, "replayed_into": target, "repeats": repeats,
                "steps_per_s_real": round(real_rate, 2),
                "steps_per_s_real_range": f"{min(r['steps_per_s'] for r in theirs):.1f}-"
                                          f"{max(r['steps_per_s'] for r in theirs):.1f}",
                "steps_per_s_replay": round(replay_rate, 2), "steps_per_s_error": round(replay_rate / real_rate - 1, 3),
                "lag_mean_real": round(med(theirs, "lag_mean"), 3), "lag_mean_replay": round(med(ours, "lag_mean"), 3),
                "lag_tv_distance": round(tv, 3),
                "drop_frac_real": round(med(theirs, "drop_frac"), 3), "drop_frac_replay": round(med(ours, "drop_frac"), 3),
                "drawn_fraction": round(float(pd.Series([r.drawn_fraction for r in mine]).median()), 3),
            })
            print(rows[-1], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["speed", "fidelity"])
    parser.add_argument("--steps", type=int, default=1000, help="steps of the speed section's recordings")
    parser.add_argument("--fidelity-steps", type=int, default=200, help="steps of each fidelity run")
    parser.add_argument("--repeats", type=int, default=3, help="real runs of each sampler in the fidelity section")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=None, help="run directory name under benchmarks/data/bench_replay")
    parser.add_argument("--out", default=None, help="write rows.csv/meta.json here instead")
    args = parser.parse_args()
    before = meta("bench_replay")

    work = Path(tempfile.mkdtemp(prefix="bench-replay-"))
    speed_rows: list[dict] = []
    fidelity_rows: list[dict] = []
    try:
        if args.only in (None, "speed"):
            speed(work, args.steps, args.seed, speed_rows)
        if args.only in (None, "fidelity"):
            fidelity(work, args.fidelity_steps, args.seed, args.repeats, fidelity_rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    speed_frame, fidelity_frame = pd.DataFrame(speed_rows), pd.DataFrame(fidelity_rows)
    results: dict = {"steps": args.steps, "fidelity_steps": args.fidelity_steps}
    if len(speed_frame):
        results.update(replay_s_max=float(speed_frame.replay_s.max()),
                       replay_s_median=float(speed_frame.replay_s.median()),
                       own_schedule_equal=bool(speed_frame[speed_frame.own_sampler].same_schedule.all()),
                       targets={"under_10_s_per_sampler": bool(speed_frame.replay_s.max() < 10)})
    if len(fidelity_frame):
        off = fidelity_frame[fidelity_frame.recording != fidelity_frame.replayed_into]
        results.update(fidelity_steps_per_s_error_median=float(off.steps_per_s_error.abs().median()),
                       fidelity_lag_tv_median=float(off.lag_tv_distance.median()))
    rows = pd.concat([speed_frame.assign(section="speed"), fidelity_frame.assign(section="fidelity")],
                     ignore_index=True)
    where = save("bench_replay", rows, results, before=before, out=args.out, name=args.name,
                 files={"speed.csv": speed_frame, "fidelity.csv": fidelity_frame})
    with pd.option_context("display.width", 250, "display.max_columns", None):
        for frame in (speed_frame, fidelity_frame):
            if len(frame):
                print(frame.to_string(index=False))
    print(results)
    print(f"raw rows: {where}")


if __name__ == "__main__":
    main()
