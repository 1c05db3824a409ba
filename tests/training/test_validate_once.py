"""One `megatron-lev train` validates its config once and derives the DeepSpeed JSON and the padded
vocabulary once (`plan`), however many modules the start-up passes through.

A real tiny run, in-process in a one-rank gloo group, with every rule and derivation wrapped in a
counter that calls the real function. Before `plan` the same run validated 4 times (and ran the
variant's `check_config` 4 times), built the DeepSpeed JSON 3 times, the batch layout 5 times, and
padded the vocabulary and checked it against the tokenizer twice each; and the tokenizer was built
and fingerprinted twice (the run's setup, then the shard checks).
"""

from __future__ import annotations

import collections
import functools
import sys
from pathlib import Path

import pytest

from tests.training.conftest import TINY, tiny_overrides

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

CASES = {
    # the vocabulary comes from the tokenizer: its rules run once the tokenizer is read
    "lev": {"model.embedding": "lev"},
    # model.vocab_size fixes the vocabulary: its rules run before, and the tokenizer is only checked
    "tied-fixed-vocab": {"model.embedding": "tied", "model.vocab_size": 50304},
}


def _counting(counts: collections.Counter, name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)

    return wrapper


def _replace_everywhere(original, wrapper) -> None:
    """Point every loaded module's name for `original` at `wrapper` (names bound by `from ... import` too)."""
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("megatron_lev"):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, wrapper)


def _count_one_train_run(prefix: str, tok: str, out: str) -> dict:
    """Run `megatron-lev train` for each case in this process; the calls counted per run."""
    import megatron_lev.commands.train  # noqa: F401  (load what a run loads before wrapping)
    import megatron_lev.data.tokenizers as tokenizers
    import megatron_lev.model.vocab as model_vocab
    import megatron_lev.plan as engine_plan
    import megatron_lev.plan.ds_config as engine_config
    import megatron_lev.training.run  # noqa: F401
    from megatron_lev.cli import main
    from megatron_lev.config import RunConfig
    from megatron_lev.model.embeddings import REGISTRY

    counts: collections.Counter = collections.Counter()
    RunConfig.validate = _counting(counts, "RunConfig.validate", RunConfig.validate)
    for module, name in (
        (engine_config, "build_ds_config"),
        (engine_config, "batch_layout"),
        (model_vocab, "padded_vocab_size"),
        (engine_plan, "check_vocab"),
        (tokenizers, "build_tokenizer"),
        (tokenizers, "tokenizer_fingerprint"),
    ):
        original = getattr(module, name)
        _replace_everywhere(original, _counting(counts, name, original))
    for cls in REGISTRY.values():  # the variant's own rules (classmethods)
        for rule in ("check_config", "check_vocab"):
            setattr(cls, rule, classmethod(_counting(counts, f"variant.{rule}", getattr(cls, rule).__func__)))

    results = {}
    for case, extra in CASES.items():
        counts.clear()
        overrides = tiny_overrides(prefix, tok, Path(out) / case, **{"train.train_iters": 2, **extra})
        code = main(["train", "--config", str(TINY), *overrides])
        results[case] = {"exit_code": code, "counts": dict(counts)}
    return results


@pytest.fixture(scope="module")
def counted(minipile_prefix, tokenizer_path, tmp_path_factory) -> dict:
    from megatron_lev.testing.distributed import run_distributed

    out = tmp_path_factory.mktemp("validate-once")
    (res,) = run_distributed(
        _count_one_train_run, world_size=1, args=(minipile_prefix, tokenizer_path, str(out)), timeout=300
    )
    return res


@pytest.mark.parametrize("case", list(CASES))
def test_one_train_run_validates_and_derives_once(counted, case):
    r = counted[case]
    assert r["exit_code"] == 0, r
    counts = collections.Counter(r["counts"])
    assert counts["RunConfig.validate"] == 1, counts  # was 4: load_config, the command, pretrain, build_model
    assert counts["build_ds_config"] == 1, counts  # was 3: the command and pretrain validating, the engine
    assert counts["batch_layout"] == 1, counts  # was 5; inside build_ds_config, the plan carries it
    assert counts["padded_vocab_size"] == 1, counts  # was 2: pretrain and build_model
    assert counts["check_vocab"] == 1, counts  # model.vocab_size against the tokenizer; was 2
    assert counts["variant.check_config"] == 1, counts  # was 4, with RunConfig.validate
    assert counts["variant.check_vocab"] == 1, counts
    # the tokenizer is read and fingerprinted once a start; the shard checks take that fingerprint
    assert counts["build_tokenizer"] == 1, counts  # was 2: the run's setup and the shard checks
    assert counts["tokenizer_fingerprint"] == 1, counts  # was 2 (3 with a separate validation set)
