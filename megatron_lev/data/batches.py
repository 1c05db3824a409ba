"""From the data pipeline's datasets to the micro-batches the engine consumes.

Each data-parallel rank reads its own slice of every global batch (Megatron's
pretraining sampler); tensor- and pipeline-parallel peers of a replica read the
same slice themselves, so no batch is broadcast. The train position is the number
of samples consumed, which the checkpoint stores.

A micro-batch is `(input_ids, labels)`, or a `MicroBatch` when the run treats packed documents
separately (`data.boundaries.DocumentLayout`: positions, attention and loss mask from the EOD id).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset

from megatron_lev.data.boundaries import DocumentLayout
from megatron_lev.utils.tensors import check_token_ids


@dataclass
class MicroBatch:
    """One micro-batch of packed documents; the optional tensors are None when their option is off."""

    input_ids: torch.Tensor  # (B, S)
    labels: torch.Tensor  # (B, S)
    position_ids: torch.Tensor | None = None  # (B, S) restart at each document (data.reset_position_ids)
    document_ids: torch.Tensor | None = None  # (B, S) attention within documents (data.reset_attention_mask)
    loss_mask: torch.Tensor | None = None  # (B, S) float 0/1 (data.eod_mask_loss)


def make_loader(
    dataset: Dataset,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int,
) -> DataLoader:
    """A loader of `{"tokens": (B, S+1) int64}` starting after `consumed_samples` samples."""
    from megatron_lev.data.samplers import PretrainingSampler, build_data_loader

    sampler = PretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=dp_rank,
        data_parallel_size=dp_size,
    )
    loader = build_data_loader(dataset, sampler, num_workers=num_workers)
    # its own generator: starting an iterator must not draw from the global RNG (exact resume)
    loader.generator = torch.Generator()
    return loader


def token_batches(
    loader: DataLoader,
    device: torch.device,
    vocab_size: int | None = None,
    documents: DocumentLayout | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor] | MicroBatch]:
    """`(input_ids, labels)`, each `(B, S)`, on `device`; labels are the inputs shifted by one.

    With a `documents` layout: a `MicroBatch` that also carries the document tensors it switches on.

    With `vocab_size`, every id is checked on the host before the copy (IndexError naming the
    id), so the model's own check on the device never has to make the host wait.
    """
    for batch in loader:
        tokens = batch["tokens"]  # (B, S+1) host memory
        if vocab_size is not None:
            check_token_ids(tokens, vocab_size)
        tokens = tokens.to(device, non_blocking=True).long()
        input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if documents is None:
            yield input_ids, labels
        else:
            yield MicroBatch(input_ids, labels, **documents(input_ids))
