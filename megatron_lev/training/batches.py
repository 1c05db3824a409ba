"""From the data pipeline's datasets to the micro-batches the engine consumes.

Each data-parallel rank reads its own slice of every global batch (Megatron's
pretraining sampler); tensor- and pipeline-parallel peers of a replica read the
same slice themselves, so no batch is broadcast. The train position is the number
of samples consumed, which the checkpoint stores.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset


def make_loader(dataset: Dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                num_workers: int) -> DataLoader:
    """A loader of `{"tokens": (B, S+1) int64}` starting after `consumed_samples` samples."""
    from megatron_lev.data.samplers import PretrainingSampler, build_data_loader

    sampler = PretrainingSampler(total_samples=len(dataset), consumed_samples=consumed_samples,
                                 micro_batch_size=micro_batch_size, data_parallel_rank=dp_rank,
                                 data_parallel_size=dp_size)
    loader = build_data_loader(dataset, sampler, num_workers=num_workers)
    # its own generator: starting an iterator must not draw from the global RNG (exact resume)
    loader.generator = torch.Generator()
    return loader


def token_batches(loader: DataLoader, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`(input_ids, labels)`, each `(B, S)`, on `device`; labels are the inputs shifted by one."""
    for batch in loader:
        tokens = batch["tokens"].to(device, non_blocking=True).long()  # (B, S+1)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def pipeline_batches(batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[tuple]:
    """The `((inputs,), labels)` form DeepSpeed's pipeline engine expects."""
    for input_ids, labels in batches:
        yield (input_ids,), labels
