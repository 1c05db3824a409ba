#!/usr/bin/env bash
# The training entry point on one machine without Slurm: torchrun, one process per GPU.
#
#   scripts/torchrun_local.sh --config pretrain/configs/tiny.yaml data.data_path=[data/x_text_document] \
#       data.tokenizer_path=tok.json train.save=ckpt/tiny
#   NPROC=2 scripts/torchrun_local.sh --config ...      # two CPU processes (gloo) on a machine without GPUs
#
# NPROC defaults to the number of visible GPUs (1 without GPUs). torchrun picks a free
# rendezvous port (--standalone), so several runs can share a machine. Like the Slurm
# script it uses MEGATRON_LEV_PYTHON, else .venv/bin/python, else python; ENTRY replaces
# "-m megatron_lev train". Started again with the same train.save, a run resumes from
# its latest checkpoint.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${MEGATRON_LEV_PYTHON:-}" ]; then
    python=$MEGATRON_LEV_PYTHON
elif [ -x "$root/.venv/bin/python" ]; then
    python=$root/.venv/bin/python
else
    python=python
fi
[ $# -gt 0 ] || { echo "usage: $0 --config FILE [section.key=value ...]" >&2; exit 2; }
if [ -z "${NPROC:-}" ]; then
    NPROC=$("$python" -c "import torch; print(max(1, torch.cuda.device_count()))")
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
read -ra entry <<<"${ENTRY:--m megatron_lev train}"
echo "[torchrun_local] $NPROC process(es), python $python"
exec "$python" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" "${entry[@]}" "$@"
