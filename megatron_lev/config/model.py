"""The `model` section and its `model.lev` subsection: sizes, the input embedding, the init.

Which variant `model.embedding` names, and what that variant needs of the rest of the config, is
the variant's business (`megatron_lev.model.embeddings`, asked by `plan`); this section
holds the keys and their generic rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_lev.config.ranges import FRACTION, K, M, Range, check_fields, count, nonempty, ranged
from megatron_lev.errors import ConfigError, check_choice

# model.lev.id_order: which token gets which compositional digits (docs/model.md, "Token-id order")
LEV_ID_ORDERS = ("bpe", "random", "frequency")


@dataclass
class LevConfig:
    """Hyperparameters of the LEV layer (spec: LEV.md, 'The LEV layer, exactly')."""

    k: int = ranged(3, count(cap=64))  # digits of the compositional index
    d_seed: int = ranged(128, count(cap=64 * K))  # seed width
    heads: int = ranged(8, count(cap=4 * K))  # h
    # spline knots
    kappa: int = ranged(16, count("a quadratic B-spline needs at least 3 knots", lo=3, cap=64 * K))
    rank: int = ranged(64, count(cap=64 * K))  # r of the separable product
    residual: bool = False  # optional `+ W_res z` path of the paper's earlier version
    chunk_size: int = ranged(4096, count(cap=64 * M))  # unique ids processed per chunk
    recompute: bool = True  # recompute chunks in backward instead of storing activations
    # multiplies the spec's N(0, 0.02/sqrt(h)) init of W_out
    w_out_init_scale: float = ranged(1.0, Range(0, cap=1000, why="multiplies the init std of W_out"))
    # multiplies the spec's N(0, 0.02) init of the codebooks and W_l. The LayerNorm after W_l z makes the
    # output depend on their scale only through its eps (1e-5), about the variance of W_l z at the spec's
    # init: a larger scale spreads u over more knots at init, shrinks their gradients (1/scale) and how
    # far one Adam step turns them (lr/scale). Without lev.residual, which reads z directly.
    seed_init_scale: float = ranged(
        1.0, Range(0, lo_open=True, cap=1000, why="multiplies the init std of the codebooks and W_l, e.g. 10")
    )
    # multiplies the learning rate of the codebooks and W_l (the same scale-free seed side): a tenth
    # turns them by lr/0.02 x 0.1 per Adam step. Two optimizer rules the LEV variant puts before
    # train.param_groups (model/embeddings/lev_rules.py), so it applies with any model.embedding in one
    # config file.
    seed_lr_mult: float = ranged(
        1.0,
        Range(
            0, lo_open=True, cap=1000, why="multiplies the learning rate of the codebooks and W_l, e.g. 0.1"
        ),
    )
    # None (the spec): the codebooks and W_l are in the global gradient norm, where they carry most of
    # it (their gradients scale as one over their size) and so decide how much train.clip_grad shrinks
    # every step. A number: they are clipped on their own norm at this threshold and left out of the
    # global norm (0: their own group, never clipped). A clip group the LEV variant puts before
    # train.clip_groups (model/embeddings/lev_rules.py), named `lev_seed`.
    seed_clip_grad: float | None = ranged(
        None,
        Range(0, cap=1e6, why="the seed side's own clipping threshold (0: its own group, never clipped)"),
    )
    centred: bool = False  # G = sum_l (M_l - 1) W_out_l: drops the all-ones mode's shared vector
    # > 0: G = sum_l (M_l - mean_R M_l) W_out_l, R this many evenly spaced token ids (reference_ids),
    # recomputed from the current weights at every forward, so the readout stays centred in training
    centre_reference: int = ranged(
        0, Range(0, 64 * M, why="token ids whose mean modes are subtracted (0: off; e.g. 256)")
    )
    # token-id order (one of LEV_ID_ORDERS): the digits of token i are those of rank[i], a permutation
    # stored with the model; "bpe": rank[i] = i (the spec), "random": seeded by id_order_seed,
    # "frequency": by count in id_order_counts (a counts.npy; the run plan fills it from data.data_path)
    id_order: str = "bpe"
    id_order_seed: int = ranged(0, Range(0, 2**32 - 1, why="the seed of model.lev.id_order=random"))
    id_order_counts: str | None = None

    def validate(self) -> None:
        check_fields(self, "model.lev")
        check_choice("model.lev.id_order", self.id_order, LEV_ID_ORDERS)
        if self.id_order_counts is not None:
            if self.id_order != "frequency":
                raise ConfigError(
                    f"model.lev.id_order_counts={self.id_order_counts!r} is set but model.lev.id_order="
                    f"{self.id_order!r}: the counts rank token ids only for id_order=frequency; set "
                    "model.lev.id_order=frequency or unset model.lev.id_order_counts"
                )
            if not str(self.id_order_counts).strip():
                raise ConfigError(
                    "model.lev.id_order_counts is an empty string: give a counts.npy, or null to take "
                    "<first data.data_path prefix>.counts.npy"
                )
        if self.centred and self.centre_reference:
            raise ConfigError(
                f"model.lev.centred=true and model.lev.centre_reference={self.centre_reference} both "
                "centre LEV's modes: keep one (centre_reference subtracts their mean, centred subtracts 1)"
            )


def _width(why: str = "", cap: int = 256 * K) -> Range:
    return count(why, cap=cap)


@dataclass
class ModelConfig:
    name: str = nonempty("tiny")
    num_layers: int = ranged(2, count(cap=4 * K))
    hidden_size: int = ranged(128, count("the model width; 2048 for the 1.2B config", cap=64 * K))
    num_attention_heads: int = ranged(4, count(cap=4 * K))
    # None: multi-head attention; fewer: grouped-query
    num_kv_heads: int | None = ranged(None, count("or null for multi-head attention", cap=4 * K))
    # None: SwiGLU default, 8/3 * hidden rounded to 64
    ffn_hidden_size: int | None = ranged(None, _width("or null for the SwiGLU default"))
    seq_length: int = ranged(128, count("tokens per sample; the memory estimate judges what fits", cap=4 * M))
    # None: taken from the tokenizer
    vocab_size: int | None = ranged(None, count("or null to take it from the tokenizer", cap=16 * M))
    make_vocab_size_divisible_by: int = ranged(128, count(cap=64 * K))  # padded to a multiple of this x TP
    embedding: str = "lev"  # a variant of megatron_lev.model.embeddings.REGISTRY (checked there)
    lev: LevConfig = field(default_factory=LevConfig)
    # albert/flat_mlp bottleneck e; None: sized to match LEV
    baseline_dim: int | None = ranged(None, _width("or null to size it like LEV"))
    # MLP hidden width of the MLP baselines; None: sized to match LEV
    baseline_hidden: int | None = ranged(None, _width("or null to size it like LEV"))
    # a compressed baseline narrower than this (code width e or MLP hidden) is refused: a degenerate
    # bottleneck (e = 1) is not a fair comparison; the paper grid allows its parameter-matched widths
    min_compressed_width: int = ranged(16, _width("the narrowest width a compressed baseline may have"))
    rope_theta: float = ranged(10000.0, Range(0, lo_open=True, cap=1e12, why="the RoPE base, e.g. 10000"))
    norm_eps: float = ranged(
        1e-5, Range(0, lo_open=True, cap=1, why="added to the RMS before dividing, e.g. 1e-5")
    )
    init_std: float = ranged(
        0.02, Range(0, lo_open=True, cap=1, why="standard deviation of the initial weights, e.g. 0.02")
    )
    # the input embedding's output RMS over the vocabulary at init (its final linear map rescaled;
    # `InputEmbedding.rescale_output_`); None: each variant's own initialisation
    input_init_rms: float | None = ranged(
        None,
        Range(
            0,
            lo_open=True,
            cap=1000,
            why="the input embedding's initial output RMS, or null for each variant's own init",
        ),
    )
    hidden_dropout: float = ranged(0.0, FRACTION)
    attention_dropout: float = ranged(0.0, FRACTION)
    activation_checkpointing: bool = False
    checkpoint_num_layers: int = ranged(1, count(cap=4 * K))
    # selective recompute: only the attention core (scores, softmax, dropout) is recomputed in backward,
    # not whole blocks (Megatron's --recompute-granularity selective); engine/recompute.py
    recompute_attention: bool = False
    # torch.compile each decoder block in place (engine/compile.py); the first steps pay the compilation
    compile: bool = False
    # the head's matmul and the cross-entropy in one function chunked over tokens, so no (B, S, V/tp)
    # logits are held (parallel/fused_cross_entropy.py); false: the logits path, for comparison
    fused_loss: bool = True
    # tokens per chunk of the fused loss; 0: as many as fit 256 MiB of fp32 logits
    loss_chunk_tokens: int = ranged(
        0, Range(0, 16 * M, why="tokens per chunk of the fused loss (0: chosen from memory)")
    )

    def validate(self) -> None:
        check_fields(self, "model")
        self.lev.validate()
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} must be divisible by "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ConfigError(
                "model.hidden_size / model.num_attention_heads = "
                f"{self.hidden_size // self.num_attention_heads} "
                "is odd: rotary position embeddings need an even head width; change either key"
            )
        if self.recompute_attention and self.activation_checkpointing:
            raise ConfigError(
                "model.recompute_attention=true with model.activation_checkpointing=true: whole blocks are "
                "already recomputed; keep one (selective recompute keeps more memory and recomputes less)"
            )
        if self.compile and self.recompute_attention:
            raise ConfigError(
                "model.compile=true with model.recompute_attention=true: a compiled block's recomputation "
                "is not supported; turn one of them off"
            )
        if self.compile and self.activation_checkpointing:
            raise ConfigError(
                "model.compile=true with model.activation_checkpointing=true: a compiled block recomputed "
                "by the checkpointing does not save what its forward saved (torch refuses the backward); "
                "turn one of them off (the paper configs train without checkpointing)"
            )
        kv = self.kv_heads
        if self.num_attention_heads % kv:
            raise ConfigError(
                f"model.num_kv_heads={self.num_kv_heads} must divide "
                f"model.num_attention_heads={self.num_attention_heads}"
            )

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return int(math.ceil(8 * self.hidden_size / 3 / 64) * 64)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads
