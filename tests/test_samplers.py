"""The samplers (docs/samplers.md): every shared rule, every policy's rule, every configuration error, ``explain``."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing

import pytest
from pydantic import ValidationError

import asyncrl.samplers as samplers
from asyncrl.buffer import ReplayBuffer
from asyncrl.samplers import (
    Admission,
    InOrderSampler,
    PromptGroupSampler,
    ReadyFirstSampler,
    Verdict,
    WeightFifoSampler,
    WindowedSampler,
    build_sampler,
    explain_frame,
    sampler_config,
)

FIXTURE = "tests.custom_sampler_fixture"
BUILT_IN = {
    "windowed": (WindowedSampler, "max_staleness_versions"),
    "weight_fifo": (WeightFifoSampler, "max_staleness_versions"),
    "in_order": (InOrderSampler, "max_lookahead_versions"),
    "ready_first": (ReadyFirstSampler, "max_staleness_versions"),
}
GATED = ["weight_fifo", "in_order", "ready_first"]


def make(name: str, window: int = 1, buf: ReplayBuffer | None = None, **knobs):
    cls, knob = BUILT_IN[name]
    buf = ReplayBuffer() if buf is None else buf
    return cls(buf, **{knob: window}, **knobs), buf


def add(buf: ReplayBuffer, version: int, n: int = 1, ready: bool = True, target: int | None = None) -> list[int]:
    gids = [buf.reserve(version, target_step=target) for _ in range(n)]
    if ready:
        for gid in gids:
            buf.commit(gid, f"rollouts-{gid}")
    return gids


def ids(slots):
    return None if slots is None else [s.group_id for s in slots]


def state(buf: ReplayBuffer):
    return [(s.group_id, s.weight_version, s.target_step, s.ready) for s in buf]


def verdicts_by_id(verdicts):
    return {v.group_id: v for v in verdicts}


# ------------------------------------------------------------------------------------------ public names
def test_public_names_are_importable():
    for name in ["PromptGroupSampler", "Admission", "WindowedSampler", "WeightFifoSampler", "InOrderSampler",
                 "ReadyFirstSampler", "build_sampler"]:
        assert hasattr(samplers, name), name
        assert name in samplers.__all__


def protocol_members() -> set[str]:
    return set(getattr(PromptGroupSampler, "__protocol_attrs__", None)
               or typing._get_protocol_attrs(PromptGroupSampler))


def test_protocol_is_runtime_checkable_and_samplerbase_satisfies_it():
    assert {"admit", "select", "evict", "explain", "is_on_policy", "required_buffer_capacity"} <= protocol_members()
    for name in BUILT_IN:
        sampler, _ = make(name)
        assert isinstance(sampler, PromptGroupSampler)
    assert not isinstance(object(), PromptGroupSampler)


def test_verdict_fields_are_the_contract():
    assert [f.name for f in dataclasses.fields(Verdict)] == [
        "group_id", "weight_version", "target_step", "state", "action", "code", "reason"
    ]


def test_import_is_light():
    """``import asyncrl.samplers`` pulls in no torch, Ray or Jupyter package."""
    code = (
        "import json, sys; import asyncrl.samplers; "
        "heavy = ('torch', 'ray', 'ipywidgets', 'IPython', 'matplotlib', 'jupyter', 'ipykernel', 'notebook'); "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0].startswith(heavy))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


# ---------------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    "config, cls, knobs",
    [
        ({"name": "windowed"}, WindowedSampler, {"max_staleness_versions": 1, "freshest_first": False}),
        ({"name": "windowed", "max_staleness_versions": 3, "freshest_first": True}, WindowedSampler,
         {"max_staleness_versions": 3, "freshest_first": True}),
        ({"name": "weight_fifo", "max_staleness_versions": 2}, WeightFifoSampler, {"max_staleness_versions": 2}),
        ({"name": "in_order"}, InOrderSampler, {"max_lookahead_versions": 1}),
        ({"name": "in_order", "max_lookahead_versions": 0}, InOrderSampler, {"max_lookahead_versions": 0}),
        ({"name": "ready_first", "max_staleness_versions": 0}, ReadyFirstSampler, {"max_staleness_versions": 0}),
    ],
)
def test_build_sampler_from_a_mapping_or_a_model(config, cls, knobs):
    buf = ReplayBuffer()
    for cfg in (config, sampler_config(config)):
        sampler = build_sampler(cfg, buf)
        assert type(sampler) is cls and sampler.buffer is buf and sampler.dispatch_index == -1
        assert sampler.knobs.model_dump(exclude={"name"}) == knobs
    assert sampler_config(config).name == config["name"]


def test_each_class_is_constructed_with_buffer_and_knobs():
    buf = ReplayBuffer()
    assert WindowedSampler(buf, max_staleness_versions=2, freshest_first=True).window == 2
    assert InOrderSampler(buf, max_lookahead_versions=0).is_on_policy
    assert "max_staleness_versions=4" in repr(WeightFifoSampler(buf, max_staleness_versions=4))


def test_unknown_sampler_name_names_it_and_the_allowed_ones():
    with pytest.raises(ValidationError, match=r"'fifo'.*'windowed', 'weight_fifo', 'in_order', 'ready_first'"):
        build_sampler({"name": "fifo"}, ReplayBuffer())


def test_missing_sampler_name():
    with pytest.raises(ValueError, match=r"needs a 'name', one of \['windowed', .*'custom'\]"):
        build_sampler({"max_staleness_versions": 1}, ReplayBuffer())


@pytest.mark.parametrize(
    "config, unknown, allowed",
    [
        ({"name": "windowed", "max_lookahead_versions": 1}, "max_lookahead_versions",
         "['max_staleness_versions', 'freshest_first']"),
        ({"name": "in_order", "max_staleness_versions": 1}, "max_staleness_versions", "['max_lookahead_versions']"),
        ({"name": "weight_fifo", "freshest_first": True}, "freshest_first", "['max_staleness_versions']"),
        ({"name": "ready_first", "window": 2}, "window", "['max_staleness_versions']"),
    ],
)
def test_unknown_knob_names_it_and_the_policys_knobs(config, unknown, allowed):
    with pytest.raises(ValidationError) as err:
        build_sampler(config, ReplayBuffer())
    message = str(err.value)
    assert f"unknown knob(s) ['{unknown}'] for sampler '{config['name']}'" in message
    assert f"its knobs are {allowed}" in message


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_negative_knob_is_rejected(name):
    knob = BUILT_IN[name][1]
    with pytest.raises(ValidationError, match=rf"(?s){knob}.*greater than or equal to 0.*input_value=-1"):
        build_sampler({"name": name, knob: -1}, ReplayBuffer())
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        make(name, window=-1)  # the class validates its knobs too


@pytest.mark.parametrize("bad", [True, 1.5, "1"])
def test_knobs_are_strict_ints(bad):
    with pytest.raises(ValidationError, match="max_staleness_versions"):
        build_sampler({"name": "weight_fifo", "max_staleness_versions": bad}, ReplayBuffer())


def test_freshest_first_is_a_strict_bool():
    with pytest.raises(ValidationError, match="freshest_first"):
        build_sampler({"name": "windowed", "freshest_first": "yes"}, ReplayBuffer())


def test_config_must_be_a_mapping_or_a_model():
    with pytest.raises(TypeError, match="must be a mapping or a sampler config model, got list"):
        build_sampler(["windowed"], ReplayBuffer())


def test_config_models_are_frozen():
    cfg = sampler_config({"name": "windowed"})
    with pytest.raises(ValidationError):
        cfg.max_staleness_versions = 5


# ----------------------------------------------------------------------------------------------- custom
def test_custom_sampler_is_built_with_buffer_and_kwargs():
    buf = ReplayBuffer()
    sampler = build_sampler({"name": "custom", "target": f"{FIXTURE}:NewestFirstSampler", "boost": 3}, buf)
    assert type(sampler).__name__ == "NewestFirstSampler"
    assert sampler.buffer is buf and sampler.knobs.boost == 3
    assert isinstance(sampler, PromptGroupSampler)
    assert sampler.required_buffer_capacity(4) == 11
    cfg = sampler_config({"name": "custom", "target": f"{FIXTURE}:NewestFirstSampler", "boost": 3})
    assert cfg.kwargs == {"boost": 3}
    add(buf, 0, 3)
    assert ids(sampler.select(0, 1, 2)) == [2, 1]


@pytest.mark.parametrize("target", ["no_colon", "a:b:C", ":Cls", "pkg.mod:", ""])
def test_custom_target_without_module_and_class(target):
    with pytest.raises(ValidationError, match=rf"must look like 'package.module:ClassName', got '{target}'"):
        sampler_config({"name": "custom", "target": target})


def test_custom_target_module_that_does_not_import():
    with pytest.raises(ValidationError, match=r"module 'no_such_module_xyz' does not import \(ModuleNotFoundError"):
        sampler_config({"name": "custom", "target": "no_such_module_xyz:Sampler"})


def test_custom_target_module_that_raises_while_importing(tmp_path, monkeypatch):
    (tmp_path / "asyncrl_test_broken_sampler.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValidationError, match=r"module 'asyncrl_test_broken_sampler' does not import "
                                              r"\(RuntimeError: boom at import\)"):
        sampler_config({"name": "custom", "target": "asyncrl_test_broken_sampler:Sampler"})


@pytest.mark.parametrize("target, found", [("Nope", "nothing"), ("not_a_class", "a function")])
def test_custom_target_that_is_not_a_class(target, found):
    with pytest.raises(ValidationError, match=rf"has no class '{target}' \(found {found}\)"):
        sampler_config({"name": "custom", "target": f"{FIXTURE}:{target}"})


def test_a_custom_class_that_does_not_subclass_samplerbase_is_one_line_naming_it_and_what_is_required():
    """Even one with every member of the Protocol: the pumps read what SamplerBase declares."""
    from asyncrl import load_config

    for check in (lambda: sampler_config({"name": "custom", "target": f"{FIXTURE}:NotASubclass"}),
                  lambda: load_config("quickstart", sampler={"name": "custom", "target": f"{FIXTURE}:NotASubclass"})):
        with pytest.raises(ValidationError) as caught:
            check()
        (error,) = caught.value.errors()
        assert error["msg"] == (
            f"Value error, custom sampler target '{FIXTURE}:NotASubclass': class NotASubclass does not subclass "
            "SamplerBase; a custom sampler must subclass asyncrl.samplers.SamplerBase (docs/samplers.md, "
            "'Writing your own')")


def test_custom_kwargs_the_class_rejects():
    with pytest.raises(ValueError, match=r"rejected kwargs \{'speed': 2\}"):
        build_sampler({"name": "custom", "target": f"{FIXTURE}:NewestFirstSampler", "speed": 2}, ReplayBuffer())


def test_a_custom_sampler_answers_the_configuration_through_its_class_and_knobs():
    """No sampler and no buffer are built to validate a config: on-policy-ness and capacity are the class's."""
    from asyncrl import load_config
    from asyncrl.samplers import sampler_class, sampler_knobs

    built = []
    original = samplers.SamplerBase.__init__

    def counting(self, buffer, **knobs):
        built.append(type(self).__name__)
        original(self, buffer, **knobs)

    config = {"name": "custom", "target": f"{FIXTURE}:NewestFirstSampler", "boost": 3}
    samplers.SamplerBase.__init__ = counting
    try:
        cfg = load_config("quickstart", sampler=config, max_buffered_groups=19)
        load_config("quickstart", sampler={"name": "weight_fifo", "max_staleness_versions": 2},
                    loss={"importance_correction": "token"})
    finally:
        samplers.SamplerBase.__init__ = original
    assert built == []
    cls, knobs = sampler_class(cfg.sampler), sampler_knobs(cfg.sampler)
    assert cls.__name__ == "NewestFirstSampler" and knobs.boost == 3
    assert cls.capacity_needed(knobs, 8) == 19 and cls.trains_on_policy(knobs) is False
    assert build_sampler(cfg.sampler, ReplayBuffer()).required_buffer_capacity(8) == 19
    for name, (klass, knob) in BUILT_IN.items():
        for window in (0, 2):
            knobs = sampler_knobs({"name": name, knob: window})
            assert sampler_class({"name": name}) is klass
            sampler = klass(ReplayBuffer(), **{knob: window})
            assert klass.trains_on_policy(knobs) is sampler.is_on_policy
            assert klass.capacity_needed(knobs, 8) == sampler.required_buffer_capacity(8)


@pytest.mark.parametrize("cls, says", [
    ("OwnCapacity", "overrides required_buffer_capacity (override the classmethod capacity_needed(knobs, "
                    "groups_per_step) instead)"),
    ("GatedWithoutWindow", "lacks a `window_knob` (gated admission lets batch k go once k <= T + W"),
])
def test_a_subclass_that_the_configuration_could_not_ask_is_refused(cls, says):
    with pytest.raises(ValidationError) as caught:
        sampler_config({"name": "custom", "target": f"{FIXTURE}:{cls}"})
    (error,) = caught.value.errors()
    assert f"custom sampler {cls} ('{FIXTURE}:{cls}') {says}" in error["msg"] and "\n" not in error["msg"]


@pytest.mark.parametrize("cls, lacks", [
    ("NoKnobs", "`Knobs` (a KnobModel subclass"),
    ("NoCandidates", "`_candidates(T)`"),
    ("WrongWindowKnob", "a knob 'max_lag' in its Knobs, which window_knob names as its window (its knobs: "
                        "['max_staleness_versions'])"),
])
def test_a_samplerbase_subclass_lacking_what_it_must_define_is_a_configuration_error(cls, lacks):
    """Caught when the configuration validates (before anything is built), in one line naming the class."""
    from asyncrl import load_config

    for check in (lambda: sampler_config({"name": "custom", "target": f"{FIXTURE}:{cls}"}),
                  lambda: load_config("quickstart", sampler={"name": "custom", "target": f"{FIXTURE}:{cls}"})):
        with pytest.raises(ValidationError) as caught:
            check()
        (error,) = caught.value.errors()
        assert f"custom sampler {cls} ('{FIXTURE}:{cls}') lacks {lacks}" in error["msg"]
        assert "\n" not in error["msg"]


def test_a_custom_samplers_kwargs_and_capacity_are_checked_with_the_configuration():
    from asyncrl import load_config

    with pytest.raises(ValidationError, match=r"Worded' rejected kwargs \{'speed': 2\}: unknown knob\(s\) \['speed'\]"):
        sampler_config({"name": "custom", "target": f"{FIXTURE}:Worded", "speed": 2})
    with pytest.raises(ValidationError, match=r"NewestFirstSampler' rejected kwargs \{'boost': -1\}: boost: "):
        sampler_config({"name": "custom", "target": f"{FIXTURE}:NewestFirstSampler", "boost": -1})
    with pytest.raises(ValidationError, match=r"max_buffered_groups 16 is smaller than the 19 groups sampler"):
        load_config("quickstart", max_buffered_groups=16,
                    sampler={"name": "custom", "target": f"{FIXTURE}:NewestFirstSampler", "boost": 3})


# -------------------------------------------------------------------------------------------- admission
@pytest.mark.parametrize("name", GATED)
@pytest.mark.parametrize("window", [0, 1, 3])
def test_gated_admission(name, window):
    """Batch k is admitted once k <= T + W; the first batch always passes; each admission bumps the index."""
    sampler, _ = make(name, window)
    for T in range(4):
        admitted = []
        while (adm := sampler.admit(T)) is not None:
            admitted.append(adm.dispatch_index)
        assert admitted[-1] == T + window == sampler.dispatch_index
        assert sampler.admit(T) is None  # the gate stays shut and the index stays put
        assert sampler.dispatch_index == T + window
    assert sampler.required_buffer_capacity(8) == 8 * (window + 1)


def test_first_batch_always_passes():
    for name in GATED:
        sampler, _ = make(name, 0)
        assert sampler.admit(0) == Admission(0, 0 if name == "in_order" else None)
        assert sampler.admit(0) is None


def test_in_order_stamps_the_dispatch_index_others_do_not():
    in_order, _ = make("in_order", 2)
    assert [in_order.admit(0).target_step for _ in range(3)] == [0, 1, 2]
    for name in ["windowed", "weight_fifo", "ready_first"]:
        sampler, _ = make(name, 2)
        assert [sampler.admit(0).target_step for _ in range(3)] == [None, None, None]


def test_windowed_admission_is_always_open():
    sampler, _ = make("windowed", 0)
    got = [sampler.admit(0) for _ in range(50)]
    assert [a.dispatch_index for a in got] == list(range(50)) and all(a.target_step is None for a in got)
    assert sampler.required_buffer_capacity(8) is None


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_set_dispatch_index_on_resume(name):
    sampler, _ = make(name, 1)
    sampler.set_dispatch_index(5)
    assert sampler.dispatch_index == 4
    first = sampler.admit(5)
    assert first.dispatch_index == 5
    assert first.target_step == (5 if name == "in_order" else None)
    if name in GATED:
        assert sampler.admit(5).dispatch_index == 6 and sampler.admit(5) is None
    sampler.set_dispatch_index(0)
    assert sampler.dispatch_index == -1
    with pytest.raises(ValueError, match="resume_step must be an int >= 0, got -1"):
        sampler.set_dispatch_index(-1)
    assert sampler.dispatch_index == -1


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_resume_schedule_counts_the_batches_a_restored_buffer_holds_as_admitted(name):
    """Restored at T=5 over groups another sampler admitted: a stamping sampler resumes after the last stamp it
    holds, any other after ceil(kept / N) batches; with nothing kept, both start at batch T."""
    sampler, buf = make(name, 1)
    for target in (5, 5, 6, None, 6):
        add(buf, 4, target=target)
    sampler.resume_schedule(buf.slots(), 5, 4)
    assert sampler.dispatch_index == (6 if name == "in_order" else 4 + 2)
    if name in GATED:
        assert sampler.admit(5) is None and sampler.admit(6).dispatch_index == 7
    sampler.resume_schedule([], 5, 4)
    assert sampler.dispatch_index == 4 and sampler.admit(5) == Admission(5, 5 if name == "in_order" else None)
    for bad, message in [((buf.slots(), -1, 4), "trainer_version must be an int >= 0, got -1"),
                         ((buf.slots(), 5, 0), "groups_per_step must be an int >= 1, got 0")]:
        with pytest.raises(ValueError, match=message):
            sampler.resume_schedule(*bad)
    assert sampler.dispatch_index == 5  # a refused call changes nothing


def test_a_policy_without_a_window_declares_none():
    from tests.custom_sampler_fixture import NewestFirstSampler

    sampler = NewestFirstSampler(ReplayBuffer(), boost=1)
    assert (sampler.window, sampler.lower_bound(7), sampler.admits_ahead, sampler.is_on_policy) == (None, 0, True, False)
    assert (sampler.gated, sampler.stamps_target, sampler.required_buffer_capacity(3)) == (False, False, 7)
    add(sampler.buffer, 0, 2)
    add(sampler.buffer, 9, 1)
    assert sampler.evict(9) == [] and ids(sampler.select(9, 1, 2)) == [2, 1]


@pytest.mark.parametrize("name", list(BUILT_IN))
@pytest.mark.parametrize("bad", [0, -2, 1.0])
def test_required_buffer_capacity_needs_a_positive_groups_per_step(name, bad):
    sampler, _ = make(name)
    with pytest.raises(ValueError, match=rf"groups_per_step must be an int >= 1, got {bad!r}"):
        sampler.required_buffer_capacity(bad)


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_is_on_policy_exactly_when_the_window_is_zero(name):
    assert make(name, 0)[0].is_on_policy is True
    assert make(name, 1)[0].is_on_policy is False
    assert make(name, 4)[0].is_on_policy is False


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_bad_trainer_version(name):
    sampler, buf = make(name)
    add(buf, 0, 2)
    for call in (sampler.admit, sampler.evict, lambda T: sampler.select(T, 1, 1), sampler.explain):
        with pytest.raises(ValueError, match="trainer_version must be an int >= 0, got -1"):
            call(-1)
    assert len(buf) == 2 and sampler.dispatch_index == -1


# ------------------------------------------------------------------------------------ select: arguments
@pytest.mark.parametrize("name", list(BUILT_IN))
@pytest.mark.parametrize(
    "min_groups, max_groups, message",
    [
        (0, 4, "min_groups must be an int >= 1, got 0"),
        (-1, 4, "min_groups must be an int >= 1, got -1"),
        (True, 4, "min_groups must be an int >= 1, got True"),
        (2.0, 4, "min_groups must be an int >= 1, got 2.0"),
        (3, 2, r"max_groups must be an int >= min_groups \(3\), got 2"),
        (1, None, r"max_groups must be an int >= min_groups \(1\), got None"),
    ],
)
def test_select_arguments_out_of_range(name, min_groups, max_groups, message):
    sampler, buf = make(name)
    add(buf, 0, 4, target=0)
    before = state(buf)
    with pytest.raises(ValueError, match=message):
        sampler.select(0, min_groups, max_groups)
    assert state(buf) == before


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_select_with_too_few_candidates_returns_none_and_leaves_the_buffer(name):
    sampler, buf = make(name)
    add(buf, 0, 3, target=0)
    add(buf, 0, 2, ready=False, target=0)
    before = state(buf)
    assert sampler.select(0, 4, 8) is None
    assert state(buf) == before
    chunk = sampler.select(0, 3, 8)  # exactly min_groups is enough
    assert ids(chunk) == [0, 1, 2] and all(s.ready for s in chunk)
    assert ids(buf) == [3, 4]


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_select_takes_at_most_max_groups_in_order(name):
    sampler, buf = make(name)
    add(buf, 0, 5, target=0)
    assert ids(sampler.select(0, 1, 2)) == [0, 1]
    assert ids(sampler.select(0, 1, 2)) == [2, 3]
    assert ids(sampler.select(0, 1, 2)) == [4]
    assert sampler.select(0, 1, 2) is None


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_select_order_is_dispatch_order_not_commit_order(name):
    sampler, buf = make(name)
    gids = add(buf, 0, 4, ready=False, target=0)
    for gid in reversed(gids):
        buf.commit(gid, None)
    assert ids(sampler.select(0, 1, 4)) == gids


# ------------------------------------------------------------------------------------------- windowed
def test_windowed_selects_ready_slots_inside_the_window_in_buffer_order():
    sampler, buf = make("windowed", 1)
    stale = add(buf, 2, 2)
    old = add(buf, 3, 2)
    pending = add(buf, 3, 1, ready=False)
    new = add(buf, 4, 2)
    future = add(buf, 5, 1)
    T = 4  # lo = 3
    assert ids(sampler.select(T, 1, 10)) == old + new
    assert ids(buf) == stale + pending + future


def test_windowed_freshest_first_sorts_by_lag_then_position():
    sampler, buf = make("windowed", 2, freshest_first=True)
    a = add(buf, 1, 2)
    b = add(buf, 2, 2)
    c = add(buf, 3, 2, ready=False)
    for gid in reversed(c):
        buf.commit(gid, None)
    add(buf, 4, 1)  # future for T = 3
    assert ids(sampler.select(3, 1, 5)) == c + b + a[:1]
    assert ids(sampler.select(3, 1, 5)) == a[1:]


def test_windowed_zero_window_is_on_policy():
    sampler, buf = make("windowed", 0)
    add(buf, 2, 2)
    current = add(buf, 3, 2)
    assert ids(sampler.select(3, 1, 10)) == current
    assert sampler.select(3, 1, 10) is None


def test_windowed_aborts_in_flight_rollouts_below_the_window():
    sampler, _ = make("windowed", 2)
    assert sampler.should_abort_inflight(weight_version=2, trainer_version=5) is True  # lo = 3
    assert sampler.should_abort_inflight(weight_version=3, trainer_version=5) is False
    assert sampler.should_abort_inflight(weight_version=6, trainer_version=5) is False
    assert sampler.should_abort_inflight(weight_version=0, trainer_version=1) is False  # lo = max(0, -1)


# ----------------------------------------------------------------------------------------- weight_fifo
def test_weight_fifo_takes_only_the_oldest_in_window_version():
    sampler, buf = make("weight_fifo", 2)
    add(buf, 0, 1)  # stale at T = 4 (lo = 2): does not count
    v2 = add(buf, 2, 2)
    v3 = add(buf, 3, 3)
    assert ids(sampler.select(4, 1, 10)) == v2  # never mixes versions in a chunk
    assert ids(sampler.select(4, 1, 10)) == v3


def test_weight_fifo_never_skips_ahead_of_a_pending_version():
    sampler, buf = make("weight_fifo", 1)
    v1 = add(buf, 1, 2, ready=False)
    v2 = add(buf, 2, 4)
    before = state(buf)
    assert sampler.select(2, 1, 4) is None  # version 1 still has pending groups: wait
    assert state(buf) == before
    buf.commit(v1[1], None)
    assert ids(sampler.select(2, 1, 4)) == [v1[1]]
    buf.commit(v1[0], None)
    assert ids(sampler.select(2, 1, 4)) == [v1[0]]
    assert ids(sampler.select(2, 1, 4)) == v2


def test_weight_fifo_takes_a_complete_version_even_below_min_groups():
    # A skipped group's replacement is generated with newer weights: its version can end a group short for good.
    sampler, buf = make("weight_fifo", 1)
    v1 = add(buf, 1, 3)
    v2 = add(buf, 2, 4)
    [verdict] = {v.code for v in sampler.explain(2, 4, 4) if v.group_id in v1}
    assert verdict == "selected"
    assert ids(sampler.select(2, 4, 4)) == v1  # nothing of version 1 is pending: waiting could never end
    assert ids(sampler.select(2, 4, 4)) == v2
    add(buf, 2, 1)
    add(buf, 2, 1, ready=False)
    before = state(buf)
    assert sampler.select(2, 4, 4) is None  # a version with pending groups still waits for min_groups
    assert state(buf) == before


def test_weight_fifo_target_ignores_future_versions():
    sampler, buf = make("weight_fifo", 1)
    future = add(buf, 3, 2)
    assert sampler.select(2, 1, 4) is None
    assert ids(buf) == future and sampler.evict(2) == []


@pytest.mark.parametrize("name", GATED)
def test_gated_policies_never_abort(name):
    """Every admitted batch is waited for: aborting would lose a slot the gate already counted."""
    sampler, _ = make(name, 1)
    assert not any(sampler.should_abort_inflight(w, T) for T in range(0, 50, 7) for w in range(0, T + 2))


# -------------------------------------------------------------------------------------------- in_order
def test_in_order_selects_exactly_the_current_target_step_whatever_the_version():
    sampler, buf = make("in_order", 1)
    past = add(buf, 0, 1, target=1)
    now = add(buf, 0, 2, target=5)  # weight_version 0 at T = 5: the window is not consulted
    later = add(buf, 3, 2, target=6)
    unstamped = add(buf, 4, 1)
    assert ids(sampler.select(5, 1, 10)) == now
    assert sampler.select(5, 1, 10) is None
    assert ids(buf) == past + later + unstamped


def test_in_order_waits_for_pending_groups_of_its_step():
    sampler, buf = make("in_order", 0)
    gids = add(buf, 0, 3, ready=False, target=0)
    buf.commit(gids[2], None)
    assert sampler.select(0, 3, 3) is None
    buf.commit(gids[0], None)
    buf.commit(gids[1], None)
    assert ids(sampler.select(0, 3, 3)) == gids


def test_in_order_evicts_what_select_will_never_take():
    sampler, buf = make("in_order", 1)
    gone = add(buf, 0, 2, target=2)
    still_pending = add(buf, 0, 1, ready=False, target=2)
    now = add(buf, 1, 1, target=3)
    later = add(buf, 1, 1, target=4)
    assert ids(sampler.evict(3)) == gone
    assert ids(buf) == still_pending + now + later
    buf.commit(still_pending[0], None)
    assert ids(sampler.evict(3)) == still_pending


def test_in_order_with_zero_lookahead_is_synchronous():
    sampler, buf = make("in_order", 0)
    assert sampler.is_on_policy and sampler.required_buffer_capacity(4) == 4
    for T in range(3):
        adm = sampler.admit(T)
        assert adm.target_step == T and sampler.admit(T) is None
        add(buf, T, 4, target=adm.target_step)
        assert len(ids(sampler.select(T, 4, 4))) == 4 and len(buf) == 0


# ----------------------------------------------------------------------------------------- ready_first
def test_ready_first_takes_every_ready_group_up_to_T_without_a_lower_bound():
    sampler, buf = make("ready_first", 1)
    ancient = add(buf, 0, 2)
    pending = add(buf, 3, 1, ready=False)
    recent = add(buf, 9, 1)
    future = add(buf, 11, 1)
    assert sampler.evict(10) == []
    assert ids(sampler.select(10, 1, 10)) == ancient + recent
    assert ids(buf) == pending + future


def test_ready_first_never_evicts():
    sampler, buf = make("ready_first", 0)
    add(buf, 0, 3)
    assert sampler.evict(100) == [] and len(buf) == 3


# ------------------------------------------------------------------------------------ default eviction
@pytest.mark.parametrize("name", ["windowed", "weight_fifo"])
def test_default_eviction_drops_ready_slots_below_the_window(name):
    sampler, buf = make(name, 1)
    stale = add(buf, 1, 2)
    stale_pending = add(buf, 1, 1, ready=False)
    inside = add(buf, 2, 1)
    future = add(buf, 5, 1)
    T = 3  # lo = 2
    evicted = sampler.evict(T)
    assert ids(evicted) == stale and all(s.ready for s in evicted)
    assert ids(buf) == stale_pending + inside + future  # never a pending slot: a commit may be in flight
    assert sampler.evict(T) == []
    buf.commit(stale_pending[0], None)
    assert ids(sampler.evict(T)) == stale_pending


@pytest.mark.parametrize("name", ["windowed", "weight_fifo", "ready_first"])
def test_nothing_is_stale_early_on(name):
    sampler, buf = make(name, 3)
    add(buf, 0, 2)
    assert sampler.evict(2) == []  # lo = max(0, 2 - 3) = 0


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_evict_never_touches_pending_slots(name):
    sampler, buf = make(name, 0)
    pending = add(buf, 0, 3, ready=False, target=0)
    assert sampler.evict(50) == [] and ids(buf) == pending


# ---------------------------------------------------------------------------------------------- explain
def mixed_buffer(name: str):
    """A buffer with one slot of every kind for ``name``'s policy, at T = 5."""
    sampler, buf = make(name, 1)
    if name == "in_order":
        add(buf, 2, 1, target=4)  # past target step: evicted
        add(buf, 2, 1, ready=False, target=4)  # pending, past
        add(buf, 3, 3, target=5)  # current step
        add(buf, 4, 1, ready=False, target=5)  # pending, current step
        add(buf, 4, 1, target=6)  # wrong target step
        add(buf, 5, 1)  # no target step
    else:
        add(buf, 2, 1)  # too stale (lo = 4) for windowed/weight_fifo
        add(buf, 3, 1, ready=False)  # pending, too stale
        add(buf, 4, 3)
        add(buf, 4, 1, ready=False)
        add(buf, 5, 1)
        add(buf, 6, 1)  # future version
    return sampler, buf


EXPECTED_CODES = {
    # (group_id -> code) at T = 5, min_groups=1, max_groups=2
    "windowed": ["too_stale", "pending", "selected", "selected", "beyond_max_groups", "pending", "beyond_max_groups",
                 "future_version"],
    "weight_fifo": ["too_stale", "pending", "selected", "selected", "beyond_max_groups", "pending",
                    "not_oldest_version", "future_version"],
    "in_order": ["past_target_step", "pending", "selected", "selected", "beyond_max_groups", "pending",
                 "wrong_target_step", "no_target_step"],
    "ready_first": ["selected", "pending", "selected", "beyond_max_groups", "beyond_max_groups", "pending",
                    "beyond_max_groups", "future_version"],
}


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_explain_gives_a_verdict_per_slot_and_agrees_with_evict_then_select(name):
    sampler, buf = mixed_buffer(name)
    before = state(buf), sampler.dispatch_index
    verdicts = sampler.explain(5, min_groups=1, max_groups=2)
    assert (state(buf), sampler.dispatch_index) == before  # explain changes nothing
    assert [v.group_id for v in verdicts] == ids(buf)
    assert [v.code for v in verdicts] == EXPECTED_CODES[name]
    for v, slot in zip(verdicts, buf):
        assert (v.weight_version, v.target_step, v.state) == (slot.weight_version, slot.target_step, slot.state)
        assert v.action in ("select", "evict", "keep") and v.reason
        assert (v.action == "select") == (v.code == "selected")
        assert v.state == "ready" or v.action == "keep"
    to_evict = [v.group_id for v in verdicts if v.action == "evict"]
    to_select = [v.group_id for v in verdicts if v.action == "select"]
    assert ids(sampler.evict(5)) == to_evict
    assert sorted(ids(sampler.select(5, 1, 2))) == sorted(to_select)


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_explain_below_min_groups(name):
    sampler, buf = mixed_buffer(name)
    verdicts = sampler.explain(5, min_groups=50, max_groups=60)
    waiting = [v for v in verdicts if v.code == "below_min_groups"]
    assert waiting and all(v.action == "keep" for v in waiting)
    assert "a chunk needs 50 group(s) (min_groups) and only" in waiting[0].reason
    assert "qualify: select waits" in waiting[0].reason
    assert not any(v.action == "select" for v in verdicts)
    assert sampler.select(5, 50, 60) is None


def test_explain_default_selects_every_candidate():
    sampler, buf = make("windowed", 1)
    add(buf, 0, 3)
    assert [v.action for v in sampler.explain(0)] == ["select"] * 3


def test_explain_reasons_are_readable():
    sampler, buf = mixed_buffer("windowed")
    by_id = verdicts_by_id(sampler.explain(5, 1, 2))
    assert by_id[0].reason == (
        "too stale: weight version 2 is older than the window [4, 5] (at most 1 version behind T=5)"
    )
    assert by_id[1].reason == (
        "pending (rollouts not committed yet) and already too stale (weight version 3 is older than the window "
        "[4, 5]): evicted once committed"
    )
    assert by_id[2].reason == (
        "selected as candidate #1 of 4: ready, weight version 4 is inside the window [4, 5], buffer order"
    )
    assert by_id[4].reason == (
        "eligible (candidate #3 of 4), but this chunk takes only the first 2 (max_groups): left for a later chunk"
    )
    assert by_id[7].reason == "future version: weight version 6 is newer than T=5, kept for a later step"


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_reasons_use_words_not_variable_names(name):
    """A person reads "older than the window [4, 5]", not ``lo`` or ``weight_version < 4``; the codes stay."""
    sampler, buf = mixed_buffer(name)
    add(buf, 6, 2, ready=False, target=7)
    for min_groups, max_groups in ((1, 2), (50, 60)):
        for verdict in sampler.explain(5, min_groups, max_groups):
            for jargon in ("lo ", "weight_version", "target_step", " < ", " > ", "==", "!=", "W="):
                assert jargon not in verdict.reason, (verdict.code, verdict.reason)


def test_explain_weight_fifo_says_what_it_waits_for():
    sampler, buf = make("weight_fifo", 1)
    add(buf, 1, 1)
    add(buf, 1, 2, ready=False)
    add(buf, 2, 3)
    by_id = verdicts_by_id(sampler.explain(2, min_groups=2, max_groups=4))
    assert by_id[0].code == "below_min_groups"
    assert "for the 2 pending group(s) of version 1" in by_id[0].reason
    assert by_id[3].code == "not_oldest_version" and "waits until version 1 is trained" in by_id[3].reason


def test_explain_in_order_says_what_it_waits_for():
    sampler, buf = make("in_order", 1)
    add(buf, 0, 1, target=3)
    add(buf, 0, 2, ready=False, target=3)
    by_id = verdicts_by_id(sampler.explain(3, min_groups=3, max_groups=3))
    assert by_id[0].code == "below_min_groups" and "2 pending group(s) made for step 3" in by_id[0].reason
    assert by_id[1].code == "pending"


def test_explain_freshest_first_numbers_candidates_in_its_order():
    sampler, buf = make("windowed", 1, freshest_first=True)
    add(buf, 0, 1)
    add(buf, 1, 1)
    by_id = verdicts_by_id(sampler.explain(1))
    assert "candidate #2 of 2" in by_id[0].reason and "candidate #1 of 2" in by_id[1].reason
    assert "freshest first" in by_id[1].reason


def test_explain_rejects_bad_chunk_bounds():
    sampler, buf = make("windowed")
    add(buf, 0, 2)
    with pytest.raises(ValueError, match="min_groups must be an int >= 1, got 0"):
        sampler.explain(0, min_groups=0)
    with pytest.raises(ValueError, match=r"max_groups must be an int >= min_groups \(3\), got 1"):
        sampler.explain(0, min_groups=3, max_groups=1)


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_decisions_carry_the_words_their_verdicts_give(name):
    """``select_reasoned``/``evict_reasoned``/``abort_reason`` (what the trace records) say what ``explain`` says."""
    for max_groups in (1, 2, 10):
        sampler, buf = mixed_buffer(name)
        said = {v.group_id: (v.action, v.reason) for v in sampler.explain(5, 1, max_groups)}
        evicted = sampler.evict_reasoned(5)
        chosen = sampler.select_reasoned(5, 1, max_groups)
        for (slot, reason), action in [*((e, "evict") for e in evicted), *((c, "select") for c in chosen)]:
            assert said[slot.group_id] == (action, reason)
        assert [gid for gid, (action, _) in said.items() if action != "keep"] == sorted(
            slot.group_id for slot, _ in evicted + chosen)
        assert sampler._candidate_count(5) == len(list(sampler._candidates(5)))
    sampler, buf = make(name, 1)
    add(buf, 0, 1)
    (verdict,) = sampler.explain(3)
    if verdict.action == "evict":
        assert sampler.abort_reason(buf.slots()[0], 3) == verdict.reason
    assert sampler.select_reasoned(3, 5, 5) is None and len(buf) == 1


def test_explain_frame_is_a_table():
    sampler, buf = mixed_buffer("weight_fifo")
    frame = explain_frame(sampler.explain(5, 1, 2))
    assert list(frame.columns) == ["group_id", "weight_version", "target_step", "state", "action", "code", "reason"]
    assert len(frame) == len(buf) and frame["action"].value_counts()["select"] == 2
    assert explain_frame([]).empty


def test_the_explain_frame_prints_every_reason_whole():
    """pandas cuts a cell at 50 characters; a verdict table printed in a script shows each reason in full."""
    sampler, buf = mixed_buffer("windowed")
    frame = explain_frame(sampler.explain(5, 1, 2))
    longest = max(frame.reason, key=len)
    assert len(longest) > 80
    for shown in (repr(frame), str(frame), frame.to_string(), repr(frame[frame.action == "select"]),
                  frame._repr_html_()):
        picked = frame.reason[frame.action == "select"].iloc[0]
        assert picked in shown and "..." not in shown
    assert longest in repr(frame)


# ------------------------------------------------------------------------------------- admission reasons
def test_a_refusal_says_why_in_the_policys_words():
    sampler, _ = make("weight_fifo", 1)
    assert sampler.explain_admission(0) == (
        "`weight_fifo` with max_staleness_versions=1 admits at most one batch ahead of T: batch 0 may go at T=0"
    )
    sampler.admit(0), sampler.admit(0)
    assert sampler.admit(0) is None
    assert sampler.explain_admission(0) == (
        "`weight_fifo` with max_staleness_versions=1 admits at most one batch ahead of T: batch 2 waits for T >= 1"
    )
    assert sampler.dispatch_index == 1  # explaining changes nothing
    assert "batch 2 may go at T=1" in sampler.explain_admission(1)

    in_order, _ = make("in_order", 0)
    in_order.admit(0)
    assert in_order.explain_admission(0) == (
        "`in_order` with max_lookahead_versions=0 admits no batch ahead of T: batch 1 (for step 1) waits for T >= 1"
    )
    ready_first, _ = make("ready_first", 3)
    assert "admits at most 3 batches ahead of T" in ready_first.explain_admission(0)
    windowed, _ = make("windowed", 1)
    assert windowed.explain_admission(0).startswith("`windowed` always admits")


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_explain_admission_agrees_with_admit(name):
    sampler, _ = make(name, 1)
    for T in (0, 0, 0, 1, 1, 2):
        said = sampler.explain_admission(T)
        assert ("waits for" in said) == (sampler.admit(T) is None), said


# ------------------------------------------------------------------------- registry and custom samplers
def test_protocol_owns_the_dispatch_index_and_one_explain_signature():
    assert {"dispatch_index", "name", "explain_admission"} <= protocol_members()
    explain = typing.get_type_hints(PromptGroupSampler.explain)
    assert list(explain) == ["trainer_version", "min_groups", "max_groups", "return"]
    for name in BUILT_IN:
        sampler, _ = make(name)
        assert sampler.window == 1 and sampler.lower_bound(3) == (0 if name == "ready_first" else 2)
        assert sampler.name == name


def test_every_built_in_policy_is_registered_once_by_its_name():
    assert list(samplers.SAMPLERS) == [cls.name for cls in samplers.BUILT_IN]
    for cls in samplers.BUILT_IN:
        assert cls.Knobs().name == cls.name
        assert cls.__name__ in samplers.__all__ and cls.Knobs.__name__ in samplers.__all__


def test_a_new_policy_registered_in_one_place_is_buildable_by_name(tmp_path):
    """Adding a policy: its own file, plus one entry in ``BUILT_IN``; config validation and errors follow."""
    import shutil
    from pathlib import Path

    package = Path(samplers.__file__).parents[1]
    shutil.copytree(package, tmp_path / "asyncrl", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "asyncrl" / "samplers" / "newest.py").write_text(
        "from typing import Literal\n"
        "from pydantic import Field\n"
        "from asyncrl.samplers.base import KnobModel, SamplerBase\n\n"
        "class NewestConfig(KnobModel):\n"
        "    name: Literal['newest'] = 'newest'\n"
        "    max_staleness_versions: int = Field(1, ge=0, strict=True)\n\n"
        "class NewestSampler(SamplerBase):\n"
        "    name = 'newest'\n"
        "    Knobs = NewestConfig\n\n"
        "    def _candidates(self, T):\n"
        "        index = self.buffer.by_version\n"
        "        for v in reversed(index.keys_between(self.lower_bound(T), T)):\n"
        "            yield from index.ready[v]\n"
    )
    init = tmp_path / "asyncrl" / "samplers" / "__init__.py"
    text = init.read_text()
    anchor = "BUILT_IN: tuple[type[SamplerBase], ...] = ("
    assert text.count(anchor) == 1
    init.write_text(text.replace(anchor, "from asyncrl.samplers.newest import NewestSampler  # noqa: E402\n"
                                         + anchor + "NewestSampler, "))
    code = (
        "from asyncrl.buffer import ReplayBuffer\n"
        "from asyncrl.samplers import build_sampler\n"
        "from asyncrl.config import load_config\n"
        "buf = ReplayBuffer()\n"
        "s = build_sampler({'name': 'newest', 'max_staleness_versions': 2}, buf)\n"
        "[buf.commit(buf.reserve(v), None) for v in (0, 1, 2)]\n"
        "print(type(s).__name__, s.window, [g.group_id for g in s.select(2, 1, 3)])\n"
        "print(load_config('quickstart', sampler={'name': 'newest'}).sampler)\n"
        "try:\n"
        "    build_sampler({'name': 'nope'}, buf)\n"
        "except Exception as e:\n"
        "    print('newest' in str(e))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["NewestSampler 2 [2, 1, 0]", "name='newest' max_staleness_versions=1", "True"]


@pytest.fixture
def my_sampler(monkeypatch):
    """``notebooks/my_sampler.py``, the custom sampler the docs and notebooks show."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "notebooks"))
    import my_sampler

    return my_sampler


def test_the_notebooks_custom_sampler_is_short_and_complete(my_sampler):
    import inspect

    source = inspect.getsource(my_sampler)
    code = [line for line in source.split('"""')[-1].splitlines() if line.strip()]
    assert len(code) <= 20, len(code)  # SamplerBase carries the rest
    buf = ReplayBuffer()
    sampler = build_sampler({"name": "custom", "target": "my_sampler:NewestFirst", "max_lag": 1}, buf)
    assert isinstance(sampler, PromptGroupSampler) and sampler.window == 1 and sampler.lower_bound(3) == 2
    assert sampler.required_buffer_capacity(8) == 16 and not sampler.is_on_policy
    add(buf, 0, 2)
    add(buf, 1, 1)
    add(buf, 2, 2)
    add(buf, 2, 1, ready=False)
    by_id = verdicts_by_id(sampler.explain(2, 1, 2))
    assert [by_id[g].code for g in range(6)] == [
        "too_stale", "too_stale", "beyond_max_groups", "selected", "selected", "pending"
    ]
    assert by_id[3].reason.endswith("newest first")
    assert ids(sampler.evict(2)) == [0, 1]
    assert ids(sampler.select(2, 1, 2)) == [3, 4]
    with pytest.raises(ValueError, match=r"unknown knob\(s\) \['lag'\] for sampler 'NewestFirstKnobs'"):
        build_sampler({"name": "custom", "target": "my_sampler:NewestFirst", "lag": 1}, buf)


@pytest.mark.parametrize("sampler", [
    {"name": "in_order", "max_lookahead_versions": 1},
    {"name": "windowed", "max_staleness_versions": 1},
    {"name": "custom", "target": f"{FIXTURE}:NewestFirstSampler", "boost": 1},
], ids=["in_order", "windowed", "custom"])
def test_a_run_builds_its_sampler_once_in_the_controller(sampler, monkeypatch):
    """Loading and checking the configuration builds none (with importance_correction 'none' too); the controller
    builds the one it follows."""
    from asyncrl import Controller, load_config

    built = []
    original = samplers.SamplerBase.__init__

    def counting(self, buffer, **knobs):
        built.append(buffer)
        original(self, buffer, **knobs)

    monkeypatch.setattr(samplers.SamplerBase, "__init__", counting)
    loss = {"importance_correction": "none", "truncation": "none"} if sampler["name"] == "in_order" else {}
    cfg = load_config("quickstart", sampler={**sampler, **({"max_lookahead_versions": 0} if loss else {})},
                      loss=loss, generation={"backend": "simulated"}, trainer={"backend": "simulated"})
    assert built == []
    with Controller.from_config(cfg) as ctrl:
        assert built == [ctrl.buffer] and ctrl.sampler.buffer is ctrl.buffer
        ctrl.tick()
    assert len(built) == 1
