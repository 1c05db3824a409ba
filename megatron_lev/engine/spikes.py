"""Loss and gradient-norm spikes: a step whose gradient norm, or loss, lies more than `train.spike_zscore`
standard deviations above its mean over the last `train.spike_window` applied steps is not applied
(OLMo-core's rule; the optimizer state is untouched, as for a non-finite step).

    detector = SpikeDetector(window=100, zscore=6.0, device=device)
    flag = detector.check(grad_norm, loss)     # () bool on the device, before the optimizer steps
    ...                                        # the guard folds `flag` into its skip decision
    detector.record(grad_norm, loss)           # after an applied step only: a spike never enters

Everything stays on the device: the decision joins the optimizer guard's one host read. Nothing is
flagged until the window holds `window` applied steps. The window travels with the checkpoint
(`state_dict`), so a resumed run decides as the uninterrupted one would. A pipeline's loss is not
known before its optimizer steps (DeepSpeed's schedule steps inside `train_batch`): there the
gradient norm alone decides.
"""

from __future__ import annotations

import torch


class SpikeDetector:
    def __init__(self, window: int, zscore: float, device: torch.device) -> None:
        self.window, self.zscore, self.device = int(window), float(zscore), device
        self.hist = torch.zeros(2, self.window, dtype=torch.float64, device=device)  # norms, losses
        self.count = 0  # applied steps recorded (at most `window` count)
        self.pos = 0  # where the next one goes
        self.last: torch.Tensor | None = None  # (4,) the window's norm mean, sd, loss mean, sd at check

    def check(self, norm: torch.Tensor, loss: torch.Tensor | None) -> torch.Tensor:
        """() bool on the device: this step's norm (or loss, where given) is a spike."""
        if self.count < self.window:
            self.last = None
            return torch.zeros((), dtype=torch.bool, device=self.device)
        mean = self.hist.mean(dim=1)
        sd = self.hist.std(dim=1, unbiased=False)
        self.last = torch.stack([mean[0], sd[0], mean[1], sd[1]])
        floor = 1e-6 * mean.abs() + 1e-12  # a window of identical values: any rise counts
        over = (norm.to(self.hist) - mean[0]) > self.zscore * torch.maximum(sd[0], floor[0])
        if loss is not None:
            over = over | ((loss.to(self.hist) - mean[1]) > self.zscore * torch.maximum(sd[1], floor[1]))
        return over & torch.isfinite(norm.to(self.hist))  # non-finite steps are the guard's own

    def record(self, norm: torch.Tensor, loss: torch.Tensor | None) -> None:
        """Add an applied step's values (the loss column keeps the norm's slot where no loss is given)."""
        i = self.pos % self.window
        self.hist[0, i] = norm.to(self.hist)
        self.hist[1, i] = loss.to(self.hist) if loss is not None else 0.0
        self.pos += 1
        self.count = min(self.count + 1, self.window)

    def state_dict(self) -> dict:
        """Plain numbers (the checkpoint's train state): the window's values, count and position."""
        return {"hist": self.hist.cpu().tolist(), "count": self.count, "pos": self.pos, "window": self.window}

    def load_state_dict(self, state: dict) -> None:
        if not state or int(state.get("window", -1)) != self.window:  # none, or another window: afresh
            return
        self.hist.copy_(torch.tensor(state["hist"], dtype=torch.float64))
        self.count, self.pos = int(state["count"]), int(state["pos"])
