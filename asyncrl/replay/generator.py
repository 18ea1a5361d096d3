"""The replay's generator: the simulated generator (its latency model, replicas, weight updates and per-token
versions unchanged) serving each dispatched prompt the completions a recording holds for it.

For a request it looks up the prompt (``prompt_of``: the replay controller's slot for the group) among the
recording's groups of that prompt and serves the one generated at the weight version nearest the one the group is
submitted under (the older of two equally near); several recorded groups of one prompt at that version are served
in recorded order, then again from the first. A prompt the recording never generated gets a group drawn (seeded)
from the recording's groups generated at the version nearest it: the recording's own distribution of lengths and
rewards at that stage of training. ``served`` says, per replayed group, which recorded group it got and whether it
was drawn.

Invariants: the generator's own random stream is never used for recorded groups (nothing the recording holds is
redrawn); draws for unknown prompts come from a stream of their own, seeded by the run's seed, in submission order.
"""

from __future__ import annotations

import bisect
import random
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from asyncrl.backends.simulated import SimulatedGenerator, draw_env_seconds
from asyncrl.data import GenerationRequest
from asyncrl.replay.recorded import RecordedGroup


@dataclass(frozen=True)
class Served:
    """What a replayed group got: the recorded group whose completions it was served, and whether that group
    was drawn (the recording never generated this prompt)."""

    recorded_group: int
    drawn: bool


class _ByVersion:
    """Recorded groups sorted by version, the nearest one found by bisection."""

    def __init__(self, groups: Iterable[RecordedGroup]):
        self.at: dict[int, list[RecordedGroup]] = defaultdict(list)
        for group in groups:
            self.at[group.version].append(group)
        self.versions = sorted(self.at)

    def nearest(self, version: int) -> int:
        i = bisect.bisect_left(self.versions, version)
        below = self.versions[i - 1] if i > 0 else None
        above = self.versions[i] if i < len(self.versions) else None
        if above == version or below is None:
            return above
        if above is None or version - below <= above - version:
            return below
        return above


class RecordedGenerator(SimulatedGenerator):
    """A ``SimulatedGenerator`` whose ``draw`` serves recorded completions (see the module docstring). Call
    ``serve(groups, prompt_of)`` before the first submit."""

    def __init__(self, model_cfg, gen_cfg, seed: int, tokenizer) -> None:
        super().__init__(model_cfg, gen_cfg, seed, tokenizer)
        self.seed = seed
        self.served: dict[int, Served] = {}

    def serve(self, groups: Iterable[tuple[str, RecordedGroup]], prompt_of: Callable[[int], str]) -> None:
        """``groups``: the recording's committed groups, each with the key of its prompt; ``prompt_of(group_id)``:
        the key of the prompt a replayed group was dispatched with."""
        groups = list(groups)
        by_prompt: dict[str, list[RecordedGroup]] = defaultdict(list)
        for key, group in groups:
            by_prompt[key].append(group)
        self._by_prompt = {key: _ByVersion(found) for key, found in by_prompt.items()}
        self._everything = _ByVersion(group for _, group in groups)
        self._cursor: dict[tuple[str, int], int] = defaultdict(int)
        self._prompt_of = prompt_of
        self._draws = random.Random(f"replay draws {self.seed}")
        self._env_draws = random.Random(f"replay environment {self.seed}")  # environment seconds (multi-turn)
        self._observations: dict[int, list[int]] = {}  # per group: each trajectory's tokens per observation

    def draw(self, request: GenerationRequest, success: float) -> tuple[list[int], list[float]]:
        group = self._pick(request)
        lengths = [min(self.max_new_tokens, n) for n in group.lengths]
        # a recording's groups hold group_size completions; a partial log is cycled to fill the group
        return ([lengths[i % len(lengths)] for i in range(request.n)],
                [group.rewards[i % len(group.rewards)] for i in range(request.n)])

    def draw_turns(self, request: GenerationRequest, success: float) -> tuple[list[list[int]], list[list[float]],
                                                                             list[float]]:
        """A recorded multi-turn group: each trajectory's recorded turns (its sampled tokens split over them) and
        reward, the environment's seconds drawn from the fitted ``turns`` model (a stream of their own)."""
        group = self._pick(request)
        split = group.turn_lengths()
        lengths = [[min(self.max_new_tokens, n) for n in split[i % len(split)]] for i in range(request.n)]
        env = [[draw_env_seconds(self.model.turns, self._env_draws) for _ in x] for x in lengths]
        observations = group.env_tokens or (0,) * len(split)
        self._observations[request.group_id] = [
            observations[i % len(split)] // max(1, len(x) - 1) for i, x in enumerate(lengths)]
        return lengths, env, [group.rewards[i % len(group.rewards)] for i in range(request.n)]

    def observation_tokens(self, group_id: int, trajectory: int) -> int:
        """The recorded trajectory's tokens per observation (its observation tokens over its turns but one)."""
        return self._observations[group_id][trajectory] if group_id in self._observations else 0

    def _pick(self, request: GenerationRequest) -> RecordedGroup:
        """The recorded group a request is served (module docstring), noted in ``served``."""
        key, version = self._prompt_of(request.group_id), self._version
        known = self._by_prompt.get(key)
        if known is not None:
            at = known.nearest(version)
            choices = known.at[at]
            k = self._cursor[key, at]
            self._cursor[key, at] = k + 1
            group, drawn = choices[k % len(choices)], False
        else:
            group, drawn = self._draws.choice(self._everything.at[self._everything.nearest(version)]), True
        self.served[request.group_id] = Served(group.group_id, drawn)
        return group

    @property
    def drawn_fraction(self) -> float:
        """The share of the groups submitted so far whose prompt the recording never generated."""
        return sum(s.drawn for s in self.served.values()) / len(self.served) if self.served else 0.0
