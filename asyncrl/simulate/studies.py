"""What-if studies on the virtual clock: one simulation, a sweep of samplers x windows x latencies, a grid over any
config keys (every split of a GPU budget among them).

    sim = simulate("what_if", steps=1000, sampler={"name": "weight_fifo"})
    sweep(samplers=("in_order", "weight_fifo"), windows=(0, 1, 2))
    grid("what_if_gen_heavy", 60, gpus=8)   # every split of 8 GPUs, the best marked

Each point is a fresh ``Controller`` from its config, so a study is a function of its configs and seeds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from asyncrl.config import Config, load_config
from asyncrl.controller import Controller
from asyncrl.samplers import SAMPLERS
from asyncrl.simulate.simulation import Simulation, count_gpus

SYNC = {"name": "in_order", "max_lookahead_versions": 0}
ASYNC = {"name": "weight_fifo", "max_staleness_versions": 1}


def run(ctrl: Controller, steps: int) -> Simulation:
    """Run ``ctrl`` (simulated backends) ``steps`` steps on the virtual clock; the ``Simulation`` has the results."""
    sim = Simulation(ctrl)
    sim.run(steps)
    return sim


def simulate(preset: str | Path | Config = "what_if", steps: int = 200, **overrides: Any) -> Simulation:
    """Build a controller from a preset (or a ``Config``) with overrides and run it ``steps`` simulated steps."""
    cfg = preset if isinstance(preset, Config) else load_config(preset, **overrides)
    return run(Controller.from_config(cfg), steps)


def sweep(samplers: Iterable[str] = ("in_order", "weight_fifo", "windowed", "ready_first"),
          windows: Iterable[int] = (0, 1, 2), latencies: Mapping[str, Mapping] | None = None,
          preset: str = "what_if", steps: int = 200, seeds: Iterable[int] = (0,), **overrides: Any) -> pd.DataFrame:
    """One simulation per sampler x window x latency setting x seed: a DataFrame with one row each (the
    summary's numbers). ``latencies`` maps a label to config overrides, e.g.
    ``{"long tail": {"generation": {"lengths": "pareto", "pareto_alpha": 1.5}}}``."""
    from asyncrl.config import merge_overrides

    latencies = dict(latencies or {"preset": {}})
    rows = []
    for label, latency in latencies.items():
        for name in samplers:
            for window in windows:
                for seed in seeds:
                    sampler = {"name": name, SAMPLERS[name].window_knob: window}
                    cfg = load_config(preset, **merge_overrides(merge_overrides(dict(overrides), dict(latency)),
                                                       {"sampler": sampler, "seed": seed}))
                    sim = simulate(cfg, steps)
                    s = sim.summary()
                    rows.append({"latency": label, "sampler": name, "window": window, "seed": seed,
                                 **{k: v for k, v in s.items() if k not in ("sampler", "seed", "lag_counts")}})
    return pd.DataFrame(rows)


def grid(preset: str | Path = "what_if", steps: int = 200, axes: Mapping[str, Iterable[Any]] | None = None,
         gpus: int | None = None, **overrides: Any) -> pd.DataFrame:
    """One simulation per point of the grid ``axes`` (a dotted config key -> its values, e.g.
    ``{"generation.replicas": [1, 2, 4]}``; several keys: every combination), on ``preset`` with ``overrides``.
    ``gpus``: only the points whose config uses exactly that many GPUs (``count_gpus``); with neither
    ``generation.replicas`` nor ``trainer.data_parallel`` among the axes, every split of ``gpus`` between the two
    (replicas 1 .. gpus - 1, ranks the rest) is added. One row per point: its values, then the summary's numbers;
    ``best`` marks the point with the most ``tokens_per_s_per_gpu`` (at a fixed GPU count: the most tokens/s)."""
    import itertools

    from asyncrl.config import merge_overrides

    axes = {key: list(values) for key, values in (axes or {}).items()}
    splits = gpus is not None and not {"generation.replicas", "trainer.data_parallel"} & set(axes)
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1 + splits):
        raise ValueError(f"gpus must be an int >= {1 + splits} (one GPU for each side at least), got {gpus!r}")
    if splits:
        axes = {"generation.replicas": list(range(1, gpus)), "trainer.data_parallel": list(range(1, gpus)), **axes}
    for key, values in axes.items():
        if not values:
            raise ValueError(f"the sweep over {key} has no values")
    points = []  # every point's config first: a bad value fails before anything runs
    for point in itertools.product(*axes.values()):
        nested: dict = {}
        for key, value in zip(axes, point):
            *parents, leaf = key.split(".")
            node = nested
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        cfg = load_config(preset, **merge_overrides(dict(overrides), nested))
        if gpus is None or count_gpus(cfg) == gpus:
            points.append((point, cfg))
    if not points:
        raise ValueError(f"no point of the sweep {axes} uses {gpus} GPUs")
    rows = []
    for point, cfg in points:
        s = simulate(cfg, steps).summary()
        rows.append({**dict(zip(axes, point)), **{k: v for k, v in s.items() if k not in ("sampler", "lag_counts")}})
    df = pd.DataFrame(rows)
    df["best"] = df.index == df.tokens_per_s_per_gpu.idxmax()
    return df
