"""The manifest of a shard set: what `preprocess` wrote, so readers take all of it or none.

`<prefix>.manifest.json` is written last by `preprocess`. It lists every file of the
set (shards `.bin/.idx`, `.stats.json`, `.counts.npy`) with its size and sha256, the
tokenizer fingerprint (`tokenizers.tokenizer_fingerprint`) and the largest token id.
A set without one is incomplete (its run died) or predates manifests.

`verify_shard_set(shard)` is what the dataset builder, `build-indices` and `train`
call. Policy: file sizes are checked on every open (a `stat` per file); sha256 sums
are checked once per file version and remembered in a checksum cache keyed by
(path, size, mtime), so a large set is hashed once, not at every start. Under
`torch.distributed` rank 0 hashes and tells the others the outcome, so every rank
raises the same error (no rank waits at a barrier for one that failed).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np

from megatron_lev.errors import DataError
from megatron_lev.utils.io import atomic_write_json, sha256_file

FORMAT = "megatron-lev shard set"
VERSION = 1
SUFFIX = ".manifest.json"
SHARD_FILES = (".bin", ".idx")
SET_FILES = (".stats.json", ".counts.npy")
CACHE_ENV = "MEGATRON_LEV_CACHE_DIR"  # where the checksum cache lives (default ~/.cache/megatron_lev)


class ShardSetError(DataError):
    """A shard set has no manifest, or its files or tokenizer disagree with it."""


def manifest_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}{SUFFIX}")


def how_to_fix(prefix) -> str:
    return (
        f"rerun `megatron-lev preprocess` into {prefix}; for shards you trust that were made without a "
        f"manifest, run `megatron-lev preprocess --write-manifest-for {prefix} --tokenizer FILE`"
    )


# --------------------------------------------------------------------------- writing


def write_manifest(
    prefix: str | os.PathLike,
    shards: list[str],
    tokenizer_fp: dict,
    max_token_id: int,
    known_sha256: dict[str, str] | None = None,
    **summary,
) -> Path:
    """Write `<prefix>.manifest.json` for `shards` (prefixes in the manifest's directory) and the
    set files beside `prefix` that exist. `known_sha256` maps file names to sums computed while
    writing (saves reading a large shard back)."""
    prefix = Path(prefix)
    directory = prefix.parent
    known = known_sha256 or {}
    names = [f"{Path(s).name}{ext}" for s in shards for ext in SHARD_FILES]
    names += [f"{prefix.name}{ext}" for ext in SET_FILES if (directory / f"{prefix.name}{ext}").exists()]
    files = {}
    for name in names:
        path = directory / name
        files[name] = {"size": path.stat().st_size, "sha256": known.get(name) or sha256_file(path)}
        _remember(path, files[name]["sha256"])
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "prefix": prefix.name,
        "shards": [Path(s).name for s in shards],
        "files": files,
        "tokenizer": tokenizer_fp,
        "max_token_id": int(max_token_id),
        **summary,
    }
    path = manifest_path(prefix)
    atomic_write_json(path, manifest)
    return path


def read_manifest(path: str | os.PathLike) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardSetError(
            f"{path}: unreadable shard-set manifest ({exc}); {how_to_fix(str(path)[: -len(SUFFIX)])}"
        ) from None
    ok = (
        isinstance(data, dict)
        and data.get("format") == FORMAT
        and isinstance(data.get("files"), dict)
        and isinstance(data.get("shards"), list)
        and isinstance(data.get("max_token_id"), int)
    )
    if not ok:
        raise ShardSetError(
            f"{path}: not a megatron-lev shard-set manifest (format, files, shards or "
            f"max_token_id missing); {how_to_fix(str(path)[: -len(SUFFIX)])}"
        )
    if data.get("version") != VERSION:
        raise ShardSetError(
            f"{path}: manifest version {data.get('version')!r}, this code reads {VERSION}; "
            "rerun preprocess with this version"
        )
    return data


def find_manifest(shard: str | os.PathLike) -> tuple[Path | None, dict | None, list[Path]]:
    """The manifest listing `shard`: `<shard>.manifest.json`, else that of the prefix left after
    dropping `_suffix` parts of the name (`P_Github_00003` -> `P_Github`, `P`). Returns
    (path, manifest, manifests seen that do not list it)."""
    shard = Path(shard)
    name, others = shard.name, []
    while True:
        path = shard.parent / f"{name}{SUFFIX}"
        if path.is_file():
            data = read_manifest(path)
            if shard.name in data["shards"]:
                return path, data, others
            others.append(path)
        if "_" not in name:
            return None, None, others
        name = name.rsplit("_", 1)[0]


# --------------------------------------------------------------------------- checking


def verify_shard_set(
    prefix: str | os.PathLike,
    tokenizer_fp: dict | None = None,
    vocab_size: int | None = None,
    checksums: bool = True,
) -> dict:
    """Refuse a shard whose set has no manifest, whose files differ from it (size always, sha256
    once per file version), whose tokenizer differs from `tokenizer_fp`, or whose largest token
    id does not fit `vocab_size`. Returns the manifest."""
    shard = Path(prefix)
    path, manifest, others = find_manifest(shard)
    if manifest is None:
        if others:
            raise ShardSetError(
                f"{shard}: not part of the shard set described by {others[0]} (left by an earlier run?); "
                f"use the prefixes that manifest lists, delete the stray {shard}.bin/.idx, "
                f"or {how_to_fix(shard)}"
            )
        raise ShardSetError(
            f"{shard}: no {shard.name}{SUFFIX} (the preprocess run that wrote it did not finish, "
            f"or it predates manifests); {how_to_fix(shard)}"
        )
    directory = path.parent
    for name, entry in manifest["files"].items():
        file = directory / name
        if not file.is_file():
            raise ShardSetError(
                f"{file}: missing, but listed in {path}; the shard set is incomplete: "
                f"{how_to_fix(directory / manifest['prefix'])}"
            )
        size = file.stat().st_size
        if size != entry.get("size"):
            raise ShardSetError(
                f"{file}: {size} bytes, but {path} records {entry.get('size')}; the file was "
                f"changed or cut short: {how_to_fix(directory / manifest['prefix'])}"
            )
    if checksums:
        mine = [f"{shard.name}{ext}" for ext in SHARD_FILES]
        mine += [n for n in manifest["files"] if any(n.endswith(ext) for ext in SET_FILES)]
        _agree_on(lambda: _checksum_problem(directory, path, manifest, mine))
    if tokenizer_fp is not None and manifest.get("tokenizer"):
        from megatron_lev.data.tokenizers import fingerprint_mismatch

        diff = fingerprint_mismatch(manifest["tokenizer"], tokenizer_fp)
        if diff:
            raise ShardSetError(
                f"{shard}: made with another tokenizer than the one given ({diff}, see {path}); set "
                "data.tokenizer_path/--tokenizer to the tokenizer preprocess used, "
                "or rerun preprocess with this one"
            )
    if vocab_size is not None and manifest["max_token_id"] >= vocab_size:
        raise ShardSetError(
            f"{shard}: holds token id {manifest['max_token_id']} "
            f"but the vocabulary has only {vocab_size} ids "
            f"(see {path}); use the tokenizer the shards were made with, or a larger model.vocab_size"
        )
    return manifest


def _checksum_problem(directory: Path, path: Path, manifest: dict, names: list[str]) -> str | None:
    for name in names:
        entry = manifest["files"].get(name)
        if entry is None:
            continue
        got = cached_sha256(directory / name)
        if got != entry.get("sha256"):
            return (
                f"{directory / name}: sha256 {got[:12]}... differs from {entry.get('sha256', '')[:12]}... "
                f"recorded in {path}; the file is damaged: {how_to_fix(directory / manifest['prefix'])}"
            )
    return None


def _agree_on(check) -> None:
    """Run `check()` (an error message or None) once, on rank 0 under torch.distributed, and
    raise the same error on every rank. When `check()` itself raises on rank 0 (an unreadable
    file, say), the other ranks are told too and raise a ShardSetError with its message, so no
    rank is left waiting in the broadcast."""
    dist = None
    try:
        import torch.distributed as td

        if td.is_available() and td.is_initialized() and td.get_world_size() > 1:
            dist = td
    except ImportError:
        pass
    if dist is None:
        message = check()
    else:
        failure: Exception | None = None
        box: list = [None]
        if dist.get_rank() == 0:
            try:
                box = [("ok", check())]
            except Exception as exc:  # told to every rank below, so that all of them raise
                failure = exc
                box = [("raised", f"checking the shard set on rank 0 failed: {type(exc).__name__}: {exc}")]
        dist.broadcast_object_list(box, src=0)
        kind, message = box[0]
        if kind == "raised":
            raise ShardSetError(message) from failure
    if message:
        raise ShardSetError(message)


# --------------------------------------------------------------------------- checksum cache

_memory: dict[str, tuple[int, int, str]] = {}


def _cache_file() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "megatron_lev")
    return Path(base) / "sha256-cache.json"


def _load_cache() -> dict:
    try:
        data = json.loads(_cache_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _remember(path: Path, digest: str) -> None:
    st = path.stat()
    key = str(path.resolve())
    _memory[key] = (st.st_size, st.st_mtime_ns, digest)
    cache = _load_cache()
    if len(cache) > 2000:  # forget files that are gone
        cache = {k: v for k, v in cache.items() if os.path.exists(k)}
    cache[key] = [st.st_size, st.st_mtime_ns, digest]
    with contextlib.suppress(OSError):  # an unwritable home only costs a re-hash next time
        atomic_write_json(_cache_file(), cache)


def cached_sha256(path: str | os.PathLike) -> str:
    """sha256 of `path`, hashed only when this (path, size, mtime) has not been hashed before."""
    path = Path(path)
    st = path.stat()
    key = str(path.resolve())
    hit = _memory.get(key) or tuple(_load_cache().get(key) or ())
    if len(hit) == 3 and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
        return hit[2]
    digest = sha256_file(path)
    _remember(path, digest)
    return digest


# --------------------------------------------------------------------------- legacy sets


def legacy_shards(prefix: str | os.PathLike) -> list[str]:
    """The shards of a set made without a manifest: `prefix` itself, else `prefix_*` pairs."""
    prefix = Path(prefix)
    if Path(f"{prefix}.bin").is_file():
        return [str(prefix)]
    found = sorted(
        str(p)[:-4]
        for p in prefix.parent.glob(f"{prefix.name}_*.bin")
        if Path(f"{str(p)[:-4]}.idx").is_file()
    )
    if not found:
        raise ShardSetError(
            f"{prefix}: no {prefix.name}.bin/.idx and no {prefix.name}_*.bin/.idx shards found; "
            "give the prefix preprocess wrote"
        )
    return found


def write_manifest_for(
    prefix: str | os.PathLike, tokenizer_type: str, tokenizer_path: str
) -> tuple[Path, list[str]]:
    """Check every shard of a set made without a manifest (structure, and every id below the
    tokenizer's vocabulary) and write its manifest. Returns (manifest, shards)."""
    from megatron_lev.data.indexed import IndexedDataset
    from megatron_lev.data.tokenizers import build_tokenizer, tokenizer_fingerprint

    tok = build_tokenizer(tokenizer_type, tokenizer_path)
    shards = legacy_shards(prefix)
    largest, documents, tokens = 0, 0, 0
    for shard in shards:
        ds = IndexedDataset(shard)
        largest = max(largest, max_token_id(ds._bin))
        documents += ds.num_documents
        tokens += ds.num_tokens
    if largest >= tok.vocab_size:
        raise ShardSetError(
            f"{prefix}: holds token id {largest} but {tokenizer_path} has {tok.vocab_size} ids; "
            "give the tokenizer the shards were made with"
        )
    path = write_manifest(
        prefix,
        shards,
        tokenizer_fingerprint(tokenizer_type, tokenizer_path, tok),
        largest,
        documents=documents,
        tokens=tokens,
        dtype=str(IndexedDataset(shards[0]).dtype),
        note="written by --write-manifest-for for shards made without a manifest",
    )
    return path, shards


def max_token_id(tokens: np.ndarray, block: int = 1 << 26) -> int:
    """The largest value of a (memory-mapped) token array, read in blocks."""
    largest = 0
    for start in range(0, len(tokens), block):
        largest = max(largest, int(tokens[start : start + block].max()))
    return largest
