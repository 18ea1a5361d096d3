"""tests/gpu/conftest.py's check that each GPU file gives the card back, run without a GPU: the device's memory
and the release are stood in for, so what the check decides (and records) is what is tested here."""

from __future__ import annotations

import json

import pytest

from tests.gpu import conftest


@pytest.fixture
def card(monkeypatch, tmp_path):
    """A card whose memory in use is ``state["used"]`` GiB; a shallow release frees ``state["shallow"]`` GiB, a deep
    one ``state["deep"]`` more; gpu_memory.json goes to tmp_path."""
    state = {"used": 0.0, "shallow": 0.0, "deep": 0.0, "releases": []}

    def release(deep):
        state["releases"].append(deep)
        state["used"] -= state["deep"] if deep else state["shallow"]

    monkeypatch.setattr(conftest, "used_gib", lambda: state["used"])
    monkeypatch.setattr(conftest, "release", release)
    monkeypatch.setattr(conftest, "_RESULTS", [])
    monkeypatch.setenv("ASYNCRL_GPU_RESULTS", str(tmp_path))
    return state


def test_a_file_that_gives_its_engines_back_passes_after_a_shallow_release(card, tmp_path):
    card.update(used=1.5 + 30.0, shallow=30.0)  # 30 GiB still cached by torch until emptied
    assert conftest.give_back("test_gap", 1.5) == {"used_gib_before": 1.5, "used_gib_after": 1.5,
                                                   "deep_release": False}
    assert card["releases"] == [False]
    saved = json.loads((tmp_path / "gpu_memory.json").read_text())
    assert saved["gpu_memory_test_gap"]["used_gib_after"] == 1.5 and saved["held_gib_allowed"] == conftest.HELD_GIB


def test_what_only_the_deep_release_frees_is_freed_and_said(card):
    card.update(used=1.0 + 20.0, shallow=0.0, deep=19.5)  # e.g. a compiled model's parameters, process groups
    assert conftest.give_back("test_megatron_vllm", 1.0)["deep_release"] is True
    assert card["releases"] == [False, True]


def test_a_file_that_keeps_an_engines_pool_fails_naming_how_much(card, tmp_path):
    card.update(used=1.0 + 20.6)  # what test_gap kept on the H100 (vLLM's pool at gpu_memory_utilization 0.25)
    with pytest.raises(AssertionError, match=r"test_gap left 20\.6 GiB of GPU memory held .*\(at most 3\.0 GiB"):
        conftest.give_back("test_gap", 1.0)
    assert card["releases"] == [False, True]  # both tried before it fails
    assert json.loads((tmp_path / "gpu_memory.json").read_text())["gpu_memory_test_gap"]["used_gib_after"] == 21.6


def test_every_file_lands_in_one_gpu_memory_json(card, tmp_path):
    for name in ("test_colocated_async", "test_gap"):
        conftest.give_back(name, 0.5)
    saved = json.loads((tmp_path / "gpu_memory.json").read_text())
    assert {"gpu_memory_test_colocated_async", "gpu_memory_test_gap"} <= set(saved)
