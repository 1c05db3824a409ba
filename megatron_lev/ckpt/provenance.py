"""What a checkpoint was trained on: `provenance.json` in its tag directory.

    {"format": "megatron-lev provenance", "version": 1,
     "tokenizer": {type, name, file, sha256, vocab_size, eod, probe_sha256, path},
     "data": {"train": [{"prefix", "weight", "manifest", "digest", "documents", "tokens"}, ...],
              "valid": [...] or null, "split": "969,30,1"}}

`tokenizer` is `data.tokenizers.tokenizer_fingerprint` of the run's tokenizer file. Each blend
entry names a shard prefix, its weight and the identity of its shard set: `digest`, the sha256
over the size and sha256 of every `.bin`/`.idx` file its manifest lists (`manifest_digest`), so
the same tokens give the same digest whatever the set's name, timings or worker count, and a set
preprocessed again from another corpus gives another. `ckpt.io.save_checkpoint` writes the file
(rank 0, atomically) before the `complete` marker, whose checksums cover it; it is plain JSON, so
converters and analyses read it without DeepSpeed.

Who compares it: a resume (`training.resume_checks.check_resume_provenance`), `convert` and `evaluate`
(the tokenizer), `reshard` (copies it). A checkpoint without one (saved by an older version) is
named in one warning and not compared.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from megatron_lev.ckpt.record import read_record
from megatron_lev.errors import CheckpointDataError
from megatron_lev.log import get_logger

PROVENANCE_FILE = "provenance.json"
FORMAT = "megatron-lev provenance"
VERSION = 1

log = get_logger(__name__)

_warned: set[str] = set()  # tag directories already named as having no record


# --------------------------------------------------------------------------- building


def manifest_digest(manifest: dict) -> str:
    """The identity of a shard set's tokens: sha256 over (size, sha256) of its shards' `.bin` and
    `.idx` files, in the manifest's shard order (names, timings and statistics left out)."""
    from megatron_lev.data.manifest import SHARD_FILES

    files = manifest.get("files") or {}
    parts = []
    for shard in manifest.get("shards") or []:
        for ext in SHARD_FILES:
            entry = files.get(f"{shard}{ext}") or {}
            parts.append([entry.get("size"), entry.get("sha256")])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def blend_record(paths: list[str] | None) -> list[dict[str, Any]] | None:
    """One entry per prefix of a `data.data_path`-style blend; a prefix whose manifest is missing or
    unreadable has `digest` None (the dataset builder refuses it with its own message)."""
    from megatron_lev.data.gpt_dataset import parse_blend
    from megatron_lev.data.manifest import ShardSetError, find_manifest

    if not paths:
        return None
    out = []
    for weight, prefix in parse_blend(list(paths)):
        entry: dict[str, Any] = {
            "prefix": str(prefix),
            "weight": float(weight),
            "manifest": None,
            "digest": None,
        }
        try:
            path, manifest, _ = find_manifest(prefix)
        except ShardSetError:
            path, manifest = None, None
        if manifest is not None:
            entry.update(
                manifest=str(path),
                digest=manifest_digest(manifest),
                documents=manifest.get("documents"),
                tokens=manifest.get("tokens"),
            )
        out.append(entry)
    return out


def tokenizer_record(tokenizer_type: str, path: str | os.PathLike | None, tokenizer=None) -> dict | None:
    """The tokenizer's fingerprint and path; None when the file cannot be read (the run refuses it
    with its own message)."""
    from megatron_lev.data.tokenizers import TokenizerError, tokenizer_fingerprint

    if not path or not Path(path).is_file():
        return None
    try:
        fingerprint = tokenizer_fingerprint(tokenizer_type, path, tokenizer)
    except (TokenizerError, OSError):
        return None
    return {**fingerprint, "path": str(path)}


def run_provenance(data_cfg, tokenizer=None) -> dict[str, Any]:
    """The record of a run's `data` config section (`tokenizer`: the built tokenizer, if at hand)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": tokenizer_record(data_cfg.tokenizer_type, data_cfg.tokenizer_path, tokenizer),
        "data": {
            "train": blend_record(data_cfg.data_path),
            "valid": blend_record(data_cfg.valid_data_path),
            "split": data_cfg.split,
        },
    }


# --------------------------------------------------------------------------- reading


def read_provenance(tag_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The record of checkpoint tag directory `tag_dir`; None when it has none (an older version
    saved it); a damaged one is refused."""
    path = Path(tag_dir) / PROVENANCE_FILE
    if not path.is_file():
        return None
    data = read_record(
        path,
        "restore it from a backup, or delete it to use the checkpoint without comparing its data and "
        "tokenizer",
    )
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointDataError(
            f"{path} is not a megatron-lev provenance record; restore it, or delete it to use the "
            "checkpoint without comparing its data and tokenizer"
        )
    if data.get("version") != VERSION:
        raise CheckpointDataError(
            f"{path}: provenance version {data.get('version')!r}, this code reads {VERSION}; "
            "use the version that saved the checkpoint"
        )
    return data


def warn_unrecorded(tag_dir: str | os.PathLike, what: str) -> None:
    """Once per checkpoint: it records no provenance, so `what` is not compared."""
    key = str(Path(tag_dir).resolve())
    if key in _warned:
        return
    _warned.add(key)
    log.warning(
        "%s records no %s (saved by an older version): %s",
        Path(tag_dir),
        PROVENANCE_FILE,
        what,
    )


def recorded_tokenizer(record: dict | None) -> dict | None:
    """The tokenizer fingerprint of a record, when it holds one."""
    tok = (record or {}).get("tokenizer")
    return tok if isinstance(tok, dict) and tok.get("sha256") else None


# --------------------------------------------------------------------------- comparing


def tokenizer_change(recorded: dict | None, current: dict | None) -> str | None:
    """What differs between the recorded and the current tokenizer (one phrase), or None."""
    from megatron_lev.data.tokenizers import fingerprint_mismatch

    old, new = recorded_tokenizer(recorded), recorded_tokenizer(current)
    if old is None or new is None:
        return None
    diff = fingerprint_mismatch(old, new)
    if diff is None:
        return None
    old_path, new_path = old.get("path") or old.get("file"), new.get("path") or new.get("file")
    if old_path == new_path:
        return f"the tokenizer file {new_path} changed since the checkpoint was trained with it ({diff})"
    return f"the tokenizer {new_path} is not the one the checkpoint was trained with, {old_path} ({diff})"


def _describe(entry: dict) -> str:
    docs, tokens = entry.get("documents"), entry.get("tokens")
    if isinstance(docs, int) and isinstance(tokens, int):
        return f"{docs:,} documents, {tokens:,} tokens"
    return f"digest {str(entry.get('digest'))[:12]}"


def data_changes(recorded: dict | None, current: dict | None) -> list[str]:
    """What differs between the shard sets and blend weights of two records (phrases); sets whose
    current manifest is missing are left to the dataset builder."""
    changes = []
    old_data, new_data = (recorded or {}).get("data") or {}, (current or {}).get("data") or {}
    added = bool(new_data.get("valid")) and not old_data.get("valid")
    removed = bool(old_data.get("valid")) and not new_data.get("valid")
    split = str(old_data.get("split") or new_data.get("split") or "")
    if (added or removed) and "train" in old_data and not _trains_on_every_document(split):
        # with data.valid_data_path, training reads every document of data.data_path; without, the
        # training part of data.split: another set of training documents, so other losses from here on
        now, then = (
            ("every document", f"data.split={split}'s training part")
            if added
            else (
                f"data.split={split}'s training part",
                "every document",
            )
        )
        changes.append(
            f"a validation set was {'added' if added else 'removed'} (data.valid_data_path): training now "
            f"reads {now} of data.data_path, the checkpoint read {then}"
        )
    for part in ("train", "valid"):
        old, new = old_data.get(part), new_data.get(part)
        if not old or not new:
            continue
        if len(old) != len(new):
            changes.append(
                f"the {part} blend has {len(new)} shard set(s), the checkpoint was trained on {len(old)} "
                f"({', '.join(e.get('prefix', '?') for e in old)})"
            )
            continue
        for a, b in zip(old, new):
            if a.get("digest") and b.get("digest") and a["digest"] != b["digest"]:
                changes.append(
                    f"shard set {b['prefix']} holds other tokens than the checkpoint was trained on "
                    f"({b.get('manifest')}: {_describe(b)}; recorded: {a.get('prefix')}, {_describe(a)})"
                )
            elif float(a.get("weight", 1.0)) != float(b.get("weight", 1.0)):
                changes.append(
                    f"the blend weight of {b['prefix']} is {b['weight']:g}, recorded {a['weight']:g}"
                )
    return changes


def _trains_on_every_document(split: str) -> bool:
    """Whether `data.split` ('train,valid,test' weights) gives every document to training."""
    try:
        weights = [float(w) for w in split.split(",")]
    except ValueError:
        return False
    return len(weights) > 0 and all(w == 0 for w in weights[1:])


__all__ = [
    "PROVENANCE_FILE",
    "blend_record",
    "data_changes",
    "manifest_digest",
    "read_provenance",
    "recorded_tokenizer",
    "run_provenance",
    "tokenizer_change",
    "tokenizer_record",
    "warn_unrecorded",
]
