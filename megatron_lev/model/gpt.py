"""The GPT model as one module (PP = 1; also what ZeRO-2/3 wrap).

    input ids (B, S) -> input embedding (any variant) -> N x TransformerBlock
    -> RMSNorm -> vocabulary-parallel head -> logits (B, S, V/tp), per-token loss (B, S) or mean loss ()

With labels and `model.fused_loss` (the default), the head and the cross-entropy run as one
function chunked over tokens (`parallel.fused_cross_entropy`), never holding the logits: for the
mean loss (`reduction="mean"`, what training asks for), and for per-token losses without a gradient
(evaluation). Per-token losses with a gradient, or `model.fused_loss=false`, take the logits path.

Packed documents (optional, `model.documents`): `position_ids (B, S)` restart RoPE at each
document, `document_ids (B, S)` keep attention inside each document.

The network is defined once, as the stage list of `model.stages` (`stage_specs`). This model
builds every stage, adopts the stages' modules under their own (canonical) names, and its forward
runs the stages in order (GPT-NeoX's `to_sequential`): the same stage forwards the pipeline-parallel
model (`engine.pipeline`) runs, from exactly the same weights. With a tied head the last stage is
the embedding stage's `head_logits`, as in the pipeline.

The model holds no training policy: activation checkpointing is applied from outside
(`engine.recompute.apply_activation_checkpointing`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron_lev.config import ModelConfig
from megatron_lev.model.loss import masked_mean, real_vocab_size, token_losses
from megatron_lev.model.stages import DOCUMENT_TENSORS, stage_specs
from megatron_lev.parallel.layout import SINGLE, ParallelLayout
from megatron_lev.parallel.random import RNGStatesTracker, tp_rng_tracker


class GPTModel(nn.Module):
    """Decoder-only LM. `vocab_size` is the padded size (divisible by TP; see `vocab.padded_vocab_size`).

    `true_vocab_size` is the tokenizer's vocabulary (default: no padding): the loss masks the
    logits of the padding rows, so every TP size trains the objective of the exported model.
    `layout` (default: one process) is the `ParallelLayout` this rank's shards belong to.
    `rng` (default: a new one from `seed` and the layout's TP rank) is the model's RNG tracker, kept as
    `self.rng`: attention dropout draws from its TP stream, and a checkpoint saves it.

    `stages` are the built stages in forward order: stage modules, and for a tied head the
    embedding stage's `head_logits`. They are not registered as submodules (their modules are,
    under the canonical names: `embedding`, `layers`, `final_norm`, `output_head`), so changing
    the list (activation checkpointing) changes no parameter name.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        vocab_size: int,
        seed: int = 1234,
        true_vocab_size: int | None = None,
        layout: ParallelLayout = SINGLE,
        rng: RNGStatesTracker | None = None,
    ):
        super().__init__()
        self.cfg, self.vocab_size, self.layout = model_cfg, vocab_size, layout
        self.rng = rng if rng is not None else tp_rng_tracker(seed, layout)
        self.true_vocab_size = real_vocab_size(vocab_size, true_vocab_size)
        modules: dict[str, nn.Module] = {}  # in stage order: embedding, layers, final_norm, output_head
        shared: dict[str, nn.Module] = {}  # tied_key -> the stage built for its first use
        stages: list[Callable] = []
        specs = stage_specs(
            model_cfg, vocab_size, seed, DOCUMENT_TENSORS, layout, true_vocab_size, rng=self.rng
        )
        for spec in specs:
            if spec.tied_key in shared:  # a second use of a shared stage: the tied head
                stages.append(getattr(shared[spec.tied_key], spec.tied_forward))
                continue
            stage = spec.build()
            if spec.tied_key is not None:
                shared[spec.tied_key] = stage
                if stage.tied_weight is None:
                    raise ValueError(
                        f"model.embedding={model_cfg.embedding!r} has no table to tie the output head to"
                    )
            stages.append(stage)
            for name, child in stage.named_children():
                if isinstance(child, nn.ModuleDict):  # a block stage's {str(i): block i}, in order of i
                    modules.setdefault(name, nn.ModuleList()).extend(child.values())
                else:
                    modules[name] = child
        for name, module in modules.items():
            setattr(self, name, module)
        self.stages: list[Callable] = stages  # a plain list: not registered (see the class doc)
        head = stages[-1]  # a HeadStage, or the shared embedding stage's bound head_logits
        self._head_loss = getattr(head, "__self__", head).head_loss  # the fused head + loss

    def train(self, mode: bool = True) -> GPTModel:
        super().train(mode)
        for stage in self.stages:  # not submodules, so their mode is set here
            if isinstance(stage, nn.Module):
                stage.train(mode)
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        reduction: str = "none",
    ) -> torch.Tensor:
        """Logits `(B, S, V/tp)` without `labels`; with them, the per-token losses `(B, S)` fp32
        (`reduction="none"`) or their mean over the tokens `loss_mask` keeps `()` (`"mean"`)."""
        if reduction not in ("none", "mean"):
            raise ValueError(f"reduction must be 'none' or 'mean', got {reduction!r}")
        x = input_ids  # (B, S), or with documents (input_ids, position_ids, document_ids) as DOCUMENT_TENSORS
        if position_ids is not None or document_ids is not None:
            x = (input_ids, position_ids, document_ids)
        *body, head = self.stages
        for stage in body:
            x = stage(x)  # ends with the final norm: hidden (B, S, D)
        if labels is None:
            return head(x)  # logits (B, S, V/tp)
        if self.cfg.fused_loss and (reduction == "mean" or not torch.is_grad_enabled()):
            chunk = self.cfg.loss_chunk_tokens or None
            mean, losses = self._head_loss(x, labels, self.true_vocab_size, loss_mask, chunk)
            return mean if reduction == "mean" else losses
        losses = token_losses(head(x), labels, self.true_vocab_size, layout=self.layout)  # (B, S) fp32
        return masked_mean(losses, loss_mask) if reduction == "mean" else losses
