#!/bin/bash
# Stage, on a machine with network, the wheels a lent GPU machine needs to execute a notebook with nbclient: its
# image has matplotlib, psutil, pygments, python-dateutil, packaging, attrs and typing-extensions, and no Jupyter
# package (/work/.library/device/KINDS.md, "Python packages already there"). The versions are the ones the
# project's CPU environment runs its notebooks with (nbclient 0.11, ipykernel 7.4, ipywidgets 8.1); pyzmq is also in
# the vLLM stage, here so that this folder stands alone. ~13 MB of py3.12 manylinux / pure-Python wheels.
#
#   bash tests/gpu/stage_notebook.sh            (from the project checkout: writes .gpu-stage/nb, git-ignored)
#   NB_DIR=/elsewhere bash tests/gpu/stage_notebook.sh
#
# Then carry .gpu-stage/nb and, on the device, `SITE=/tmp/site NB_WHEELS=.gpu-stage/nb bash tests/gpu/run_gpu.sh
# OUT notebook` (docs/gpu.md, "Checks on a GPU machine").
set -euo pipefail
REPO=${REPO:-$(git rev-parse --show-toplevel)}
NB_DIR=${NB_DIR:-$REPO/.gpu-stage/nb}
PY=${PY:-python3}
mkdir -p "$NB_DIR"
WHEELS="nbclient==0.11.0 nbformat==5.11.1 fastjsonschema==2.22.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
 referencing==0.37.0 rpds-py==2026.9.1 jupyter-client==8.10.0 jupyter-core==5.9.1 platformdirs==4.14.9
 traitlets==5.16.1 tornado==6.6.1 pyzmq==27.3.0
 ipykernel==7.4.0 comm==0.2.3 debugpy==1.8.22 ipython==9.18.1 ipython-pygments-lexers==1.1.1 jedi==0.20.1 parso==0.8.7
 matplotlib-inline==0.2.2 nest-asyncio2==1.7.4 pexpect==4.9.0 ptyprocess==0.7.0 prompt-toolkit==3.0.53 wcwidth==0.9.4
 stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure-eval==0.2.4
 ipywidgets==8.1.9 widgetsnbextension==4.0.16 jupyterlab-widgets==3.0.17"
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$NB_DIR" $WHEELS
n=$(ls "$NB_DIR"/*.whl | wc -l)
expected=$(echo $WHEELS | wc -w)
[ "$n" -ge "$expected" ] || { echo "only $n of $expected wheels in $NB_DIR"; exit 1; }
du -sh "$NB_DIR"; echo "$n wheels in $NB_DIR"
