"""The simulated generator's multi-turn groups (``generation.turns``, a ``SimulatedTurns``; None: single-turn), a base
of ``SimulatedGenerator`` (asyncrl/backends/simulated.py). Each completion is a trajectory of model turns, each
followed by an environment call, as a text environment's through ``asyncrl/turns.py``: a trajectory plays one turn and then
another with probability ``1 - 1 / mean_turns`` after each (at most ``max_turns``), each turn's length drawn as a completion's,
each call's seconds drawn from a lognormal or pareto with median ``env_latency_s`` (clipped to
``env_latency_max_s``). A group plays its turns together: turn ``j`` decodes for ``prefill_s + decode_s_per_token
x`` its trajectories' longest turn ``j``, then the environment answers each trajectory still playing, one call after
another (one worker holds a group's instances, as ``asyncrl/environments/host.py`` places them), and the group holds
its decoding slot meanwhile; the sum is the group's seconds. At each turn's end (its environment's answer) the pump
bound by ``asyncrl.multiturn.attach`` gets a ``turn`` event per trajectory that played it, at the version that
decoded it, and, unless the group is done, is asked whether the group goes on (the sampler's
``should_abort_inflight``, as a ``TurnGenerator``'s boundaries ask); a group stopped there leaves at once. A turn is
decoded with the weights its replica holds when the turn starts, so a group spans versions turn by turn:
``turn_versions``, per sampled token ``token_versions``; observation tokens (``env_tokens`` after every turn but the
last) are context (``trained_mask`` 0, logprob 0). Turn boundaries are events of the loop (``next_event_time``),
spread over the group's span with its pauses as token times are.

Invariants: random draws happen only in ``draw_turns`` (called by ``submit``, in request order); a turn's boundary is
reported once, in time order, with the pump's callbacks called outside the generator's lock (they take the run's);
a trajectory's ``token_versions`` list its sampled tokens' versions only, its observation tokens have
``trained_mask`` 0 and logprob 0.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from asyncrl.data import GenerationRequest, GroupRollouts

LOG_HALF = math.log(0.5)
DRIFT = 0.01  # token logprobs at version v are LOG_HALF - DRIFT * v: stale tokens carry IS weights exp(-DRIFT * lag)


def draw_env_seconds(turns, rng: random.Random) -> float:
    """One environment call's seconds: median ``env_latency_s`` with a lognormal or pareto tail, clipped to
    ``env_latency_max_s``."""
    median = turns.env_latency_s
    if median <= 0:
        return 0.0
    if turns.env_latency_tail == "lognormal":
        x = rng.lognormvariate(math.log(median), turns.env_latency_sigma)
    else:  # pareto with this median: x_m = median / 2 ** (1 / alpha)
        x = median / 2 ** (1 / turns.env_latency_alpha) * rng.paretovariate(turns.env_latency_alpha)
    return x if turns.env_latency_max_s is None else min(x, turns.env_latency_max_s)


class TurnsModel:
    """Multi-turn groups of ``SimulatedGenerator`` (the module docstring); its flights, replicas, rng and lock."""

    # the pump's turn callbacks until ``bind`` (asyncrl/turn_hooks.py) sets them
    on_turn = staticmethod(lambda gid, i, turn, version, done: None)
    at_boundary = staticmethod(lambda gid, turn: False)

    @property
    def plays_turns(self) -> bool:
        """Whether groups are multi-turn (``generation.turns``): the rollout pump binds its turn hooks then."""
        return self.model.turns is not None

    def bind(self, on_turn: Callable[..., None], at_boundary: Callable[[int, int], bool],
             on_failed: Callable[[int, str], None]) -> None:
        """The pump's callbacks, as a ``TurnGenerator`` takes them (a simulated environment never fails)."""
        self.on_turn, self.at_boundary = on_turn, at_boundary

    def draw_turns(self, request: GenerationRequest, success: float) -> tuple[list[list[int]], list[list[float]],
                                                                             list[float]]:
        """A multi-turn group: per trajectory its turns' lengths and its environment calls' seconds (one per turn),
        and the rewards. A replay's generator serves recorded turns instead."""
        turns = self.model.turns
        stop = 1 / turns.mean_turns if turns.mean_turns is not None else 0.0
        lengths, env = [], []
        for _ in range(request.n):
            n = 1
            while n < turns.max_turns and self.rng.random() >= stop:
                n += 1
            lengths.append([self.length() for _ in range(n)])
            env.append([draw_env_seconds(turns, self.rng) for _ in range(n)])
        return lengths, env, [1.0 if self.rng.random() < success else 0.0 for _ in range(request.n)]

    def _plan_turns(self, f: Any, env: list[list[float]]) -> None:
        """The group's turn timeline in drawn seconds (the module docstring): its seconds and turn offsets."""
        m, t = self.model, 0.0
        f.turn_starts, f.turn_ends = [], []
        for j in range(max(len(x) for x in f.turn_lengths)):
            live = [i for i, x in enumerate(f.turn_lengths) if len(x) > j]
            f.turn_starts.append(t)
            t += m.prefill_s + m.decode_s_per_token * max(f.turn_lengths[i][j] for i in live)
            t += sum(env[i][j] for i in live)  # one worker answers the group's trajectories in turn
            f.turn_ends.append(t)
        f.seconds = t

    def _turns_by(self, now: float) -> list[tuple[Any, int, list[int]]]:
        """The turns ended by ``now`` and not reported yet, ``(flight, turn index, versions of every turn so
        far)``, in time order (marked reported)."""
        out = []
        for f in self._flights.values():
            while f.turn_ends is not None and f.reported < len(f.turn_ends) and f.at(f.turn_ends[f.reported]) <= now:
                f.reported += 1
                out.append((f, f.reported - 1, self._turn_versions(f)[:f.reported]))
        return sorted(out, key=lambda e: (e[0].at(e[0].turn_ends[e[1]]), e[0].request.group_id))

    def _turn_versions(self, f: Any) -> list[int]:
        """The version each turn of ``f`` is decoded with: its replica's when the turn starts."""
        rep = self._replicas[f.replica]
        return [max(f.version if not self.timed_updates else 0, rep.version_at(f.at(t))) for t in f.turn_starts]

    def _report_turns(self, turns: list[tuple[Any, int, list[int]]]) -> set[int]:
        """A ``turn`` event per trajectory that played each turn, then (unless the group is done) whether it goes
        on; the groups the pump stopped."""
        stopped: set[int] = set()
        for f, j, versions in turns:
            gid = f.request.group_id
            if gid in stopped:
                continue
            last = len(f.turn_ends) - 1
            for i, x in enumerate(f.turn_lengths):
                if len(x) > j:
                    self.on_turn(gid, i, j + 1, versions[j], len(x) == j + 1)
            if j < last and self.at_boundary(gid, j + 1):
                stopped.add(gid)
        return stopped

    def observation_tokens(self, group_id: int, trajectory: int) -> int:
        """Tokens of each observation of a trajectory (``turns.env_tokens``; a replay serves recorded ones)."""
        return self.model.turns.env_tokens

    def _turn_rollouts(self, f: Any) -> GroupRollouts:
        """A multi-turn group: each trajectory's turns (``x`` tokens, eos ending its last) with ``env_tokens``
        observation tokens (``o``) after every turn but the last; per-turn versions and logprobs, and the turns'
        texts (``turn_texts``, as ``asyncrl/turns.py`` logs them: joined, the completion's text)."""
        versions = self._turn_versions(f)
        ids, lps, masks, tversions, turns, reasons = [], [], [], [], [], []
        for k, x in enumerate(f.turn_lengths):
            env = self.observation_tokens(f.request.group_id, k)
            i_, l_, m_, v_, t_ = [], [], [], [], []
            for j, n in enumerate(x):
                last = j == len(x) - 1
                i_ += [ord("x")] * (n - 1) + [self.eos_id if last else ord("x")]
                t_.append({"role": "assistant", "text": "x" * (n - 1 if last else n), "version": versions[j]})
                l_ += [LOG_HALF - DRIFT * versions[j]] * n
                m_ += [1] * n
                v_ += [versions[j]] * n
                if not last:
                    i_ += [ord("o")] * env
                    l_ += [0.0] * env
                    m_ += [0] * env
                    t_.append({"role": "user", "text": "o" * env, "version": None})
            ids.append(i_)
            lps.append(l_)
            masks.append(m_)
            tversions.append(v_)
            turns.append({"turns": len(x), "tool_calls": 0, "env_tokens": env * (len(x) - 1),
                          "turn_versions": versions[:len(x)], "turn_texts": t_})
            reasons.append("length" if x[-1] == self.max_new_tokens else "stop")
        used = versions[:max(len(x) for x in f.turn_lengths)]
        return GroupRollouts(f.request.group_id, list(f.request.prompt_ids), ids, lps, min(used), max(used),
                             reasons, rewards=list(f.rewards), replica=f.replica if self.replicas > 1 else None,
                             texts=["".join(map(chr, i_[:-1])) for i_ in ids], token_versions=tversions,
                             trained_mask=masks, turns=turns)

