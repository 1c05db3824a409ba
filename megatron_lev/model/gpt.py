"""The GPT model as one module (PP = 1; also what ZeRO-2/3 wrap).

    input ids (B, S) -> input embedding (any variant) -> N x TransformerBlock
    -> RMSNorm -> vocabulary-parallel head -> logits (B, S, V/tp) or per-token loss (B, S)

Packed documents (optional, `model.documents`): `position_ids (B, S)` restart RoPE at each
document, `document_ids (B, S)` keep attention inside each document.

Every part is built from its own seed (`layer_seed`), so the pipeline-parallel model
(`model.pipeline`) starts from exactly the same weights as this one.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_lev.config import ModelConfig
from megatron_lev.model.block import TransformerBlock, checkpointed
from megatron_lev.model.documents import Documents
from megatron_lev.model.embeddings.base import InputEmbedding
from megatron_lev.model.head import VocabParallelHead
from megatron_lev.model.norm import RMSNorm
from megatron_lev.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lev.parallel.random import seeded


def layer_seed(base_seed: int, part: str, index: int = 0) -> int:
    """Seed of one part: "embedding" -> base, "block" i -> base + 1 + i, "head" (norm + head) -> base - 1."""
    return {"embedding": base_seed, "block": base_seed + 1 + index, "head": base_seed - 1}[part]


def build_embedding(model_cfg: ModelConfig, vocab_size: int, seed: int) -> InputEmbedding:
    """The configured input-embedding variant (from the embeddings registry), built from its seed."""
    from megatron_lev.model.embeddings import build_input_embedding

    with seeded(layer_seed(seed, "embedding")):
        return build_input_embedding(model_cfg, vocab_size)


def build_final_norm_and_head(
    model_cfg: ModelConfig, vocab_size: int, seed: int, true_vocab_size: int | None = None
) -> tuple[RMSNorm, VocabParallelHead]:
    from megatron_lev.model.embeddings import embedding_class

    tied = embedding_class(model_cfg.embedding).ties_output_head
    with seeded(layer_seed(seed, "head")):
        norm = RMSNorm(model_cfg.hidden_size, model_cfg.norm_eps)
        head = VocabParallelHead(
            model_cfg.hidden_size, vocab_size, model_cfg.init_std, tied=tied, true_vocab_size=true_vocab_size
        )
    return norm, head


class GPTModel(nn.Module):
    """Decoder-only LM. `vocab_size` is the padded size (divisible by TP; see `build.padded_vocab_size`).

    `true_vocab_size` is the tokenizer's vocabulary (default: no padding): the loss masks the
    logits of the padding rows, so every TP size trains the objective of the exported model.
    """

    def __init__(
        self, model_cfg: ModelConfig, vocab_size: int, seed: int = 1234, true_vocab_size: int | None = None
    ):
        super().__init__()
        self.cfg, self.vocab_size = model_cfg, vocab_size
        self.embedding = build_embedding(model_cfg, vocab_size, seed)
        self.layers = nn.ModuleList(
            TransformerBlock(model_cfg, i, layer_seed(seed, "block", i)) for i in range(model_cfg.num_layers)
        )
        self.final_norm, self.output_head = build_final_norm_and_head(
            model_cfg, vocab_size, seed, true_vocab_size
        )
        if self.output_head.tied and self.embedding.tied_output_weight() is None:
            raise ValueError(
                f"model.embedding={model_cfg.embedding!r} has no table to tie the output head to"
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        documents = None
        if position_ids is not None or document_ids is not None:
            documents = Documents(position_ids, document_ids)  # built once, shared by every block
        h = self.embedding(input_ids)  # (B, S, D)
        group = self.cfg.checkpoint_num_layers
        for start in range(0, len(self.layers), group):
            blocks = self.layers[start : start + group]
            if self.cfg.activation_checkpointing and self.training:
                h = checkpointed(_run_blocks(blocks, documents), h)
            else:
                h = _run_blocks(blocks, documents)(h)
        logits = self.output_head(self.final_norm(h), self.embedding.tied_output_weight())  # (B, S, V/tp)
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.output_head.true_vocab_size)  # (B, S) fp32


def _run_blocks(blocks, documents: Documents | None = None):
    def run(h):
        for block in blocks:
            h = block(h, documents)
        return h

    return run
