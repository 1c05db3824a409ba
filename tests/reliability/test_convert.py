"""Bad inputs and faults of `convert`, `evaluate`, `capacity` and `reshard`, and the CPU-kernel cache.

Each case runs the command in this process and checks the exit status, the one-line
message (it names the file, key or flag) and what is left on disk: no half-written
output, no `.partial` directory, inputs untouched, and no code run from data (pickle
payloads and planted libraries create a marker file that must not appear).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_lev.utils.io import sha256_file
from tests.convert.conftest import ds_checkpoints, sample_text, tokenizer_path  # noqa: F401 (fixtures)
from tests.reliability.harness import expect_error, expect_ok, run_cli
from tests.reliability.test_checkpoint import make_data
from tests.reliability.test_checkpoint import overrides as train_overrides
from tests.reliability.test_checkpoint import train as train_run

pytestmark = pytest.mark.multiprocess  # the shared checkpoints are made by 4 gloo processes


# ----------------------------------------------------------------------------- shared inputs


class Payload:
    """Unpickling this runs `open(marker, "w")`: a stand-in for any code planted in a data file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def clone(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint tree whose files are symlinks (cheap); `own()` makes one file real."""
    for root, _, files in os.walk(src):
        rel = Path(root).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for f in files:
            os.symlink(Path(root) / f, dst / rel / f)
    return dst


def own(path: Path) -> Path:
    real = path.resolve()
    path.unlink()
    shutil.copyfile(real, path)
    return path


def tag_of(root: Path) -> Path:
    return root / (root / "latest").read_text().strip()


@dataclass
class Ctx:
    tmp: Path
    ckpt: dict[str, Path]
    hf: Path
    hf_lev: Path
    tokenizer: Path
    marker: Path = field(init=False)

    def __post_init__(self):
        self.marker = self.tmp / "PAYLOAD_RAN"

    def copy(self, variant: str = "tied") -> Path:
        return clone(self.ckpt[variant], self.tmp / f"ckpt_{variant}")

    def plant(self, path: Path) -> None:
        """Replace a checkpoint file with a valid torch file that carries a pickle payload, and
        record its checksum in the completion marker (whoever can plant a file can do that too):
        the loader, not the checksum, must refuse it."""
        path.unlink()
        torch.save({"module": {"w": torch.zeros(2)}, "evil": Payload(self.marker)}, path)
        rerecord(path)

    def other_tokenizer(self) -> Path:
        """The run's tokenizer with the ids of two tokens swapped: same size, other ids."""
        data = json.loads(self.tokenizer.read_text())
        vocab = data["model"]["vocab"]
        vocab["the"], vocab["and"] = vocab["and"], vocab["the"]
        path = self.tmp / "other-tokenizer.json"
        path.write_text(json.dumps(data))
        return path


def rerecord(path: Path) -> None:
    """Write `path`'s current size and sha256 into its checkpoint's completion marker."""
    marker = path.parent / "complete"
    if marker.is_file():
        data = json.loads(marker.read_text())
        if path.name in data.get("files", {}):
            data["files"][path.name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
            own(marker).write_text(json.dumps(data))


def flip_bytes(path: Path, n: int = 64) -> None:
    """Flip `n` bytes in the middle of `path` (same size: only a checksum can tell)."""
    data = bytearray(own(path).read_bytes())
    mid = len(data) // 2
    for i in range(mid, min(mid + n, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def exports(ds_checkpoints, tmp_path_factory):  # noqa: F811
    """A dense export of the tied checkpoint and a --keep-lev export of the LEV one."""
    from megatron_lev.convert.hf_export import export_to_hf

    out = tmp_path_factory.mktemp("exports")
    dense = export_to_hf(ds_checkpoints["tied"][0], out / "tied", progress=False).out_dir
    lev = export_to_hf(ds_checkpoints["lev"][0], out / "lev_layer", progress=False, keep_lev=True).out_dir
    return dense, lev


@pytest.fixture
def ctx(ds_checkpoints, exports, tokenizer_path, tmp_path):  # noqa: F811
    return Ctx(
        tmp_path, {k: v[0] for k, v in ds_checkpoints.items()}, exports[0], exports[1], Path(tokenizer_path)
    )


def tree(path: Path) -> dict[str, int]:
    return (
        {str(p.relative_to(path)): p.lstat().st_size for p in sorted(path.rglob("*"))}
        if path.exists()
        else {}
    )


# ----------------------------------------------------------------------------- the table


@dataclass
class Case:
    setup: Callable[[Ctx], list]  # -> argv (after the command name)
    fragments: tuple[str, ...]  # regexes the error line must match
    rc: int | None = None
    check: Callable[[Ctx], None] | None = None  # the state on disk afterwards


def no_output(c: Ctx) -> None:
    leftovers = [p.name for p in c.tmp.iterdir() if p.name.startswith(("out", ".out"))]
    assert leftovers == [], f"half-written output left behind: {leftovers}"
    assert not c.marker.exists(), "a pickle payload ran"


def no_eval(c: Ctx) -> None:
    assert not (c.tmp / "ev").exists(), "results written for a refused evaluation"
    assert not c.marker.exists()


def no_capacity(c: Ctx) -> None:
    assert not (c.tmp / "cap" / "capacity.json").exists() and not c.marker.exists()


def cv(*extra):
    """argv of `convert` on the unmodified tied checkpoint into tmp/out."""
    return lambda c: ["convert", c.ckpt["tied"], c.tmp / "out", "--no-progress", *extra]


def cv_on(prepare, *extra, variant="tied"):
    """argv of `convert` on a copy of a checkpoint changed by `prepare(ctx, root)`."""

    def setup(c):
        root = c.copy(variant)
        prepare(c, root)
        return ["convert", root, c.tmp / "out", "--no-progress", *extra]

    return setup


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return path


def config_with(c: Ctx, variant: str = "tied", **changes) -> Path:
    import yaml

    cfg = yaml.safe_load((tag_of(c.ckpt[variant]) / "config.yaml").read_text())
    for key, value in changes.items():
        section, name = key.split("__")
        cfg[section][name] = value
    return write(c.tmp / "other.yaml", yaml.safe_dump(cfg))


def truncate(c, root):
    victim = own(tag_of(root) / "layer_01-model_01-model_states.pt")
    victim.write_bytes(victim.read_bytes()[:300])


def kept_file(c: Ctx):
    assert (c.tmp / "out").read_text() == "keep me"


def with_model_vocab(vocab: int):
    """`prepare` for cv_on: the checkpoint's config.yaml says model.vocab_size=`vocab` (the tokenizer has
    50,277; 50,300 pads to the same 50,304 rows, so the weights are those of such a run)."""

    def prepare(c: Ctx, root: Path) -> None:
        import yaml

        path = own(tag_of(root) / "config.yaml")
        cfg = yaml.safe_load(path.read_text())
        cfg["model"]["vocab_size"] = vocab
        path.write_text(yaml.safe_dump(cfg))
        rerecord(path)

    return prepare


def kept_dir(c: Ctx):
    assert (c.tmp / "out" / "mine.txt").read_text() == "keep me" and len(list((c.tmp / "out").iterdir())) == 1


def ckpt_intact(c: Ctx):
    assert (tag_of(c.tmp / "ckpt_tied") / "complete").exists() and not c.marker.exists()


def planted(key: str, value: float, index=None, file: str = "layer_00-model_00-model_states.pt"):
    """`prepare` for cv_on: parameter `key` of one layer file (a TP shard) set to `value` (at `index`,
    or everywhere), and its checksum recorded again (the weights are wrong, not the file)."""

    def prepare(c: Ctx, root: Path) -> None:
        path = own(tag_of(root) / file)
        state = torch.load(path, map_location="cpu", weights_only=True)
        if index is None:
            state[key].fill_(value)
        else:
            state[key][index] = value
        torch.save(state, path)
        rerecord(path)

    return prepare


NAN_DELTA = planted("embedding.delta", float("nan"), (0, 3, 2, 1))  # a row few probe tokens reach
HUGE_DELTA = planted("embedding.delta", 1e6)  # finite; the product over 8 coordinates overflows


CONVERT = [
    pytest.param(
        Case(lambda c: ["convert", c.tmp / "nope", c.tmp / "out"], ("nope", "does not exist"), 1, no_output),
        id="checkpoint-dir-missing",
    ),
    pytest.param(
        Case(
            lambda c: ["convert", write(c.tmp / "empty" / "x.txt", "").parent, c.tmp / "out"],
            ("empty", "no 'latest'"),
            1,
            no_output,
        ),
        id="dir-without-latest",
    ),
    pytest.param(
        Case(
            cv_on(lambda c, r: ((r / "latest").unlink(), (r / "latest").write_text("iter_0000099\n"))),
            ("latest", "iter_0000099", "does not exist"),
            1,
            no_output,
        ),
        id="latest-names-missing-tag",
    ),
    pytest.param(
        Case(
            cv_on(lambda c, r: ((r / "latest").unlink(), (r / "latest").write_text("\n"))),
            ("latest", "does not name a checkpoint tag", "--tag"),
            1,
            no_output,
        ),
        id="latest-empty",
    ),
    pytest.param(
        Case(
            cv_on(lambda c, r: ((r / "latest").unlink(), (r / "latest").write_text("../../etc\n"))),
            ("latest", "does not name a checkpoint tag"),
            1,
            no_output,
        ),
        id="latest-escapes-dir",
    ),
    pytest.param(
        Case(cv("--tag", "iter_0000042"), ("iter_0000042", "does not exist", "iter_0000001"), 1, no_output),
        id="tag-missing",
    ),
    pytest.param(
        Case(
            cv_on(lambda c, r: (tag_of(r) / "complete").unlink()),
            ("complete", "interrupted", "--tag"),
            1,
            no_output,
        ),
        id="incomplete-tag-no-marker",
    ),
    pytest.param(
        Case(
            cv_on(lambda c, r: (tag_of(r) / "layer_02-model_00-model_states.pt").unlink()),
            ("layer_02-model_00-model_states.pt", "is missing", "damaged"),
            1,
            no_output,
        ),
        id="missing-shard",
    ),
    pytest.param(
        Case(
            cv_on(lambda c, r: [p.unlink() for p in tag_of(r).glob("*model_states.pt")]),
            ("model_states.pt", "missing", "--tag"),
            1,
            no_output,
        ),
        id="tag-without-shards",
    ),
    pytest.param(
        Case(cv_on(truncate), ("layer_01-model_01-model_states.pt", "truncated", "damaged"), 1, no_output),
        id="truncated-shard",
    ),
    pytest.param(
        Case(
            cv_on(lambda c, r: flip_bytes(tag_of(r) / "layer_01-model_00-model_states.pt")),
            ("layer_01-model_00-model_states.pt", "checksum", "--tag"),
            1,
            no_output,
        ),
        id="flipped-bytes-in-layer-file",
    ),
    pytest.param(
        Case(
            cv_on(lambda c, r: flip_bytes(sorted(tag_of(r).glob("*optim_states.pt"))[0], 16)),
            ("optim_states.pt", "checksum", "damaged"),
            1,
            no_output,
        ),
        id="flipped-bytes-in-optimizer-file",
    ),
    pytest.param(
        Case(
            cv_on(lambda c, r: c.plant(tag_of(r) / "layer_01-model_00-model_states.pt")),
            ("refusing to load", "layer_01-model_00-model_states.pt", "builtins.open|open"),
            1,
            no_output,
        ),
        id="pickle-payload-in-layer-file",
    ),
    pytest.param(
        Case(
            cv_on(
                lambda c, r: c.plant(tag_of(r) / "zero_pp_rank_0_mp_rank_00_model_states.pt"),
                variant="albert",
            ),
            ("refusing to load", "ZeRO-3", "TP rank 0"),
            1,
            no_output,
        ),
        id="pickle-payload-in-zero3-model-states",
    ),
    pytest.param(
        Case(
            cv_on(
                lambda c, r: c.plant(tag_of(r) / "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"),
                variant="albert",
            ),
            ("refusing to load", "TP rank 1"),
            1,
            no_output,
        ),
        id="pickle-payload-in-zero3-optim-states",
    ),
    pytest.param(
        Case(
            lambda c: [
                "convert",
                c.ckpt["tied"],
                c.tmp / "out",
                "--config",
                config_with(c, model__rope_theta=500000.0),
            ],
            ("other.yaml", "model.rope_theta: 10000.0 in the checkpoint != 500000.0", "drop --config"),
            1,
            no_output,
        ),
        id="config-other-rope-theta",
    ),
    pytest.param(
        Case(
            lambda c: [
                "convert",
                c.ckpt["tied"],
                c.tmp / "out",
                "--config",
                config_with(c, model__norm_eps=1e-6, model__num_kv_heads=4),
            ],
            ("model.norm_eps: 1e-05 in the checkpoint != 1e-06", "model.num_kv_heads: 2"),
            1,
            no_output,
        ),
        id="config-other-norm-eps-and-gqa",
    ),
    pytest.param(
        Case(
            lambda c: ["convert", c.ckpt["tied"], c.tmp / "out", "--tokenizer", c.other_tokenizer()],
            ("other-tokenizer.json", "not the one the run was trained with", "sha256"),
            1,
            no_output,
        ),
        id="tokenizer-other-file",
    ),
    pytest.param(
        Case(
            lambda c: ["convert", c.ckpt["tied"], c.tmp / "out", "--tokenizer", c.tmp / "none.json"],
            ("tokenizer not found", "none.json", "--tokenizer"),
            1,
            no_output,
        ),
        id="tokenizer-missing",
    ),
    pytest.param(
        Case(
            cv_on(
                lambda c, r: own(tag_of(r) / "config.yaml").write_text(
                    (tag_of(r) / "config.yaml").read_text().replace(str(c.tokenizer), "/moved/tok.json")
                )
            ),
            ("tokenizer not found", "/moved/tok.json", "--tokenizer"),
            1,
            no_output,
        ),
        id="run-tokenizer-moved",
    ),
    pytest.param(
        Case(
            lambda c: ["convert", c.ckpt["tied"], write(c.tmp / "out" / "mine.txt", "keep me").parent],
            ("out", "exists and is not empty", "--overwrite"),
            2,
            kept_dir,
        ),
        id="output-not-empty",
    ),
    pytest.param(
        Case(
            lambda c: ["convert", c.ckpt["tied"], write(c.tmp / "out", "keep me")],
            ("out", "not a directory"),
            2,
            kept_file,
        ),
        id="output-is-a-file",
    ),
    pytest.param(
        Case(
            lambda c: ["convert", c.copy(), c.tmp / "ckpt_tied", "--overwrite"],
            ("holds the checkpoint",),
            2,
            ckpt_intact,
        ),
        id="output-is-the-checkpoint",
    ),
    pytest.param(
        Case(cv("--keep-lev"), ("--keep-lev needs a LEV model", "tied"), 2, no_output), id="keep-lev-on-tied"
    ),
    pytest.param(
        Case(
            cv_on(with_model_vocab(50000)),
            ("50277 tokens", "model.vocab_size is only 50000", "smaller"),
            1,
            no_output,
        ),
        id="model-vocab-smaller-than-tokenizer",
    ),
    pytest.param(
        Case(cv("--max-shard-size", "0"), ("--max-shard-size",), 2, no_output), id="max-shard-size-zero"
    ),
    pytest.param(
        Case(
            cv_on(NAN_DELTA, variant="lev"),
            ("iter_0000001", "parameter embedding.delta holds 1 non-finite value", "--tag"),
            1,
            no_output,
        ),
        id="lev-delta-holds-nan",
    ),
    pytest.param(
        Case(
            cv_on(NAN_DELTA, "--keep-lev", variant="lev"),
            ("parameter embedding.delta holds 1 non-finite value", "nothing was exported"),
            1,
            no_output,
        ),
        id="lev-delta-holds-nan-keep-lev",
    ),
    pytest.param(
        Case(
            cv_on(HUGE_DELTA, variant="lev"),
            (
                r"model\.embed_tokens\.weight \(the lev input embedding materialised over the whole",
                "non-finite row",
            ),
            1,
            no_output,
        ),
        id="lev-table-overflows-from-finite-parameters",
    ),
    pytest.param(
        Case(
            cv_on(HUGE_DELTA, "--keep-lev", variant="lev"),
            ("the LEV table", "materialised over the whole vocabulary", "non-finite row"),
            1,
            no_output,
        ),
        id="lev-table-overflows-keep-lev",
    ),
    pytest.param(
        Case(
            cv_on(
                planted("layers.0.mlp.down.weight", 1e6, (0, 0), file="layer_01-model_00-model_states.pt"),
                "--dtype",
                "fp16",
            ),
            (
                r"exported tensor model\.layers\.0\.mlp\.down_proj\.weight holds 1 non-finite",
                "float16",
                "--dtype fp32",
            ),
            1,
            no_output,
        ),
        id="weight-beyond-fp16-range",
    ),
]


def ev(*extra, model="hf"):
    return lambda c: [
        "evaluate",
        getattr(c, model),
        "--out",
        c.tmp / "ev",
        "--threads",
        "1",
        "--seq-len",
        "8",
        *extra,
    ]


def ev_text(content: str | bytes, name: str = "corpus.txt"):
    return lambda c: ev("--text", write(c.tmp / name, content), "--tokenizer", c.tokenizer)(c)


WIKI = " = Title = \n \n Some text @-@ here , and more . \n = = Part = = \n Last line . \n"


def ev_task(flag: str, content: str | bytes | None, name: str, *extra):
    """evaluate with `flag` FILE (the run's tokenizer); `content` None: the file does not exist."""

    def make(c: Ctx) -> list:
        path = c.tmp / name if content is None else write(c.tmp / name, content)
        return ev(flag, path, "--tokenizer", c.tokenizer, *extra)(c)

    return make


def shard(c: Ctx, ids) -> Path:
    """A held-out shard set of one document with its manifest (no tokenizer recorded)."""
    from megatron_lev.data.indexed import IndexedDatasetBuilder
    from megatron_lev.data.manifest import write_manifest

    builder = IndexedDatasetBuilder(c.tmp / "heldout", dtype=np.uint16)
    builder.add_document(np.asarray(ids))
    builder.finalize()
    write_manifest(c.tmp / "heldout", [str(c.tmp / "heldout")], {}, int(max(ids)))
    return c.tmp / "heldout"


def shard_of_other_tokenizer(c: Ctx) -> Path:
    from megatron_lev.data.manifest import write_manifest

    prefix = shard(c, range(1, 30))
    write_manifest(
        prefix,
        [str(prefix)],
        {"type": "hf", "file": "other.json", "sha256": "0" * 64, "vocab_size": 50277, "eod": 0},
        29,
    )
    return prefix


def shard_with_manifest(c: Ctx, kind: str, tokenizer: Path, text: str = "") -> Path:
    """Held-out shard of `text` (default: the probe-free sample below) made with `tokenizer`, and its
    manifest."""
    from megatron_lev.data.manifest import write_manifest
    from megatron_lev.data.tokenizers import build_tokenizer, tokenizer_fingerprint

    tok = build_tokenizer(kind, tokenizer)
    ids = tok.encode(text or "Held-out text: 12 apples, 3 pears.\n\tAnd caf\u00e9 na\u00efve! " * 3) + [
        tok.eod
    ]
    prefix = shard(c, ids)
    write_manifest(prefix, [str(prefix)], tokenizer_fingerprint(kind, tokenizer, tok), max(ids))
    return prefix


def reformatted_tokenizer(c: Ctx) -> Path:
    """The run's tokenizer.json written again by another JSON writer: same tokenizer, other bytes."""
    path = c.tmp / "reformatted" / "tokenizer.json"
    return write(path, json.dumps(json.loads(c.tokenizer.read_text()), indent=1, ensure_ascii=False))


def digits_swapped_tokenizer(c: Ctx) -> Path:
    """The run's tokenizer with the ids of "1" and "2" swapped: same size and EOD, other ids for digits."""
    data = json.loads(c.tokenizer.read_text())
    vocab = data["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]
    return write(c.tmp / "digits-swapped.json", json.dumps(data))


def damaged_manifest(c: Ctx) -> Path:
    prefix = shard(c, range(1, 30))
    write(c.tmp / "heldout.manifest.json", "{not json")
    return prefix


def nan_model(c: Ctx) -> Path:
    from safetensors.torch import load_file, save_file

    out = c.tmp / "nan_model"
    shutil.copytree(c.hf, out)
    state = load_file(out / "model.safetensors")
    state["model.norm.weight"][:] = float("nan")
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def no_config(c: Ctx) -> Path:
    out = c.tmp / "weights_only"
    out.mkdir()
    shutil.copyfile(c.hf / "model.safetensors", out / "model.safetensors")
    return out


EVALUATE = [
    pytest.param(Case(ev_text(""), ("corpus.txt", "no tokens to evaluate"), 1, no_eval), id="text-empty"),
    pytest.param(
        Case(ev_text(b"caf\xe9 latin-1 text\n"), ("corpus.txt", "not UTF-8"), 1, no_eval), id="text-not-utf8"
    ),
    pytest.param(
        Case(
            ev_text('{"text": "ok"}\nnot json\n', "c.jsonl"), (r"c.jsonl:2", "not a JSON object"), 1, no_eval
        ),
        id="jsonl-bad-line",
    ),
    pytest.param(
        Case(ev_text('{"text": 17}\n', "c.jsonl"), (r"c.jsonl:1", "'text' is a int"), 1, no_eval),
        id="jsonl-text-not-string",
    ),
    pytest.param(
        Case(ev_text(b'{"text": "\xff\xfe"}\n', "c.jsonl"), ("c.jsonl", "not UTF-8"), 1, no_eval),
        id="jsonl-not-utf8",
    ),
    pytest.param(
        Case(
            lambda c: ev(
                "--text",
                write(c.tmp / "t.txt", "some text here and more"),
                "--tokenizer",
                c.other_tokenizer(),
            )(c),
            ("other-tokenizer.json", "not the model's tokenizer"),
            1,
            no_eval,
        ),
        id="tokenizer-not-the-models",
    ),
    pytest.param(
        Case(
            lambda c: ev("--data", shard(c, [5, 6, 60000, 7, 8, 9, 10, 11, 12, 13]))(c),
            ("heldout", "token id 60000", "vocabulary of 50277"),
            1,
            no_eval,
        ),
        id="shard-ids-beyond-vocab",
    ),
    pytest.param(
        Case(
            lambda c: ev("--data", shard_of_other_tokenizer(c))(c),
            ("heldout", "other.json", "not the model's"),
            1,
            no_eval,
        ),
        id="shard-manifest-other-tokenizer",
    ),
    pytest.param(
        Case(
            lambda c: ev("--data", shard_with_manifest(c, "hf", digits_swapped_tokenizer(c)))(c),
            ("heldout", "digits-swapped.json", "not the model's", "probe text"),
            1,
            no_eval,
        ),
        id="shard-manifest-tokenizer-encodes-otherwise",
    ),
    pytest.param(
        Case(
            lambda c: ev("--data", damaged_manifest(c))(c),
            ("heldout", "heldout.manifest.json", "unreadable shard-set manifest"),
            1,
            no_eval,
        ),
        id="shard-manifest-damaged",
    ),
    pytest.param(
        Case(
            lambda c: [
                "evaluate",
                nan_model(c),
                "--data",
                shard(c, list(range(1, 40))),
                "--out",
                c.tmp / "ev",
                "--seq-len",
                "8",
                "--threads",
                "1",
            ],
            ("heldout", "non-finite perplexity"),
            1,
            no_eval,
        ),
        id="non-finite-result",
    ),
    pytest.param(
        Case(
            lambda c: ["evaluate", no_config(c), "--data", c.tmp / "x", "--out", c.tmp / "ev"],
            ("weights_only", "no config.json"),
            1,
            no_eval,
        ),
        id="hf-dir-without-config",
    ),
    pytest.param(
        Case(
            ev("--text", "x.txt", model="hf_lev"),
            ("lev_layer", "modeling_lev_llama.py", "--trust-remote-code"),
            1,
            no_eval,
        ),
        id="keep-lev-export-needs-trust-remote-code",
    ),
    pytest.param(
        Case(
            lambda c: ev("--data", shard(c, range(1, 20)), "--seq-len", "0")(c),
            ("--seq-len", ">= 1"),
            1,
            no_eval,
        ),
        id="seq-len-zero",
    ),
    pytest.param(
        Case(
            lambda c: [
                "evaluate",
                c.ckpt["tied"],
                "--text",
                write(c.tmp / "t.txt", "a b c"),
                "--out",
                c.tmp / "ev",
            ],
            ("--text", "needs --tokenizer"),
            1,
            no_eval,
        ),
        id="checkpoint-text-without-tokenizer",
    ),
    pytest.param(
        Case(
            lambda c: ["evaluate", c.tmp / "gone", "--data", c.tmp / "x", "--out", c.tmp / "ev"],
            ("gone", "does not exist"),
            1,
            no_eval,
        ),
        id="model-missing",
    ),
    pytest.param(
        Case(
            lambda c: ev("--data", shard(c, range(1, 20)), "--counts", write(c.tmp / "c.npy", b"junk"))(c),
            ("--counts", "c.npy"),
            1,
            no_eval,
        ),
        id="counts-not-npy",
    ),
    pytest.param(Case(lambda c: ev()(c), ("--data", "--text"), 1, no_eval), id="nothing-to-evaluate"),
    pytest.param(
        Case(ev_task("--lambada", None, "gone.jsonl"), ("gone.jsonl", "LAMBADA file not found"), 1, no_eval),
        id="lambada-missing",
    ),
    pytest.param(
        Case(ev_task("--lambada", "", "l.jsonl"), (r"l\.jsonl: no passages", "empty file"), 1, no_eval),
        id="lambada-empty",
    ),
    pytest.param(
        Case(
            ev_task("--lambada", '{"text": "a b c"}\n{"passage": "d e f"}\n', "l.jsonl"),
            (r"l\.jsonl:2: no 'text' field",),
            1,
            no_eval,
        ),
        id="lambada-line-without-text",
    ),
    pytest.param(
        Case(ev_task("--lambada", b"caf\xe9 au lait\n", "l.txt"), (r"l\.txt:1: not UTF-8",), 1, no_eval),
        id="lambada-not-utf8",
    ),
    pytest.param(
        Case(ev_task("--wikitext", None, "gone.raw"), ("gone.raw", "Wikitext file not found"), 1, no_eval),
        id="wikitext-missing",
    ),
    pytest.param(
        Case(ev_task("--wikitext", " \n \n", "w.raw"), (r"w\.raw: no text to evaluate",), 1, no_eval),
        id="wikitext-empty",
    ),
    pytest.param(
        Case(
            ev_task("--wikitext", "just prose, no headings\n", "w.raw"),
            (r"w\.raw: no article heading", "--text"),
            1,
            no_eval,
        ),
        id="wikitext-without-headings",
    ),
    pytest.param(
        Case(
            ev_task("--wikitext", WIKI, "w.raw", "--stride", "9"), ("--stride 9", "--seq-len 8"), 1, no_eval
        ),
        id="stride-above-window",
    ),
    pytest.param(
        Case(
            ev_task("--lambada", "a b c\n", "l.txt", "--detokenize"),
            ("--detokenize", "--wikitext"),
            1,
            no_eval,
        ),
        id="detokenize-without-wikitext",
    ),
]


def npy(c: Ctx, array, name="m.npy", allow_pickle=False) -> Path:
    path = c.tmp / name
    np.save(path, array, allow_pickle=allow_pickle)
    return path


def cap(make):
    return lambda c: ["capacity", make(c), "--out", c.tmp / "cap", "--threads", "1"]


def with_nan(value, row=3):
    def make(c):
        m = np.random.default_rng(0).normal(size=(20, 8)).astype(np.float32)
        m[row, 2] = value
        return npy(c, m)

    return make


def fit_file(rows) -> Callable:
    return lambda c: [
        "capacity",
        "--fit",
        write(c.tmp / "rows.json", rows if isinstance(rows, str) else json.dumps(rows)),
        "--out",
        c.tmp / "cap",
    ]


def planted_bin(c: Ctx) -> Path:
    d = c.tmp / "torch_model"
    d.mkdir()
    with open(d / "pytorch_model.bin", "wb") as f:
        torch.save({"model.embed_tokens.weight": torch.zeros(4, 4), "x": Payload(c.marker)}, f)
    return d


GOOD_ROWS = [[64, 8, 0.3], [128, 8, 0.4], [256, 16, 0.35], [512, 16, 0.4], [1024, 32, 0.33], [16, 32, 0.0]]

CAPACITY = [
    pytest.param(
        Case(cap(lambda c: npy(c, np.zeros((2, 3, 4), np.float32))), ("m.npy", "2-D"), 1, no_capacity),
        id="npy-3d",
    ),
    pytest.param(
        Case(cap(lambda c: npy(c, np.ones((5, 4), np.complex64))), ("m.npy", "real numbers"), 1, no_capacity),
        id="npy-complex",
    ),
    pytest.param(
        Case(
            cap(
                lambda c: npy(
                    c, np.array([Payload(c.marker)] * 4, dtype=object).reshape(2, 2), allow_pickle=True
                )
            ),
            ("m.npy", "not a readable .npy"),
            1,
            no_capacity,
        ),
        id="npy-object-pickle-payload",
    ),
    pytest.param(
        Case(cap(with_nan(np.nan)), ("m.npy", "row 3", "non-finite"), 1, no_capacity), id="npy-nan-row"
    ),
    pytest.param(
        Case(cap(with_nan(np.inf, row=17)), ("m.npy", "row 17", "non-finite"), 1, no_capacity),
        id="npy-inf-row",
    ),
    pytest.param(
        Case(
            cap(lambda c: npy(c, np.ones((1, 8), np.float32))),
            ("m.npy", "at least 2", "got 1"),
            1,
            no_capacity,
        ),
        id="npy-one-row",
    ),
    pytest.param(
        Case(cap(lambda c: npy(c, np.zeros((6, 8), np.float32))), ("m.npy", "6 zero"), 1, no_capacity),
        id="npy-all-zero-rows",
    ),
    pytest.param(
        Case(
            cap(lambda c: write(c.tmp / "m.npy", b"\x93NUMPY garbage")),
            ("m.npy", "not a readable"),
            1,
            no_capacity,
        ),
        id="npy-damaged",
    ),
    pytest.param(
        Case(cap(planted_bin), ("pytorch_model.bin", "not a plain PyTorch state dict"), 1, no_capacity),
        id="bin-pickle-payload",
    ),
    pytest.param(
        Case(
            cap(lambda c: write(c.tmp / "w.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json")),
            ("w.safetensors", "not a readable .safetensors"),
            1,
            no_capacity,
        ),
        id="safetensors-damaged",
    ),
    pytest.param(
        Case(
            cap(lambda c: write(c.tmp / "dir" / "README", "x").parent),
            ("dir", "no \\*.safetensors"),
            1,
            no_capacity,
        ),
        id="dir-without-weights",
    ),
    pytest.param(
        Case(
            fit_file(GOOD_ROWS[:2] + [[256, 16, float("nan")]] + GOOD_ROWS[3:]),
            ("rows.json", "row 2", "finite"),
            1,
            no_capacity,
        ),
        id="fit-nan-row",
    ),
    pytest.param(
        Case(
            fit_file([[64, 8, 0.3], [128, 8, 0.4]]), ("rows.json", "too few", "need at least"), 1, no_capacity
        ),
        id="fit-too-few-rows",
    ),
    pytest.param(
        Case(fit_file([[64, 8, 0.3], [128, 8]]), ("rows.json", "row 1", r"\[k, d, eps\*\]"), 1, no_capacity),
        id="fit-row-wrong-shape",
    ),
    pytest.param(
        Case(fit_file("[[1, 2, 3"), ("rows.json", "cannot read"), 1, no_capacity), id="fit-not-json"
    ),
    pytest.param(
        Case(
            fit_file(GOOD_ROWS[:1] + [[-5, 8, 0.2]] + GOOD_ROWS[1:]),
            ("rows.json", "row 1", "positive"),
            1,
            no_capacity,
        ),
        id="fit-negative-k",
    ),
]


def rs(*flags, out="out"):
    return lambda c: ["reshard", c.ckpt["tied"], c.tmp / out, *flags]


def reshard_planted(c: Ctx) -> list:
    root = c.copy("albert")
    c.plant(tag_of(root) / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    return ["reshard", root, c.tmp / "out", "--tp", "1", "--pp", "1"]


RESHARD = [
    pytest.param(
        Case(
            rs("--tp", "3", "--pp", "1"), ("--tp 3", "num_attention_heads=4 is not divisible"), 2, no_output
        ),
        id="tp-does-not-divide-heads",
    ),
    pytest.param(
        Case(rs("--tp", "1", "--pp", "5"), ("--pp 5", "exceeds model.num_layers=2"), 2, no_output),
        id="pp-more-than-layers",
    ),
    pytest.param(
        Case(rs("--tp", "1", "--pp", "1", "--dp", "0"), ("--dp must be >= 1",), 2, no_output), id="dp-zero"
    ),
    pytest.param(
        Case(
            lambda c: [
                "reshard",
                c.ckpt["tied"],
                write(c.tmp / "out" / "mine.txt", "keep me").parent,
                "--tp",
                "1",
                "--pp",
                "1",
            ],
            ("out", "is not empty"),
            1,
            kept_dir,
        ),
        id="reshard-output-not-empty",
    ),
    pytest.param(
        Case(
            lambda c: ["reshard", c.copy(), c.tmp / "ckpt_tied", "--tp", "1", "--pp", "1"],
            ("holds the checkpoint",),
            1,
            ckpt_intact,
        ),
        id="reshard-output-is-the-checkpoint",
    ),
    pytest.param(
        Case(
            lambda c: ["reshard", c.tmp / "nope", c.tmp / "out", "--tp", "1", "--pp", "1"],
            ("nope", "does not exist"),
            1,
            no_output,
        ),
        id="reshard-source-missing",
    ),
    pytest.param(
        Case(reshard_planted, ("refusing to load", "ZeRO-3"), 1, no_output),
        id="reshard-pickle-payload-in-source",
    ),
]


@pytest.mark.parametrize("case", CONVERT + EVALUATE + CAPACITY + RESHARD)
def test_bad_input_is_refused_in_one_line(case: Case, ctx: Ctx, capsys):
    argv = case.setup(ctx)
    before = tree(ctx.ckpt["tied"])
    outcome = run_cli(argv, capsys)
    expect_error(outcome, *case.fragments, rc=case.rc)
    if case.check is not None:
        case.check(ctx)
    assert tree(ctx.ckpt["tied"]) == before, "the source checkpoint was changed"


# -------------------------------------------------------------------------- inputs that look odd but are fine


@dataclass
class Accepted:
    setup: Callable[[Ctx], list]  # -> argv (after the command name)
    check: Callable[[Ctx], None]  # the result on disk


def exported_vocab(vocab: int) -> Callable[[Ctx], None]:
    def check(c: Ctx) -> None:
        from safetensors import safe_open

        assert json.loads((c.tmp / "out" / "config.json").read_text())["vocab_size"] == vocab
        with safe_open(str(next((c.tmp / "out").glob("*.safetensors"))), "pt") as f:
            assert f.get_slice("model.embed_tokens.weight").get_shape()[0] == vocab

    return check


def evaluated(c: Ctx) -> None:
    result = json.loads((c.tmp / "ev" / "eval.json").read_text())["results"][0]
    assert np.isfinite(result["perplexity"]) and result["tokens"] > 8


def tiktoken_export_and_its_shards(c: Ctx) -> list:
    """What a tiktoken run leaves: an export holding the converted tokenizer.json, and shards whose
    manifest records the tiktoken file (another file, the same ids)."""
    from megatron_lev.data.tokenizers import build_tokenizer
    from tests.data.test_tokenizers import _tiktoken_file

    bpe = _tiktoken_file(c.tmp / "run.tiktoken", c.tokenizer)
    model = c.tmp / "tiktoken_export"
    model.mkdir()
    for f in c.hf.iterdir():
        if not f.name.startswith("tokenizer"):
            os.symlink(f, model / f.name)
    build_tokenizer("tiktoken", bpe).save_for_hf(model)
    assert sha256_file(model / "tokenizer.json") != sha256_file(bpe)
    return [
        "evaluate",
        model,
        "--data",
        shard_with_manifest(c, "tiktoken", bpe),
        "--out",
        c.tmp / "ev",
        "--threads",
        "1",
        "--seq-len",
        "8",
    ]


ACCEPTED = [
    pytest.param(
        Accepted(cv_on(with_model_vocab(50300)), exported_vocab(50300)),
        id="model-vocab-larger-than-tokenizer",
    ),
    pytest.param(
        Accepted(
            lambda c: ev("--data", shard_with_manifest(c, "hf", reformatted_tokenizer(c)))(c), evaluated
        ),
        id="shard-manifest-equivalent-tokenizer-json",
    ),
    pytest.param(
        Accepted(tiktoken_export_and_its_shards, evaluated), id="tiktoken-export-evaluates-its-own-shards"
    ),
]


@pytest.mark.parametrize("case", ACCEPTED)
def test_equivalent_input_is_accepted(case: Accepted, ctx: Ctx, capsys):
    expect_ok(run_cli(case.setup(ctx), capsys))
    case.check(ctx)


# ----------------------------------------------------------------------------- DeepSpeed files on older torch


def _fp16_optim_states(c_tmp: Path, marker: Path) -> Path:
    """What the optimizer states of an fp16 ZeRO-3 run pickle (fp16 needs CUDA, so the file is made
    here from DeepSpeed's own classes, built as its engine builds them)."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import ZeroStageEnum

    scaler = CreateLossScaler(
        dtype=torch.float16,
        static_loss_scale=0,
        dynamic_scaling=True,
        dynamic_loss_args=DeepSpeedFP16Config(enabled=True).dynamic_loss_scale_args(),
    )
    path = c_tmp / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save(
        {
            "optimizer_state_dict": {
                "zero_stage": ZeroStageEnum.weights,
                "loss_scaler": scaler,
                "dynamic_loss_scale": True,
                "overflow": False,
                "partition_count": 2,
                "fp32_flat_groups": [torch.ones(8)],
            },
            "ds_version": "0.19",
        },
        path,
    )
    return path


def _tensors_only(c_tmp: Path, marker: Path) -> Path:
    torch.save({"module": {"w": torch.ones(2)}, "iteration": 3}, c_tmp / "mp_rank_00_model_states.pt")
    return c_tmp / "mp_rank_00_model_states.pt"


def _payload(c_tmp: Path, marker: Path) -> Path:
    torch.save(
        {"module": {"w": torch.ones(2)}, "evil": Payload(marker)}, c_tmp / "mp_rank_00_model_states.pt"
    )
    return c_tmp / "mp_rank_00_model_states.pt"


def _loaded_fp16(state: dict) -> None:
    scaler = state["optimizer_state_dict"]["loss_scaler"]
    assert type(scaler).__name__ == "DynamicLossScaler" and scaler.cur_scale == 2**16 and scaler.dynamic


def _loaded_tensors(state: dict) -> None:
    assert torch.equal(state["module"]["w"], torch.ones(2))


TORCH_2_4 = ("safe_globals",)  # torch.serialization functions a torch of that version lacks
TORCH_2_3 = ("safe_globals", "add_safe_globals")
SAFE_LOAD = [  # (functions taken away, file, check of the loaded state or fragments of the refusal)
    pytest.param((), _fp16_optim_states, _loaded_fp16, id="fp16-loss-scaler"),
    pytest.param(TORCH_2_4, _fp16_optim_states, _loaded_fp16, id="fp16-loss-scaler-torch-2.4"),
    pytest.param(
        TORCH_2_3,
        _fp16_optim_states,
        ("optim_states.pt", "pickles DeepSpeed.s deepspeed", "torch >= 2.4"),
        id="fp16-loss-scaler-torch-2.3-refused",
    ),
    pytest.param(TORCH_2_3, _tensors_only, _loaded_tensors, id="tensors-torch-2.3"),
    pytest.param(TORCH_2_4, _payload, ("refusing to load", "builtins.open|open"), id="payload-torch-2.4"),
    pytest.param(TORCH_2_3, _payload, ("refusing to load", "builtins.open|open"), id="payload-torch-2.3"),
]


@pytest.mark.parametrize("missing,make,expect", SAFE_LOAD)
def test_deepspeed_files_load_without_running_code_on_every_supported_torch(
    missing, make, expect, tmp_path, monkeypatch
):
    from megatron_lev.engine.checkpoint_files import CheckpointError, load_file, safe_globals

    serialization = torch.serialization
    saved = list(serialization.get_safe_globals())
    ours = safe_globals()
    serialization.clear_safe_globals()  # start without DeepSpeed's classes allowed process-wide
    serialization.add_safe_globals([g for g in saved if g not in ours])
    marker = tmp_path / "PAYLOAD_RAN"
    try:
        path = make(tmp_path, marker)
        for name in missing:
            monkeypatch.delattr(serialization, name)
        if callable(expect):
            expect(load_file(path))
        else:
            with pytest.raises(CheckpointError) as info:
                load_file(path)
            for frag in expect:
                assert re.search(frag, str(info.value), re.IGNORECASE), f"{frag!r} not in {info.value}"
        assert not marker.exists(), "a pickle payload ran"
    finally:
        monkeypatch.undo()
        serialization.clear_safe_globals()
        serialization.add_safe_globals(saved)


# ----------------------------------------------------------------------------- file errors of our own code


def _raising(exc: BaseException):
    def fn(*args, **kwargs):
        raise exc

    return fn


GUARDED = [  # an OSError raised inside a command (not by a path the user gave) -> the error line
    pytest.param(
        lambda: FileNotFoundError(2, "No such file or directory", "/var/cache/lev/index.json"),
        ("/var/cache/lev/index.json", "not found", "--debug"),
        id="internal-missing-file",
    ),
    pytest.param(
        lambda: PermissionError(13, "Permission denied", "/data/run/.x.tmp", None, "/data/run/x"),
        ("/data/run/.x.tmp -> /data/run/x", "permission denied", "--debug"),
        id="internal-rename-names-both-files",
    ),
    pytest.param(
        lambda: FileNotFoundError("the checksum cache index is gone"),
        ("FileNotFoundError", "the checksum cache index is gone", "--debug"),
        id="internal-error-without-a-file-name",
    ),
]


@pytest.mark.parametrize("make_exc,fragments", GUARDED)
def test_file_errors_name_the_file_and_debug_shows_the_traceback(
    make_exc, fragments, tmp_path, monkeypatch, capsys
):
    from megatron_lev.commands import evaluate

    monkeypatch.setattr(evaluate, "_check_flags", _raising(make_exc()))
    argv = ["evaluate", tmp_path / "model", "--data", tmp_path / "x", "--out", tmp_path / "ev"]
    expect_error(run_cli(argv, capsys), *fragments, rc=1)
    with pytest.raises(type(make_exc())) as info:  # --debug: the exception reaches the interpreter
        run_cli([*argv, "--debug"], capsys)
    assert info.traceback and not (tmp_path / "ev").exists()


# ----------------------------------------------------------------------------- validation with the probe


def _patch_config(monkeypatch, key, value):
    from megatron_lev.convert import hf_export

    real = hf_export.write_config

    def patched(out_dir, config, max_new_tokens=64, extra=None):  # a converter bug: one wrong key
        real(out_dir, config, max_new_tokens, extra)
        cfg = json.loads((out_dir / "config.json").read_text())
        cfg[key] = value
        if key == "rope_theta":
            cfg["rope_parameters"]["rope_theta"] = value
        (out_dir / "config.json").write_text(json.dumps(cfg))

    monkeypatch.setattr(hf_export, "write_config", patched)


PROBE = [
    pytest.param("lev", "rope_theta", 20000.0, "layer 0", id="rope-theta"),
    pytest.param("tied", "rope_theta", 10100.0, "layer 0", id="rope-theta-close"),
    pytest.param("lev", "tie_word_embeddings", True, "input embedding", id="tie-word-embeddings"),
]


# ------------------------------------------------------------- a NaN in LEV rows the validation never reads


@pytest.fixture(scope="module")
def lev_run(shared_data, tmp_path_factory):
    """A real two-step `megatron-lev train` run of a LEV model with 16 knots per coordinate (so a knot
    at the edge is reached by few tokens): its save directory."""
    out = tmp_path_factory.mktemp("lev16") / "run"
    data = make_data(out.parent / "data", shared_data)
    lev = {"model.lev.d_seed": 32, "model.lev.heads": 4, "model.lev.rank": 16, "model.lev.kappa": 16}
    expect_ok(
        train_run(train_overrides(data, out, **lev, **{"model.hidden_size": 64, "train.train_iters": 2}))
    )
    return out / "ckpt"


def rows_the_validation_misses(ckpt: Path) -> tuple[tuple[int, ...], int]:
    """A `delta` element (head 0, an edge knot) whose NaN makes some rows of the materialised table
    non-finite but none of the rows the validation ids read; and how many rows."""
    from megatron_lev.convert.source import iter_canonical, open_checkpoint
    from megatron_lev.convert.validate import validation_ids
    from megatron_lev.model.embeddings import build_input_embedding

    src = open_checkpoint(ckpt, None, None)
    params = {
        n.removeprefix("embedding."): t for n, t in iter_canonical(src, False) if n.startswith("embedding.")
    }
    lev = build_input_embedding(src.cfg.model, src.padded_vocab, base_vocab=src.base_vocab).float().eval()
    lev.load_state_dict(params)
    ids = validation_ids(src.vocab_size, src.cfg.model.seq_length)
    h, d, kappa, _ = lev.delta.shape
    with torch.no_grad():
        for index in [(0, j, m, 0) for m in (0, kappa - 1) for j in range(d)]:
            kept = lev.delta[index].item()
            lev.delta[index] = float("nan")
            bad = (~torch.isfinite(lev.materialize()[: src.vocab_size])).any(dim=1)
            seen = torch.isfinite(lev(ids)).all()
            lev.delta[index] = kept
            if bad.any() and not bad[ids].any() and seen:
                return index, int(bad.sum())
    pytest.fail("no delta element of head 0 at an edge knot is missed by the validation ids")


@pytest.mark.parametrize(
    "extra", [pytest.param((), id="dense"), pytest.param(("--keep-lev",), id="keep-lev")]
)
def test_nan_in_lev_rows_the_validation_misses_is_refused(lev_run, tmp_path, capsys, extra):
    """The probed logits never read these rows: without a check of every tensor the export passed
    validation with them non-finite. Refused naming the parameter, nothing written."""
    index, rows = rows_the_validation_misses(lev_run)
    assert 0 < rows < 50277
    root = clone(lev_run, tmp_path / "ckpt")
    path = own(tag_of(root) / "mp_rank_00_model_states.pt")
    state = torch.load(path, map_location="cpu", weights_only=False)  # DeepSpeed's own file (ours)
    state["module"]["embedding.delta"][index] = float("nan")
    torch.save(state, path)
    rerecord(path)
    out = run_cli(["convert", root, tmp_path / "out", "--no-progress", *extra], capsys)
    expect_error(out, r"parameter embedding\.delta holds 1 non-finite value", "nothing was exported", rc=1)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(("out", ".out"))]


@pytest.mark.parametrize("variant,key,value,stage", PROBE)
def test_probe_catches_a_wrong_setting_the_trained_weights_hide(
    variant, key, value, stage, ctx, monkeypatch, capsys
):
    from megatron_lev.convert import hf_export

    _patch_config(monkeypatch, key, value)
    real_probe = hf_export.probe_export
    # the old check alone (the checkpoint's own weights) passes this broken export ...
    monkeypatch.setattr(hf_export, "probe_export", lambda *a, **k: hf_export.ValidationReport(0.0, {}, 0, 0))
    expect_ok(run_cli(["convert", ctx.ckpt[variant], ctx.tmp / "old", "--no-progress"], capsys))
    # ... the probe does not
    monkeypatch.setattr(hf_export, "probe_export", real_probe)
    outcome = run_cli(["convert", ctx.ckpt[variant], ctx.tmp / "out", "--no-progress"], capsys)
    expect_error(
        outcome,
        "VALIDATION FAILED",
        "probe with large random weights",
        f"stage '{stage}'",
        "config.json",
        rc=1,
    )
    assert not (ctx.tmp / "out").exists() and not (ctx.tmp / "out.partial").exists()
    assert (ctx.tmp / "out.invalid" / "config.json").is_file()


def test_an_export_transformers_cannot_load_is_a_validation_failure(ctx, monkeypatch, capsys):
    _patch_config(monkeypatch, "num_key_value_heads", 4)
    outcome = run_cli(["convert", ctx.ckpt["tied"], ctx.tmp / "out", "--no-progress"], capsys)
    expect_error(outcome, "VALIDATION FAILED", "transformers cannot load", rc=1)
    assert not (ctx.tmp / "out").exists() and (ctx.tmp / "out.invalid").is_dir()


def test_disk_full_while_writing_leaves_no_partial_export(ctx, monkeypatch, capsys):
    """ENOSPC is simulated by making the shard writer's save raise it (no tmpfs needed)."""
    import errno

    from megatron_lev.convert import hf_writer

    def full(*a, **k):
        raise OSError(
            errno.ENOSPC, "No space left on device", str(ctx.tmp / "out.partial" / ".shard-00000.tmp")
        )

    monkeypatch.setattr(hf_writer, "save_file", full)
    outcome = run_cli(["convert", ctx.ckpt["tied"], ctx.tmp / "out", "--no-progress"], capsys)
    expect_error(outcome, "no space left", "out.partial", rc=1)
    no_output(ctx)


def test_overwrite_replaces_only_after_success_and_config_with_training_only_changes_passes(ctx, capsys):
    out = write(ctx.tmp / "out" / "old.txt", "old").parent
    other = config_with(ctx, model__hidden_dropout=0.1, model__activation_checkpointing=True)
    expect_ok(
        run_cli(["convert", ctx.ckpt["tied"], out, "--overwrite", "--config", other, "--no-progress"], capsys)
    )
    assert (out / "config.json").is_file() and not (out / "old.txt").exists()
    assert [p.name for p in ctx.tmp.iterdir() if p.name.startswith(".")] == []  # no .out.old / .partial left


def test_keep_lev_export_evaluates_with_trust_remote_code(ctx, capsys):
    text = write(ctx.tmp / "t.txt", "The quick brown fox jumps over the lazy dog. " * 4)
    expect_ok(
        run_cli(
            [
                "evaluate",
                ctx.hf_lev,
                "--text",
                text,
                "--trust-remote-code",
                "--seq-len",
                "8",
                "--threads",
                "1",
                "--out",
                ctx.tmp / "ev",
            ],
            capsys,
        )
    )
    result = json.loads((ctx.tmp / "ev" / "eval.json").read_text())["results"][0]
    assert np.isfinite(result["perplexity"]) and result["tokens"] > 8


def test_zero_shot_tasks_give_the_same_numbers_on_checkpoint_and_export(ctx, capsys):
    lambada = write(
        ctx.tmp / "lambada.jsonl",
        "".join(
            json.dumps({"text": t}) + "\n"
            for t in ("the cat sat on the mat", "she opened the door", "we walked along the river bank")
        ),
    )
    wiki = write(ctx.tmp / "wiki.raw", WIKI * 3)
    results = {}
    for kind, model in (("checkpoint", ctx.ckpt["tied"]), ("export", ctx.hf)):
        argv = ["evaluate", model, "--lambada", lambada, "--wikitext", wiki, "--tokenizer", ctx.tokenizer]
        argv += ["--seq-len", "16", "--threads", "1", "--out", ctx.tmp / kind]
        expect_ok(run_cli(argv, capsys))
        results[kind] = json.loads((ctx.tmp / kind / "eval.json").read_text())["results"]
    (lam_ckpt, wiki_ckpt), (lam_hf, wiki_hf) = results["checkpoint"], results["export"]
    assert lam_ckpt["count"] == 3 and wiki_ckpt["documents"] == 3 and wiki_ckpt["tokens"] > 16
    assert lam_ckpt["acc"] == lam_hf["acc"]
    for key in ("perplexity", "mean_nll"):
        assert lam_ckpt[key] == pytest.approx(lam_hf[key], rel=1e-4)
    for key in ("word_perplexity", "bits_per_byte", "token_perplexity"):
        assert wiki_ckpt[key] == pytest.approx(wiki_hf[key], rel=1e-4)


# ----------------------------------------------------------------------------- the CPU kernel cache

EVIL_C = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) { FILE *f = fopen("%s", "w"); if (f) fclose(f); }
int lev_group_size(void) { return 0; }
"""


def _plant_library(directory: Path, marker: Path) -> Path:
    from megatron_lev.model.embeddings import cpu_kernel

    src = directory / "evil.c"
    src.write_text(EVIL_C % marker)
    lib = directory / cpu_kernel.library_name()
    subprocess.run([cpu_kernel._compiler(), "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    src.unlink()
    return lib


def _load_in_child(cache: Path) -> subprocess.CompletedProcess:
    code = (
        "from megatron_lev.model.embeddings import cpu_kernel\n"
        "print('LOADED', cpu_kernel.available(), cpu_kernel._state.get('path'))\n"
    )
    env = dict(os.environ, MEGATRON_LEV_KERNEL_CACHE=str(cache))
    env.pop(cpu_kernel_switch(), None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def cpu_kernel_switch() -> str:
    from megatron_lev.model.embeddings import cpu_kernel

    return cpu_kernel.ENV_SWITCH


def _world_writable_dir(c: Path) -> None:
    c.chmod(0o777)


def _world_writable_lib(c: Path) -> None:
    next(c.glob("lev_cpu-*.so")).chmod(0o666)


def _foreign_lib(c: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("changing a file's owner needs root")
    os.chown(next(c.glob("lev_cpu-*.so")), 65534, 65534)


def _symlinked_lib(c: Path) -> None:
    lib = next(c.glob("lev_cpu-*.so"))
    real = c.parent / "elsewhere.so"
    lib.rename(real)
    lib.symlink_to(real)


KERNEL = [
    pytest.param(_world_writable_dir, "writable by group or others", id="cache-dir-world-writable"),
    pytest.param(_world_writable_lib, "writable by group or others", id="library-world-writable"),
    pytest.param(_foreign_lib, "owned by uid 65534", id="library-of-another-user"),
    pytest.param(_symlinked_lib, "not a regular file", id="library-is-a-symlink"),
]


@pytest.mark.parametrize("weaken,reason", KERNEL)
def test_planted_kernel_library_is_never_loaded(weaken, reason, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    marker = tmp_path / "PLANTED_LIBRARY_RAN"
    _plant_library(cache, marker)
    weaken(cache)
    before = tree(cache)
    proc = _load_in_child(cache)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists(), "a library another user could write was loaded"
    loaded = Path(proc.stdout.split()[-1])
    assert (
        proc.stdout.startswith("LOADED True") and cache not in loaded.parents
    )  # the real kernel, built privately
    assert reason in proc.stderr and "private" in proc.stderr
    assert tree(cache) == before  # nothing written into the untrusted cache


def test_a_private_cache_is_used(tmp_path):
    cache = tmp_path / "cache"
    first = _load_in_child(cache)
    second = _load_in_child(cache)
    assert first.returncode == second.returncode == 0
    assert Path(second.stdout.split()[-1]).parent == cache and "private" not in second.stderr
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
