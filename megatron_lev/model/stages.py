"""The GPT model as an ordered list of stages: the one definition `GPTModel` and the pipeline build and run.

    index   stage                                   parameters (canonical names)
    0       EmbeddingStage (token ids in)           embedding.*
    1 .. L  BlockStage i = index - 1                layers.{i}.*
    L + 1   FinalNormStage                          final_norm.weight
    L + 2   HeadStage, or (tied) EmbeddingStage's   output_head.weight / none of its own
            table again, through `head_logits`

`stage_specs` returns `StageSpec`s (a class and its arguments), not modules: a pipeline builds
only the stages its rank holds. Each stage registers its parameters under its `GPTModel` prefix,
so a stage's `state_dict()` (a pipeline's per-layer checkpoint file) holds canonical names, and
`GPTModel` adopts the stages' modules under the same names and runs the stages' forwards in order.
Every stage draws its weights from its own seed (`layer_seed`), so one seed gives the same weights
in every layout.

Between stages: the hidden state `(B, S, D)`, or `(h, *document tensors)` with packed documents
(`document_inputs` names them, each `(B, S)`, in order, a subset of `DOCUMENT_TENSORS`); the final
norm drops them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_lev.config import ModelConfig
from megatron_lev.model.block import TransformerBlock
from megatron_lev.model.documents import documents_for
from megatron_lev.model.embeddings import build_input_embedding, embedding_class
from megatron_lev.model.head import VocabParallelHead, vocab_parallel_logits, vocab_parallel_loss
from megatron_lev.model.norm import RMSNorm
from megatron_lev.model.vocab import base_vocab_size
from megatron_lev.parallel.layout import SINGLE, ParallelLayout
from megatron_lev.parallel.random import RNGStatesTracker, seeded

TIED_EMBEDDING = "embedding"  # the tied_key of the input table the head reuses
DOCUMENT_TENSORS = ("position_ids", "document_ids")  # what may travel beside the hidden state, in order


def layer_seed(base_seed: int, part: str, index: int = 0) -> int:
    """Seed of one part: "embedding" -> base, "block" i -> base + 1 + i, "head" (norm + head) -> base - 1."""
    return {"embedding": base_seed, "block": base_seed + 1 + index, "head": base_seed - 1}[part]


@dataclass(frozen=True)
class StageSpec:
    """One stage, unbuilt: `build()` is `cls(*args)`.

    Stages with the same `tied_key` share one module (built by the first); a later one runs the
    method `tied_forward` of `cls` on it instead of `forward`. A shared stage exposes the shared
    tensor as its `tied_weight`.
    """

    cls: type[nn.Module]
    args: tuple[Any, ...] = ()
    tied_key: str | None = None
    tied_forward: str | None = None

    def build(self) -> nn.Module:
        return self.cls(*self.args)


class EmbeddingStage(nn.Module):
    """Token ids -> hidden states, with the configured input embedding as `embedding`."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        vocab_size: int,
        seed: int,
        layout: ParallelLayout = SINGLE,
        base_vocab: int | None = None,
    ):
        super().__init__()
        self.layout = layout
        with seeded(layer_seed(seed, "embedding")):
            self.embedding = build_input_embedding(model_cfg, vocab_size, layout, base_vocab)
        if model_cfg.input_init_rms is not None:  # equal-scale init: a deterministic rescale, no RNG
            self.embedding.rescale_output_(model_cfg.input_init_rms)

    @property
    def tied_weight(self) -> torch.Tensor | None:
        """The table the output head reuses (`tied` variants), else None."""
        return self.embedding.tied_output_weight()

    def forward(self, inputs):  # (B, S) or ((B, S), *(B, S)) -> (B, S, D) or ((B, S, D), *(B, S))
        if isinstance(inputs, (tuple, list)):
            h = self.embedding(inputs[0])
            return (h, *inputs[1:]) if len(inputs) > 1 else h
        return self.embedding(inputs)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied output head: `(B, S, D)` -> logits `(B, S, V/tp)` from this table."""
        return vocab_parallel_logits(hidden, self.tied_weight, self.layout)

    def head_loss(self, hidden, labels, vocab_size=None, loss_mask=None, chunk_tokens=None):
        """The tied head fused with its loss: `(mean (), per-token losses (B, S))` (`vocab_parallel_loss`)."""
        return vocab_parallel_loss(
            hidden, self.tied_weight, labels, vocab_size, loss_mask, chunk_tokens, self.layout
        )

    def head_hidden(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A pipeline's last stage with the fused loss: `(hidden (B, S, D), the table's rows (V/tp, D))`
        pass on to `loss_fn` (`engine.pipeline.FusedPipelineLoss` says why the rows are an output)."""
        return hidden, self.tied_weight.view_as(self.tied_weight)


class BlockStage(nn.Module):
    """Decoder block `index` as `layers[str(index)]`; `document_inputs` travel beside the hidden state.

    Given a bare hidden state, the block runs without documents (whatever `document_inputs` says).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        index: int,
        seed: int,
        document_inputs: tuple[str, ...] = (),
        layout: ParallelLayout = SINGLE,
        rng: RNGStatesTracker | None = None,
    ):
        super().__init__()
        self.index, self.document_inputs = index, tuple(document_inputs)
        block = TransformerBlock(model_cfg, index, layer_seed(seed, "block", index), layout, rng)
        self.layers = nn.ModuleDict({str(index): block})

    @property
    def block(self) -> TransformerBlock:
        return self.layers[str(self.index)]

    def forward(self, inputs):  # (B, S, D) -> (B, S, D), or ((B, S, D), *(B, S)) -> same
        if isinstance(inputs, torch.Tensor):
            return self.block(inputs)
        h, *extra = inputs
        named = dict(zip(self.document_inputs, extra, strict=True))
        documents = documents_for(named.get("position_ids"), named.get("document_ids"))
        return (self.block(h, documents), *extra)


class FinalNormStage(nn.Module):
    """The final RMSNorm as `final_norm` (no random state, so no seed); drops the document tensors."""

    def __init__(self, model_cfg: ModelConfig):
        super().__init__()
        self.final_norm = RMSNorm(model_cfg.hidden_size, model_cfg.norm_eps)

    def forward(self, x):  # (B, S, D) or ((B, S, D), *(B, S)) -> (B, S, D)
        return self.final_norm(x[0] if isinstance(x, (tuple, list)) else x)


class HeadStage(nn.Module):
    """The untied vocabulary-parallel head as `output_head`: `(B, S, D) -> (B, S, V/tp)`."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        vocab_size: int,
        seed: int,
        layout: ParallelLayout = SINGLE,
        base_vocab: int | None = None,
    ):
        super().__init__()
        with seeded(layer_seed(seed, "head")):
            self.output_head = VocabParallelHead(
                model_cfg.hidden_size, vocab_size, model_cfg.init_std, layout, init_rows=base_vocab
            )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output_head(hidden)

    def head_loss(self, hidden, labels, vocab_size=None, loss_mask=None, chunk_tokens=None):
        """The head fused with its loss: `(mean (), per-token losses (B, S))` (`vocab_parallel_loss`)."""
        return self.output_head(hidden, labels, vocab_size, loss_mask, chunk_tokens)


class DeferredHeadStage(HeadStage):
    """`HeadStage` as a pipeline's last layer with the fused loss: `(hidden (B, S, D), its rows
    (V/tp, D))` pass on to the pipeline's `loss_fn`, which runs the head fused with the loss (the same
    weights, names and checkpoint files; `engine.pipeline.FusedPipelineLoss`)."""

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = self.output_head.weight
        return hidden, weight.view_as(weight)


def stage_specs(
    model_cfg: ModelConfig,
    vocab_size: int,
    seed: int,
    document_inputs: tuple[str, ...] = (),
    layout: ParallelLayout = SINGLE,
    true_vocab_size: int | None = None,
    deferred_head: bool = False,
    rng: RNGStatesTracker | None = None,
) -> list[StageSpec]:
    """The model's stages in order (see the module doc); `vocab_size` is the padded size.

    `document_inputs`: the document tensors that follow the hidden state (`DOCUMENT_TENSORS`, in order).
    `layout`: the TP layout every stage is sharded over (its TP layers keep it).
    `true_vocab_size` (default: every row real) gives the embedding its one-process vocabulary.
    `deferred_head`: the last stage passes the hidden state on (`DeferredHeadStage`, `head_hidden`), for a
    pipeline whose `loss_fn` runs the head fused with the loss.
    `rng`: the model's tracker (`parallel.random.tp_rng_tracker`), shared by every block's attention.
    """
    tied = embedding_class(model_cfg.embedding).ties_output_head
    base = base_vocab_size(vocab_size, true_vocab_size, model_cfg)
    embedding = (model_cfg, vocab_size, seed, layout, base)
    specs = [StageSpec(EmbeddingStage, embedding, TIED_EMBEDDING if tied else None)]
    specs += [
        StageSpec(BlockStage, (model_cfg, i, seed, tuple(document_inputs), layout, rng))
        for i in range(model_cfg.num_layers)
    ]
    specs.append(StageSpec(FinalNormStage, (model_cfg,)))
    if tied:
        forward = "head_hidden" if deferred_head else "head_logits"
        specs.append(StageSpec(EmbeddingStage, embedding, TIED_EMBEDDING, forward))
    else:
        head = DeferredHeadStage if deferred_head else HeadStage
        specs.append(StageSpec(head, (model_cfg, vocab_size, seed, layout, base)))
    return specs
