"""Generation backend on ``vllm.LLM``: ``G`` samples per prompt with the logprob of every sampled token, weight
updates in place.

``VLLMGenerator(model_cfg, gen_cfg, seed, tokenizer)`` mirrors ``TorchGenerator``:
- The engine needs a model directory: ``model_cfg.hf_path``, or a temporary one holding the HF config, the
  tokenizer and the initial weights of ``ModelConfig`` (the same weights ``TorchPolicy`` / ``MegatronPolicy``
  start from with that seed; ``write_model_dir``).
- ``submit`` queues; ``poll`` runs what is queued as one *wave*: a single ``LLM.generate`` call over token-id
  prompts with one ``SamplingParams(n=G, logprobs=0, temperature, top_p, max_tokens, seed, stop_token_ids=[eos])``
  per group. A wave runs under one weight version, so ``gen_start_version == gen_end_version`` for its groups.
- ``poll`` may run in any thread (the controller's rollout pump does so while its train pump trains); with
  ``gen_cfg.background`` the generator runs waves in a thread of its own and ``poll(timeout)``
  only collects. One lock serialises engine use: ``load_weights`` waits for a running wave to end, then
  ``collective_rpc("reload_weights", weights_iterator=...)`` (HF names; vLLM fuses qkv and gate/up itself) and
  ``reset_prefix_cache()`` (cached prefixes hold the old weights' keys and values); ``version`` changes only after
  both completed.
  (``gen_cfg.weight_load: load_weights`` calls the model's ``load_weights`` directly instead.)
- ``abort`` cancels queued groups outright; groups of the running wave are cancelled too (never returned), but
  ``LLM.generate`` cannot be interrupted, so their GPU work finishes with the wave.
- Logprobs are vLLM's default ``raw_logprobs``: the model's temperature-1 distribution, before temperature and
  top-p, which is what the policy computes (``gen_cfg.llm_kwargs`` can change ``logprobs_mode``).
- Sampling seeds are per group (derived from ``seed`` and the group id), so what a group samples does not depend
  on which other groups share its wave.

Colocated with Megatron on one GPU: create both in one process; ``gen_cfg.gpu_memory_utilization`` is vLLM's share
of the GPU. ``VLLM_ENABLE_V1_MULTIPROCESSING`` defaults to ``0`` here (engine in this process, so weights pass by
reference), unless the environment already sets it. ``import vllm`` happens only when a generator is built.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from asyncrl.backends.hf import build_hf_config, init_hf_model
from asyncrl.config import ModelConfig, VLLMGenerationConfig
from asyncrl.data import GenerationRequest, GroupRollouts

__all__ = ["VLLMGenerator", "write_model_dir", "group_seed"]


def write_model_dir(model_cfg: Any, tokenizer: Any, seed: int, path: str | Path) -> Path:
    """Write what ``vllm.LLM`` loads for a model built from ``ModelConfig``: ``config.json`` (+ generation
    config), the tokenizer, and the initial weights (safetensors, in ``model_cfg.dtype``) — the weights
    ``init_hf_model(build_hf_config(model_cfg, tokenizer), seed)`` gives, i.e. the policies' version 0."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config = build_hf_config(model_cfg, tokenizer)
    model = init_hf_model(hf_config, seed)
    dtype = torch.bfloat16 if model_cfg.dtype == "bfloat16" else torch.float32
    model = model.to(dtype)
    model.config.torch_dtype = dtype
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path


def group_seed(seed: int, group_id: int) -> int:
    """A 31-bit sampling seed for one group (vLLM gives sample ``i`` of the group ``seed + i``)."""
    digest = hashlib.blake2b(f"{seed}:{group_id}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x3FFFFFFF


def _sampled_logprob(entry: Any, token_id: int) -> float:
    """The logprob of ``token_id`` in one position's logprobs entry (a ``{token_id: Logprob}`` mapping)."""
    value = entry[token_id]
    return float(getattr(value, "logprob", value))


class VLLMGenerator:
    """A ``GenerationBackend`` on ``vllm.LLM``. See the module docstring.

    ``llm`` and ``sampling_params_cls`` replace the real engine and ``vllm.SamplingParams`` (tests use small
    fakes of that surface: ``generate(prompts, params, use_tqdm=False)``, ``collective_rpc``,
    ``reset_prefix_cache``)."""

    def __init__(self, model_cfg: ModelConfig, gen_cfg: VLLMGenerationConfig, seed: int = 0, tokenizer: Any = None, *,
                 llm: Any = None, sampling_params_cls: Any = None):
        self.model_cfg, self.gen_cfg, self.seed = model_cfg, gen_cfg, seed
        self.tokenizer = tokenizer
        self._tmpdir: str | None = None
        self.eos_id = self._eos_id(model_cfg, tokenizer)
        self.model_dir: str | None = None
        if llm is None:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            import vllm

            sampling_params_cls = sampling_params_cls or vllm.SamplingParams
            t0 = time.perf_counter()
            self.model_dir = model_cfg.hf_path or self._write_model_dir()
            self.write_seconds = time.perf_counter() - t0
            kwargs: dict[str, Any] = dict(
                model=self.model_dir,
                dtype=model_cfg.dtype,
                seed=seed,
                gpu_memory_utilization=gen_cfg.gpu_memory_utilization,
                enforce_eager=gen_cfg.enforce_eager,
            )
            if not model_cfg.hf_path:
                kwargs["max_model_len"] = model_cfg.max_position_embeddings
            kwargs.update(gen_cfg.llm_kwargs)
            t0 = time.perf_counter()
            llm = vllm.LLM(**kwargs)
            self.init_seconds = time.perf_counter() - t0
        elif sampling_params_cls is None:
            raise ValueError("an injected llm needs its sampling_params_cls")
        self.llm = llm
        self._sp = sampling_params_cls
        self.per_group_seed = gen_cfg.per_group_seed
        self.max_groups_per_wave = gen_cfg.max_groups_per_wave  # None: everything queued
        self.last_sync_seconds: float | None = None
        # "reload_weights": vLLM's in-place reload (layerwise, handles quantised models); "load_weights": the model's
        # load_weights called directly. Pick one for the engine's lifetime: the first reload wraps the loaders.
        self.weight_load = gen_cfg.weight_load

        self._version = 0
        self._engine = threading.Lock()  # engine use (a wave, greedy decoding) vs weight loads
        self._state = threading.Lock()  # queue / running / done / cancelled
        self._changed = threading.Condition(self._state)
        self._queue: deque[GenerationRequest] = deque()
        self._running: dict[int, GenerationRequest] = {}
        self._cancelled: set[int] = set()
        self._done: list[GroupRollouts] = []
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        if gen_cfg.background:
            self._thread = threading.Thread(target=self._background, name="asyncrl-vllm", daemon=True)
            self._thread.start()

    # ---- construction helpers ----------------------------------------------------------------------------------

    @staticmethod
    def _eos_id(model_cfg: Any, tokenizer: Any) -> int | None:
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            return int(tokenizer.eos_token_id)
        if model_cfg.hf_path:
            from transformers import AutoConfig

            eos = getattr(AutoConfig.from_pretrained(model_cfg.hf_path), "eos_token_id", None)
            if isinstance(eos, (list, tuple)):
                eos = eos[0] if eos else None
            return None if eos is None else int(eos)
        return None

    def _write_model_dir(self) -> str:
        if self.tokenizer is None:
            raise ValueError("a model built from ModelConfig (no hf_path) needs the tokenizer")
        self._tmpdir = tempfile.mkdtemp(prefix="asyncrl-vllm-")
        return str(write_model_dir(self.model_cfg, self.tokenizer, self.seed, self._tmpdir))

    def _params(self, request: GenerationRequest) -> Any:
        g = self.gen_cfg
        return self._sp(
            n=request.n,
            temperature=g.temperature,
            top_p=g.top_p,
            max_tokens=g.max_new_tokens,
            logprobs=0,  # the sampled token's logprob only
            seed=group_seed(self.seed, request.group_id) if self.per_group_seed else None,
            stop_token_ids=[self.eos_id] if self.eos_id is not None else None,
            detokenize=False,  # the controller decodes with its own tokenizer
        )

    # ---- the GenerationBackend surface ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_new_tokens(self) -> int:
        return self.gen_cfg.max_new_tokens

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        with self._changed:
            self._check_open()
            self._queue.extend(requests)
            self._changed.notify_all()

    def num_inflight(self) -> int:
        """Groups submitted and not yet returned by ``poll`` (queued, generating, or finished and waiting),
        aborted ones excluded."""
        with self._state:
            running = sum(1 for gid in self._running if gid not in self._cancelled)
            return len(self._queue) + running + len(self._done)

    def poll(self, timeout: float | None = 0.0) -> list[GroupRollouts]:
        """Finished groups, in submission order within a wave.

        Without a background thread, runs everything queued now as one wave in the calling thread (``timeout`` is
        not needed: generation is synchronous). With one, waits up to ``timeout`` seconds for a finished group
        (``None``: until one finishes or nothing is in flight)."""
        if self._thread is None:
            while True:
                batch = self._take_wave()
                if not batch:
                    break
                self._run_wave(batch)
                if self.max_groups_per_wave is None:
                    break
            return self._take_done()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while not self._done and self._error is None:
                if not (self._queue or self._running):
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._changed.wait(remaining)
        return self._take_done()

    def abort(self, group_ids: Sequence[int]) -> list[int]:
        """Cancel unfinished groups: queued ones are dropped, running ones are never returned (their wave still
        finishes on the GPU). Finished groups are not cancelled. Returns the ids cancelled."""
        wanted = set(group_ids)
        with self._changed:
            cancelled = [r.group_id for r in self._queue if r.group_id in wanted]
            if cancelled:
                self._queue = deque(r for r in self._queue if r.group_id not in wanted)
            for gid in self._running:
                if gid in wanted and gid not in self._cancelled:
                    self._cancelled.add(gid)
                    cancelled.append(gid)
            self._changed.notify_all()
        return cancelled

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Load HF-named tensors into the engine in place (after any running wave), reset the prefix cache, then
        set ``version``. On failure the version stays what it was."""
        items = list(weights.items())
        with self._engine:
            t0 = time.perf_counter()
            if self.weight_load == "reload_weights":
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
            else:  # the model's own load_weights, directly (unquantized models need no re-processing)
                self.llm.apply_model(lambda model: model.load_weights(items) and None)
            self.llm.reset_prefix_cache()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.last_sync_seconds = time.perf_counter() - t0
            with self._state:
                self._version = int(version)

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | None = None) -> list[list[int]]:
        """Greedy (temperature 0) completions of token-id prompts under the current weights, eos included."""
        if not prompts:
            return []
        params = self._sp(n=1, temperature=0.0, max_tokens=max_new_tokens or self.gen_cfg.max_new_tokens,
                          stop_token_ids=[self.eos_id] if self.eos_id is not None else None, detokenize=False)
        with self._engine:
            outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def state_dict(self) -> dict[str, Any]:
        """The version (sampling seeds derive from the seed and group ids, so there is no RNG state to keep)."""
        return {"version": self._version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._state:
            self._version = int(state["version"])

    def close(self) -> None:
        """Stop the background thread, drop queued work, shut the engine down, remove the temporary model dir."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
            self._queue.clear()
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
        with self._engine:
            llm, self.llm = self.llm, None
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                try:
                    core.shutdown()
                except Exception:  # noqa: BLE001 - best effort: the process may be exiting
                    pass
            del llm
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ---- waves ---------------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the vLLM generator is closed")

    def _take_wave(self) -> list[GenerationRequest]:
        with self._state:
            limit = self.max_groups_per_wave or len(self._queue)
            batch = [self._queue.popleft() for _ in range(min(limit, len(self._queue)))]
            for r in batch:
                self._running[r.group_id] = r
            return batch

    def _take_done(self) -> list[GroupRollouts]:
        with self._state:
            if self._error is not None:
                error, self._error = self._error, None
                raise RuntimeError("vLLM generation failed in the background thread") from error
            done, self._done = self._done, []
            return done

    def _run_wave(self, batch: list[GenerationRequest]) -> None:
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in batch]
        params = [self._params(r) for r in batch]
        try:
            with self._engine:
                version = self._version
                outs = self.llm.generate(prompts, params, use_tqdm=False)
        except BaseException:
            with self._changed:
                for r in batch:
                    self._running.pop(r.group_id, None)
                    self._cancelled.discard(r.group_id)
                self._changed.notify_all()
            raise
        groups = []
        for r, out in zip(batch, outs):
            completions = sorted(out.outputs, key=lambda c: c.index)
            ids = [list(c.token_ids) for c in completions]
            lps = [[_sampled_logprob(c.logprobs[i], t) for i, t in enumerate(tok)] for c, tok in zip(completions, ids)]
            groups.append(GroupRollouts(
                group_id=r.group_id, prompt_ids=list(r.prompt_ids), completion_ids=ids, logprobs=lps,
                gen_start_version=version, gen_end_version=version,
                finish_reasons=[str(c.finish_reason) for c in completions],
            ))
        with self._changed:
            for r, group in zip(batch, groups):
                self._running.pop(r.group_id, None)
                if r.group_id in self._cancelled:
                    self._cancelled.discard(r.group_id)
                else:
                    self._done.append(group)
            self._changed.notify_all()

    def _background(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
            batch = self._take_wave()
            if not batch:
                continue
            try:
                self._run_wave(batch)
            except BaseException as exc:  # surfaced by the next poll
                with self._changed:
                    self._error = exc
                    self._changed.notify_all()
