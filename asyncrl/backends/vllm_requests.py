"""A group in vLLM's terms, for the vLLM generator (``asyncrl/backends/vllm.py``): the ``SamplingParams`` of a
request and the ``GroupRollouts`` of its finished output.

- One request per group: ``n`` samples, the sampled token's logprob only (``logprobs=0``: vLLM's default
  ``raw_logprobs``, temperature 1 before top-k/top-p, which is what the policy computes), one output when the
  group's last completion ended (``FINAL_ONLY``), eos as a stop token.
- A group's length limit (``max_new_tokens`` or its long-tailed limit) and its sampling seed derive from the run's
  seed and the group id only, so what a group samples does not depend on what else runs with it.
- Logprobs flat (``flat_logprobs``, where vLLM has it): no Python object a token in the engine's loop.
- Token ids in, token ids out: the engine detokenizes nothing (the controller decodes with its own tokenizer)
  unless stop strings are set, which vLLM matches on the detokenized text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.backends.sampling import group_max_tokens, group_seed
from asyncrl.data import GenerationRequest, GroupRollouts


@dataclass
class Group:
    """A group submitted to the vLLM generator: its request, ``version`` when submitted, and once in the engine its
    first step's version."""

    request: GenerationRequest
    submitted_version: int
    seq: int  # submission order (a drain runs the groups submitted before it)
    start_version: int | None = None
    # A LoRA run's adapter (``vllm_lora.Entry``, None: the base model), fixed once (``pinned``): at submit under
    # ``drain``, when it enters the engine under ``inflight``; every request of the group carries it.
    adapter: Any = None
    pinned: bool = False


def eos_token_id(model_cfg: Any, tokenizer: Any) -> int | None:
    """The eos id: the tokenizer's, else the model directory's config's (its first, when it lists several)."""
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        return int(tokenizer.eos_token_id)
    if model_cfg.hf_path:
        from transformers import AutoConfig

        eos = getattr(AutoConfig.from_pretrained(model_cfg.hf_path), "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return None if eos is None else int(eos)
    return None


def sampling_params(sp_cls: Any, gen_cfg: Any, seed: int, request: GenerationRequest, eos_id: int | None,
                    output_kind: Any, per_group_seed: bool) -> Any:
    """The ``SamplingParams`` of one group's request (``per_group_seed``: seeded from the seed and group id).
    ``top_k`` is passed only when set (vLLM releases disagree on what "off" is: -1 or 0)."""
    stop = {"stop": list(gen_cfg.stop)} if gen_cfg.stop else {}
    return sp_cls(
        n=request.n,
        temperature=gen_cfg.temperature,
        top_p=gen_cfg.top_p,
        **({"top_k": gen_cfg.top_k} if gen_cfg.top_k > 0 else {}),
        max_tokens=group_max_tokens(gen_cfg, seed, request.group_id),
        logprobs=0,  # the sampled token's logprob only
        seed=group_seed(seed, request.group_id) if per_group_seed else None,
        stop_token_ids=[eos_id] if eos_id is not None else None,
        **stop,  # vLLM matches stop strings on the text it decodes: only then does it detokenize
        detokenize=bool(stop),  # otherwise the controller decodes with its own tokenizer
        output_kind=output_kind,  # one output per group, when its last completion ended
        **flat_logprobs(sp_cls),
    )


def flat_logprobs(sp_cls: Any) -> dict:
    """``flat_logprobs=True`` where ``sp_cls`` has it (vLLM >= 0.12): a completion's logprobs come back as a few
    flat lists instead of a ``{token_id: Logprob}`` dict a token, objects the engine would otherwise make and the
    garbage collector walk at every decode step (256 a step here)."""
    fields = getattr(sp_cls, "__struct_fields__", None)
    has = "flat_logprobs" in fields if fields is not None else hasattr(sp_cls, "flat_logprobs")
    return {"flat_logprobs": True} if has else {}


def greedy_params(sp_cls: Any, max_tokens: int, eos_id: int | None, output_kind: Any, stop: list[str]) -> Any:
    """The ``SamplingParams`` of one greedy (evaluation) request; it stops at the run's stop strings too."""
    return sp_cls(n=1, temperature=0.0, max_tokens=max_tokens, stop_token_ids=[eos_id] if eos_id is not None else None,
                  **({"stop": list(stop)} if stop else {}), detokenize=bool(stop), output_kind=output_kind)


def eval_sampling_params(sp_cls: Any, gen_cfg: Any, n: int, temperature: float, max_tokens: int, seed: int,
                         eos_id: int | None, output_kind: Any) -> Any:
    """The ``SamplingParams`` of one sampled evaluation request: ``n`` completions of a prompt at ``temperature``
    with the run's ``top_p``/``top_k``/stop strings, seeded, no logprobs."""
    stop = {"stop": list(gen_cfg.stop)} if gen_cfg.stop else {}
    return sp_cls(n=n, temperature=temperature, top_p=gen_cfg.top_p,
                  **({"top_k": gen_cfg.top_k} if gen_cfg.top_k > 0 else {}), max_tokens=max_tokens, seed=seed,
                  stop_token_ids=[eos_id] if eos_id is not None else None, **stop, detokenize=bool(stop),
                  output_kind=output_kind)


def sampled_logprob(entry: Any, token_id: int) -> float:
    """The logprob of ``token_id`` in one position's logprobs entry (a ``{token_id: Logprob}`` mapping)."""
    value = entry[token_id]
    return float(getattr(value, "logprob", value))


def completion_logprobs(logprobs: Any, ids: list[int]) -> list[float]:
    """Each sampled token's logprob: read straight from vLLM's ``FlatLogprobs`` when it holds exactly one entry a
    position, the sampled token's (``logprobs=0``), else position by position."""
    flat, flat_ids = getattr(logprobs, "logprobs", None), getattr(logprobs, "token_ids", None)
    if flat is not None and flat_ids is not None and len(flat) == len(ids) and list(flat_ids) == ids:
        return [float(x) for x in flat]
    return [sampled_logprob(logprobs[i], t) for i, t in enumerate(ids)]


def group_rollouts(out: Any, request: GenerationRequest, start_version: int, end_version: int) -> GroupRollouts:
    """The ``GroupRollouts`` of a finished request output (its completions in sample order)."""
    completions = sorted(out.outputs, key=lambda c: c.index)
    ids = [list(c.token_ids) for c in completions]
    lps = [completion_logprobs(c.logprobs, tok) for c, tok in zip(completions, ids)]
    return GroupRollouts(
        group_id=request.group_id, prompt_ids=list(request.prompt_ids), completion_ids=ids, logprobs=lps,
        gen_start_version=start_version, gen_end_version=end_version,
        finish_reasons=[str(c.finish_reason) for c in completions],
    )
