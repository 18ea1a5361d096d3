"""Execute a notebook top to bottom with nbclient, as Jupyter would, and write what happened as JSON: what
``tests/gpu/run_gpu.sh notebook`` runs on a lent GPU machine for ``notebooks/gpu_quickstart.ipynb`` (issue 48), and
what runs the CPU ``notebooks/quickstart.ipynb`` the same way (tests/test_run_notebook.py).

    python tests/gpu/run_notebook.py NOTEBOOK --out DIR [--timeout SECONDS_PER_CELL]

The kernel is ipykernel's own ``python3`` (this interpreter, ``-m ipykernel_launcher``), started in the notebook's
folder with this process's environment, so ``PYTHONPATH`` (a ``pip install --target`` folder, the project) reaches
it. Cells run one at a time until the first error. ``DIR`` receives ``<name>.summary.json`` (below) and
``<name>.executed.ipynb`` (the notebook with its outputs). Exit status 0 when every code cell ran, 1 otherwise.

Summary keys: ``notebook``, ``cells`` (code cells), ``cells_run`` (ran without error), ``seconds`` (the whole
execution, the kernel's start included), ``kernel_start_s``, ``cell_seconds`` (one per code cell run),
``reward_first``, ``reward_last``, ``accuracy``, ``constant_answer_accuracy`` (from the last line the notebook
prints as ``reward A -> B | held-out accuracy C (best constant answer D)``, None where it prints none),
``final_line`` (that line), ``error`` (None, or the failing cell's index, its error's name and value)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

RESULT = re.compile(r"reward (?P<reward_first>-?[\d.]+) -> (?P<reward_last>-?[\d.]+).*?accuracy "
                    r"(?P<accuracy>-?[\d.]+)(?:.*?best constant answer (?P<constant_answer_accuracy>-?[\d.]+))?")


def printed(cell) -> str:
    """What a code cell printed (its stream outputs)."""
    return "".join(out.get("text", "") for out in cell.get("outputs", []) if out.get("output_type") == "stream")


def final_numbers(cells) -> dict:
    """The numbers of the last ``reward A -> B ... accuracy C`` line any cell printed."""
    found = {"final_line": None, "reward_first": None, "reward_last": None, "accuracy": None,
             "constant_answer_accuracy": None}
    for cell in cells:
        for line in printed(cell).splitlines():
            match = RESULT.search(line)
            if match:
                found = {"final_line": line.strip(),
                         **{k: None if v is None else float(v) for k, v in match.groupdict().items()}}
    return found


def run(notebook: Path, out: Path, timeout: int) -> dict:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    for name, sub in (("JUPYTER_RUNTIME_DIR", "runtime"), ("IPYTHONDIR", "ipython")):  # a bare machine's HOME
        os.environ.setdefault(name, os.path.join(tempfile.gettempdir(), "asyncrl-jupyter", sub))
        os.makedirs(os.environ[name], exist_ok=True)
    nb = nbformat.read(notebook, as_version=4)
    code = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"]
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(notebook.parent)}})
    summary = {"notebook": str(notebook), "cells": len(code), "cells_run": 0, "cell_seconds": [], "error": None,
               "python": sys.executable}
    start = time.perf_counter()
    try:
        with client.setup_kernel():
            summary["kernel_start_s"] = round(time.perf_counter() - start, 2)
            for index in code:
                t0 = time.perf_counter()
                try:
                    client.execute_cell(nb.cells[index], index)
                finally:
                    summary["cell_seconds"].append(round(time.perf_counter() - t0, 2))
                summary["cells_run"] += 1
    except CellExecutionError as exc:
        summary["error"] = {"cell": index, "name": getattr(exc, "ename", type(exc).__name__),
                            "value": str(getattr(exc, "evalue", exc))[:2000]}
    except Exception as exc:  # noqa: BLE001 - a kernel that dies or times out: the summary says so, and how far it got
        summary["error"] = {"cell": code[summary["cells_run"]] if summary["cells_run"] < len(code) else None,
                            "name": type(exc).__name__, "value": str(exc)[:2000]}
    summary["seconds"] = round(time.perf_counter() - start, 2)
    summary.update(final_numbers(nb.cells))
    out.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out / f"{notebook.stem}.executed.ipynb")
    (out / f"{notebook.stem}.summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="folder for the summary and the executed notebook")
    parser.add_argument("--timeout", type=int, default=600, help="seconds one cell may take (default 600)")
    args = parser.parse_args(argv)
    if not args.notebook.is_file():
        print(f"run_notebook: {args.notebook} is not a notebook file", file=sys.stderr)
        return 2
    summary = run(args.notebook.resolve(), args.out, args.timeout)
    shown = {k: v for k, v in summary.items() if k != "cell_seconds"}
    print(json.dumps(shown, indent=1), flush=True)
    return 0 if summary["error"] is None and summary["cells_run"] == summary["cells"] else 1


if __name__ == "__main__":
    sys.exit(main())
