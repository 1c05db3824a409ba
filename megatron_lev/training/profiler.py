"""A `torch.profiler` trace of a window of steps, and on CUDA a memory history snapshot of it:
`logging.profile_steps: [first, last]` on `logging.profile_ranks` (default rank 0).

    logging:
      profile_steps: [20, 24]      # iterations 20..24 (1-based, as the log lines count them)
      profile_ranks: [0, 8]

The trace is written under `<output_dir>/profile/` by `torch.profiler.tensorboard_trace_handler`
(`rank{R}.<host>_<pid>.<time>.pt.trace.json`): open it in TensorBoard's profiler plugin or drag it
into Perfetto (ui.perfetto.dev). The model's parts are named ranges around their operators
(`layers.3.attention`, `layers.3.mlp`, `embedding`, `output_head`), through forward hooks held for the
window only. With CUDA the window's allocations are recorded too
(`torch.cuda.memory._record_memory_history`) and dumped to `profile/rank{R}_memory.pickle`, for
pytorch.org/memory_viz. Steps outside the window run unprofiled; a run that stops inside the window
writes what it has.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_lev.log import get_logger
from megatron_lev.training.hooks import Callback, Control, TrainResult

if TYPE_CHECKING:
    from megatron_lev.training.trainer import Trainer

log = get_logger(__name__)


class StepProfiler(Callback):
    """Profiles iterations `first..last` (inclusive) on the ranks in `ranks` into `out_dir`."""

    def __init__(self, first: int, last: int, ranks: list[int], out_dir: str | Path) -> None:
        self.first, self.last, self.ranks, self.out_dir = first, last, set(ranks), Path(out_dir)
        self._prof = None
        self._memory = False
        self._rank = 0
        self._hooks: list = []

    def on_train_begin(self, trainer: Trainer, control: Control) -> None:
        self._rank = trainer.rank

    def on_step_begin(self, trainer: Trainer, iteration: int) -> None:
        # `iteration`: the one this step makes (1-based, as the log lines count)
        if self._rank not in self.ranks or self._prof is not None or iteration != self.first:
            return
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

        self.out_dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(
            activities=activities,
            record_shapes=True,
            profile_memory=True,
            with_stack=False,
            with_modules=True,
            on_trace_ready=tensorboard_trace_handler(str(self.out_dir), worker_name=self._worker()),
        )
        self._prof.__enter__()
        self._label_modules(trainer.engine.module)
        if torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(max_entries=200_000)
            self._memory = True
        log.info("profiling iterations %d..%d into %s", self.first, self.last, self.out_dir)

    def on_step_end(self, trainer: Trainer, iteration: int, skipped: bool, control: Control) -> None:
        if self._prof is not None and iteration >= self.last:
            self._finish()

    def on_train_end(self, trainer: Trainer, result: TrainResult) -> None:
        self._finish()

    def on_close(self, trainer: Trainer) -> None:
        self._finish()

    def _label_modules(self, model: torch.nn.Module) -> None:
        """Each block's parts as a named range (`layers.3.attention`): forward hooks open and close a
        `record_function` around the module, for the window only."""
        from torch.profiler import record_function

        def label(name: str):
            return f"layers.{name.split('layers.', 1)[1]}" if "layers." in name else name

        for name, module in model.named_modules():
            if not name or not any(
                part in name for part in ("layers.", "embedding", "final_norm", "output_head")
            ):
                continue
            if name.count(".") > 3:  # blocks and their attention / MLP / norms; no deeper
                continue
            ranges: list = []

            def pre(_module, _args, name=name, ranges=ranges):
                ranges.append(record_function(label(name)))
                ranges[-1].__enter__()

            def post(_module, _args, _out, ranges=ranges):
                if ranges:
                    ranges.pop().__exit__(None, None, None)

            self._hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def _worker(self) -> str:
        return f"rank{self._rank}.{socket.gethostname()}"

    def _finish(self) -> None:
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)  # writes the trace through on_trace_ready
        if self._memory:
            path = self.out_dir / f"rank{self._rank}_memory.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            self._memory = False
        log.info("profile of iterations %d..%d written to %s", self.first, self.last, self.out_dir)


def profiler_callback(cfg, rank: int) -> StepProfiler | None:
    """The profiler when `logging.profile_steps` is set and this rank is among `logging.profile_ranks`."""
    lg = cfg.logging
    if not lg.profile_steps or rank not in lg.profile_ranks:
        return None
    first, last = lg.profile_steps
    return StepProfiler(first, last, lg.profile_ranks, Path(lg.output_dir) / "profile")
