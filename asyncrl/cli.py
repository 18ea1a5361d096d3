"""``asyncrl run CONFIG_OR_PRESET --steps N --out DIR``: a headless run that writes its metrics, trace and config.
``asyncrl simulate PRESET --steps N --out DIR``: the same on a virtual clock with the simulated backends (seconds);
``--sweep KEY=V1,V2`` (repeatable) and ``--gpus G`` simulate a grid instead: ``sweep.csv``, ``sweep.png``.
``asyncrl export RUN_OR_CHECKPOINT DIR``: the trained policy of a checkpoint as a Hugging Face model directory.
``asyncrl replay RUN --sampler S [--sampler S ...] --out DIR``: a recorded run replayed under other samplers
(``asyncrl/replay/command.py``).

Overrides use dotted keys: ``--set seed=1 --set sampler.name=weight_fifo --set sampler.max_staleness_versions=2``.
Checkpoints: ``--checkpoint-every K`` writes ``DIR/checkpoints/step-XXXXXX`` every K steps; ``--resume DIR``
continues that run from its newest complete checkpoint to ``--steps`` in all (metrics.csv and trace.csv are
rewritten to hold exactly the steps of one uninterrupted history).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.presets import presets  # the rest is imported where it is used: `asyncrl --help` loads no torch
from asyncrl.replay import command as replay_command
from asyncrl.run_endings import RunSignals, Terminated, failure_line

if TYPE_CHECKING:
    from pydantic import BaseModel


def parse_overrides(pairs: list[str]) -> dict:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}``: ``--set`` values, dotted keys, YAML values. A value
    that is not YAML, or a key both set and given subkeys, is a one-line ``ValueError`` naming the ``--set``."""
    from asyncrl.config import read_yaml

    out: dict = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--set expects KEY=VALUE, got {pair!r}")
        key, raw = pair.split("=", 1)
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {pair!r}: {part!r} is given a value by another --set, so it has no keys")
        node[leaf] = read_yaml(raw, f"--set {pair!r}: the value")
    return out


def run(args: argparse.Namespace) -> int:
    """Check everything, then run, appending each finished step to metrics.csv and its events to trace.csv (and
    trace_index.csv, which lets ``asyncrl.Recording`` scrub it), listening on DIR/control.sock for
    ``asyncrl.attach`` meanwhile. Exit 0 when the run completed (or the data ran out) or was stopped by an attached
    controller or reached --max-time (status ``time_limit``); 130 on Ctrl-C (SIGINT), 143 on SIGTERM, 129 on
    SIGHUP (128 + the signal: the run stops at a safe point, the files hold every finished step, summary.json says
    ``interrupted`` or ``terminated``); 1 when it failed (one line on stderr, the traceback in DIR/error.log); summary.json says which (``status``) and why."""
    with RunSignals() as signals:
        return _run_checked(args, signals)


def _run_checked(args: argparse.Namespace, signals: RunSignals) -> int:
    import yaml

    from asyncrl.checkpoint import CheckpointSkipped, resolve
    from asyncrl.config import load_config
    from asyncrl.controller import Controller

    stop = {"handle": None}
    out = None
    try:  # nothing is written before the config, the output directory and the controller are known to be good
        if args.out is None and args.resume is None:
            raise ValueError("give --out DIR (or --resume DIR to continue a run)")
        out, overrides = Path(args.out or args.resume), parse_overrides(args.set)
        with warnings.catch_warnings(record=True) as skipped:  # a damaged checkpoint: one line, then an older one
            warnings.simplefilter("always", CheckpointSkipped)
            resume = resolve(args.resume) if args.resume else None  # its newest complete, intact checkpoint
        for w in skipped:
            if issubclass(w.category, CheckpointSkipped):
                print(f"asyncrl run: {w.message}", file=sys.stderr)
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        every = args.checkpoint_every
        saved = (yaml.safe_load((resume / "config.yaml").read_text()) or {}) if resume is not None else {}
        if every is None and resume is not None:  # a resumed run keeps checkpointing as it did
            every = saved.get("checkpoint_every")
        if every is not None:
            overrides.update(checkpoint_every=every, checkpoint_dir=str(out / "checkpoints"))
        if args.max_time is not None:  # the wall-time limit (run_loop: ends after a step, status time_limit)
            overrides.update(max_time_s=args.max_time)
        cfg = load_config(args.config, **overrides)
        if resume is not None:  # and keeps its TensorBoard / W&B sinks unless told otherwise
            cfg = _keep_tracking(cfg, saved.get("tracking") or {}, args.config, overrides)
        if cfg.trainer.lr_schedule != "constant" and cfg.trainer.lr_decay_steps is None:
            cfg.trainer.lr_decay_steps = args.steps  # a decaying lr_schedule's horizon: the run's --steps in all
        _check_writable(out)
        ctrl = Controller.restore(resume, config=cfg) if resume else Controller.from_config(cfg)
        if resume is not None:  # the one line a resumed run says where it continues from
            print(f"asyncrl run: resuming from checkpoint {resume} at step {ctrl.trainer_version} of {args.steps}",
                  file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted before the run started; nothing written", file=sys.stderr)
        return 130
    except Terminated as exc:
        print(f"asyncrl run: {exc} before the run started; nothing written", file=sys.stderr)
        return 128 + exc.signum
    except (ValueError, TypeError, ImportError, OSError) as exc:  # pydantic's ValidationError is a ValueError
        print(_error_message(exc), file=sys.stderr)
        return 2
    except Exception as exc:  # user code building the run (a custom sampler, a loss, ...): one line, error.log
        print(failure_line(out, exc), file=sys.stderr)
        return 1
    try:
        out.mkdir(parents=True, exist_ok=True)
        from asyncrl.remote import ControlServer

        try:  # a live run in this directory answers on its socket: refuse before touching its files
            server = ControlServer(out, ctrl, lambda: stop["handle"], lambda: stop.update(remote=True)).start()
        except (RuntimeError, OSError) as exc:
            print(f"asyncrl run: {exc}", file=sys.stderr)
            return 2
        try:
            return _run(args, ctrl, cfg, out, stop, signals)
        finally:
            server.close()  # last: an attached Remote that sees it hang up knows every file is written
    except KeyboardInterrupt:  # before the pumps started: the socket is gone, nothing was trained
        print("interrupted before the run started", file=sys.stderr)
        return 130
    except Terminated as exc:
        print(f"asyncrl run: {exc} before the run started", file=sys.stderr)
        return 128 + exc.signum


def _keep_tracking(cfg, saved: dict, config, overrides: dict):
    """A resumed run's config with the first run's tracking sinks (TensorBoard directory, W&B project and run
    name) wherever the resume's config and ``--set`` / ``--tensorboard`` / ``--wandb`` leave them unset."""
    from asyncrl.config import load_config

    given = overrides.get("tracking") or {}
    keep = {key: value for key, value in saved.items()
            if value is not None and key not in given and getattr(cfg.tracking, key, None) is None}
    if not keep:
        return cfg
    return load_config(config, **{**overrides, "tracking": {**given, **keep}})


def _run(args, ctrl, cfg, out: Path, stop: dict, signals: RunSignals) -> int:
    """The run itself, its files and its summary (``run`` checked everything and listens for ``attach``)."""
    import yaml

    from asyncrl.run_files import RunFiles

    (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    # trace.csv, metrics.csv and trace_index.csv, appended at each step (asyncrl/run_files.py); history=True: a
    # resumed run's files start from its checkpoint's history, not the old files
    files = RunFiles(out).attach(ctrl)  # and completions.jsonl, what the model wrote (asyncrl/completions.py)

    signals.running(lambda: stop["handle"] is not None and stop["handle"].stop(wait=False))
    error = None
    try:
        if args.steps > ctrl.trainer_version:  # --steps counts in all: a resumed run has done some
            stop["handle"] = ctrl.start(args.steps - ctrl.trainer_version, progress=not args.quiet)
            if signals.asked:
                stop["handle"].stop(wait=False)
            stop["handle"].wait()
    except Exception as exc:  # the run's own error, re-raised by wait(): one line here, the traceback in error.log
        error = exc
    error = _unwritable(files.close, error)  # a full disk or a read-only directory: the run's error
    handle = stop["handle"]
    timed_out = handle is not None and handle.status == "time_limit"  # --max-time: ends after a step, exit 0
    final = None
    if error is None and signals.asked is None and not stop.get("remote") and not timed_out and ctrl.task.eval_prompts:
        try:  # a dataset may have no evaluation split
            final = ctrl.evaluate()
        except Exception as exc:
            error = exc
    status = ("failed" if error is not None else signals.status or ("stopped" if stop.get("remote") else
                                                                     "time_limit" if timed_out else "completed"))
    summary = {"status": status, "steps": ctrl.trainer_version, "ended": handle.status if handle else "not started"}
    if signals.asked is not None:
        summary["signal"] = signals.name
    if error is not None:
        summary["error"] = f"{type(error).__name__}: {error}"
    if final is not None:
        summary.update({f"final_eval_{k}": v for k, v in final.items()})
    summary["constant_answer_accuracy"] = ctrl.task.constant_answer_accuracy
    error = _unwritable(lambda: (out / "summary.json").write_text(json.dumps(summary, indent=2)), error)
    if not args.no_plot and len(ctrl.metrics):
        error = _unwritable(lambda: _plot(ctrl, out / "reward.png"), error)
    ctrl.close()
    print(json.dumps(summary))
    if error is not None:
        print(_failure(out, error), file=sys.stderr)
    if final is not None:
        print(_learning(ctrl, final))
    if error is not None:
        return 1
    return 0 if status in ("completed", "stopped", "time_limit") else 128 + signals.asked  # killed by a signal, after the clean-up


def _failure(out: Path, exc: BaseException) -> str:
    """The one line a failed run prints: a run directory that cannot be written names the file (no error.log: the
    disk may be full); any other error its line and where its traceback went (``run_endings.failure_line``)."""
    from asyncrl.run_dir import RunDirError

    if isinstance(exc, RunDirError):
        return f"asyncrl run: {exc}; the run stopped, every file ends with a whole row"
    return failure_line(out, exc)


def _unwritable(write, error: Exception | None) -> Exception | None:
    """``write()`` a file of the run directory; an ``OSError`` becomes the run's error (a ``RunDirError`` naming the
    file) when it had none, and the run's own error stays the one reported when it had one."""
    from asyncrl.run_dir import RunDirError

    try:
        write()
    except OSError as exc:
        return error or (exc if isinstance(exc, RunDirError) else RunDirError(exc.filename or "the run directory", exc))
    return error


def _check_writable(out: Path) -> None:
    """Before anything is built: ``out`` (or its nearest existing parent, where it would be created) takes a new
    entry. Tried for real and removed at once, since permission bits do not tell (root passes every ``os.access``
    check, yet cannot create files under /proc)."""
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"--out {str(out)!r}: {str(probe)!r} is not a directory")
    try:
        tempfile.TemporaryDirectory(dir=probe, prefix=".asyncrl-probe-").cleanup()
    except OSError as exc:
        raise ValueError(f"--out {str(out)!r}: cannot create files in {str(probe)!r} ({exc.strerror or exc})") from exc


def _plot(ctrl, path: Path) -> None:
    try:
        from matplotlib.figure import Figure

        from asyncrl.plots.metrics import draw_reward  # the notebook's reward panel: one drawing of it
    except ImportError:
        print("matplotlib is not installed: no reward.png (pip install 'asyncrl[notebook]')", file=sys.stderr)
        return
    fig = Figure(figsize=(8.4, 3.4), layout="constrained")
    draw_reward(ctrl, fig.add_subplot())
    fig.savefig(path, dpi=110)


def _learning(ctrl, final: dict) -> str:
    """One line a person reads: held-out accuracy before training (when ``eval_every`` evaluated the untrained
    model), after the run, and the bar it is judged against."""
    from asyncrl.metrics import EVALUATED_VERSION, HELD_OUT_ACCURACY

    start = ctrl.evaluations.iloc[0]
    accuracy, version = start[HELD_OUT_ACCURACY.name], start[EVALUATED_VERSION.name]
    before = f"{accuracy:.2f} untrained -> " if version == 0 < ctrl.trainer_version else ""
    after = final[HELD_OUT_ACCURACY.name]
    bar = ctrl.task.constant_answer_accuracy  # NaN: a dataset without an answer column has no such bar
    return (f"held-out greedy accuracy: {before}{after:.2f} after {ctrl.trainer_version} steps"
            + ("" if bar != bar else f"; the best constant answer scores {bar:.2f}"))


def _error_message(exc: Exception) -> str:
    """What a user sees for a mistake found before the run: a configuration error is one line per error, without
    a traceback, pydantic's links or a dump of the whole config; anything else is its message."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return f"asyncrl run: {exc}"
    errors = _config_errors(exc)
    return "\n".join([f"asyncrl run: invalid configuration ({len(errors)} error{'s' if len(errors) > 1 else ''}):",
                      *(f"  {line}" for line in errors)])


def _config_errors(exc) -> list[str]:
    """One line per error: the dotted key, what was given, what is allowed (no pydantic boilerplate, no dump of
    the whole config)."""
    from asyncrl.config import BOOLEAN_NOT_A_NUMBER, GENERATION_CONFIGS, TRAINER_CONFIGS, Config
    from asyncrl.samplers import SAMPLERS

    tags = {"sampler": {*SAMPLERS, "custom"}, "generation": set(GENERATION_CONFIGS), "trainer": set(TRAINER_CONFIGS)}
    lines = []
    for err in exc.errors(include_url=False):
        if err["type"] == BOOLEAN_NOT_A_NUMBER:  # names its keys and values itself
            lines.append(err["msg"])
            continue
        # Sampler and backend configs are unions tagged by name / backend: the tag is in the location, not a key a
        # person types.
        loc = [str(p) for i, p in enumerate(err["loc"]) if not (i == 1 and p in tags.get(err["loc"][0], ()))]
        key, given = ".".join(loc), err["input"]
        message = err["msg"].removeprefix("Value error, ").removeprefix("Input ")
        if err["type"] == "extra_forbidden":
            message = f"not a configuration key; the keys here are {', '.join(_keys_at(Config, loc[:-1]))}"
            sections = {name: getattr(field.annotation, "model_fields", {}) for name, field in Config.model_fields.items()}
            sections.update({name: {k for v in variants.values() for k in v.model_fields}
                             for name, variants in (("generation", GENERATION_CONFIGS), ("trainer", TRAINER_CONFIGS))})
            elsewhere = [f"{name}.{loc[-1]}" for name, keys in sections.items() if len(loc) == 1 and loc[-1] in keys]
            message += f" (did you mean {' or '.join(elsewhere)}?)" if elsewhere else ""
        elif err["type"] == "union_tag_invalid":
            key, given = f"{key}.name", err["ctx"]["tag"]
            message = f"should be one of {err['ctx']['expected_tags']}"
        where = key or "configuration"
        lines.append(f"{where} = {given!r}: {message}" if not isinstance(given, (dict, list)) else f"{where}: {message}")
    return lines


def _keys_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    for part in loc:
        model = model.model_fields[part].annotation
    return list(model.model_fields)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def simulate(args: argparse.Namespace) -> int:
    """``asyncrl simulate PRESET --steps N --out DIR``: the controller on the simulated backends' virtual clock."""
    from asyncrl import simulate as sim_module
    from asyncrl.config import load_config
    from asyncrl.controller import Controller

    try:
        overrides = parse_overrides(args.set)
        cfg = load_config(args.config, **overrides)
        _check_writable(Path(args.out))
        sim = sim_module.Simulation(Controller.from_config(cfg))
        if args.sweep or args.gpus is not None:
            import yaml

            axes = {}
            for item in args.sweep:
                key, eq, values = item.partition("=")
                if not eq or not values:
                    raise ValueError(f"--sweep expects KEY=V1,V2,..., got {item!r}")
                axes[key] = [yaml.safe_load(v) for v in values.split(",")]
            table = sim_module.grid(args.config, args.steps, axes, gpus=args.gpus, **overrides)
    except (ValueError, TypeError, ImportError, OSError) as exc:  # pydantic's ValidationError is a ValueError
        print(_error_message(exc).replace("asyncrl run:", "asyncrl simulate:"), file=sys.stderr)
        return 2
    if args.sweep or args.gpus is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        table.to_csv(out / "sweep.csv", index=False)
        if not args.no_plot:
            from asyncrl.plots.simulation import plot_grid

            plot_grid(table, [c for c in table.columns if "." in c]).savefig(out / "sweep.png", dpi=110)
        shown = [c for c in table.columns if "." in c] + ["gpus", "sim_steps_per_hour", "tokens_per_s",
                                                          "tokens_per_s_per_gpu", "gen_idle", "train_idle", "best"]
        print(table[shown].round(3).to_string(index=False))
        best = table[table.best].iloc[0]
        print(json.dumps({k: (v.item() if hasattr(v, "item") else v) for k, v in best[shown[:-1]].items()}))
        print(f"{len(table)} points of {args.steps} simulated steps; files in {args.out}", file=sys.stderr)
        return 0
    sim.run(args.steps)
    sim.write(args.out, plots=not args.no_plot)
    summary = sim.summary()
    print(json.dumps({k: summary[k] for k in ("steps", "sim_steps_per_hour", "gen_idle_frac", "train_idle_frac",
                                              "lag_mean", "groups_dropped")}))
    print(f"{summary['steps']} simulated steps in {sim.wall_s:.1f} s of wall time; files in {args.out}",
          file=sys.stderr)
    return 0


def export(args: argparse.Namespace) -> int:
    """``asyncrl export RUN_OR_CHECKPOINT DIR [--adapter]``: the checkpoint's policy (a run directory: its newest)
    as a Hugging Face model directory, or a LoRA run's adapter alone, from its weights and tokenizer only
    (``asyncrl.restoring.export_checkpoint``: no reward, task or sampler code imported, no tracking sink opened). A
    bad checkpoint or DIR is one line, exit 2, nothing written."""
    from asyncrl.restoring import export_checkpoint

    out = Path(args.dir)
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"{args.dir!r} exists and is not an empty directory: export writes a new one")
        out, step = export_checkpoint(args.run, out, adapter=getattr(args, "adapter", False))
    except (ValueError, TypeError, ImportError, OSError) as exc:
        print(_error_message(exc).replace("asyncrl run:", "asyncrl export:"), file=sys.stderr)
        return 2
    what = "LoRA adapter" if getattr(args, "adapter", False) else "policy"
    print(f"asyncrl export: the {what} after step {step} of {args.run} written to {out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="asyncrl", description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"presets: {', '.join(presets())} (or the path of a YAML file with the same keys)\n"
               "example: asyncrl run quickstart --steps 300 --out runs/q",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run headless and write metrics.csv, trace.csv, completions.jsonl, config.yaml, "
                       "summary.json")
    p.add_argument("config", help=f"a preset ({', '.join(presets())}) or the path of a YAML config")
    p.add_argument("--steps", type=_positive, required=True,
                   help="optimizer steps to train (>= 1), in all: a resumed run counts the steps it already has")
    p.add_argument("--out", metavar="DIR",
                   help="directory for metrics.csv, trace.csv, config.yaml, summary.json and reward.png "
                        "(created if missing; files in it are overwritten; with --resume: the resumed directory)")
    p.add_argument("--checkpoint-every", type=_positive, metavar="K",
                   help="checkpoint every K steps under OUT/checkpoints, keeping the newest keep_checkpoints")
    p.add_argument("--max-time", type=_positive_seconds, metavar="SECONDS",
                   help="wall-time limit: stop after the step during which it passed, with a checkpoint when "
                        "--checkpoint-every is set; summary.json status 'time_limit', exit 0 (config: max_time_s)")
    p.add_argument("--resume", metavar="DIR",
                   help="continue the run in DIR (an --out directory or a checkpoint) from its newest complete "
                        "checkpoint to --steps in all; CONFIG must have the same model")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, dotted, value in YAML (repeatable): --set sampler.name=windowed")
    p.add_argument("--tensorboard", metavar="DIR", help="log every metrics row to TensorBoard in DIR "
                   "(same as --set tracking.tensorboard_dir=DIR)")
    p.add_argument("--wandb", metavar="PROJECT", help="log every metrics row to this W&B project (needs wandb)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true", help="do not write reward.png")
    p = sub.add_parser("simulate", help="the same controller on a virtual clock with the simulated backends "
                       "(seconds for 1,000 steps): metrics.csv, trace.csv, summary.json, simulation.png")
    p.add_argument("config", help="a preset with simulated backends (what_if) or the path of a YAML config")
    p.add_argument("--steps", type=_positive, required=True, help="optimizer steps to simulate (>= 1)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="directory for metrics.csv, trace.csv, config.yaml, summary.json and simulation.png")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, dotted (repeatable): --set generation.lengths=pareto")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="simulate each value of a config key, dotted (repeatable: every combination); writes "
                        "sweep.csv and sweep.png instead, the best point (tokens/s per GPU) marked")
    p.add_argument("--gpus", type=_positive, metavar="G",
                   help="keep the sweep's points that use G GPUs; without a sweep over generation.replicas or "
                        "trainer.data_parallel, every split of G between them: how many for generation?")
    p.add_argument("--no-plot", action="store_true", help="do not write simulation.png (sweep.png)")
    p = sub.add_parser("export", help="write a checkpoint's trained policy as a Hugging Face model directory "
                       "(config, safetensors, tokenizer) that transformers and vLLM load")
    p.add_argument("run", metavar="RUN_OR_CHECKPOINT", help="a run directory (its newest checkpoint) or a checkpoint")
    p.add_argument("dir", metavar="DIR", help="the directory to write (must not exist, or be empty)")
    p.add_argument("--adapter", action="store_true", help="a LoRA run (model.lora): write the adapter alone "
                   "(peft.PeftModel.from_pretrained loads it onto the base) instead of the merged model")
    replay_command.add_parser(sub)
    args = parser.parse_args(argv)
    # As `python -m` and a script would: a config's "module:function" rewards or "module:Class" sampler in the
    # directory the command runs from import without PYTHONPATH (workers get this sys.path too).
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    if args.command == "simulate":
        return simulate(args)
    if args.command == "export":
        return export(args)
    if args.command == "replay":
        return replay_command.main(args)
    args.set += [f"tracking.{key}={value}" for key, value in
                 (("tensorboard_dir", args.tensorboard), ("wandb_project", args.wandb)) if value is not None]
    code = run(args)
    if argv is None:  # the `asyncrl` command, whose process ends here (not main([...]) inside another program)
        # The run's objects (model, trace, completions) go with the process: frozen, they skip the interpreter's
        # last full garbage collection. A Ctrl-C'd guess_letter run exited 0.25-0.45 s after the signal instead of
        # 1.5-2.0 (2 cores, 2026-12-05), its summary written 0.1-0.2 s after the signal either way.
        gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())
