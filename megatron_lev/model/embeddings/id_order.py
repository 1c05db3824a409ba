"""Token-id order: which token gets which compositional digits (`model.lev.id_order`).

LEV.md's step 1 gives token `i` the digits of `i` itself ("bpe" order, the default). With another
order token `i` gets the digits of `rank[i]`, where `rank` is a permutation of the (padded)
vocabulary:

    bpe        rank[i] = i (no permutation is stored: the model is the spec's, bit for bit)
    random     a permutation drawn from `model.lev.id_order_seed` (its own generator: the model's
               other weights are drawn exactly as without it)
    frequency  ids by their count in `model.lev.id_order_counts` (a `counts.npy` of `preprocess`),
               most frequent first, ties by id; ids past the end of the counts count 0

The permutation is a persistent buffer (`id_rank`, int64, shape `(V,)`) of the module that computes
the digits, so checkpoints, conversion, resharding and exports carry it: only a fresh model reads
the counts file. Built without it (the file is not on this machine), a `frequency` model holds a
placeholder and refuses to run until a checkpoint's `id_rank` is loaded into it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from megatron_lev.config import LevConfig
from megatron_lev.errors import ConfigError

BUFFER = "id_rank"


def random_ranks(vocab_size: int, seed: int) -> torch.Tensor:
    """A permutation of `range(vocab_size)` from `seed` (a private CPU generator: the global RNG is not
    touched, so every other weight is drawn as in a `bpe` model)."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    return torch.randperm(vocab_size, generator=gen, device="cpu", dtype=torch.int64)


def read_counts(path: str | Path) -> np.ndarray:
    """A `counts.npy` as int64; one line naming the file and the key otherwise."""
    path = Path(path)
    try:
        counts = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"model.lev.id_order_counts={str(path)!r}: cannot read token counts ({exc}); give the "
            "training data's <prefix>.counts.npy (written by `megatron-lev preprocess`)"
        ) from None
    if counts.ndim != 1 or not np.issubdtype(counts.dtype, np.integer) or (counts < 0).any():
        raise ConfigError(
            f"model.lev.id_order_counts={str(path)!r}: token counts must be a 1-D array of non-negative "
            f"integers, got {counts.dtype} {counts.shape}"
        )
    return counts.astype(np.int64)


def frequency_ranks(counts: np.ndarray, vocab_size: int, source: str = "counts") -> torch.Tensor:
    """`rank[i]`: the position of id `i` when ids are sorted by count, most frequent first, ties by id.
    Counts shorter than the vocabulary are padded with 0; longer ones (another tokenizer) are refused."""
    counts = np.asarray(counts, dtype=np.int64)
    if len(counts) > vocab_size:
        tail = counts[vocab_size:]
        if tail.any():
            raise ConfigError(
                f"model.lev.id_order_counts={source!r} counts {len(counts):,} token ids but the model's "
                f"(padded) vocabulary has {vocab_size:,}, and ids past it occur: these are another "
                "tokenizer's counts; give the training data's <prefix>.counts.npy"
            )
        counts = counts[:vocab_size]
    full = np.zeros(vocab_size, dtype=np.int64)
    full[: len(counts)] = counts
    order = np.argsort(-full, kind="stable")  # ids by decreasing count; a stable sort keeps ties by id
    rank = np.empty(vocab_size, dtype=np.int64)
    rank[order] = np.arange(vocab_size, dtype=np.int64)
    return torch.from_numpy(rank)


def initial_ranks(lev: LevConfig, vocab_size: int) -> tuple[torch.Tensor | None, bool]:
    """`(rank, pending)` for a freshly built module: rank None for `bpe` (nothing stored); `pending`
    when a `frequency` model's counts file is absent (the rank is then a placeholder that a
    checkpoint must replace). On the meta device nothing is computed or read."""
    order = lev.id_order
    if order == "bpe":
        return None, False
    if torch.empty(0).is_meta:  # shapes only (canonical specs, a model a checkpoint is assigned to)
        return torch.empty(vocab_size, dtype=torch.int64), False
    if order == "random":
        return random_ranks(vocab_size, lev.id_order_seed), False
    if order != "frequency":
        raise ConfigError(f"model.lev.id_order={order!r} is not one of bpe, random, frequency")
    path = lev.id_order_counts
    if path is None or not Path(path).is_file():
        return torch.arange(vocab_size, dtype=torch.int64), True
    return frequency_ranks(read_counts(path), vocab_size, str(path)), False


def check_permutation(rank: torch.Tensor, vocab_size: int, where: str) -> None:
    """Refuse a stored `id_rank` that is not a permutation of `range(vocab_size)`."""
    if tuple(rank.shape) != (vocab_size,) or rank.dtype != torch.int64:
        raise ValueError(
            f"{where}: expected an int64 permutation of shape ({vocab_size},), got {rank.dtype} "
            f"{tuple(rank.shape)}"
        )
    if rank.is_meta:
        return
    seen = torch.zeros(vocab_size, dtype=torch.bool, device=rank.device)
    inside = (rank >= 0) & (rank < vocab_size)
    seen[rank[inside]] = True
    if not bool(inside.all()) or not bool(seen.all()):
        raise ValueError(f"{where}: the stored token order is not a permutation of the {vocab_size:,} ids")


def pending_error(lev: LevConfig, where: str) -> ConfigError:
    return ConfigError(
        f"model.lev.id_order=frequency: {where} has no token order: the counts file "
        f"model.lev.id_order_counts={lev.id_order_counts!r} is not there and no checkpoint's "
        f"{BUFFER} was loaded; give the training data's <prefix>.counts.npy, or load the checkpoint"
    )
