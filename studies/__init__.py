"""The research workbench: the study runner, its plans and the per-study report writers.

Not part of the `megatron_lev` package (nor of its wheel): it drives the library's commands from a
checkout, and only reads what they write. Run from the repository's root:

    python -m studies plan --plan clip
    python -m studies run --plan clip --data-dir DIR --tokenizer FILE --out runs/clip --lanes 2
    python -m studies collect runs/clip results/clip/raw
    python -m studies report results/clip/raw docs/results/clip

- `plans.py`: the plans (`PLANS`: study, pilot, regime, order, clip), their runs and lanes;
- `runner.py`: running a plan on resumable lanes;
- `collect.py`: copying the finished runs' small raw files into `results/<study>/raw/`;
- `plan_raw.py`: reading those raw files; `study_report.py`, `pilot_report.py`, `regime_report.py`
  (also the order plan's page) and `clip_report.py`: the pages of `docs/results/<study>/`.
"""
