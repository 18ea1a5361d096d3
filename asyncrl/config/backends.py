"""The engines' sections: ``model:``, ``generation:`` and ``trainer:`` (one typed class per backend, chosen by
``backend``), ``ray:``, and the backend registry that names each section's engine.

Invariants:
- Every backend section is a ``StrictModel``: an unknown key is an error listing the allowed ones, so a knob of
  another backend (or a typo) is never silently ignored.
- ``GENERATION_CONFIGS`` / ``TRAINER_CONFIGS`` are the registry: one entry per backend, whose class names its engine
  (``engine``); ``asyncrl.backends.build_backends`` builds what they name. A new backend is a class here and a
  line there.
- ``check_placement`` holds the rules that join the two sections (replicas and ranks are Ray actors, a collective
  weight sync needs both sides in Ray on like devices); each section checks its own knobs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from asyncrl.strict import StrictModel


class ModelConfig(BaseModel):
    """A Llama-style causal LM built from this config (random init), or loaded from ``hf_path``."""

    model_config = ConfigDict(extra="forbid")

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
    chat_template: str | None = Field(
        None, description="the chat template conversational prompts are rendered with (a Jinja template, or the "
        "path of a file holding one); None: the tokenizer's own (asyncrl/chat.py)")

    def shape_dump(self) -> dict:
        """The fields that make the weights (what a checkpoint keeps as its model and a restore must match): all
        but ``chat_template``, which changes how prompts are rendered, not the model."""
        return self.model_dump(mode="json", exclude={"chat_template"})

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


class _Placement(StrictModel):
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
        "forward/backward; None: 16384")

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

    @model_validator(mode="after")
    def _megatron_optimizer_needs_cuda(self) -> "MegatronTrainerConfig":  # it takes only torch.cuda parameters
        if self.optimizer == "megatron" and not str(self.device).startswith("cuda"):
            raise ValueError(f"trainer.optimizer 'megatron' needs a CUDA device (megatron-core's optimizer makes its "
                             f"tensors on cuda); got trainer.device {self.device!r}: use optimizer 'torch'")
        return self

    @property
    def ranks(self) -> int:
        return self.data_parallel * self.tensor_parallel


class SimulatedTraining(StrictModel):
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


class RayConfig(BaseModel):
    """``ray:`` — the Ray session behind every ``placement: ray`` backend, generation replica and trainer rank."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(
        None, description="join this Ray cluster ('auto': the one `ray start` started on this machine; "
        "'HOST:6379'); None: the RAY_ADDRESS environment variable, else a local Ray (docs/cluster.md)")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a locally started Ray (None: all)")
    placement_timeout_s: float = Field(
        60.0, gt=0, description="how long trainer ranks and generation replicas wait for their resources before "
        "the run fails with what was asked and what the cluster has")


def check_placement(gen: Any, trainer: Any) -> None:
    """The rules that join ``generation`` and ``trainer`` (ValueError naming both sides). Replicas and ranks are
    Ray actors (Megatron ranks may also come from torchrun, with placement 'local'); what is not built yet says
    so by its knob."""
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
    if gen.weight_sync == "collective":
        _check_collective_weight_sync(gen, trainer)


def _check_collective_weight_sync(gen: Any, trainer: Any) -> None:
    placements = (trainer.placement, gen.placement)
    if placements != ("ray", "ray"):
        raise ValueError(
            "generation.weight_sync 'collective' sends weights from the policy's Ray actor to the generator's, so "
            f"both need placement 'ray'; got trainer.placement {placements[0]!r} and generation.placement "
            f"{placements[1]!r} (use weight_sync 'driver' otherwise)"
        )
    devices = (str(trainer.device), str(gen.device))
    if not (all(d.startswith("cuda") for d in devices) or all(d == "cpu" for d in devices)):
        raise ValueError(
            f"generation.weight_sync 'collective' needs both backends on CUDA (NCCL) or both on CPU (gloo); got "
            f"trainer.device {devices[0]!r} and generation.device {devices[1]!r}"
        )
