"""A custom prompt-group sampler, as a user writes one: ``{"name": "custom", "target": "my_sampler:NewestFirst"}``.

``NewestFirst`` trains the freshest ready groups first and drops a ready group once it is more than ``max_lag``
versions old. ``SamplerBase`` supplies the rest: gated admission (at most ``max_lag`` batches ahead of ``T``, so the
buffer needs ``groups_per_step * (max_lag + 1)`` slots), ``select``/``evict``/``explain`` derived from
``_candidates`` and the default eviction, and the verdicts' wording. (The notebooks import it from this directory,
their working directory; elsewhere put its directory on ``PYTHONPATH``.) The rules: ``docs/samplers.md``.
"""

from pydantic import Field

from asyncrl.samplers import KnobModel, SamplerBase


class NewestFirstKnobs(KnobModel):
    max_lag: int = Field(2, ge=0, strict=True, description="drop a ready group more than this many versions old")


class NewestFirst(SamplerBase):
    name = "newest_first"
    Knobs = NewestFirstKnobs
    window_knob = "max_lag"  # the window [T - max_lag, T]: admission, eviction and the buffer view's shading

    def _candidates(self, T):
        index = self.buffer.by_version
        for version in reversed(index.keys_between(self.lower_bound(T), T)):  # newest version first
            yield from index.ready[version]  # dispatch order within a version

    def _select_reason(self, slot, T):
        return f"{super()._select_reason(slot, T)}, newest first"
