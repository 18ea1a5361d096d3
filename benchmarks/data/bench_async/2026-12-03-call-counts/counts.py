"""Deterministic Python calls a step of the rollout and train ticks (cProfile; stepped weight_fifo W=1, quickstart,
max_new_tokens 4, 20 steps after 3 run steps). Prints one JSON line."""
import cProfile, json, pstats, sys
from asyncrl import Controller, load_config
STEPS = 20
cfg = load_config("quickstart", sampler={"name": "weight_fifo", "max_staleness_versions": 1}, eval_every=None,
                  torch_threads=1, generation={"max_new_tokens": 4, "placement": "local"})
ctrl = Controller.from_config(cfg)
ctrl.run(3, progress=False)
pr_r, pr_t = cProfile.Profile(), cProfile.Profile()
ticks = {"rollout": 0, "train": 0}
for _ in range(STEPS):
    pr_r.enable(); ctrl.rollout_tick(); pr_r.disable(); ticks["rollout"] += 1
    while True:
        pr_t.enable(); rep = ctrl.train_tick(); pr_t.disable(); ticks["train"] += 1
        if rep.step_finished: break
        pr_r.enable(); ctrl.rollout_tick(); pr_r.disable(); ticks["rollout"] += 1
out = {"rollout_calls_per_step": pstats.Stats(pr_r).total_calls / STEPS, "train_calls_per_step": pstats.Stats(pr_t).total_calls / STEPS,
       "rollout_ticks_per_step": ticks["rollout"] / STEPS, "train_ticks_per_step": ticks["train"] / STEPS,
       "last_loss": float(ctrl.metrics.loss.iloc[-1])}
print("COUNTS " + json.dumps(out))
ctrl.close()
