"""What-if studies in seconds: the real controller, buffer and sampler on the simulated backends' virtual clock.

    sim = asyncrl.simulate.simulate("what_if", steps=1000, sampler={"name": "weight_fifo"})
    sim.summary()["sim_steps_per_hour"]; sim.metrics; sim.trace; sim.write("out/")
    asyncrl.simulate.grid("what_if_gen_heavy", 60, gpus=8)   # every split of 8 GPUs, the best marked

The parts, one module each: ``simulation`` (the discrete-event loop, ``Simulation``, and how it reads back),
``studies`` (``simulate``, ``sweep``, ``grid``) and ``calibration`` (a latency model fitted to a real run, and the
overlap probe). A run's own recording replayed under another sampler is ``asyncrl.replay``.
"""

from asyncrl.simulate.calibration import Calibration, calibrate, measure_overlap
from asyncrl.simulate.simulation import WALL_COLUMNS, Simulation, count_gpus
from asyncrl.simulate.studies import ASYNC, SYNC, grid, run, simulate, sweep

__all__ = ["ASYNC", "SYNC", "WALL_COLUMNS", "Calibration", "Simulation", "calibrate", "count_gpus", "grid",
           "measure_overlap", "run", "simulate", "sweep"]
