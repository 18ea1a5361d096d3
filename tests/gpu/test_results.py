"""The GPU tests' results helper (tests/gpu/results.py) runs without a GPU: what a GPU run writes is checked here."""

from __future__ import annotations

import json

from tests.gpu.results import Results


def test_record_prints_each_number_and_writes_the_file_so_far(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ASYNCRL_GPU_RESULTS", str(tmp_path / "out"))
    r = Results("demo", positions=3)
    r.record("speed", {"fused": 1.5})
    r.record("ok", True)
    assert capsys.readouterr().out.splitlines() == ['RESULT speed = {"fused": 1.5}', "RESULT ok = true"]
    saved = json.loads((tmp_path / "out" / "demo.json").read_text())
    assert saved["positions"] == 3 and saved["speed"] == {"fused": 1.5} and saved["ok"] is True
    assert set(saved) >= {"machine", "date"}


def test_without_the_folder_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("ASYNCRL_GPU_RESULTS", raising=False)
    monkeypatch.chdir(tmp_path)
    Results("demo").record("x", 1)
    assert list(tmp_path.iterdir()) == []
