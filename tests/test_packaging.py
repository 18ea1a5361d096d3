"""The install story: pyproject.toml declares dependencies once; environment.yml, the Makefile and CI install
that same project; the package imports without its optional parts."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ENV = yaml.safe_load((ROOT / "environment.yml").read_text())
MAKEFILE = (ROOT / "Makefile").read_text()


def env_pip_lines() -> list[str]:
    for dep in ENV["dependencies"]:
        if isinstance(dep, dict) and "pip" in dep:
            return dep["pip"]
    raise AssertionError("environment.yml has no pip section")


def extras_of(line: str) -> set[str]:
    match = re.search(r"\.\[([^\]]*)\]", line)
    return set(match.group(1).split(",")) if match else set()


def test_environment_yml_installs_this_project_with_the_same_extras_as_make_test():
    project_lines = [line for line in env_pip_lines() if line.startswith("-e .")]
    assert len(project_lines) == 1, "environment.yml must install the project itself, once"
    make_extras = set(re.search(r"^EXTRAS \?= (.*)$", MAKEFILE, re.M).group(1).split(","))
    assert extras_of(project_lines[0]) == make_extras
    assert make_extras <= set(PYPROJECT["project"]["optional-dependencies"])


def test_environment_yml_declares_no_dependency_of_its_own_besides_python_pip_and_torch():
    conda = [d for d in ENV["dependencies"] if isinstance(d, str)]
    assert {d.split("=")[0] for d in conda} == {"python", "pip"}
    others = [line for line in env_pip_lines() if not line.startswith("-e .")]
    assert others == ["torch==2.13.0"]


def test_python_and_torch_pins_satisfy_the_project_ranges():
    python = next(d for d in ENV["dependencies"] if isinstance(d, str) and d.startswith("python="))
    assert Version(python.split("=")[1]) in SpecifierSet(PYPROJECT["project"]["requires-python"]) or \
        SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(python.split("=")[1] + ".0")
    torch_req = next(Requirement(r) for r in PYPROJECT["project"]["dependencies"] if r.startswith("torch"))
    assert torch_req.specifier.contains("2.13.0")
    assert not str(torch_req.specifier).startswith("=="), "keep the package's torch requirement a range"
    assert "pip install -q torch==2.13.0" in MAKEFILE


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and re.search(r"^make test$", ci, re.M)


def _imports_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_asyncrl_imports_without_jupyter_and_ray():
    heavy = {"ipywidgets", "IPython", "ipykernel", "jupyter_client", "matplotlib", "ray", "widgets", "vllm",
             "megatron"}
    assert not heavy & _imports_after("import asyncrl; asyncrl.Controller; asyncrl.load_config")


def test_samplers_import_without_torch():
    assert not {"torch", "ray", "ipywidgets", "IPython", "transformers"} & _imports_after("import asyncrl.samplers")
