"""Where the figures of simulated runs were before ``asyncrl.plots``: the same functions, from
``asyncrl.plots.simulation`` (import them from there)."""

from asyncrl.plots.simulation import COLORS, STYLES, plot_grid, plot_simulation, plot_sweep, sampler_label  # noqa: F401
