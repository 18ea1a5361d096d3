"""Custom-sampler targets for the tests (``"tests.custom_sampler_fixture:ClassName"``)."""

from __future__ import annotations

from asyncrl.samplers import Admission, KnobModel, SamplerBase, Verdict


class NewestFirstSampler:
    """A complete custom policy written without ``SamplerBase``: always admits, trains the newest ready groups
    first, never evicts."""

    name = "newest_first_fixture"

    def __init__(self, buffer, boost: int = 0, is_on_policy: bool = False):
        self.buffer = buffer
        self.boost = boost
        self.is_on_policy = is_on_policy  # an instance attribute, declared by the class-level default below
        self.dispatch_index = -1

    is_on_policy: bool
    dispatch_index: int

    def admit(self, trainer_version):
        self.dispatch_index += 1
        return Admission(self.dispatch_index)

    def explain_admission(self, trainer_version):
        return "always admits"

    def select(self, trainer_version, min_groups, max_groups):
        ready = [s for s in reversed(self.buffer.slots()) if s.ready][:max_groups]
        return self.buffer.remove([s.group_id for s in ready]) if len(ready) >= min_groups else None

    def evict(self, trainer_version):
        return []

    def should_abort_inflight(self, weight_version, trainer_version):
        return False

    def explain(self, trainer_version, min_groups=1, max_groups=None):
        return [
            Verdict(s.group_id, s.weight_version, s.target_step, s.state, "keep", "kept", "custom policy")
            for s in self.buffer.slots()
        ]

    def required_buffer_capacity(self, groups_per_step):
        return 2 * groups_per_step + self.boost

    def set_dispatch_index(self, resume_step):
        self.dispatch_index = resume_step - 1


class AnnotatedOnly(NewestFirstSampler):
    """Declares ``is_on_policy`` (inherited annotation) but never sets it: passes the class check at configuration
    time, and fails the instance check in ``build_sampler``."""

    def __init__(self, buffer):
        self.buffer = buffer
        self.dispatch_index = -1


class _Methods:
    """All Protocol members except ``explain`` and ``is_on_policy``."""

    name = "incomplete"
    dispatch_index = -1

    def __init__(self, buffer):
        self.buffer = buffer

    def admit(self, trainer_version): ...

    def explain_admission(self, trainer_version): ...

    def select(self, trainer_version, min_groups, max_groups): ...

    def evict(self, trainer_version): ...

    def should_abort_inflight(self, weight_version, trainer_version): ...

    def required_buffer_capacity(self, groups_per_step): ...

    def set_dispatch_index(self, resume_step): ...


class MissingExplain(_Methods):
    is_on_policy = False


class ExplainNotCallable(_Methods):
    is_on_policy = False
    explain = None


class NoIsOnPolicy(_Methods):
    def explain(self, trainer_version, min_groups=1, max_groups=None): ...


def not_a_class(buffer):
    return NewestFirstSampler(buffer)


# SamplerBase subclasses with one of the things a subclass must define left out (docs/samplers.md).
class _Knobs(KnobModel):
    max_staleness_versions: int = 1


class NoKnobs(SamplerBase):
    name = "no_knobs"

    def _candidates(self, T):
        yield from ()


class NoCandidates(SamplerBase):
    name = "no_candidates"
    Knobs = _Knobs


class WrongWindowKnob(SamplerBase):
    name = "wrong_window"
    Knobs = _Knobs
    window_knob = "max_lag"

    def _candidates(self, T):
        yield from ()


class Worded(SamplerBase):
    """A complete subclass with words of its own: its verdicts (and the trace) say them."""

    name = "worded"
    Knobs = _Knobs
    gated = False

    def should_abort_inflight(self, weight_version, trainer_version):
        return weight_version < self.lower_bound(trainer_version)

    def _candidates(self, T):
        index = self.buffer.by_version
        for version in index.keys_between(self.lower_bound(T), T):
            yield from index.ready[version]

    def _select_reason(self, slot, T):
        return f"worded pick of group {slot.group_id} at T={T}"

    def _evict_reason(self, slot, T):
        return "worded_drop", f"worded drop of weight version {slot.weight_version} at T={T}"
