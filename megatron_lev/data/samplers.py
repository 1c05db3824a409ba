"""Megatron's sequential pretraining sampler and a DataLoader that keeps its position.

The global sample order is fixed (0, 1, 2, ...); each global micro-batch of
`micro_batch_size * dp` consecutive samples is split so DP rank r takes slice r.
The position is `consumed_samples` (global), so a run can resume under another DP size.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_lev.errors import DataError


class PretrainingSampler:
    """Yields this DP rank's index list for each global micro-batch, from `consumed_samples` on."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        if total_samples <= 0:
            raise DataError(
                f"no samples to draw (total_samples={total_samples}); check the data and train.train_iters"
            )
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(
                f"micro_batch_size={micro_batch_size} and data_parallel_size={data_parallel_size} "
                "must be positive"
            )
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank={data_parallel_rank} not in [0, {data_parallel_size})")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.drop_last = micro_batch_size, drop_last
        self.dp_rank, self.dp_size = data_parallel_rank, data_parallel_size
        self.global_micro_batch = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        left = self.total_samples - self.consumed_samples
        return left // self.global_micro_batch if self.drop_last else -(-left // self.global_micro_batch)

    def _slice(self, batch: list[int]) -> list[int]:
        per_rank = (
            -(-len(batch) // self.dp_size) if len(batch) < self.global_micro_batch else self.micro_batch_size
        )
        return batch[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]

    def __iter__(self):
        """Indices of the global micro-batches from `consumed_samples`; the loader advances the position."""
        start = self.consumed_samples
        for first in range(start, self.total_samples, self.global_micro_batch):
            batch = list(range(first, min(first + self.global_micro_batch, self.total_samples)))
            if len(batch) < self.global_micro_batch and self.drop_last:
                return
            yield self._slice(batch)

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])


class PretrainingDataLoader(torch.utils.data.DataLoader):
    """A DataLoader that advances its sampler's `consumed_samples` per batch actually delivered.

    With worker prefetching the sampler is read ahead; counting at delivery keeps
    `sampler.state_dict()` equal to what the training loop has seen.
    """

    def __iter__(self):
        sampler = self.batch_sampler
        for batch in super().__iter__():
            sampler.consumed_samples += sampler.global_micro_batch
            yield batch


def _collate(items: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(np.stack([it[k] for it in items])) for k in items[0]}


def build_data_loader(dataset, sampler: PretrainingSampler, num_workers: int = 0) -> PretrainingDataLoader:
    """Batches `{"tokens": (micro_batch, S + 1) int64}` in the sampler's order."""
    return PretrainingDataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=_collate,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=False,
    )
