"""The launch environment read as the launcher meant it, both sides of each check.

- `export RANK=0` in a batch script before `srun`: every task would claim rank 0 (one fails on the
  port, the others wait out the timeout). Refused at once in one line naming RANK and SLURM_PROCID;
  not refused: torchrun under srun (its own RANK, TORCHELASTIC_RUN_ID set), RANK equal to the task's
  SLURM_PROCID, a one-task step.
- The memory check counts the processes of this machine from the real launch: `srun -N64 -n512`
  without LOCAL_WORLD_SIZE or SLURM_NTASKS_PER_NODE sets SLURM_TASKS_PER_NODE=8(x64); a 0.6 GiB run
  is 8 processes here, not 512.
"""

from __future__ import annotations

import pytest

from megatron_lev.errors import LaunchError
from megatron_lev.plan import memory
from megatron_lev.training.rendezvous import read_dist_env

SRUN_TASK = {  # task 5 of an `srun -N2 -n8` step
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_JOB_NODELIST": "n[1-2]",
}


def test_rank_exported_before_srun_is_refused_naming_both_variables():
    with pytest.raises(LaunchError) as err:
        read_dist_env({**SRUN_TASK, "RANK": "0"})
    message = str(err.value)
    assert "RANK=0 contradicts SLURM_PROCID=5" in message and "unset RANK" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "extra, rank",
    [
        ({}, 5),  # plain srun
        ({"RANK": "5"}, 5),  # RANK that agrees with the task
        (  # torchrun started by srun on each node: its ranks are not the tasks'
            {
                "RANK": "3",
                "WORLD_SIZE": "16",
                "LOCAL_RANK": "3",
                "MASTER_ADDR": "n1",
                "MASTER_PORT": "29500",
                "TORCHELASTIC_RUN_ID": "4242",
            },
            3,
        ),
    ],
    ids=["srun", "rank-agrees", "torchrun-under-srun"],
)
def test_the_healthy_launches_are_not_refused(extra, rank):
    assert read_dist_env({**SRUN_TASK, **extra}).rank == rank


def test_one_task_with_rank_zero_exported_is_one_process():
    env = {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "0"}
    assert read_dist_env(env).world_size == 1


SRUN_64x8 = {
    "SLURM_NTASKS": "512",
    "SLURM_TASKS_PER_NODE": "8(x64)",
    "SLURM_NNODES": "64",
    "SLURM_NODEID": "3",
}


@pytest.mark.parametrize(
    "env, here",
    [
        (SRUN_64x8, 8),
        ({**SRUN_64x8, "SLURM_NODEID": "70"}, 8),  # a node id past the list: its largest entry
        ({"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}, 1),
        ({"SLURM_NTASKS": "10", "SLURM_JOB_NUM_NODES": "4"}, 3),  # no per-node list: rounded up
        ({**SRUN_64x8, "SLURM_NTASKS_PER_NODE": "4"}, 4),
        ({**SRUN_64x8, "LOCAL_WORLD_SIZE": "2"}, 2),  # torchrun's own count wins
        ({}, 512),  # no launcher: every rank is here
    ],
)
def test_processes_on_this_machine_come_from_the_launch(env, here):
    assert memory._processes_here(512, env) == here


def test_a_small_run_on_512_ranks_over_64_nodes_is_not_refused(monkeypatch):
    from megatron_lev.config import load_config
    from tests.reliability.harness import ROOT

    for key, value in SRUN_64x8.items():
        monkeypatch.setenv(key, value)
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(key, raising=False)
    cfg = load_config(
        [ROOT / "pretrain" / "configs" / "tiny.yaml"],
        ["data.data_path=[x]", "data.tokenizer_path=x", "train.micro_batch_size=2", "model.seq_length=64"],
    )
    est = memory.estimate_memory(cfg, 512, 50304, cuda=False)
    assert est.processes == 8
    assert est.per_process < 1 << 30  # the tiny model: well under 1 GiB a process
    memory.check_memory(est, cfg, cuda=False)  # 8 of them fit this machine; 512 would not


def test_a_one_process_run_inside_an_allocation_counts_one_process():
    """A run of one process started inside an allocation of 8 tasks per node (salloc, an interactive
    srun shell) shares the machine with no other rank of its own: before, the memory check counted the
    allocation's 8 and refused a run that fits. The 8-rank launch in the same allocation counts 8."""
    allocation = {"SLURM_JOB_ID": "7", "SLURM_NTASKS_PER_NODE": "8", "SLURM_NTASKS": "8"}
    assert memory._processes_here(1, allocation) == 1
    assert memory._processes_here(8, allocation) == 8
