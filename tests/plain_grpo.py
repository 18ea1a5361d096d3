"""A plain generate-then-train GRPO loop: the reference the controller's synchronous mode must match bit for bit.

``plain_grpo(cfg, steps)`` builds everything from ``cfg`` exactly as the controller does and then, per step
``t = 0, 1, ...``::

    torch.set_num_threads(cfg.torch_threads)  (only when set)
    tokenizer = build_tokenizer();  task = build_task(cfg.task)
    stream    = PromptStream(task.train_prompts, seed=cfg.seed, max_epochs=cfg.max_epochs)
    policy    = TorchPolicy(cfg.model, cfg.trainer, cfg.loss, cfg.seed, tokenizer)
    generator = TorchGenerator(cfg.model, cfg.generation, cfg.seed, tokenizer)   # version 0 == policy's init

    prompts = stream.get(t*N + i) for i in 0..N-1                     (N = cfg.groups_per_step)
    generator.submit([GenerationRequest(group_id=t*N + i, prompt_ids=tokenizer.encode(prompt.text), n=G)])
                                                                       (one submit of all N, in order; G = group_size)
    groups = generator.poll(None)                                      (one batched generation, submission order)
    group.texts = tokenizer.batch_decode(group.completion_ids, skip_special_tokens=True)
    group.rewards = [task.reward(prompt, text) for text in group.texts]
    batch = make_train_batch(groups, cfg.loss, tokenizer.pad_token_id)
    batch.prev_logprobs = policy.logprobs(batch)
    policy.begin_train_step(); policy.train_microbatches(batch); policy.finish_train_step()
    generator.load_weights(policy.export_weights(), t + 1)

Group ids do not influence anything the generator computes.
"""

from __future__ import annotations

import time

import torch

from asyncrl.algorithms import make_train_batch
from asyncrl.backends.base import GenerationRequest
from asyncrl.backends.torch import TorchGenerator, TorchPolicy
from asyncrl.config import Config
from asyncrl.tasks import PromptStream, build_task, evaluate
from asyncrl.tokenizer import build_tokenizer


def plain_grpo(cfg: Config, steps: int, eval_every: int | None = None):
    """Run ``steps`` synchronous GRPO steps (see the module docstring); returns ``(policy, generator, history)``
    where ``history`` is a list of per-step dicts (the policy's step metrics plus ``step``, ``reward_mean``,
    ``step_time_s`` and, every ``eval_every`` steps and at the end, ``eval_reward``/``eval_accuracy`` of greedy
    completions under the *policy's* weights)."""
    if cfg.torch_threads is not None:  # as the controller does: thread count can change float reductions
        torch.set_num_threads(cfg.torch_threads)
    tokenizer = build_tokenizer()
    task = build_task(cfg.task)
    stream = PromptStream(task.train_prompts, seed=cfg.seed, max_epochs=cfg.max_epochs)
    policy = TorchPolicy(cfg.model, cfg.trainer, cfg.loss, cfg.seed, tokenizer)
    generator = TorchGenerator(cfg.model, cfg.generation, cfg.seed, tokenizer)
    N, G = cfg.groups_per_step, cfg.group_size
    history = []
    for step in range(steps):
        start = time.perf_counter()
        if stream.exhausted(step * N + N - 1):
            break
        prompts = [stream.get(step * N + i) for i in range(N)]
        generator.submit([
            GenerationRequest(group_id=step * N + i, prompt_ids=tokenizer.encode(p.text), n=G)
            for i, p in enumerate(prompts)
        ])
        groups = generator.poll(None)
        for group, prompt in zip(groups, prompts):
            group.texts = tokenizer.batch_decode(group.completion_ids, skip_special_tokens=True)
            group.rewards = [task.reward(prompt, text) for text in group.texts]
        batch = make_train_batch(groups, cfg.loss, tokenizer.pad_token_id)
        batch.prev_logprobs = policy.logprobs(batch)
        policy.begin_train_step()
        policy.train_microbatches(batch)
        metrics = policy.finish_train_step()
        generator.load_weights(policy.export_weights(), step + 1)
        row = {
            "step": step,
            "reward_mean": sum(sum(g.rewards) for g in groups) / (N * G),
            "weight_version": groups[0].weight_version,
            **metrics,
            "step_time_s": time.perf_counter() - start,
        }
        if (eval_every and (step + 1) % eval_every == 0) or step + 1 == steps:
            ev = evaluate(policy, task, tokenizer, cfg.generation.max_new_tokens)
            row["eval_reward"], row["eval_accuracy"] = ev["reward_mean"], ev["accuracy"]
        history.append(row)
    return policy, generator, history
