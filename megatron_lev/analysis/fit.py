"""Refit the capacity constants to packing results `(k, d, eps*)` by non-linear least squares.

The adjusted and fitted forms take a log of `k/d` (resp. `k^a/d`), defined only for k > d;
for k <= d an exactly orthogonal packing exists (eps* = 0). So those forms are fitted on the
rows with k > d, and every form is scored (R^2) on all rows with its prediction clamped to 0
where its log argument is not positive; MAPE is over the rows with k > d (relative error
against eps* ~ 0 means nothing).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from megatron_lev.errors import DataError


class PackingError(DataError):
    """Packing results that cannot be fitted: unreadable, malformed, non-finite or too few rows."""


def _jl(p, k, d):
    return np.sqrt(p[0] * np.log(k) / d)


def _adjusted(p, k, d):
    return np.sqrt(p[0] * np.clip(np.log(k / d), 0.0, None) / d)


def _fitted(p, k, d):
    return np.sqrt(p[0] * np.clip(p[1] * np.log(k) - np.log(d), 0.0, None) ** p[2] / d ** p[3])


# form key -> (predict eps, parameter names, start point, rows it is fitted on)
FORMS = {
    "jl": (_jl, ("C",), (1.0,), lambda k, d: np.ones_like(k, dtype=bool)),
    "adjusted": (_adjusted, ("C",), (1.0,), lambda k, d: k > d),
    "fitted": (_fitted, ("C", "a", "b", "c"), (0.5, 1.05, 1.4, 0.97), lambda k, d: k > d),
}


def load_packing(path: str | Path) -> np.ndarray:
    """Rows `[k, d, eps*]` from a JSON list (the paper's sweep files and our sweep output).

    A row that is not three finite numbers with k, d > 0 and eps* >= 0 is refused, naming it.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PackingError(f"{path}: cannot read packing results ({exc})") from None
    if isinstance(data, dict):
        data = data.get("rows", [])
    if not isinstance(data, list) or not data:
        raise PackingError(f"{path}: expected a non-empty list of [k, d, eps*] rows")
    for i, row in enumerate(data):
        if (
            not isinstance(row, list)
            or len(row) != 3
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in row)
        ):
            raise PackingError(f"{path}: row {i} is {row!r}, expected [k, d, eps*] (three numbers)")
    arr = np.asarray(data, dtype=np.float64)
    bad = np.nonzero(~np.isfinite(arr).all(axis=1) | (arr[:, 0] <= 0) | (arr[:, 1] <= 0) | (arr[:, 2] < 0))[0]
    if len(bad):
        raise PackingError(
            f"{path}: row {int(bad[0])} is {data[int(bad[0])]!r}: k and d must be positive and "
            f"eps* finite and >= 0 ({len(bad)} bad row(s)); rerun the sweep or drop the row"
        )
    return arr


def refit(rows: np.ndarray, source: str = "packing rows") -> dict[str, dict]:
    """Fit every form; returns {form: {"params": {...}, "r2", "mape_percent", "n_fit", "n"}}."""
    k, d, eps = (np.asarray(c, dtype=np.float64) for c in np.asarray(rows).T)
    out = {}
    for key, (predict, names, start, domain) in FORMS.items():
        mask = domain(k, d)
        need = len(names)  # at least one row per constant
        if mask.sum() < need:
            where = "rows" if key == "jl" else "rows with k > d"
            raise PackingError(
                f"{source}: too few {where} to fit the {key} form: {int(mask.sum())}, need at "
                f"least {need}; add packing results (e.g. --sweep small)"
            )
        km, dm, em = k[mask], d[mask], eps[mask]
        with np.errstate(invalid="ignore"):  # trial points may leave the domain; lm backs off
            sol = least_squares(
                lambda p, km=km, dm=dm, em=em, f=predict: f(p, km, dm) - em,
                np.asarray(start),
                method="lm",
                xtol=1e-14,
                ftol=1e-14,
            )
        pred = predict(sol.x, k, d)
        r2 = 1.0 - float(((pred - eps) ** 2).sum() / ((eps - eps.mean()) ** 2).sum())
        rel = k > d
        mape = float(np.mean(np.abs(pred[rel] - eps[rel]) / eps[rel]) * 100)
        out[key] = {
            "params": dict(zip(names, map(float, sol.x))),
            "r2": r2,
            "mape_percent": mape,
            "n_fit": int(mask.sum()),
            "n": len(k),
        }
    return out


def fit_markdown(fits: dict[str, dict]) -> str:
    lines = ["| form | constants | R^2 | MAPE % | rows fitted |", "|---|---|---|---|---|"]
    for key, f in fits.items():
        consts = ", ".join(f"{n} = {v:.5g}" for n, v in f["params"].items())
        lines.append(
            f"| {key} | {consts} | {f['r2']:.4f} | {f['mape_percent']:.2f} | {f['n_fit']}/{f['n']} |"
        )
    return "\n".join(lines) + "\n"
