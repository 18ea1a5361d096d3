"""KV-cached decoding of a Hugging Face causal LM in plain torch: what the torch engines sample and evaluate with.

- ``decode`` decodes every prompt row at once (left-padded, shifted positions), one ``choose(logits) -> tokens``
  call per position, and reports per row the completion (up to and including eos), each token's temperature-1
  logprob (``log_softmax(logits)``, whatever ``choose`` sampled with) and the finish reason.
- ``_sample_from`` draws only from the ``torch.Generator`` it is given, so a rollout depends on that generator's
  seed and the calls made, never on timing; ``greedy_completions`` draws nothing.
- Works across transformers 4.x and 5.x (the cache and logits-to-keep keyword names are read off the signature).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from asyncrl.tokenizer import EOS_ID, PAD_ID

# --- forward helpers (work across transformers 4.x and 5.x keyword names) -----------------------------------------

def _forward_kwargs() -> tuple[str, str | None]:
    from transformers import LlamaForCausalLM

    params = inspect.signature(LlamaForCausalLM.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    keep_kw = "logits_to_keep" if "logits_to_keep" in params else (
        "num_logits_to_keep" if "num_logits_to_keep" in params else None
    )
    return cache_kw, keep_kw


_CACHE_KW: str | None = None
_KEEP_KW: str | None = None


def _kw() -> tuple[str, str | None]:
    global _CACHE_KW, _KEEP_KW
    if _CACHE_KW is None:
        _CACHE_KW, _KEEP_KW = _forward_kwargs()
    return _CACHE_KW, _KEEP_KW


def _new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


def _sample_from(logits: torch.Tensor, temperature: float, top_p: float, rng: torch.Generator,
                 top_k: int = 0) -> torch.Tensor:
    """One token per row from ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens
    (0: all), then to the top-p nucleus of what is left (vLLM's order). Off, neither changes a draw."""
    if temperature != 1.0:
        logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=rng).squeeze(-1)


@torch.no_grad()
def decode(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    choose: Callable[[torch.Tensor], torch.Tensor],
    eos_id: int = EOS_ID,
    pad_id: int = PAD_ID,
    limits: Sequence[int] | None = None,
    stop: Callable[[list[int]], bool] | None = None,
) -> tuple[list[list[int]], list[list[float]], list[str]]:
    """Decode every prompt row at once with a KV cache: ``choose(logits[B, V]) -> tokens[B]`` picks the next
    tokens. Returns per row the completion ids (up to and including ``eos``), the temperature-1 logprob of each,
    and the finish reason (``"stop"`` at eos, else ``"length"``). Prompts of unequal lengths are left-padded
    with an attention mask and shifted position ids. ``limits``: a token limit per row (at most
    ``max_new_tokens``); a row past its limit is finished, but ``choose`` still draws for it, so every row's
    completion is the prefix of the one it gets without limits. ``stop(completion so far) -> bool`` (stop
    strings): a row it says yes to ends with that token, finish reason ``"stop"`` (draws go on as for limits)."""
    device = next(model.parameters()).device
    cache_kw, keep_kw = _kw()
    B = len(prompts)
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    if min(lengths) == width:
        input_ids = torch.tensor(prompts, dtype=torch.long, device=device)
        mask = positions = None
    else:
        input_ids = torch.full((B, width), pad_id, dtype=torch.long)
        mask = torch.zeros((B, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            if p:
                input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = _new_cache(model)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    limit = None if limits is None else torch.tensor(limits, device=device)
    tokens, logps = [], []
    so_far: list[list[int]] = [[] for _ in range(B)]  # with ``stop``: each row's completion, to test it
    stopped: list[int | None] = [None] * B  # the length at which ``stop`` ended a row
    step_input = input_ids
    for t in range(max_new_tokens):
        kwargs: dict[str, Any] = {cache_kw: cache, "use_cache": True}
        if keep_kw is not None:
            kwargs[keep_kw] = 1
        if mask is not None:
            kwargs["attention_mask"] = mask
            kwargs["position_ids"] = positions
        logits = model(input_ids=step_input, **kwargs).logits[:, -1].float()
        nxt = choose(logits)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
        nxt = nxt.masked_fill(finished, pad_id)
        tokens.append(nxt)
        logps.append(logp)
        if stop is not None:
            for i, (tok, done) in enumerate(zip(nxt.tolist(), finished.tolist())):
                if not done and tok != eos_id:
                    so_far[i].append(tok)
                    if stop(so_far[i]):
                        stopped[i] = t + 1
            finished = finished | torch.tensor([n is not None for n in stopped], device=device)
        finished = finished | (nxt == eos_id)
        if limit is not None:
            finished = finished | (limit <= t + 1)
        if t + 1 == max_new_tokens or bool(finished.all()):
            break
        step_input = nxt.unsqueeze(-1)
        if mask is not None:
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
            positions = positions[:, -1:] + 1
    tok_rows = torch.stack(tokens, dim=1).tolist()
    lp_rows = torch.stack(logps, dim=1).tolist()
    completions, logprobs, reasons = [], [], []
    for row, (toks, lps) in enumerate(zip(tok_rows, lp_rows)):
        if limits is not None:
            toks, lps = toks[:limits[row]], lps[:limits[row]]
        if stopped[row] is not None:
            completions.append(toks[:stopped[row]])
            logprobs.append(lps[:stopped[row]])
            reasons.append("stop")
        elif eos_id in toks:
            n = toks.index(eos_id) + 1
            completions.append(toks[:n])
            logprobs.append(lps[:n])
            reasons.append("stop")
        else:
            completions.append(toks)
            logprobs.append(lps)
            reasons.append("length")
    return completions, logprobs, reasons


def stop_strings(stops: Sequence[str], tokenizer: Any) -> Callable[[list[int]], bool] | None:
    """``decode``'s ``stop`` for stop strings: whether a completion's decoded text (special tokens skipped, as
    vLLM decodes) contains one of ``stops``. Only its tail is decoded: a string newly completed by the last token
    lies within its last ``len(bytes)`` tokens, and the window is wider than that (every token is a byte or more)."""
    if not stops:
        return None
    if tokenizer is None:
        from asyncrl.tokenizer import build_tokenizer

        tokenizer = build_tokenizer()
    window = 2 * max(len(s.encode()) for s in stops) + 8
    return lambda ids: any(s in tokenizer.decode(ids[-window:], skip_special_tokens=True) for s in stops)


def greedy_completions(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int = EOS_ID,
                       pad_id: int = PAD_ID, stop: Callable[[list[int]], bool] | None = None) -> list[list[int]]:
    """Greedy (argmax) completions of ``prompts`` under ``model`` (ended by ``stop`` as in ``decode``); no
    randomness is drawn."""
    if not prompts:
        return []
    was_training = model.training
    model.eval()
    try:
        completions, _, _ = decode(model, prompts, max_new_tokens, lambda lg: lg.argmax(-1), eos_id, pad_id,
                                   stop=stop)
    finally:
        model.train(was_training)
    return completions
