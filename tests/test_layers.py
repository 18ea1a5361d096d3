"""The package's layers point one way: every import (lazy ones inside functions included) goes to a lower layer,
no module takes part in an import cycle (``if TYPE_CHECKING:`` imports count: the tie they make is real), no engine
imports another engine, no module outside ``asyncrl/controller.py`` reads or writes the controller's private state,
no part of the controller (a pump, the checkpoint format, anything below it) holds the controller to reach its
state, no package file grows past 510 lines (85% of the 600-line cap, so the next knob has room), and nothing asks
with ``isinstance`` what a backend or sampler may do beyond its Protocol (that is declared). Source is read with ``ast``, so nothing is imported to check it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lower = lower layer, listed bottom up. A module may import only from lower layers (or from its own family).
TIERS = [
    ["asyncrl.run_dir"],  # a run directory's files written whole, or one error naming the file: imports nothing
    # the data that crosses the Protocols, the metric and trace vocabularies, the tokenizer: import nothing
    ["asyncrl.data", "asyncrl.metrics", "asyncrl.trace", "asyncrl.tokenizer", "asyncrl.sorted_ids",
     "asyncrl.tracking", "asyncrl.strict", "asyncrl.prompts", "asyncrl.completions"],  # strict: the strict base
    # model and int check configs and samplers share; prompts: the Prompt and the stream that serves prompts by data
    # position; completions: the completions log (what the model wrote)
    ["asyncrl.buffer", "asyncrl.faults", "asyncrl.uniform_groups"],  # the replay buffer; fault budgets (a
    # collaborator of the controller); filter_uniform_groups' skips and streak
    ["asyncrl.state"],  # the run state the controller owns, and its typed events
    ["asyncrl.samplers"],  # and its submodules (one family)
    # token logprobs and entropy from logits, or from hidden states a chunk of the output layer at a time: torch only
    ["asyncrl.logprobs"],
    # GRPO maths and the Loss; how engines cut a chunk into micro-batches: data and metrics only, never the backends
    ["asyncrl.algorithms", "asyncrl.micro_batches"],
    ["asyncrl.chat", "asyncrl.datasets"],  # prompts as the model sees them (chat templates); tables read as prompts
    # reward functions (TRL's signature), the built-ins and the runner that scores off the pump: no task, no torch
    ["asyncrl.rewards"],  # and its submodules (one family)
    ["asyncrl.environments"],  # and its submodules (one family): environment classes, their workers, the config
    ["asyncrl.countdown"],  # a generated dataset task, scored by the countdown verifier
    ["asyncrl.tasks"],  # prompts, rewards, evaluation: the config checks a task's options by building it
    ["asyncrl.config"],  # and its submodules (one family): a module per section, Config in the package
    # the backend Protocols and Capabilities; the submit/poll/abort queue of generators that generate on poll
    ["asyncrl.backends.base", "asyncrl.backends.submit_queue"],
    # what the engines share: HF helpers, placements, Megatron's weight map, process groups and forward, torch
    # decoding, the simulated generator's clock, replica timelines and turns model, Megatron's optimizer step
    ["asyncrl.backends.hf", "asyncrl.backends.ray", "asyncrl.backends.process",
     "asyncrl.backends.megatron_weights", "asyncrl.backends.megatron_parallel", "asyncrl.backends.megatron_forward",
     "asyncrl.backends.megatron_step",
     "asyncrl.backends.device_lock",
     "asyncrl.backends.data_parallel", "asyncrl.backends.sampling", "asyncrl.backends.torch_decode",
     "asyncrl.backends.lr_schedule", "asyncrl.backends.simulated_timeline", "asyncrl.backends.simulated_turns",
     "asyncrl.backends.lora"],
    # how the vLLM engine is built (the HF model directory it loads), a group's requests, weights into it, LoRA
    # adapters in it
    ["asyncrl.backends.vllm_build", "asyncrl.backends.vllm_requests", "asyncrl.backends.vllm_weights",
     "asyncrl.backends.vllm_lora"],
    # engines (any other asyncrl.backends.* module counts as one) and the weight sync between two of them
    ["asyncrl.backends.torch", "asyncrl.backends.megatron", "asyncrl.backends.vllm", "asyncrl.backends.simulated",
     "asyncrl.backends.weight_sync", "asyncrl.backends.replicas", "asyncrl.backends.ranks"],
    ["asyncrl.backends"],  # the registry: build_backends picks engines by name
    ["asyncrl.evaluation"],  # evaluation on a split: n samples a prompt (a generator's capability), mean@n, pass@n
    ["asyncrl.parts"],  # the controller's parts, fixed at construction
    ["asyncrl.reports"],  # what a tick did and the state snapshot: the controller's read API types
    ["asyncrl.read_view"],  # the read API as a Protocol, and the one computation of explain() and state()
    # the two pumps, the background run and the checkpoint format the controller uses (the train pump knows the
    # rollout pump only as the part it is handed: a type, imported ``if TYPE_CHECKING:``)
    ["asyncrl.pump_threads"],  # torch threads per pump thread and the OpenMP pool release (CPU runs)
    ["asyncrl.turns"],  # multi-turn rollouts: a generation backend over the run's generator
    ["asyncrl.turn_hooks"],  # the rollout pump's side of turns (trace, turn-boundary aborts, failed trajectories)
    ["asyncrl.rollout", "asyncrl.train", "asyncrl.run_loop", "asyncrl.checkpoint"],
    # a checkpoint read back for less than a run: export (the policy alone), what a restore must be given
    ["asyncrl.restoring"],
    ["asyncrl.multiturn"],  # wiring an environment into a controller
    ["asyncrl.controller"],
    ["asyncrl.run_files"],  # a run directory written live (trace, metrics, the step index)
    ["asyncrl.plots"],  # and its submodules (one family): figures and tables from the read API, no ipywidgets
    # drives a controller on the simulated backends: the loop, the studies built on it, a fit to a real run
    ["asyncrl.simulate.simulation"], ["asyncrl.simulate.studies"], ["asyncrl.simulate.calibration"],
    ["asyncrl.simulate"],
    # a recording replayed under another sampler: what it reads of a recording, the latency fit, the generator
    # serving recorded completions, one replay, several side by side, the package's lazy names (the figure of a
    # comparison is asyncrl.plots.comparison)
    ["asyncrl.replay.recorded"], ["asyncrl.replay.latency", "asyncrl.replay.generator"], ["asyncrl.replay.replayed"],
    ["asyncrl.replay.comparison"], ["asyncrl.replay"],
    ["asyncrl.recording", "asyncrl.remote"],  # a run read back (its files or a live controller); a live run's socket
    ["asyncrl.replay.command"],  # ``asyncrl replay``: opens a recording, compares
    ["asyncrl.run_endings"],  # how ``asyncrl run`` ends early: signals at a safe point, a failure's line and error.log
    ["asyncrl.cli"],
    ["widgets"],  # the notebook package (and its modules): on top, nothing in asyncrl imports it
]
LAYERS = {module: layer for layer, modules in enumerate(TIERS) for module in modules}
# Packages whose submodules are one family: they share the package's layer and may import one another.
FAMILIES = ("asyncrl.samplers", "asyncrl.config", "asyncrl.rewards", "asyncrl.environments", "asyncrl.plots", "widgets")
PACKAGES = ("asyncrl", "widgets")  # scanned: the package and the notebook views
ENGINE = LAYERS["asyncrl.backends.torch"]
# They connect or multiply engines' actors (K replicas / R ranks as one backend); they import none.
NOT_ENGINES = {"asyncrl.backends.weight_sync", "asyncrl.backends.replicas", "asyncrl.backends.ranks"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
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
            target = _owner(name) if name.split(".")[0] in PACKAGES else None
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
    assert {"_state", "_lock", "_train", "_run"} <= privates
    source = "def f(ctrl):\n    ctrl._state.trace.append(1)\n    return self._step, ctrl.trace\n"
    assert _private_reads(source, "probe.py", privates) == ["probe.py:2: ctrl._state"]


# A part of the controller is built from the parts it uses, named in its signature; it never holds the controller
# (``RolloutPump(ctrl)`` reading ``ctrl.buffer``, ``ctrl.capacity``, ... ) nor is handed it to call back into
# (``checkpoint.save(ctrl)`` calling ``ctrl.state_dict()``, ``restore(cls)`` calling ``cls.from_config``). The names
# that hold a controller: a parameter, variable or attribute called ``ctrl``/``controller``, and a parameter
# annotated ``Controller``. The run loop is the one exception: it drives a controller as a notebook
# does, so it may hold one, and use only what every driver may (the hand ticks and the public read API).
HOLDERS = {"ctrl", "controller", "_ctrl", "_controller"}
DRIVER = "asyncrl.run_loop"
DRIVER_API = {"rollout_tick", "train_tick", "changed", "num_events", "trainer_version", "exhausted", "inflight",
              "buffer", "capacity", "metrics", "explain", "drain", "clock", "subscribe", "lockstep", "cfg"}
PARTS = [m for m in MODULES if (_layer(m) or 0) < LAYERS["asyncrl.controller"]]


def _holds_controller(arg: ast.arg) -> bool:
    annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
    return arg.arg in HOLDERS or re.search(r"\bController\b", annotation) is not None


def _held(node: ast.AST) -> bool:
    """``ctrl`` or ``self.ctrl``: an expression that holds the controller."""
    return (isinstance(node, ast.Name) and node.id in HOLDERS) or (
        isinstance(node, ast.Attribute) and node.attr in HOLDERS and isinstance(node.value, ast.Name)
        and node.value.id == "self")


def _back_references(source: str, where: str, driver: bool = False) -> list[str]:
    """Where a module below the controller holds it: every parameter or ``self`` attribute that does (a part), or
    (``driver``) every use of one beyond ``DRIVER_API``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if driver:
            if isinstance(node, ast.Attribute) and _held(node.value) and node.attr not in DRIVER_API:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)} (not a driver's: {sorted(DRIVER_API)})")
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                if _holds_controller(arg):
                    found.append(f"{where}:{node.lineno}: takes the controller as {arg.arg!r}")
        elif isinstance(node, (ast.Attribute, ast.Name)) and isinstance(node.ctx, ast.Store) and _held(node):
            found.append(f"{where}:{node.lineno}: keeps the controller as {ast.unparse(node)}")
    return found


def test_no_part_of_the_controller_holds_the_controller():
    found = [hit for m in PARTS for hit in _back_references(MODULES[m].read_text(), str(MODULES[m].relative_to(ROOT)),
                                                            driver=m == DRIVER)]
    assert not found, "parts below the controller reaching it through a back-reference:\n" + "\n".join(found)


def test_the_back_reference_check_sees_what_it_judges():
    assert {"asyncrl.rollout", "asyncrl.train", "asyncrl.checkpoint", "asyncrl.buffer", "asyncrl.state"} <= set(PARTS)
    pump = ("class RolloutPump:\n"  # the rollout pump before issue 30: handed the controller, reading its parts
            "    def __init__(self, ctrl: Any, state, faults):\n"
            "        self.ctrl, self.state, self.faults = ctrl, state, faults\n"
            "    def _no_room(self):\n"
            "        return len(self.ctrl.buffer) + 1 > self.ctrl.capacity\n")
    assert _back_references(pump, "probe.py") == ["probe.py:2: takes the controller as 'ctrl'",
                                                  "probe.py:3: keeps the controller as self.ctrl"]
    checkpoint = ("def save(ctrl: Any, path):\n"  # checkpoint.py before: calling back into what it was handed
                  "    return write(path, ctrl.state_dict())\n"
                  "def restore(cls: type, path):\n"
                  "    ctrl = cls.from_config(read(path))\n"
                  "    ctrl.load_state_dict(state_dict(path))\n")
    assert _back_references(checkpoint, "probe.py") == ["probe.py:1: takes the controller as 'ctrl'",
                                                        "probe.py:4: keeps the controller as ctrl"]
    typed = ("def periodic(owner: 'Controller', directory):\n    return owner.save(directory)\n"
             "def encode(state: ControllerState):\n    return state.buffer\n")  # a snapshot type is no controller
    assert _back_references(typed, "probe.py") == ["probe.py:1: takes the controller as 'owner'"]
    parts = ("class TrainPump:\n    def __init__(self, cfg, buffer, sampler, rollout):\n"
             "        self.buffer, self.rollout = buffer, rollout\n"
             "def save(path, config: dict, state: dict):\n    return write(path, config, state)\n")
    assert _back_references(parts, "probe.py") == []  # handed its parts, not their owner
    driver = ("class RunHandle:\n    def __init__(self, ctrl):\n        self.ctrl = ctrl\n"
              "    def go(self):\n        self.ctrl.rollout_tick()\n        return self.ctrl.sampler.admit(0)\n")
    assert [hit.split(" (")[0] for hit in _back_references(driver, "probe.py", driver=True)] == [
        "probe.py:6: self.ctrl.sampler"]


def test_the_checks_see_the_imports_they_judge():
    # The rules above are only as good as the parsing: spot-check edges that exist, lazy ones included.
    assert "asyncrl.data" in GRAPH["asyncrl.algorithms"]
    assert "asyncrl.backends.hf" in GRAPH["asyncrl.backends.vllm_build"]
    assert "asyncrl.backends" in GRAPH["asyncrl.controller"]  # imported inside from_config
    assert "asyncrl.backends.ray" in GRAPH["asyncrl.backends.weight_sync"]


LINE_CAP = 600  # a file near it has no room left: placement starts to follow the counter instead of the meaning


@pytest.mark.parametrize("package", ["asyncrl", "widgets"])
def test_no_package_file_over_85_percent_of_the_600_line_cap(package):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / package).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > LINE_CAP * 85 // 100}
    assert not long, long


# ------------------------------------------------------------------------ the notebook package stays on top
def _widgets_imports(source: str, where: str) -> list[str]:
    """Every import of the ``widgets`` package in ``source`` (lazy ones inside functions, ``import_module``)."""
    hits = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            names = [n.module]
        elif isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", None)) == "import_module":
            names = [a.value for a in n.args[:1] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        else:
            continue
        hits += [f"{where}:{n.lineno}: {ast.unparse(n)}" for name in names if name.split(".")[0] == "widgets"]
    return hits


def test_no_asyncrl_module_imports_widgets():
    """``asyncrl`` imports without Jupyter packages, and its CLI draws with ``asyncrl.plots``: nothing in it may
    reach the notebook package, not even lazily."""
    probe = "def _plot(ctrl):\n    from widgets.render import draw_reward\n    import widgets\n"
    assert _widgets_imports(probe, "probe.py") == ["probe.py:2: from widgets.render import draw_reward",
                                                   "probe.py:3: import widgets"]
    found = [hit for path in sorted((ROOT / "asyncrl").rglob("*.py"))
             for hit in _widgets_imports(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "asyncrl imports the notebook package:\n" + "\n".join(found)


def test_the_widgets_are_scanned_like_the_package():
    assert {"widgets", "widgets.render", "widgets.views"} <= set(MODULES)
    assert "asyncrl.plots" in GRAPH["widgets.views"] and "asyncrl.trace" in GRAPH["widgets.views"]
    assert _layer("widgets.views") == LAYERS["widgets"] > LAYERS["asyncrl.cli"]


# ------------------------------------------------------------- the trace's words are for people, not parsers
WORDS = {"reason", "detail"}  # the trace's text columns: they may be reworded; the numbers are typed columns
REGEX_CALLS = {"search", "match", "fullmatch", "findall", "finditer", "sub", "subn", "split"}
SPLITS = {"split", "rsplit", "partition", "rpartition"}
PANDAS_STR = {"extract", "extractall", "match", "fullmatch", "contains", "findall", "replace", "split", "rsplit"}


def _is_words(node: ast.expr) -> bool:
    """``row.reason``, ``trace.detail``, ``row["reason"]``."""
    if isinstance(node, ast.Attribute):
        return node.attr in WORDS
    return (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
            and node.slice.value in WORDS)


def _parsed_words(source: str, where: str) -> list[str]:
    """Where ``source`` parses a trace reason or detail: a regex applied to one (``re.search(p, row.reason)``,
    ``PATTERN.search(row.reason)``), one split into pieces (``row.detail.rsplit(" ", 1)``), a pandas string
    method on one (``trace.reason.str.extract(...)``), or any ``re.compile`` in a module that reads trace rows (it
    imports ``asyncrl.trace``)."""
    tree = ast.parse(source)
    reads_trace = any(isinstance(n, ast.ImportFrom) and n.module == "asyncrl.trace"
                      or isinstance(n, ast.Import) and any(a.name == "asyncrl.trace" for a in n.names)
                      for n in ast.walk(tree))
    hits = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
            continue
        f = n.func
        if ((f.attr in REGEX_CALLS and any(_is_words(a) for a in n.args))
                or (f.attr in SPLITS and _is_words(f.value))
                or (f.attr in PANDAS_STR and isinstance(f.value, ast.Attribute) and f.value.attr == "str"
                    and _is_words(f.value.value))
                or (reads_trace and f.attr == "compile" and isinstance(f.value, ast.Name) and f.value.id == "re")):
            hits.append((n.lineno, f"{where}:{n.lineno}: {ast.unparse(n)}"))
    return [hit for _, hit in sorted(hits)]


def test_no_trace_reason_or_detail_is_parsed():
    """Replay reads ``gen_start_version``, ``gen_end_version``, ``replica`` and ``dispatch_index``, never the words
    of a reason: rewording a reason must not break anything."""
    probe = (  # how asyncrl/recording.py read a commit's versions and replica, and an admit's batch, before
        "import re\n"
        "from asyncrl.trace import COMMIT\n"
        "_REPLICA = re.compile(r' on replica (\\d+)$')\n"
        "_GENERATED = re.compile(r'generated with weights (\\d+)\\.\\.(\\d+)')\n"
        "def slot(row, trace):\n"
        "    generated = _GENERATED.search(row.reason)\n"
        "    replica = re.search(r'replica (\\d+)', row['reason'])\n"
        "    batch = int(row.detail.rsplit(' ', 1)[-1])\n"
        "    ends = trace.reason.str.extract(r'weights \\d+\\.\\.(\\d+)')\n"
        "    return row.gen_end_version, row.replica, row.reason[:90], row.reason.startswith('retried:')\n"
    )
    assert [hit.split(":")[1] for hit in _parsed_words(probe, "probe.py")] == ["3", "4", "6", "7", "8", "9"]
    assert _parsed_words(probe.replace("from asyncrl.trace import COMMIT\n", ""), "p.py")[0].startswith("p.py:5:")
    found = [hit for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             for hit in _parsed_words(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "trace words parsed (read the typed columns instead):\n" + "\n".join(found)


# ------------------------------------------------- optional capabilities are declared, not probed with isinstance
# The Protocols an object is checked against because it must be one (the two a backend implements, and the
# sampler's). Anything optional is a declaration with a default: ``Capabilities`` for backends (read with
# ``asyncrl.backends.base.capabilities``), ``SamplerBase``'s class attributes for samplers.
CHECKED_PROTOCOLS = {"GenerationBackend", "PolicyBackend", "PromptGroupSampler"}


def _runtime_protocols(source: str) -> set[str]:
    """Names of the ``@runtime_checkable`` Protocols ``source`` defines."""
    return {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)
            and any(getattr(d, "attr", getattr(d, "id", None)) == "runtime_checkable" for d in n.decorator_list)
            and any(getattr(b, "attr", getattr(b, "id", None)) == "Protocol" for b in n.bases)}


def _capability_probes(source: str, where: str, protocols: set[str]) -> list[str]:
    """Each ``isinstance(x, P)`` / ``issubclass(x, P)`` in ``source`` (``P`` a name, ``module.P`` or one of a tuple)
    where ``P`` is one of ``protocols`` but none of ``CHECKED_PROTOCOLS``."""
    hits = []
    for n in ast.walk(ast.parse(source)):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("isinstance", "issubclass")
                and len(n.args) == 2):
            continue
        kinds = n.args[1].elts if isinstance(n.args[1], ast.Tuple) else [n.args[1]]
        names = {getattr(k, "attr", getattr(k, "id", None)) for k in kinds}
        if names & (protocols - CHECKED_PROTOCOLS):
            hits.append((n.lineno, f"{where}:{n.lineno}: {ast.unparse(n)}"))
    return [hit for _, hit in sorted(hits)]


SOURCES = {str(p.relative_to(ROOT)): p.read_text() for package in PACKAGES
           for p in sorted((ROOT / package).rglob("*.py"))}
PROTOCOLS = {name for source in SOURCES.values() for name in _runtime_protocols(source)}


def test_no_optional_capability_is_probed_with_isinstance():
    """A wrapper (a Ray proxy, a child process, a replica set, a rank group) answers for what it wraps, which a
    structural ``isinstance`` cannot see (and Python 3.11 and 3.12 answer it differently through ``__getattr__``):
    what a backend or sampler may do beyond its Protocol is declared, with a default."""
    probe = (  # how asyncrl/train.py and backends/base.py asked, before issue 30
        "from typing import Protocol, runtime_checkable\n"
        "import typing\n"
        "from asyncrl.backends import base\n"
        "@runtime_checkable\n"
        "class StepMetrics(Protocol):\n"
        "    def step_metrics(self) -> dict: ...\n"
        "@typing.runtime_checkable\n"
        "class ActorBackend(Protocol):\n"
        "    actor_id: str\n"
        "class Plain(Protocol):\n"
        "    x: int\n"
        "def end_step(policy, generator, row, cls):\n"
        "    if isinstance(generator, StepMetrics):\n"
        "        row.update(generator.step_metrics())\n"
        "    ok = isinstance(policy, base.PrevLogprobsFromForward) and isinstance(policy, base.PolicyBackend)\n"
        "    dead = isinstance(generator, (int, ActorBackend)) or issubclass(cls, base.DeclaresCapabilities)\n"
        "    return isinstance(generator, GenerationBackend) and isinstance(row, dict) and isinstance(row, Plain)\n"
    )
    known = _runtime_protocols(probe) | {"PrevLogprobsFromForward", "DeclaresCapabilities"}  # base.py's, before
    assert _runtime_protocols(probe) == {"StepMetrics", "ActorBackend"}  # Plain is not runtime-checkable
    assert [hit.split(":")[1] for hit in _capability_probes(probe, "probe.py", known)] == ["13", "15", "16", "16"]
    assert CHECKED_PROTOCOLS <= PROTOCOLS  # the checked ones are found where they are defined
    found = [hit for where, source in SOURCES.items() for hit in _capability_probes(source, where, PROTOCOLS)]
    assert not found, ("an optional capability probed with isinstance (declare it: Capabilities, or a "
                       "SamplerBase attribute):\n" + "\n".join(found))
