"""Training checkpoint (any TP x PP x ZeRO layout) -> a plain Hugging Face `LlamaForCausalLM` directory.

    result = export_to_hf("runs/x/checkpoints", "runs/x/hf")     # validated by default

The input embedding becomes a dense table: `tied`/`untied` copy theirs; LEV and the
compressed baselines are rebuilt at TP = 1 from their merged parameters and
`materialize()`d. `tied` exports with `tie_word_embeddings=True`, every other variant
untied. Vocabulary rows added for TP padding are dropped (export vocab = tokenizer vocab).

The directory is written as `<out>.partial` and renamed to `<out>` only after the
exported model reproduces the source model's logits (see `validate`); a failed
validation leaves `<out>.invalid` for inspection and raises `ValidationError`.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_lev.checkpoint.hf_writer import (
    DEFAULT_MAX_SHARD_BYTES,
    SafetensorsShardWriter,
    llama_config,
    write_config,
)
from megatron_lev.checkpoint.llama_names import to_hf
from megatron_lev.checkpoint.source import SourceCheckpoint, iter_canonical, open_checkpoint
from megatron_lev.checkpoint.validate import (
    ValidationError,
    ValidationReport,
    compare_stages,
    hf_stages,
    source_stages,
    validation_ids,
)
from megatron_lev.logging import get_logger

log = get_logger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
REMOTE_CODE = "modeling_lev_llama.py"  # shipped beside this file, copied into --keep-lev exports
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}  # atol = rtol of validation


@dataclass
class ExportResult:
    out_dir: Path
    files: list[Path]
    vocab_size: int
    report: ValidationReport | None


def export_to_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, tag: str | None = None,
                 config: str | os.PathLike | None = None, tokenizer: str | os.PathLike | None = None,
                 dtype: str = "fp32", validate: bool = True, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 overwrite: bool = False, progress: bool = True, keep_lev: bool = False) -> ExportResult:
    """Convert, write, validate, then move the result into place (see the module docstring).

    `keep_lev`: keep the LEV layer (its parameters plus `modeling_lev_llama.py`, loaded with
    `trust_remote_code=True`) instead of materialising the dense table.
    """
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    tok = _tokenizer(checkpoint, tag, config, tokenizer)
    src = open_checkpoint(checkpoint, tag, config, vocab_size=tok.vocab_size)
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tied = src.cfg.model.embedding == "tied"
    if keep_lev and src.cfg.model.embedding != "lev":
        raise ValueError(f"--keep-lev needs a LEV model; this checkpoint has model.embedding="
                         f"{src.cfg.model.embedding!r}")
    hf_config = llama_config(src.cfg.model, src.vocab_size, tied, DTYPES[dtype],
                             bos_token_id=tok.eod, eos_token_id=tok.eod)
    files = write_weights(src, work, DTYPES[dtype], max_shard_bytes, progress, keep_lev)
    write_config(work, hf_config, extra=lev_config(src) if keep_lev else None)
    if keep_lev:
        shutil.copyfile(Path(__file__).with_name(REMOTE_CODE), work / REMOTE_CODE)
    tok.save_for_hf(work)
    report = None
    if validate:
        try:
            report = validate_export(src, work, DTYPES[dtype], progress, remote_code=keep_lev)
        except ValidationError:
            bad = out.with_name(out.name + ".invalid")
            shutil.rmtree(bad, ignore_errors=True)
            os.replace(work, bad)
            log.error("the export failed validation; the files are kept in %s", bad)
            raise
        log.info(report.summary())
    if out.exists():
        shutil.rmtree(out)
    os.replace(work, out)
    return ExportResult(out, [out / f.name for f in files], src.vocab_size, report)


def _tokenizer(checkpoint, tag, config, tokenizer):
    from megatron_lev.checkpoint.ds_reader import CheckpointError, find_run_config, resolve_tag_dir
    from megatron_lev.data.tokenizers import build_tokenizer

    cfg = find_run_config(resolve_tag_dir(checkpoint, tag), config)
    path = tokenizer or cfg.data.tokenizer_path
    if not path or not Path(path).is_file():
        raise CheckpointError(f"tokenizer not found (data.tokenizer_path={cfg.data.tokenizer_path!r} in the run's "
                              "config); pass --tokenizer PATH")
    return build_tokenizer(cfg.data.tokenizer_type, path)


def write_weights(src: SourceCheckpoint, out: Path, dtype: torch.dtype, max_shard_bytes: int,
                  progress: bool = True, keep_lev: bool = False) -> list[Path]:
    """Stream the merged checkpoint into safetensors shards under Llama names."""
    writer = SafetensorsShardWriter(out, max_shard_bytes)
    dense = src.cfg.model.embedding in ("tied", "untied")
    embedding: dict[str, torch.Tensor] = {}
    for name, tensor in iter_canonical(src, progress):
        if keep_lev and name.startswith("embedding."):  # LEV kept as a layer: same names under embed_tokens
            writer.add("model.embed_tokens." + name.removeprefix("embedding."), tensor.to(dtype))
            continue
        if name.startswith("embedding.") and not dense:
            embedding[name.removeprefix("embedding.")] = tensor
            continue
        if embedding:
            writer.add("model.embed_tokens.weight", materialized_table(src, embedding).to(dtype))
            embedding = {}
        for hf_name, t in to_hf(name, tensor, src.cfg.model, src.vocab_size):
            writer.add(hf_name, t.to(dtype))
    if embedding:
        writer.add("model.embed_tokens.weight", materialized_table(src, embedding).to(dtype))
    return writer.close()


def materialized_table(src: SourceCheckpoint, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rebuild the input embedding at TP = 1 from its merged parameters; its dense `(V, D)` table."""
    from megatron_lev.model.embeddings import build_input_embedding

    module = build_input_embedding(src.cfg.model, src.padded_vocab).float()
    module.load_state_dict({k: v.float() for k, v in params.items()}, strict=True)
    module.eval()
    return module.materialize()[: src.vocab_size]


def source_model(src: SourceCheckpoint, progress: bool = True) -> torch.nn.Module:
    """The project's `GPTModel` at TP = 1 / PP = 1 (fp32) holding the merged checkpoint weights."""
    from megatron_lev.model.gpt import GPTModel

    with torch.device("meta"):
        model = GPTModel(src.cfg.model, src.padded_vocab)
    state = {name: t.float() for name, t in iter_canonical(src, progress)}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def lev_config(src: SourceCheckpoint) -> dict:
    """config.json keys of a `--keep-lev` export: the LEV hyperparameters and the remote-code classes."""
    from megatron_lev.model.embeddings.lev import digit_base

    lev = src.cfg.model.lev
    module = REMOTE_CODE.removesuffix(".py")
    return {"model_type": "lev_llama", "architectures": ["LevLlamaForCausalLM"],
            "auto_map": {"AutoConfig": f"{module}.LevLlamaConfig",
                         "AutoModelForCausalLM": f"{module}.LevLlamaForCausalLM"},
            "lev_k": lev.k, "lev_base": digit_base(src.padded_vocab, lev.k), "lev_d_seed": lev.d_seed,
            "lev_heads": lev.heads, "lev_kappa": lev.kappa, "lev_rank": lev.rank, "lev_residual": lev.residual,
            "lev_chunk_size": 256}


def validate_export(src: SourceCheckpoint, hf_dir: Path, dtype: torch.dtype = torch.float32,
                    progress: bool = True, remote_code: bool = False) -> ValidationReport:
    """Run the source and the exported model on the same ids; raise ValidationError naming the first bad stage."""
    from transformers import AutoModelForCausalLM

    ids = validation_ids(src.vocab_size, src.cfg.model.seq_length)
    model = source_model(src, progress)
    reference = source_stages(model, ids, src.vocab_size)
    del model  # one model in memory at a time
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, trust_remote_code=remote_code).eval()
    exported = hf_stages(hf, ids)
    del hf
    tol = TOLERANCE[dtype]
    return compare_stages(reference, exported, atol=tol, rtol=tol)


__all__ = ["export_to_hf", "ExportResult", "validate_export", "source_model", "materialized_table"]
