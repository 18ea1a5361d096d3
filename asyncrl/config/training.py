"""``trainer:`` — one typed section per training engine (torch, Megatron, simulated), chosen by ``backend``.

Invariants:
- Every knob has a description, and an unknown key is an error listing the allowed ones (``StrictModel``), so a
  knob of another backend (or a typo) is never silently ignored.
- A section names its engine (``engine``, "module:Class") and says its rank count (``ranks``);
  ``asyncrl.config.backends`` registers it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.config.placement import Placement
from asyncrl.strict import StrictModel


class _Trainer(Placement):
    lr: float = Field(1e-4, gt=0, description="learning rate")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float | None = Field(1.0, gt=0, description="gradient norm clip (None: no clipping)")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="the learning rate per optimizer step, as transformers' schedulers of these names "
        "(asyncrl/backends/lr_schedule.py): after warmup_steps, constant, or decaying to 0 at lr_decay_steps")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warmup from 0 to lr")
    lr_decay_steps: int | None = Field(
        None, ge=1, description="optimizer steps, warmup included, over which 'linear' / 'cosine' decay the lr to "
        "0; None: `asyncrl run` sets it to --steps (required otherwise with those schedules)")
    micro_batch_size: int | None = Field(
        None, ge=1, description="micro_batching 'rows': sequences per forward/backward, in the chunk's order; "
        "None: a whole chunk")

    @model_validator(mode="after")
    def _warmup_within_decay(self) -> "_Trainer":
        if self.lr_decay_steps is not None and self.warmup_steps > self.lr_decay_steps:
            raise ValueError(f"trainer.warmup_steps {self.warmup_steps} > trainer.lr_decay_steps "
                             f"{self.lr_decay_steps}: the warmup is part of the decay's steps")
        return self

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
    gradient_checkpointing: bool = Field(
        False, description="recompute each transformer layer's activations in the backward pass instead of keeping "
        "them (TRL's gradient_checkpointing): the same loss and gradients, less activation memory, about one more "
        "forward of time; torch engine: transformers' gradient_checkpointing_enable, Megatron: full recompute of "
        "every layer (recompute_granularity 'full', method 'uniform', 1 layer a group)")
    logprob_chunk_tokens: int = Field(
        2048, ge=1, description="positions per chunk of the output layer: token logprobs and entropy are computed "
        "from the last hidden states this many positions at a time, forward and backward, never as a whole "
        "pass's [positions, vocabulary] logits (asyncrl.logprobs.chunked_logprobs)")

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
    attention: Literal["auto", "varlen", "flex", "unfused"] = Field(
        "auto", description="'varlen': torch's FlashAttention-2 over each packed sequence (CUDA, compute capability "
        "8.0+); 'flex': FlexAttention, a fused kernel under a document-masked causal block mask (packed sequences); "
        "'unfused': Megatron's local matmul-softmax-matmul over a [rows, heads, W, W] score matrix; 'auto': flex on "
        "CUDA, unfused elsewhere (asyncrl/backends/megatron_forward.py)")
    compile: Literal["none", "layers", "modules"] = Field(
        "none", description="torch.compile in the training model: 'layers' each transformer layer whole (RMSNorm, "
        "rotary, residual adds and casts fused, forward and backward), 'modules' each layer's norms, attention and "
        "MLP apart; 'none': eager, FlexAttention and the SwiGLU compiled alone. Meant for CUDA; the first step "
        "compiles (tens of seconds, once a process). benchmarks/bench_mfu_gpu.py measures what it pays")

    @model_validator(mode="after")
    def _megatron_optimizer_needs_cuda(self) -> "MegatronTrainerConfig":  # it takes only torch.cuda parameters
        if self.optimizer == "megatron" and not str(self.device).startswith("cuda"):
            raise ValueError(f"trainer.optimizer 'megatron' needs a CUDA device (megatron-core's optimizer makes its "
                             f"tensors on cuda); got trainer.device {self.device!r}: use optimizer 'torch'")
        if self.gradient_checkpointing and not str(self.device).startswith("cuda"):  # its recompute replays CUDA RNG
            raise ValueError(f"trainer.gradient_checkpointing with the Megatron trainer needs a CUDA device "
                             f"(megatron-core's recompute restores the CUDA RNG state); got trainer.device "
                             f"{self.device!r}: use the torch trainer on CPU")
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
