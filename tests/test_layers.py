"""The package's layers point one way: every import (lazy ones inside functions included) goes to a lower layer,
no module takes part in an import cycle, no engine imports another engine, and no package file grows past 600
lines. Imports are read from the source with ``ast``, so nothing is imported to check them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lower = lower layer, listed bottom up. A module may import only from lower layers (or from its own family).
TIERS = [
    # the data that crosses the Protocols, the metric and trace vocabularies, the tokenizer: import nothing
    ["asyncrl.data", "asyncrl.metrics", "asyncrl.trace", "asyncrl.tokenizer", "asyncrl.sorted_ids",
     "asyncrl.tracking"],
    ["asyncrl.buffer", "asyncrl.faults"],  # the replay buffer; fault bookkeeping (the controller mixes it in)
    ["asyncrl.samplers"],  # and its submodules (one family)
    ["asyncrl.algorithms"],  # GRPO maths and the Loss: data and metrics only, never the backends
    ["asyncrl.tasks"],  # prompts, rewards, evaluation: the config checks a task's options by building it
    ["asyncrl.config"],
    # what the engines share: the Protocols, HF helpers, placements, Megatron's weight map and process groups
    ["asyncrl.backends.base", "asyncrl.backends.hf", "asyncrl.backends.ray", "asyncrl.backends.process",
     "asyncrl.backends.megatron_weights", "asyncrl.backends.megatron_parallel", "asyncrl.backends.device_lock",
     "asyncrl.backends.data_parallel"],
    # engines (any other asyncrl.backends.* module counts as one) and the weight sync between two of them
    ["asyncrl.backends.torch", "asyncrl.backends.megatron", "asyncrl.backends.vllm", "asyncrl.backends.simulated",
     "asyncrl.backends.weight_sync", "asyncrl.backends.replicas", "asyncrl.backends.ranks"],
    ["asyncrl.backends"],  # the registry: build_backends picks engines by name
    ["asyncrl.reports"],  # what a tick did and the state snapshot: the controller's read API types
    ["asyncrl.run_loop", "asyncrl.checkpoint"],  # the background run and the checkpoint format the controller uses
    ["asyncrl.controller"],
    ["asyncrl.simulate_plots"],
    ["asyncrl.simulate"],  # drives a controller on the simulated backends
    ["asyncrl.cli"],
]
LAYERS = {module: layer for layer, modules in enumerate(TIERS) for module in modules}
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


def _imports(module: str) -> set[str]:
    """asyncrl modules ``module`` imports anywhere in its source, and the packages such an import loads first
    (importing ``asyncrl.backends.x`` from outside ``asyncrl.backends`` runs ``asyncrl/backends/__init__.py``)."""
    out = set()
    tree = ast.parse(MODULES[module].read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
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


def _layer(module: str) -> int | None:
    if module in LAYERS:
        return LAYERS[module]
    if module.startswith("asyncrl.samplers."):
        return LAYERS["asyncrl.samplers"]
    if module.startswith("asyncrl.backends."):
        return ENGINE
    return None  # a new top-level module: only the cycle check applies until it is given a layer


def _family(module: str) -> str:
    if module.startswith("asyncrl.samplers"):
        return "asyncrl.samplers"
    return module


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
    import networkx as nx

    graph = nx.DiGraph([(m, t) for m, targets in GRAPH.items() for t in targets])
    assert list(nx.simple_cycles(graph)) == []


def test_the_checks_see_the_imports_they_judge():
    # The rules above are only as good as the parsing: spot-check edges that exist, lazy ones included.
    assert "asyncrl.data" in GRAPH["asyncrl.algorithms"]
    assert "asyncrl.backends.hf" in GRAPH["asyncrl.backends.vllm"]
    assert "asyncrl.backends" in GRAPH["asyncrl.controller"]  # imported inside from_config
    assert "asyncrl.backends.ray" in GRAPH["asyncrl.backends.weight_sync"]


@pytest.mark.parametrize("package", ["asyncrl", "widgets"])
def test_no_package_file_over_600_lines(package):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / package).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long
