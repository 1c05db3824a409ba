"""A Llama whose input embedding is the LEV layer, for Hugging Face `trust_remote_code` loading.

Copied next to the weights by `megatron-lev convert --keep-lev`; it depends only on torch and
transformers (not on megatron_lev), so an exported model keeps training LEV anywhere.
The math follows the LEV spec: compositional digits -> summed codebooks (seed z) -> per head
`u = sigmoid(LayerNorm(W z))` -> normalised quadratic B-spline basis on `kappa` knots ->
`phi = sum_m B_m(u) (1 + delta_m)` -> rank-r separable product over the seed coordinates
(`sign * exp(sum log(|phi| + 1e-9))`) -> `sum_l M_l @ W_out_l` (+ optional `W_res z`); with
`lev_centred`, `sum_l (M_l - 1) @ W_out_l`; with `lev_centre_reference` = R > 0,
`sum_l (M_l - mean_R M_l) @ W_out_l`, the mean over the R token ids `floor((2j + 1) V / 2R)` with V
`lev_reference_vocab` (the training run's vocabulary, padded as for one process). With a token-id
order other than `bpe` (`lev_id_order`: `random`, `frequency`) token i takes the digits of `id_rank[i]`, a
permutation stored with the weights (`model.embed_tokens.codebooks.id_rank`, int64, one entry per
token id).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

LOG_EPS = 1e-9
LN_EPS = 1e-5


class LevLlamaConfig(LlamaConfig):
    model_type = "lev_llama"

    def __init__(
        self,
        lev_k: int = 3,
        lev_base: int = 37,
        lev_d_seed: int = 128,
        lev_heads: int = 8,
        lev_kappa: int = 16,
        lev_rank: int = 64,
        lev_residual: bool = False,
        lev_chunk_size: int = 256,
        lev_centred: bool = False,
        lev_id_order: str = "bpe",
        lev_centre_reference: int = 0,
        lev_reference_vocab: int | None = None,
        **kwargs,
    ):
        self.lev_centred = lev_centred
        self.lev_centre_reference, self.lev_reference_vocab = lev_centre_reference, lev_reference_vocab
        self.lev_id_order = lev_id_order
        self.lev_k, self.lev_base, self.lev_d_seed, self.lev_heads = lev_k, lev_base, lev_d_seed, lev_heads
        self.lev_kappa, self.lev_rank, self.lev_residual, self.lev_chunk_size = (
            lev_kappa,
            lev_rank,
            lev_residual,
            lev_chunk_size,
        )
        super().__init__(**kwargs)


class _Codebooks(nn.Module):
    def __init__(self, k: int, base: int, d_seed: int, vocab_size: int, id_order: str = "bpe"):
        super().__init__()
        self.k, self.base = k, base
        self.weight = nn.Parameter(torch.zeros(k * base, d_seed))  # rows of C_0, then C_1, ...
        if id_order != "bpe":  # token i takes the digits of id_rank[i] (loaded with the weights)
            self.register_buffer("id_rank", torch.arange(vocab_size, dtype=torch.int64))
        else:
            self.id_rank = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, d_seed)
        if self.id_rank is not None:
            ids = self.id_rank[ids]
        powers = self.base ** torch.arange(self.k, device=ids.device)
        digits = (ids.unsqueeze(-1) // powers) % self.base + torch.arange(
            self.k, device=ids.device
        ) * self.base
        return F.embedding(digits, self.weight).sum(dim=-2)


def _basis(u: torch.Tensor, kappa: int) -> torch.Tensor:
    """Normalised quadratic B-spline basis, `u (...)` in [0, 1] -> `(..., kappa)`."""
    t = (u * (kappa - 1)).unsqueeze(-1) - torch.arange(kappa, device=u.device, dtype=u.dtype)
    a = t.abs()
    raw = torch.where(a < 0.5, 0.75 - t * t, 0.5 * (1.5 - a).clamp(min=0.0) ** 2)
    return raw / raw.sum(dim=-1, keepdim=True)


class LevEmbedding(nn.Module):
    """Token ids `(B, S)` -> `(B, S, D)`, computed once per unique id, in chunks."""

    def __init__(self, config: LevLlamaConfig):
        super().__init__()
        h, d, r, kappa = config.lev_heads, config.lev_d_seed, config.lev_rank, config.lev_kappa
        self.kappa, self.chunk = kappa, config.lev_chunk_size
        self.centred = getattr(config, "lev_centred", False)
        self.reference = getattr(config, "lev_centre_reference", 0)
        self.reference_vocab = getattr(config, "lev_reference_vocab", None) or config.vocab_size
        # the token order covers the ids the layer reads: the tokens and, with a reference mean, the
        # reference ids, which are spread over the padded vocabulary (and may lie past the last token)
        self.codebooks = _Codebooks(
            config.lev_k,
            config.lev_base,
            d,
            max(config.vocab_size, self.reference_vocab if self.reference else 0),
            getattr(config, "lev_id_order", "bpe"),
        )
        self.proj = nn.Parameter(torch.zeros(h, d, d))
        self.norm_weight = nn.Parameter(torch.ones(h, d))
        self.norm_bias = nn.Parameter(torch.zeros(h, d))
        self.delta = nn.Parameter(torch.zeros(h, d, kappa, r))
        self.out_proj = nn.Parameter(torch.zeros(h, r, config.hidden_size))
        self.residual = nn.Linear(d, config.hidden_size, bias=False) if config.lev_residual else None

    def _modes(self, z: torch.Tensor) -> torch.Tensor:  # (N, d) seeds -> (N, h*r) modes
        y = torch.einsum("nd,hed->nhe", z, self.proj.float())  # (N, h, d)
        y = F.layer_norm(y, (y.shape[-1],), eps=LN_EPS) * self.norm_weight.float() + self.norm_bias.float()
        basis = _basis(torch.sigmoid(y).clamp(0.0, 1.0), self.kappa)  # (N, h, d, kappa)
        phi = torch.einsum("nhdk,hdkr->nhdr", basis, 1.0 + self.delta.float())  # (N, h, d, r)
        negative = (phi < 0).sum(dim=2) % 2  # (N, h, r): parity of negative factors
        modes = (1.0 - 2.0 * negative) * torch.exp(torch.log(phi.abs() + LOG_EPS).sum(dim=2))  # (N, h, r)
        return modes.flatten(1)

    def reference_modes(self) -> torch.Tensor | None:  # the mean modes of the reference ids
        if not self.reference:
            return None
        v, count = self.reference_vocab, self.reference
        j = torch.arange(min(count, v), device=self.delta.device)
        ids = j if count >= v else ((2 * j + 1) * v) // (2 * count)
        z = self.codebooks(ids).float()
        return torch.cat([self._modes(c) for c in z.split(self.chunk)], dim=0).mean(dim=0)

    def embed_ids(
        self, ids: torch.Tensor, offset: torch.Tensor | None = None
    ) -> torch.Tensor:  # (N,) -> (N, D)
        z = self.codebooks(ids).float()  # (N, d)
        modes = self._modes(z)
        if self.centred:  # (M_l - 1) @ W_out_l
            modes = modes - 1.0
        elif offset is not None:  # (M_l - mean_R M_l) @ W_out_l
            modes = modes - offset
        out = modes @ self.out_proj.float().flatten(0, 1)  # (N, D)
        if self.residual is not None:
            out = out + self.residual(z.to(self.residual.weight.dtype)).float()
        return out

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (B, S) -> (B, S, D)
        unique, inverse = torch.unique(input_ids.reshape(-1), return_inverse=True)
        offset = self.reference_modes()
        table = torch.cat([self.embed_ids(c, offset) for c in unique.split(self.chunk)], dim=0)
        return table[inverse].view(*input_ids.shape, -1).to(self.out_proj.dtype)


class LevLlamaForCausalLM(LlamaForCausalLM):
    config_class = LevLlamaConfig

    def __init__(self, config: LevLlamaConfig):
        super().__init__(config)
        self.model.embed_tokens = LevEmbedding(config)
        self.post_init()
