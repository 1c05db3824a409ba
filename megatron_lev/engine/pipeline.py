"""The GPT model as a DeepSpeed `PipelineModule` (PP > 1), built from the model's own stage list.

The layers are `stage_specs(...)` (`model/stages.py`) in order, the stages `GPTModel` runs; a
stage's index is DeepSpeed's layer index (`layer_XX` in checkpoints) and its `state_dict()`, hence
its layer file, holds canonical (`GPTModel`) names. A stage with a `tied_key` becomes a
`TiedLayerSpec`: with a tied embedding, the first and the last stage each hold a copy of the table
(the last one runs `EmbeddingStage.head_logits`); DeepSpeed broadcasts it at start and
all-reduces its gradient between the two stages, so the copies stay identical.

Batches are `((input_ids,), labels)`; `loss_fn` returns the mean per-token loss. With
`model.fused_loss` (the default) the last layer passes the hidden state and its head's rows on
(`DeferredHeadStage`, or the tied table's `head_hidden`) and `loss_fn` (`FusedPipelineLoss`) runs the
head fused with the cross-entropy, as `GPTModel` does; otherwise the last layer returns logits and
`loss_fn` is `pipeline_loss` (`model.loss.lm_loss`). Every TP rank of the first and last stage reads
its own data iterator: feed them the same batches.

Packed documents (`data.reset_position_ids`, `data.reset_attention_mask`, `data.eod_mask_loss`):
the inputs are `(input_ids, position_ids, document_ids)`, each `(B, S)`, keeping only those
switched on and in this order (`document_inputs`); they travel beside the hidden state from stage
to stage, `(h, position_ids, document_ids)`, and the final norm drops them. With a loss mask the
labels are `(labels, loss_mask)` and `loss_fn` averages over the unmasked tokens.

Activation checkpointing is DeepSpeed's (`activation_checkpoint_interval`), recomputing through
`engine.recompute.checkpointed` as the plain model does.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator

import torch
from torch import nn

from megatron_lev.engine.recompute import checkpointed
from megatron_lev.model.head import vocab_parallel_loss
from megatron_lev.model.loss import lm_loss, real_vocab_size
from megatron_lev.model.stages import BlockStage, StageSpec, stage_specs
from megatron_lev.parallel.layout import ParallelLayout
from megatron_lev.parallel.random import RNGStatesTracker
from megatron_lev.plan.spec import ModelSpec

STAGE_PREFIX = re.compile(r"^(?:\d+|tied_modules\.[^.]+)\.")  # a PipelineModule's layer (or tied) prefix
TIED_WEIGHT_ATTR = "tied_weight"  # what a shared stage calls the tensor its copies share (StageSpec)


def pipeline_loss(
    logits: torch.Tensor, labels, vocab_size: int | None = None, *, layout: ParallelLayout
) -> torch.Tensor:
    """`lm_loss` of the last stage's logits `(B, S, V/tp)` and the batch's labels `(B, S)`, or
    `(labels, loss_mask)` (`pipeline_batches`).

    `vocab_size`: the real vocabulary; the padding rows beyond it are left out of the softmax.
    `layout`: the TP group the vocabulary is split over.
    """
    loss_mask = None
    if isinstance(labels, (tuple, list)):
        labels, loss_mask = labels
    return lm_loss(logits, labels, vocab_size, loss_mask, layout=layout)


class FusedPipelineLoss:
    """A pipeline's `loss_fn` with the fused head: the last layer's `(hidden (B, S, D), head rows
    (V/tp, D))` (`DeferredHeadStage`, or the tied table's `head_hidden`) and the labels
    (`pipeline_loss`'s forms) -> the masked mean loss (`model.head.vocab_parallel_loss`).

    The head's rows come out of the stage as a view, not read from the module here: DeepSpeed starts
    its backward bookkeeping (the bf16 optimizer clears the gradients it has not yet taken) when the
    gradient reaches the module's outputs, so a weight used only here would get its gradient before
    that and lose it. As an output, its gradient passes the module's outputs first, as the logits' did.
    """

    def __init__(self, vocab_size: int | None, chunk_tokens: int | None, layout: ParallelLayout):
        self.vocab_size, self.chunk_tokens, self.layout = vocab_size, chunk_tokens, layout

    def __call__(self, outputs, labels) -> torch.Tensor:
        hidden, weight = outputs
        loss_mask = None
        if isinstance(labels, (tuple, list)):
            labels, loss_mask = labels
        mean, _ = vocab_parallel_loss(
            hidden, weight, labels, self.vocab_size, loss_mask, self.chunk_tokens, self.layout
        )
        return mean


def layer_specs(stages: list[StageSpec]) -> list:
    """DeepSpeed's `LayerSpec` / `TiedLayerSpec` for each stage (built later, only on the rank owning it)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    out = []
    for stage in stages:
        if stage.tied_key is None:
            out.append(LayerSpec(stage.cls, *stage.args))
            continue
        forward_fn = getattr(stage.cls, stage.tied_forward) if stage.tied_forward else None
        out.append(
            TiedLayerSpec(
                stage.tied_key,
                stage.cls,
                *stage.args,
                forward_fn=forward_fn,
                tied_weight_attr=TIED_WEIGHT_ATTR,
            )
        )
    return out


def build_pipeline(spec: ModelSpec, layout: ParallelLayout, topology, rng: RNGStatesTracker):
    """A `deepspeed.pipe.PipelineModule` of `spec` (already validated) on `layout`, carrying the model's
    RNG tracker `rng` (`parallel.random.tp_rng_tracker`, made by `engine.build.build_model`) as `rng`.

    The loss keeps `spec.true_vocab` rows of the padded vocabulary. DeepSpeed's topology is the
    layout's (the same rank order) unless `topology` is given.
    """
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    _wrap_process_group()
    m = spec.model
    if topology is None:
        topology = PipeModelDataParallelTopology(num_pp=layout.pp, num_mp=layout.tp, num_dp=layout.dp)
    stages = stage_specs(
        m, spec.padded_vocab, spec.seed, spec.documents, layout, spec.true_vocab, m.fused_loss, rng
    )
    real = real_vocab_size(spec.padded_vocab, spec.true_vocab)
    if m.fused_loss:
        loss_fn = FusedPipelineLoss(real, m.loss_chunk_tokens or None, layout)
    else:
        loss_fn = functools.partial(pipeline_loss, vocab_size=real, layout=layout)
    # each stage seeds itself (layer_seed), so DeepSpeed's own per-layer seeding stays off
    pipe = PipelineModule(
        layers=layer_specs(stages),
        topology=topology,
        loss_fn=loss_fn,
        partition_method=_partition_method(spec.partition_method),
        activation_checkpoint_interval=m.checkpoint_num_layers if m.activation_checkpointing else 0,
        activation_checkpoint_func=functools.partial(checkpointed, rng=rng),
        checkpointable_layers=[BlockStage.__name__],
        seed_layers=False,
    )
    pipe.rng = rng
    return pipe


def stage_modules(pipe: nn.Module) -> list[nn.Module]:
    """This rank's stage modules (a shared one once); their `state_dict()` names are canonical."""
    return [*pipe.tied_modules.values(), *(m for name, m in pipe.named_children() if name.isdigit())]


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
    return {"parameters": "parameters", "uniform": f"type:^{BlockStage.__name__}$"}[name]


def pipeline_batches(batches: Iterator) -> Iterator[tuple]:
    """DeepSpeed's pipeline form of the data side's micro-batches: `((input_ids, *document tensors),
    labels)`, with a loss mask `((...), (labels, loss_mask))`; the document tensors in the order of
    `document_inputs`."""
    from megatron_lev.data.batches import MicroBatch

    for batch in batches:
        if isinstance(batch, MicroBatch):
            extra = (t for t in (batch.position_ids, batch.document_ids) if t is not None)
            labels = batch.labels if batch.loss_mask is None else (batch.labels, batch.loss_mask)
            yield (batch.input_ids, *extra), labels
        else:
            input_ids, labels = batch
            yield (input_ids,), labels
