"""Rewards off the rollout pump: steps/s of the quickstart run with a slow reward, scored inline or in workers.

Three reward functions with TRL's signature, each scoring the quickstart task (``copy_first``: the completion's
first character is the prompt's first):
- ``instant``: takes no time (the baseline);
- ``waits_10ms``: sleeps 10 ms per group before answering, as a remote verifier (an HTTP judge, a sandbox) does;
- ``computes_10ms``: spins the CPU for 10 ms per group (a local verifier; on 2 cores it competes with training).
Each runs with ``reward.workers`` 0 (inline, on the rollout pump's thread), 1, 2 and 4. Every controller is built
and warmed up first; then the timed stretches (``--steps`` steps each) go round all of them ``--reps`` times, each
round starting one cell further on, so load on the machine hits every cell alike. The figure is the median steps/s over the reps and its ratio to
``instant`` inline, measured in the same run. The target (issue 31): with 4 workers, a reward that waits 10 ms
per group runs within 10% of the one that takes no time.

What bounds it: the quickstart's sampler (``in_order``, ``max_lookahead_versions: 1``) admits batch k+2 when step
k ends, so that batch must be generated and scored while step k+1 trains, or step k+2 waits for it; with 8 groups
on 4 workers scoring takes at least two rounds of 10 ms. Two steps then take at least one step's training plus
generating and scoring one batch, and the run prints that ceiling, measured in the same run. ``--lookahead 2``
runs every cell with ``max_lookahead_versions: 2`` instead (the same model, batch and task; admission one more step
ahead): a batch then has two steps of training to be generated and scored in, and the ceiling is 1.

    python benchmarks/bench_rewards.py [--steps 60] [--reps 5] [--workers 0 1 2 4 8] [--lookahead 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

from record import meta, save

from asyncrl import Controller, load_config


def _copy_first(prompts, completions):
    return [1.0 if c.strip()[:1] == p[:1] else 0.0 for p, c in zip(prompts, completions)]


def instant(prompts, completions, **kwargs):
    return _copy_first(prompts, completions)


def waits_10ms(prompts, completions, **kwargs):
    time.sleep(0.010)
    return _copy_first(prompts, completions)


def computes_10ms(prompts, completions, **kwargs):
    end = time.thread_time() + 0.010  # CPU time of this thread: 10 ms of work, however loaded the box
    x = 0
    while time.thread_time() < end:
        x += 1
    return _copy_first(prompts, completions)


REWARDS = {"instant": instant, "waits_10ms": waits_10ms, "computes_10ms": computes_10ms}


def build(reward, workers: int, log_completions="all", lookahead: int = 1) -> Controller:
    cfg = load_config("quickstart", eval_every=None, torch_threads=1, log_completions=log_completions,
                      sampler={"name": "in_order", "max_lookahead_versions": lookahead},
                      reward={"funcs": [reward], "workers": workers, "timeout_s": 30})
    ctrl = Controller.from_config(cfg)
    ctrl.run(3, progress=False)  # warm-up: first passes, the workers started and loaded
    return ctrl


def timed(ctrl: Controller, steps: int) -> float:
    start = time.perf_counter()
    ctrl.run(steps, progress=False)
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--lookahead", type=int, default=1,
                        help="in_order's max_lookahead_versions for every cell (the quickstart preset's: 1)")
    parser.add_argument("--out", default=None, help="run directory (default benchmarks/data/bench_rewards/<UTC time>)")
    parser.add_argument("--name", default=None, help="name of the run directory under benchmarks/data/bench_rewards")
    args = parser.parse_args()
    before = meta("bench_rewards")
    cells = {(name, w): build(fn, w, lookahead=args.lookahead) for name, fn in REWARDS.items() for w in args.workers}
    raw = []
    try:
        keys = list(cells)
        for rep in range(args.reps):
            for name, workers in keys[rep % len(keys):] + keys[:rep % len(keys)]:  # each rep starts elsewhere
                ctrl = cells[(name, workers)]
                rate = timed(ctrl, args.steps)
                m = ctrl.metrics.tail(args.steps)
                raw.append({"reward": name, "workers": workers, "rep": rep, "steps": args.steps, "steps_per_s": rate,
                            "reward_time_s": float(m.reward_time_s.sum()),
                            # the generator's seconds a step (it generates one batch a poll): completion tokens
                            # over the rate of its polls
                            "gen_s_per_step": float((m.completion_tokens / m.gen_tokens_per_s).median())})
    finally:
        for ctrl in cells.values():
            ctrl.close()
    median = {key: statistics.median(r["steps_per_s"] for r in raw if (r["reward"], r["workers"]) == key)
              for key in cells}
    base = median[("instant", args.workers[0])]
    print(f"quickstart (copy_first, 8 groups x 8 per step, in_order lookahead {args.lookahead}), torch_threads 1, "
          f"{args.steps} steps x {args.reps} reps per cell; load {before['machine']['load_1min']} before the run")
    print(f"{'reward':<15} {'workers':>7} {'steps/s':>8} {'vs instant inline':>18}")
    results = {"lookahead": args.lookahead}
    for (name, workers), value in median.items():
        results[f"{name}/{workers}"] = {"steps_per_s": value, "ratio": value / base}
        print(f"{name:<15} {workers:>7} {value:>8.2f} {value / base:>18.2f}")
    judged = 4 if 4 in args.workers else max(args.workers)  # the target is about 4 workers
    results["target_met"] = median[("waits_10ms", judged)] >= 0.9 * base
    # The ceiling the sampler leaves (module docstring): batch k+2 is admitted when step k ends, and must be
    # generated and scored (8 groups on `judged` workers: ceil(8 / judged) rounds of 10 ms) while step k+1 trains,
    # else step k+2 waits for it: steps/s <= 2 / (step + gen + rounds * 10 ms), against 1 / step inline.
    step = 1 / base
    gen = statistics.median(r["gen_s_per_step"] for r in raw if (r["reward"], r["workers"]) == ("waits_10ms", judged))
    rounds = -(-8 // judged)
    # With L steps of lookahead the batch has L steps' training to be ready in: L x step / ((L-1) x step + gen +
    # scoring), at most 1.
    L = args.lookahead
    results["ceiling"] = {"workers": judged, "step_s": step, "gen_s": gen, "scoring_s": 0.010 * rounds,
                          "ratio": min(1.0, (L + 1) * step / (L * step + gen + 0.010 * rounds))}
    where = save("bench_rewards", raw, results, before=before, out=args.out, name=args.name)
    c = results["ceiling"]
    print(f"ceiling of waits_10ms/{judged} (in_order, lookahead {L}): {L + 1} x {c['step_s'] * 1e3:.1f} ms / "
          f"({L} x {c['step_s'] * 1e3:.1f} + {c['gen_s'] * 1e3:.1f} generating + {c['scoring_s'] * 1e3:.0f} scoring) "
          f"= {c['ratio']:.2f} (at most 1)")
    print(f"waits_10ms with {judged} workers within 10% of instant inline: {results['target_met']}; raw data: {where}")


if __name__ == "__main__":
    main()
