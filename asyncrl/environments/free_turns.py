"""Free turns: a running pump's multi-turn trajectories go on as their environment answers (``FreeTurns``, a base
of ``asyncrl.turns.TurnGenerator``).

A lockstep poll (a stepped tick, or a synchronous sampler's run) waits for every environment call of a turn before
any trajectory asks for its next one: what a plain turn-by-turn loop does, so a stepped run is deterministic and
``in_order`` with no lookahead stays synchronous GRPO bit for bit. An asynchronous sampler's running pump (a poll
with a timeout, ``free_turns`` set by the wiring, environment workers) need not: its calls are sent to the workers
and not waited for, and each trajectory whose calls were all answered is observed and asks for its next turn at
the next poll, while slower calls (its siblings', other groups') still run. That is the environment's wait the
asynchrony hides. Its schedule then depends on timing, as a running asynchronous run's does anyway.

Invariants:
- A trajectory still has at most one turn or one turn's environment calls outstanding; a poll advances it by at
  most one turn. A group is returned when all its trajectories ended and none waits for an answer, stopped at a
  turn boundary (``at_boundary``) when one of its trajectories finished a turn, given up as in lockstep.
- Answers for a group no longer in flight (aborted, given up) are dropped; instances are made (``_start``) and
  dropped (``_flush_drops``) without waiting either.
- A lockstep poll after free ones first waits for what they left (``_settle``), so nothing is lost switching.
- Everything here runs on the polling thread; the group table is guarded by the generator's ``_lock``.
"""

from __future__ import annotations

from typing import Any

from asyncrl.data import GroupRollouts
from asyncrl.environments.trajectory import Group


class FreeTurns:
    """Free-turn polling over a ``TurnGenerator``'s parts (its ``inner`` generator, ``host``, ``groups``,
    ``_lock``, callbacks and the helpers named in the methods)."""

    def __init__(self) -> None:
        self.free_turns = False  # set by the wiring (``asyncrl.multiturn.attach``)
        self._env: dict[int, tuple[Group, int, str | None]] = {}  # ticket -> (group, trajectory, tool name)
        self._answers: dict[tuple[int, int], list] = {}  # a trajectory's answers so far
        self._ended: dict[tuple[int, int], tuple[int, int]] = {}  # a trajectory's turn, until answered: (turn, v)
        self._making: dict[int, tuple[Group, Any, list[int]]] = {}  # groups whose instances are being made
        self._made_answers: dict[int, Any] = {}  # their make outcomes so far, by ticket

    def _made(self, timeout: float = 0.0) -> None:
        """Free turns: begin the groups whose instances were all made (waiting up to ``timeout`` for one)."""
        tickets = {t for _, _, ts in self._making.values() for t in ts}
        self._made_answers.update(self.host.collect(tickets, timeout) if tickets else {})
        ready = [gid for gid, (_, _, ts) in sorted(self._making.items()) if all(t in self._made_answers for t in ts)]
        self._begin([(g, p, [self._made_answers.pop(t) for t in ts])
                     for g, p, ts in (self._making.pop(gid) for gid in ready)])

    def _poll_free(self, timeout: float) -> list[GroupRollouts]:
        """A running pump's poll with free turns: the turns the generator finished go to their environments
        (``host.start``, not waited for); each trajectory whose calls were all answered is observed and, unless it
        ended, asks for its next turn at once (one ``submit`` for all of them, in group and trajectory order); a
        group is stopped at a turn boundary (``at_boundary``) when one of its trajectories finished a turn, and
        returned when all ended. Waits up to ``timeout`` for an answer when the generator had nothing."""
        self._flush_drops(wait=False)
        with self._lock:
            new = [g for g in self.groups.values() if not g.started and g.gid not in self._making]
        prompts = {g.gid: self.prompt_of(g.gid) for g in new}  # instances made meanwhile: ``_made`` begins them
        tickets = iter(self.host.start(self._make_calls(new, prompts)))
        for g in new:
            self._making[g.gid] = (g, prompts[g.gid], [next(tickets) for _ in range(g.n)])
        self._made()
        done = self.inner.poll(timeout) if self.inner.num_inflight() else []
        _, events = self._take_turns(done)
        with self._lock:
            owner = {g.gid: g for g in self.groups.values()}
        fresh = [(owner[gid], i) for gid, i, _, _ in events if gid in owner]
        for gid, i, turn, version in events:
            self._ended[gid, i] = (turn, version)
        calls, where = self._env_calls(fresh)
        for key in [(g.gid, i) for g, i in fresh if g.trajectories[i].done]:  # ended without a call (a tool turn)
            self._answers[key] = []
        real = [(c, w) for c, w in zip(calls, where) if c[1] != "drop?"]
        for (g, i, name), call in ((w, c) for c, w in zip(calls, where) if c[1] == "drop?"):
            self._answers.setdefault((g.gid, i), []).append((g, name, None))
        for ticket, (_, w) in zip(self.host.start([c for c, _ in real]), real):
            self._env[ticket] = w
            self._answers.setdefault((w[0].gid, w[1]), [])
        got = self.host.collect(set(self._env), 0.0 if done else timeout) if self._env else {}
        for ticket, o in sorted(got.items()):
            g, i, name = self._env.pop(ticket)
            self._answers[g.gid, i].append((g, name, o))
        waiting = {(g.gid, i) for g, i, _ in self._env.values()}
        answered = {k: v for k, v in self._answers.items() if k not in waiting}
        for k in answered:
            del self._answers[k]
        return self._after_answers(answered)

    def _after_answers(self, answered: dict[tuple[int, int], list]) -> list[GroupRollouts]:
        """Free turns: observe the trajectories answered, report their turns, finish, stop or continue groups."""
        with self._lock:
            alive = {gid for gid, _ in answered if gid in self.groups}  # an aborted group's answers are dropped
        self._replies({k: v for k, v in answered.items() if v})
        touched: dict[int, Group] = {}
        for gid, i in sorted(answered):
            g = self.groups.get(gid) or next((v[0] for v in answered[gid, i][:1]), None)
            turn, version = self._ended.pop((gid, i), (0, 0))
            if gid in alive and g is not None:
                touched[gid] = g
                self.on_turn(gid, i, turn, version, g.trajectories[i].done or gid not in self.groups)
        with self._lock:
            live = [g for gid, g in sorted(touched.items()) if gid in self.groups]
            finished = [g for g in live if all(t.done for t in g.trajectories) and not g.waiting
                        and not any(k[0] == g.gid for k in self._answers)]
        going = [(self.groups[gid], (i,)) for gid, i in sorted(answered) if gid in self.groups]
        return self._end_turns(live, finished, going)

    def _settle(self) -> list[GroupRollouts]:
        """Before a lockstep poll: wait for the environment calls free turns left, and act on their answers (their
        trajectories' next turns are requested, so they are generated by this poll)."""
        while self._making:
            self._made(1.0)
        while self._env:
            got = self.host.collect(set(self._env), 1.0)
            for ticket, o in sorted(got.items()):
                g, i, name = self._env.pop(ticket)
                self._answers[g.gid, i].append((g, name, o))
        answered, self._answers = self._answers, {}
        return self._after_answers(answered) if answered else []

