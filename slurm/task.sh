#!/usr/bin/env bash
# One rank of a torch.distributed job, started by `srun` (one task per GPU). Maps
# Slurm's task variables onto the ones torch.distributed reads, then becomes CMD:
#   RANK=SLURM_PROCID  WORLD_SIZE=SLURM_NTASKS  LOCAL_RANK=SLURM_LOCALID
#   LOCAL_WORLD_SIZE=tasks on this node  GROUP_RANK=SLURM_NODEID
# MASTER_ADDR/MASTER_PORT come from the batch script (slurm/lib.sh: mlev_rendezvous).
# Every task sees all GPUs of its node and picks cuda:LOCAL_RANK (no --gpu-bind).
set -euo pipefail
: "${SLURM_PROCID:?slurm/task.sh runs under srun}" "${MASTER_ADDR:?MASTER_ADDR not set}" "${MASTER_PORT:?}"
export RANK=$SLURM_PROCID
export WORLD_SIZE=${SLURM_NTASKS:-${SLURM_NPROCS:?}}
export LOCAL_RANK=${SLURM_LOCALID:-0}
export GROUP_RANK=${SLURM_NODEID:-0}
# Tasks per node, run-length encoded by Slurm: "4(x2)" or "3,2" or "2(x3),1"; pick this node's entry.
counts=()
IFS=, read -ra groups <<<"${SLURM_STEP_TASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-1}}"
for group in "${groups[@]}"; do
    repeat=1
    [[ $group == *"(x"* ]] && { repeat=${group#*(x}; repeat=${repeat%)}; }
    for ((i = 0; i < repeat; i++)); do counts+=("${group%%(*}"); done
done
export LOCAL_WORLD_SIZE=${counts[$GROUP_RANK]:-${counts[0]}}
echo "[task] rank $RANK/$WORLD_SIZE local_rank $LOCAL_RANK/$LOCAL_WORLD_SIZE node ${SLURMD_NODENAME:-?}" \
    "(node_id $GROUP_RANK) restart ${SLURM_RESTART_COUNT:-0} pid $$"
exec "$@"
