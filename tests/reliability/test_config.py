"""Config validation and the lighter commands on bad input: every case exits non-zero with one line
naming the key, file or flag, and leaves nothing behind (no saved config, no output directory)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from megatron_lev.config import RunConfig, load_config, numeric_keys, ranges
from megatron_lev.errors import ConfigError
from tests.reliability.harness import ROOT, expect_error, expect_ok, run_cli

# --------------------------------------------------------------------------- numeric ranges

# (override, fragments of the error line); each is refused by `megatron-lev config` with exit 2
RANGE_CASES = [
    # absurd sizes that used to pass `config` (the memory estimate judges what lies below the caps)
    ("model.hidden_size=1048576", [r"model\.hidden_size=1048576", r"<= 65536"]),
    ("model.seq_length=1000000000", [r"model\.seq_length=1000000000", r"<= 4194304", r"memory estimate"]),
    ("train.lr=1e9", [r"train\.lr=1000000000\.0", r"> 0 and <= 1\b"]),
    ("train.lr=2", [r"train\.lr=2\.0", r"<= 1\b"]),
    ("model.num_layers=100000", [r"model\.num_layers=100000", r"<= 4096"]),
    ("train.micro_batch_size=1000000", [r"train\.micro_batch_size=1000000", r"<= 65536"]),
    ("model.vocab_size=1000000000", [r"model\.vocab_size=1000000000", r"<= 16777216"]),
    ("train.lr=inf", [r"train\.lr=inf", r"> 0"]),
    ("train.lr=.nan", [r"train\.lr=nan", r"finite"]),
    ("train.lr=0", [r"train\.lr=0", r"> 0"]),
    ("train.weight_decay=nan", [r"train\.weight_decay=nan", r">= 0"]),
    ("train.weight_decay=-0.1", [r"train\.weight_decay=-0\.1", r">= 0"]),
    ("model.rope_theta=0", [r"model\.rope_theta=0", r"> 0"]),
    ("model.rope_theta=-inf", [r"model\.rope_theta=-inf"]),
    ("model.norm_eps=-1", [r"model\.norm_eps=-1", r"> 0"]),
    ("model.norm_eps=0", [r"model\.norm_eps=0", r"> 0"]),
    ("model.init_std=nan", [r"model\.init_std=nan", r"> 0"]),
    ("model.init_std=0", [r"model\.init_std=0"]),
    ("model.input_init_rms=0", [r"model\.input_init_rms=0", r"> 0"]),
    ("model.input_init_rms=nan", [r"model\.input_init_rms=nan", r"finite"]),
    ("train.train_iters=-5", [r"train\.train_iters=-5", r"integer >= 1"]),
    ("train.train_iters=0", [r"train\.train_iters=0", r">= 1"]),
    ("train.train_tokens=-1", [r"train\.train_tokens=-1", r">= 1"]),
    ("train.lr_warmup_iters=-1", [r"train\.lr_warmup_iters=-1", r">= 0"]),
    ("train.lr_warmup_fraction=1", [r"train\.lr_warmup_fraction=1", r"\[0, 1\)"]),
    ("train.min_lr=nan", [r"train\.min_lr=nan", r">= 0"]),
    ("train.min_lr=0.1", [r"train\.min_lr=0\.1 is above train\.lr"]),
    ("train.adam_beta1=1.5", [r"train\.adam_beta1=1\.5", r"\[0, 1\)"]),
    ("train.adam_beta2=-0.1", [r"train\.adam_beta2=-0\.1", r"\[0, 1\)"]),
    ("train.adam_beta2=1", [r"train\.adam_beta2=1", r"\[0, 1\)"]),
    ("train.adam_eps=0", [r"train\.adam_eps=0", r"> 0"]),
    ("train.clip_grad=-1", [r"train\.clip_grad=-1", r">= 0"]),
    ("train.clip_grad=inf", [r"train\.clip_grad=inf"]),
    ("train.seed=-1", [r"train\.seed=-1", r"\[0, 4294967295\]"]),
    ("data.seed=4294967296", [r"data\.seed=4294967296", r"\[0, 4294967295\]"]),
    ("data.num_workers=-1", [r"data\.num_workers=-1", r">= 0"]),
    ("train.micro_batch_size=0", [r"train\.micro_batch_size=0", r">= 1"]),
    ("train.global_batch_size=-8", [r"train\.global_batch_size=-8", r">= 1"]),
    ("train.save_interval=-1", [r"train\.save_interval=-1", r">= 0"]),
    ("train.eval_interval=-10", [r"train\.eval_interval=-10", r">= 0"]),
    ("train.keep_last=0", [r"train\.keep_last=0", r">= 1"]),
    ("train.eval_iters=0", [r"train\.eval_iters=0"]),
    ("train.max_consecutive_skips=-1", [r"train\.max_consecutive_skips=-1"]),
    ("train.max_update_ratio=1", [r"train\.max_update_ratio=1", r"> 1", "null to turn the check off"]),
    ("train.max_update_ratio=.nan", [r"train\.max_update_ratio=nan", r"finite"]),
    ("logging.peak_tflops=inf", [r"logging\.peak_tflops=inf", r"> 0"]),
    ("logging.log_interval=0", [r"logging\.log_interval=0", r">= 1"]),
    ("model.num_layers=0", [r"model\.num_layers=0", r">= 1"]),
    ("model.seq_length=-128", [r"model\.seq_length=-128"]),
    ("model.num_kv_heads=0", [r"model\.num_kv_heads=0", r"null"]),
    ("model.ffn_hidden_size=-64", [r"model\.ffn_hidden_size=-64", r"null"]),
    ("model.vocab_size=0", [r"model\.vocab_size=0"]),
    ("model.baseline_dim=0", [r"model\.baseline_dim=0"]),
    ("model.baseline_hidden=-1", [r"model\.baseline_hidden=-1"]),
    ("model.min_compressed_width=0", [r"model\.min_compressed_width=0", r">= 1"]),
    ("model.make_vocab_size_divisible_by=0", [r"model\.make_vocab_size_divisible_by=0"]),
    ("model.hidden_dropout=1", [r"model\.hidden_dropout=1", r"\[0, 1\)"]),
    ("model.attention_dropout=nan", [r"model\.attention_dropout=nan"]),
    ("model.checkpoint_num_layers=0", [r"model\.checkpoint_num_layers=0"]),
    ("model.lev.kappa=2", [r"model\.lev\.kappa=2", r">= 3", r"knots"]),
    ("model.lev.k=0", [r"model\.lev\.k=0"]),
    ("model.lev.rank=-4", [r"model\.lev\.rank=-4"]),
    ("model.lev.w_out_init_scale=nan", [r"model\.lev\.w_out_init_scale=nan", r">= 0"]),
    ("parallel.tensor_model_parallel_size=0", [r"parallel\.tensor_model_parallel_size=0", r">= 1"]),
    ("parallel.pipeline_model_parallel_size=-1", [r"parallel\.pipeline_model_parallel_size=-1"]),
    ("parallel.zero_stage=4", [r"parallel\.zero_stage=4", r"\[0, 3\]"]),
    ("parallel.collective_timeout_s=0", [r"parallel\.collective_timeout_s=0", r">= 1"]),
    ("parallel.collective_timeout_s=inf", [r"parallel\.collective_timeout_s=inf", r"finite"]),
    ("parallel.heartbeat_timeout_s=-1", [r"parallel\.heartbeat_timeout_s=-1", r">= 0", r"off"]),
    ("parallel.heartbeat_timeout_s=0.5", [r"parallel\.heartbeat_timeout_s=0\.5 is too short", r"0 to turn"]),
]

# values that are not numbers or ranges but would explode later: (overrides, fragments)
SHAPE_CASES = [
    pytest.param(["data.split=1,2"], [r"data\.split='1,2'", r"three"], id="split-two-parts"),
    pytest.param(["data.split=a,b,c"], [r"data\.split='a,b,c'", r"numbers"], id="split-words"),
    pytest.param(["data.split=nan,1,1"], [r"data\.split='nan,1,1'", r"finite"], id="split-nan"),
    pytest.param(["data.split=0,0,0"], [r"data\.split='0,0,0'", r"positive sum"], id="split-all-zero"),
    pytest.param(["data.split=1,-1,0"], [r"data\.split='1,-1,0'", r"non-negative"], id="split-negative"),
    pytest.param(
        ["data.data_path=[x, y]"], [r"data\.data_path\[0\]='x' is not a weight"], id="blend-no-weight"
    ),
    pytest.param(
        ["data.data_path=[0.5, a, 0.5]"],
        [r"data\.data_path", r"alternate weight and prefix"],
        id="blend-odd-length",
    ),
    pytest.param(
        ["data.data_path=[-1, a, 2, b]"], [r"data\.data_path\[0\]='-1'", r">= 0"], id="blend-negative"
    ),
    pytest.param(
        ["data.data_path=[inf, a, 1, b]"], [r"data\.data_path\[0\]='inf'", r"finite"], id="blend-inf"
    ),
    pytest.param(
        ["data.data_path=[0, a, 0, b]"], [r"data\.data_path", r"every blend weight is 0"], id="blend-all-zero"
    ),
    pytest.param(
        ["data.valid_data_path=['']"],
        [r"data\.valid_data_path\[0\] is an empty string"],
        id="valid-path-empty",
    ),
    pytest.param(
        ["data.tokenizer_path=''"], [r"data\.tokenizer_path is an empty string"], id="tokenizer-empty"
    ),
    pytest.param(["train.save=' '"], [r"train\.save is an empty string"], id="save-blank"),
    pytest.param(
        ["logging.output_dir=''"], [r"logging\.output_dir is an empty string"], id="output-dir-empty"
    ),
    pytest.param(
        ["model.hidden_size=96", "model.num_attention_heads=32"],
        [r"model\.hidden_size / model\.num_attention_heads = 3", r"even head width"],
        id="odd-head-width",
    ),
    pytest.param(
        ["model.embedding=flat_mlp", "model.vocab_size=50277"],
        [
            r"model\.embedding=flat_mlp: its table width e \(model\.baseline_dim\) is 12",
            r"below model\.min_compressed_width=16",
            r"padded vocabulary 50,304",
            r"model\.lev\.heads=11 or more",
        ],
        id="compressed-baseline-too-narrow",
    ),
    pytest.param(["--world-size", "0"], [r"world size 0", r">= 1"], id="world-size-zero"),
    pytest.param(["--world-size", "-2"], [r"world size -2"], id="world-size-negative"),
]


@pytest.mark.parametrize("override,fragments", [pytest.param(o, f, id=o) for o, f in RANGE_CASES])
def test_out_of_range_values_are_refused_before_anything_is_written(override, fragments, tmp_path, capsys):
    save = tmp_path / "saved"
    outcome = run_cli(["config", override, "--save", save], capsys)
    expect_error(outcome, *fragments, r"must be|above", rc=2)
    assert not save.exists(), "a refused config was saved"
    assert outcome.out == "", "a refused config was printed"


@pytest.mark.parametrize("args,fragments", SHAPE_CASES)
def test_malformed_values_are_one_line_naming_the_key(args, fragments, tmp_path, capsys):
    save = tmp_path / "saved"
    outcome = run_cli(["config", *args, "--save", save], capsys)
    expect_error(outcome, *fragments, rc=2)
    assert not save.exists()


def test_every_numeric_key_has_a_rule_that_refuses_non_finite_and_below_range_values():
    rules = ranges()  # read from the sections' fields
    assert sorted(numeric_keys()) == sorted(rules), "a numeric config key without a range rule"
    defaults = RunConfig().to_dict()
    for key, rule in rules.items():
        section = defaults
        for part in key.split(".")[:-1]:
            section = section[part]
        is_float = isinstance(section[key.split(".")[-1]], float)
        below = rule.lo - 1 if not rule.lo_open else rule.lo
        bad = [below] + ([math.nan, math.inf] if is_float else [])
        for value in bad:
            with pytest.raises(ConfigError, match=re.escape(key) + "=.*out of range"):
                load_config([], [f"{key}={value}"])


def test_every_cap_refuses_the_value_above_it_and_accepts_itself():
    """The sanity caps (`Range.cap`) refuse absurd values and keep the cap itself (and so every
    real run below it)."""
    capped = {key: rule for key, rule in ranges().items() if rule.cap is not None}
    assert {"model.hidden_size", "model.seq_length", "train.lr", "model.num_layers"} <= capped.keys()
    for key, rule in capped.items():
        above = rule.cap * 2
        with pytest.raises(ConfigError, match=re.escape(key) + r"=.*out of range.*<= "):
            load_config([], [f"{key}={above}"])
        assert rule.contains(rule.cap)


def test_shipped_configs_and_boundary_values_still_validate():
    from megatron_lev.plan import validate_config

    for path in sorted((ROOT / "pretrain" / "configs").rglob("*.yaml")):
        load_config([path])
    boundary = load_config(
        [],
        [
            "train.lr_warmup_iters=0",
            "train.clip_grad=0",
            "train.weight_decay=0",
            "data.num_workers=0",
            "model.lev.w_out_init_scale=0",
            "train.seed=0",
            "data.seed=4294967295",
            "train.min_lr=0",
            "parallel.zero_stage=0",
            "model.hidden_dropout=0.5",
            "data.data_path=[0.5, a, 0, b]",
            "train.save=null",
            "model.num_kv_heads=null",
            "model.input_init_rms=null",
            "model.input_init_rms=1e-3",
            "model.lev.centred=true",
        ],
        validate=False,
    )
    validate_config(boundary, 1)  # the generic rules, the variant's and world 1's layout


# --------------------------------------------------------------------------- YAML files and includes

YAML_CASES = [
    # (id, files to write {name: bytes}, file given as --config, fragments)
    (
        "include-cycle",
        {"a.yaml": b"include: b.yaml\n", "b.yaml": b"include: a.yaml\n"},
        "a.yaml",
        [r"include cycle", r"a\.yaml -> .*b\.yaml -> .*a\.yaml"],
    ),
    (
        "include-self",
        {"a.yaml": b"include: a.yaml\nmodel:\n  num_layers: 2\n"},
        "a.yaml",
        [r"include cycle", r"a\.yaml -> .*a\.yaml"],
    ),
    (
        "include-cycle-three",
        {"a.yaml": b"include: [b.yaml]\n", "b.yaml": b"include: c.yaml\n", "c.yaml": b"include: ./a.yaml\n"},
        "a.yaml",
        [r"include cycle", r"c\.yaml"],
    ),
    (
        "include-missing",
        {"a.yaml": b"include: nope.yaml\n"},
        "a.yaml",
        [r"a\.yaml: included file not found", r"nope\.yaml"],
    ),
    (
        "include-not-a-name",
        {"a.yaml": b"include: 5\n"},
        "a.yaml",
        [r"a\.yaml", r"'include' must be a file name"],
    ),
    (
        "include-directory",
        {"a.yaml": b"include: sub\n", "sub/x.yaml": b"model: {}\n"},
        "a.yaml",
        [r"sub \(included by .*a\.yaml\) is a directory"],
    ),
    (
        "included-binary",
        {"a.yaml": b"include: b.yaml\n", "b.yaml": b"\x00\x01\x02binary"},
        "a.yaml",
        [r"b\.yaml \(included by .*a\.yaml\) is binary"],
    ),
    ("binary", {"a.yaml": b"\xff\xfe\x00\x01binary"}, "a.yaml", [r"a\.yaml is not a UTF-8 text file"]),
    ("latin-1", {"a.yaml": b"model:\n  name: caf\xe9\n"}, "a.yaml", [r"a\.yaml is not a UTF-8 text file"]),
    ("nul-bytes", {"a.yaml": b"model:\n  name: x\x00\n"}, "a.yaml", [r"a\.yaml is binary"]),
    (
        "invalid-syntax",
        {"a.yaml": b"model: [\n"},
        "a.yaml",
        [r"a\.yaml: invalid YAML at line \d+, column \d+"],
    ),
    (
        "bad-indent",
        {"a.yaml": b"model:\n  num_layers: 2\n   hidden_size: 3\n"},
        "a.yaml",
        [r"a\.yaml: invalid YAML at line 3"],
    ),
    (
        "python-tag",
        {"a.yaml": b"model:\n  name: !!python/object/apply:os.system [ls]\n"},
        "a.yaml",
        [r"a\.yaml: invalid YAML", r"constructor"],
    ),
    (
        "duplicate-key",
        {"a.yaml": b"train:\n  lr: 1.0e-3\ntrain:\n  seed: 3\n"},
        "a.yaml",
        [r"a\.yaml: invalid YAML at line 3", r"'train' appears twice"],
    ),
    (
        "top-level-list",
        {"a.yaml": b"- 1\n- 2\n"},
        "a.yaml",
        [r"a\.yaml: the top level must be a mapping", r"list"],
    ),
    (
        "top-level-scalar",
        {"a.yaml": b"just words\n"},
        "a.yaml",
        [r"a\.yaml: the top level must be a mapping"],
    ),
    ("empty", {"a.yaml": b""}, "a.yaml", [r"a\.yaml is empty"]),
    ("only-comments", {"a.yaml": b"# nothing yet\n"}, "a.yaml", [r"a\.yaml is empty"]),
    ("two-documents", {"a.yaml": b"model: {}\n---\ntrain: {}\n"}, "a.yaml", [r"a\.yaml: invalid YAML"]),
    ("directory", {"d/x.yaml": b"model: {}\n"}, "d", [r"/d is a directory: give a YAML config file"]),
    ("missing", {}, "nope.yaml", [r"config file not found: .*nope\.yaml"]),
    ("section-not-mapping", {"a.yaml": b"model: 3\n"}, "a.yaml", [r"model must be a mapping"]),
]


@pytest.mark.parametrize(
    "files,given,fragments", [pytest.param(f, g, fr, id=i) for i, f, g, fr in YAML_CASES]
)
def test_unusable_yaml_files_are_one_line_naming_the_file(files, given, fragments, tmp_path, capsys):
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    save = tmp_path / "saved"
    outcome = run_cli(["config", "--config", tmp_path / given, "--save", save], capsys)
    expect_error(outcome, *fragments, rc=2)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before, "a refused config left files behind"


def test_includes_merge_only_what_they_set(tmp_path, capsys):
    """An included file's defaults never override what an earlier --config file set."""
    (tmp_path / "base.yaml").write_text("model:\n  num_layers: 6\n")
    (tmp_path / "model.yaml").write_text("model:\n  hidden_size: 256\n")
    (tmp_path / "run.yaml").write_text("include: model.yaml\ntrain:\n  lr: 1.0e-3\n")
    cfg = load_config([tmp_path / "base.yaml", tmp_path / "run.yaml"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.train.lr) == (6, 256, 1e-3)
    (tmp_path / "diamond.yaml").write_text("include: [model.yaml, model.yaml]\n")  # repeated, not a cycle
    assert load_config([tmp_path / "diamond.yaml"]).model.hidden_size == 256


# --------------------------------------------------------------------------- the lighter commands


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Shared inputs of the command cases: good and damaged results, curves and corpora."""
    d = tmp_path_factory.mktemp("inputs")
    result = {"name": "TIED", "results": [{"name": "TIED", "perplexity": 20.0, "corpus": "heldout"}]}
    (d / "tied.json").write_text(json.dumps(result))
    (d / "lev.json").write_text(
        json.dumps({**result, "name": "LEV", "results": [{**result["results"][0], "name": "LEV"}]})
    )
    (d / "corrupt.json").write_text('{"results": [{"perplex')
    (d / "binary.json").write_bytes(b"\xff\xfe\x00garbage")
    (d / "no_ppl.json").write_text(json.dumps({"results": [{"loss": 3.0}]}))
    (d / "nan_ppl.json").write_text('{"name": "TIED", "results": [{"perplexity": NaN}]}')
    (d / "unnamed.json").write_text(json.dumps({"results": [{"perplexity": 3.0}]}))
    (d / "curve_ragged.csv").write_text("tokens,loss\n0,3.0\n10\n")
    (d / "curve_words.csv").write_text("0,3.0\n10,high\n")
    (d / "curve_pairs.json").write_text(json.dumps({"tokens": [0, 10, 20], "loss": [3.0, 2.0]}))
    (d / "curve_nan.json").write_text('{"tokens": [0, 10], "loss": [NaN, NaN]}')
    (d / "no_events").mkdir()
    (d / "a_file").write_text("not a directory\n")
    (d / "empty_corpus").mkdir()
    (d / "cut_run" / "checkpoints" / "iter_0000002").mkdir(parents=True)  # a save without its marker
    with open(d / "corpus.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": f"document {i}: the quick brown fox jumps over the lazy dog"}) + "\n")
    (d / "not_pile.jsonl").write_text('{"body": "no text key"}\nnot json at all\n')
    (d / "bad.yaml").write_bytes(b"\xff\xfebinary")
    (d / "empty.jsonl").write_text("")
    (d / "lambada_no_text.jsonl").write_text('{"text": "a b c"}\n{"passage": "d e f"}\n')
    return d


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# (id, argv with {i} = inputs dir and {t} = this case's tmp dir, fragments, exit status, paths under {t}
# that must not exist afterwards)
COMMAND_CASES = [
    # params
    ("params-tp-zero", ["params", "--tp", "0", "--sizes", "tiny"], [r"--tp 0", r">= 1"], 1, []),
    (
        "params-negative-vocab",
        ["params", "--vocab-size", "-5", "--sizes", "tiny"],
        [r"--vocab-size -5"],
        1,
        [],
    ),
    (
        "params-override-after-sizes",
        ["params", "--sizes", "tiny", "model.norm_eps=-1"],
        [r"model\.norm_eps=-1"],
        2,
        [],
    ),
    ("params-unknown-size", ["params", "--sizes", "huge"], [r"--sizes", r"'huge'", r"known: "], 2, []),
    (
        "params-binary-yaml",
        ["params", "--sizes", "{i}/bad.yaml"],
        [r"bad\.yaml is not a UTF-8 text file"],
        2,
        [],
    ),
    # compare
    (
        "compare-missing-result",
        ["compare", "TIED={t}/nope/eval.json", "--out", "{t}/out"],
        [r"nope/eval\.json: evaluation result not found"],
        1,
        ["out"],
    ),
    (
        "compare-result-is-dir",
        ["compare", "TIED={i}/no_events", "--out", "{t}/out"],
        [r"no_events is a directory"],
        1,
        ["out"],
    ),
    (
        "compare-corrupt-result",
        ["compare", "TIED={i}/corrupt.json", "--out", "{t}/out"],
        [r"corrupt\.json: not a readable evaluation result"],
        1,
        ["out"],
    ),
    (
        "compare-binary-result",
        ["compare", "TIED={i}/binary.json", "--out", "{t}/out"],
        [r"binary\.json"],
        1,
        ["out"],
    ),
    (
        "compare-no-perplexity",
        ["compare", "TIED={i}/no_ppl.json", "--out", "{t}/out"],
        [r"no_ppl\.json: not an evaluate result"],
        1,
        ["out"],
    ),
    (
        "compare-nan-perplexity",
        ["compare", "{i}/nan_ppl.json", "--out", "{t}/out"],
        [r"nan_ppl\.json: perplexity nan", r"not a finite"],
        1,
        ["out"],
    ),
    (
        "compare-unnamed-result",
        ["compare", "{i}/unnamed.json", "--out", "{t}/out"],
        [r"unnamed\.json: the result has no 'name'", r"NAME="],
        1,
        ["out"],
    ),
    (
        "compare-no-baseline",
        ["compare", "LEV={i}/lev.json", "--out", "{t}/out"],
        [r"--baseline 'TIED' is not among the runs"],
        1,
        ["out"],
    ),
    (
        "compare-duplicate-names",
        ["compare", "{i}/tied.json", "{i}/tied.json", "--out", "{t}/out"],
        [r"'.*tied\.json' is given twice|named 'TIED'"],
        1,
        ["out"],
    ),
    ("compare-empty-path", ["compare", "TIED=", "--out", "{t}/out"], [r"empty path in 'TIED='"], 1, ["out"]),
    (
        "compare-missing-run-dir",
        ["compare", "TIED={i}/tied.json", "--curves", "TIED={t}/runs/tied/tensorboard", "--out", "{t}/out"],
        [r"tensorboard: loss curve not found"],
        1,
        ["out"],
    ),
    (
        "compare-run-without-metrics",
        ["compare", "TIED={i}/tied.json", "--curves", "TIED={i}/no_events", "--out", "{t}/out"],
        [r"no_events: no scalar tag", r"no TensorBoard scalars"],
        1,
        ["out"],
    ),
    (
        "compare-ragged-csv",
        ["compare", "TIED={i}/tied.json", "--curves", "TIED={i}/curve_ragged.csv", "--out", "{t}/out"],
        [r"curve_ragged\.csv: line 3 has too few columns"],
        1,
        ["out"],
    ),
    (
        "compare-words-in-csv",
        ["compare", "TIED={i}/tied.json", "--curves", "TIED={i}/curve_words.csv", "--out", "{t}/out"],
        [r"curve_words\.csv: expected \(tokens, loss\) pairs"],
        1,
        ["out"],
    ),
    (
        "compare-unpaired-json",
        ["compare", "TIED={i}/tied.json", "--curves", "TIED={i}/curve_pairs.json", "--out", "{t}/out"],
        [r"curve_pairs\.json: 'tokens' has 3 values but 'loss' has 2"],
        1,
        ["out"],
    ),
    (
        "compare-nan-curve",
        ["compare", "TIED={i}/tied.json", "--curves", "TIED={i}/curve_nan.json", "--out", "{t}/out"],
        [r"curve_nan\.json: no finite"],
        1,
        ["out"],
    ),
    (
        "compare-curve-without-result",
        [
            "compare",
            "TIED={i}/tied.json",
            "--curves",
            "TIED={i}/curve_pairs.json",
            "Tied={i}/curve_pairs.json",
            "--out",
            "{t}/out",
        ],
        [r"curve_pairs|--curves"],
        1,
        ["out"],
    ),
    (
        "compare-negative-tokens-per-step",
        ["compare", "TIED={i}/tied.json", "--tokens-per-step", "-1", "--out", "{t}/out"],
        [r"--tokens-per-step -1"],
        1,
        ["out"],
    ),
    (
        "compare-mismatched-seed-counts",
        ["compare", "TIED={i}/tied.json,{i}/lev.json", "LEV={i}/lev.json", "--out", "{t}/out"],
        [r"LEV has 1 seed\(s\) but TIED has 2", r"same number of eval\.json"],
        1,
        ["out"],
    ),
    (
        "compare-seed-given-twice",
        ["compare", "TIED={i}/tied.json", "TIED={i}/tied.json", "--out", "{t}/out"],
        [r"tied\.json' is given twice for 'TIED'"],
        1,
        ["out"],
    ),
    (
        "compare-empty-seed-path",
        ["compare", "TIED={i}/tied.json,", "--out", "{t}/out"],
        [r"empty path in 'TIED=.*tied\.json,'"],
        1,
        ["out"],
    ),
    (
        "compare-bootstrap-without-per-document-losses",
        ["compare", "TIED={i}/tied.json", "LEV={i}/lev.json", "--bootstrap", "200", "--out", "{t}/out"],
        [r"tied\.json: no per-document losses", r"rerun `megatron-lev evaluate`", r"--bootstrap 0"],
        1,
        ["out"],
    ),
    (
        "compare-negative-bootstrap",
        ["compare", "TIED={i}/tied.json", "--bootstrap", "-5", "--out", "{t}/out"],
        [r"--bootstrap -5"],
        1,
        ["out"],
    ),
    (
        "compare-decomposition-without-its-runs",
        ["compare", "TIED={i}/tied.json", "LEV={i}/lev.json", "--decomposition", "--out", "{t}/out"],
        [r"--decomposition needs", r"missing: ALBERT, FLAT-MLP, FACT-MLP"],
        1,
        ["out"],
    ),
    (
        "compare-out-is-a-file",
        ["compare", "TIED={i}/tied.json", "--out", "{i}/a_file"],
        [r"--out .*a_file: exists and is not a directory"],
        1,
        [],
    ),
    (
        "compare-out-under-a-file",
        ["compare", "TIED={i}/tied.json", "--out", "{i}/a_file/out"],
        [r"--out .*a_file/out: a parent of it is a file"],
        1,
        [],
    ),
    # lm-eval-tasks
    (
        "lm-eval-missing-data-dir",
        ["lm-eval-tasks", "--data-dir", "{t}/nope", "--out", "{t}/tasks"],
        [r"--data-dir .*nope: not a directory"],
        1,
        ["tasks"],
    ),
    (
        "lm-eval-empty-data-dir",
        ["lm-eval-tasks", "--data-dir", "{i}/empty_corpus", "--out", "{t}/tasks"],
        [r"no data-\*\.arrow file", r"--data-dir"],
        1,
        ["tasks"],
    ),
    (
        "lm-eval-data-dir-is-file",
        ["lm-eval-tasks", "--data-dir", "{i}/a_file", "--out", "{t}/tasks"],
        [r"--data-dir .*a_file: not a directory"],
        1,
        ["tasks"],
    ),
    (
        "lm-eval-nothing-to-write",
        ["lm-eval-tasks", "--out", "{t}/tasks"],
        [r"--data-dir", r"--lambada"],
        1,
        ["tasks"],
    ),
    (
        "lm-eval-lambada-missing",
        ["lm-eval-tasks", "--lambada", "{t}/nope.jsonl", "--out", "{t}/tasks"],
        [r"nope\.jsonl: LAMBADA file not found"],
        1,
        ["tasks"],
    ),
    (
        "lm-eval-lambada-empty",
        ["lm-eval-tasks", "--lambada", "{i}/empty.jsonl", "--out", "{t}/tasks"],
        [r"empty\.jsonl: no passages"],
        1,
        ["tasks"],
    ),
    (
        "lm-eval-lambada-line-without-text",
        ["lm-eval-tasks", "--lambada", "{i}/lambada_no_text.jsonl", "--out", "{t}/tasks"],
        [r"lambada_no_text\.jsonl:2: no 'text' field"],
        1,
        ["tasks"],
    ),
    (
        "lm-eval-lambada-is-a-directory",
        ["lm-eval-tasks", "--lambada", "{i}/empty_corpus", "--out", "{t}/tasks"],
        [r"empty_corpus: LAMBADA file is a directory"],
        1,
        ["tasks"],
    ),
    (
        "lm-eval-tasks-without-data-dir",
        ["lm-eval-tasks", "--lambada", "{i}/corpus.jsonl", "--tasks", "local_piqa", "--out", "{t}/tasks"],
        [r"--tasks", r"--data-dir"],
        1,
        ["tasks"],
    ),
    # train-tokenizer
    (
        "tokenizer-missing-input",
        ["train-tokenizer", "--input", "{t}/nope.jsonl", "--model-prefix", "{t}/tok/spm"],
        [r"--input", r"nope\.jsonl: no such file"],
        1,
        ["tok"],
    ),
    (
        "tokenizer-empty-input-dir",
        ["train-tokenizer", "--input", "{i}/empty_corpus", "--model-prefix", "{t}/tok/spm"],
        [r"--input", r"empty_corpus: no \*\.jsonl"],
        1,
        ["tok"],
    ),
    (
        "tokenizer-unsupported-input",
        ["train-tokenizer", "--input", "{i}/bad.yaml", "--model-prefix", "{t}/tok/spm"],
        [r"--input", r"bad\.yaml: unsupported file type"],
        1,
        ["tok"],
    ),
    (
        "tokenizer-no-text",
        [
            "train-tokenizer",
            "--input",
            "{i}/not_pile.jsonl",
            "--model-prefix",
            "{t}/tok/spm",
            "--vocab-size",
            "300",
        ],
        [r"not_pile\.jsonl: no text to train on", r"--json-key"],
        1,
        ["tok"],
    ),
    (
        "tokenizer-wrong-json-key",
        [
            "train-tokenizer",
            "--input",
            "{i}/corpus.jsonl",
            "--json-key",
            "body",
            "--model-prefix",
            "{t}/tok/spm",
        ],
        [r"no text to train on", r"'body'"],
        1,
        ["tok"],
    ),
    (
        "tokenizer-vocab-too-small",
        [
            "train-tokenizer",
            "--input",
            "{i}/corpus.jsonl",
            "--model-prefix",
            "{t}/tok/spm",
            "--vocab-size",
            "100",
        ],
        [r"--vocab-size 100", r">= 260"],
        1,
        ["tok"],
    ),
    (
        "tokenizer-vocab-negative",
        [
            "train-tokenizer",
            "--input",
            "{i}/corpus.jsonl",
            "--model-prefix",
            "{t}/tok/spm",
            "--vocab-size",
            "-1",
        ],
        [r"--vocab-size -1"],
        1,
        ["tok"],
    ),
    (
        "tokenizer-vocab-larger-than-corpus",
        [
            "train-tokenizer",
            "--input",
            "{i}/corpus.jsonl",
            "--model-prefix",
            "{t}/tok/spm",
            "--vocab-size",
            "8000",
            "--threads",
            "1",
        ],
        [r"--vocab-size 8000 is more than this text supports \(at most \d+\)", r"lower --vocab-size"],
        1,
        ["tok"],
    ),
    (
        "tokenizer-max-mb-nan",
        [
            "train-tokenizer",
            "--input",
            "{i}/corpus.jsonl",
            "--model-prefix",
            "{t}/tok/spm",
            "--max-mb",
            "nan",
        ],
        [r"--max-mb nan", r"finite"],
        1,
        ["tok"],
    ),
    (
        "tokenizer-threads-zero",
        ["train-tokenizer", "--input", "{i}/corpus.jsonl", "--model-prefix", "{t}/tok/spm", "--threads", "0"],
        [r"--threads 0"],
        1,
        ["tok"],
    ),
    (
        "tokenizer-prefix-is-dir",
        ["train-tokenizer", "--input", "{i}/corpus.jsonl", "--model-prefix", "{i}/empty_corpus"],
        [r"--model-prefix .*empty_corpus", r"not a directory"],
        1,
        [],
    ),
    (
        "tokenizer-prefix-under-file",
        ["train-tokenizer", "--input", "{i}/corpus.jsonl", "--model-prefix", "{i}/a_file/spm"],
        [r"--model-prefix", r"a_file is a file"],
        1,
        [],
    ),
    # sample-corpus
    (
        "sample-corpus-negative-size",
        ["sample-corpus", "--output-dir", "{t}/corpus", "--max-mb", "-1"],
        [r"--max-mb -1"],
        1,
        ["corpus"],
    ),
    (
        "sample-corpus-infinite-size",
        ["sample-corpus", "--output-dir", "{t}/corpus", "--max-mb", "inf"],
        [r"--max-mb inf"],
        1,
        ["corpus"],
    ),
    (
        "sample-corpus-nan-size",
        ["sample-corpus", "--output-dir", "{t}/corpus", "--max-mb", "nan"],
        [r"--max-mb nan"],
        1,
        ["corpus"],
    ),
    (
        "sample-corpus-unknown-source",
        ["sample-corpus", "--output-dir", "{t}/corpus", "--sources", "Nope"],
        [r"--sources", r"invalid choice: 'Nope'"],
        2,
        ["corpus"],
    ),
    (
        "sample-corpus-out-is-file",
        ["sample-corpus", "--output-dir", "{i}/a_file", "--max-mb", "0.01"],
        [r"--output-dir .*a_file: exists and is not a directory"],
        1,
        [],
    ),
    # grid
    (
        "grid-paper-write-to-file",
        ["grid", "--grid", "paper", "--write", "{i}/a_file"],
        [r"--write .*a_file: exists and is not a directory"],
        1,
        [],
    ),
    (
        "grid-paper-overrides",
        ["grid", "--grid", "paper", "train.lr=1"],
        [r"overrides", r"--grid small only"],
        2,
        [],
    ),
    (
        "grid-small-no-data-dir",
        ["grid", "--grid", "small", "--out", "{t}/grid"],
        [r"--grid small needs --data-dir"],
        2,
        ["grid"],
    ),
    (
        "grid-small-missing-data-dir",
        ["grid", "--grid", "small", "--data-dir", "{t}/nope", "--out", "{t}/grid"],
        [r"--data-dir .*nope: not a directory"],
        2,
        ["grid"],
    ),
    (
        "grid-small-empty-data-dir",
        ["grid", "--grid", "small", "--data-dir", "{i}/empty_corpus", "--out", "{t}/grid"],
        [r"--data-dir .*empty_corpus: no \*\.jsonl"],
        2,
        ["grid"],
    ),
    (
        "grid-small-valid-every-zero",
        ["grid", "--grid", "small", "--data-dir", "{i}", "--out", "{t}/grid", "--valid-every", "0"],
        [r"--valid-every 0", r">= 2"],
        2,
        ["grid"],
    ),
    (
        "grid-small-negative-chars",
        ["grid", "--grid", "small", "--data-dir", "{i}", "--out", "{t}/grid", "--max-chars-per-subset", "-1"],
        [r"--max-chars-per-subset -1"],
        2,
        ["grid"],
    ),
    (
        "grid-small-bad-override",
        ["grid", "--grid", "small", "--data-dir", "{i}", "--out", "{t}/grid", "train.lr=inf"],
        [r"train\.lr=inf", r"> 0"],
        2,
        ["grid"],
    ),
    (
        "grid-small-binary-config",
        ["grid", "--grid", "small", "--data-dir", "{i}", "--out", "{t}/grid", "--config", "{i}/bad.yaml"],
        [r"bad\.yaml is not a UTF-8 text file"],
        2,
        ["grid"],
    ),
    # demo (every check runs before the first step, so nothing is built)
    (
        "demo-negative-iters",
        ["demo", "--out", "{t}/demo", "--iters", "-1"],
        [r"--iters -1", r">= 1"],
        2,
        ["demo"],
    ),
    ("demo-zero-iters", ["demo", "--out", "{t}/demo", "--iters", "0"], [r"--iters 0"], 2, ["demo"]),
    (
        "demo-vocab-too-small",
        ["demo", "--out", "{t}/demo", "--vocab-size", "10"],
        [r"--vocab-size 10", r">= 260"],
        2,
        ["demo"],
    ),
    (
        "demo-negative-corpus",
        ["demo", "--out", "{t}/demo", "--corpus-mb", "-1"],
        [r"--corpus-mb -1"],
        2,
        ["demo"],
    ),
    ("demo-nproc-negative", ["demo", "--out", "{t}/demo", "--nproc", "-1"], [r"--nproc -1"], 2, ["demo"]),
    (
        "demo-missing-corpus-dir",
        ["demo", "--out", "{t}/demo", "--corpus-dir", "{t}/nope"],
        [r"--corpus-dir .*nope: not a directory"],
        2,
        ["demo"],
    ),
    (
        "demo-empty-corpus-dir",
        ["demo", "--out", "{t}/demo", "--corpus-dir", "{i}/empty_corpus"],
        [r"--input", r"empty_corpus: no \*\.jsonl"],
        1,
        ["demo"],
    ),
    (
        "demo-missing-config",
        ["demo", "--out", "{t}/demo", "--config", "{t}/nope.yaml"],
        [r"--config .*nope\.yaml: run config not found"],
        2,
        ["demo"],
    ),
    (
        "demo-binary-config",
        ["demo", "--out", "{t}/demo", "--config", "{i}/bad.yaml"],
        [r"bad\.yaml is not a UTF-8 text file"],
        2,
        ["demo"],
    ),
    (
        "demo-out-is-file",
        ["demo", "--out", "{i}/a_file"],
        [r"--out .*a_file: exists and is not a directory"],
        2,
        [],
    ),
    # geometry
    (
        "geometry-run-without-checkpoints",
        ["geometry", "{i}/no_events", "--out", "{t}/geo"],
        [r"no_events: no complete training checkpoint", r"iter_XXXXXXX"],
        1,
        ["geo"],
    ),
    (
        "geometry-only-an-interrupted-save",
        ["geometry", "{i}/cut_run", "--out", "{t}/geo"],
        [r"cut_run: no complete training checkpoint", r"cut_run/checkpoints"],
        1,
        ["geo"],
    ),
    (
        "geometry-missing-run",
        ["geometry", "{t}/nope", "--out", "{t}/geo"],
        [r"nope: not a directory"],
        1,
        ["geo"],
    ),
    # config
    (
        "config-save-to-file",
        ["config", "--save", "{i}/a_file"],
        [r"--save .*a_file: exists and is not a directory"],
        1,
        [],
    ),
    (
        "config-save-under-file",
        ["config", "--save", "{i}/a_file/run"],
        [r"--save .*a_file/run: a parent"],
        1,
        [],
    ),
]


@pytest.mark.parametrize(
    "argv,fragments,rc,absent", [pytest.param(a, f, r, x, id=i) for i, a, f, r, x in COMMAND_CASES]
)
def test_light_commands_refuse_bad_input_in_one_line(argv, fragments, rc, absent, inputs, tmp_path, capsys):
    inputs_before = _tree(inputs)
    argv = [a.replace("{i}", str(inputs)).replace("{t}", str(tmp_path)) for a in argv]
    outcome = run_cli(argv, capsys)
    expect_error(outcome, *fragments, rc=rc)
    for rel in absent:
        assert not (tmp_path / rel).exists(), f"a refused command wrote {rel}"
    assert _tree(inputs) == inputs_before, "a refused command changed its inputs"
    assert not [p for p in tmp_path.rglob("*") if ".tmp." in p.name], "temp files left behind"


def test_sample_corpus_rerun_removes_subsets_of_an_earlier_run(tmp_path, capsys):
    out = tmp_path / "corpus"
    expect_ok(
        run_cli(
            [
                "sample-corpus",
                "--output-dir",
                out,
                "--max-mb",
                "0.05",
                "--no-progress",
                "--sources",
                "Github",
                "Python_docs",
            ],
            capsys,
        )
    )
    assert (out / "Python_docs.jsonl.zst").exists()
    expect_ok(
        run_cli(
            [
                "sample-corpus",
                "--output-dir",
                out,
                "--max-mb",
                "0.05",
                "--no-progress",
                "--sources",
                "Github",
            ],
            capsys,
        )
    )
    assert sorted(p.name for p in out.iterdir()) == ["Github.jsonl.zst", "manifest.json"]
    assert list(json.loads((out / "manifest.json").read_text())["subsets"]) == ["Github"]
