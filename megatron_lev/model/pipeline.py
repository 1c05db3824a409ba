"""The GPT model as a DeepSpeed `PipelineModule` (PP > 1).

Layer specs, in order (the index is the DeepSpeed layer index, `layer_XX` in checkpoints):
    0            EmbeddingStage  (first stage; consumes token ids)   canonical prefix ""
    1 .. L       TransformerBlock i = index - 1                       "layers.{i}."
    L + 1        FinalNormStage                                      "final_norm."
    L + 2        HeadStage (untied) / tied embedding copy              "output_head." / ""
When the variant's class `ties_output_head` (`tied`), layers 0 and L + 2 are
`TiedLayerSpec("embedding", ...)`: the first and the last stage each hold a copy of the table;
DeepSpeed broadcasts it at start and all-reduces its gradient between the two stages, so the
copies stay identical.

Batches are `((input_ids,), labels)`; `loss_fn` returns the mean per-token loss. Every TP rank
of the first and last stage reads its own data iterator: feed them the same batches.

Packed documents (`data.reset_position_ids`, `data.reset_attention_mask`, `data.eod_mask_loss`):
the inputs are `(input_ids, position_ids, document_ids)`, each `(B, S)`, keeping only those
switched on and in this order (`document_inputs`); they travel beside the hidden state from stage
to stage, `(h, position_ids, document_ids)`, and the final norm drops them. With a loss mask the
labels are `(labels, loss_mask)` and `loss_fn` averages over the unmasked tokens.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from megatron_lev.config import RunConfig
from megatron_lev.model.block import TransformerBlock, checkpointed
from megatron_lev.model.documents import documents_for, masked_mean
from megatron_lev.model.embeddings import embedding_class
from megatron_lev.model.gpt import build_embedding, layer_seed
from megatron_lev.model.head import VocabParallelHead
from megatron_lev.model.norm import RMSNorm
from megatron_lev.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lev.parallel.mappings import copy_to_tensor_parallel_region
from megatron_lev.parallel.random import seeded

TIED_KEY = "embedding"


class EmbeddingStage(nn.Module):
    """Token ids -> hidden states. Holds the input embedding as `embedding`."""

    def __init__(self, model_cfg, vocab_size: int, seed: int):
        super().__init__()
        self.embedding = build_embedding(model_cfg, vocab_size, seed)

    @property
    def tied_weight(self) -> torch.Tensor:  # the tied table, named for DeepSpeed's `tied_weight_attr`
        return self.embedding.tied_output_weight()

    def forward(
        self, inputs
    ):  # ((B, S), *document tensors) or (B, S) -> (B, S, D) or ((B, S, D), *document tensors)
        if isinstance(inputs, (tuple, list)):
            h = self.embedding(inputs[0])
            return (h, *inputs[1:]) if len(inputs) > 1 else h
        return self.embedding(inputs)


class DocumentTransformerBlock(TransformerBlock):
    """A `TransformerBlock` whose input and output are `(h, *document tensors)` (names in `inputs`).

    The same parameters, names and seed as `TransformerBlock`; only the calling convention differs.
    """

    def __init__(self, cfg, layer_index: int, seed: int, inputs: tuple[str, ...]):
        super().__init__(cfg, layer_index, seed)
        self.document_inputs = inputs

    def forward(self, inputs):  # ((B, S, D), *(B, S)) -> ((B, S, D), *(B, S))
        h, *extra = inputs
        documents = documents_for(**dict(zip(self.document_inputs, extra, strict=True)))
        return (super().forward(h, documents), *extra)


class FinalNormStage(RMSNorm):
    """The final RMSNorm (holds no random state, so it needs no seed); drops the document tensors."""

    def __init__(self, model_cfg):
        super().__init__(model_cfg.hidden_size, model_cfg.norm_eps)

    def forward(self, x):
        return super().forward(x[0] if isinstance(x, (tuple, list)) else x)


class HeadStage(VocabParallelHead):
    """The untied vocabulary-parallel head `(B, S, D) -> (B, S, V/tp)`, drawn from the head's seed."""

    def __init__(self, model_cfg, vocab_size: int, seed: int):
        with seeded(layer_seed(seed, "head")):
            super().__init__(model_cfg.hidden_size, vocab_size, model_cfg.init_std, tied=False)


def _tied_head_forward(stage: EmbeddingStage, h: torch.Tensor) -> torch.Tensor:
    """The last stage's use of the tied table: logits `(B, S, V/tp)` (the hidden state enters the TP
    region)."""
    return nn.functional.linear(copy_to_tensor_parallel_region(h), stage.tied_weight)


def pipeline_loss(logits: torch.Tensor, labels, vocab_size: int | None = None) -> torch.Tensor:
    """Mean per-token loss from vocabulary-parallel logits `(B, S, V/tp)` and labels `(B, S)`, or
    `(labels, loss_mask)`: then the mean over the tokens the mask keeps (`masked_mean`).

    `vocab_size`: the real vocabulary; the padding rows beyond it are left out of the softmax.
    """
    if isinstance(labels, (tuple, list)):
        labels, loss_mask = labels
        return masked_mean(vocab_parallel_cross_entropy(logits, labels, vocab_size), loss_mask)
    return vocab_parallel_cross_entropy(logits, labels, vocab_size).mean()


def document_inputs(data_cfg) -> tuple[str, ...]:
    """Names of the document tensors that follow `input_ids` in a pipeline batch, in order."""
    return tuple(
        name
        for name, on in (
            ("position_ids", data_cfg.reset_position_ids),
            ("document_ids", data_cfg.reset_attention_mask),
        )
        if on
    )


def build_pipeline(cfg: RunConfig, vocab_size: int, topology=None, true_vocab_size: int | None = None):
    """A `deepspeed.pipe.PipelineModule` for `cfg` (already validated); `vocab_size` is padded.

    `true_vocab_size` (the tokenizer's, default: no padding) is what the loss keeps.
    """
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from megatron_lev.parallel import state

    _wrap_process_group()
    m, p, seed = cfg.model, cfg.parallel, cfg.train.seed
    if topology is None:
        import torch.distributed as dist

        dp = state.layout(dist.get_world_size(), p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
        topology = PipeModelDataParallelTopology(
            num_pp=p.pipeline_model_parallel_size, num_mp=p.tensor_model_parallel_size, num_dp=dp
        )
    tied = embedding_class(m.embedding).ties_output_head
    if tied:
        specs = [TiedLayerSpec(TIED_KEY, EmbeddingStage, m, vocab_size, seed, tied_weight_attr="tied_weight")]
    else:
        specs = [LayerSpec(EmbeddingStage, m, vocab_size, seed)]
    extra = document_inputs(cfg.data)
    if extra:
        specs += [
            LayerSpec(DocumentTransformerBlock, m, i, layer_seed(seed, "block", i), extra)
            for i in range(m.num_layers)
        ]
    else:
        specs += [
            LayerSpec(TransformerBlock, m, i, layer_seed(seed, "block", i)) for i in range(m.num_layers)
        ]
    specs.append(LayerSpec(FinalNormStage, m))
    if tied:
        specs.append(
            TiedLayerSpec(
                TIED_KEY,
                EmbeddingStage,
                m,
                vocab_size,
                seed,
                forward_fn=_tied_head_forward,
                tied_weight_attr="tied_weight",
            )
        )
    else:
        specs.append(LayerSpec(HeadStage, m, vocab_size, seed))
    ckpt = m.checkpoint_num_layers if m.activation_checkpointing else 0
    # each layer seeds itself (layer_seed), so DeepSpeed's own per-layer seeding stays off
    loss_fn = (
        functools.partial(pipeline_loss, vocab_size=true_vocab_size) if true_vocab_size else pipeline_loss
    )
    return PipelineModule(
        layers=specs,
        topology=topology,
        loss_fn=loss_fn,
        partition_method=_partition_method(p.partition_method),
        activation_checkpoint_interval=ckpt,
        activation_checkpoint_func=checkpointed,
        checkpointable_layers=["TransformerBlock", "DocumentTransformerBlock"],
        seed_layers=False,
    )


def _wrap_process_group() -> None:
    """Let DeepSpeed's comm layer adopt an already initialised torch.distributed group (no re-init)."""
    import deepspeed
    import deepspeed.comm as ds_dist
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "pipeline parallelism needs torch.distributed initialised (e.g. by the launcher) first"
        )
    if not ds_dist.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=None)


def _partition_method(name: str) -> str:
    # "parameters": balance trainable parameter counts (DeepSpeed's own method);
    # "uniform": the same number of blocks per stage (embedding on the first, norm + head on the last)
    return {"parameters": "parameters", "uniform": "type:TransformerBlock"}[name]


def canonical_name(pipeline_name: str, num_layers: int) -> str:
    """Map a `PipelineModule` parameter name to the canonical (GPTModel, TP=1) name.

    `"3.attention.qkv.weight"` -> `"layers.2.attention.qkv.weight"`; `"0.embedding.x"` -> `"embedding.x"`;
    `"tied_modules.embedding.embedding.weight"` -> `"embedding.weight"`.
    """
    head, _, rest = pipeline_name.partition(".")
    if head == "tied_modules":
        _, _, rest = rest.partition(".")
        return rest
    idx = int(head)
    if idx == 0:
        return rest
    if idx <= num_layers:
        return f"layers.{idx - 1}.{rest}"
    return f"{'final_norm' if idx == num_layers + 1 else 'output_head'}.{rest}"
