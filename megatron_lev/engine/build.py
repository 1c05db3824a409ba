"""From a model spec and this rank's parallel layout to this rank's model: `GPTModel` (PP = 1) or a
DeepSpeed `PipelineModule` (`engine.pipeline`, built from the same stages). Which of the two is the
backend's choice."""

from __future__ import annotations

from torch import nn

from megatron_lev.engine.pipeline import build_pipeline
from megatron_lev.errors import ConfigError
from megatron_lev.model.gpt import GPTModel
from megatron_lev.parallel.layout import ParallelLayout
from megatron_lev.parallel.random import tp_rng_tracker
from megatron_lev.plan.spec import ModelSpec


def build_model(spec: ModelSpec, layout: ParallelLayout, topology=None) -> nn.Module:
    """Build the model for this rank from a `ModelSpec` (a run's `plan.model_spec`, or
    `plan.model_spec(cfg, vocab)` for a model that is not trained here) and the `layout` of the
    process groups (`parallel.state.initialize_model_parallel`; with TP = PP = 1 a sizes-only
    `ParallelLayout.single()` will do).

    The spec was validated and its vocabulary padded where it was made: nothing is checked or derived
    again, but the layout must be the spec's. The padding rows are left out of the loss (see
    `parallel.cross_entropy`).

    Either model carries its RNG tracker as `model.rng` (`parallel.random.tp_rng_tracker(spec.seed,
    layout)`): its attention dropout and recompute use it, and a checkpoint saves it.
    """
    if (layout.tp, layout.pp) != (spec.tp, spec.pp):
        raise ConfigError(
            f"the layout has TP={layout.tp}, PP={layout.pp} but the config asks for "
            f"parallel.tensor_model_parallel_size={spec.tp}, parallel.pipeline_model_parallel_size={spec.pp}"
            + (
                ""
                if layout.has_groups
                else ": call megatron_lev.parallel.state.initialize_model_parallel(tp, pp)"
            )
        )
    rng = tp_rng_tracker(spec.seed, layout)
    if spec.pp == 1:
        return GPTModel(
            spec.model,
            spec.padded_vocab,
            seed=spec.seed,
            true_vocab_size=spec.true_vocab,
            layout=layout,
            rng=rng,
        )
    return build_pipeline(spec, layout, topology, rng)
