"""Write docs/config.md, the configuration reference: every key of ``asyncrl.config.Config`` with its type, default
and description, read off the pydantic models (a section per model; a section with variants, such as
``generation`` chosen by ``backend``, a table per variant). ``tests/test_config_doc.py`` fails when the file is
not what this script writes, or when a key has no description.

    PYTHONPATH=. python docs/make_config.py          # rewrite docs/config.md
"""

from __future__ import annotations

import inspect
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "config.md"

HEADER = """# Configuration reference

Every key of a run's configuration (`asyncrl.config.Config`): a preset or YAML file with overrides
(`load_config("quickstart", seed=1, trainer={"lr": 1e-4})`), or `asyncrl run ... --set key.sub=value`. Generated from the pydantic models by
`python docs/make_config.py`; `tests/test_config_doc.py` checks that this file is current and that every key is
described. An unknown key is an error that lists the allowed ones; a bad value is one line naming it.
"""


def _variants(annotation: Any) -> list[type[BaseModel]]:
    """The models a field's annotation allows (one for a section, several for a discriminated union)."""
    found: list[type[BaseModel]] = []

    def visit(a: Any) -> None:
        if isinstance(a, type) and issubclass(a, BaseModel):
            if a not in found:
                found.append(a)
            return
        for arg in typing.get_args(a):
            visit(arg)

    visit(annotation)
    return found


def _type(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin)).replace("Callable", "function")
        return f"{name}[{', '.join(_type(a) for a in args)}]" if args else name
    if annotation is Any:
        return "any"
    if annotation in (inspect.Parameter.empty, None):
        return "any"
    return getattr(annotation, "__name__", str(annotation)).replace("Callable", "function")


def _bounds(field: Any) -> str:
    words = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    out = []
    for item in field.metadata:
        for attr, sign in words.items():
            value = getattr(item, attr, None)
            if value is not None:
                out.append(f"{sign} {value}")
    return f"({', '.join(out)})" if out else ""


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section)"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _doc(model: type[BaseModel]) -> str:
    return " ".join((inspect.getdoc(model) or "").split("\n\n")[0].split())


def _table(model: type[BaseModel], prefix: str, chooser: str | None = None
           ) -> tuple[list[str], list[tuple[str, type[BaseModel] | list]]]:
    """The rows of ``model``'s plain keys, and its sections (key, models) to describe after it. ``chooser``: the
    key that picks this variant of its section (described as such when it has no description of its own)."""
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    sections = []
    for name, field in model.model_fields.items():
        variants = _variants(field.annotation)
        if variants:
            sections.append((prefix + name, variants))
            rows.append(f"| `{prefix}{name}` | section | {_default(field)} | "
                        f"{_cell(field.description or _doc(variants[0]) if len(variants) == 1 else field.description or '')}"
                        f"{' (one of ' + str(len(variants)) + ' variants: below)' if len(variants) > 1 else ' (below)'} |")
            continue
        description = field.description or (f"chooses this variant of `{prefix[:-1]}`" if name == chooser else "")
        bounds = _bounds(field)
        rows.append(f"| `{prefix}{name}` | `{_cell(_type(field.annotation))}`{' ' + _cell(bounds) if bounds else ''} | "
                    f"`{_cell(_default(field))}` | {_cell(description)} |")
    return rows, sections


def _discriminator(variants: list[type[BaseModel]]) -> str | None:
    for key in ("backend", "name"):
        if all(key in v.model_fields and typing.get_origin(v.model_fields[key].annotation) is typing.Literal
               for v in variants):
            return key
    return None


def render() -> str:
    from asyncrl.config import Config

    lines = [HEADER, "## Top level", "", _doc(Config), ""]
    rows, sections = _table(Config, "")
    lines += rows + [""]
    while sections:
        key, variants = sections.pop(0)
        nested = []
        if len(variants) == 1:
            lines += [f"## `{key}`", "", f"{_doc(variants[0])} (`{variants[0].__name__}`)", ""]
            rows, nested = _table(variants[0], key + ".")
            lines += rows + [""]
        else:
            by = _discriminator(variants)
            lines += [f"## `{key}`", "", f"One of {len(variants)} variants, chosen by `{key}.{by}`.", ""]
            for variant in variants:
                tag = typing.get_args(variant.model_fields[by].annotation)[0] if by else variant.__name__
                lines += [f"### `{key}` with `{by}: {tag}`", "", f"{_doc(variant)} (`{variant.__name__}`)", ""]
                rows, more = _table(variant, key + ".", by)
                lines += rows + [""]
                nested += more
        sections = nested + sections
    return "\n".join(lines).rstrip() + "\n"


def undescribed() -> list[str]:
    """Keys with no description (``tests/test_config_doc.py`` asks for none)."""
    return [line.split("`")[1] for line in render().splitlines()
            if line.startswith("| `") and line.rstrip().endswith("|  |")]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    OUT.write_text(render())
    print(f"wrote {OUT.relative_to(ROOT)} ({len(render().splitlines())} lines)")
    missing = undescribed()
    if missing:
        print(f"{len(missing)} key(s) without a description: {', '.join(missing)}")
