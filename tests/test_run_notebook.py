"""``tests/gpu/run_notebook.py`` (what ``tests/gpu/run_gpu.sh notebook`` runs on a lent GPU machine for
``notebooks/gpu_quickstart.ipynb``) on the CPU: a notebook runs top to bottom in an ipykernel that sees this
process's ``PYTHONPATH`` from the notebook's folder, and its summary says how many cells ran, the final reward and
accuracy line, and the first error, which stops it; ``run_gpu.sh``'s part runs it the same way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
import nbformat  # noqa: E402

from tests.gpu.run_notebook import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LINE = "reward 0.112 -> 0.547 | held-out accuracy 0.81 (best constant answer 0.20)"


def notebook(path: Path, *cells: str) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# a notebook")]
                                  + [nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def test_a_notebook_runs_top_to_bottom_and_its_final_numbers_are_read(tmp_path, capsys):
    nb = notebook(tmp_path / "nb" / "ok.ipynb", "import os, asyncrl\nprint(os.getcwd())",
                  f"print('step 40')\nprint({LINE!r})")
    assert main([str(nb), "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "ok.summary.json").read_text())
    assert (summary["cells"], summary["cells_run"], summary["error"]) == (2, 2, None)
    assert len(summary["cell_seconds"]) == 2 and summary["seconds"] >= summary["kernel_start_s"] > 0
    assert (summary["reward_first"], summary["reward_last"], summary["accuracy"],
            summary["constant_answer_accuracy"]) == (0.112, 0.547, 0.81, 0.2)
    assert summary["final_line"] == LINE
    executed = nbformat.read(tmp_path / "out" / "ok.executed.ipynb", as_version=4)
    assert executed.cells[1].outputs[0]["text"].strip() == str(nb.parent)  # started in the notebook's folder
    assert '"cells_run": 2' in capsys.readouterr().out


def test_the_first_error_stops_the_notebook_and_is_named(tmp_path):
    nb = notebook(tmp_path / "bad.ipynb", "x = 1", "raise ValueError('the reward did not rise')", "print('never')")
    assert main([str(nb), "--out", str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "bad.summary.json").read_text())
    assert summary["cells_run"] == 1 and summary["cells"] == 3
    assert summary["error"]["cell"] == 2 and summary["error"]["name"] == "ValueError"  # cell 0 is the markdown
    assert "the reward did not rise" in summary["error"]["value"]
    assert summary["accuracy"] is None and summary["final_line"] is None


def test_run_gpu_sh_s_notebook_part_runs_it(tmp_path):
    nb = notebook(tmp_path / "nb" / "part.ipynb", f"print({LINE!r})")
    here = Path(sys.executable).parent  # run_gpu.sh calls python3: this interpreter's, first on PATH
    if shutil.which("python3", path=str(here)) is None:
        pytest.skip(f"no python3 beside {sys.executable}")
    env = {**os.environ, "NOTEBOOK": str(nb), "PATH": f"{here}:{os.environ['PATH']}"}
    env.pop("SITE", None)
    out = tmp_path / "out"
    done = subprocess.run(["bash", "tests/gpu/run_gpu.sh", str(out), "notebook"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert "=== notebook: rc=0" in done.stdout, done.stdout + done.stderr
    summary = json.loads((out / "part.summary.json").read_text())
    assert summary["cells_run"] == 1 and summary["accuracy"] == 0.81
    assert (out / "part.executed.ipynb").exists() and (out / "notebook.log").exists()
