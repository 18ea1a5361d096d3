"""Checkpoints on disk: atomic directories that load without unpickling code. A checkpoint is data: ``save`` writes a
run's ``(config, state_dict)`` (``Controller.state_dict()``'s keys) into a file layout, ``load`` reads them back
(the config validated and checked against the checkpoint's model). ``Controller.save`` and ``Controller.restore``
own the flow; nothing here builds, reads or calls a controller.

One checkpoint is a directory:

| file | holds | read with |
| --- | --- | --- |
| ``tensors.pt`` | policy state (weights, optimizer, reference model), generator state (weights, sampling RNG, version), the torch RNG | ``torch.load(weights_only=True)`` |
| ``state.json`` | the buffer (every slot: stamps, prompt, rollouts), the trace, the metrics, the evaluations, what the next step has counted (``in_step``) | ``json`` |
| ``config.yaml`` | the run's configuration | ``yaml.safe_load`` |
| ``meta.json`` | format, asyncrl version, model shape, trainer version, data position, dispatch index, the sha256 of ``tensors.pt`` and ``state.json`` (``digests``) | ``json`` |

Invariants:
- Atomic: everything is written into a hidden temporary directory next to the target (``.NAME.tmp-*``), flushed
  to disk, then renamed into place; ``meta.json`` is written last, so a directory without it is never complete.
  Overwriting a checkpoint renames the old one aside (``.NAME.old-*``) first and deletes it only after the new one
  is in place; if a crash falls between the two renames, ``resolve`` finds the old one. A crash at any point leaves
  the previous checkpoint loadable. Leftover temporary directories are ignored and removed by the next save.
- ``checkpoint_every: K`` writes ``step-XXXXXX`` (the trainer version) under ``checkpoint_dir`` and keeps the
  newest ``keep_checkpoints`` complete ones; ``latest(dir)`` is the newest complete one.
- A checkpoint is restored only by the asyncrl version that wrote it and only into the same model shape (the
  ``model`` config and every parameter's shape): anything else is a clear error before anything is loaded.
- A damaged file (truncated, overwritten, a flipped bit: what a full disk, a copy cut short or bad storage leaves)
  is a ``CheckpointError`` of one line naming the file and what is wrong: it does not parse, or its sha256 is not
  the one ``meta.json`` recorded at the save (checked before anything is loaded; a checkpoint from before digests
  is not checked). Given a directory of checkpoints, ``resolve`` skips a damaged one
  with a ``CheckpointSkipped`` warning saying the same, and takes the newest intact one.
- Restoring without a config builds from the checkpoint's ``config.yaml``: a checkpoint naming a ``custom``
  sampler, or reward functions of one's own (``reward.funcs``: ``module:function``), is refused unless the caller
  passes ``trust_code=True`` (importing them runs their modules' code) or names its own (``sampler=``,
  ``reward_funcs=``), and its ``ray.address`` is dropped (where a restore connects is the caller's choice: its config or ``RAY_ADDRESS``).

What a resume restores: weights, optimizer, the generator's weights, version and sampling RNG, the torch RNG, every
buffered group (ready ones with their rollouts and reward functions' values), the sampler's dispatch index,
the data position, the trace, the metrics and what the next step has counted. A save first brings back every
group in flight (``Controller.state_dict``, ``RolloutPump.settle``): a step's weight sync generates the batches
submitted before it with the old weights, and a running rollout pump may hold a batch it generated and has not
committed; those rollouts are saved, never generated again. So a run resumes bit-identically whatever the save
caught (``in_order`` or ``weight_fifo`` included: ``tests/test_checkpoint.py``, ``tests/test_resume_kill.py``).
What it does not restore: a group a generator still held after ``stall_timeout_s`` is saved pending and generated
again after the restore, fault counters and retry backoffs start fresh, timings, and where the backends ran (the
restoring config decides placement).
Saving is refused in the middle of a step (``Controller.save`` says so).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from asyncrl.rewards.config import imported_functions
from asyncrl.run_dir import RunDirError

FORMAT = 1
PREFIX = "step-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored here (another version, another model shape, incomplete, damaged)."""


class CheckpointSkipped(UserWarning):
    """A damaged checkpoint passed over for an older intact one (the message names the file and the damage)."""


# --- the three file-system operations a save is made of (tests make each one fail in turn) ---------------------
def _write(path: Path, data: bytes) -> None:
    try:  # a full disk or a read-only directory: one line naming the file (the save is abandoned, see ``write``)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise RunDirError(path, exc) from None


def _rename(src: Path, dst: Path) -> None:
    os.rename(src, dst)
    _fsync_dir(dst.parent)


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- writing ---------------------------------------------------------------------------------------------------
def _jsonable(obj: Any) -> Any:
    if callable(getattr(obj, "to_json", None)):  # a Prompt: its columns, only the fields it has set
        return obj.to_json()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (np.generic, torch.Tensor)):  # numpy / torch scalars
        return obj.item()
    raise TypeError(f"cannot write {type(obj).__name__} {obj!r} into a checkpoint")


def write(path: str | Path, meta: dict, config: dict, state: dict, tensors: dict) -> Path:
    """Write one checkpoint directory at ``path`` atomically (see the module docstring)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        _remove(stale)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        blob = io.BytesIO()
        torch.save(tensors, blob)
        files = {"tensors.pt": blob.getvalue(), "state.json": json.dumps(state, default=_jsonable).encode()}
        for name, data in files.items():
            _write(tmp / name, data)
        _write(tmp / "config.yaml", yaml.safe_dump(config, sort_keys=False).encode())
        meta = {**meta, "format": FORMAT, DIGESTS: digests(files)}
        _write(tmp / "meta.json", json.dumps(meta, indent=1, default=_jsonable).encode())
        _fsync_dir(tmp)
    except BaseException:
        _remove(tmp)
        raise
    if path.exists():
        _rename(path, path.parent / f".{path.name}.old-{time.monotonic_ns()}")
    _rename(tmp, path)
    for old in path.parent.glob(f".{path.name}.old-*"):  # this one's, and any a crash left behind
        _remove(old)
    return path


def complete(path: Path) -> bool:
    return (path / "meta.json").is_file()


def resolve(path: str | Path) -> Path:
    """The checkpoint at ``path``; the one a crashed overwrite left aside; or, for a directory of checkpoints
    (``checkpoint_dir`` or a CLI ``--out`` directory), the newest complete and intact one in it (each damaged one
    passed over is a ``CheckpointSkipped`` warning naming the file)."""
    import warnings

    path = Path(path)
    if complete(path):
        return path
    aside = sorted(path.parent.glob(f".{path.name}.old-*"))
    if aside and complete(aside[-1]):
        return aside[-1]
    found = _complete(path) or _complete(path / "checkpoints")
    skipped = []
    for candidate in reversed(found):
        problem = damage(candidate)
        if problem is None:
            return candidate
        skipped.append(problem)
        warnings.warn(CheckpointSkipped(f"skipping {problem}"), stacklevel=2)
    if skipped:
        raise CheckpointError(f"no intact checkpoint at {str(path)!r}: {'; '.join(skipped)}")
    raise CheckpointError(f"no complete checkpoint at {str(path)!r} (a checkpoint directory has meta.json)")


def _complete(directory: Path) -> list[Path]:
    return sorted(p for p in Path(directory).glob(f"{PREFIX}*") if complete(p))


def damage(path: Path) -> str | None:
    """What is wrong with the files of a complete checkpoint, in one line naming the file (None: nothing found).
    Parses the three text files and opens ``tensors.pt``'s zip directory, which sits at its end (a truncated or
    overwritten file has none); it does not load the tensors."""
    import zipfile

    for name, parse in (("meta.json", json.loads), ("config.yaml", yaml.safe_load), ("state.json", json.loads)):
        try:
            parse((path / name).read_text())
        except (OSError, ValueError, yaml.YAMLError) as exc:
            return _damaged(path / name, exc)
    try:
        with zipfile.ZipFile(path / "tensors.pt"):
            pass
    except (OSError, zipfile.BadZipFile) as exc:
        return _damaged(path / "tensors.pt", exc)
    return digest_damage(path, json.loads((path / "meta.json").read_text()))


def _damaged(file: Path, exc: BaseException) -> str:
    detail = " ".join(str(exc).split()) or type(exc).__name__
    return f"damaged checkpoint file {str(file)!r}: {type(exc).__name__}: {detail[:200]}"


# --- digests: a checkpoint verifies its own files --------------------------------------------------------------
# ``meta.json`` records the sha256 of the files a resume loads as data (``tensors.pt``, ``state.json``) as written
# (``digests``); a file whose bytes changed since (a flipped bit, a copy cut short that still parses) is damaged,
# found before anything of it is loaded. ``config.yaml`` is not digested: it is the one file meant to be read and
# edited by hand, and a restore validates all of it (and checks its model against ``meta.json``) anyway. A
# checkpoint from before digests (no ``digests`` key) is not checked.
DIGESTS = "digests"


def digests(files: dict[str, bytes]) -> dict[str, str]:
    """``{file name: sha256 hex digest}`` of a checkpoint's files (their bytes as written)."""
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):  # a model's tensors.pt can be larger than memory should hold twice
            h.update(chunk)
    return h.hexdigest()


def digest_damage(path: Path, meta: dict) -> str | None:
    """The first file of checkpoint ``path`` whose sha256 is not the one its ``meta.json`` recorded, in one line
    naming it (None: every file matches, or the checkpoint records no digests)."""
    recorded = meta.get(DIGESTS) if isinstance(meta, dict) else None
    if not isinstance(recorded, dict):
        return None
    for name, want in recorded.items():
        file = path / name
        try:
            got = _sha256(file)
        except OSError as exc:
            return _damaged(file, exc)
        if got != want:
            return (f"damaged checkpoint file {str(file)!r}: its sha256 is {got[:16]}..., not the {str(want)[:16]}... "
                    f"meta.json recorded when it was saved ({file.stat().st_size} bytes now)")
    return None


def latest(directory: str | Path) -> Path | None:
    """The newest complete ``step-*`` checkpoint in ``directory`` (None when there is none)."""
    found = _complete(Path(directory))
    return found[-1] if found else None


def save_periodic(directory: str | Path, config: Any, state: dict, keep: int) -> Path:
    """``checkpoint_every``: ``save`` into ``directory/step-XXXXXX`` (the state's trainer version), then delete all
    but the newest ``keep`` complete ones."""
    directory = Path(directory)
    path = save(directory / f"{PREFIX}{state['trainer_version']:06d}", config, state)
    done = sorted(p for p in directory.glob(f"{PREFIX}*") if complete(p))
    for old in done[:-keep]:
        _remove(old)
    return path


# --- reading ---------------------------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    path: Path
    meta: dict
    config: dict
    state: dict
    tensors: dict


def read(path: str | Path, version: str) -> Checkpoint:
    """Load a checkpoint written by asyncrl ``version`` (anything else is a ``CheckpointError``)."""
    path = resolve(path)
    meta = _load(path / "meta.json", json.loads)
    if meta.get("format") != FORMAT or meta.get("asyncrl_version") != version:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was written by asyncrl {meta.get('asyncrl_version')!r} (format "
            f"{meta.get('format')!r}); this is asyncrl {version!r} (format {FORMAT}), which restores only its own "
            "checkpoints"
        )
    problem = digest_damage(path, meta)
    if problem is not None:
        raise CheckpointError(problem)
    config = _load(path / "config.yaml", yaml.safe_load)
    state = _load(path / "state.json", json.loads)
    tensors = _load(path / "tensors.pt", lambda _: torch.load(path / "tensors.pt", weights_only=True), text=False)
    return Checkpoint(path, meta, config, state, tensors)


def _load(file: Path, parse, text: bool = True) -> Any:
    """``parse`` the file, or a one-line ``CheckpointError`` naming it and what is wrong."""
    try:
        return parse(file.read_text() if text else None)
    except Exception as exc:  # torch's, json's and yaml's errors for a damaged file share no base class
        raise CheckpointError(_damaged(file, exc)) from None


def check_model(saved: dict, model: dict, where: str) -> None:
    """The restoring config's model must be the checkpoint's (every field of the ``model`` section)."""
    diff = {k: (saved.get(k), model.get(k)) for k in sorted(set(saved) | set(model)) if saved.get(k) != model.get(k)}
    if diff:
        pairs = ", ".join(f"{k}: checkpoint {a!r}, config {b!r}" for k, (a, b) in diff.items())
        raise CheckpointError(f"checkpoint {where} holds another model shape ({pairs}); restore it with its own model")


def check_shapes(saved: dict[str, list[int]], current: dict[str, list[int]], where: str) -> None:
    if saved != current:
        diff = [f"{k}: checkpoint {saved.get(k)}, model {current.get(k)}"
                for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
        raise CheckpointError(f"checkpoint {where} holds another model shape: {'; '.join(diff[:5])}")


def check_data(saved: dict | None, task: Any, where: str) -> None:
    """The restoring run's data is the data the checkpoint trained on (``asyncrl.datasets.data_changed``)."""
    from asyncrl.datasets import data_changed

    problem = data_changed(saved, task)
    if problem is not None:
        raise CheckpointError(f"checkpoint {where}: {problem}")


def shapes(policy_state: dict) -> dict[str, list[int]]:
    """Parameter shapes of a policy state (its ``model`` tensors), the model-shape fingerprint."""
    model = policy_state.get("model", {}) if isinstance(policy_state, dict) else {}
    return {k: list(v.shape) for k, v in model.items() if isinstance(v, torch.Tensor)}


# --- a run's (config, state_dict) as files, and back -------------------------------------------------------
# Where each key of a state dict (``Controller.state_dict()``) is stored: meta.json, state.json, tensors.pt.
META_KEYS = ("trainer_version", "data_position", "exhausted", "dispatch_index", "sampler")
STATE_KEYS = ("buffer", "trace", "metrics", "evaluations", "in_step")
TENSOR_KEYS = ("policy", "generator", "torch_rng")


def save(path: str | Path, config: Any, state: dict) -> Path:
    """Write ``(config, state)`` as one checkpoint directory at ``path``, atomically: ``config`` a run's ``Config``
    (``config.yaml``; its model's shape fields in ``meta.json``), ``state`` a state dict. Buffer slots' dataclasses
    (``Prompt``, ``GroupRollouts``) become plain JSON objects; ``state`` itself is not changed."""
    import asyncrl

    buffer = {**state["buffer"], "slots": [
        {**row, "prompt": _jsonable(row["prompt"]) if row["prompt"] is not None else None,
         "rollouts": _jsonable(row["rollouts"]) if row["rollouts"] is not None else None}
        for row in state["buffer"]["slots"]]}
    meta = {
        "asyncrl_version": asyncrl.__version__,
        "model": config.model.shape_dump(),
        "shapes": shapes(state["policy"]),
        **{key: state[key] for key in META_KEYS},
        **({"data": state["data"]} if state.get("data") else {}),  # a dataset task's sources and content hashes
        **({"given": state["given"]} if state.get("given") else {}),  # built from objects: restore asks for them
    }
    files = {key: buffer if key == "buffer" else state[key] for key in STATE_KEYS}
    if not any(files["in_step"].values()):  # nothing counted: the files are those of the format before in_step
        del files["in_step"]
    tensors = {key: state[key] for key in TENSOR_KEYS}
    return write(path, meta, config.model_dump(mode="json"), files, tensors)


def own_config(ckpt: Checkpoint, sampler_given: bool, trust_code: bool, rewards_given: bool = False,
               environment_given: bool = False) -> dict:
    """The checkpoint's own config as plain data, before anything of it is validated (validating a ``custom``
    sampler imports its module): refused when it names a custom sampler the caller did not trust or replace; its
    ``ray.address`` dropped (where to connect is the caller's: a config, or ``RAY_ADDRESS``)."""
    data = {**(ckpt.config or {})}
    named = data.get("sampler") or {}
    if isinstance(named, dict) and named.get("name") == "custom" and not (trust_code or sampler_given):
        raise CheckpointError(
            f"checkpoint {str(ckpt.path)!r} names a custom sampler, {named.get('target')!r}: building it would import "
            "and run that module's code. Pass trust_code=True if you trust the checkpoint, or pass config= (or "
            "sampler=) to choose what runs")
    imported = imported_functions(data)  # reward functions of one's own: the same rule as a custom sampler
    if imported and not (trust_code or rewards_given):
        raise CheckpointError(
            f"checkpoint {str(ckpt.path)!r} names reward functions {imported}: loading them would import and run "
            "their modules' code. Pass trust_code=True if you trust the checkpoint, or pass reward_funcs= (or "
            "config=) to choose what runs")
    factory = (data.get("environment") or {}).get("factory") if isinstance(data.get("environment"), dict) else None
    if factory and not (trust_code or environment_given):  # an environment class of one's own: the same rule
        raise CheckpointError(
            f"checkpoint {str(ckpt.path)!r} names an environment class, {factory!r}: building it would import and run "
            "its module's code. Pass trust_code=True if you trust the checkpoint, or pass environment_factory= (or "
            "config=) to choose what runs")
    if isinstance(data.get("ray"), dict):
        data["ray"] = {**data["ray"], "address": None}
    return data


def state_dict(ckpt: Checkpoint) -> dict:
    """A checkpoint's files as a state dict (``Controller.load_state_dict`` takes it): buffer slots as ``Prompt``
    and ``GroupRollouts`` again."""
    from asyncrl.data import GroupRollouts
    from asyncrl.tasks import Prompt

    state = {**{key: ckpt.meta[key] for key in META_KEYS}, **{key: ckpt.state.get(key) for key in STATE_KEYS},
             **{key: ckpt.tensors[key] for key in TENSOR_KEYS}, "data": ckpt.meta.get("data")}
    for row in state["buffer"]["slots"]:
        row["prompt"] = Prompt(**row["prompt"]) if row["prompt"] is not None else None
        row["rollouts"] = GroupRollouts(**row["rollouts"]) if row["rollouts"] is not None else None
    return state


def load(path: str | Path, config: Any = None, sampler: Any = None, trust_code: bool = False,
         rewards_given: bool = False, environment_given: bool = False) -> tuple[Any, dict]:
    """``(config, state_dict)`` of the checkpoint at ``path`` (``resolve`` finds it). The config is ``config``
    (a ``Config``; default: the checkpoint's own, under ``own_config``'s rules) with ``sampler`` (a sampler config
    or mapping) in place of its sampler, validated, and its model must be the checkpoint's: every check that can
    fail here runs before anything is loaded into a run."""
    import asyncrl
    from asyncrl.config import Config
    from asyncrl.samplers import sampler_config

    ckpt = read(path, asyncrl.__version__)
    data = (own_config(ckpt, sampler is not None, trust_code, rewards_given, environment_given) if config is None
            else config.model_dump(mode="json"))
    if rewards_given:  # the caller's objects replace the functions named (nothing of them is imported)
        data["reward"] = {**(data.get("reward") or {}), "funcs": []}  # weights and accuracy are data: kept
    if sampler is not None:
        data["sampler"] = sampler_config(sampler).model_dump(mode="json")
    cfg = Config.model_validate(data)
    check_model(ckpt.meta["model"], cfg.model.shape_dump(), repr(str(ckpt.path)))
    return cfg, state_dict(ckpt)
