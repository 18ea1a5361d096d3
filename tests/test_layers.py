"""The package's layers point one way: every import (lazy ones inside functions included) goes to a lower layer,
no module takes part in an import cycle (``if TYPE_CHECKING:`` imports count: the tie they make is real), no engine
imports another engine, no module outside ``asyncrl/controller.py`` reads or writes the controller's private state,
and no package file grows past 600 lines. Source is read with ``ast``, so nothing is imported to check it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lower = lower layer, listed bottom up. A module may import only from lower layers (or from its own family).
TIERS = [
    # the data that crosses the Protocols, the metric and trace vocabularies, the tokenizer: import nothing
    ["asyncrl.data", "asyncrl.metrics", "asyncrl.trace", "asyncrl.tokenizer", "asyncrl.sorted_ids",
     "asyncrl.tracking", "asyncrl.strict", "asyncrl.prompts"],  # strict: the strict base model and int check
    # configs and samplers share; prompts: the Prompt and the stream that serves prompts by data position
    ["asyncrl.buffer", "asyncrl.faults"],  # the replay buffer; fault budgets (a collaborator of the controller)
    ["asyncrl.state"],  # the run state the controller owns, and its typed events
    ["asyncrl.samplers"],  # and its submodules (one family)
    # GRPO maths and the Loss; how engines cut a chunk into micro-batches: data and metrics only, never the backends
    ["asyncrl.algorithms", "asyncrl.micro_batches"],
    ["asyncrl.chat", "asyncrl.datasets"],  # prompts as the model sees them (chat templates); tables read as prompts
    # reward functions (TRL's signature), the built-ins and the runner that scores off the pump: no task, no torch
    ["asyncrl.rewards"],  # and its submodules (one family)
    ["asyncrl.countdown"],  # a generated dataset task, scored by the countdown verifier
    ["asyncrl.tasks"],  # prompts, rewards, evaluation: the config checks a task's options by building it
    ["asyncrl.config"],  # and its submodules (one family): a module per section, Config in the package
    # the backend Protocols and Capabilities; the submit/poll/abort queue of generators that generate on poll
    ["asyncrl.backends.base", "asyncrl.backends.submit_queue"],
    # what the engines share: HF helpers, placements, Megatron's weight map and process groups, torch decoding
    ["asyncrl.backends.hf", "asyncrl.backends.ray", "asyncrl.backends.process",
     "asyncrl.backends.megatron_weights", "asyncrl.backends.megatron_parallel", "asyncrl.backends.device_lock",
     "asyncrl.backends.data_parallel", "asyncrl.backends.sampling", "asyncrl.backends.torch_decode"],
    # how the vLLM engine is built (the HF model directory it loads), a group's requests, weights into it
    ["asyncrl.backends.vllm_build", "asyncrl.backends.vllm_requests", "asyncrl.backends.vllm_weights"],
    # engines (any other asyncrl.backends.* module counts as one) and the weight sync between two of them
    ["asyncrl.backends.torch", "asyncrl.backends.megatron", "asyncrl.backends.vllm", "asyncrl.backends.simulated",
     "asyncrl.backends.weight_sync", "asyncrl.backends.replicas", "asyncrl.backends.ranks"],
    ["asyncrl.backends"],  # the registry: build_backends picks engines by name
    ["asyncrl.reports"],  # what a tick did and the state snapshot: the controller's read API types
    # the rollout pump, the background run and the checkpoint format the controller uses
    ["asyncrl.rollout", "asyncrl.run_loop", "asyncrl.checkpoint"],
    ["asyncrl.controller"],
    ["asyncrl.simulate_plots"],
    # drives a controller on the simulated backends: the loop, the studies built on it, a fit to a real run
    ["asyncrl.simulate.simulation"], ["asyncrl.simulate.studies"], ["asyncrl.simulate.calibration"],
    ["asyncrl.simulate"],
    # a recording replayed under another sampler: what it reads of a recording, the latency fit, the generator
    # serving recorded completions, one replay, several side by side (and their figure), the package's lazy names
    ["asyncrl.replay.recorded"], ["asyncrl.replay.latency", "asyncrl.replay.generator"], ["asyncrl.replay.replayed"],
    ["asyncrl.replay.figure"], ["asyncrl.replay.comparison"], ["asyncrl.replay"],
    ["asyncrl.recording", "asyncrl.remote"],  # a run read back (its files or a live controller); a live run's socket
    ["asyncrl.replay.command"],  # ``asyncrl replay``: opens a recording, compares
    ["asyncrl.cli"],
]
LAYERS = {module: layer for layer, modules in enumerate(TIERS) for module in modules}
# Packages whose submodules are one family: they share the package's layer and may import one another.
FAMILIES = ("asyncrl.samplers", "asyncrl.config", "asyncrl.rewards")
ENGINE = LAYERS["asyncrl.backends.torch"]
# They connect or multiply engines' actors (K replicas / R ranks as one backend); they import none.
NOT_ENGINES = {"asyncrl.backends.weight_sync", "asyncrl.backends.replicas", "asyncrl.backends.ranks"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "asyncrl").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The asyncrl module an import of ``name`` loads (``pkg.mod.attr`` -> ``pkg.mod``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, typing: bool = False) -> set[str]:
    """asyncrl modules ``module`` imports anywhere in its source, and the packages such an import loads first
    (importing ``asyncrl.backends.x`` from outside ``asyncrl.backends`` runs ``asyncrl/backends/__init__.py``).
    ``typing``: also those imported only ``if TYPE_CHECKING:``."""
    out = set()
    tree = ast.parse(MODULES[module].read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only and not typing:
            continue  # ``if TYPE_CHECKING:`` imports are for annotations, not run-time dependencies
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            target = _owner(name) if name.startswith("asyncrl") else None
            if target is None or target == module:
                continue
            out.add(target)
            package = target.rpartition(".")[0]
            while package.count(".") >= 1 and not module.startswith(package + ".") and module != package:
                out.add(package)
                package = package.rpartition(".")[0]
    out.discard("asyncrl")  # asyncrl/__init__.py imports nothing at import time
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


GRAPH = {m: _imports(m) for m in MODULES}
TYPED_GRAPH = {m: _imports(m, typing=True) for m in MODULES}  # with the ``if TYPE_CHECKING:`` imports


def _layer(module: str) -> int | None:
    if module in LAYERS:
        return LAYERS[module]
    for family in FAMILIES:
        if module.startswith(family + "."):
            return LAYERS[family]
    if module.startswith("asyncrl.backends."):
        return ENGINE
    return None  # a new top-level module: only the cycle check applies until it is given a layer


def _family(module: str) -> str:
    return next((f for f in FAMILIES if module == f or module.startswith(f + ".")), module)


def test_every_import_points_down():
    upward = []
    for module, targets in GRAPH.items():
        for target in targets:
            a, b = _layer(module), _layer(target)
            if a is None or b is None or _family(module) == _family(target):
                continue
            if b >= a:
                upward.append(f"{module} (layer {a}) imports {target} (layer {b})")
    assert not upward, "imports that do not point down:\n" + "\n".join(sorted(upward))


def test_no_engine_imports_another():
    engines = {m for m in MODULES if _layer(m) == ENGINE and m not in NOT_ENGINES}
    crossing = sorted(f"{m} imports {t}" for m in engines for t in GRAPH[m] & engines)
    assert not crossing, crossing


def test_no_import_cycles():
    """Type-only imports count: a cycle through ``if TYPE_CHECKING:`` is two modules that know each other."""
    import networkx as nx

    graph = nx.DiGraph([(m, t) for m, targets in TYPED_GRAPH.items() for t in targets])
    assert list(nx.simple_cycles(graph)) == []


CONTROLLER = ROOT / "asyncrl" / "controller.py"
# Everything outside the controller that could reach into it: the package, the widgets, benchmarks and examples.
OUTSIDE = [p for d in ("asyncrl", "widgets", "benchmarks", "examples") for p in sorted((ROOT / d).rglob("*.py"))
           if p != CONTROLLER]


def _controller_privates() -> set[str]:
    """The private names of ``Controller``: its ``_methods`` and every ``self._attribute`` it (or a class it
    derives from) sets."""
    tree = ast.parse(CONTROLLER.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Controller")
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
              and n.value.id == "self"}
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_reads(source: str, where: str, privates: set[str]) -> list[str]:
    """``x._name`` where ``_name`` is one of the controller's privates and ``x`` is not ``self``/``cls``."""
    return [f"{where}:{n.lineno}: {ast.unparse(n)}" for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Attribute) and n.attr in privates
            and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))]


def test_nothing_outside_the_controller_touches_its_private_state():
    privates = _controller_privates()
    found = [hit for path in OUTSIDE for hit in _private_reads(path.read_text(), str(path.relative_to(ROOT)), privates)]
    assert not found, "private controller state used outside asyncrl/controller.py:\n" + "\n".join(found)


def test_the_private_state_check_sees_what_it_judges():
    privates = _controller_privates()
    assert {"_state", "_lock", "_step", "_run"} <= privates
    source = "def f(ctrl):\n    ctrl._state.trace.append(1)\n    return self._step, ctrl.trace\n"
    assert _private_reads(source, "probe.py", privates) == ["probe.py:2: ctrl._state"]


def test_the_checks_see_the_imports_they_judge():
    # The rules above are only as good as the parsing: spot-check edges that exist, lazy ones included.
    assert "asyncrl.data" in GRAPH["asyncrl.algorithms"]
    assert "asyncrl.backends.hf" in GRAPH["asyncrl.backends.vllm_build"]
    assert "asyncrl.backends" in GRAPH["asyncrl.controller"]  # imported inside from_config
    assert "asyncrl.backends.ray" in GRAPH["asyncrl.backends.weight_sync"]


@pytest.mark.parametrize("package", ["asyncrl", "widgets"])
def test_no_package_file_over_600_lines(package):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / package).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long
