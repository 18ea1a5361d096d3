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
  ``collective_rpc("reload_weights", weights_iterator=...)`` (HF names; vLLM fuses qkv and gate/up itself), and
  ``reset_prefix_cache()`` only if the prefix cache is on (cached prefixes hold the old weights' keys and values;
  the reset walks every KV block in Python, so its cost follows the pool's size: the cache is off by default);
  ``version`` changes only after both completed.
  (``gen_cfg.weight_load: load_weights`` calls the model's ``load_weights`` directly instead.)
- Staged weights (``stage_weights``, what the collective sync's receive uses): new weights are received into
  staging buffers *while a wave runs* and swapped in between waves. Invariants: the engine never runs on a partly
  loaded set (the swap holds the engine lock); staged buffers are never written while being loaded (one staging
  lock around the receive and around the swap); a newer staged set replaces an older one not yet swapped in (the
  version may then skip one). ``version`` is the version *new work* runs with: the staged set's once its receive
  completed (no wave starts before swapping it in), so a group dispatched while a wave still runs on the old
  weights is recorded with the weights it will really get; each group carries the version its wave ran with
  (``gen_start_version``). The receive returns as soon as the set is staged, so the trainer's sync never waits
  for the load (on two H200s that took 3-4 ms off every step of the trainer's side): the swap comes at the end of
  the running wave or the start of the next wave, eval or poll, whichever is first, and with ``gen_cfg.background``
  the wave thread does it at once when no wave runs. ``sync_parts()`` records each sync's parts (receive, wait for
  the swap, load, prefix-cache reset).
- The KV pool: ``gen_cfg.kv_cache_tokens`` sizes it from a token budget (vLLM's ``kv_cache_memory_bytes``),
  otherwise ``gpu_memory_utilization`` does. ``max_num_seqs`` bounds sequences decoded at once.
- Completion lengths: ``max_new_tokens``, or per group a long-tailed limit (``min_new_tokens_tail``,
  ``length_sigma``; ``group_max_tokens``), drawn from the seed and group id.
- ``abort`` cancels queued groups outright; groups of the running wave are cancelled too (never returned), but
  ``LLM.generate`` cannot be interrupted, so their GPU work finishes with the wave.
- Logprobs are vLLM's default ``raw_logprobs``: the model's temperature-1 distribution, before temperature and
  top-p, which is what the policy computes (``gen_cfg.llm_kwargs`` can change ``logprobs_mode``).
- Sampling seeds are per group (derived from ``seed`` and the group id), so what a group samples does not depend
  on which other groups share its wave.

Colocated with Megatron on one GPU: create both in one process; ``gen_cfg.gpu_memory_utilization`` (or
``kv_cache_tokens``) bounds vLLM's share of the GPU; every use of the engine holds the process's lock for the device
(``device_lock``), so vLLM's and Megatron's GPU work never interleave. ``VLLM_ENABLE_V1_MULTIPROCESSING`` defaults
to ``0`` here (engine in this process, so weights pass by reference), unless the environment already sets it.
``import vllm`` happens only when a generator is built.
"""

from __future__ import annotations

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

from asyncrl.backends.base import Capabilities
from asyncrl.backends.device_lock import exclusive_device
from asyncrl.backends.hf import build_hf_config, init_hf_model
from asyncrl.backends.sampling import group_max_tokens, group_seed
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


def kv_cache_bytes(model_cfg: Any, hf_config: Any, tokens: int) -> int:
    """Bytes of vLLM's KV pool for ``tokens`` tokens: keys and values, every layer, every KV head."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim
    return int(tokens) * per_token * (2 if model_cfg.dtype == "bfloat16" else 4)


def _sampled_logprob(entry: Any, token_id: int) -> float:
    """The logprob of ``token_id`` in one position's logprobs entry (a ``{token_id: Logprob}`` mapping)."""
    value = entry[token_id]
    return float(getattr(value, "logprob", value))


class VLLMGenerator:
    """A ``GenerationBackend`` on ``vllm.LLM``. See the module docstring.

    ``llm`` and ``sampling_params_cls`` replace the real engine and ``vllm.SamplingParams`` (tests use small
    fakes of that surface: ``generate(prompts, params, use_tqdm=False)``, ``collective_rpc``,
    ``reset_prefix_cache``)."""

    # Ray may serve two calls of this actor at once (asyncrl.backends.ray): a weight receive runs during a wave.
    # Safe: every engine use holds ``_engine`` and staged weights ``_staging`` (module docstring).
    capabilities = Capabilities(ray_max_concurrency=2)

    def __init__(self, model_cfg: ModelConfig, gen_cfg: VLLMGenerationConfig, seed: int = 0, tokenizer: Any = None, *,
                 llm: Any = None, sampling_params_cls: Any = None):
        self.model_cfg, self.gen_cfg, self.seed = model_cfg, gen_cfg, seed
        self.tokenizer = tokenizer
        self._tmpdir: str | None = None
        self.eos_id = self._eos_id(model_cfg, tokenizer)
        self.model_dir: str | None = None
        self.device = torch.device(gen_cfg.device)
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
                enable_prefix_caching=gen_cfg.enable_prefix_caching,
            )
            if not model_cfg.hf_path:
                kwargs["max_model_len"] = model_cfg.max_position_embeddings
            if gen_cfg.kv_cache_tokens is not None:
                from transformers import AutoConfig

                kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(
                    model_cfg, AutoConfig.from_pretrained(self.model_dir), gen_cfg.kv_cache_tokens)
            if gen_cfg.max_num_seqs is not None:
                kwargs["max_num_seqs"] = gen_cfg.max_num_seqs
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
        self._sync_parts: deque[dict[str, float]] = deque(maxlen=10_000)
        self._staging = threading.Lock()  # staged buffers: written by a receive, read by the swap
        # weights, version, when staged, seconds fill() took
        self._staged: tuple[Mapping[str, torch.Tensor], int, float, float] | None = None
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
            max_tokens=group_max_tokens(g, self.seed, request.group_id),
            logprobs=0,  # the sampled token's logprob only
            seed=group_seed(self.seed, request.group_id) if self.per_group_seed else None,
            stop_token_ids=[self.eos_id] if self.eos_id is not None else None,
            detokenize=False,  # the controller decodes with its own tokenizer
        )

    # ---- the GenerationBackend surface ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The weights new work runs with: staged ones count, as no wave starts before they are swapped in."""
        staged = self._staged  # one read: the swap clears it only after _version moved
        return self._version if staged is None else staged[1]

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
            if self._staged is not None and self._engine.acquire(blocking=False):
                try:  # weights staged while the last wave ran: swap them in now, not at the next wave
                    self._swap_staged()
                finally:
                    self._engine.release()
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
        """Load HF-named tensors into the engine in place (after any running wave), reset the prefix cache if it
        is on, then set ``version``. On failure the version stays what it was."""
        with self._engine:
            self._load(weights, version, {"receive_s": 0.0, "swap_wait_s": 0.0})

    def stage_weights(self, weights: Mapping[str, torch.Tensor], version: int, fill: Any = None) -> None:
        """Stage ``weights`` as ``version`` without waiting for a running wave: ``fill()`` (if given) writes them
        first, under the staging lock (the collective sync receives into ``weights`` there). ``version`` says so at
        once; they are swapped in before the next wave (module docstring). ``weights`` must stay untouched by the
        caller until the next ``stage_weights`` call: they are read at the swap."""
        with self._staging:
            t0 = time.perf_counter()
            if fill is not None:
                fill()
            t1 = time.perf_counter()
            self._staged = (weights, int(version), t1, t1 - t0)
        if self._thread is not None:  # the wave thread swaps them in (at once if no wave runs); the sender goes on
            with self._changed:
                self._changed.notify_all()

    def _swap_staged(self) -> None:
        """Load the staged weights, if any; the caller holds ``_engine``."""
        with self._staging:
            if self._staged is None:
                return
            weights, version, staged_at, receive_s = self._staged
            try:
                self._load(weights, version, {"receive_s": receive_s, "swap_wait_s": time.perf_counter() - staged_at})
            finally:
                self._staged = None  # after _version moved, so ``version`` never reads an older one meanwhile

    def _load(self, weights: Mapping[str, torch.Tensor], version: int, parts: dict[str, float]) -> None:
        items = list(weights.items())
        with exclusive_device(self.device, type(self).__name__):
            t0 = time.perf_counter()
            if self.weight_load == "reload_weights":
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
            else:  # the model's own load_weights, directly (unquantized models need no re-processing)
                self.llm.apply_model(lambda model: model.load_weights(items) and None)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t1 = t2 = time.perf_counter()
            if self.gen_cfg.enable_prefix_caching:
                self.llm.reset_prefix_cache()
                t2 = time.perf_counter()
        self.last_sync_seconds = t2 - t0
        self._sync_parts.append({"version": int(version), **parts, "load_s": t1 - t0, "reset_s": t2 - t1})
        with self._state:
            self._version = int(version)

    def sync_parts(self) -> list[dict[str, float]]:
        """One record per weight load, oldest first: ``version``, ``receive_s`` (writing the staged buffers: the
        transfer, for a collective sync), ``swap_wait_s`` (staged until swapped in: the wave it waited for),
        ``load_s`` (into the engine, device synchronised) and ``reset_s`` (prefix-cache reset; 0 when off)."""
        return list(self._sync_parts)

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | None = None) -> list[list[int]]:
        """Greedy (temperature 0) completions of token-id prompts under the current weights, eos included."""
        if not prompts:
            return []
        params = self._sp(n=1, temperature=0.0, max_tokens=max_new_tokens or self.gen_cfg.max_new_tokens,
                          stop_token_ids=[self.eos_id] if self.eos_id is not None else None, detokenize=False)
        with self._engine:
            self._swap_staged()
            with exclusive_device(self.device, type(self).__name__):
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
                self._swap_staged()  # between waves: weights staged during the last one
                version = self._version
                with exclusive_device(self.device, type(self).__name__):
                    outs = self.llm.generate(prompts, params, use_tqdm=False)
                self._swap_staged()  # staged during this wave: in before the next one is even asked for
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
                while not self._queue and self._staged is None and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
            try:
                batch = self._take_wave()
                if batch:
                    self._run_wave(batch)  # swaps staged weights in first
                else:
                    with self._engine:
                        self._swap_staged()
            except BaseException as exc:  # surfaced by the next poll
                with self._changed:
                    self._error = exc
                    self._changed.notify_all()
