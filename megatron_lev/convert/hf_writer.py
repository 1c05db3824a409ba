"""The Hugging Face side of an export: LlamaConfig, generation config, streamed safetensors shards.

Nothing here knows the project's model; it receives already-merged tensors under
Hugging Face names and writes files `AutoModelForCausalLM` loads without custom code.
(Tokenizer files come from the tokenizer itself: `data.tokenizers.Tokenizer.save_for_hf`.)
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_lev.config import ModelConfig
from megatron_lev.utils.io import atomic_write_json

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' own default shard size


def llama_config(
    model: ModelConfig,
    vocab_size: int,
    tie_word_embeddings: bool,
    dtype: torch.dtype,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
):
    """A `LlamaConfig` describing the project's blocks (RMSNorm, rotary, SwiGLU, no biases)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.kv_heads,
        head_dim=model.hidden_size // model.num_attention_heads,
        hidden_act="silu",
        max_position_embeddings=model.seq_length,
        initializer_range=model.init_std,
        rms_norm_eps=model.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(model.rope_theta)},
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        dtype=dtype,
        architectures=["LlamaForCausalLM"],
    )


def write_config(out_dir: Path, config, max_new_tokens: int = 64, extra: dict | None = None) -> None:
    """config.json (with a top-level `rope_theta` too, for transformers 4.x; `extra` keys merged in)
    and generation_config.json."""
    from transformers import GenerationConfig

    cfg = config.to_dict()
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta"))
    cfg.update(extra or {})
    atomic_write_json(out_dir / "config.json", cfg)
    gen = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.eos_token_id,
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    atomic_write_json(out_dir / "generation_config.json", gen.to_dict())


class SafetensorsShardWriter:
    """Collect tensors and write a safetensors shard whenever `max_shard_bytes` is reached.

    Only the current shard is held in memory. `close()` names the shards
    `model-0000i-of-0000n.safetensors` and writes `model.safetensors.index.json`
    (or a single `model.safetensors` when one shard suffices). Files are written to
    temporary names first, so a crash leaves no half-written model behind.
    """

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._shards):
            raise ValueError(f"tensor {name!r} written twice")
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        path = self.out_dir / f".shard-{len(self._shards):05d}.tmp"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Flush the last shard, give the shards their final names, write the index; returns the files."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            final = [self.out_dir / "model.safetensors"]
        else:
            final = [self.out_dir / f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        umask = os.umask(0)
        os.umask(umask)
        for (tmp, names), path in zip(self._shards, final):
            os.chmod(tmp, 0o666 & ~umask)  # safetensors creates files owner-only; others must read the model
            os.replace(tmp, path)
            weight_map.update({name: path.name for name in names})
        if n > 1:
            atomic_write_json(
                self.out_dir / "model.safetensors.index.json",
                {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map},
            )
        return final
