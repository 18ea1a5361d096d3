"""Synchronous GRPO on one screen: generate a batch with the current weights, score it, train on it, sync.

This is the loop asyncrl's controller pulls apart into two pumps. With ``in_order`` and
``max_lookahead_versions=0`` the controller *is* this loop, bit for bit on CPU (``tests/test_controller.py`` runs
both and compares the weights), so everything here is built from the config exactly as the controller builds it.

    python examples/plain_grpo.py --steps 150    # the quickstart preset: reward and held-out accuracy rise
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from asyncrl.algorithms import GRPOLoss, make_train_batch
from asyncrl.backends.torch import TorchGenerator, TorchPolicy
from asyncrl.config import Config, load_config
from asyncrl.data import GenerationRequest
from asyncrl.tasks import PromptStream, build_task, evaluate
from asyncrl.tokenizer import build_tokenizer


def plain_grpo(cfg: Config, steps: int, eval_every: int | None = None):
    """Run ``steps`` GRPO steps; returns ``(policy, generator, history)``, one dict per step in ``history``
    (the policy's metrics, ``reward_mean``, and every ``eval_every`` steps and at the end ``eval_accuracy``)."""
    if cfg.torch_threads is not None:  # as the controller does: the thread count can change float reductions
        torch.set_num_threads(cfg.torch_threads)
    tokenizer = build_tokenizer()
    task = build_task(cfg.task)
    stream = PromptStream(task.train_prompts, seed=cfg.seed, max_epochs=cfg.max_epochs)
    policy = TorchPolicy(cfg.model, cfg.trainer, GRPOLoss(cfg.loss), cfg.seed, tokenizer)  # trains
    generator = TorchGenerator(cfg.model, cfg.generation, cfg.seed, tokenizer)  # samples; same init (version 0)
    N, G = cfg.groups_per_step, cfg.group_size
    history = []
    for step in range(steps):
        start = time.perf_counter()
        if stream.exhausted(step * N + N - 1):
            break
        # 1. Generate: N prompts with G completions each (a group per prompt), all with the current weights.
        prompts = [stream.get(step * N + i) for i in range(N)]
        generator.submit([GenerationRequest(group_id=step * N + i, prompt_ids=tokenizer.encode(p.text), n=G)
                          for i, p in enumerate(prompts)])
        groups = generator.poll(None)  # waits for all N groups; they come back in submission order
        # 2. Score every completion with the task's reward.
        for group, prompt in zip(groups, prompts):
            group.texts = tokenizer.batch_decode(group.completion_ids, skip_special_tokens=True)
            group.rewards = [task.reward(prompt, text) for text in group.texts]
        # 3. Advantages, group relative: each reward minus the mean of its group (so no value model is needed).
        batch = make_train_batch(groups, cfg.loss, tokenizer.pad_token_id)
        # 4. One optimizer step on the clipped surrogate loss, relative to the logprobs before the step.
        batch = replace(batch, prev_logprobs=policy.logprobs(batch))
        policy.begin_train_step()
        policy.train_microbatches(batch)
        metrics = policy.finish_train_step()
        # 5. Weight sync: the next batch is generated with the new weights, version step + 1.
        generator.load_weights(policy.export_weights(), step + 1)
        row = {"step": step, "reward_mean": sum(sum(g.rewards) for g in groups) / (N * G),
               "weight_version": groups[0].gen_start_version, **metrics, "step_time_s": time.perf_counter() - start}
        if (eval_every and (step + 1) % eval_every == 0) or step + 1 == steps:
            ev = evaluate(policy, task, tokenizer, cfg.generation.max_new_tokens)  # greedy, held-out prompts
            row["eval_reward"], row["eval_accuracy"] = ev["reward_mean"], ev["accuracy"]
        history.append(row)
    return policy, generator, history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="quickstart")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=50)
    args = parser.parse_args()
    cfg = load_config(args.preset, sampler={"name": "in_order", "max_lookahead_versions": 0})
    for row in plain_grpo(cfg, args.steps, args.eval_every)[2]:
        accuracy = f"  held-out accuracy {row['eval_accuracy']:.3f}" if "eval_accuracy" in row else ""
        print(f"step {row['step']:4d}  reward {row['reward_mean']:.3f}  loss {row['loss']:+.4f}{accuracy}")
