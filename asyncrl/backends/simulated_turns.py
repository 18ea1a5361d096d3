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

**Free turns** (as ``asyncrl/environments/free_turns.py`` lets an asynchronous sampler's running pump play them):
with ``turns.workers`` > 0, under an asynchronous sampler (``free_turns``, set by ``asyncrl.multiturn.attach`` from
``sampler.admits_ahead``) and off the stepped clock (``asyncrl.simulate``'s loop, or the wall clock), a group
submitted then plays its trajectories apart. It starts once its replica holds its weights and is not loading (no
decoding slot: the engine decodes each turn as it is asked, as the torch engine batches what each poll submitted);
trajectory ``i``'s turn ``j`` decodes for ``prefill_s + decode_s_per_token x`` its own length (stretched by the
replica's pauses and weight loads), then its environment call goes to worker ``group id mod workers`` (where
``asyncrl/environments/host.py`` keeps a group's instances) and waits there for the calls that came before it
(first come, first served; ties by group, then trajectory); its next turn starts when the call ends. The group ends
with its last call. Its timeline is projected from the current state whenever anything changes (``_project_free``:
a submission, an abort, a pause or a weight load), so it depends on the other groups sharing its worker, never on
when it is polled. Each trajectory's turn is a ``turn`` event at its call's end, decoded with the weights its
replica held when the turn started, and after it (unless the group is done) the sampler is asked whether the group
goes on. Stepped ticks, synchronous samplers and ``workers: 0`` stay lockstep (above), as the real generator does.

Invariants: random draws happen only in ``draw_turns`` (called by ``submit``, in request order); a turn's boundary is
reported once, in time order, with the pump's callbacks called outside the generator's lock (they take the run's);
a trajectory's ``token_versions`` list its sampled tokens' versions only, its observation tokens have
``trained_mask`` 0 and logprob 0. Free turns: a worker runs one call at a time; a call that started by ``now`` keeps
its start and end (an aborted group's too: the worker still runs it), so a projection never rewrites the past; the
same seed and submissions give the same timeline.
"""

from __future__ import annotations

import heapq
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
    free_turns = False  # an asynchronous sampler's pump polls it (``asyncrl.multiturn.attach``): free turns

    def _plays_free(self) -> bool:
        """Whether a group submitted now plays free turns (the module docstring)."""
        return self.free_turns and self.model.turns.workers > 0 and not self.clock.stepping

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

    def free_turn_state(self) -> tuple[list[list[tuple[float, float]]], dict[int, float]]:
        """Empty ``(_stops, _worker_busy)``: per replica its pauses and weight loads (free-turn decodes skip them),
        per environment worker when the call it runs ends."""
        return [[] for _ in range(self.replicas)], {}

    def _plan_free(self, f: Any, env: list[list[float]]) -> None:
        """A free-turn group (the module docstring): ``f.env`` its calls' seconds (per trajectory, per turn),
        ``f.times`` each turn's projected ``(began, call arrives, call starts, call ends)``, ``f.reported_turns``
        the turns reported per trajectory; its seconds (what it would take alone) for the generator's tallies."""
        m = self.model
        f.free, f.env, f.times = True, env, [[] for _ in f.turn_lengths]
        f.reported_turns = [0] * len(f.turn_lengths)
        f.seconds = max(sum(m.prefill_s + m.decode_s_per_token * n + e for n, e in zip(x, c))
                        for x, c in zip(f.turn_lengths, env))

    def _decode_end(self, r: int, t: float, seconds: float) -> float:
        """When a decode of ``seconds`` that starts at ``t`` on replica ``r`` ends, its pauses and loads skipped."""
        for a, b in sorted(self._stops[r]):
            if b <= t:
                continue
            if a >= t + seconds:
                break
            if a > t:
                seconds -= a - t
            t = b
        return t + seconds

    def _freeze(self, flights: Any, now: float) -> None:
        """Each worker runs the calls that started by ``now`` (projected before now, so they did) to their end."""
        workers = self.model.turns.workers if self.model.turns is not None else 0
        for f in flights:
            if f.free:
                for times in f.times:
                    for _, _, start, end in times:
                        if start <= now:
                            w = f.request.group_id % workers
                            self._worker_busy[w] = max(self._worker_busy.get(w, -math.inf), end)

    def _project_free(self) -> None:
        """Every free-turn group's timeline from ``now`` on (the module docstring): the calls that started by now
        are kept, the rest replayed as events in time order, each call served by its worker first come, first
        served. Deterministic: ties go by group id, then trajectory."""
        now, m = self.clock.now, self.model
        free = [f for f in self._flights.values() if f.free]
        if not free:
            return
        workers = m.turns.workers
        self._freeze(free, now)
        worker_free = {w: max(now, t) for w, t in self._worker_busy.items()}
        events: list[tuple[float, int, int, int, float]] = []  # (call arrives, group, trajectory, turn, turn began)
        for f in free:
            gid, rep = f.request.group_id, self._replicas[f.replica]
            if f.start > now:  # not started: once its replica holds its weights and is not loading
                f.start = max(now, rep.free_at, rep.ready(f.version))
            for i, x in enumerate(f.turn_lengths):
                f.times[i] = [t for t in f.times[i] if t[2] <= now] if f.start <= now else []
                j = len(f.times[i])
                if j < len(x) and f.start < math.inf:
                    ready = f.times[i][-1][3] if j else f.start
                    arrive = self._decode_end(f.replica, ready, m.prefill_s + m.decode_s_per_token * x[j])
                    heapq.heappush(events, (arrive, gid, i, j, ready))
        while events:
            arrive, gid, i, j, ready = heapq.heappop(events)
            f, w = self._flights[gid], gid % workers
            start = max(arrive, worker_free.get(w, now))
            end = worker_free[w] = start + f.env[i][j]
            f.times[i].append((ready, arrive, start, end))
            if j + 1 < len(f.turn_lengths[i]):
                nxt = self._decode_end(f.replica, end, m.prefill_s + m.decode_s_per_token * f.turn_lengths[i][j + 1])
                heapq.heappush(events, (nxt, gid, i, j + 1, end))
        for f in free:
            f.finish = max(t[-1][3] for t in f.times) if f.start < math.inf else math.inf

    def _next_turn_end(self, past: float) -> float:
        """The earliest turn end after ``past`` still to be reported (free-turn groups)."""
        return min((t[k][3] for f in self._flights.values() if f.free and f.start < math.inf
                    for t, k in zip(f.times, f.reported_turns) if k < len(t) and t[k][3] > past), default=math.inf)

    def _turns_by(self, now: float) -> list[tuple[float, Any, int | None, int, list[list[int]]]]:
        """The turns ended by ``now`` and not reported yet, ``(when, flight, trajectory (None: every trajectory
        that played it, lockstep), turn index, each trajectory's turn versions)``, in time order (marked
        reported)."""
        out = []
        for f in self._flights.values():
            if f.free:
                for i, times in enumerate(f.times):
                    while f.start < math.inf and f.reported_turns[i] < len(times) \
                            and times[f.reported_turns[i]][3] <= now:
                        f.reported_turns[i] += 1
                        out.append((times[f.reported_turns[i] - 1][3], f, i, f.reported_turns[i] - 1,
                                    self._turn_versions(f)))
                continue
            while f.turn_ends is not None and f.reported < len(f.turn_ends) and f.at(f.turn_ends[f.reported]) <= now:
                f.reported += 1
                out.append((f.at(f.turn_ends[f.reported - 1]), f, None, f.reported - 1, self._turn_versions(f)))
        return sorted(out, key=lambda e: (e[0], e[1].request.group_id, -1 if e[2] is None else e[2]))

    def _turn_versions(self, f: Any) -> list[list[int]]:
        """The version each turn of each trajectory of ``f`` is decoded with: its replica's when the turn starts
        (lockstep: the group's turn)."""
        rep, base = self._replicas[f.replica], f.version if not self.timed_updates else 0
        if f.free:
            return [[max(base, rep.version_at(t[0])) for t in times] for times in f.times]
        group = [max(base, rep.version_at(f.at(t))) for t in f.turn_starts]
        return [group[:len(x)] for x in f.turn_lengths]

    def _report_turns(self, turns: list[tuple[float, Any, int | None, int, list[list[int]]]]) -> set[int]:
        """A ``turn`` event per trajectory that played each turn, then (unless the group is done) whether it goes
        on; the groups the pump stopped."""
        stopped: set[int] = set()
        for when, f, which, j, versions in turns:
            gid = f.request.group_id
            if gid in stopped:
                continue
            played = [i for i, x in enumerate(f.turn_lengths) if len(x) > j and which in (None, i)]
            for i in played:
                self.on_turn(gid, i, j + 1, versions[i][j], len(f.turn_lengths[i]) == j + 1)
            going = j < len(f.turn_ends) - 1 if which is None else when < f.finish
            reached = j + 1 if which is None else max(sum(t[3] <= when for t in times) for times in f.times)
            if going and self.at_boundary(gid, reached):  # the turn the group reached: its furthest trajectory's
                stopped.add(gid)
        return stopped

    def observation_tokens(self, group_id: int, trajectory: int) -> int:
        """Tokens of each observation of a trajectory (``turns.env_tokens``; a replay serves recorded ones)."""
        return self.model.turns.env_tokens

    def _turn_rollouts(self, f: Any) -> GroupRollouts:
        """A multi-turn group: each trajectory's turns (``x`` tokens, eos ending its last) with ``env_tokens``
        observation tokens (``o``) after every turn but the last; per-turn versions and logprobs, and the turns'
        texts (``turn_texts``, as ``asyncrl/turns.py`` logs them: joined, the completion's text)."""
        per_trajectory = self._turn_versions(f)
        ids, lps, masks, tversions, turns, reasons = [], [], [], [], [], []
        for k, x in enumerate(f.turn_lengths):
            env, versions = self.observation_tokens(f.request.group_id, k), per_trajectory[k]
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
        used = [v for versions in per_trajectory for v in versions]
        return GroupRollouts(f.request.group_id, list(f.request.prompt_ids), ids, lps, min(used), max(used),
                             reasons, rewards=list(f.rewards), replica=f.replica if self.replicas > 1 else None,
                             texts=["".join(map(chr, i_[:-1])) for i_ in ids], token_versions=tversions,
                             trained_mask=masks, turns=turns)

