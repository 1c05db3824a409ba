"""Canonical project names <-> Hugging Face `LlamaForCausalLM` names, with the fused weights split.

The project's blocks are Llama's (RMSNorm, "rotate half" rotary, SwiGLU, no biases), so
the mapping is renaming plus splitting the fused QKV `[Wq; Wk; Wv]` and gate/up
`[Wgate; Wup]` weights; q/k rows need no permutation. Vocabulary rows past the real
vocabulary (TP padding) are dropped on export and zero-filled on import.
"""

from __future__ import annotations

import re

import torch

from megatron_lev.config import ModelConfig

_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")
_RENAME = {  # block-local canonical name -> block-local HF name (one-to-one)
    "attention_norm.weight": "input_layernorm.weight",
    "attention.dense.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
DENSE_TABLE = "embedding.table.weight"  # the input table of `tied` / `untied`


def qkv_sizes(cfg: ModelConfig) -> list[int]:
    hd = cfg.hidden_size // cfg.num_attention_heads
    return [cfg.num_attention_heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd]


def to_hf(
    name: str, tensor: torch.Tensor, cfg: ModelConfig, vocab_size: int
) -> list[tuple[str, torch.Tensor]]:
    """HF tensors for one canonical tensor (input-embedding parameters other than the dense table
    excluded)."""
    if m := _BLOCK.match(name):
        i, rest = m.groups()
        p = f"model.layers.{i}."
        if rest in _RENAME:
            return [(p + _RENAME[rest], tensor)]
        if rest == "attention.qkv.weight":
            q, k, v = tensor.split(qkv_sizes(cfg), dim=0)
            return [
                (p + "self_attn.q_proj.weight", q),
                (p + "self_attn.k_proj.weight", k),
                (p + "self_attn.v_proj.weight", v),
            ]
        if rest == "mlp.gate_up.weight":
            gate, up = tensor.chunk(2, dim=0)
            return [(p + "mlp.gate_proj.weight", gate), (p + "mlp.up_proj.weight", up)]
    elif name == "final_norm.weight":
        return [("model.norm.weight", tensor)]
    elif name == "output_head.weight":
        return [("lm_head.weight", tensor[:vocab_size])]
    elif name == DENSE_TABLE:
        return [("model.embed_tokens.weight", tensor[:vocab_size])]
    raise KeyError(f"no Hugging Face Llama name for parameter {name!r}")


def from_hf(
    hf: dict[str, torch.Tensor], cfg: ModelConfig, padded_vocab: int, tied: bool
) -> dict[str, torch.Tensor]:
    """The canonical state dict of a `tied`/`untied` GPTModel from a Llama state dict."""
    out: dict[str, torch.Tensor] = {}
    inverse = {v: k for k, v in _RENAME.items()}
    for i in range(cfg.num_layers):
        p, c = f"model.layers.{i}.", f"layers.{i}."
        for hf_name, name in inverse.items():
            out[c + name] = hf[p + hf_name]
        out[c + "attention.qkv.weight"] = torch.cat(
            [hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"], dim=0
        )
        out[c + "mlp.gate_up.weight"] = torch.cat(
            [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], dim=0
        )
    out["final_norm.weight"] = hf["model.norm.weight"]
    out[DENSE_TABLE] = pad_rows(hf["model.embed_tokens.weight"], padded_vocab)
    if not tied:
        out["output_head.weight"] = pad_rows(hf["lm_head.weight"], padded_vocab)
    return out


def pad_rows(table: torch.Tensor, rows: int) -> torch.Tensor:
    """`table` with zero rows appended up to `rows` (the TP-padded vocabulary)."""
    if table.shape[0] > rows:
        raise ValueError(f"table has {table.shape[0]} rows, more than the padded vocabulary {rows}")
    return torch.cat([table, table.new_zeros(rows - table.shape[0], *table.shape[1:])], dim=0)
