"""Checks on tensors that several layers share."""

from __future__ import annotations

import torch


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Refuse ids outside [0, vocab_size) (instead of a silent wrong row), without a host sync.

    Host tensors: an IndexError naming the id. Device tensors: a device-side assert, which
    does not make the host wait; the training loader has already checked every batch on
    the host (`data.batches.token_batches`), so there it is a backstop.
    """
    if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TypeError(f"token ids must be an integer tensor, got {input_ids.dtype}")
    if input_ids.numel() == 0:
        return
    if input_ids.device.type != "cpu":
        inside = ((input_ids >= 0) & (input_ids < vocab_size)).all()
        torch._assert_async(inside, f"a token id is outside the vocabulary [0, {vocab_size})")
        return
    ids = input_ids.detach().numpy()  # host memory: reading it waits for nothing
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise IndexError(
            f"token id {bad} is outside the vocabulary [0, {vocab_size}); check that the "
            "tokenizer matches model.vocab_size"
        )
