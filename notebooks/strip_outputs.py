"""Store an executed notebook the way this repository keeps notebooks: outputs stripped, except the cells marked
``# NBVAL_CHECK_OUTPUT`` (deterministic text that nbval --nbval-lax compares on every test run).

After editing a notebook::

    cd notebooks && jupyter nbconvert --to notebook --execute quickstart.ipynb --output-dir /tmp/nb \\
        && python strip_outputs.py /tmp/nb/quickstart.ipynb quickstart.ipynb
"""

from __future__ import annotations

import sys

import nbformat

MARK = "# NBVAL_CHECK_OUTPUT"


def strip(source: str, target: str) -> None:
    nb = nbformat.read(source, as_version=4)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        if MARK in cell.source:
            for output in cell.outputs:
                if output.get("output_type") != "stream" and set(output.get("data", {})) - {"text/plain"}:
                    raise SystemExit(f"checked cell has rich output, keep it to printed text:\n{cell.source}")
        else:
            cell.outputs, cell.execution_count = [], None
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    nbformat.validate(nb)
    nbformat.write(nb, target)


if __name__ == "__main__":
    strip(*sys.argv[1:3])
