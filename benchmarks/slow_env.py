"""``SlowGuessLetter``: ``guess_letter``'s text environment behind a long-tailed latency, for bench_agents.py.

Each ``step`` first sleeps a seeded draw of the same distribution the simulated generator's ``turns`` model draws
(``asyncrl.backends.simulated.draw_env_seconds``): a pareto with median 20 ms and tail index 1.5, clipped to
500 ms a call (about 1 call in 250 reaches the cap), so the what-if run models this environment with the knobs it
really has. An instance's draws are seeded by its secret and the order instances are made in its process.
"""

from __future__ import annotations

import itertools
import random
import time

from asyncrl.backends.simulated import draw_env_seconds
from asyncrl.config import SimulatedTurns
from asyncrl.environments.guess_letter import GuessLetter

LATENCY = {"env_latency_s": 0.020, "env_latency_tail": "pareto", "env_latency_alpha": 1.5, "env_latency_max_s": 0.5}
_MODEL = SimulatedTurns(**LATENCY)
_made = itertools.count()


class SlowGuessLetter(GuessLetter):
    def reset(self, **row):
        self._rng = random.Random(f"{row.get('secret')}-{next(_made)}")
        return super().reset(**row)

    def step(self, action: str):
        time.sleep(draw_env_seconds(_MODEL, self._rng))
        return super().step(action)
