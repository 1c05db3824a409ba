"""Where preprocessing writes: the output shards in a staging directory (one stream per subset,
cut by size), then the commit that moves the staged set into place, writes its manifest last and
removes what an earlier run into the same prefix wrote that this one does not, never touching
another shard set's files."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from megatron_lev.data.indexed import IndexedDatasetBuilder, best_dtype
from megatron_lev.data.manifest import SET_FILES, SHARD_FILES, read_manifest, write_manifest
from megatron_lev.data.manifest import SUFFIX as MANIFEST_SUFFIX
from megatron_lev.data.preprocess_chunk import ChunkResult, PreprocessError, PreprocessOptions
from megatron_lev.errors import DataError
from megatron_lev.utils.io import TEMP_MARK


class StagedOutputs:
    """The output shards in the staging directory: one stream per subset key, cut by size."""

    def __init__(self, opts: PreprocessOptions, staging: Path, vocab_size: int):
        self.opts, self.staging = opts, staging
        self.name = Path(opts.output_prefix).name
        self.dtype = best_dtype(vocab_size)
        self.limit = int(opts.shard_size_mb * 1e6) if opts.shard_size_mb else None
        self.builders: dict[str, IndexedDatasetBuilder] = {}
        self.shard_no: dict[str, int] = {}
        self.done: list[IndexedDatasetBuilder] = []
        self.counts = np.zeros(vocab_size, dtype=np.int64)
        self.max_token_id = 0

    def base(self, key: str) -> str:
        return f"{self.name}_{key}" if key else self.name

    def _open(self, key: str) -> IndexedDatasetBuilder:
        n = self.shard_no.get(key, 0)
        self.shard_no[key] = n + 1
        name = f"{self.base(key)}_{n:05d}" if self.limit else self.base(key)
        self.builders[key] = IndexedDatasetBuilder(self.staging / name, self.dtype)
        return self.builders[key]

    def add(self, res: ChunkResult) -> None:
        for key, flat, sizes in res.groups:
            self.counts += np.bincount(flat, minlength=len(self.counts))[: len(self.counts)]
            self.max_token_id = max(self.max_token_id, int(flat.max()))
            builder = self.builders.get(key) or self._open(key)
            offsets = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
            i, item = 0, self.dtype.itemsize
            while i < len(sizes):
                take = len(sizes) - i
                if self.limit is not None:
                    nbytes = (offsets[i + 1 :] - offsets[i]) * item
                    take = int(np.searchsorted(nbytes, self.limit - builder.num_bytes, side="right"))
                    if take == 0 and builder.num_sequences:  # full: start the next shard
                        builder.finalize()
                        self.done.append(builder)
                        builder = self._open(key)
                        continue
                    take = max(take, 1)  # one document larger than a shard gets a shard of its own
                builder.add_raw(flat[offsets[i] : offsets[i + take]].tobytes(), sizes[i : i + take])
                i += take

    def bases(self) -> set[str]:
        """The output names before any shard number: the prefix, or prefix_<subset> per subset."""
        return {self.base(k) for k in self.shard_no} | {self.name}

    def finish(self) -> list[IndexedDatasetBuilder]:
        for key in sorted(self.builders):
            self.builders[key].finalize()
            self.done.append(self.builders[key])
        self.builders = {}
        return sorted(self.done, key=lambda b: b.prefix)

    def abort(self) -> None:
        for b in self.builders.values():
            b.abort()


def commit_shard_set(
    out_prefix: Path,
    staging: Path,
    shards: list[IndexedDatasetBuilder],
    bases: set[str],
    fingerprint: dict,
    max_token_id: int,
    known_sha256: dict,
    stats: dict,
) -> list[Path]:
    """Move the staged set into place, write its manifest last and remove what an earlier run into
    the same prefix wrote that this one does not. Returns the removed files."""
    out_dir, name = out_prefix.parent, out_prefix.name
    staged = sorted(p for p in staging.iterdir() if TEMP_MARK not in p.name)
    _refuse_other_sets(out_prefix, [p.name for p in staged], bases)
    old_manifest = Path(f"{out_prefix}{MANIFEST_SUFFIX}")
    old_files: list[str] = []
    if old_manifest.is_file():
        try:
            old_files = list(read_manifest(old_manifest)["files"])
        except DataError:
            old_files = []
        old_manifest.unlink()  # from here on the old set is no longer a complete set
    new_files = []
    for path in staged:
        os.replace(path, out_dir / path.name)
        new_files.append(path.name)
    write_manifest(
        out_prefix,
        [str(out_dir / Path(b.prefix).name) for b in shards],
        fingerprint,
        max_token_id,
        known_sha256,
        documents=stats["documents"],
        tokens=stats["tokens"],
        dtype=stats["dtype"],
    )
    # numbered shards of the bases this run writes are this prefix's outputs too (e.g. from a run
    # without a manifest); so are the files the old manifest listed. A file that the manifest of
    # another shard set lists is that set's, whatever its name, and is never removed.
    ours = re.compile(rf"^(?:{'|'.join(sorted(map(re.escape, bases)))})(?:_\d{{5}})?\.(?:bin|idx)$")
    keep = set(new_files)
    stale = [out_dir / f for f in old_files if f not in keep and "/" not in f and (out_dir / f).is_file()]
    stale += [
        p
        for p in out_dir.iterdir()
        if p.is_file() and ours.match(p.name) and p.name not in keep and p not in stale
    ]
    stale = [p for p in stale if _other_owner(out_dir, p.name, name) is None]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def _other_owner(out_dir: Path, file: str, name: str) -> Path | None:
    """The manifest of another shard set than prefix `name` that owns `file` in `out_dir`, or None
    when the file is this prefix's (its manifest lists it) or no set's. As in
    `manifest.find_manifest`, the owner of `P_Github_00003.bin` is the first of
    `P_Github_00003`, `P_Github`, `P` `.manifest.json` that lists it; an unreadable manifest of
    another set is taken to own everything it could."""
    stem, shard = file, False
    for ext in (*SHARD_FILES, *SET_FILES):
        if file.endswith(ext):
            stem, shard = file[: -len(ext)], ext in SHARD_FILES
            break
    candidate = stem
    while True:
        path = out_dir / f"{candidate}{MANIFEST_SUFFIX}"
        if path.is_file():
            try:
                manifest = read_manifest(path)
            except DataError:
                if candidate != name:
                    return path
                manifest = {"shards": [], "files": {}}
            if file in manifest["files"] or (shard and stem in manifest["shards"]):
                return None if candidate == name else path
        if "_" not in candidate:
            return None
        candidate = candidate.rsplit("_", 1)[0]


def _refuse_other_sets(out_prefix: Path, files: list[str], bases: set[str]) -> None:
    """Refuse, before anything is moved, a run whose outputs would overwrite a file of another shard
    set, or whose output name (`<prefix>_<subset>` of --split-by-subset) is another set's prefix."""
    out_dir, name = out_prefix.parent, out_prefix.name
    for file in files:
        owner = _other_owner(out_dir, file, name) if (out_dir / file).exists() else None
        if owner is not None:
            raise PreprocessError(
                f"--output-prefix {out_prefix}: would overwrite {out_dir / file} of the shard set "
                f"{out_dir / owner.name[: -len(MANIFEST_SUFFIX)]} (see {owner}); "
                "choose another --output-prefix, or move or delete that set first; nothing was written"
            )
    for base in sorted(bases - {name}):
        other = out_dir / f"{base}{MANIFEST_SUFFIX}"
        if other.exists():
            raise PreprocessError(
                f"--output-prefix {out_prefix}: would write {out_dir / base}.bin/.idx, "
                f"but {out_dir / base} is "
                f"the prefix of another shard set (see {other}); choose another --output-prefix, or move or "
                f"delete that set first; nothing was written"
            )
