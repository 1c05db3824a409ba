"""Text to MMIDIDX shards with workers that tokenise and write their own partial shards.

The main process only splits the input into chunks of raw lines (a bounded queue
keeps memory at workers x chunk); each worker parses, tokenises, appends EOD and
streams tokens to its own part files; a final merge stream-copies the parts in
input order into the outputs (one per Pile subset if asked, split into shards by
size). The output is therefore identical for any number of workers.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_lev.config import atomic_write_json
from megatron_lev.data.indexed import IndexedDataset, IndexedDatasetBuilder, best_dtype
from megatron_lev.data.readers import Chunk, Problem, check_text, find_inputs, iter_chunks, parse_line
from megatron_lev.data.tokenizers import build_tokenizer

UNKNOWN_SUBSET = "unknown"


@dataclass
class PreprocessOptions:
    inputs: list[str]
    output_prefix: str
    tokenizer_type: str
    tokenizer_path: str
    json_key: str = "text"
    workers: int = 1
    split_by_subset: bool = False  # one output per meta.pile_set_name
    shard_size_mb: float | None = None  # split each output into shards of about this size
    chunk_bytes: int = 1 << 20  # input bytes per work item
    progress: bool = True
    max_error_records: int = 1000  # problems listed by file and line in the stats (all are counted)


@dataclass
class ChunkResult:
    chunk_id: int
    parts: list  # (subset, part prefix, first sequence, count)
    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    subsets: dict = field(default_factory=dict)  # subset -> [documents, tokens]
    problems: list = field(default_factory=list)


class _Worker:
    """Tokenises chunks and appends them to this worker's part shards (one per subset)."""

    def __init__(self, opts: PreprocessOptions, part_dir: Path, worker_id: int, tokenizer=None):
        self.opts = opts
        self.tok = tokenizer or build_tokenizer(opts.tokenizer_type, opts.tokenizer_path)
        self.dtype = best_dtype(self.tok.vocab_size)
        self.part_dir, self.worker_id = part_dir, worker_id
        self.builders: dict[str, IndexedDatasetBuilder] = {}
        self.counts = np.zeros(self.tok.vocab_size, dtype=np.int64)

    def process(self, chunk: Chunk) -> ChunkResult:
        res = ChunkResult(chunk.chunk_id, [])
        texts, subsets = [], []
        for i, item in enumerate(chunk.lines):
            if chunk.records:
                (text, subset), err = item, check_text(item[0])
            else:
                text, subset, err = parse_line(item, self.opts.json_key)
                err = err or check_text(text)
            if err:
                kind, _, msg = err.partition(": ")
                res.problems.append(Problem(chunk.file, chunk.first_line + i, kind, msg))
                continue
            texts.append(text)
            subsets.append(subset or UNKNOWN_SUBSET)
            res.text_bytes += len(text)
        if not texts:
            return res
        ids = self.tok.encode_batch(texts)
        eod = self.tok.eod
        groups: dict[str, list[int]] = {}
        for j, s in enumerate(subsets):
            ids[j].append(eod)
            groups.setdefault(s if self.opts.split_by_subset else "", []).append(j)
        for key, members in groups.items():
            arrays = [np.asarray(ids[j], dtype=np.int64) for j in members]  # C-level list conversion
            sizes = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
            flat = np.concatenate(arrays)
            self.counts += np.bincount(flat, minlength=len(self.counts))[: len(self.counts)]
            builder = self._builder(key)
            first = builder.num_sequences
            builder.add_raw(flat.astype(self.dtype).tobytes(), sizes)
            res.parts.append((key, builder.prefix, first, len(members)))
        for j, s in enumerate(subsets):
            entry = res.subsets.setdefault(s, [0, 0])
            entry[0] += 1
            entry[1] += len(ids[j])
        res.documents = len(texts)
        res.tokens = sum(len(x) for x in ids)
        return res

    def _builder(self, key: str) -> IndexedDatasetBuilder:
        if key not in self.builders:
            slug = "".join(c if c.isalnum() else "_" for c in key) or "all"
            self.builders[key] = IndexedDatasetBuilder(self.part_dir / f"w{self.worker_id}_{slug}", self.dtype)
        return self.builders[key]

    def finish(self) -> np.ndarray:
        for b in self.builders.values():
            b.finalize()
        return self.counts


def _worker_main(opts: PreprocessOptions, part_dir: Path, worker_id: int, in_q, out_q) -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one core per worker; the pool gives parallelism
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        worker = _Worker(opts, part_dir, worker_id)
        while (chunk := in_q.get()) is not None:
            out_q.put(("chunk", worker.process(chunk)))
        out_q.put(("done", worker.finish()))
    except BaseException:
        out_q.put(("error", f"worker {worker_id}:\n{traceback.format_exc()}"))


class _Progress:
    """Counts and a tqdm bar with docs/s, MB/s and tokens/s."""

    def __init__(self, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(unit=" docs", disable=not enabled, smoothing=0.1, dynamic_ncols=True)
        self.start = time.monotonic()
        self.docs = self.tokens = self.bytes = 0

    def update(self, res: ChunkResult) -> None:
        self.docs += res.documents
        self.tokens += res.tokens
        self.bytes += res.text_bytes
        dt = max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.bytes / dt / 1e6:.1f} MB/s, {self.tokens / dt / 1e3:.0f}k tok/s",
                                 refresh=False)
        self.bar.update(res.documents)


def preprocess(opts: PreprocessOptions) -> dict:
    """Run the whole pipeline; returns the statistics also written to `<prefix>.stats.json`."""
    files = find_inputs(opts.inputs)
    tok = build_tokenizer(opts.tokenizer_type, opts.tokenizer_path)
    out_prefix = Path(opts.output_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    part_dir = out_prefix.parent / f".{out_prefix.name}.parts.{os.getpid()}"
    part_dir.mkdir(parents=True, exist_ok=True)
    problems: list[Problem] = []
    results: list[ChunkResult] = []
    progress = _Progress(opts.progress)
    counts = np.zeros(tok.vocab_size, dtype=np.int64)
    try:
        if opts.workers <= 1:
            worker = _Worker(opts, part_dir, 0, tok)
            for chunk in iter_chunks(files, problems, opts.chunk_bytes, opts.json_key):
                results.append(worker.process(chunk))
                progress.update(results[-1])
            counts += worker.finish()
        else:
            counts += _run_pool(opts, files, part_dir, problems, results, progress, tok.vocab_size)
        progress.bar.close()
        results.sort(key=lambda r: r.chunk_id)
        outputs = _merge(opts, results, best_dtype(tok.vocab_size))
        stats = _stats(opts, files, tok, results, problems, outputs, time.monotonic() - progress.start)
        tmp = out_prefix.parent / f".{out_prefix.name}.counts.npy.tmp.{os.getpid()}.npy"
        np.save(tmp, counts)
        os.replace(tmp, f"{out_prefix}.counts.npy")
        atomic_write_json(f"{out_prefix}.stats.json", stats)
        return stats
    finally:
        progress.bar.close()
        shutil.rmtree(part_dir, ignore_errors=True)


def _run_pool(opts, files, part_dir, problems, results, progress, vocab_size: int) -> np.ndarray:
    """Feed chunks to worker processes through a bounded queue; returns the summed token counts."""
    ctx = mp.get_context("spawn")
    in_q, out_q = ctx.Queue(maxsize=2 * opts.workers), ctx.Queue()
    procs = [ctx.Process(target=_worker_main, args=(opts, part_dir, w, in_q, out_q), daemon=True)
             for w in range(opts.workers)]
    for p in procs:
        p.start()
    counts = np.zeros(vocab_size, dtype=np.int64)
    done = 0

    def drain(block: bool) -> None:
        nonlocal done, counts
        while True:
            try:
                kind, payload = out_q.get(timeout=0.5) if block else out_q.get_nowait()
            except queue.Empty:
                if block and not any(p.is_alive() for p in procs):
                    raise RuntimeError("preprocessing workers died without reporting (out of memory?)") from None
                return
            if kind == "error":
                raise RuntimeError(f"preprocessing failed in {payload}")
            if kind == "done":
                counts += payload
                done += 1
            else:
                results.append(payload)
                progress.update(payload)
            if block:
                return

    try:
        for chunk in iter_chunks(files, problems, opts.chunk_bytes, opts.json_key):
            while True:
                try:
                    in_q.put(chunk, timeout=0.2)
                    break
                except queue.Full:
                    drain(block=False)
            drain(block=False)
        for _ in procs:
            in_q.put(None)
        while done < len(procs):
            drain(block=True)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return counts


def _merge(opts: PreprocessOptions, results: list[ChunkResult], dtype) -> list[str]:
    """Stream-copy the workers' parts, in input order, into the final (sharded) outputs."""
    by_key: dict[str, list] = {}
    for res in results:
        for key, part, first, count in res.parts:
            by_key.setdefault(key, []).append((part, first, count))
    if not by_key and not opts.split_by_subset:
        by_key[""] = []
    limit = int(opts.shard_size_mb * 1e6) if opts.shard_size_mb else None
    opened: dict[str, IndexedDataset] = {}
    outputs: list[str] = []
    for key in sorted(by_key):
        base = f"{opts.output_prefix}_{key}" if opts.split_by_subset else str(opts.output_prefix)
        shard = 0
        name = (lambda s, b=base: f"{b}_{s:05d}") if limit else (lambda s, b=base: b)
        builder = IndexedDatasetBuilder(name(shard), dtype)
        for part, first, count in by_key[key]:
            ds = opened.setdefault(part, IndexedDataset(part))
            while count > 0:
                if limit is None:
                    take = count
                else:
                    nbytes = np.cumsum(ds.sizes[first:first + count], dtype=np.int64) * dtype.itemsize
                    take = int(np.searchsorted(nbytes, limit - builder.num_bytes, side="right"))
                    if take == 0 and builder.num_sequences:
                        builder.finalize()
                        outputs.append(builder.prefix)
                        shard += 1
                        builder = IndexedDatasetBuilder(name(shard), dtype)
                        continue
                    take = max(take, 1)
                builder.copy_range(ds, first, take)
                first, count = first + take, count - take
        builder.finalize()
        outputs.append(builder.prefix)
    return outputs


def _stats(opts, files, tok, results, problems, outputs, seconds) -> dict:
    problems = list(problems) + [p for r in results for p in r.problems]
    errors: dict[str, int] = {}
    for p in problems:
        errors[p.kind] = errors.get(p.kind, 0) + 1
    subsets: dict[str, dict] = {}
    for r in results:
        for s, (d, t) in r.subsets.items():
            e = subsets.setdefault(s, {"documents": 0, "tokens": 0})
            e["documents"] += d
            e["tokens"] += t
    docs = sum(r.documents for r in results)
    tokens = sum(r.tokens for r in results)
    return {
        "inputs": files, "outputs": outputs, "tokenizer": tok.name, "vocab_size": tok.vocab_size,
        "eod": tok.eod, "dtype": best_dtype(tok.vocab_size).name, "json_key": opts.json_key,
        "documents": docs, "tokens": tokens, "text_bytes": sum(r.text_bytes for r in results),
        "subsets": dict(sorted(subsets.items())), "errors": dict(sorted(errors.items())),
        "error_count": len(problems), "problems": [p.to_dict() for p in problems[: opts.max_error_records]],
        "workers": opts.workers, "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / max(seconds, 1e-9), 1),
    }
