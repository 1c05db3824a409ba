"""The eps experiment's page and plot, from its raw files and the regime's.

    write_eps_report("results/eps/raw", "docs/results/eps")

The outcomes are those `docs/results/eps/README.md` fixed before the runs: `D = LEV-EPS - LEV` on
validation targets rarer than 1e-7 (the paper's bucket; never seen in training on this split), with
the premise measured on LEV's final checkpoint (`output_rows.json`, `python -m studies rows`). The
regime's runs are read beside (`LEV-R`, `TIED-R`: `clip_report.CombinedRaw`'s names). Deterministic.
"""

from __future__ import annotations

from pathlib import Path

from megatron_lev.errors import DataError
from studies import regime_report as rr
from studies.clip_report import LEV_R, CombinedRaw, with_regime
from studies.output_rows import FILE as ROWS_FILE
from studies.plan_raw import COUNT_SCOPE, read_raw_json, save_plot, write_pages

PAGES = ("eps.md",)
LEV, LEV_EPS = "LEV", "LEV-EPS"
RARE_BUCKET = ("bucket", 0)  # the paper's < 1e-7: targets never seen in training on this split
PREMISE_SHARE = 0.3  # README: LEV's never-seen rows' median eps share at least this
CARRIES = 0.196  # README: half of LEV-C0 - LEV-R below 1e-7 (+0.391, seed 1234, ../clip/bands.md)
COMPARISONS = ((LEV_EPS, LEV), (LEV, LEV_R), (LEV_EPS, LEV_R))


def never_seen_share(raw: CombinedRaw, group: str) -> float | None:
    """The median eps share of band 0's rows at the group's seed-1234 final checkpoint, or None."""
    run = raw.seeds(group).get(1234)
    if run is None or run["source"] != "clip":
        return None
    path = raw.clip.root / run["name"] / ROWS_FILE
    if not path.is_file():
        return None
    band = next((b for b in read_raw_json(path)["bands"] if b["band"] == "0"), None)
    return band.get("eps_share_median") if band else None


def outcome(raw: CombinedRaw) -> tuple[str, list[str]]:
    """The README's outcome and the numbers it was read from."""
    share = never_seen_share(raw, LEV)
    first = raw.seeds(LEV).get(1234)
    buckets = (raw.result(first).get("buckets") or []) if first is not None else []
    if buckets and str(buckets[0].get("bucket")) != "< 1e-07":
        raise DataError(f"the first target bucket is {buckets[0].get('bucket')!r}, not '< 1e-07'")
    d = rr.comparison(raw, LEV_EPS, LEV, "mmidx", RARE_BUCKET)
    if share is None or d is None or d["mean"] is None or d["document"] is None:
        return "not available yet", [
            "LEV's output_rows.json, a run of LEV / LEV-EPS or D's interval is missing"
        ]
    lo = d["document"][0]
    reasons = [
        f"premise: LEV's never-seen rows' median eps share {share:.3f} (needs >= {PREMISE_SHARE})",
        f"D = LEV-EPS - LEV below 1e-7: {d['mean']:+.3f} document {rr._interval(d['document'])} "
        f"(carries at >= +{CARRIES:.3f})",
    ]
    if share < PREMISE_SHARE:  # README: "Below 0.3 the mechanism is refuted whatever D is"
        label = "not eps (the premise fails)"
    elif lo <= 0:
        label = "not eps"
    elif d["mean"] >= CARRIES:
        label = "eps carries the lead"
    else:
        label = "eps is part of it"
    same, why = reproduces_regime(raw)
    reasons.append(why)
    return (label if same else f"{label}, about this code's LEV only"), reasons


SAME_OVERALL = 0.01  # README: LEV - LEV-R within 0.01 nats overall ...


def reproduces_regime(raw: CombinedRaw) -> tuple[bool, str]:
    """The README's check that this code's LEV is the regime's: LEV - LEV-R within `SAME_OVERALL`
    overall, and its interval below 1e-7 including zero."""
    overall = rr.comparison(raw, LEV, LEV_R, "mmidx")
    rare = rr.comparison(raw, LEV, LEV_R, "mmidx", RARE_BUCKET)
    if overall is None or rare is None or overall["mean"] is None or rare["document"] is None:
        return False, "LEV - LEV-R: not available, so D is about this code's LEV only"
    lo, hi = rare["document"]
    same = abs(overall["mean"]) <= SAME_OVERALL and lo <= 0 <= hi
    return same, (
        f"LEV - LEV-R (this code's LEV against the regime's): overall {overall['mean']:+.3f}, below 1e-7 "
        f"{rare['mean']:+.3f} {rr._interval(rare['document'])}: "
        + ("the regime's LEV reproduced" if same else "not reproduced, so D is about this code's LEV only")
    )


def eps_markdown(raw: CombinedRaw) -> str:
    lines = ["# Adam's eps: results", ""]
    if preliminary := raw.preliminary():
        lines += [preliminary, ""]
    label, reasons = outcome(raw)
    lines += [
        f"**Outcome** (`README.md`'s, fixed before the runs): **{label}**.",
        "",
        *(f"- {r}" for r in reasons),
        "",
        "Validation shard, nats per predicted token, seed 1234, document bootstrap 95%. LEV and LEV-EPS "
        "ran on this code; LEV-R and TIED-R are the regime's runs (its clipping DeepSpeed's). "
        f"{COUNT_SCOPE}",
        "",
        "| comparison | target | tokens | difference | document 95% |",
        "|---|---|---|---|---|",
    ]
    first = raw.seeds(LEV).get(1234)
    result = raw.result(first) if first is not None else {}
    buckets = result.get("buckets") or []
    targets = [("overall", None, "-"), ("input 1-9", ("input_band", rr.RARE_BAND), "-")]
    targets += [(str(b["bucket"]), ("bucket", i), f"{b['tokens']:,}") for i, b in enumerate(buckets)]
    for a, b in COMPARISONS:
        for name, band, tokens in targets:
            c = rr.comparison(raw, a, b, "mmidx", band)
            if c is None or c["mean"] is None:
                continue
            lines.append(
                f"| {a} - {b} | {name} | {tokens} | {c['mean']:+.3f} | {rr._interval(c['document'])} |"
            )
    lines += ["", "The never-seen rows' eps share at each run's final checkpoint (`output_rows.json`):", ""]
    lines += ["| group | median eps share, band 0 |", "|---|---|"]
    for group in (LEV, LEV_EPS):
        share = never_seen_share(raw, group)
        lines.append(f"| {group} | {'-' if share is None else f'{share:.3f}'} |")
    return "\n".join(lines) + "\n"


def write_plot(raw: CombinedRaw, out: Path) -> None:
    """LEV-EPS - LEV and LEV - LEV-R by the paper's bucket, with their document intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = raw.seeds(LEV).get(1234)
    buckets = (raw.result(first).get("buckets") or []) if first is not None else []
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for k, (a, b) in enumerate(COMPARISONS[:2]):
        xs, ys, errs = [], [], [[], []]
        for i in range(len(buckets)):
            c = rr.comparison(raw, a, b, "mmidx", ("bucket", i))
            if c is None or c["mean"] is None:
                continue
            xs.append(i + (k - 0.5) * 0.25)
            ys.append(c["mean"])
            errs[0].append(c["mean"] - c["document"][0])
            errs[1].append(c["document"][1] - c["mean"])
        ax.errorbar(xs, ys, yerr=errs, fmt="o", capsize=3, label=f"{a} - {b}")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(buckets)), [str(b["bucket"]) for b in buckets])
    ax.set_xlabel("target's training frequency (the paper's buckets)")
    ax.set_ylabel("validation NLL difference (nats)")
    ax.legend(fontsize=8)
    save_plot(fig, out, "eps.png")


def write_eps_report(
    raw_dir: Path, out_dir: Path, plots: bool = True, regime_raw: Path | None = None
) -> dict[str, Path]:
    """`eps.md` (and `plots/eps.png`) from `raw_dir` (plan `eps`) and the regime's raw files."""
    raw = with_regime(raw_dir, regime_raw, "eps", LEV)
    out = Path(out_dir)
    paths = write_pages(out, {"eps.md": eps_markdown(raw)})
    if plots:
        write_plot(raw, out)
    return paths


__all__ = ["outcome", "write_eps_report"]
