"""The metric vocabulary and the one accumulator every step's bookkeeping goes through.

A metric is named once, with how its contributions reduce over a step (CleanRL style: the name is written in one
place and read everywhere else through it):
- ``sum``: contributions add up (counts, token totals);
- ``mean``: contributions are *sums* and the result divides by the step's total of the ``over`` metric (a mean
  over tokens, completions or groups, independent of how the step was chunked);
- ``max`` / ``min``: the extreme contribution; a step with no contribution reports ``empty``.

Who names what: ``STEP_METRICS`` and ``STEP_FACTS`` below are the controller's (one row of ``Controller.metrics``
per optimizer step); a loss names its own metrics next to its maths (``GRPOLoss.metrics`` in ``algorithms``), and
a policy backend adds ``ENGINE_METRICS`` from its optimizer step. A new metric is one ``Metric(...)`` line where
its value is made; a column read elsewhere (widgets) gets a named constant here and is read through it.

This module imports nothing of asyncrl (and no torch): it is the bottom layer with ``asyncrl.data``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Reduce = Literal["sum", "mean", "max", "min"]


@dataclass(frozen=True)
class Metric:
    name: str
    reduce: Reduce
    doc: str
    over: str | None = None  # for ``mean``: the metric whose step total is the denominator
    empty: float = 0.0  # the value of a ``mean``/``max``/``min`` when nothing was contributed

    def __post_init__(self) -> None:
        if (self.reduce == "mean") != (self.over is not None):
            raise ValueError(f"metric {self.name!r}: 'over' is required for reduce 'mean' and only for it")


class Accumulator:
    """Adds up one step's contributions to a fixed set of metrics and reduces them once, at the end of the step.

    ``add`` takes a mapping of contributions; a name outside the set is a ``KeyError`` naming the allowed ones (a
    typo never goes silently missing). ``result()`` gives every metric, reduced; ``reset()`` starts a new step."""

    def __init__(self, metrics: Iterable[Metric]) -> None:
        self.metrics: dict[str, Metric] = {}
        for m in metrics:
            if m.name in self.metrics:
                raise ValueError(f"metric {m.name!r} is named twice")
            self.metrics[m.name] = m
        for m in self.metrics.values():
            if m.over is not None and m.over not in self.metrics:
                raise ValueError(f"metric {m.name!r} is a mean over {m.over!r}, which is not in {sorted(self.metrics)}")
        self.reset()

    def reset(self) -> None:
        self.totals: dict[str, float] = {}

    def add(self, contributions: Mapping[str, float]) -> None:
        for name, value in contributions.items():
            metric = self.metrics.get(name)
            if metric is None:
                raise KeyError(f"unknown metric {name!r}; this accumulator takes {sorted(self.metrics)}")
            value = float(value)
            if (metric.reduce == "max" and value == -math.inf) or (metric.reduce == "min" and value == math.inf):
                continue  # "nothing to contribute" (a micro-batch without tokens: algorithms.grpo_loss)
            old = self.totals.get(name)
            if old is None:
                self.totals[name] = value
            elif metric.reduce == "max":
                self.totals[name] = max(old, value)
            elif metric.reduce == "min":
                self.totals[name] = min(old, value)
            else:
                self.totals[name] = old + value

    def sum_across(self, reduce_sums: Callable[[list[float]], Sequence[float]]) -> None:
        """Replace the additive totals by ``reduce_sums`` of them, e.g. an all-reduce over data-parallel ranks
        (every rank must hold the same metric set). ``max``/``min`` stay this rank's."""
        names = [m.name for m in self.metrics.values() if m.reduce in ("sum", "mean")]
        summed = reduce_sums([self.totals.get(n, 0.0) for n in names])
        self.totals.update(zip(names, (float(v) for v in summed)))

    def total(self, name: str) -> float:
        """The raw step total of a ``sum``/``mean`` metric (0 before any contribution)."""
        if name not in self.metrics:
            raise KeyError(f"unknown metric {name!r}; this accumulator takes {sorted(self.metrics)}")
        return self.totals.get(name, 0.0)

    def result(self) -> dict[str, float]:
        out = {}
        for m in self.metrics.values():
            total = self.totals.get(m.name)
            if m.reduce == "sum":
                out[m.name] = total or 0.0
            elif m.reduce == "mean":
                denominator = self.totals.get(m.over, 0.0)
                out[m.name] = (total or 0.0) / denominator if denominator else m.empty
            else:
                out[m.name] = m.empty if total is None else total
        return out


@dataclass(frozen=True)
class Column:
    """A column the controller writes as a fact of the moment (not accumulated over the step). Readers (widgets,
    plots) take the name from here, so a renamed column is an ImportError or a KeyError, never a blank plot."""

    name: str
    doc: str


# --- the controller's step metrics and facts: the columns of Controller.metrics, one row per optimizer step -------
# Named constants are the ones read outside the code that writes them (widgets, simulate); the rest are only in
# their tuple.

REWARD_MEAN = Metric("reward_mean", "mean", "mean reward of the completions trained this step", over="completions",
                     empty=math.nan)
LAG_MEAN = Metric("lag_mean", "mean", "mean staleness T - weight_version of the groups trained this step",
                  over="groups", empty=math.nan)
STEP_METRICS: tuple[Metric, ...] = (
    REWARD_MEAN,
    LAG_MEAN,
    Metric("lag_max", "max", "largest staleness of a group trained this step", empty=math.nan),
    Metric("groups_evicted", "sum", "groups the sampler evicted during this step"),
    Metric("groups_aborted", "sum", "in-flight groups aborted during this step: after its weight sync, or at a "
           "multi-turn group's turn boundary"),
    Metric("chunks", "sum", "chunks (select calls that returned groups) this step trained"),
    Metric("groups", "sum", "prompt groups trained this step (groups_per_step once the step is finished)"),
    COMPLETIONS := Metric("completions", "sum", "completions trained this step"),
    COMPLETION_TOKENS := Metric("completion_tokens", "sum", "completion tokens trained this step (tokens_per_s "
                                "counts these)"),
    TRAIN_TIME_S := Metric("train_time_s", "sum", "seconds in the policy's calls this step: each chunk's logprobs "
                           "and forward/backward, and the optimizer step"),
)

# --- what the sampler skews: completion length and reward of the groups generated, trained and dropped per step ---
# (``skew`` makes the contributions). Side by side they show what a policy's choices do to the training data:
# eviction and ready-first favour short answers when lengths are long-tailed (widgets.bias_figure).
SKEW_KINDS = {"gen": "committed", "train": "trained", "drop": "evicted or aborted"}
SKEW_COUNT = {"gen": "gen_completions", "train": "completions", "drop": "drop_completions"}
SKEW_LEN = {kind: Metric(f"{kind}_len_mean", "mean", f"mean completion tokens of the groups {what} this step",
                         over=SKEW_COUNT[kind], empty=math.nan) for kind, what in SKEW_KINDS.items()}
SKEW_REWARD = {kind: Metric(f"{kind}_reward_mean", "mean", f"mean reward of the completions of the groups {what} "
                            "this step", over=SKEW_COUNT[kind], empty=math.nan) for kind, what in SKEW_KINDS.items()}
STEP_METRICS += (
    Metric("drop_completions", "sum", "completions of the groups evicted or aborted this step (an abort in "
           "flight has none)"),
    SKEW_LEN["train"], SKEW_REWARD["train"], SKEW_LEN["drop"], SKEW_REWARD["drop"],
)
GEN_METRICS: tuple[Metric, ...] = (  # made by the rollout pump, which commits (RolloutPump.take_generated)
    Metric("gen_completions", "sum", "completions of the groups committed this step"),
    Metric("groups_uniform", "sum", "groups skipped this step because every completion got the same reward "
           "(filter_uniform_groups)"),
    SKEW_LEN["gen"], SKEW_REWARD["gen"],
)


def skew(kind: str, groups: Iterable) -> dict[str, float]:
    """Contributions of ``groups`` (rollouts with ``completion_ids`` and ``rewards``; None or unscored ones are
    left out: a group aborted in flight has no completions) to the ``kind`` skew metrics (``SKEW_KINDS``). The
    trained groups' count is ``completions``, which the train chunk adds itself."""
    groups = [g for g in groups if g is not None and g.rewards is not None]
    out = {SKEW_LEN[kind].name: sum(len(c) for g in groups for c in g.completion_ids),
           SKEW_REWARD[kind].name: sum(float(r) for g in groups for r in g.rewards)}
    if kind != "train":
        out[SKEW_COUNT[kind]] = sum(len(g.rewards) for g in groups)
    return out


# --- staleness as the tokens saw it: T minus the weight version that sampled each trained token (the train pump's
# ``token_staleness``). With weights loaded under running groups (``weight_update: inflight``) a completion's tokens
# come from several versions: then these differ from ``lag_mean``/``lag_max``, which count a group by its oldest.
TOKEN_STALENESS_MEAN = Metric("token_staleness_mean", "mean", "mean over the completion tokens trained this step of "
                              "T minus the weight version that sampled each", over="completion_tokens",
                              empty=math.nan)
TOKEN_STALENESS_MAX = Metric("token_staleness_max", "max", "largest T minus sampling version of a token trained this "
                             "step", empty=math.nan)
SPANNING_FRACTION = Metric("spanning_fraction", "mean", "share of the completions trained this step whose tokens were "
                           "sampled by more than one weight version", over="completions", empty=math.nan)
STALENESS_BINS = 4  # the histogram: token_staleness/0 .. /3, and /4+ for the rest
TOKEN_STALENESS_SHARES: tuple[Metric, ...] = tuple(
    Metric(f"token_staleness/{k}{'+' if k == STALENESS_BINS else ''}", "mean", f"share of the completion tokens "
           f"trained this step sampled {k}{' or more' if k == STALENESS_BINS else ''} versions before T",
           over="completion_tokens", empty=math.nan) for k in range(STALENESS_BINS + 1))
STEP_METRICS += (TOKEN_STALENESS_MEAN, TOKEN_STALENESS_MAX, SPANNING_FRACTION, *TOKEN_STALENESS_SHARES)


def token_staleness(groups: Iterable, T: int) -> dict[str, float]:
    """Contributions of the trained ``groups`` (rollouts with ``versions()``) at trainer version ``T`` to the
    token-staleness metrics (their denominators, ``completion_tokens`` and ``completions``, the chunk adds). A group
    that spans versions without saying which token had which (no ``token_versions``) counts every token as its
    oldest version's and every completion as spanning: upper bounds."""
    total, top, spanning = 0, -math.inf, 0
    bins = [0] * (STALENESS_BINS + 1)
    for group in groups:
        unsaid = group.token_versions is None and group.gen_start_version != group.gen_end_version
        if group.token_versions is None:  # one version for every token: per completion, not per token (hot path)
            lag = T - group.gen_start_version
            for completion in group.completion_ids:
                total += lag * len(completion)
                top = max(top, lag) if completion else top
                bins[min(lag, STALENESS_BINS)] += len(completion)
                spanning += unsaid
            continue
        for versions in group.versions():
            spanning += unsaid or len(set(versions)) > 1
            for v in versions:
                lag = T - v
                total += lag
                top = max(top, lag)
                bins[min(lag, STALENESS_BINS)] += 1
    return {TOKEN_STALENESS_MEAN.name: total, TOKEN_STALENESS_MAX.name: top, SPANNING_FRACTION.name: spanning,
            **{m.name: n for m, n in zip(TOKEN_STALENESS_SHARES, bins)}}


# --- the training-inference gap, apart: the importance weight exp(prev - gen) is exp(prev - v) x exp(v - gen), with
# ``v`` the trainer's logprob at the weights that sampled the token: staleness (the weights moved since) times the
# engines' numerical mismatch (two engines computing the same weights). A loss reports them
# (``asyncrl.algorithms.gap_contributions``) over the tokens whose ``v`` the trainer had (``gap_tokens``).
GAP_TOKENS = Metric("gap_tokens", "sum", "completion tokens whose sampling version's trainer logprobs were at hand "
                    "(the tokens the gap metrics are over)")
MISMATCH_KL = Metric("mismatch_kl", "mean", "k3 estimate per token of KL(behaviour || trainer at the sampling "
                     "version): the engines' numerical mismatch, apart from staleness", over="gap_tokens",
                     empty=math.nan)
IS_MISMATCH_MEAN = Metric("is_mismatch_mean", "mean", "mean of exp(trainer logprob at the sampling version - "
                          "behaviour logprob): the importance weight's mismatch part", over="gap_tokens",
                          empty=math.nan)
IS_MISMATCH_MAX = Metric("is_mismatch_max", "max", "largest mismatch part of a token's importance weight",
                         empty=math.nan)
IS_STALENESS_MEAN = Metric("is_staleness_mean", "mean", "mean of exp(trainer logprob at T - at the sampling "
                           "version): the importance weight's staleness part (1 for fresh tokens)", over="gap_tokens",
                           empty=math.nan)
IS_STALENESS_MAX = Metric("is_staleness_max", "max", "largest staleness part of a token's importance weight",
                          empty=math.nan)
GAP_METRICS: tuple[Metric, ...] = (GAP_TOKENS, MISMATCH_KL, IS_MISMATCH_MEAN, IS_MISMATCH_MAX, IS_STALENESS_MEAN,
                                   IS_STALENESS_MAX)

STEP = Column("step", "the optimizer step the row reports (T - 1 once it is done)")
TRAINER_VERSION = Column("trainer_version", "T after the step")
STEP_TIME_S = Column("step_time_s", "seconds the step took, active time only (not a pause between hand ticks)")
TOKENS_PER_S = Column("tokens_per_s", "completion_tokens / step_time_s")
SYNC_TIME_S = Column("sync_time_s", "seconds of the weight sync after the optimizer step")
SYNC_BYTES = Column("sync_bytes", "bytes the weight sync after the optimizer step sent the generator: the weights, "
                    "or with model.lora on vLLM the adapter alone (a row has it when the sync says: driver, adapter "
                    "and collective syncs)")
BUFFERED = Column("buffered", "groups in the buffer at the end of the step")
INFLIGHT = Column("inflight", "groups in flight at the end of the step")
EVAL_REWARD = Column("eval_reward", "held-out greedy reward after the step (every eval_every steps, else absent)")
EVAL_ACCURACY = Column("eval_accuracy", "held-out greedy accuracy after the step (every eval_every steps)")
EVAL_FAILED = Column("eval_failed", "evaluation prompts left out: their reward scoring kept failing past "
                     "faults.reward_retries (fault rows say why); in a metrics row every eval_every steps")
STEP_FACTS: tuple[Column, ...] = (STEP, TRAINER_VERSION, STEP_TIME_S, TOKENS_PER_S, SYNC_TIME_S, BUFFERED, INFLIGHT)
"""A row of ``Controller.metrics``: ``step``, ``trainer_version``, ``STEP_METRICS``, ``GEN_METRICS`` (the
rollout pump's), the rest of ``STEP_FACTS``,
``SYNC_BYTES`` (when the weight sync counts them), the policy backend's metrics (its loss's and ``ENGINE_METRICS``), ``THROUGHPUT`` (below), a generator's optional
``step_metrics()``, and ``EVAL_REWARD``/``EVAL_ACCURACY``/``EVAL_FAILED`` every ``eval_every`` steps."""

# --- Controller.evaluations: one row per held-out evaluation ---------------------------------------------------
EVALUATED_VERSION = Column("weight_version", "the generator's weight version the evaluation judged")
HELD_OUT_REWARD = Column("reward_mean", "mean reward of greedy completions of the held-out prompts")
HELD_OUT_ACCURACY = Column("accuracy", "share of held-out prompts answered correctly (greedy)")
EVAL_SPLIT = Column("split", "the split evaluated ('eval' or 'train')")
EVAL_N = Column("n", "completions per prompt; the row's mean@n and pass@n columns are named with it (mean@4)")
EVAL_TEMPERATURE = Column("temperature", "0.0: greedy; else the sampling temperature")
EVAL_PROMPTS = Column("prompts", "prompts evaluated (scored; eval_failed more were left out)")
EVALUATION_COLUMNS: tuple[Column, ...] = (EVALUATED_VERSION, HELD_OUT_REWARD, HELD_OUT_ACCURACY, EVAL_SPLIT, EVAL_N,
                                          EVAL_TEMPERATURE, EVAL_PROMPTS, EVAL_FAILED)  # then mean@n, pass@n


def evaluation_columns(rows: Iterable[dict]) -> list[str]:
    """The columns of ``Controller.evaluations``: ``EVALUATION_COLUMNS``, then each ``mean@n`` / ``pass@n`` the
    rows hold, in the order they first appear."""
    return list(dict.fromkeys([c.name for c in EVALUATION_COLUMNS] + [k for row in rows for k in row]))

ENGINE_METRICS: tuple[Metric, ...] = (
    Metric("loss", "mean", "the step's loss: loss sums over the step divided by its normaliser", over="normaliser"),
    Metric("normaliser", "sum", "what the step's loss and gradients are divided by (tokens or sequences)"),
    Metric("sequences", "sum", "sequences (completions) the policy trained on this step"),
    Metric("grad_norm", "max", "gradient norm before clipping"),
    Metric("lr", "max", "learning rate of the optimizer step"),
    TRAIN_TOKENS := Metric("train_tokens", "sum", "real positions trained (prompt and completion tokens): what "
                           "the forward/backward had to compute"),
    TRAIN_PADDED_TOKENS := Metric("train_padded_tokens", "sum", "positions the forward/backward computed, padding "
                                  "included (rows x width over the micro-batches)"),
    Metric("train_flops", "sum", "6 x parameters x train_tokens: the step's useful training work"),
    Metric("peak_flops", "sum", "bf16 dense peak FLOP/s of the devices that trained (peak_flops(); 0 where none "
           "is known, e.g. a CPU)"),
)
"""What a policy backend's ``finish_train_step`` reports besides its loss's metrics (a backend that does not
count FLOPs leaves the last four at 0)."""

# --- throughput: the controller derives these from the engine's counts and its own clock --------------------------
TRAIN_TFLOPS = Column("train_tflops", "useful training TFLOP/s: train_flops / train_time_s / 1e12")
MFU = Column("mfu", "model FLOPs utilisation: train_flops / train_time_s / peak_flops (NaN without a known peak)")
GEN_TOKENS_PER_S = Column("gen_tokens_per_s", "completion tokens the generator returned since the previous step, "
                          "per second the rollout pump spent in its poll calls (a generator that works outside "
                          "poll reports its own through step_metrics(): vLLM per second its engine was stepped)")
THROUGHPUT: tuple[Column, ...] = (TRAIN_TFLOPS, MFU, GEN_TOKENS_PER_S)

# bf16 dense tensor-core peaks (no sparsity) from the vendors' data sheets, matched in order against
# torch.cuda.get_device_name(): the more specific names first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12), ("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
    ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12),
)


def peak_flops(device_name: str | None) -> float:
    """The bf16 dense peak FLOP/s of a GPU by its name (``PEAK_BF16_FLOPS``); NaN for a CPU (``None``) or an
    unknown GPU, so ``mfu`` stays empty rather than wrong."""
    if device_name:
        for key, flops in PEAK_BF16_FLOPS:
            if key in device_name:
                return flops
    return math.nan


def train_flops(parameters: float, tokens: float) -> float:
    """A training step's useful work: 6 x parameters x real tokens trained (2 FLOPs a parameter a token forward,
    4 backward; no padding, no recomputation). What the engines report as ``train_flops`` and what
    benchmarks/bench_trl_gpu.py counts for TRL's trainer, so the two TFLOP/s are one formula."""
    return 6.0 * parameters * tokens


def throughput(engine: Mapping[str, float], train_time_s: float) -> dict[str, float]:
    """``train_tflops`` and ``mfu`` of a step from the engine's ``train_flops`` / ``peak_flops``."""
    flops = engine.get("train_flops", 0.0)
    rate = flops / train_time_s if flops and train_time_s > 0 else math.nan
    peak = engine.get("peak_flops", math.nan)
    return {TRAIN_TFLOPS.name: rate / 1e12, MFU.name: rate / peak if peak and peak > 0 else math.nan}


class FunctionRewards(Accumulator):
    """``reward/<name>`` of each reward function: the mean of its values over the completions trained this step
    that it applied to (defined over the groups the step trained, as ``reward_mean`` is; NaN only where it applied
    to none). The values come with each group (``GroupRollouts.reward_parts``, kept in checkpoints); their counts
    are this accumulator's denominators, not columns."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = list(names)
        super().__init__(m for name in self.names for m in (
            Metric(f"reward/{name}", "mean", f"mean value of reward function {name!r} over the completions trained "
                   "this step that it applied to", over=f"reward_count/{name}", empty=math.nan),
            Metric(f"reward_count/{name}", "sum", f"completions trained this step that {name!r} applied to")))

    def add_groups(self, groups: Iterable) -> None:
        """The contributions of trained ``groups`` (a group without ``reward_parts`` contributes nothing)."""
        out: dict[str, float] = {}
        for group in groups:
            for name, values in (getattr(group, "reward_parts", None) or {}).items():
                if f"reward/{name}" in self.metrics:
                    applied = [float(v) for v in values if v is not None]
                    out[f"reward/{name}"] = out.get(f"reward/{name}", 0.0) + sum(applied)
                    out[f"reward_count/{name}"] = out.get(f"reward_count/{name}", 0.0) + len(applied)
        self.add(out)

    def result(self) -> dict[str, float]:
        out = super().result()
        return {f"reward/{name}": out[f"reward/{name}"] for name in self.names}


class StepAccumulator(Accumulator):
    """The controller's accumulator for the step in progress: ``STEP_METRICS``, plus when the step started (on
    ``clock``) and whether the policy has begun it (``begin_train_step`` comes with the step's first chunk)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        super().__init__(STEP_METRICS)

    def reset(self) -> None:
        super().reset()
        self.started = False
        self.start = self.clock()

    @property
    def groups(self) -> int:
        """Groups trained in this step so far."""
        return int(self.totals.get("groups", 0))
