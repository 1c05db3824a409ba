"""The manifest of a shard set: what `preprocess` wrote, so readers take all of it or none.

`<prefix>.manifest.json` is written last by `preprocess`. It lists every file of the
set (shards `.bin/.idx`, `.stats.json`, `.counts.npy`) with its size and sha256, the
tokenizer fingerprint (`tokenizers.tokenizer_fingerprint`) and the largest token id.
A set without one is incomplete (its run died) or predates manifests.

`verify_shard_set(shard)` is what the dataset builder, `build-indices` and `train`
call. Policy: file sizes are checked on every open (a `stat` per file). Each shard
file also has its chunk digests in the manifest (sha256 of every `CHUNK_BYTES`, computed
by `preprocess` where it writes the set): every start checks a fresh random sample of
chunks (the last ones first, at most `SAMPLE_BYTES` a set however many of its shards a run
lists: `verify_shard_sets`), split over the ranks, so a 600 GB
shard costs the same seconds as a small one and no rank waits long in a collective; a
file rewritten with its size and mtime restored (`rsync -a`, `tar x`, `cp -p`) differs in
every chunk. `megatron-lev preprocess --verify PREFIX` checks every byte. A manifest
written before chunk digests is checked by its whole-file sha256s as before, on rank 0, in a
group whose timeout is sized to the bytes (not the collective timeout), remembered in a
checksum cache keyed by (path, size, mtime, ctime, inode); ctime changes on every write, so a
restored mtime does not fool it. Every rank raises the same error.
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
CHUNK_BYTES = 64 << 20  # the unit of the chunk digests a manifest records for each shard file
SAMPLE_BYTES = 1 << 30  # chunks checked at a start, per shard set (the last chunk of each file first)
CHUNK_DIGEST_HEX = 32  # a chunk digest is the first 128 bits of its sha256
LEGACY_HASH_BYTES_PER_S = 100e6  # the slowest whole-file hashing a legacy check's wait allows for


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
        if name.endswith(SHARD_FILES):  # one read: the chunk digests (and the sha256 if not known)
            whole, chunks = file_digests(path)
            files[name] = {
                "size": path.stat().st_size,
                "sha256": known.get(name) or whole,
                "chunk_bytes": CHUNK_BYTES,
                "chunks": chunks,
            }
        else:
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


def file_digests(path: str | os.PathLike) -> tuple[str, list[str]]:
    """(sha256 of the file, the chunk digests: the first CHUNK_DIGEST_HEX hex digits of the sha256 of
    each CHUNK_BYTES of it), in one read."""
    import hashlib

    whole, chunks = hashlib.sha256(), []
    with open(path, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            whole.update(block)
            chunks.append(hashlib.sha256(block).hexdigest()[:CHUNK_DIGEST_HEX])
    return whole.hexdigest(), chunks


def chunk_digest(path: str | os.PathLike, index: int, chunk_bytes: int = CHUNK_BYTES) -> str:
    """The digest of chunk `index` of `path` (as `file_digests` records it)."""
    import hashlib

    with open(path, "rb") as f:
        f.seek(index * chunk_bytes)
        return hashlib.sha256(f.read(chunk_bytes)).hexdigest()[:CHUNK_DIGEST_HEX]


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


def verify_shard_sets(prefixes: list[str | os.PathLike], **kwargs) -> list[dict]:
    """`verify_shard_set` for each of `prefixes` (their manifests, in order), checking each shard set
    once: its files' sizes, and one start-up sample of chunks over the shards of it that are listed.
    The shards of a set written in many (`P_00000`, `P_00001`, ...) share its `SAMPLE_BYTES`, so
    listing a set's 150 shards costs a start what one shard would, not 150 GiB of reading."""
    found = [find_manifest(prefix) for prefix in prefixes]  # each manifest read once a prefix
    keys = [str(f[0] or prefix) for f, prefix in zip(found, prefixes)]
    listed: dict[str, list[str]] = {}
    for key, prefix in zip(keys, prefixes):
        listed.setdefault(key, []).append(Path(prefix).name)
    seen: set[str] = set()
    manifests = []
    for key, prefix, f in zip(keys, prefixes, found):
        manifests.append(
            verify_shard_set(prefix, sample_shards=listed[key], set_checked=key in seen, found=f, **kwargs)
        )
        seen.add(key)
    return manifests


def verify_shard_set(
    prefix: str | os.PathLike,
    tokenizer_fp: dict | None = None,
    vocab_size: int | None = None,
    checksums: bool = True,
    allow_tokenizer_change: bool = False,
    sample_shards: list[str] | None = None,
    set_checked: bool = False,
    found: tuple | None = None,
) -> dict:
    """Refuse a shard whose set has no manifest, whose files differ from it (size always, sha256
    once per file version), whose tokenizer differs from `tokenizer_fp`, or whose largest token
    id does not fit `vocab_size`. Returns the manifest. The contents' check covers the shard's files
    and the set's, or those of every shard named in `sample_shards` (names in the set: one
    sample for the shards of a set a run lists, `verify_shard_sets`); `set_checked`: an earlier call
    of the same start checked the set's files (sizes and sample), only the listing and the
    tokenizer remain; `found`: `find_manifest(prefix)`, when the caller has read it."""
    shard = Path(prefix)
    path, manifest, others = found if found is not None else find_manifest(shard)
    if manifest is None:
        if others and not Path(f"{shard}.bin").exists() and not Path(f"{shard}.idx").exists():
            listed = read_manifest(others[0])["shards"]
            shown = ", ".join(str(shard.parent / n) for n in listed[:3]) + (
                ", ..." if len(listed) > 3 else ""
            )
            raise ShardSetError(
                f"{shard}: no such shard; {others[0]} describes the set written at this prefix, whose "
                f"{len(listed)} shard(s) are {shown}: give those prefixes in data.data_path (or --data)"
            )
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
    for name, entry in () if set_checked else manifest["files"].items():
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
    if checksums and not set_checked:
        shards = [n for n in (sample_shards or []) if n in manifest["shards"]] or [shard.name]
        mine = [f"{name}{ext}" for name in shards for ext in SHARD_FILES]
        mine += [n for n in manifest["files"] if any(n.endswith(ext) for ext in SET_FILES)]
        chunked = [n for n in mine if manifest["files"].get(n, {}).get("chunks") is not None]
        whole = [n for n in mine if n not in chunked]
        if chunked:
            _check_sampled_chunks(directory, path, manifest, chunked)
        if whole:
            _agree_on_slowly(lambda: _checksum_problem(directory, path, manifest, whole), directory, whole)
    if tokenizer_fp is not None and manifest.get("tokenizer"):
        from megatron_lev.data.tokenizers import fingerprint_mismatch

        diff = fingerprint_mismatch(manifest["tokenizer"], tokenizer_fp)
        if diff and allow_tokenizer_change:
            from megatron_lev.log import get_logger

            get_logger(__name__).warning(
                "%s: made with another tokenizer than the one given (%s); used anyway (--allow-change "
                "tokenizer)",
                shard,
                diff,
            )
        elif diff:
            raise ShardSetError(
                f"{shard}: made with another tokenizer than the one given ({diff}, see {path}); set "
                "data.tokenizer_path/--tokenizer to the tokenizer preprocess used, rerun preprocess "
                "with this one, or pass --allow-change tokenizer to train on them with it"
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


def sample_chunks(manifest: dict, names: list[str], seed: int, budget: int = SAMPLE_BYTES):
    """(name, chunk index) to check at a start, at most `budget` bytes of chunks: the last chunk of
    every file (a random half of the budget's chunks when there are more files than that: a set
    written in 150 shards), then chunks drawn at random (`seed`) over all of them."""
    import random

    rng = random.Random(seed)
    lasts, pool = [], []
    for name in names:
        n = len(manifest["files"][name]["chunks"])
        if n:
            lasts.append((name, n - 1))
            pool += [(name, i) for i in range(n - 1)]
    chunk = max((manifest["files"][n].get("chunk_bytes", CHUNK_BYTES) for n in names), default=CHUNK_BYTES)
    slots = max(budget // chunk, 1)
    if len(lasts) <= slots:
        picked = lasts
    else:  # more files than the budget holds chunks: the other lasts join the random draw
        picked = rng.sample(lasts, max(slots // 2, 1))
        chosen = set(picked)
        pool += [c for c in lasts if c not in chosen]
    room = slots - len(picked)
    if pool and room > 0:
        picked = picked + rng.sample(pool, min(room, len(pool)))
    return picked


def _check_sampled_chunks(directory: Path, path: Path, manifest: dict, names: list[str]) -> None:
    """Check a random sample of the files' chunks against the manifest, split over the ranks (each
    rank reads its share, then one small all-gather); every rank raises the same error."""
    td = _dist()
    rank, world = (td.get_rank(), td.get_world_size()) if td else (0, 1)
    box = [int.from_bytes(os.urandom(4), "little")]
    if td:
        td.broadcast_object_list(box, src=0)
    mine = sample_chunks(manifest, names, box[0], SAMPLE_BYTES)[rank::world]
    problem = None
    try:
        for name, index in mine:
            entry = manifest["files"][name]
            unit = entry.get("chunk_bytes", CHUNK_BYTES)
            if chunk_digest(directory / name, index, unit) != entry["chunks"][index]:
                problem = (
                    f"{directory / name}: the sha256 of chunk {index} (bytes {index * unit:,}...) differs "
                    f"from the one recorded in {path}, though the size is the same: the file was rewritten "
                    f"or damaged; {how_to_fix(directory / manifest['prefix'])}"
                )
                break
    except OSError as exc:
        problem = (
            f"checking the shard set on rank {rank} failed: {directory / mine[0][0]} is unreadable "
            f"({exc}); {how_to_fix(directory / manifest['prefix'])}"
        )
    found = [problem]
    if td:
        found = [None] * world
        td.all_gather_object(found, problem)
    first = next((p for p in found if p), None)
    if first:
        raise ShardSetError(first)


def _dist():
    """torch.distributed when a group of more than one rank is up, else None."""
    try:
        import torch.distributed as td

        if td.is_available() and td.is_initialized() and td.get_world_size() > 1:
            return td
    except ImportError:
        pass
    return None


def _agree_on_slowly(check, directory: Path, names: list[str]) -> None:
    """`_agree_on` for whole-file hashing on rank 0 (a manifest without chunk digests): the others wait
    in a gloo group whose timeout is sized to the bytes, not in one bounded by the collective timeout
    (a cold 600 GB shard takes about 11 minutes to hash). The log says what it is doing."""
    td = _dist()
    if td is None:
        _agree_on(check)
        return
    import datetime

    from megatron_lev.log import get_logger

    size = sum((directory / n).stat().st_size for n in names)
    seconds = max(600.0, size / LEGACY_HASH_BYTES_PER_S)
    if td.get_rank() == 0 and size > (1 << 30):
        get_logger(__name__).info(
            "checking the sha256 of %s (%.1f GB; its manifest has no chunk digests): rank 0 reads it all, "
            "the others wait up to %.0f s; `megatron-lev preprocess --verify PREFIX` adds them",
            ", ".join(names),
            size / 1e9,
            seconds,
        )
    group = td.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
    try:
        _agree_on(check, group)
    finally:
        td.destroy_process_group(group)


def _agree_on(check, group=None) -> None:
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
        dist.broadcast_object_list(box, src=0, group=group)
        kind, message = box[0]
        if kind == "raised":
            raise ShardSetError(message) from failure
    if message:
        raise ShardSetError(message)


# --------------------------------------------------------------------------- checksum cache

_memory: dict[str, tuple] = {}


def _cache_file() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "megatron_lev")
    return Path(base) / "sha256-cache.json"


def _load_cache() -> dict:
    try:
        data = json.loads(_cache_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _version(st: os.stat_result) -> list[int]:
    """What identifies one version of a file: size, mtime, ctime and inode. ctime is set by the kernel
    on every write or metadata change and cannot be restored (unlike the mtime `rsync -a`, `tar x` or
    `cp -p` put back), and a file replaced by another has another inode."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _remember(path: Path, digest: str) -> None:
    st = path.stat()
    key = str(path.resolve())
    _memory[key] = (*_version(st), digest)
    cache = _load_cache()
    if len(cache) > 2000:  # forget files that are gone
        cache = {k: v for k, v in cache.items() if os.path.exists(k)}
    cache[key] = [*_version(st), digest]
    with contextlib.suppress(OSError):  # an unwritable home only costs a re-hash next time
        atomic_write_json(_cache_file(), cache)


def cached_sha256(path: str | os.PathLike) -> str:
    """sha256 of `path`, hashed only when this version of it (`_version`: path, size, mtime, ctime,
    inode) has not been hashed before."""
    path = Path(path)
    st = path.stat()
    key = str(path.resolve())
    hit = _memory.get(key) or tuple(_load_cache().get(key) or ())
    if len(hit) == 5 and list(hit[:4]) == _version(st):
        return hit[4]
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


def verify_every_byte(prefix: str | os.PathLike, workers: int = 2, log=None) -> dict:
    """The full check of a shard set (`preprocess --verify`): the sha256 of every file its manifest
    lists, and the chunk digests of each shard file; files are read on `workers` threads (hashlib
    releases the GIL). A manifest written before chunk digests gets them once every file matched
    (rewritten atomically). Raises ShardSetError naming the first file that differs. Returns
    {"files", "bytes", "seconds", "added_chunks"}."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    own = Path(f"{prefix}{SUFFIX}")
    if own.is_file():  # the set named by its prefix: its own manifest, sharded or not
        path, manifest = own, read_manifest(own)
    else:  # one shard of a set (`P_Github_00003`): the manifest that lists it
        path, manifest, _ = find_manifest(prefix)
    if manifest is None:
        raise ShardSetError(f"{prefix}: no shard-set manifest lists it; {how_to_fix(prefix)}")
    directory, start = path.parent, time.perf_counter()

    def one(name: str) -> tuple[str, str, list[str] | None]:
        if name.endswith(SHARD_FILES):
            whole, chunks = file_digests(directory / name)
            return name, whole, chunks
        return name, sha256_file(directory / name), None

    names = list(manifest["files"])
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(names)))) as pool:
        results = list(pool.map(one, names))
    added = False
    for name, whole, chunks in results:
        entry = manifest["files"][name]
        if whole != entry.get("sha256"):
            raise ShardSetError(
                f"{directory / name}: sha256 {whole[:12]}... differs from {str(entry.get('sha256'))[:12]}... "
                f"recorded in {path}; the file is damaged: {how_to_fix(directory / manifest['prefix'])}"
            )
        if chunks is not None and entry.get("chunks") is None:
            entry.update(chunk_bytes=CHUNK_BYTES, chunks=chunks)
            added = True
        _remember(directory / name, whole)
    if added:
        atomic_write_json(path, manifest)
    size = sum(manifest["files"][n]["size"] for n in names)
    return {"files": len(names), "bytes": size, "seconds": time.perf_counter() - start, "added_chunks": added}


def max_token_id(tokens: np.ndarray, block: int = 1 << 26) -> int:
    """The largest value of a (memory-mapped) token array, read in blocks."""
    largest = 0
    for start in range(0, len(tokens), block):
        largest = max(largest, int(tokens[start : start + block].max()))
    return largest
