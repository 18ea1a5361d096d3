"""Run configuration: ``Config`` (the run's own knobs and one field per section), YAML presets, and
``load_config(preset_or_path, **overrides)``.

Where a section lives (each module opens with its invariants):
- ``asyncrl.config.backends``: ``model:`` and the backend registry (``GENERATION_CONFIGS``, ``TRAINER_CONFIGS``);
- ``asyncrl.config.generation``, ``asyncrl.config.training``: one ``generation:`` / ``trainer:`` section per engine;
- ``asyncrl.config.placement``: where engines run (what every engine's section has), ``ray:``, and the rules that
  join generation to trainer;
- ``asyncrl.config.sampling``: the sampler's glue (``sampler:`` itself is typed in ``asyncrl.samplers``);
- ``asyncrl.config.tasks``: ``task:``, and the sections that say what is trained on and how it is scored;
- ``loss:``, ``faults:``, ``tracking:`` and ``reward:`` are typed next to what they configure
  (asyncrl/algorithms.py, asyncrl/faults.py, asyncrl/tracking.py, asyncrl/rewards).
A new section is a model in the module it belongs to, a field of ``Config`` and, where it is imported from
``asyncrl.config``, a name below.

Cross-field rules are checked here, where a bad combination is rejected before anything starts:
- a sampler that may train on stale data needs an importance-sampling correction in the loss;
- the buffer must hold at least the sampler's ``required_buffer_capacity(groups_per_step)``;
- chunk bounds fit inside a step; replicas and ranks fit their placement.
"""

from __future__ import annotations

import warnings
import weakref
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from asyncrl.algorithms import LossConfig
from asyncrl.config.backends import GENERATION_CONFIGS, TRAINER_CONFIGS, GenerationConfig, ModelConfig, TrainerConfig
from asyncrl.config.generation import (
    SimulatedGeneration,
    SimulatedGenerationConfig,
    SimulatedTurns,
    TorchGenerationConfig,
    VLLMGenerationConfig,
)
from asyncrl.config.placement import RayConfig, check_overlap, check_placement
from asyncrl.config.sampling import (
    check_sampler_config,
    check_sampler_fits,
    check_stale_sampler_correction,
    required_buffer_capacity,
)
from asyncrl.config.tasks import TaskConfig
from asyncrl.config.training import MegatronTrainerConfig, SimulatedTrainerConfig, SimulatedTraining, TorchTrainerConfig
from asyncrl.faults import FaultsConfig
from asyncrl.presets import PRESETS, presets
from asyncrl.completions import check_every
from asyncrl.environments import EnvironmentConfig
from asyncrl.rewards import RewardConfig
from asyncrl.samplers import CustomConfig, InOrderConfig, SamplerConfig, build_custom, build_sampler
from asyncrl.strict import StrictModel, booleans_for_numbers
from asyncrl.tasks import build_task
from asyncrl.tracking import TrackingConfig

__all__ = [
    "Config", "load_config", "merge_overrides", "read_yaml", "presets", "PRESETS",
    "ModelConfig", "RayConfig", "TaskConfig", "RewardConfig", "EnvironmentConfig", "LossConfig", "FaultsConfig", "TrackingConfig", "SamplerConfig",
    "GENERATION_CONFIGS", "TRAINER_CONFIGS", "GenerationConfig", "TrainerConfig",
    "TorchGenerationConfig", "VLLMGenerationConfig", "SimulatedGeneration", "SimulatedGenerationConfig", "SimulatedTurns",
    "TorchTrainerConfig", "MegatronTrainerConfig", "SimulatedTraining", "SimulatedTrainerConfig",
    "check_sampler_fits", "required_buffer_capacity",
    # importable from asyncrl.config since before the split into a package; their homes are asyncrl.samplers
    # and asyncrl.tasks
    "CustomConfig", "InOrderConfig", "build_custom", "build_sampler", "build_task",
]

BOOLEAN_NOT_A_NUMBER = "boolean_not_a_number"  # the error type of a bool given where a number is taken


class Config(BaseModel):
    """The whole run: the run's own knobs here, each section typed in the module that holds it."""

    model_config = ConfigDict(extra="forbid")
    seed: int = Field(0, description="seeds the model's init, the prompt stream's shuffle and the sampling")
    groups_per_step: int = Field(8, ge=1, description="N: prompt groups per optimizer step (one batch)")
    group_size: int = Field(8, ge=1, description="G: completions per prompt (TRL's num_generations)")
    min_groups_per_chunk: int | None = Field(
        None, ge=1, description="fewest groups a train tick trains at once (a chunk); None: the whole step in one")
    max_groups_per_chunk: int | None = Field(
        None, ge=1, description="most groups a chunk takes; None: groups_per_step")
    max_buffered_groups: int | None = Field(
        None, ge=1, description="the replay buffer's capacity in groups; None: the sampler's required capacity (or 4N)")
    max_inflight_groups: int | None = Field(
        None, ge=1, description="groups dispatched and not yet back, at most; None: no bound beyond the buffer")
    max_epochs: int | None = Field(
        None, ge=1, description="passes over the training prompts; None: the prompt stream never runs out")
    eval_every: int | None = Field(
        None, ge=1, description="evaluate (greedy, on the task's evaluation split) every K steps and before step 0; "
        "the eval_reward / eval_accuracy metrics; None: never")
    filter_uniform_groups: bool = Field(
        False, description="skip a group whose completions all got the same reward (no learning signal: DAPO's "
        "dynamic sampling) and admit another in its place")
    # On a small CPU box the two pumps each run torch code; unset, a run splits the cores between them
    # (run_loop.torch_threads_per_pump); 1 gives each pump one thread whatever the box.
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads for this process (None: "
                                      "torch's default, a thread per core; then a run whose two pumps both compute "
                                      "on this CPU gives each half: asyncrl/run_loop.py)")
    # One GPU shared by both engines in this process: their GPU work takes turns under the device lock anyway, and a
    # second pump thread only competes for the interpreter with the thread stepping vLLM (run_loop.runs_in_lockstep).
    pump_threads: Literal["auto", 1, 2] = Field(
        "auto", description="threads a run drives the pumps with: 1 (a rollout tick then a train tick, as stepping "
        "does), 2 (a rollout pump and a train pump, overlapping), 'auto': 1 when the sampler cannot admit ahead or "
        "generation and training share one CUDA device in this process with device_sharing 'turns', else 2")
    # Overlap on that one GPU (asyncrl/backends/device_lock.py): vLLM's decoding of a small model leaves the GPU mostly
    # idle, so the trainer's passes may run beside it on a stream of their own. Not yet measured on a GPU (issue 48).
    device_sharing: Literal["turns", "overlap"] = Field(
        "turns", description="how vLLM and Megatron share the CUDA device they are both on in this process: "
        "'turns' (each engine's GPU work in turn under the device lock), 'overlap' (during a run the trainer's "
        "forward/backward passes run beside vLLM's decoding, on a CUDA stream of their own; the optimizer step and "
        "weight sync still take turns; pump_threads 'auto' is then 2)")
    # A run fails with a StallError (what each pump waits for, and the sampler's verdicts) when no group was
    # committed, trained, evicted or aborted for this long: groups that never come back, or a deadlocked policy.
    # Generous by default, for slow generation on big models.
    stall_timeout_s: float = Field(
        60.0, gt=0, description="a run fails with a StallError (what each pump waits for, and the sampler's "
        "verdicts) when no group was committed, trained, evicted or aborted for this long")
    # Checkpoints (asyncrl/checkpoint.py): every K steps into checkpoint_dir/step-XXXXXX, keeping the newest few.
    checkpoint_every: int | None = Field(None, ge=1, description="save a checkpoint every K optimizer steps")
    checkpoint_dir: str | None = Field(None, description="where checkpoint_every writes (the CLI: OUT/checkpoints)")
    keep_checkpoints: int = Field(3, ge=1, description="complete checkpoints kept; older ones are deleted")
    max_time_s: float | None = Field(
        None, gt=0, description="wall-time limit of a run (`asyncrl run --max-time`, ctrl.run(max_time_s=)): it "
        "stops after the step during which the limit passed, with a checkpoint when checkpoint_every is set, "
        "status 'time_limit'; None: no limit")
    device: str | None = Field(
        None, description="where both engines run unless their own section names a device ('cuda', 'cpu'): one "
        "--set device=cuda moves a CPU preset's torch engines to the GPU; None: each section's device")
    faults: FaultsConfig = Field(default_factory=FaultsConfig)  # retry budgets and backoff (asyncrl/faults.py)
    sampler: SamplerConfig = Field(default_factory=InOrderConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    generation: GenerationConfig = Field(default_factory=TorchGenerationConfig)
    trainer: TrainerConfig = Field(default_factory=TorchTrainerConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)  # reward functions, weights, workers (asyncrl/rewards)
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)  # multi-turn (asyncrl/environments)
    log_completions: str | int = Field(
        "all", description="what completions.jsonl and ctrl.completions keep: 'all', 'none', or N (the groups "
        "generated with weights 0, N, 2N, ...); asyncrl/completions.py")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)  # TensorBoard / W&B; nothing unless set
    ray: RayConfig = Field(default_factory=RayConfig)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        # pydantic's lax mode reads True as 1 (and YAML's true/yes/on are True): refused in every section, each key
        # named (the error type tells the CLI to print the message as it is)
        wrong = booleans_for_numbers(cls, data)
        if wrong:
            raise PydanticCustomError(BOOLEAN_NOT_A_NUMBER, "{keys}: a boolean where the key takes a number or text "
                                      "(YAML reads true/false/yes/no/on/off as booleans)", {"keys": "; ".join(wrong)})
        return data

    @field_validator("log_completions")
    @classmethod
    def _every(cls, value: str | int) -> str | int:
        return check_every(value)

    @model_validator(mode="before")
    @classmethod
    def _device_for_both_engines(cls, data: Any) -> Any:
        # The top-level device fills in each engine section that does not name one (a section's own device wins).
        if isinstance(data, dict) and data.get("device") is not None:
            data = dict(data)
            for section in ("generation", "trainer"):
                part = data.get(section)
                part = dict(part) if isinstance(part, dict) else {}
                part.setdefault("device", data["device"])
                data[section] = part
        return data

    @field_validator("loss", mode="before")
    @classmethod
    def _stale_sampler_needs_correction(cls, loss: Any, info: ValidationInfo) -> Any:
        # Runs before LossConfig's own checks (see check_stale_sampler_correction).
        correction = loss.get("importance_correction") if isinstance(loss, dict) else None
        check_stale_sampler_correction(info.data.get("sampler"), correction)
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
        if self.loss.scale_rewards == "batch" and self.chunk_bounds[0] < N:
            raise ValueError(f"loss.scale_rewards 'batch' divides by the std of the step's rewards, which a chunk of "
                             f"min_groups_per_chunk {self.chunk_bounds[0]} < groups_per_step {N} does not know yet: "
                             "use 'group', or unset min_groups_per_chunk")
        check_placement(self.generation, self.trainer)
        if self.device_sharing == "overlap":
            check_overlap(self.generation, self.trainer)
        check_sampler_config(self)
        return self

    @property
    def chunk_bounds(self) -> tuple[int, int]:
        lo = self.min_groups_per_chunk or self.groups_per_step
        return lo, self.max_groups_per_chunk or self.groups_per_step

    def buffer_capacity(self, required: int | None) -> int:
        if self.max_buffered_groups is not None:
            return self.max_buffered_groups
        return required if required is not None else 4 * self.groups_per_step


# id -> whether loss.entropy_coef of a config load_config made came from the preset or file rather than an override
# (kept beside the config, dropped when it is collected, so its equality and dump stay its fields alone).
_ENTROPY_FROM_FILE: dict[int, bool] = {}


def warn_toy_knobs(cfg: Config, objects: bool | None = None) -> None:
    """One ``UserWarning`` line when a toy preset's knob meets a real model or real data: ``loss.entropy_coef``
    (tuned for one-token toy completions) with ``model.hf_path`` or a ``dataset`` task. On a warm-started model with
    long completions such a bonus drove the entropy to its maximum within about 10 steps (issue 47); the ``grpo``
    preset has none. Only a coefficient that came from the preset or file ``load_config`` read is judged (an
    override that sets it is a choice). ``load_config`` asks with ``objects`` None; ``Controller.from_config`` with
    whether data objects were given (then it warns only where ``load_config`` could not know: no hf_path, no
    dataset task)."""
    if not _ENTROPY_FROM_FILE.get(id(cfg), False) or (objects is not None and (not objects or cfg.task.name == "dataset"
                                                                or cfg.model.hf_path is not None)):
        return
    real = [what for what, yes in (("model.hf_path", cfg.model.hf_path is not None),
                                   ("a dataset task", bool(objects) or cfg.task.name == "dataset")) if yes]
    if cfg.loss.entropy_coef > 0 and real:
        warnings.warn(f"loss.entropy_coef {cfg.loss.entropy_coef} (a toy preset's entropy bonus) with "
                      f"{' and '.join(real)}: it can drive a real model's entropy to its maximum within a few steps; "
                      "set loss.entropy_coef=0 or start from the 'grpo' preset", UserWarning, stacklevel=3)


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
            fields = _VARIANTS[key].get(value["backend"], StrictModel).model_fields
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
        data = read_yaml(path.read_text(), f"config file {str(path)!r}")
        if data is None:
            raise ValueError(f"config file {str(path)!r} is empty: it holds no configuration keys (give a preset, "
                             "e.g. 'quickstart', or write keys such as 'groups_per_step: 8')")
        if not isinstance(data, dict):
            raise ValueError(f"config file {str(path)!r} holds a YAML {type(data).__name__}, not a mapping of "
                             "configuration keys (key: value lines, such as 'groups_per_step: 8')")
    cfg = Config.model_validate(merge_overrides(data, overrides))
    _ENTROPY_FROM_FILE[id(cfg)] = "entropy_coef" not in (overrides.get("loss") or {})
    weakref.finalize(cfg, _ENTROPY_FROM_FILE.pop, id(cfg), None)
    warn_toy_knobs(cfg)
    return cfg


def read_yaml(text: str, what: str) -> Any:
    """``text`` as YAML; a syntax error is a ``ValueError`` of one line naming ``what``, the line and the column."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ValueError(f"{what} is not valid YAML{where}: {problem}") from None
