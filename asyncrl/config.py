"""Run configuration: pydantic models, YAML presets, and ``load_config(preset_or_path, **overrides)``.

Cross-field rules live here, where a bad combination is rejected before anything starts:
- a sampler that may train on stale data needs an importance-sampling correction in the loss;
- the buffer must hold at least the sampler's ``required_buffer_capacity(groups_per_step)``;
- chunk bounds fit inside a step.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from asyncrl.algorithms import LossConfig
from asyncrl.faults import FaultsConfig
from asyncrl.presets import PRESETS, presets
from asyncrl.samplers import CustomConfig, InOrderConfig, SamplerConfig, build_custom, build_sampler
from asyncrl.tasks import build_task
from asyncrl.tracking import TrackingConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Knobs(_Strict):
    """A backend's section: an unknown key is an error that lists the allowed ones (a typo is never silently
    ignored), like the samplers' ``KnobModel``."""

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            unknown = [key for key in data if key not in cls.model_fields]
            if unknown:
                given = ", ".join(f"{key}={data[key]!r}" for key in unknown)
                raise ValueError(f"unknown key(s) {given} for {cls.__name__}; allowed: {list(cls.model_fields)}")
        return data


class ModelConfig(_Strict):
    """A Llama-style causal LM built from this config (random init), or loaded from ``hf_path``."""

    hidden_size: int = Field(128, ge=1)
    intermediate_size: int = Field(344, ge=1)
    num_hidden_layers: int = Field(2, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    max_position_embeddings: int = Field(64, ge=8)
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    hf_path: str | None = None  # a local Hugging Face checkpoint directory (config + safetensors + tokenizer)
    dtype: Literal["float32", "bfloat16"] = "float32"

    def llama_config(self, vocab_size: int, pad_token_id: int, bos_token_id: int, eos_token_id: int):
        """The ``transformers.LlamaConfig`` every backend builds this model from (when there is no ``hf_path``),
        so the torch, Megatron and vLLM engines start from the same architecture and the same init."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta, tie_word_embeddings=self.tie_word_embeddings, attention_dropout=0.0,
            pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
        )


# --- backends: one typed section per engine, chosen by ``backend`` ----------------------------------------------


class _Placement(_Knobs):
    backend: str  # each variant narrows it to its Literal name (the discriminator)
    device: str = Field("cpu", description="torch device the engine runs on: 'cpu', 'cuda', 'cuda:1', ...")
    placement: Literal["local", "ray"] = Field(
        "local", description="'local': in the controller's process; 'ray': in a Ray actor of its own")
    ray_options: dict[str, Any] = Field(
        default_factory=dict, description="options of the Ray actor when placement is 'ray' (num_gpus, num_cpus, "
        "runtime_env, resources, ...); see asyncrl/backends/ray.py")


class _Generation(_Placement):
    placement: Literal["local", "process", "ray"] = Field(
        "local", description="'local': in the controller's process; 'process': a child process over a pipe (its "
        "own interpreter lock, for CPU overlap; asyncrl/backends/process.py); 'ray': in a Ray actor of its own")
    max_new_tokens: int = Field(4, ge=1, description="completion length limit (tokens, eos included)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass (1: off)")
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


class SimulatedGeneration(_Knobs):
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


class _Trainer(_Placement):
    lr: float = Field(1e-4, gt=0, description="learning rate")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float | None = Field(1.0, gt=0, description="gradient norm clip (None: no clipping)")
    micro_batch_size: int | None = Field(
        None, ge=1, description="micro_batching 'rows': sequences per forward/backward, in the chunk's order; "
        "None: a whole chunk")

    @property
    def ranks(self) -> int:
        """Trainer ranks (the world size): data_parallel x tensor_parallel for an engine that has ranks, else 1."""
        return 1


class _MicroBatched(_Trainer):
    """How an engine cuts a chunk into forward/backward passes (``asyncrl/micro_batches.py`` holds the plans and
    their invariants). Setting only ``micro_batch_size`` means ``micro_batching: rows``."""

    micro_batch_tokens: int | None = Field(
        None, ge=1, description="micro_batching 'sorted' / 'packed': positions (rows x padded width) per "
        "forward/backward; None: 16384 (Megatron on CUDA: as many as fit the memory free at the first step)")
    logprob_chunk_tokens: int = Field(
        2048, ge=1, description="positions per chunk of the output layer: token logprobs and entropy are computed "
        "from the last hidden states this many positions at a time, forward and backward, never as a whole "
        "pass's [positions, vocabulary] logits (asyncrl.algorithms.chunked_logprobs)")

    @model_validator(mode="before")
    @classmethod
    def _size_means_rows(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("micro_batch_size") is not None and "micro_batching" not in data:
            data = {**data, "micro_batching": "rows"}
        return data

    @model_validator(mode="after")
    def _micro_batch_knobs(self) -> "_MicroBatched":
        from asyncrl.micro_batches import check_knobs

        check_knobs(self.micro_batching, self.micro_batch_size, self.micro_batch_tokens)
        return self


class TorchTrainerConfig(_MicroBatched):
    """Training with the embedded torch engine (asyncrl/backends/torch.py)."""

    backend: Literal["torch"] = "torch"
    engine: ClassVar[str] = "asyncrl.backends.torch:TorchPolicy"
    micro_batching: Literal["rows", "sorted"] = Field(
        "rows", description="'rows': micro_batch_size sequences at a time, padded to the chunk's longest (the "
        "default: CPU runs stay bit for bit as before); 'sorted': length-sorted micro-batches of at most "
        "micro_batch_tokens positions, each padded to its own longest")
    data_parallel: int = Field(
        1, ge=1, description="data-parallel ranks, one Ray actor each in one torch.distributed group (> 1 needs "
        "placement 'ray'): asyncrl/backends/ranks.py")
    tensor_parallel: int = Field(1, ge=1, description="must be 1: the torch engine holds the whole model in a rank")

    @field_validator("tensor_parallel")
    @classmethod
    def _no_tensor_parallel(cls, tp: int) -> int:
        if tp != 1:
            raise ValueError(f"tensor_parallel {tp}: the torch backend keeps a whole model in each rank; use "
                             "data_parallel, or trainer.backend 'megatron' for tensor parallelism")
        return tp

    @property
    def ranks(self) -> int:
        return self.data_parallel


class MegatronTrainerConfig(_MicroBatched):
    """Training with Megatron-core (asyncrl/backends/megatron.py)."""

    backend: Literal["megatron"] = "megatron"
    engine: ClassVar[str] = "asyncrl.backends.megatron:MegatronPolicy"
    micro_batching: Literal["rows", "sorted", "packed"] = Field(
        "packed", description="'packed' (default): sequences packed into rows as wide as the chunk's longest, a "
        "block-diagonal causal mask, micro_batch_tokens positions per pass; 'sorted': length-sorted and padded "
        "to each micro-batch's longest; 'rows': micro_batch_size sequences at a time, padded to the chunk's longest")
    tensor_parallel: int = Field(1, ge=1, description="tensor-parallel ranks (x data_parallel = world size)")
    data_parallel: int = Field(1, ge=1, description="data-parallel ranks")
    optimizer: Literal["megatron", "torch"] | None = Field(
        None, description="'megatron' (DDP + Megatron's optimizer, fp32 master weights) or 'torch' (AdamW on the "
        "bare model); None: megatron on CUDA, torch elsewhere")
    adam_eps: float = Field(1e-8, gt=0, description="Adam epsilon")
    compute_entropy: bool = Field(
        True, description="compute the entropy metric even when the loss has no entropy bonus (costs a pass)")
    attention: Literal["auto", "flex", "unfused"] = Field(
        "auto", description="'flex': FlexAttention, a fused kernel under a document-masked causal block mask "
        "(packed sequences); 'unfused': Megatron's local matmul-softmax-matmul over a [rows, heads, W, W] score "
        "matrix; 'auto': flex on CUDA, unfused elsewhere (asyncrl/backends/megatron_forward.py)")

    @model_validator(mode="after")
    def _megatron_optimizer_needs_cuda(self) -> "MegatronTrainerConfig":  # it takes only torch.cuda parameters
        if self.optimizer == "megatron" and not str(self.device).startswith("cuda"):
            raise ValueError(f"trainer.optimizer 'megatron' needs a CUDA device (megatron-core's optimizer makes its "
                             f"tensors on cuda); got trainer.device {self.device!r}: use optimizer 'torch'")
        return self

    @property
    def ranks(self) -> int:
        return self.data_parallel * self.tensor_parallel


class SimulatedTraining(_Knobs):
    """Latency and learning model of the simulated policy (asyncrl/backends/simulated.py). Times are virtual
    seconds."""

    train_s_per_token: float = Field(0.0, ge=0, description="seconds of training per completion token")
    train_s_per_step: float = Field(0.0, ge=0, description="fixed seconds per optimizer step (optimizer, overhead)")
    sync_s: float = Field(0.0, ge=0, description="seconds per weight sync; the generator stops decoding meanwhile")
    overlap_slowdown: float = Field(
        1.0, ge=1, le=4, description="how much slower training and generation each run while the other runs too: "
        "1 on separate hardware (full overlap), 2 when they share one resource (overlap gains nothing); a real "
        "machine's value comes from timing the two alone and at once (asyncrl.simulate.measure_overlap)")
    clock: Literal["ticks", "wall"] = Field(
        "ticks", description="wall: training and the sync sleep their seconds (for real-time runs); ticks: they "
        "take no wall time, and asyncrl.simulate books them in virtual time")
    reward_gain: float = Field(0.01, ge=0, le=1, description="success probability a step on fresh data adds")
    stale_progress: float = Field(
        0.5, ge=0, le=1, description="share of a step's progress kept per version of lag: gain x this ** lag")
    # At scale (asyncrl/backends/simulated.py, "Replicas and weight updates"): ranks and the weight transfer.
    data_parallel: int = Field(
        1, ge=1, description="simulated data-parallel ranks: a chunk's per-token time is divided by the speed-up "
        "R x scaling_efficiency ** log2(R); train_s_per_step is paid once a step")
    scaling_efficiency: float = Field(
        0.9, gt=0, le=1, description="share of the ideal speed-up kept per doubling of data_parallel (gradient "
        "all-reduce, stragglers). Not measured: no multi-rank GPU run has been timed (the two-H200 DP2 run checked "
        "correctness only), so 0.9 is an assumption to sweep")
    weight_bytes: float = Field(
        0.0, ge=0, description="bytes sent to each replica per weight sync (parameters x bytes each: 236M in bf16 "
        "is 4.72e8); each transfer takes sync_s + weight_bytes / link_gb_per_s")
    link_gb_per_s: float = Field(
        48.0, gt=0, description="link bandwidth of one transfer, GB/s. 48: the two-H200 NCCL receive of the ~0.5B "
        "model with the GPU otherwise idle (a GPU check's timing, not in benchmarks/data: an input to sweep)")
    sync_fanout: Literal["sequential", "tree"] = Field(
        "sequential", description="how the weights reach K replicas: 'sequential' one transfer after another "
        "(replica i has them after (i + 1) transfers), 'tree' a binomial broadcast (every holder sends on: replica "
        "i after floor(log2(i + 1)) + 1 transfers); the trainer waits until the last has them")
    colocated: bool = Field(
        False, description="the trainer runs on the generation replicas' GPUs (one GPU: the engines take turns; "
        "model the sharing with overlap_slowdown); summary()['gpus'] then counts the replicas' GPUs only")


class SimulatedTrainerConfig(_Trainer, SimulatedTraining):
    """Training without a model (asyncrl/backends/simulated.py): a step takes time proportional to its tokens."""

    backend: Literal["simulated"] = "simulated"
    engine: ClassVar[str] = "asyncrl.backends.simulated:SimulatedPolicy"


def _backend_tag(default: str):
    def tag(value: Any) -> str:
        backend = value.get("backend", default) if isinstance(value, Mapping) else getattr(value, "backend", None)
        return backend if isinstance(backend, str) else repr(backend)

    return tag


# The backend registry, one line per backend: its config section class, which names its engine (``engine``).
GENERATION_CONFIGS = {c.model_fields["backend"].default: c for c in (
    TorchGenerationConfig, VLLMGenerationConfig, SimulatedGenerationConfig)}
TRAINER_CONFIGS = {c.model_fields["backend"].default: c for c in (
    TorchTrainerConfig, MegatronTrainerConfig, SimulatedTrainerConfig)}
GenerationConfig = Annotated[
    Union[tuple(Annotated[c, Tag(name)] for name, c in GENERATION_CONFIGS.items())],
    Discriminator(_backend_tag("torch"), custom_error_type="unknown_backend",
                  custom_error_message=f"generation.backend must be one of {list(GENERATION_CONFIGS)}"),
]
"""``generation:`` — one of ``GENERATION_CONFIGS``, chosen by ``backend`` (default ``torch``)."""
TrainerConfig = Annotated[
    Union[tuple(Annotated[c, Tag(name)] for name, c in TRAINER_CONFIGS.items())],
    Discriminator(_backend_tag("torch"), custom_error_type="unknown_backend",
                  custom_error_message=f"trainer.backend must be one of {list(TRAINER_CONFIGS)}"),
]
"""``trainer:`` — one of ``TRAINER_CONFIGS``, chosen by ``backend`` (default ``torch``)."""


class RayConfig(_Strict):
    """``ray:`` — the Ray session behind every ``placement: ray`` backend, generation replica and trainer rank."""

    address: str | None = Field(
        None, description="join this Ray cluster ('auto': the one `ray start` started on this machine; "
        "'HOST:6379'); None: the RAY_ADDRESS environment variable, else a local Ray (docs/cluster.md)")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a locally started Ray (None: all)")
    placement_timeout_s: float = Field(
        60.0, gt=0, description="how long trainer ranks and generation replicas wait for their resources before "
        "the run fails with what was asked and what the cluster has")


class TaskConfig(_Strict):
    """``task:`` — a built-in task (asyncrl/tasks.py) and its options, checked when the config loads."""

    name: str = Field("copy_digit", description="one of asyncrl.tasks.TASKS")
    options: dict[str, Any] = Field(
        default_factory=dict, description="the task factory's keyword arguments (each task's are its factory's)")

    @model_validator(mode="after")
    def _builds(self) -> "TaskConfig":
        build_task(self)  # an unknown task, an unknown option or a bad value is a ValueError naming it
        return self


class Config(_Strict):
    seed: int = 0
    groups_per_step: int = Field(8, ge=1)  # N: prompt groups per optimizer step (one batch)
    group_size: int = Field(8, ge=1)  # G: completions per prompt
    min_groups_per_chunk: int | None = Field(None, ge=1)  # None: the whole step in one chunk
    max_groups_per_chunk: int | None = Field(None, ge=1)
    max_buffered_groups: int | None = Field(None, ge=1)  # None: the sampler's required capacity (or 4N)
    max_inflight_groups: int | None = Field(None, ge=1)  # None: no bound beyond the buffer
    max_epochs: int | None = Field(None, ge=1)  # None: the prompt stream never runs out
    eval_every: int | None = Field(None, ge=1)
    # torch intra-op threads for this process (None: torch's default). On a small CPU box the two pumps each
    # run torch code; one thread each avoids oversubscribing the cores.
    torch_threads: int | None = Field(None, ge=1)
    # A run fails with a StallError (what each pump waits for, and the sampler's verdicts) when no group was
    # committed, trained, evicted or aborted for this long: groups that never come back, or a deadlocked policy.
    # Generous by default, for slow generation on big models.
    stall_timeout_s: float = Field(60.0, gt=0)
    # Checkpoints (asyncrl/checkpoint.py): every K steps into checkpoint_dir/step-XXXXXX, keeping the newest few.
    checkpoint_every: int | None = Field(None, ge=1, description="save a checkpoint every K optimizer steps")
    checkpoint_dir: str | None = Field(None, description="where checkpoint_every writes (the CLI: OUT/checkpoints)")
    keep_checkpoints: int = Field(3, ge=1, description="complete checkpoints kept; older ones are deleted")
    faults: FaultsConfig = Field(default_factory=FaultsConfig)  # retry budgets and backoff (asyncrl/faults.py)
    sampler: SamplerConfig = Field(default_factory=InOrderConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    generation: GenerationConfig = Field(default_factory=TorchGenerationConfig)
    trainer: TrainerConfig = Field(default_factory=TorchTrainerConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)  # TensorBoard / W&B; nothing unless set
    ray: RayConfig = Field(default_factory=RayConfig)

    @field_validator("loss", mode="before")
    @classmethod
    def _stale_sampler_needs_correction(cls, loss: Any, info: ValidationInfo) -> Any:
        # Runs before LossConfig's own checks, so a stale sampler with importance_correction 'none' is reported
        # as the cause (the sampler rule), not as a truncation that has nothing to correct.
        correction = loss.get("importance_correction") if isinstance(loss, dict) else None
        sampler = info.data.get("sampler")
        if correction == "none" and sampler is not None and not isinstance(sampler, CustomConfig):
            check_importance_correction(build_sampler(sampler, None), correction)
        return loss

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        N = self.groups_per_step
        if self.group_size < 2:
            raise ValueError(
                f"group_size {self.group_size}: GRPO's advantage is a reward minus its group's mean, so a group of "
                "one always has advantage 0 and learns nothing; use group_size >= 2"
            )
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError(f"checkpoint_every {self.checkpoint_every} needs checkpoint_dir (where to write)")
        for knob in ("min_groups_per_chunk", "max_groups_per_chunk"):  # a chunk is part of one step
            if getattr(self, knob) is not None and getattr(self, knob) > N:
                raise ValueError(f"{knob} {getattr(self, knob)} > groups_per_step {N}: a chunk is part of one step")
        if self.max_groups_per_chunk is not None and self.max_groups_per_chunk < self.chunk_bounds[0]:
            raise ValueError(
                f"max_groups_per_chunk {self.max_groups_per_chunk} < min_groups_per_chunk {self.chunk_bounds[0]}"
            )
        _check_scale(self)
        if self.generation.weight_sync == "collective":
            _check_collective_weight_sync(self)
        if isinstance(self.sampler, CustomConfig):  # built on an empty buffer, as its config validation did
            from asyncrl.buffer import ReplayBuffer

            sampler = build_custom(self.sampler, ReplayBuffer())
        else:
            sampler = build_sampler(self.sampler, None)
        check_sampler_fits(sampler, self)
        return self

    @property
    def chunk_bounds(self) -> tuple[int, int]:
        lo = self.min_groups_per_chunk or self.groups_per_step
        return lo, self.max_groups_per_chunk or self.groups_per_step

    def buffer_capacity(self, required: int | None) -> int:
        if self.max_buffered_groups is not None:
            return self.max_buffered_groups
        return required if required is not None else 4 * self.groups_per_step


def check_sampler_fits(sampler: Any, cfg: Config) -> None:
    """Reject a sampler the rest of the config cannot serve (raises ValueError naming both sides)."""
    check_importance_correction(sampler, cfg.loss.importance_correction)
    required = sampler.required_buffer_capacity(cfg.groups_per_step)
    if required is not None and cfg.max_buffered_groups is not None and cfg.max_buffered_groups < required:
        raise ValueError(
            f"max_buffered_groups {cfg.max_buffered_groups} is smaller than the {required} groups sampler "
            f"{sampler!r} needs with groups_per_step {cfg.groups_per_step}; it would deadlock"
        )


def check_importance_correction(sampler: Any, importance_correction: str) -> None:
    if not sampler.is_on_policy and importance_correction == "none":
        raise ValueError(
            f"sampler {sampler!r} may train on stale data, so the loss needs an importance-sampling correction: "
            "set loss.importance_correction to 'token' or 'sequence' (got 'none')"
        )


def _check_scale(cfg: Config) -> None:
    """Replicas and ranks are Ray actors (Megatron ranks may also come from torchrun, with placement 'local');
    what is not built yet says so by its knob."""
    gen, trainer = cfg.generation, cfg.trainer
    if gen.backend == "simulated" and trainer.backend == "simulated" and trainer.colocated:
        gpus = gen.replicas * gen.gpus_per_replica
        if trainer.data_parallel > gpus:
            raise ValueError(f"trainer.colocated with data_parallel {trainer.data_parallel}: the ranks share the "
                             f"generation replicas' {gpus} GPU(s); use data_parallel <= {gpus} or colocated false")
    if gen.replicas > 1 and gen.placement != "ray" and gen.backend != "simulated":  # simulated: modelled engines
        raise ValueError(f"generation.replicas {gen.replicas} starts each replica in a Ray actor: set "
                         f"generation.placement 'ray' (got {gen.placement!r})")
    ranks = trainer.ranks
    if trainer.backend == "torch" and ranks > 1 and trainer.placement != "ray":
        raise ValueError(f"trainer.data_parallel {trainer.data_parallel} starts each rank in a Ray actor: set "
                         f"trainer.placement 'ray' (got {trainer.placement!r})")
    if gen.weight_sync == "collective" and (gen.replicas > 1 or ranks > 1):
        raise ValueError(
            f"generation.weight_sync 'collective' joins one policy actor and one generator actor; with "
            f"generation.replicas {gen.replicas} and {ranks} trainer rank(s) use weight_sync 'driver'"
        )


def _check_collective_weight_sync(cfg: Config) -> None:
    placements = (cfg.trainer.placement, cfg.generation.placement)
    if placements != ("ray", "ray"):
        raise ValueError(
            "generation.weight_sync 'collective' sends weights from the policy's Ray actor to the generator's, so "
            f"both need placement 'ray'; got trainer.placement {placements[0]!r} and generation.placement "
            f"{placements[1]!r} (use weight_sync 'driver' otherwise)"
        )
    devices = (str(cfg.trainer.device), str(cfg.generation.device))
    if not (all(d.startswith("cuda") for d in devices) or all(d == "cpu" for d in devices)):
        raise ValueError(
            f"generation.weight_sync 'collective' needs both backends on CUDA (NCCL) or both on CPU (gloo); got "
            f"trainer.device {devices[0]!r} and generation.device {devices[1]!r}"
        )


_VARIANTS = {"generation": GENERATION_CONFIGS, "trainer": TRAINER_CONFIGS}


def merge_overrides(base: dict, overrides: dict) -> dict:
    """``base`` with nested ``overrides`` applied, as ``load_config(preset, **overrides)`` applies them to a preset."""
    out = dict(base)
    for key, value in overrides.items():
        # A new sampler name replaces the sampler block: knobs of one policy are errors for another.
        if key == "sampler" and isinstance(value, dict) and value.get("name") not in (None, out.get(key, {}).get("name")):
            out[key] = dict(value)
        # A new backend keeps the base's keys the new backend also has (device, placement, max_new_tokens, ...)
        # and drops the old backend's own knobs; the override's keys are all kept (unknown ones are errors).
        elif (key in _VARIANTS and isinstance(value, dict) and isinstance(out.get(key), dict)
              and value.get("backend", out[key].get("backend", "torch")) != out[key].get("backend", "torch")):
            fields = _VARIANTS[key].get(value["backend"], _Knobs).model_fields
            out[key] = {**{k: v for k, v in out[key].items() if k in fields}, **value}
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_overrides(out[key], value)
        else:
            out[key] = value
    return out


def load_config(preset_or_path: str | Path | None = "quickstart", **overrides: Any) -> Config:
    """A preset name (``quickstart``, ...) or a YAML path, with nested overrides applied on top:
    ``load_config("quickstart", seed=1, sampler={"name": "weight_fifo", "max_staleness_versions": 2})``."""
    data: dict = {}
    if preset_or_path is not None:
        path = Path(preset_or_path)
        if not path.suffix and not path.exists():
            path = PRESETS / f"{preset_or_path}.yaml"
            if not path.exists():
                raise ValueError(f"unknown preset {str(preset_or_path)!r}; presets: {presets()}, or a YAML path")
        elif not path.exists():
            raise ValueError(f"config file {str(preset_or_path)!r} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
    return Config.model_validate(merge_overrides(data, overrides))
