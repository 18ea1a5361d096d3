"""Synchronous multi-turn GRPO on one screen: every trajectory of a batch plays its environment turn by turn with
the current weights, then the batch is scored by the environments, trained on, and the weights synced.

The multi-turn counterpart of ``examples/plain_grpo.py``. With ``in_order`` and ``max_lookahead_versions=0`` the
controller with an ``environment:`` section *is* this loop, bit for bit on CPU (``tests/test_environments.py`` runs
both and compares the weights). A trajectory is the prompt, then each model turn's tokens exactly as sampled, then
the environment's observation (raw text here: the byte-tokenizer model has no chat template), whose tokens are
context: loss mask 0, no logprob.

    python examples/plain_multiturn.py --steps 100    # the guess_letter preset
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from asyncrl.algorithms import GRPOLoss, make_train_batch
from asyncrl.backends.torch import TorchGenerator, TorchPolicy
from asyncrl.config import Config, load_config
from asyncrl.data import GenerationRequest, GroupRollouts
from asyncrl.environments import load_factory
from asyncrl.tasks import PromptStream, build_task
from asyncrl.tokenizer import build_tokenizer


def plain_multiturn(cfg: Config, steps: int):
    """Run ``steps`` multi-turn GRPO steps; returns ``(policy, generator, history)``."""
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)
    tokenizer = build_tokenizer()
    task = build_task(cfg.task)
    env_cls, M = load_factory(cfg.environment.factory), cfg.environment.max_turns
    stream = PromptStream(task.train_prompts, seed=cfg.seed, max_epochs=cfg.max_epochs)
    policy = TorchPolicy(cfg.model, cfg.trainer, GRPOLoss(cfg.loss), cfg.seed, tokenizer)
    generator = TorchGenerator(cfg.model, cfg.generation, cfg.seed, tokenizer)
    N, G, eos = cfg.groups_per_step, cfg.group_size, tokenizer.eos_token_id
    history = []
    for step in range(steps):
        prompts = [stream.get(step * N + i) for i in range(N)]
        envs = [[env_cls() for _ in range(G)] for _ in prompts]  # one environment per trajectory, reset with its row
        starts = [[env.reset(**p.columns) for env in row] for p, row in zip(prompts, envs)]
        prompt_ids = [tokenizer.encode(p.text + (s[0] or "")) for p, s in zip(prompts, starts)]
        ids = [[[] for _ in range(G)] for _ in prompts]  # per trajectory: tokens after the prompt
        mask = [[[] for _ in range(G)] for _ in prompts]  # 1 at sampled tokens
        logps = [[[] for _ in range(G)] for _ in prompts]
        rewards = [[0.0] * G for _ in prompts]
        live = [[True] * G for _ in prompts]
        # Turn 1: every group's G trajectories from its prompt; later turns: each live trajectory from its tokens.
        requests = [GenerationRequest(i, prompt_ids[i], G) for i in range(N)]
        for turn in range(1, M + 1):
            generator.submit(requests)
            out = generator.poll(None)
            where = [(i, k) for i in range(N) for k in range(G)] if turn == 1 else \
                [(i, k) for i in range(N) for k in range(G) if live[i][k]]
            sampled = [(c, lp) for g in out for c, lp in zip(g.completion_ids, g.logprobs)]
            for (i, k), (c, lp) in zip(where, sampled):
                ids[i][k] += c
                mask[i][k] += [1] * len(c)
                logps[i][k] += lp
                action = tokenizer.decode(c[:-1] if c and c[-1] == eos else c, skip_special_tokens=False)
                obs, reward, done = envs[i][k].step(action)  # the environment's reply
                rewards[i][k] += reward
                if done or obs is None or turn == M:
                    live[i][k] = False
                    continue
                o = tokenizer.encode(obs, add_special_tokens=False)[:cfg.environment.max_env_tokens]
                ids[i][k] += o
                mask[i][k] += [0] * len(o)  # context: never trained
                logps[i][k] += [0.0] * len(o)
            requests = [GenerationRequest(i * G + k, prompt_ids[i] + ids[i][k], 1)
                        for i in range(N) for k in range(G) if live[i][k]]
            if not requests:
                break
        groups = [GroupRollouts(i, prompt_ids[i], ids[i], logps[i], step, step, rewards=rewards[i],
                                trained_mask=mask[i]) for i in range(N)]
        batch = make_train_batch(groups, cfg.loss, tokenizer.pad_token_id)
        batch = replace(batch, prev_logprobs=policy.logprobs(batch))
        policy.begin_train_step()
        policy.train_microbatches(batch)
        metrics = policy.finish_train_step()
        generator.load_weights(policy.export_weights(), step + 1)
        history.append({"step": step, "reward_mean": sum(map(sum, rewards)) / (N * G), **metrics})
    return policy, generator, history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="guess_letter")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    cfg = load_config(args.preset, sampler={"name": "in_order", "max_lookahead_versions": 0})
    for row in plain_multiturn(cfg, args.steps)[2]:
        print(f"step {row['step']:4d}  reward {row['reward_mean']:.3f}  loss {row['loss']:+.4f}")
