"""``generation:`` — one typed section per generation engine (torch, vLLM, simulated), chosen by ``backend``.

Invariants:
- Every knob has a description, and an unknown key is an error listing the allowed ones (``StrictModel``), so a
  knob of another backend (or a typo) is never silently ignored.
- A section names its engine (``engine``, "module:Class"); ``asyncrl.config.backends`` registers it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.config.placement import Placement
from asyncrl.strict import StrictModel


class _Generation(Placement):
    placement: Literal["local", "process", "ray"] = Field(
        "local", description="'local': in the controller's process; 'process': a child process over a pipe (its "
        "own interpreter lock, for CPU overlap; asyncrl/backends/process.py); 'ray': in a Ray actor of its own")
    max_new_tokens: int = Field(4, ge=1, description="completion length limit (tokens, eos included)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass (1: off)")
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens, before top_p (0: off)")
    stop: list[str] = Field(
        default_factory=list, description="stop strings: a completion ends with the token that completes one "
        "of them in its decoded text (finish_reason 'stop'; the string stays in the completion)")

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: list[str]) -> list[str]:
        if any(s == "" for s in stop):
            raise ValueError(f"generation.stop {stop!r}: an empty stop string would end every completion at once")
        return stop
    replicas: int = Field(
        1, ge=1, description="generation engines, each in a Ray actor of its own (> 1 needs placement 'ray'); the "
        "controller sees one backend: asyncrl/backends/replicas.py")
    weight_sync: Literal["driver", "collective"] = Field(
        "driver", description="how weights reach the generator after each step: 'driver' (through the "
        "controller's process) or 'collective' (policy actor -> generator actor over a torch.distributed group, "
        "NCCL on GPUs / gloo on CPU; both placements 'ray'); see asyncrl/backends/weight_sync.py")


class _LongTail(_Generation):
    """Long-tailed completion lengths, drawn per group by ``asyncrl.backends.sampling.group_max_tokens``."""

    min_new_tokens_tail: int | None = Field(
        None, ge=1, description="long-tailed completion lengths: each group's token limit is drawn (seeded by "
        "seed and group id) as min(max_new_tokens, round(min_new_tokens_tail * exp(length_sigma * |z|))), z "
        "standard normal; None: every group gets max_new_tokens. A randomly initialised model rarely emits eos, "
        "so this is what gives a throughput preset the length spread of real RL")
    length_sigma: float = Field(
        1.0, gt=0, description="spread of the long-tailed token limit (see min_new_tokens_tail)")

    @model_validator(mode="after")
    def _lengths_fit(self) -> "_LongTail":
        if self.min_new_tokens_tail is not None and self.min_new_tokens_tail > self.max_new_tokens:
            raise ValueError(f"min_new_tokens_tail {self.min_new_tokens_tail} exceeds max_new_tokens "
                             f"{self.max_new_tokens}: the drawn limits lie between the two")
        return self


class TorchGenerationConfig(_LongTail):
    """Generation with the embedded torch engine (asyncrl/backends/torch.py)."""

    backend: Literal["torch"] = "torch"
    engine: ClassVar[str] = "asyncrl.backends.torch:TorchGenerator"


class VLLMGenerationConfig(_LongTail):
    """Generation with vLLM (asyncrl/backends/vllm.py)."""

    backend: Literal["vllm"] = "vllm"
    engine: ClassVar[str] = "asyncrl.backends.vllm:VLLMGenerator"
    gpu_memory_utilization: float = Field(0.3, gt=0, lt=1, description="vLLM's share of the GPU's memory")
    enforce_eager: bool = Field(True, description="no CUDA graphs: builds ~20-25 s faster, decodes slower (vllm.py)")
    background: bool = Field(
        False, description="step the engine in a thread of the generator's own; poll(timeout) only collects")
    weight_update: Literal["drain", "inflight"] = Field("drain", description="'drain': a load lets the groups sent "
                                                        "before it finish; 'inflight': between two steps (vllm.py)")
    weight_load: Literal["reload_weights", "load_weights"] = Field(
        "reload_weights", description="how weights enter the engine: vLLM's reload_weights, or the model's own "
        "load_weights via apply_model")
    per_group_seed: bool = Field(
        True, description="seed each group's sampling from (seed, group id), so it does not depend on what else runs")
    enable_prefix_caching: bool = Field(
        False, description="vLLM's prefix cache. Off by default: GRPO prompts are short and new weights void "
        "every cached prefix, so a cache would cost a reset (a walk over every KV block) at every weight sync")
    kv_cache_tokens: int | None = Field(
        None, ge=1, description="size the KV pool to this many tokens (vLLM's kv_cache_memory_bytes, computed "
        "from the model's layers, KV heads and dtype) instead of gpu_memory_utilization; a step needs about "
        "groups x group_size x (prompt + max_new_tokens) tokens")
    max_num_seqs: int | None = Field(
        None, ge=1, description="sequences vLLM decodes at once (None: vLLM's default, 256 on this GPU class)")
    max_loras: int = Field(
        4, ge=1, description="with model.lora: vLLM adapters served at once, one per weight version a group in "
        "flight uses (at least the sampler's window W + 1); vLLM's max_loras and max_cpu_loras")
    llm_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra keyword arguments for vllm.LLM (e.g. logprobs_mode)")

    @field_validator("device")
    @classmethod
    def _first_visible_gpu(cls, device: str) -> str:  # an index would only key the device lock, not the engine
        if device.startswith("cuda:") and device != "cuda:0":
            raise ValueError(
                f"generation.device {device!r}: vLLM runs on the first GPU its process sees; choose the GPU with "
                "placement 'ray' (Ray gives the actor a GPU of its own) or CUDA_VISIBLE_DEVICES, and set device 'cuda'")
        return device


class SimulatedTurns(StrictModel):
    """Multi-turn trajectories of the simulated generator (asyncrl/backends/simulated.py, "Turns"): how many model
    turns each trajectory plays and how long each environment call takes. Times are virtual seconds."""

    max_turns: int = Field(3, ge=1, description="model turns per trajectory at most (environment.max_turns)")
    mean_turns: float | None = Field(
        None, ge=1, description="mean turns per trajectory before clipping to max_turns: after each turn a "
        "trajectory ends with probability 1 / mean_turns (geometric); None: every trajectory plays max_turns")
    env_latency_s: float = Field(0.0, ge=0, description="median seconds of one environment call (a step after "
                                 "each model turn, the last included, as a text environment's)")
    env_latency_tail: Literal["lognormal", "pareto"] = Field(
        "lognormal", description="the calls' latency distribution with that median: lognormal (env_latency_sigma) "
        "or pareto (env_latency_alpha)")
    env_latency_sigma: float = Field(1.0, gt=0, le=4, description="lognormal: standard deviation of log seconds")
    env_latency_alpha: float = Field(2.0, gt=1, le=20, description="pareto: tail index (> 1; smaller is heavier)")
    env_latency_max_s: float | None = Field(
        None, gt=0, description="a call's seconds are clipped to this (the environment's own cap); None: no cap")
    env_tokens: int = Field(2, ge=0, description="observation tokens after each model turn but the last "
                            "(context: untrained, like a real environment's)")
    workers: int = Field(0, ge=0, description="environment workers (environment.workers): under an asynchronous "
                         "sampler in asyncrl.simulate (free turns) each trajectory goes on when its call ends and a "
                         "call waits for its group's worker (group id mod workers); 0: a group's turns in lockstep")

    @model_validator(mode="after")
    def _fits(self) -> "SimulatedTurns":
        if self.mean_turns is not None and self.mean_turns > self.max_turns:
            raise ValueError(f"turns.mean_turns {self.mean_turns} exceeds turns.max_turns {self.max_turns}")
        return self


class SimulatedGeneration(StrictModel):
    """Latency and reward model of the simulated generator (asyncrl/backends/simulated.py says how each knob
    is used). Times are virtual seconds. A knob set of its own, so ``asyncrl.simulate``'s calibration can fit one."""

    prefill_s: float = Field(0.0, ge=0, description="seconds before a group's first token (prefill, engine queue)")
    decode_s_per_token: float = Field(
        0.0, ge=0, description="seconds per decoding step; a group lasts prefill_s + this x its longest completion")
    lengths: Literal["uniform", "lognormal", "pareto"] = Field(
        "uniform", description="completion-length distribution: uniform on [1, max_new_tokens], or a long tail "
        "(lognormal, pareto) with mean length_mean, clipped to [1, max_new_tokens]")
    length_mean: float | None = Field(
        None, gt=0, description="mean completion length in tokens before clipping (lognormal, pareto); "
        "None: max_new_tokens / 4")
    length_sigma: float = Field(1.0, gt=0, le=4, description="lognormal: standard deviation of log length")
    pareto_alpha: float = Field(2.0, gt=1, le=20, description="pareto: tail index (> 1; smaller is heavier)")
    concurrency: int | None = Field(
        None, ge=1, description="groups decoding at once; later ones wait in order. None: no limit")
    clock: Literal["ticks", "wall"] = Field(
        "ticks", description="ticks: each poll (rollout tick) advances virtual time by rollout_tick_s, so stepping "
        "is deterministic; wall: the seconds are real and poll waits for them (to exercise Controller.run in real "
        "time). asyncrl.simulate drives the clock itself and needs ticks")
    rollout_tick_s: float = Field(
        1.0, gt=0, description="with clock ticks, the seconds one rollout tick stands for: a group finishes "
        "ceil(its seconds / rollout_tick_s) ticks after dispatch, counting the tick that dispatched it")
    reward_base: float = Field(0.1, ge=0, le=1, description="success probability with no progress (version 0)")
    reward_max: float = Field(0.95, ge=0, le=1, description="success probability ceiling")
    # At scale (asyncrl/backends/simulated.py, "Replicas and weight updates"): K engines, how each takes groups, and
    # what a weight update does to the groups it runs. Timed only on asyncrl.simulate's virtual clock.
    admission: Literal["streaming", "wave"] = Field(
        "streaming", description="how a replica takes groups: 'streaming' starts a group as soon as one of its "
        "concurrency slots is free (the streaming vLLM engine); 'wave' starts up to concurrency queued groups "
        "together once the replica is idle and returns them all when the slowest ends (LLM.generate waves)")
    weight_update: Literal["drain", "inflight"] = Field(
        "drain", description="the GPU generator's key, same meaning: 'drain' stops taking new groups when the "
        "weights arrive, lets running ones finish on the old weights, loads, goes on (one group, one version); "
        "'inflight' loads at once between two engine steps, running groups pause for the load and span versions "
        "gen_start_version..gen_end_version (their staleness is judged by the oldest)")
    load_s: float | None = Field(
        None, ge=0, description="seconds a replica stops decoding to load weights once they arrived (the two-H200 "
        "runs' load_weights time: sync_load_s_median in "
        "benchmarks/data/bench_two_gpus/2026-11-30-balanced-g6-lr5e-4/rows.csv); None: the replica stops for its "
        "whole transfer instead (receiving is loading: the model before link bandwidth, what the what_if numbers "
        "were made with)")
    gpus_per_replica: int = Field(
        1, ge=1, description="GPUs one engine uses (tensor parallel); summary()['gpus'] counts them")
    turns: SimulatedTurns | None = Field(
        None, description="multi-turn trajectories (max_turns, mean_turns, env_latency_s and its tail, "
        "env_tokens): each group's trajectories play turns with environment calls between them, producing turn "
        "events and per-turn versions; None: one model turn per completion")

    @model_validator(mode="after")
    def _ordered(self) -> "SimulatedGeneration":
        if self.reward_max < self.reward_base:
            raise ValueError(f"reward_max {self.reward_max} must be >= reward_base {self.reward_base}")
        return self


class SimulatedGenerationConfig(_Generation, SimulatedGeneration):
    """Generation without a model (asyncrl/backends/simulated.py): latency, completion-length and reward models."""

    backend: Literal["simulated"] = "simulated"
    engine: ClassVar[str] = "asyncrl.backends.simulated:SimulatedGenerator"
    replicas: int = Field(
        1, ge=1, description="simulated engines, each with its concurrency slots, modelled in one backend with "
        "placement 'local' (groups go to the least loaded; weights reach each as trainer.sync_fanout says); with "
        "placement 'ray', one Ray actor each as for a real engine")
