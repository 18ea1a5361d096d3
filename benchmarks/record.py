"""Where every benchmark writes its raw data, so a number in a README can be traced to a file and regenerated.

    from record import save
    save("bench_async", rows, results, name=None)   # -> benchmarks/data/bench_async/<UTC date-time>/

A run directory holds ``rows.csv`` (one row per measured repeat or cell, the raw figures) and ``meta.json``:
the bench, the command line, the UTC date, the commit (with ``dirty`` when the tree had changes), the machine
(CPU model, cores, load average before the run, GPUs) and the versions of the libraries that set the speed, plus
``results``: whatever the bench derived from its rows (ratios, targets met). ``benchmarks/report.py`` builds the
tables of ``benchmarks/README.md`` from these directories, never from numbers typed by hand.

``--out DIR`` on a bench overrides the directory (a GPU machine writes under ``$OUT`` and the files are copied
into ``benchmarks/data/<bench>/<name>/`` afterwards, unchanged).

The commit is this project's own, wherever the tree runs (a GPU machine gets a copy without ``.git``, maybe inside
another repository), taken from the first of: the ``ASYNCRL_COMMIT`` environment variable (its value as given,
``dirty`` unknown); the stamp file ``.asyncrl-commit`` at the tree's root, written in the checkout before the copy
(``python benchmarks/record.py --stamp``); git, only where the enclosing repository is this project (its top level
holds ``asyncrl/`` and a ``pyproject.toml`` naming asyncrl); else ``"unknown"``, never another repository's commit.
``commit_source`` says which.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "data"
STAMP = ".asyncrl-commit"  # at the tree's root: {"commit", "dirty", "stamped_utc"} (``--stamp`` writes it)
VERSIONED = ("torch", "transformers", "vllm", "megatron-core", "ray", "numpy", "pandas")


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in _run(["lscpu"]).splitlines()
                if line.startswith("Model name")), platform.processor())
    gpus = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "load_1min": round(os.getloadavg()[0], 2),
            "gpus": [g for g in gpus.splitlines() if g], "python": sys.version.split()[0],
            "platform": platform.platform()}


def versions() -> dict:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def _is_this_project(top: Path) -> bool:
    """Whether a directory is a checkout of this project: ``asyncrl/`` and a pyproject.toml naming it."""
    try:
        return (top / "asyncrl").is_dir() and re.search(
            r'^name\s*=\s*"asyncrl"', (top / "pyproject.toml").read_text(), re.M) is not None
    except OSError:
        return False


def git_commit(root: Path = ROOT) -> dict | None:
    """``{"commit", "dirty"}`` from git, if the repository enclosing ``root`` is this project and is ``root``
    itself (a copy of the tree inside another repository gets None, not that repository's commit)."""
    top = _run(["git", "-C", str(root), "rev-parse", "--show-toplevel"])
    if not top or Path(top).resolve() != root.resolve() or not _is_this_project(Path(top)):
        return None
    sha = _run(["git", "-C", str(root), "rev-parse", "HEAD"])
    dirty = bool(_run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"]))
    return {"commit": sha, "dirty": dirty} if sha else None


def commit(root: Path = ROOT) -> dict:
    """This project's commit (module docstring): ``commit``, ``dirty`` (None where unknown), ``commit_source``."""
    env = os.environ.get("ASYNCRL_COMMIT", "").strip()
    if env:
        return {"commit": env, "dirty": None, "commit_source": "ASYNCRL_COMMIT"}
    try:
        stamp = json.loads((root / STAMP).read_text())
        return {"commit": str(stamp["commit"]), "dirty": stamp.get("dirty"),
                "commit_source": f"{STAMP} (stamped {stamp.get('stamped_utc', 'at an unrecorded time')})"}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = git_commit(root)
    if found:
        return {**found, "commit_source": "git"}
    return {"commit": "unknown", "dirty": None, "commit_source": "none (no ASYNCRL_COMMIT, no stamp, no git checkout "
            "of this project)"}


def stamp(root: Path = ROOT) -> Path:
    """Write ``.asyncrl-commit`` at ``root`` from git (in the checkout, before the tree is copied elsewhere)."""
    found = git_commit(root)
    if not found:
        raise SystemExit(f"{root} is not a git checkout of asyncrl: nothing to stamp")
    path = root / STAMP
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    path.write_text(json.dumps({**found, "stamped_utc": now}) + "\n")
    return path


def meta(bench: str) -> dict:
    """What a run directory records about where and how it was made; take it before the run starts (the load
    average is the one before the bench loaded the machine)."""
    return {"bench": bench, "command": shlex.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **commit(), "machine": machine(), "versions": versions()}


def save(bench: str, rows, results: dict, *, before: dict | None = None, out: str | Path | None = None,
         name: str | None = None, files: dict[str, object] | None = None) -> Path:
    """Write ``rows`` (a DataFrame or a list of dicts) and ``meta.json`` into a run directory and return it.
    ``before`` is :func:`meta` taken before the run (else taken now); ``files`` maps extra file names to
    DataFrames (written as CSV) or JSON-able objects."""
    import pandas as pd

    info = before or meta(bench)
    if out is None:
        stamp = info["date_utc"].replace(":", "").replace("+0000", "Z")[:15] + "Z"
        out = DATA / bench / (name or stamp)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    frame.to_csv(out / "rows.csv", index=False)
    for fname, obj in (files or {}).items():
        if isinstance(obj, pd.DataFrame):
            obj.to_csv(out / fname, index=False)
        else:
            (out / fname).write_text(json.dumps(obj, indent=1, default=str) + "\n")
    (out / "meta.json").write_text(json.dumps({**info, "results": results}, indent=1, default=str) + "\n")
    return out


def load(run_dir: str | Path) -> tuple[dict, "pd.DataFrame"]:  # noqa: F821
    """(meta with results, rows) of a run directory."""
    import pandas as pd

    run_dir = Path(run_dir)
    return json.loads((run_dir / "meta.json").read_text()), pd.read_csv(run_dir / "rows.csv")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Stamp this checkout's commit for copies of the tree.")
    parser.add_argument("--stamp", action="store_true", help=f"write {STAMP} at the tree's root from git")
    if parser.parse_args().stamp:
        print(stamp())
    else:
        print(json.dumps(commit()))
