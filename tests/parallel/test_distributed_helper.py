"""The gloo launchers: `testing.run_distributed` (tests) and `parallel.local_workers.run_workers`
(offline tools)."""

import re

import pytest
import torch

from megatron_lev.testing import DistributedTestError, run_distributed


def _all_reduce_rank():
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _fails_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()
    return "rank 0 sees the peer vanish; the helper must report rank 1 as the root cause"


@pytest.mark.multiprocess
def test_two_process_all_reduce():
    results = run_distributed(_all_reduce_rank, world_size=2)
    assert results == [(0, 2, 3.0), (1, 2, 3.0)]


@pytest.mark.multiprocess
def test_child_traceback_is_reported():
    with pytest.raises(
        DistributedTestError, match=r"(?s)rank 1 of 2 failed first.*ValueError: boom on rank one"
    ):
        run_distributed(_fails_on_rank_one, world_size=2, timeout=60)


def _tp_regions(x):
    from megatron_lev.parallel import mappings, state

    layout = state.initialize_model_parallel(tensor_model_parallel_size=2)
    x = x.clone().requires_grad_(True)
    # copy -> per-rank scale -> reduce == sum of scales; grad of x = sum of scales as well
    y = mappings.copy_to_tensor_parallel_region(x, layout) * (layout.tp_rank + 1.0)
    out = mappings.reduce_from_tensor_parallel_region(y, layout)
    part = mappings.scatter_to_tensor_parallel_region(out, layout)
    full = mappings.gather_from_tensor_parallel_region(part * 2, layout)
    full.sum().backward()
    return out.detach(), full.detach(), x.grad


@pytest.mark.multiprocess
def test_tensor_parallel_regions_match_single_process():
    x = torch.randn(3, 4, dtype=torch.float64)
    results = run_distributed(_tp_regions, world_size=2, args=(x,))
    for out, full, grad in results:
        torch.testing.assert_close(out, 3 * x)
        torch.testing.assert_close(full, 6 * x)
        # d(sum(2 * 3x))/dx = 6, reached through reduce (identity) and copy (all-reduce of 2*(r+1))
        torch.testing.assert_close(grad, torch.full_like(x, 6.0))


def _groups(tp, pp):
    import torch.distributed as dist

    from megatron_lev.parallel import state
    from megatron_lev.parallel.layout import ParallelLayout

    layout = state.initialize_model_parallel(tp, pp)
    assert layout == ParallelLayout.from_sizes(tp, pp, layout.dp, rank=dist.get_rank(), groups=layout.groups)
    assert dist.get_rank() in layout.tp_ranks and layout.rank == dist.get_rank()
    return (dist.get_rank(), layout.tp_rank, layout.pp_rank, layout.dp_rank, layout.dp)


@pytest.mark.multiprocess
def test_group_layout_matches_deepspeed_topology():
    # world 4 = TP 2 x PP 2 x DP 1: rank = pp * 2 + tp
    results = run_distributed(_groups, world_size=4, args=(2, 2))
    assert results == [(0, 0, 0, 0, 1), (1, 1, 0, 0, 1), (2, 0, 1, 0, 1), (3, 1, 1, 0, 1)]


def _returns_tensor():
    import torch.distributed as dist

    return torch.full((4, 4), float(dist.get_rank()))


@pytest.mark.multiprocess
def test_tensors_come_back_by_value_after_the_ranks_exit():
    results = run_distributed(_returns_tensor, world_size=2)
    assert [float(r.sum()) for r in results] == [0.0, 16.0]


def _user_error_on_rank_one():
    import torch.distributed as dist

    from megatron_lev.config import ConfigError

    if dist.get_rank() == 1:
        raise ConfigError("model.hidden_size=7 is odd\nsecond line")
    dist.barrier()


@pytest.mark.multiprocess
def test_the_user_launcher_reports_one_line_naming_the_rank():
    from megatron_lev.errors import UserError
    from megatron_lev.parallel.local_workers import WorkerError, run_workers

    with pytest.raises(WorkerError) as info:
        run_workers(_fails_on_rank_one, world_size=2, timeout=60)
    exc = info.value
    assert isinstance(exc, UserError) and exc.exit_code == 1
    # rank 0 may fail next, at the barrier its peer left
    assert re.fullmatch(
        r"rank 1 of 2 failed( \(then rank\(s\) \[0\] failed too\))?: ValueError: boom on rank one", str(exc)
    )
    assert "Traceback" in str(exc.__cause__) and "_fails_on_rank_one" in exc.traceback

    with pytest.raises(WorkerError) as info:  # a user error keeps its message alone and its exit code
        run_workers(_user_error_on_rank_one, world_size=2, timeout=60)
    assert re.fullmatch(r"rank 1 of 2 failed( \(then .* too\))?: model.hidden_size=7 is odd", str(info.value))
    assert info.value.exit_code == 2


def test_only_a_rendezvous_failure_is_taken_for_a_port_race():
    from megatron_lev.parallel.session import _rendezvous_error
    from megatron_lev.testing.distributed import _port_race

    mesh = RuntimeError(
        "Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer [127.0.0.1]:38573"
    )
    joined = _rendezvous_error(mesh, 1, 2, "127.0.0.1", 45527, 30.0)
    assert _port_race(str(joined))  # a peer reached a stranger's socket: start again on a new port
    assert _port_race("RuntimeError: ... EADDRINUSE ...")
    assert not _port_race("ValueError: boom on rank one")  # the code under test: reported at once
