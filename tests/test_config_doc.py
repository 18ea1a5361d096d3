"""docs/config.md, the configuration reference, is what docs/make_config.py generates from the pydantic models
today: a key added, renamed or re-described without regenerating it fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("make_config", ROOT / "docs" / "make_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_is_current():
    current = (ROOT / "docs" / "config.md").read_text()
    assert current == _generator().render(), "docs/config.md is stale: run PYTHONPATH=. python docs/make_config.py"


def test_the_reference_lists_every_key_with_its_type_and_default():
    from asyncrl.config import Config

    text = _generator().render()
    for name, field in Config.model_fields.items():
        assert f"| `{name}` |" in text, name
    assert "| `generation.max_new_tokens` | `int` (≥ 1) | `4` | completion length limit" in text
    assert "### `trainer` with `backend: megatron`" in text and "| `task.options` | `dict[str, any]` | `{}` |" in text
    assert "| `filter_uniform_groups` | `bool` | `false` | skip a group whose completions all got the same reward" in text


def test_every_key_has_a_description():
    missing = _generator().undescribed()
    assert not missing, f"keys without a description (give their Field a description=...): {missing}"
