"""Reading a checkpoint back for less than a whole run, and what a restore must be given.

- ``export_checkpoint``: the trained policy of a checkpoint as a Hugging Face directory (or, for a LoRA run, the
  adapter alone), built from the checkpoint's ``model``, ``trainer`` and ``loss`` sections and its tensors only: no
  task, reward function, sampler or tracking sink is built, so a run whose rewards are ``module:function`` exports
  without importing them (no trust needed) and no W&B run or TensorBoard file is opened (``asyncrl export``).
- ``check_given``: a run built from Python objects (``from_config(train_dataset=..., reward_funcs=...)``) records
  which in its checkpoints (``meta.json``'s ``given``); restoring it without them is one line naming what to pass,
  before anything is loaded, never a fall back to the config's own task.
- ``rejudge``: restored under another sampler, the restored groups are judged by its rules (``Controller.restore``
  says how): what it can never train or has no room for is skipped, its dispatch index follows what it holds, and
  it evicts what it would.
- ``untracked``: a restore opens no tracking sink unless asked (``Controller.restore(tracking=True)``, or a
  config of the caller's that names one): reading a checkpoint back must not start a new W&B run or write an
  empty TensorBoard file into the old run's folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl import checkpoint

GIVEN = ("train_dataset", "eval_dataset", "reward_funcs", "environment_factory")  # from_config's objects a checkpoint names, not holds


def check_on_sampler_change(how: str) -> None:
    if how not in ("rejudge", "drop"):
        raise ValueError(f"on_sampler_change must be 'rejudge' or 'drop', got {how!r}")


def check_given(path: Path, config: Any, data: dict[str, Any], trust_code: bool = False) -> None:
    """The objects the checkpoint's run was built from are among ``data`` (``restore``'s keyword arguments), or a
    ``CheckpointError`` of one line naming what to pass. Reward functions are named in the config as
    ``module:function``: untrusted, ``checkpoint.own_config`` refuses to import them (naming ``reward_funcs=``);
    trusted, they are needed only when one does not import (a function of a notebook or a test's closure). Data
    cannot be rebuilt. With a ``config`` of the caller's, that config decides."""
    if config is not None:
        return
    try:
        given = json.loads((Path(path) / "meta.json").read_text()).get("given") or []
    except (OSError, ValueError):
        return  # a damaged meta.json is named by the load that follows
    missing = [name for name in given if data.get(name) is None]
    if "environment_factory" in missing and not trust_code:
        missing.remove("environment_factory")  # checkpoint.own_config refuses to import it, naming the keyword
    elif "environment_factory" in missing and _factory_imports(path):
        missing.remove("environment_factory")  # trusted: the class the config names is imported
    if missing in ([], ["reward_funcs"]) and not (missing and trust_code and _unimportable(path)):
        return
    if missing:
        args = ", ".join(f"{name}=..." for name in missing)
        raise checkpoint.CheckpointError(
            f"checkpoint {str(path)!r} is of a run built from Python objects ({', '.join(given)}), which a checkpoint "
            f"does not hold: pass {', '.join(f'{m}=' for m in missing)} again, as Controller.restore(path, "
            f"trust_code=True, {args})")


def _unimportable(path: Path) -> bool:
    """Whether a reward function the checkpoint's config names does not load here (trusted: importing is allowed)."""
    import yaml

    from asyncrl.rewards.config import imported_functions
    from asyncrl.rewards.functions import load_function

    try:
        specs = imported_functions(yaml.safe_load((Path(path) / "config.yaml").read_text()) or {})
    except (OSError, yaml.YAMLError):
        return False
    for spec in specs:
        try:
            load_function(spec)
        except ValueError:
            return True
    return False


def _factory_imports(path: Path) -> bool:
    """Whether the environment class the checkpoint's config names loads here (trusted: importing is allowed)."""
    import yaml

    from asyncrl.environments import load_factory

    try:
        spec = ((yaml.safe_load((Path(path) / "config.yaml").read_text()) or {}).get("environment") or {}).get("factory")
        return bool(spec) and load_factory(spec) is not None
    except (OSError, yaml.YAMLError, ValueError):
        return False


def untracked(cfg: Any) -> Any:
    """``cfg`` without tracking sinks (a restore's default: see the module docstring)."""
    from asyncrl.tracking import TrackingConfig

    return cfg.model_copy(update={"tracking": TrackingConfig()})


def export_checkpoint(path: str | Path, out: str | Path, adapter: bool = False) -> tuple[Path, int]:
    """Write the policy of the checkpoint at ``path`` (a run directory: its newest) as a Hugging Face model
    directory at ``out`` (merged weights for a LoRA run), or with ``adapter`` the LoRA adapter alone (loadable with
    ``peft.PeftModel.from_pretrained``). Returns ``(out, trainer version)``. Builds the trainer's engine alone, in
    this process (on the CPU for the torch engine); a bad checkpoint, a multi-rank trainer or ``adapter`` without
    LoRA is one ``ValueError`` line."""
    from pydantic import TypeAdapter

    import asyncrl
    from asyncrl.algorithms import GRPOLoss
    from asyncrl.backends import engine
    from asyncrl.backends.hf import export_pretrained, load_tokenizer
    from asyncrl.config import LossConfig, ModelConfig, TrainerConfig

    ckpt = checkpoint.read(path, asyncrl.__version__)
    where = repr(str(ckpt.path))
    model_cfg = ModelConfig.model_validate(ckpt.config.get("model") or {})
    trainer_cfg = TypeAdapter(TrainerConfig).validate_python(ckpt.config.get("trainer") or {})
    if adapter and (model_cfg.lora is None or trainer_cfg.backend != "torch"):
        raise ValueError(f"--adapter: checkpoint {where} has no adapter (its model.lora is not set): export the whole "
                         "model without --adapter")
    if getattr(trainer_cfg, "ranks", 1) > 1:
        raise ValueError(f"checkpoint {where} is of a trainer of {trainer_cfg.ranks} ranks, which export does not "
                         "build: use Controller.restore(path, trust_code=True).save_pretrained(dir) on its machines")
    if "device" in type(trainer_cfg).model_fields:  # the torch engine: weights are read, not trained; the CPU does
        trainer_cfg = trainer_cfg.model_copy(update={"device": "cpu"})
    tokenizer = load_tokenizer(model_cfg)
    loss = GRPOLoss(LossConfig.model_validate(ckpt.config.get("loss") or {}))
    policy = engine(trainer_cfg)(model_cfg, trainer_cfg, loss, int(ckpt.config.get("seed", 0)), tokenizer)
    try:
        policy.load_state_dict(ckpt.tensors["policy"])
        if adapter:
            from asyncrl.backends.lora import save_adapter

            written = save_adapter(policy.peft, out)
            tokenizer.save_pretrained(str(written))
        else:
            written = export_pretrained(policy, model_cfg, tokenizer, out)
    finally:
        policy.close()
    return Path(written), int(ckpt.meta["trainer_version"])


def rejudge(buffer, sampler, rollout, state, cfg, old: dict, how: str) -> None:
    """Restored under another sampler (``cfg.sampler``; ``old`` the checkpoint's): skip what it cannot keep (all of
    it with ``how="drop"``), fix its dispatch index, let it evict. ``rollout`` is the rollout pump (the one way a
    group is given up: ``skip``), ``state`` the run state (the trace)."""
    from asyncrl.trace import EVICT

    T, N, new = state.trainer_version, cfg.groups_per_step, cfg.sampler.name
    change = f"restored under sampler {new} (was {old.get('name')})"
    for slot in buffer.slots():
        if how == "drop":
            rollout.skip(slot.group_id, f"{change}; dropped (on_sampler_change='drop')", replace=False)
        elif sampler.stamps_target and slot.target_step is None:
            rollout.skip(slot.group_id, f"{change}, which trains only groups stamped with a target step", replace=False)
    for slot in reversed(buffer.slots()[buffer.capacity:]):
        rollout.skip(slot.group_id, f"{change}; over its capacity {buffer.capacity}", replace=False)
    sampler.resume_schedule(buffer.slots(), T, N)  # the batches it holds count as admitted
    for slot, reason in sampler.evict_reasoned(T):
        state.record(EVICT, slot.group_id, slot.weight_version, slot.target_step, T - slot.weight_version,
                     "on restore", f"{reason} ({change})")
    rollout.take_skipped()
