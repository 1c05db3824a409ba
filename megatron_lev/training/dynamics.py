"""What the optimiser does to the model, at every log line: `TrainingDynamics`.

On the steps that end a log interval (the same steps `MetricsLogger` logs) the engine measures the
optimizer step (`Engine.measure_next_step`: full-tensor norms in any TP/PP/ZeRO layout) and this
callback adds to the log line:

    grad_norm/group/<g>, grad_norm/<tensor>   gradient norm per parameter group and per input-layer
                                              tensor (canonical name, e.g. embedding.delta), unclipped
    param_norm/group/<g>, param_norm/<tensor> weight norm before the step
    update_ratio/group/<g>, update_ratio/<tensor>
                                              |w_after - w_before| / |w_before| over the step
    input_table/rms, input_table/mean_row_ratio, input_table/effective_rank,
    input_table/effective_rank_centred        the input table over a fixed sample of token ids
    input_table/update_ratio                  |T_after - T_before| / |T_before| of those rows over the step

The input-layer tensors are the parameters under the model's `embedding` module. The table
statistics use `utils.matrix`, as `megatron-lev geometry` does over a checkpoint's whole table;
`effective_rank_centred` is that of the sample rows minus their mean row. The sample is
`logging.dynamics_sample_ids` ids drawn once with a fixed seed from the tokenizer's vocabulary (all
of it when smaller), the same in every run and layout; `InputEmbedding.sample_rows` computes only
those rows. Under pipeline parallelism the first stage computes them (rank 0, which writes, is on it).

Steps between log lines are not measured and cost nothing; a log line costs one more host read.

`ClipMetrics`, on in every run, logs how the step was clipped (`engine.clipping`) at every log line:

    grad_norm/global                          the norm of every gradient together (= `grad_norm`)
    clipped                                   1 when the global group's gradients were scaled down
    clip_factor/<g>                           what clip group <g>'s gradients were multiplied by
                                              (`global`, and each of `plan.clip_group_rules`)
    grad_norm/clip/<g>                        clip group <g>'s own norm (only with clip groups)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from megatron_lev.model.embeddings.base import InputEmbedding, find_input_embedding
from megatron_lev.parallel.layout import SINGLE, ParallelLayout
from megatron_lev.training.hooks import Callback, Control, StepRecord
from megatron_lev.utils import matrix

if TYPE_CHECKING:
    from megatron_lev.training.trainer import Trainer

INPUT_LAYER = "embedding."  # the canonical prefix of the input layer's parameters
SAMPLE_SEED = 0
TABLE_KEYS = ("rms", "mean_row_ratio", "effective_rank", "effective_rank_centred", "update_ratio")


def sample_ids(vocab_size: int, count: int, seed: int = SAMPLE_SEED) -> torch.Tensor:
    """`count` distinct ids of `[0, vocab_size)` drawn with `seed`, sorted (every id when fewer)."""
    if vocab_size <= count:
        return torch.arange(vocab_size)
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab_size, generator=gen)[:count].sort().values


def table_statistics(rows: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """`(5,)` float64 in the order of TABLE_KEYS, of the sample `rows` after a step and `before` it,
    on the rows' device (no host read)."""
    x = rows.double()
    centred = x - x.mean(dim=0)
    moved = (x - before.double()).norm() / before.double().norm()
    return torch.stack(
        [
            matrix.rms(x),
            matrix.mean_row_ratio(x),
            matrix.effective_rank(x),
            matrix.effective_rank(centred),
            moved,
        ]
    )


class ClipMetrics(Callback):
    """How each logged step was clipped (see the module doc): read with the step's loss, no host read
    of its own."""

    order = 1  # after MetricsLogger (0)

    def __init__(self) -> None:
        self._last: StepRecord | None = None

    def on_step_values(self, trainer: Trainer, record: StepRecord, control: Control) -> None:
        self._last = record

    def metrics(self, trainer: Trainer, iteration: int) -> dict[str, Any]:
        record, self._last = self._last, None
        clip = trainer.engine.clip_record()
        if record is None or record.iteration != iteration or record.clip is None or clip is None:
            return {}
        n = len(clip.names)
        norms, factors = record.clip[:n], record.clip[n:]
        out: dict[str, Any] = {"grad_norm/global": record.grad_norm, "clipped": int(factors[0] < 1.0)}
        for name, norm, factor in zip(clip.names, norms, factors):
            out[f"clip_factor/{name}"] = factor
            if n > 1:
                out[f"grad_norm/clip/{name}"] = norm
        return out


class TrainingDynamics(Callback):
    """Gradient and update norms per group and input-layer tensor, and the input table's shape at
    every log line (see the module doc)."""

    order = 1  # after MetricsLogger (0)

    def __init__(
        self,
        log_interval: int,
        sample: int = 1024,
        vocab_size: int | None = None,
        layout: ParallelLayout = SINGLE,
    ) -> None:
        self.log_interval, self.layout = log_interval, layout
        self.sample, self.vocab_size = sample, vocab_size
        self.embedding: InputEmbedding | None = None
        self.ids: torch.Tensor | None = None
        self._measured: int | None = None  # the iteration whose step the engine measures
        self._rows_before: torch.Tensor | None = None  # the sample rows before that step

    def on_train_begin(self, trainer: Trainer, control: Control) -> None:
        self._measured = None
        found = find_input_embedding(trainer.engine.module)
        # under a pipeline the first stage computes the table (the last may hold a tied copy)
        self.embedding = found if self.layout.pp_rank == 0 else None
        if self.embedding is not None:
            vocab = min(self.vocab_size or self.embedding.vocab_size, self.embedding.vocab_size)
            device = next(self.embedding.parameters()).device
            self.ids = sample_ids(vocab, self.sample).to(device)

    def due(self, trainer: Trainer, iteration: int) -> bool:
        """The steps MetricsLogger logs: every `log_interval`, and the last."""
        return iteration % self.log_interval == 0 or iteration == trainer.budget.train_iters

    def on_step_begin(self, trainer: Trainer, iteration: int) -> None:
        if self.due(trainer, iteration):
            trainer.engine.measure_next_step((INPUT_LAYER,))
            self._measured = iteration
            self._rows_before = self.rows(trainer)  # stays on the device

    def metrics(self, trainer: Trainer, iteration: int) -> dict[str, Any]:
        if iteration != self._measured:
            return {}
        self._measured = None
        step = trainer.engine.step_measurement()
        table = self.table(trainer)
        if step is None and table is None:
            return {}
        parts = []
        if step is not None:
            parts += [step.grad, step.weight, step.update]
        if table is not None:
            parts.append(table.to(parts[0].device) if parts else table)
        values = torch.cat([p.to(torch.float64) for p in parts]).tolist()  # the one host read
        out: dict[str, Any] = {}
        if step is not None:
            n = len(step.names)
            grad, weight, update = values[:n], values[n : 2 * n], values[2 * n : 3 * n]
            for name, g, w, u in zip(step.names, grad, weight, update):
                out[f"grad_norm/{name}"] = g
                out[f"param_norm/{name}"] = w
                out[f"update_ratio/{name}"] = u / w if w > 0 else float("nan")
            values = values[3 * n :]
        if table is not None:
            out.update({f"input_table/{k}": v for k, v in zip(TABLE_KEYS, values)})
        return out

    @torch.no_grad()
    def rows(self, trainer: Trainer) -> torch.Tensor | None:
        """The input table's rows at the sample ids, on the device; None on ranks without the input
        layer. Collective over the TP group (and, under ZeRO-3, the DP group)."""
        if self.embedding is None:
            return None
        with trainer.engine.full_parameters(self.embedding):
            return self.embedding.sample_rows(self.ids)

    def table(self, trainer: Trainer) -> torch.Tensor | None:
        """The input table's statistics over the sample (TABLE_KEYS) after the measured step."""
        before, self._rows_before = self._rows_before, None
        rows = self.rows(trainer)
        return None if rows is None or before is None else table_statistics(rows, before)


__all__ = ["INPUT_LAYER", "TABLE_KEYS", "ClipMetrics", "TrainingDynamics", "sample_ids", "table_statistics"]
