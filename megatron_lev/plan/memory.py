"""How much memory one training process needs, estimated from the config before anything is allocated.

    est = estimate_memory(cfg, world_size, padded_vocab, cuda=False)
    check_memory(est, cfg, cuda=False)   # ConfigError on CPU when it cannot fit; a warning line on GPU

Per process (bytes), with P the parameters of this rank's model-parallel part (all / (TP x PP)),
DP the data-parallel size, L the layers of this rank's pipeline stage:

- model states (mixed precision keeps an fp32 master copy; DeepSpeed's ZeRO-1/2 optimizer keeps
  its own fp32 partition even in fp32):
    weights  P x (4 fp32, 2 bf16/fp16)                       / DP under ZeRO-3
    grads    P x (4 fp32 or fp32 accumulation, else 2)       / DP under ZeRO-2/3
    Adam     P x (8 moments + 4 fp32 master)                 / DP under ZeRO-1/2/3
- activations kept for the backward: micro x seq x L x (4 h + (4 h + 4 ffn) / TP) values of 4
  (fp32) or 2 bytes; with `model.activation_checkpointing`, one layer's worth plus each layer's
  input (micro x seq x h);
- attention scores where they are materialised (not the flash kernels: a document mask,
  `data.reset_attention_mask`, or attention dropout on the scaled-dot-product path): micro x
  heads / TP x seq^2 x 2 values per layer kept (one layer's with `model.recompute_attention` or
  whole-block checkpointing), plus the boolean mask micro x seq^2;
- the output head's loss. Fused (`model.fused_loss`, the default): one chunk's logits, c x vocab /
  TP x (4 + value, the matmul's output before the fp32 copy in half precision), the head's gradient
  accumulated in fp32 (vocab / TP x h x (4 + value)) and the hidden states' (micro x seq x h x value),
  with c the chunk's tokens (`model.loss_chunk_tokens`, or what fits 256 MiB of fp32 logits);
  unfused: micro x seq x vocab / TP x (value + 8), the logits and the fp32 softmax the backward keeps;
- 0.5 GiB for the framework (torch, DeepSpeed, buffers).

An estimate, not a measurement (within a factor of about 2 of the peak for the shipped
configs); it refuses what is out of reach by far, such as a million-token sequence on a laptop.
Where it is wrong for a machine, `MEGATRON_LEV_NO_MEMORY_CHECK=1` skips the check.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

from megatron_lev.config import RunConfig
from megatron_lev.errors import ConfigError
from megatron_lev.plan.ds_config import data_parallel_size

SKIP_ENV = "MEGATRON_LEV_NO_MEMORY_CHECK"
FRAMEWORK_BYTES = 512 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one process needs, by part; `processes` share this machine's memory."""

    model_states: int
    activations: int
    attention: int
    logits: int
    framework: int
    processes: int
    vocab: int

    @property
    def per_process(self) -> int:
        return self.model_states + self.activations + self.attention + self.logits + self.framework

    @property
    def machine(self) -> int:
        return self.per_process * self.processes

    def parts(self) -> dict[str, int]:
        return {
            "weights, gradients and Adam": self.model_states,
            "activations": self.activations,
            "attention scores": self.attention,
            "logits and loss": self.logits,
        }

    def text(self) -> str:
        """`about 3.2 GiB per process (activations 2.1 GiB, logits 600 MiB, ...)`."""
        shown = ", ".join(
            f"{name} {size(v)}"
            for name, v in sorted(self.parts().items(), key=lambda kv: -kv[1])
            if v >= 1 << 20
        )
        return f"about {gib(self.per_process)} per process ({shown}, framework {size(self.framework)})"


def gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def size(n: float) -> str:
    """GiB from 1 GiB on, else MiB."""
    return gib(n) if n >= GIB else f"{n / (1 << 20):,.0f} MiB"


def estimate_memory(cfg: RunConfig, world_size: int, vocab: int, *, cuda: bool) -> MemoryEstimate:
    """The estimate for a run of `cfg` on `world_size` processes with a (padded) vocabulary `vocab`."""
    from megatron_lev.model.flops import parameter_count

    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dp = data_parallel_size(cfg, world_size)
    params = parameter_count(m, vocab)["total"] / (tp * pp)
    half = t.precision in ("bf16", "fp16")
    weight_bytes = 2 if half else 4
    grad_bytes = 4 if (not half or (pp > 1 and t.precision == "bf16")) else 2
    optim_bytes = 8 + 4  # exp_avg, exp_avg_sq and an fp32 copy of the weights
    states = (
        params * weight_bytes / (dp if p.zero_stage >= 3 else 1)
        + params * grad_bytes / (dp if p.zero_stage >= 2 else 1)
        + params * optim_bytes / (dp if p.zero_stage >= 1 else 1)
    )
    value = 2 if half else 4
    b, s, h, f = t.micro_batch_size, m.seq_length, m.hidden_size, m.ffn_size
    layers = math.ceil(m.num_layers / pp)
    per_layer = b * s * (4 * h + (4 * h + 4 * f) / tp) * value
    if m.activation_checkpointing:
        activations = per_layer + layers * b * s * h * value
    else:
        activations = layers * per_layer
    flash = cuda and half and _flash_attn_installed()
    materialised = not flash and (cfg.data.reset_attention_mask or m.attention_dropout > 0)
    attention = 0
    if materialised:
        kept = 1 if (m.activation_checkpointing or m.recompute_attention) else layers
        attention = kept * b * (m.num_attention_heads / tp) * s * s * 2 * value + b * s * s
    logits = loss_bytes(cfg, vocab)
    processes = _processes_here(world_size)
    return MemoryEstimate(
        int(states), int(activations), int(attention), int(logits), FRAMEWORK_BYTES, processes, vocab
    )


def loss_bytes(cfg: RunConfig, vocab: int) -> int:
    """Bytes the output head's loss adds on one process (see the module doc): fused or not."""
    from megatron_lev.parallel.fused_cross_entropy import chunk_tokens_for

    m, t = cfg.model, cfg.train
    value = 2 if t.precision in ("bf16", "fp16") else 4
    rows = vocab / cfg.parallel.tensor_model_parallel_size
    tokens = t.micro_batch_size * m.seq_length
    if not m.fused_loss:
        return int(tokens * rows * (value + 8))
    chunk = min(m.loss_chunk_tokens or chunk_tokens_for(int(rows), tokens), tokens)
    half_copy = 0 if value == 4 else value  # in half precision the matmul's output and its fp32 copy
    return int(
        chunk * rows * (4 + half_copy)
        + rows * m.hidden_size * (4 + half_copy)
        + tokens * m.hidden_size * value
    )


def check_memory(
    est: MemoryEstimate, cfg: RunConfig, *, cuda: bool, device_bytes: int | None = None
) -> str | None:
    """On CPU: raise ConfigError when the processes of this machine need more than its available
    memory, naming the keys to change. On GPU: a warning line when one process needs more than the
    device's memory (`device_bytes`), else None. Skipped with MEGATRON_LEV_NO_MEMORY_CHECK=1."""
    if os.environ.get(SKIP_ENV) == "1":
        return None
    if cuda:
        if device_bytes and est.per_process > device_bytes:
            return (
                f"the run may not fit on the GPU: {est.text()} against {gib(device_bytes)} of device "
                f"memory; {advice(est, cfg)}"
            )
        return None
    available, source = available_memory()
    if available is None or est.machine <= available:
        return None
    who = f"{est.processes} processes x " if est.processes > 1 else ""
    raise ConfigError(
        f"the run needs {who}{est.text()} but this machine has {gib(available)} available ({source}): "
        f"{advice(est, cfg)}; {SKIP_ENV}=1 skips this check"
    )


def advice(est: MemoryEstimate, cfg: RunConfig) -> str:
    """What to change, by the largest part of the estimate."""
    m, t = cfg.model, cfg.train
    shape = f"train.micro_batch_size={t.micro_batch_size} x model.seq_length={m.seq_length}"
    largest = max(est.parts().items(), key=lambda kv: kv[1])[0]
    if largest == "activations":
        fix = f"lower model.seq_length or train.micro_batch_size ({shape}, model.hidden_size={m.hidden_size})"
        if not m.activation_checkpointing:
            fix += ", or set model.activation_checkpointing=true"
        return fix
    if largest == "attention scores":
        return (
            f"lower model.seq_length or train.micro_batch_size ({shape}: the scores grow with the square of "
            "the sequence), or set data.reset_attention_mask=false and model.attention_dropout=0"
        )
    if largest == "logits and loss":
        return (
            f"lower train.micro_batch_size or model.seq_length ({shape} x a vocabulary of {est.vocab:,}), "
            "raise parallel.tensor_model_parallel_size"
            + (", or set model.fused_loss=true" if not cfg.model.fused_loss else "")
        )
    return (
        f"choose a smaller model (model.hidden_size={m.hidden_size}, model.num_layers={m.num_layers}), raise "
        f"parallel.zero_stage (now {cfg.parallel.zero_stage}) with more processes, or use "
        "train.precision=bf16"
    )


def available_memory() -> tuple[int | None, str]:
    """Bytes this process may still allocate: /proc/meminfo's MemAvailable, lowered to what the
    cgroup's memory.max leaves; (None, "") when neither can be read."""
    found: list[tuple[int, str]] = []
    with contextlib.suppress(OSError, ValueError, IndexError):  # no /proc (not Linux) or an odd line
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable"))
                break
    if not found:
        with contextlib.suppress(OSError, ValueError):  # sysconf without these names
            found.append((os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages"))
    limit = _cgroup_room()
    if limit is not None:
        found.append((limit, "the cgroup's memory.max"))
    if not found:
        return None, ""
    return min(found)


def _cgroup_room() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), None when unlimited or unknown."""
    try:
        rel = next(
            line.split(":", 2)[2]
            for line in Path("/proc/self/cgroup").read_text().splitlines()
            if line.startswith("0::")
        )
        base = Path("/sys/fs/cgroup") / rel.strip().lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(int(limit) - int((base / "memory.current").read_text()), 0)
    except (OSError, ValueError, StopIteration, IndexError):
        return None


def _processes_here(world_size: int, environ=None) -> int:
    """Training processes sharing this machine: the launcher's local world size (torchrun's
    LOCAL_WORLD_SIZE, Slurm's tasks on this node), else all of them."""
    env = os.environ if environ is None else environ
    value = str(env.get("LOCAL_WORLD_SIZE", "")).strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    slurm = slurm_tasks_here(env)
    # never more than the run has: a one-process run started inside an allocation of 8 tasks is one
    return min(slurm, max(world_size, 1)) if slurm else max(world_size, 1)


def _expand_tasks_per_node(spec: str) -> list[int] | None:
    """Slurm's compressed tasks-per-node list (`8(x64)`, `2(x3),1`) as one count per node."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        count, _, rest = part.partition("(")
        if not count.isdigit():
            return None
        times = 1
        if rest:
            reps = rest.rstrip(")").lstrip("x")
            if not reps.isdigit():
                return None
            times = int(reps)
        out += [int(count)] * times
    return out or None


def slurm_tasks_here(env) -> int | None:
    """This node's tasks of a Slurm launch: SLURM_NTASKS_PER_NODE, else this node's entry
    (SLURM_NODEID) of SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE (their largest without a node
    id), else SLURM_NTASKS over the nodes rounded up; None outside Slurm."""
    value = str(env.get("SLURM_NTASKS_PER_NODE", "")).strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        counts = _expand_tasks_per_node(str(env.get(key, "")))
        if counts:
            node = str(env.get("SLURM_NODEID", "")).strip()
            if node.isdigit() and int(node) < len(counts):
                return counts[int(node)]
            return max(counts)
    tasks = str(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "").strip()
    nodes = str(
        env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or ""
    )
    if tasks.isdigit() and nodes.strip().isdigit() and int(nodes) > 0:
        return -(-int(tasks) // int(nodes))
    return None


def _flash_attn_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None
