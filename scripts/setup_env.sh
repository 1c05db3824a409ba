#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install megatron-lev.
#
#   scripts/setup_env.sh            # CPU set-up: torch CPU build + package + dev/hf/eval extras
#   VENV=/path/env scripts/setup_env.sh
#   EXTRAS=dev,hf,eval,gpu scripts/setup_env.sh   # on a CUDA machine with torch already in the env
#
# On a GPU cluster, create the environment with the CUDA torch you already use and
# set TORCH_SPEC=keep: the installed torch is then pinned and never replaced.
# On a CPU-only machine the default installs torch==${TORCH_VERSION} (set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu where PyPI would hand you a CUDA build).
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-dev,hf,eval}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_SPEC=${TORCH_SPEC:-torch==${TORCH_VERSION}}
PY=${PYTHON:-python3}

stamp="$VENV/.megatron-lev-setup"
want="$(cat pyproject.toml requirements/cpu-constraints.txt | sha1sum | cut -c1-16) extras=$EXTRAS"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import megatron_lev, torch, deepspeed" 2>/dev/null; then
    echo "[setup] environment $VENV is up to date"
    exit 0
fi

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment $VENV"
    "$PY" -m venv "$VENV"
fi
pip_() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }
pip_ --upgrade "pip>=24" "setuptools>=64" wheel

if [ "$TORCH_SPEC" != "keep" ]; then
    if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        echo "[setup] installing $TORCH_SPEC"
        if [ -n "${TORCH_INDEX_URL:-}" ]; then
            pip_ "$TORCH_SPEC" --extra-index-url "$TORCH_INDEX_URL"
        else
            pip_ "$TORCH_SPEC"
        fi
    fi
fi
installed=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
constraints="$VENV/torch-constraint.txt"
echo "torch==$installed" > "$constraints"
echo "[setup] torch $installed pinned; installing megatron-lev[$EXTRAS]"
DS_BUILD_OPS=0 pip_ -e ".[$EXTRAS]" -c "$constraints"
echo "$want" > "$stamp"
echo "[setup] done in $(( $(date +%s) - start )) s"
