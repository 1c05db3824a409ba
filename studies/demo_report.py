"""The demo's LEV under two settings, side by side: `docs/results/demo/settings.md` from the demo's
own summaries (`results/demo/raw/<setting>/summary.json` and the resolved `config.yaml`).

python -m studies.demo_report results/demo/raw docs/results/demo
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

SETTINGS = {  # raw directory -> what it is
    "spec": "the spec's LEV (`centre_reference: 0`, `seed_lr_mult: 1`)",
    "experiments": "the experiments' LEV (`centre_reference: 256`, `seed_lr_mult: 0.1`), now in `tiny.yaml`",
}


def _row(raw: Path) -> dict:
    summary = json.loads((raw / "summary.json").read_text())
    lev = yaml.safe_load((raw / "config.yaml").read_text())["model"]["lev"]
    table = summary["input_table"]
    inp = next(c for c in summary["capacity"] if c["name"].startswith("hf:input"))
    ppl = summary["evaluation"]["perplexity"] if "evaluation" in summary else None
    return {
        "centre_reference": lev["centre_reference"],
        "seed_lr_mult": lev["seed_lr_mult"],
        "iterations": summary["iterations"],
        "train_loss_last": summary["train_loss_last"],
        "valid_loss_last": summary["valid_loss_last"],
        "perplexity": ppl,
        "mean_row_ratio": table["mean_row_ratio"],
        "effective_rank_centred": table["effective_rank_centred"],
        "effective_rank": table["effective_rank"],
        "input_eps": inp["eps"],
        "input_class": inp["class"],
    }


def report(raw: Path) -> str:
    rows = {name: _row(raw / name) for name in SETTINGS}
    lines = [
        "# The demo's LEV: the spec's setting and the experiments'",
        "",
        "`make demo` (2 processes, 300 steps, tiny config, seed 1234) with each setting; the numbers are the "
        "demo's own summary (`results/demo/raw/<setting>/summary.json`). One run each: no interval.",
        "",
        "| setting | centre_reference | seed_lr_mult | last train loss | validation loss "
        "| held-out perplexity | mean-row ratio | effective rank (centred) | effective rank "
        "| input capacity eps |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        ppl = "-" if r["perplexity"] is None else f"{r['perplexity']:.1f}"
        lines.append(
            f"| {name} | {r['centre_reference']} | {r['seed_lr_mult']:g} | {r['train_loss_last']:.3f} "
            f"| {r['valid_loss_last']:.3f} | {ppl} | {r['mean_row_ratio']:.3f} "
            f"| {r['effective_rank_centred']:.1f} | {r['effective_rank']:.1f} "
            f"| {r['input_eps']:.3f} ({r['input_class']}) |"
        )
    lines += ["", *(f"- `{name}`: {about}" for name, about in SETTINGS.items()), ""]
    return "\n".join(lines)


def write(raw: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "settings.md"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(report(raw))
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.exit("usage: python -m studies.demo_report RAW_DIR OUT_DIR (results/demo/raw docs/results/demo)")
    print(f"wrote {write(Path(args[0]), Path(args[1]))}")


if __name__ == "__main__":
    main()
