"""The collected raw files of a `python -m studies` plan, read for the pilot's and the regime's reports,
and the paired document bootstrap their intervals use."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from megatron_lev.errors import DataError
from megatron_lev.utils.io import atomic_write_text
from studies.plans import get_plan, study_plan

BOOTSTRAP = 1000
BOOTSTRAP_SEED = 0
LEVEL = 0.95
# the input-table statistics the trainer logs as `input_table/<key>` (`training.dynamics.TABLE_KEYS`,
# repeated here so that the reports do not import torch; a test keeps the two equal)
TABLE_KEYS = ("rms", "mean_row_ratio", "effective_rank", "effective_rank_centred", "update_ratio")


# what a count band counts, said once on every page that uses the bands (`evaluate`'s `count_bands`)
COUNT_SCOPE = (
    "A band's count is the token's count in the whole training split, not how many times a run saw it: "
    "a run that stops before one pass over the split has seen each token only a share of that count."
)


def fmt_value(value, spec: str) -> str:
    """A table cell: `value` in `spec`, or "-" when it is missing or NaN."""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def read_raw_json(path: Path):
    """A raw JSON file; missing or damaged is one line naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{path}: missing from the raw results; run `python -m studies collect`") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: damaged ({' '.join(str(exc).split())}); collect it again") from None


def write_pages(out: Path, pages: dict[str, str]) -> dict[str, Path]:
    """Write each report page (name -> markdown) atomically under `out`; returns name -> path."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, text in pages.items():
        paths[name] = out / name
        atomic_write_text(paths[name], text)
    return paths


def save_plot(fig, out: Path, name: str) -> Path:
    """Write `fig` as `out/plots/<name>` (110 dpi) through a temporary file and a rename, and close it."""
    import os

    import matplotlib.pyplot as plt

    path = Path(out) / "plots" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{name}.tmp")
    fig.tight_layout()
    fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    os.replace(tmp, path)
    return path


def logged_rows(path: Path, kind: str) -> list[dict]:
    """The `kind` lines ("train", "valid") of a run's `metrics.jsonl`, one per iteration in order."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: missing from the raw results") from None
    rows = {}
    for line in lines:
        rec = json.loads(line)
        if rec.get("kind") == kind:
            rows[rec["iteration"]] = rec  # a resumed run's later line wins
    return [rows[k] for k in sorted(rows)]


class PlanRaw:
    """The collected runs of a plan (`study collect`) in plan order, with their results and logged
    dynamics read on demand."""

    def __init__(self, raw: Path):
        self.root = Path(raw)
        listing = read_raw_json(self.root / "study.json")
        plan = get_plan(listing.get("plan", "study"))
        self.plan = plan.name
        order = {g: i for i, (g, *_rest) in enumerate(plan.groups)}
        self.runs = sorted(listing["runs"], key=lambda r: (order.get(r["group"], len(order)), r["seed"]))
        self.by_name = {r["name"]: r for r in self.runs}
        self._cache: dict[tuple[str, str], object] = {}

    def missing(self) -> list[str]:
        """The plan's runs not collected here (yet), in plan order."""
        return [r.name for r in study_plan(self.plan) if r.name not in self.by_name]

    def preliminary(self) -> str | None:
        """The line a report page opens with while some of the plan's runs are not collected."""
        missing = self.missing()
        if not missing:
            return None
        return (
            f"**Preliminary**: {len(self.runs)} of the plan's {len(missing) + len(self.runs)} runs "
            f"collected; not yet: {', '.join(missing)}."
        )

    def groups(self) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for r in self.runs:
            out.setdefault(r["group"], []).append(r)
        return out

    def run(self, group: str, seed: int = 1234) -> dict | None:
        return next((r for r in self.runs if r["group"] == group and r["seed"] == seed), None)

    def result(self, run: dict, kind: str = "mmidx") -> dict:
        key = (run["name"], "eval")
        if key not in self._cache:
            data = read_raw_json(self.root / run["name"] / "eval.json")
            self._cache[key] = data.get("results", []) if isinstance(data, dict) else []
        found = next((r for r in self._cache[key] if r.get("corpus_kind") == kind), None)
        if found is None:
            raise DataError(f"{self.root / run['name'] / 'eval.json'}: no {kind} result")
        return found

    def _rows(self, run: dict, kind: str) -> list[dict]:
        key = (run["name"], kind)
        if key not in self._cache:
            self._cache[key] = logged_rows(self.root / run["name"] / "metrics.jsonl", kind)
        return self._cache[key]

    def train_rows(self, run: dict) -> list[dict]:
        """The run's logged training steps, by iteration."""
        return self._rows(run, "train")

    def valid_rows(self, run: dict) -> list[dict]:
        """The trainer's validation lines (`train.eval_interval`), by iteration."""
        return self._rows(run, "valid")

    def series(self, run: dict, key: str) -> tuple[list[int], list[float]]:
        """(iterations, values) of one logged training key over the run, where it was logged."""
        pts = [(r["iteration"], r[key]) for r in self.train_rows(run) if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    def at(self, run: dict, iteration: int) -> dict | None:
        return next((r for r in self.train_rows(run) if r["iteration"] == iteration), None)

    def scale(self, run: dict) -> tuple[int | None, int | None]:
        """(tokens trained, parameters) as the run's `metrics.jsonl` logged them: the last logged step's
        cumulative `tokens` and the `parameters` of its first start event; None where not logged."""
        tokens = next((r["tokens"] for r in reversed(self.train_rows(run)) if r.get("tokens")), None)
        events = self._rows(run, "event")
        params = next((e["parameters"] for e in events if e.get("parameters")), None)
        return tokens, params


def scale_phrase(tokens: int | None, parameters: int | None, seeds: str) -> str:
    """The scale a result rests on, for a page's sentence: "2.05M tokens a run, TIED's 11.4M parameters,
    one data sample, <seeds>" from a TIED run's logged tokens and parameters (`PlanRaw.scale`); a
    number not logged is left out."""
    parts = [f"{tokens / 1e6:.2f}M tokens a run"] if tokens else []
    parts += [f"TIED's {parameters / 1e6:.1f}M parameters"] if parameters else []
    return ", ".join([*parts, "one data sample", seeds])


def doc_arrays(result: dict, band: tuple[str, int] | None) -> tuple[np.ndarray, np.ndarray]:
    """Per-document predicted tokens and NLL sums of a result, overall or of one band
    (`("target_band", 1)`: the per-document sums `evaluate` writes for each count band)."""
    doc = result.get("per_document")
    if not doc:
        raise DataError(f"result {result.get('name', '?')}: no per-document sums (evaluate records them)")
    if band is None:
        return np.asarray(doc["tokens"], dtype=np.float64), np.asarray(doc["nll_sum"], dtype=np.float64)
    name, k = band
    if f"{name}_tokens" not in doc:
        raise DataError(f"result {result.get('name', '?')}: no {name} sums (evaluate with training counts)")
    return (
        np.asarray(doc[f"{name}_tokens"][k], dtype=np.float64),
        np.asarray(doc[f"{name}_nll_sum"][k], dtype=np.float64),
    )


def paired_differences(
    pairs: list[tuple[dict, dict]], band: tuple[str, int] | None = None
) -> tuple[list[float], tuple[float, float] | None]:
    """Mean NLL of `a` minus `b` for each pair (seed i against seed i, the same documents), and a 95%
    bootstrap interval over documents of the mean of those differences (one resample of the documents
    applied to every pair). The interval is None where a resample can hold no token of the band."""
    diffs, arrays = [], []
    for a, b in pairs:
        ta, na = doc_arrays(a, band)
        tb, nb = doc_arrays(b, band)
        if len(ta) != len(tb) or not np.array_equal(ta, tb):
            raise DataError("the two results have no per-document sums over the same documents")
        if ta.sum() == 0:
            return [], None
        diffs.append(float((na.sum() - nb.sum()) / ta.sum()))
        arrays.append((ta, na - nb))
    return diffs, _bootstrap(arrays)


def _bootstrap(arrays: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, float] | None:
    """The 95% interval of the mean over `arrays` (per-document tokens and NLL sums of a difference,
    one per seed) of token-weighted means, over `BOOTSTRAP` resamples of the documents (one resample
    applied to every seed); None where a resample holds no token."""
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    idx = rng.integers(0, len(arrays[0][0]), size=(BOOTSTRAP, len(arrays[0][0])))
    stats = np.zeros(BOOTSTRAP)
    for tokens, diff in arrays:
        t = tokens[idx].sum(axis=1)
        if (t == 0).any():
            return None
        stats += diff[idx].sum(axis=1) / t
    stats /= len(arrays)
    lo, hi = np.quantile(stats, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return float(lo), float(hi)


def paired_interval(a: dict, b: dict) -> tuple[float, float, float]:
    """Mean NLL of `a` minus that of `b` over the same documents, with a 95% bootstrap interval over
    documents."""
    diffs, interval = paired_differences([(a, b)])
    if interval is None:
        raise DataError("no tokens to compare")
    return diffs[0], interval[0], interval[1]


T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}  # Student t, two-sided 95%, by df


def seed_interval(diffs: list[float]) -> tuple[float, float] | None:
    """The seed-paired 95% Student-t interval of the mean difference (None for one seed)."""
    n = len(diffs)
    if n < 2 or n - 1 not in T_975:
        return None
    mean = sum(diffs) / n
    sd = (sum((d - mean) ** 2 for d in diffs) / (n - 1)) ** 0.5
    half = T_975[n - 1] * sd / n**0.5
    return mean - half, mean + half


def seed_contrasts(
    sets: list[list[tuple[float, dict]]], band: tuple[str, int] | None = None
) -> tuple[list[float], tuple[float, float] | None]:
    """A signed combination of results per seed (`sets[i]`: `[(+1, a), (-1, b), ...]` of seed i, all
    over the same documents): each seed's value `sum(sign x mean NLL)` over the band, and a 95%
    bootstrap interval over documents of their mean (one resample of the documents applied to every
    seed and term), as `paired_differences` does for one pair."""
    values, arrays = [], []
    for terms in sets:
        tokens, combined = None, None
        for sign, result in terms:
            t, n = doc_arrays(result, band)
            if tokens is None:
                tokens, combined = t, sign * n
            elif len(t) != len(tokens) or not np.array_equal(t, tokens):
                raise DataError("the results have no per-document sums over the same documents")
            else:
                combined = combined + sign * n
        if tokens is None or tokens.sum() == 0:
            return [], None
        values.append(float(combined.sum() / tokens.sum()))
        arrays.append((tokens, combined))
    if not arrays:
        return [], None
    return values, _bootstrap(arrays)
