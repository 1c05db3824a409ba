"""The GPT model as one module (PP = 1; also what ZeRO-2/3 wrap).

    input ids (B, S) -> input embedding (any variant) -> N x TransformerBlock
    -> RMSNorm -> vocabulary-parallel head -> logits (B, S, V/tp) or per-token loss (B, S)

Packed documents (optional, `model.documents`): `position_ids (B, S)` restart RoPE at each
document, `document_ids (B, S)` keep attention inside each document.

The network is defined once, as the stage list `GPTModel.stages` (`model.stages`): this model
adopts the stages' modules under their own names, and the pipeline-parallel model
(`engine.pipeline`) builds the same stages, so both start from exactly the same weights and
their parameters carry the same (canonical) names.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_lev.config import ModelConfig
from megatron_lev.model.block import checkpointed
from megatron_lev.model.documents import Documents
from megatron_lev.model.head import VocabParallelHead
from megatron_lev.model.stages import StageSpec, stage_specs
from megatron_lev.parallel.cross_entropy import vocab_parallel_cross_entropy


class GPTModel(nn.Module):
    """Decoder-only LM. `vocab_size` is the padded size (divisible by TP; see `vocab.padded_vocab_size`).

    `true_vocab_size` is the tokenizer's vocabulary (default: no padding): the loss masks the
    logits of the padding rows, so every TP size trains the objective of the exported model.
    """

    def __init__(
        self, model_cfg: ModelConfig, vocab_size: int, seed: int = 1234, true_vocab_size: int | None = None
    ):
        super().__init__()
        self.cfg, self.vocab_size = model_cfg, vocab_size
        modules: dict[str, nn.Module] = {}  # in stage order: embedding, layers, final_norm, output_head
        built: set[str] = set()
        for spec in self.stages(model_cfg, vocab_size, seed, true_vocab_size):
            if spec.tied_key is not None:
                if spec.tied_key in built:
                    continue  # a second use of a shared stage: the tied head, below
                built.add(spec.tied_key)
            for name, child in spec.build().named_children():
                if isinstance(child, nn.ModuleDict):  # a block stage's {str(i): block i}, in order of i
                    modules.setdefault(name, nn.ModuleList()).extend(child.values())
                else:
                    modules[name] = child
        for name, module in modules.items():
            setattr(self, name, module)
        if "output_head" not in modules:  # tied: the head holds no weight and uses the embedding's table
            self.output_head = VocabParallelHead(
                model_cfg.hidden_size,
                vocab_size,
                model_cfg.init_std,
                tied=True,
                true_vocab_size=true_vocab_size,
            )
            if self.embedding.tied_output_weight() is None:
                raise ValueError(
                    f"model.embedding={model_cfg.embedding!r} has no table to tie the output head to"
                )

    @staticmethod
    def stages(
        model_cfg: ModelConfig,
        vocab_size: int,
        seed: int,
        true_vocab_size: int | None = None,
        document_inputs: tuple[str, ...] = (),
    ) -> list[StageSpec]:
        """The model's stages in order, unbuilt (`model.stages.stage_specs`)."""
        return stage_specs(model_cfg, vocab_size, seed, true_vocab_size, document_inputs)

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
