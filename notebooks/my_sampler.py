"""A custom prompt-group sampler, as a user would write one: ``{"name": "custom", "target": "my_sampler:NewestFirst"}``.

``NewestFirst`` trains the freshest ready groups first and drops a ready group once it is more than ``max_lag``
versions old. Admission is gated like the built-ins (at most ``max_lag`` batches ahead of ``T``), so its buffer
needs ``groups_per_step * (max_lag + 1)`` slots. It uses only the public sampler API: the buffer's ``slots()`` and
``remove()``, ``Admission`` and ``Verdict``. (The notebooks import it from this directory, their working directory.)
"""

from __future__ import annotations

from asyncrl.samplers import Admission, Verdict


class NewestFirst:
    is_on_policy = False  # it may train on older weights, so the loss needs an importance-sampling correction

    def __init__(self, buffer, max_lag: int = 2):
        self.buffer = buffer
        self.max_lag = max_lag
        self.dispatch_index = -1

    # Optional: a window and its lower bound let the buffer view shade [lower_bound, T].
    @property
    def window(self):
        return self.max_lag

    def lower_bound(self, trainer_version):
        return max(0, trainer_version - self.max_lag)

    def admit(self, trainer_version):
        if self.dispatch_index >= trainer_version + self.max_lag:
            return None  # the gate: never more than max_lag batches ahead of the trainer
        self.dispatch_index += 1
        return Admission(self.dispatch_index)

    def _candidates(self, T):
        fresh = [s for s in self.buffer.slots() if s.ready and 0 <= T - s.weight_version <= self.max_lag]
        return sorted(fresh, key=lambda s: (-s.weight_version, s.group_id))  # newest version first

    def _too_old(self, T):
        return [s for s in self.buffer.slots() if s.ready and T - s.weight_version > self.max_lag]

    def select(self, trainer_version, min_groups, max_groups):
        picked = self._candidates(trainer_version)[:max_groups]
        if len(picked) < min_groups:
            return None
        return self.buffer.remove([s.group_id for s in picked])

    def evict(self, trainer_version):
        doomed = self._too_old(trainer_version)
        return self.buffer.remove([s.group_id for s in doomed]) if doomed else []

    def should_abort_inflight(self, weight_version, trainer_version):
        return False

    def explain(self, trainer_version):
        T = trainer_version
        order = {s.group_id: i for i, s in enumerate(self._candidates(T))}
        old = {s.group_id for s in self._too_old(T)}
        verdicts = []
        for s in self.buffer.slots():
            lag = T - s.weight_version
            if s.group_id in old:
                v = ("evict", "too_stale", f"lag {lag} > max_lag {self.max_lag}")
            elif s.group_id in order:
                v = ("select", "selected", f"candidate #{order[s.group_id] + 1} of {len(order)}, newest first")
            elif not s.ready:
                v = ("keep", "pending", "pending: rollouts not committed yet")
            else:
                v = ("keep", "future_version", f"weight_version {s.weight_version} > T={T}")
            verdicts.append(Verdict(s.group_id, s.weight_version, s.target_step, s.state, *v))
        return verdicts

    def required_buffer_capacity(self, groups_per_step):
        return groups_per_step * (self.max_lag + 1)

    def set_dispatch_index(self, resume_step):
        self.dispatch_index = resume_step - 1

    def __repr__(self):
        return f"NewestFirst(max_lag={self.max_lag}, dispatch_index={self.dispatch_index})"
