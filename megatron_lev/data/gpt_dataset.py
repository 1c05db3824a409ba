"""GPT training samples of S + 1 tokens over MMIDIDX shards, with train/valid/test splits and blends.

`build_train_valid_test_datasets(data_cfg, seq_length, (n_train, n_valid, n_test))`
returns three torch Datasets (None for an empty split) whose item i is
`{"tokens": int64 array of S + 1}`. Their index arrays (see `indices.py`) are cached
as `.npy` files keyed by a hash of what defines them, the shard's content included (the `.idx`
digest its manifest records: `index_digest`); one rank builds, the others wait.
Every shard set is checked against its manifest (and the run's tokenizer) first, and a
damaged cache file is rebuilt with a warning naming it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

from megatron_lev.data import indices as ix
from megatron_lev.data.indexed import IndexedDataset
from megatron_lev.data.manifest import cached_sha256, verify_shard_sets
from megatron_lev.errors import DataError
from megatron_lev.utils import dist as ranks
from megatron_lev.utils.io import atomic_open, atomic_write_json

INDEX_VERSION = (
    3  # bump when the index scheme changes, so old caches are not reused (3: sample_idx[0] = (0, 0))
)
log = logging.getLogger(__name__)


def _save_npy(path: Path, arr: np.ndarray) -> dict:
    with atomic_open(path, "wb") as f:
        np.save(f, arr)
    return {"size": path.stat().st_size, "sha256": cached_sha256(path)}


def _load_cache(cache_dir: Path, stem: str, marker: Path) -> dict[str, np.ndarray] | None:
    """The cached arrays, or None when there are none or they are damaged (then a warning names
    the file): each must have the size and sha256 its description recorded and load as .npy."""
    if not marker.exists():
        return None
    path = marker
    try:
        files = json.loads(marker.read_text())["files"]
        arrays = {}
        for k, entry in files.items():
            path = cache_dir / f"{stem}_{k}.npy"
            if path.stat().st_size != entry["size"] or cached_sha256(path) != entry["sha256"]:
                raise ValueError("its size or sha256 differs from the one recorded when it was built")
            arrays[k] = np.load(path, mmap_mode="r", allow_pickle=False)
        return arrays
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("index cache %s is damaged (%s); rebuilding it", path, exc)
        return None


def cached_arrays(cache_dir: Path, name: str, description: dict, build) -> dict[str, np.ndarray]:
    """Map the arrays `build()` returns from `<cache_dir>/<name>_<hash>_*.npy`, building them if missing.

    Global rank 0 builds while the others wait at a barrier; a node that cannot see
    rank 0's files (no shared file system) builds them once on its local rank 0.
    The description JSON is written last and marks a complete cache.
    """
    text = json.dumps({"version": INDEX_VERSION, **description}, sort_keys=True)
    key = hashlib.md5(text.encode()).hexdigest()[:16]
    cache_dir = Path(cache_dir)
    stem = f"{name}_{key}"
    marker = cache_dir / f"{stem}_description.json"

    def build_and_save() -> dict[str, np.ndarray]:
        cache_dir.mkdir(parents=True, exist_ok=True)
        marker.unlink(missing_ok=True)  # a cache being rebuilt is not complete
        arrays = build()
        files = {k: _save_npy(cache_dir / f"{stem}_{k}.npy", arr) for k, arr in arrays.items()}
        atomic_write_json(marker, {"arrays": sorted(arrays), "files": files, **json.loads(text)})
        return {k: np.load(cache_dir / f"{stem}_{k}.npy", mmap_mode="r") for k in arrays}

    if not ranks.initialized():
        return _load_cache(cache_dir, stem, marker) or build_and_save()
    if ranks.rank() == 0 and _load_cache(cache_dir, stem, marker) is None:
        build_and_save()
    ranks.barrier()
    if not marker.exists() and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        build_and_save()  # this node does not see rank 0's files
    ranks.barrier()
    return _load_cache(cache_dir, stem, marker) or build_and_save()


class GPTDataset(torch.utils.data.Dataset):
    """`num_samples` samples of S + 1 tokens from documents `[doc_start, doc_end)` of one shard."""

    def __init__(
        self,
        name: str,
        indexed: IndexedDataset,
        doc_range: tuple[int, int],
        num_samples: int,
        seq_length: int,
        seed: int,
        cache_dir: str | os.PathLike | None = None,
    ):
        self.name, self.indexed, self.seq_length = name, indexed, seq_length
        self.num_samples = num_samples
        start, end = doc_range
        first_seq, last_seq = int(indexed.doc_idx[start]), int(indexed.doc_idx[end])
        documents = np.arange(first_seq, last_seq, dtype=np.int32)
        tokens = int(indexed.sizes[first_seq:last_seq].sum(dtype=np.int64))
        if tokens == 0:
            raise DataError(
                f"{indexed.prefix}: split {name!r} (documents {start}-{end}) has no tokens; "
                "change data.split or use a larger shard set"
            )
        self.epochs = ix.num_epochs(tokens, seq_length, num_samples)
        description = {
            "class": "GPTDataset",
            "prefix": Path(indexed.prefix).name,
            "index": index_digest(indexed),  # the content, not only the name and the counts
            "sequences": len(indexed),
            "tokens": indexed.num_tokens,
            "documents": [start, end],
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
            "rng": "pcg64",
        }

        def build() -> dict[str, np.ndarray]:
            # numpy's Generator (PCG64) shuffles large arrays ~30% faster than the legacy RandomState
            doc_idx = ix.build_doc_idx(documents, self.epochs, np.random.default_rng(seed))
            sample_idx = ix.build_sample_idx(indexed.sizes, doc_idx, seq_length, num_samples)
            shuffle_idx = ix.build_shuffle_idx(num_samples, np.random.default_rng(seed + 1))
            return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}

        cache = Path(cache_dir) if cache_dir else Path(indexed.prefix).parent / "index-cache"
        arrays = cached_arrays(cache, f"{Path(indexed.prefix).name}_{name}", description, build)
        self.doc_idx, self.sample_idx, self.shuffle_idx = (
            arrays["doc_idx"],
            arrays["sample_idx"],
            arrays["shuffle_idx"],
        )

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, j: int) -> np.ndarray:
        """Sample j in stream order (before the shuffle): (S + 1,) int64."""
        (d0, o0), (d1, o1) = self.sample_idx[j], self.sample_idx[j + 1]
        if d0 == d1:
            return self.indexed.get(int(self.doc_idx[d0]), int(o0), int(o1 - o0 + 1)).astype(np.int64)
        pieces = [self.indexed.get(int(self.doc_idx[d0]), int(o0))]
        pieces += [self.indexed[int(self.doc_idx[d])] for d in range(d0 + 1, d1)]
        pieces.append(self.indexed.get(int(self.doc_idx[d1]), 0, int(o1) + 1))
        return np.concatenate(pieces).astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"tokens": self.sample(int(self.shuffle_idx[i]))}


class BlendedDataset(torch.utils.data.Dataset):
    """Several datasets mixed by weight with Megatron's greedy rule (see `indices.build_blending_indices`)."""

    def __init__(self, datasets: list, dataset_index: np.ndarray, dataset_sample_index: np.ndarray):
        self.datasets, self.dataset_index, self.dataset_sample_index = (
            datasets,
            dataset_index,
            dataset_sample_index,
        )

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def parse_blend(paths: list[str]) -> list[tuple[float, str]]:
    """`[prefix]` or `[w1, p1, w2, p2, ...]` -> [(weight, prefix)]."""
    if len(paths) == 1:
        return [(1.0, paths[0])]
    if len(paths) % 2:
        raise DataError(
            f"data.data_path {paths}: a blend alternates weight and prefix, e.g. ['0.7', 'a', '0.3', 'b']"
        )
    try:
        blend = [(float(paths[i]), paths[i + 1]) for i in range(0, len(paths), 2)]
    except ValueError:
        raise DataError(
            f"data.data_path {paths}: weights must be numbers (e.g. ['0.7', 'a', '0.3', 'b'])"
        ) from None
    if any(not np.isfinite(w) or w < 0 for w, _ in blend) or sum(w for w, _ in blend) <= 0:
        raise DataError(
            f"data.data_path {paths}: blend weights must be finite, non-negative and not all zero"
        )
    return blend


def _blend(
    name: str,
    sources: list[tuple[float, IndexedDataset, tuple[int, int]]],
    num_samples: int,
    seq_length: int,
    seed: int,
    cache_dir,
):
    """One dataset (single source) or a BlendedDataset whose children hold exactly what is drawn."""
    if num_samples <= 0 or all(r[1] <= r[0] for _, _, r in sources):
        return None
    if len(sources) == 1:
        _, ds, rng = sources[0]
        return GPTDataset(name, ds, rng, num_samples, seq_length, seed, cache_dir)
    weights = [w for w, _, _ in sources]
    description = {
        "class": "BlendedDataset",
        "weights": weights,
        "num_samples": num_samples,
        "prefixes": [Path(ds.prefix).name for _, ds, _ in sources],
    }
    cache = Path(cache_dir) if cache_dir else Path(sources[0][1].prefix).parent / "index-cache"
    arrays = cached_arrays(
        cache,
        f"blend_{name}",
        description,
        lambda: dict(
            zip(("dataset_index", "dataset_sample_index"), ix.build_blending_indices(weights, num_samples))
        ),
    )
    counts = np.bincount(arrays["dataset_index"], minlength=len(sources))
    children = []
    for (_, ds, rng), count in zip(sources, counts):
        if count and rng[1] <= rng[0]:
            raise DataError(
                f"{ds.prefix}: split {name!r} has no documents but the blend draws {count} samples; "
                "change data.split or the blend weights"
            )
        children.append(GPTDataset(name, ds, rng, int(count), seq_length, seed, cache_dir) if count else None)
    return BlendedDataset(children, arrays["dataset_index"], arrays["dataset_sample_index"])


def _fingerprint(data_cfg) -> dict | None:
    """The fingerprint of `data.tokenizer_path` (None when the config names no tokenizer)."""
    if not getattr(data_cfg, "tokenizer_path", None):
        return None
    from megatron_lev.data.tokenizers import tokenizer_fingerprint

    return tokenizer_fingerprint(data_cfg.tokenizer_type, data_cfg.tokenizer_path)


def open_shards(
    data_cfg,
    paths: list[str],
    vocab_size: int | None = None,
    allow_tokenizer_change: bool = False,
    fingerprint: dict | None = None,
) -> list[tuple[float, IndexedDataset]]:
    """(weight, shard) of a blend, each checked against its set's manifest and, when
    `data.tokenizer_path` is set, against the run's tokenizer and vocabulary (another tokenizer than
    the set's is refused unless `allow_tokenizer_change`: `--allow-change tokenizer`). `fingerprint`:
    the tokenizer's (`tokenizer_fingerprint`), when the caller has it; else it is computed here."""
    blend = parse_blend(list(paths))
    fingerprint = fingerprint or _fingerprint(data_cfg)
    if fingerprint is not None:
        vocab_size = vocab_size or fingerprint["vocab_size"]
    out = []
    manifests = verify_shard_sets(  # one start-up sample of each set's chunks, however many shards listed
        [prefix for _, prefix in blend],
        tokenizer_fp=fingerprint,
        vocab_size=vocab_size,
        allow_tokenizer_change=allow_tokenizer_change,
    )
    for (weight, prefix), manifest in zip(blend, manifests):
        ds = IndexedDataset(prefix)
        entry = manifest.get("files", {}).get(f"{Path(prefix).name}.idx") or {}
        ds.index_digest = entry.get("sha256")  # what the sample index depends on (index_digest())
        out.append((weight, ds))
    return out


def index_digest(indexed: IndexedDataset) -> str:
    """The identity of what a shard's sample index is built from (its `.idx`: sequence sizes and
    document boundaries): the sha256 the shard set's manifest records for the `.idx` (`open_shards`),
    else a hash of the arrays themselves. Keys the index cache, so another content under the same
    name never meets an old index."""
    known = getattr(indexed, "index_digest", None)
    if known:
        return known
    h = hashlib.sha256()
    for arr in (indexed.sizes, indexed.doc_idx):
        h.update(np.ascontiguousarray(arr).view(np.uint8))
    return "arrays:" + h.hexdigest()


def build_train_valid_test_datasets(
    data_cfg,
    seq_length: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    allow_tokenizer_change: bool = False,
    fingerprint: dict | None = None,
):
    """(train, valid, test) from `data.data_path` split by `data.split`, or valid from `data.valid_data_path`.
    `fingerprint`: the run's tokenizer fingerprint, when the caller has computed it (computed here
    once otherwise).

    Refuses shard sets without a matching manifest, made with another tokenizer than
    `data.tokenizer_path`, or holding ids at or above `vocab_size` (default: the tokenizer's)."""
    if not data_cfg.data_path:
        raise DataError("data.data_path is empty: give a shard prefix or a weight/prefix blend")
    if any(n < 0 for n in num_samples):
        raise DataError(f"sample counts must be non-negative, got {tuple(num_samples)}")
    cache_dir = cache_dir or data_cfg.cache_dir
    fingerprint = fingerprint or _fingerprint(data_cfg)  # once, for the training and validation shards
    train_blend = open_shards(data_cfg, data_cfg.data_path, vocab_size, allow_tokenizer_change, fingerprint)
    n_train, n_valid, n_test = num_samples
    seed = data_cfg.seed
    if data_cfg.valid_data_path:
        valid_blend = open_shards(
            data_cfg, data_cfg.valid_data_path, vocab_size, allow_tokenizer_change, fingerprint
        )
        train = _blend(
            "train",
            [(w, ds, (0, ds.num_documents)) for w, ds in train_blend],
            n_train,
            seq_length,
            seed,
            cache_dir,
        )
        valid = _blend(
            "valid",
            [(w, ds, (0, ds.num_documents)) for w, ds in valid_blend],
            n_valid,
            seq_length,
            seed,
            cache_dir,
        )
        return train, valid, None
    ranges = [ix.split_documents(ds.num_documents, data_cfg.split) for _, ds in train_blend]
    out = []
    for k, (name, n) in enumerate(zip(("train", "valid", "test"), (n_train, n_valid, n_test))):
        sources = [(w, ds, r[k]) for (w, ds), r in zip(train_blend, ranges)]
        out.append(_blend(name, sources, n, seq_length, seed, cache_dir))
    return tuple(out)
