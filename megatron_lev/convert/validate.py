"""Check an export numerically: the source model and the exported model give the same logits.

Both models run the same token ids (random sequences plus the rarest ids at the end of the
vocabulary); forward hooks record every stage (input embedding, each block, final norm,
logits), so a mismatch names the first stage that diverges instead of just failing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron_lev.errors import UserError


class ValidationError(UserError, RuntimeError):
    """The exported model's outputs differ from the source model's; the message names the stage."""


@dataclass
class ValidationReport:
    max_abs_diff: float  # over the logits
    stage_diffs: dict[str, float]  # stage -> max |difference|
    atol: float
    rtol: float
    probe_max_abs_diff: float | None = None  # the large-random-weights probe's (see hf_export.probe_export)

    def summary(self) -> str:
        probe = (
            ""
            if self.probe_max_abs_diff is None
            else f"; probe with large random weights: max |logit difference| = {self.probe_max_abs_diff:.3e}"
        )
        return (
            f"validation passed: max |logit difference| = {self.max_abs_diff:.3e} "
            f"(atol={self.atol:g}, rtol={self.rtol:g}) over {len(self.stage_diffs)} stages{probe}"
        )


def validation_ids(vocab_size: int, seq_length: int, batch: int = 3, seed: int = 0) -> torch.Tensor:
    """`(batch, S)` ids, S <= 32: random tokens, with the 8 rarest (last) ids of the vocabulary in row 0."""
    s = min(seq_length, 32)
    ids = torch.randint(0, vocab_size, (batch, s), generator=torch.Generator().manual_seed(seed))
    rare = torch.arange(max(vocab_size - 8, 0), vocab_size)[:s]
    ids[0, -len(rare) :] = rare
    return ids


def _record(modules: list[tuple[str, nn.Module]]) -> tuple[dict[str, torch.Tensor], list]:
    outputs: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in modules:

        def hook(mod, args, out, name=name):
            outputs[name] = (out[0] if isinstance(out, tuple) else out).detach().float()

        handles.append(module.register_forward_hook(hook))
    return outputs, handles


@torch.no_grad()
def source_stages(model: nn.Module, ids: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """Stage outputs of a project `GPTModel` (TP = 1), logits cut to the real vocabulary."""
    mods = [("input embedding", model.embedding)] + [(f"layer {i}", b) for i, b in enumerate(model.layers)]
    outputs, handles = _record(mods + [("final norm", model.final_norm)])
    try:
        logits = model(ids)
    finally:
        for h in handles:
            h.remove()
    outputs["logits"] = logits[..., :vocab_size].float()
    return outputs


@torch.no_grad()
def hf_stages(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same stages of a Hugging Face `LlamaForCausalLM`."""
    inner = model.model
    mods = [("input embedding", inner.embed_tokens)] + [(f"layer {i}", b) for i, b in enumerate(inner.layers)]
    outputs, handles = _record(mods + [("final norm", inner.norm)])
    try:
        logits = model(ids).logits
    finally:
        for h in handles:
            h.remove()
    outputs["logits"] = logits.float()
    return outputs


def compare_stages(
    source: dict[str, torch.Tensor],
    exported: dict[str, torch.Tensor],
    atol: float = 1e-4,
    rtol: float = 1e-4,
    relative: bool = False,
) -> ValidationReport:
    """Raise ValidationError at the first stage whose outputs differ beyond the tolerance.

    `relative`: atol is multiplied by the stage's largest |value| (for the probe's large activations).
    """
    diffs: dict[str, float] = {}
    for stage, ref in source.items():
        got = exported.get(stage)
        if got is None or got.shape != ref.shape:
            raise ValidationError(
                f"stage '{stage}': exported output shape "
                f"{None if got is None else tuple(got.shape)} != source {tuple(ref.shape)}"
            )
        if not torch.isfinite(ref).all():
            raise ValidationError(
                f"stage '{stage}' of the source model is not finite (nan/inf): the checkpoint's "
                "weights are damaged; convert an earlier checkpoint (--tag)"
            )
        diffs[stage] = (got - ref).abs().max().item()
        tol = atol * max(1.0, ref.abs().max().item()) if relative else atol
        try:
            torch.testing.assert_close(got, ref, atol=tol, rtol=rtol)
        except AssertionError:
            raise ValidationError(
                f"the exported model first diverges from the source at stage '{stage}': max |difference| "
                f"{diffs[stage]:.3e} > atol={tol:g} (earlier stages: "
                + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items() if k != stage)
                + ")"
            ) from None
    return ValidationReport(diffs["logits"], diffs, atol, rtol)
