"""benchmarks/record.py records this project's own commit wherever the tree runs: a GPU machine gets a copy of the
tree without its .git, sometimes inside another repository, whose commit must never be taken for this project's."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_record(tree: Path):
    """The record module of the tree at ``tree`` (its ROOT is that tree)."""
    spec = importlib.util.spec_from_file_location(f"record_{abs(hash(tree))}", tree / "benchmarks" / "record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def copy_inside_another_repo(tmp_path, monkeypatch):
    """``other/`` a git repository with a commit of its own; ``other/asyncrl-copy/`` the project's files (record.py,
    pyproject.toml, asyncrl/ with one file), as an archive copy unpacked there would be."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    monkeypatch.delenv("ASYNCRL_COMMIT", raising=False)
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    (other / "README").write_text("another project\n")
    git(other, "add", "README")
    git(other, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "theirs")
    tree = other / "asyncrl-copy"
    (tree / "benchmarks").mkdir(parents=True)
    (tree / "asyncrl").mkdir()
    shutil.copy(ROOT / "benchmarks" / "record.py", tree / "benchmarks" / "record.py")
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    (tree / "asyncrl" / "__init__.py").write_text("")
    return tree, git(other, "rev-parse", "HEAD")


def test_a_copy_inside_another_repository_records_unknown_not_that_repositorys_commit(copy_inside_another_repo):
    tree, theirs = copy_inside_another_repo
    got = load_record(tree).commit()
    assert got["commit"] == "unknown" and got["commit"] != theirs and got["dirty"] is None
    assert "no git checkout of this project" in got["commit_source"]


def test_the_environment_variable_names_the_commit_first(copy_inside_another_repo, monkeypatch):
    tree, _ = copy_inside_another_repo
    (tree / ".asyncrl-commit").write_text(json.dumps({"commit": "from-the-stamp", "dirty": False}))
    monkeypatch.setenv("ASYNCRL_COMMIT", "16e7086")
    assert load_record(tree).commit() == {"commit": "16e7086", "dirty": None, "commit_source": "ASYNCRL_COMMIT"}


def test_a_stamp_written_in_the_checkout_travels_with_the_copy(copy_inside_another_repo, tmp_path):
    tree, theirs = copy_inside_another_repo
    checkout = tmp_path / "checkout"  # a git checkout of the project: what --stamp reads
    shutil.copytree(tree, checkout)
    git(checkout, "init", "-q")
    git(checkout, "add", "-A")
    git(checkout, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "ours")
    ours = git(checkout, "rev-parse", "HEAD")
    record = load_record(checkout)
    assert record.commit() == {"commit": ours, "dirty": False, "commit_source": "git"}
    stamp = record.stamp(checkout)
    shutil.copy(stamp, tree / ".asyncrl-commit")  # the copy carries the stamp
    got = load_record(tree).commit()
    assert got["commit"] == ours != theirs and got["dirty"] is False and got["commit_source"].startswith(
        ".asyncrl-commit (stamped 20")
    assert load_record(tree).meta("demo")["commit"] == ours  # what a run directory's meta.json records


def test_stamping_outside_a_checkout_of_the_project_refuses(copy_inside_another_repo):
    tree, _ = copy_inside_another_repo
    with pytest.raises(SystemExit, match="not a git checkout of asyncrl"):
        load_record(tree).stamp(tree)
    assert not (tree / ".asyncrl-commit").exists()
