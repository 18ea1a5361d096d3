"""Custom-sampler targets for the tests (``"tests.custom_sampler_fixture:ClassName"``)."""

from __future__ import annotations

from pydantic import Field

from asyncrl.samplers import Admission, KnobModel, SamplerBase, Verdict
from asyncrl.strict import check_int


class NewestFirstKnobs(KnobModel):
    boost: int = Field(0, ge=0, description="buffer slots needed beyond 2 x groups_per_step")


class NewestFirstSampler(SamplerBase):
    """A policy without a window: always admits, trains the newest ready groups first, never evicts, and asks for
    a buffer of its own size (``2 N + boost``)."""

    name = "newest_first_fixture"
    Knobs = NewestFirstKnobs
    window_knob = None
    gated = False

    @classmethod
    def capacity_needed(cls, knobs, groups_per_step):
        return 2 * check_int("groups_per_step", groups_per_step, 1) + knobs.boost

    def _candidates(self, T):
        yield from (s for s in reversed(self.buffer.slots()) if s.ready)

    def _evictable(self, T):
        return iter(())

    def _select_reason(self, slot, T):
        return "ready, newest first"


class NotASubclass:
    """A complete sampler by the ``PromptGroupSampler`` Protocol that does not subclass ``SamplerBase``: refused
    when the configuration is validated (a custom sampler subclasses it)."""

    name = "not_a_subclass"
    is_on_policy = False

    def __init__(self, buffer):
        self.buffer = buffer
        self.dispatch_index = -1

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
        return [Verdict(s.group_id, s.weight_version, s.target_step, s.state, "keep", "kept", "custom policy")
                for s in self.buffer.slots()]

    def required_buffer_capacity(self, groups_per_step):
        return 2 * groups_per_step

    def set_dispatch_index(self, resume_step):
        self.dispatch_index = resume_step - 1


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


class OwnCapacity(SamplerBase):
    """Overrides the instance's ``required_buffer_capacity``, which the configuration never asks (it asks the
    class: ``capacity_needed``)."""

    name = "own_capacity"
    Knobs = _Knobs

    def _candidates(self, T):
        yield from ()

    def required_buffer_capacity(self, groups_per_step):
        return 3 * groups_per_step


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


class GatedWithoutWindow(SamplerBase):
    """Gated admission (the default) without a window to gate by."""

    name = "gated_without_window"
    Knobs = _Knobs
    window_knob = None

    def _candidates(self, T):
        yield from ()
