"""Training checkpoint (any TP x PP x ZeRO layout) -> a plain Hugging Face `LlamaForCausalLM` directory.

    result = export_to_hf("runs/x/checkpoints", "runs/x/hf")     # validated by default

The input embedding becomes a dense table: variants whose class has a `dense_table`
(`tied`/`untied`) copy theirs; LEV and the compressed baselines are rebuilt at TP = 1 from
their merged parameters and `materialize()`d. A variant whose class `ties_output_head`
(`tied`) exports with `tie_word_embeddings=True`, every other variant untied. Vocabulary rows
added for TP padding are dropped (export vocab = tokenizer vocab).

The directory is written as `<out>.partial` and renamed to `<out>` only after the
exported model reproduces the source model's logits (see `validate`), and a probe model
of the same config with large random weights converted the same way reproduces its own
(so a wrong rope_theta, norm_eps or head layout shows even on a barely trained
checkpoint); a failed validation leaves `<out>.invalid` for inspection and raises
`ValidationError`, any other failure removes `<out>.partial`.

Before any work, the model config used is compared with the one stored in the checkpoint,
and the tokenizer with the training run's: the fingerprint the checkpoint records in its
`provenance.json` (`ckpt.provenance`), so a file replaced at the run's tokenizer path after
training is refused (`allow_tokenizer_change` exports with it anyway); for a checkpoint without
a record, the file the run's config names (sha256).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_lev.ckpt.provenance import PROVENANCE_FILE, read_provenance, recorded_tokenizer, warn_unrecorded
from megatron_lev.ckpt.record import find_run_config, stored_config_path, stored_tokenizer
from megatron_lev.convert.hf_writer import (
    DEFAULT_MAX_SHARD_BYTES,
    SafetensorsShardWriter,
    llama_config,
    write_config,
)
from megatron_lev.convert.llama_names import to_hf
from megatron_lev.convert.source import SourceCheckpoint, iter_canonical, open_tag
from megatron_lev.convert.validate import (
    ValidationError,
    ValidationReport,
    compare_stages,
    hf_stages,
    source_stages,
    validation_ids,
)
from megatron_lev.engine.checkpoint_files import CheckpointError, resolve_tag_dir
from megatron_lev.errors import UserError
from megatron_lev.log import get_logger
from megatron_lev.model.embeddings.id_order import BUFFER as ID_RANK
from megatron_lev.parallel.layout import SINGLE

log = get_logger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
REMOTE_CODE = "modeling_lev_llama.py"  # shipped beside this file, copied into --keep-lev exports
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}  # atol = rtol of validation
PROBE_TOLERANCE = (
    1e-4  # the probe runs in fp32 whatever the export dtype; atol relative to each stage's scale
)
LEV_TABLE = "the LEV table"  # what a --keep-lev export checks but does not write
PROBE_GAIN = 2.0  # probe matrices ~ N(0, (gain / sqrt(fan_in))^2): sharp attention, where rope_theta shows


class ExportError(UserError):
    """A flag or the output directory does not allow the export; nothing was written."""

    exit_code = 2


@dataclass
class ExportResult:
    out_dir: Path
    files: list[Path]
    vocab_size: int
    report: ValidationReport | None


def export_to_hf(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    tag: str | None = None,
    config: str | os.PathLike | None = None,
    tokenizer: str | os.PathLike | None = None,
    dtype: str = "fp32",
    validate: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = True,
    keep_lev: bool = False,
    allow_tokenizer_change: bool = False,
) -> ExportResult:
    """Convert, write, validate, then move the result into place (see the module docstring).

    `keep_lev`: keep the LEV layer (its parameters plus `modeling_lev_llama.py`, loaded with
    `trust_remote_code=True`) instead of materialising the dense table.
    `allow_tokenizer_change`: export with a tokenizer other than the one the checkpoint records.
    """
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(out_dir)
    tag_dir = resolve_tag_dir(checkpoint, tag)
    check_out_dir(out, overwrite, protect=[Path(checkpoint), tag_dir])
    run_cfg = find_run_config(tag_dir, config)
    tok = run_tokenizer(tag_dir, run_cfg, tokenizer, allow_tokenizer_change)
    # the rows the run trained: model.vocab_size when set (>= the tokenizer's, as training requires)
    src = open_tag(tag_dir, run_cfg, vocab_size=run_cfg.model.vocab_size or tok.vocab_size)
    if keep_lev and src.cfg.model.embedding != "lev":
        raise ExportError(
            f"--keep-lev needs a LEV model; this checkpoint has model.embedding={src.cfg.model.embedding!r}"
        )
    tied = src.embedding.ties_output_head
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)  # a dead earlier run's
    work.mkdir(parents=True)
    try:
        hf_config = llama_config(
            src.cfg.model, src.vocab_size, tied, DTYPES[dtype], bos_token_id=tok.eod, eos_token_id=tok.eod
        )
        files = write_weights(src, work, DTYPES[dtype], max_shard_bytes, progress, keep_lev)
        write_config(work, hf_config, extra=lev_config(src) if keep_lev else None)
        if keep_lev:
            shutil.copyfile(Path(__file__).with_name(REMOTE_CODE), work / REMOTE_CODE)
        tok.save_for_hf(work)
        report = None
        if validate:
            report = validate_export(src, work, DTYPES[dtype], progress, remote_code=keep_lev)
            log.info(report.summary())
    except ValidationError:
        bad = out.with_name(out.name + ".invalid")
        shutil.rmtree(bad, ignore_errors=True)
        os.replace(work, bad)
        log.error("the export failed validation; the files are kept in %s", bad)
        raise
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)  # never leave a half-written model behind
        raise
    _move_into_place(work, out)
    return ExportResult(out, [out / f.name for f in files], src.vocab_size, report)


def check_out_dir(out: Path, overwrite: bool, protect: list[Path] = ()) -> None:
    """Refuse an output path that is a file, a non-empty directory (without `overwrite`), or holds the
    input."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise ExportError(f"output {out} exists and is not a directory; choose a new directory")
    resolved = out.resolve()
    for p in protect:
        p = Path(p).resolve()
        if resolved == p or resolved in p.parents:
            raise ExportError(
                f"output {out} holds the checkpoint being converted ({p}); choose another directory"
            )
    if any(out.iterdir()) and not overwrite:
        raise ExportError(
            f"output {out} exists and is not empty; pass --overwrite to replace it or choose a new directory"
        )


def _move_into_place(work: Path, out: Path) -> None:
    """Rename `work` to `out`; an existing `out` is moved aside first and removed only after."""
    if out.exists():
        old = out.with_name(f".{out.name}.old.{os.getpid()}")
        os.replace(out, old)
        os.replace(work, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(work, out)


def run_tokenizer(tag_dir: Path, cfg, tokenizer: str | os.PathLike | None = None, allow_change: bool = False):
    """The training run's tokenizer, or `tokenizer` after checking it is the same file (sha256).

    The reference is the fingerprint the checkpoint records (`provenance.json`): exporting with
    another tokenizer gives a model that reads wrong ids, so a differing file is refused unless
    `allow_change`. Without a record (an older checkpoint): the tokenizer named by the checkpoint's
    own config.yaml (and a fingerprint recorded there, if any).
    A model.vocab_size larger than the tokenizer's vocabulary is accepted, as training accepts it
    (the extra rows are exported and never produced by the tokenizer); a smaller one is refused.
    """
    from megatron_lev.config import load_config
    from megatron_lev.data.tokenizers import build_tokenizer, fingerprint_mismatch, tokenizer_fingerprint

    stored_path = stored_config_path(tag_dir)
    stored = load_config([stored_path]) if stored_path is not None else cfg
    kind, recorded_path = stored.data.tokenizer_type, stored.data.tokenizer_path
    path = tokenizer or recorded_path
    if not path or not Path(path).is_file():
        raise CheckpointError(
            f"tokenizer not found (data.tokenizer_path={recorded_path!r} in the run's config"
            f"{'' if not tokenizer else f', --tokenizer {tokenizer}'}); pass --tokenizer PATH "
            "with the run's tokenizer file"
        )
    tok = build_tokenizer(kind, path)
    given = tokenizer_fingerprint(kind, path, tok)
    record = read_provenance(tag_dir)
    trained = recorded_tokenizer(record)
    if trained is not None:
        diff = fingerprint_mismatch(trained, given)
        if diff and not allow_change:
            raise CheckpointError(
                f"tokenizer {path} is not the one the run was trained with ({diff}; recorded in "
                f"{tag_dir / PROVENANCE_FILE}): the file was replaced or edited since training; pass "
                "the run's tokenizer with --tokenizer, or --allow-tokenizer-change to export with this one"
            )
        if diff:
            log.warning("exporting with tokenizer %s although %s (--allow-tokenizer-change)", path, diff)
        return _vocab_checked(tok, path, stored)
    if record is None:
        warn_unrecorded(tag_dir, "the tokenizer is compared with the file the run's config names, if any")
    expected = stored_tokenizer(stored_path)
    where = f"data.tokenizer_path of {stored_path or 'the config'}"
    if expected is None and tokenizer and recorded_path and Path(recorded_path).is_file():
        expected = tokenizer_fingerprint(kind, recorded_path)
    if expected is not None:
        diff = fingerprint_mismatch(expected, given)
        if diff and not allow_change:
            raise CheckpointError(
                f"tokenizer {path} is not the one the run was trained with ({where}: "
                f"{recorded_path}): {diff}; pass the run's tokenizer with --tokenizer, or "
                "--allow-tokenizer-change to export with this one"
            )
        if diff:
            log.warning("exporting with tokenizer %s although %s (--allow-tokenizer-change)", path, diff)
    elif tokenizer and recorded_path != str(tokenizer):
        log.warning(
            "cannot check --tokenizer %s against the run's (%s=%r is not on this machine)",
            tokenizer,
            where,
            recorded_path,
        )
    return _vocab_checked(tok, path, stored)


def _vocab_checked(tok, path, stored):
    """`tok`, unless the run's model.vocab_size is smaller than its vocabulary."""
    if stored.model.vocab_size and stored.model.vocab_size < tok.vocab_size:
        raise CheckpointError(
            f"tokenizer {path} has {tok.vocab_size} tokens but the run's model.vocab_size is "
            f"only {stored.model.vocab_size} (smaller: ids up to {tok.vocab_size - 1} have no "
            "row); pass the run's tokenizer with --tokenizer"
        )
    return tok


def write_weights(
    src: SourceCheckpoint,
    out: Path,
    dtype: torch.dtype,
    max_shard_bytes: int,
    progress: bool = True,
    keep_lev: bool = False,
) -> list[Path]:
    """Stream the merged checkpoint into safetensors shards under Llama names.

    Every tensor is checked for inf/NaN twice: as the checkpoint holds it (the message names its
    parameter) and as it is exported (after the conversion to `dtype`, and for an input embedding
    without a dense table the table materialised over the whole vocabulary). A `--keep-lev` export
    writes the LEV parameters, and its table is materialised once to check it too."""
    writer = SafetensorsShardWriter(out, max_shard_bytes)
    lev_params: dict[str, torch.Tensor] | None = {} if keep_lev else None
    canonical = _checked_source(src, iter_canonical(src, progress), lev_params)
    for hf_name, tensor in hf_tensors(src, canonical, dtype, keep_lev):
        _check_exported(src, hf_name, tensor, dtype)
        writer.add(hf_name, tensor)
    if lev_params:
        _check_exported(src, LEV_TABLE, materialized_table(src, lev_params), torch.float32)
    return writer.close()


def _non_finite(tensor: torch.Tensor) -> tuple[int, int]:
    """(non-finite values, rows holding one) of `tensor` (rows: along its first dimension)."""
    bad = ~torch.isfinite(tensor)
    if not bool(bad.any()):
        return 0, 0
    rows = int(bad.reshape(bad.shape[0], -1).any(dim=1).sum()) if tensor.ndim > 1 else int(bad.sum())
    return int(bad.sum()), rows


def _checked_source(src: SourceCheckpoint, canonical, keep: dict[str, torch.Tensor] | None = None):
    """`canonical` as it is, after checking each tensor is finite; the input embedding's parameters
    are also collected into `keep` (when given)."""
    for name, tensor in canonical:
        values, _ = _non_finite(tensor)
        if values:
            raise CheckpointError(
                f"checkpoint {src.tag_dir}: parameter {name} holds {values} non-finite value(s) (inf/NaN) "
                f"of {tensor.numel()}; the weights are damaged, nothing was exported: convert an earlier "
                "checkpoint (--tag)"
            )
        if keep is not None and name.startswith("embedding."):
            keep[name.removeprefix("embedding.")] = tensor
        yield name, tensor


def _check_exported(src: SourceCheckpoint, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse an exported tensor that holds inf/NaN although the checkpoint's parameters are finite."""
    values, rows = _non_finite(tensor)
    if not values:
        return
    if name in ("model.embed_tokens.weight", LEV_TABLE) and not src.embedding.dense_table:
        what = (
            f"{name} (the {src.cfg.model.embedding} input embedding materialised over the whole "
            f"vocabulary from finite parameters) has {rows} non-finite row(s)"
        )
    else:
        what = f"exported tensor {name} holds {values} non-finite value(s)"
    hint = "convert an earlier checkpoint (--tag)"
    if dtype != torch.float32:
        kind = str(dtype).removeprefix("torch.")
        hint = f"values beyond the range of {kind}? export with --dtype fp32, or {hint}"
    raise CheckpointError(f"checkpoint {src.tag_dir}: {what} (inf/NaN); nothing was exported: {hint}")


def hf_tensors(src: SourceCheckpoint, canonical, dtype: torch.dtype, keep_lev: bool = False):
    """`(canonical name, tensor)` of the project's model -> `(Llama name, tensor)` of the export."""
    dense = src.embedding.dense_table
    embedding: dict[str, torch.Tensor] = {}
    for name, tensor in canonical:
        if keep_lev and name.startswith("embedding."):  # LEV kept as a layer: same names under embed_tokens
            if name.rsplit(".", 1)[-1] == ID_RANK:  # the token order of the exported ids, exact (int64);
                # with a reference mean also of the padded ids it reads (modeling_lev_llama._Codebooks)
                rows = src.padded_vocab if src.cfg.model.lev.centre_reference else src.vocab_size
                yield "model.embed_tokens." + name.removeprefix("embedding."), tensor[:rows]
                continue
            yield "model.embed_tokens." + name.removeprefix("embedding."), tensor.to(dtype)
            continue
        if name.startswith("embedding.") and not dense:
            embedding[name.removeprefix("embedding.")] = tensor
            continue
        if embedding:
            yield "model.embed_tokens.weight", materialized_table(src, embedding).to(dtype)
            embedding = {}
        for hf_name, t in to_hf(name, tensor, src.cfg.model, src.vocab_size):
            yield hf_name, t.to(dtype)
    if embedding:
        yield "model.embed_tokens.weight", materialized_table(src, embedding).to(dtype)


def materialized_table(src: SourceCheckpoint, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rebuild the input embedding at TP = 1 from its merged parameters; its dense `(V, D)` table."""
    from megatron_lev.model.embeddings import build_input_embedding

    module = build_input_embedding(src.cfg.model, src.padded_vocab, base_vocab=src.base_vocab).float()
    module.load_state_dict({k: _fp32(v) for k, v in params.items()}, strict=True)
    module.eval()
    return module.materialize()[: src.vocab_size]


def source_model(src: SourceCheckpoint, progress: bool = True) -> torch.nn.Module:
    """The project's `GPTModel` at TP = 1 / PP = 1 (fp32) holding the merged checkpoint weights."""
    from megatron_lev.engine.build import build_model

    with torch.device("meta"):  # the loss leaves the padding rows out, as in training and the export
        model = build_model(src.model_spec, SINGLE)
    state = {name: _fp32(t) for name, t in iter_canonical(src, progress)}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """Weights in fp32; integer buffers (LEV's token order `id_rank`) exactly as stored."""
    return t.float() if t.is_floating_point() else t


def stored_buffers(src: SourceCheckpoint, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers of `model` (the source model) by canonical name, e.g. LEV's token order."""
    state = model.state_dict()
    return {name: state[name] for name, spec in src.specs.items() if spec.buffer}


def lev_config(src: SourceCheckpoint) -> dict:
    """config.json keys of a `--keep-lev` export: the LEV hyperparameters and the remote-code classes."""
    from megatron_lev.model.embeddings.lev import digit_base

    lev = src.cfg.model.lev
    module = REMOTE_CODE.removesuffix(".py")
    return {
        "model_type": "lev_llama",
        "architectures": ["LevLlamaForCausalLM"],
        "auto_map": {
            "AutoConfig": f"{module}.LevLlamaConfig",
            "AutoModelForCausalLM": f"{module}.LevLlamaForCausalLM",
        },
        "lev_k": lev.k,
        "lev_base": digit_base(src.base_vocab, lev.k),
        "lev_d_seed": lev.d_seed,
        "lev_heads": lev.heads,
        "lev_kappa": lev.kappa,
        "lev_rank": lev.rank,
        "lev_residual": lev.residual,
        "lev_centred": lev.centred,
        "lev_centre_reference": lev.centre_reference,
        "lev_reference_vocab": src.base_vocab,  # reference ids: over the vocabulary padded for one process
        "lev_id_order": lev.id_order,  # not bpe: the weights hold it (`embed_tokens.codebooks.id_rank`)
        "lev_chunk_size": 256,
    }


def validate_export(
    src: SourceCheckpoint,
    hf_dir: Path,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    remote_code: bool = False,
) -> ValidationReport:
    """Run the source and the exported model on the same ids, then the probe (`probe_export`);
    raise ValidationError naming the first bad stage."""
    from transformers import AutoModelForCausalLM

    from megatron_lev.utils.progress import hf_bars_off_a_terminal

    hf_bars_off_a_terminal()
    ids = validation_ids(src.vocab_size, src.cfg.model.seq_length)
    model = source_model(src, progress)
    reference = source_stages(model, ids, src.vocab_size)
    buffers = stored_buffers(src, model)  # the probe keeps the checkpoint's token order
    del model  # one model in memory at a time
    try:
        hf = AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32, trust_remote_code=remote_code
        ).eval()
    except (RuntimeError, ValueError, OSError, KeyError) as exc:
        raise ValidationError(
            f"transformers cannot load the export with its config.json: "
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        ) from None
    exported = hf_stages(hf, ids)
    del hf
    tol = TOLERANCE[dtype]
    # relative to each stage's scale: rounding grows with the size of the values summed, and a trained
    # model's residual stream reaches tens (a run at lr 4e-3 differed by 6e-4 at a layer output of
    # that size, float32 rounding, not a conversion error)
    report = compare_stages(reference, exported, atol=tol, rtol=tol, relative=True)
    report.probe_max_abs_diff = probe_export(src, hf_dir, remote_code, buffers).max_abs_diff
    return report


def probe_model(
    src: SourceCheckpoint, ids: torch.Tensor, seed: int = 0, buffers: dict[str, torch.Tensor] | None = None
) -> torch.nn.Module:
    """The source's `GPTModel` with large random weights: matrices of gain `PROBE_GAIN` (sharp attention,
    so rope_theta and the head layout matter), norm gains 1 +- 0.5, and the input embedding scaled to
    RMS sqrt(norm_eps) (so the norms' eps matters). A trained checkpoint may show none of these yet.
    `buffers` (`stored_buffers`): the checkpoint's persistent buffers, e.g. LEV's token order, which a
    model built from the config alone may not have (a `frequency` order's counts file)."""
    from megatron_lev.engine.build import build_model

    torch.manual_seed(seed)
    model = build_model(src.model_spec, SINGLE).float().eval()
    if buffers:
        model.load_state_dict(buffers, strict=False)
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1:
                p.copy_(1.0 + 0.5 * noise)
            elif name == "embedding.table.weight" and src.embedding.dense_table:
                p.copy_(noise)
            elif not name.startswith("embedding."):
                p.copy_(noise * PROBE_GAIN / p.shape[-1] ** 0.5)
        names = [f"embedding.{n}" for n in src.embedding.output_parameters]  # the output is linear in these
        rms = model.embedding(ids).float().pow(2).mean().sqrt().item()
        if any(n in params for n in names) and 0 < rms < float("inf"):
            for n in names:
                if n in params:
                    params[n].mul_(src.cfg.model.norm_eps**0.5 / rms)
    return model


def probe_export(
    src: SourceCheckpoint,
    hf_dir: Path,
    remote_code: bool = False,
    buffers: dict[str, torch.Tensor] | None = None,
) -> ValidationReport:
    """Convert a probe model (`probe_model`, with the checkpoint's `buffers`) with the export's own
    mapping, load it into a model built from the export's config.json, and compare every stage with
    the probe (fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = validation_ids(src.vocab_size, src.cfg.model.seq_length, seed=1)
    model = probe_model(src, ids, buffers=buffers)
    reference = source_stages(model, ids, src.vocab_size)
    state = dict(hf_tensors(src, model.state_dict().items(), torch.float32, keep_lev=remote_code))
    del model
    try:
        config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=remote_code)
        hf = AutoModelForCausalLM.from_config(config, trust_remote_code=remote_code).float().eval()
    except (RuntimeError, ValueError, OSError, KeyError) as exc:
        raise ValidationError(
            f"probe: transformers cannot build the model {hf_dir / 'config.json'} describes: "
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        ) from None
    try:
        missing, unexpected = hf.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        raise ValidationError(
            f"probe: the weights do not fit the model {hf_dir / 'config.json'} describes: "
            f"{str(exc).splitlines()[-1].strip()}"
        ) from None
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValidationError(
            f"probe: {hf_dir / 'config.json'} describes a model with other weights than "
            f"the export: missing {missing[:3]}, unexpected {unexpected[:3]} "
            "(tie_word_embeddings or the layer names are wrong)"
        )
    exported = hf_stages(hf, ids)
    try:
        return compare_stages(reference, exported, atol=PROBE_TOLERANCE, rtol=PROBE_TOLERANCE, relative=True)
    except ValidationError as exc:
        raise ValidationError(
            f"probe with large random weights: {exc}; a setting of {hf_dir / 'config.json'} "
            "(rope_theta, rms_norm_eps, heads, tie_word_embeddings) or the weight mapping "
            "does not match the training model"
        ) from None


__all__ = [
    "export_to_hf",
    "ExportResult",
    "ExportError",
    "validate_export",
    "probe_export",
    "source_model",
    "materialized_table",
]
