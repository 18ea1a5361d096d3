"""Every command the README and docs show is run: the configuration each one uses is loaded with its ``--set``s,
and the ones that run on CPU are run for one step.

Found in ``README.md``, ``benchmarks/README.md`` and ``docs/*.md``:
- ``asyncrl run|simulate CONFIG ...`` lines of fenced shell blocks (``.venv/bin/asyncrl`` too; ``\\`` continues a
  line): parsed by the CLI's own argument parser, the config loaded, and on CPU run with ``--steps 1`` into a
  temporary ``--out`` (the command's other options kept);
- ``python benchmarks/X.py --preset P --set K=V`` lines: the preset loaded with those overrides;
- ``load_config(...)`` calls in fenced Python blocks and in inline code: loaded, and on CPU built and ticked once.
A command that needs a GPU (vLLM, Megatron on CUDA) is loaded only.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

from asyncrl import Controller, cli, load_config
from asyncrl.cli import parse_overrides

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
CPU_BACKENDS = {"torch", "simulated"}


def _shell_lines(body: str):
    for line in body.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            yield line


def commands() -> list[tuple[str, str, list[str]]]:
    """(where, kind, argv): kind ``cli`` (argv after ``asyncrl``), ``bench`` (argv after the script) or ``python``
    (argv is the source of one load_config call)."""
    found = []
    for path in DOCS:
        text, where = path.read_text(), path.relative_to(ROOT).as_posix()
        for lang, body in FENCE.findall(text):
            if lang in ("bash", "sh", "shell", ""):
                for line in _shell_lines(body):
                    argv = shlex.split(line)
                    for i, word in enumerate(argv):
                        if word.endswith("asyncrl") and i + 1 < len(argv) and argv[i + 1] in ("run", "simulate"):
                            found.append((f"{where}: {line}", "cli", argv[i + 1:]))
                            break
                        if word.startswith("benchmarks/") and word.endswith(".py") and "--preset" in argv:
                            found.append((f"{where}: {line}", "bench", argv[i + 1:]))
                            break
            if lang == "python":
                found += [(f"{where}: {src}", "python", [src]) for src in _load_config_calls(body)]
        for span in re.findall(r"`(load_config\([^`]*\))`", text):
            found += [(f"{where}: {src}", "python", [src]) for src in _load_config_calls(span)]
    return found


def _load_config_calls(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "load_config"]


def _literal_call(src: str) -> tuple[list, dict]:
    call = ast.parse(src, mode="eval").body
    return [ast.literal_eval(a) for a in call.args], {k.arg: ast.literal_eval(k.value) for k in call.keywords}


def on_cpu(cfg) -> bool:
    parts = (cfg.generation, cfg.trainer)
    return all(p.backend in CPU_BACKENDS and str(p.device) == "cpu" for p in parts)


COMMANDS = commands()


def test_the_docs_show_commands_and_every_fixed_one_is_here():
    kinds = [kind for _, kind, _ in COMMANDS]
    assert kinds.count("cli") >= 5 and kinds.count("python") >= 2 and kinds.count("bench") >= 1, COMMANDS
    wheres = " ".join(where for where, _, _ in COMMANDS)
    assert "docs/cluster.md: asyncrl run gpu_two_devices" in wheres  # the one configuration refused before


# A command placing its backends in Ray actors starts a Ray and an interpreter per actor, each importing torch: about
# a minute for docs/cluster.md's four on 2 cores, already at one step. Marked slow (CI still runs it).
PARAMS = [pytest.param(where, kind, argv, id=where[:90], marks=[pytest.mark.slow] if "placement=ray" in where else [])
          for where, kind, argv in COMMANDS]


@pytest.mark.parametrize("where, kind, argv", PARAMS)
def test_documented_command_loads_and_runs_a_step_on_cpu(where, kind, argv, tmp_path, monkeypatch):
    if kind == "python":
        args, kwargs = _literal_call(argv[0])
        cfg = load_config(*args, **kwargs)
        if on_cpu(cfg):
            ctrl = Controller.from_config(cfg)
            while ctrl.trainer_version < 1:
                ctrl.tick()
            ctrl.close()
        return
    if kind == "bench":
        preset = argv[argv.index("--preset") + 1]
        sets = [argv[i + 1] for i, word in enumerate(argv) if word == "--set"]
        load_config(preset, **parse_overrides(sets))
        return
    seen = {}
    monkeypatch.setattr(cli, "run", lambda args: seen.setdefault("args", args) and 0)
    monkeypatch.setattr(cli, "simulate", lambda args: seen.setdefault("args", args) and 0)
    cli.main(argv)  # the CLI's own parser: a usage error is SystemExit here, as for the user
    args = seen["args"]
    cfg = load_config(args.config, **parse_overrides(args.set))
    if not on_cpu(cfg):
        return
    args.steps, args.out, args.no_plot = 1, str(tmp_path / "out"), True
    if args.command == "run":
        args.quiet, args.resume, args.checkpoint_every = True, None, None
    monkeypatch.undo()
    ray_before = _ray_running()
    try:
        code = (cli.simulate if args.command == "simulate" else cli.run)(args)
    finally:
        if not ray_before and _ray_running():  # a Ray-placed command started Ray: leave none behind
            import ray

            ray.shutdown()
    assert code == 0, where
    written = {f.name for f in (tmp_path / "out").iterdir()}
    assert written & {"metrics.csv", "sweep.csv"}, written  # a run's files, or a sweep's (simulate --sweep/--gpus)


def _ray_running() -> bool:
    import sys

    return "ray" in sys.modules and sys.modules["ray"].is_initialized()
