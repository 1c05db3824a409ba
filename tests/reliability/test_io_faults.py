"""Faults of the machine rather than of the input, each a one-line error naming the path or port:
a directory that refuses writes (a read-only mount, or no permission) under `train` and
`train-tokenizer`, a rendezvous port already in use, and model weight files that are pickled,
truncated or garbled under `evaluate`.

A read-only file system is a real read-only bind mount when this user may mount (root); otherwise
the directory's permissions are removed instead. Permissions do not bind root, so a root user's
child process runs without CAP_DAC_OVERRIDE (`setpriv`) for the permission cases.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from megatron_lev.ckpt import layout as ck
from megatron_lev.utils.lock import DIR_LOCK_NAME
from tests.reliability.harness import ROOT, Outcome, expect_error, expect_ok, run_cli, tiny_run_overrides

pytestmark = pytest.mark.timeout(600)

TINY = ROOT / "tests" / "configs" / "tiny.yaml"
ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEGATRON_LEV_DEBUG")
IS_ROOT = os.geteuid() == 0
DROP_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


# ------------------------------------------------------------------ running and unwritable directories


def run_child(
    argv: list, *, env: dict | None = None, timeout: float = 300, drop_dac: bool = False
) -> Outcome:
    """`python -m megatron_lev *argv` in its own process group (a hang fails the test); `drop_dac`:
    without root's exemption from file permissions."""
    full = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    full.update(ENV, **(env or {}))
    cmd = [sys.executable, "-m", "megatron_lev", *map(str, argv)]
    if drop_dac and IS_ROOT:
        cmd = [*DROP_DAC, *cmd]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"megatron-lev {' '.join(map(str, argv))} hung for {timeout}s:\n{err[-3000:]}")
    return Outcome(proc.returncode, out, err)


def _can_mount() -> bool:
    if not IS_ROOT or shutil.which("mount") is None:
        return False
    probe = Path(f"/tmp/.megatron-lev-mount-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        ok = subprocess.run(["mount", "--bind", str(probe), str(probe)], capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", str(probe)], capture_output=True)
        return ok
    finally:
        probe.rmdir()


CAN_MOUNT = _can_mount()


def _permissions_bind() -> bool:
    return not IS_ROOT or shutil.which("setpriv") is not None


@contextlib.contextmanager
def unwritable(path: Path, how: str):
    """`path` refuses writes while inside: `mount` (a read-only bind mount; without mount rights,
    `chmod` instead) or `chmod` (mode 0555). Yields whether the child must drop root's exemption."""
    if how == "mount" and not CAN_MOUNT:
        how = "chmod"
    if how == "chmod" and not _permissions_bind():
        pytest.skip("root without setpriv: permissions cannot be made to apply")
    if how == "mount":
        subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], check=True)
            yield False
        finally:
            subprocess.run(["umount", str(path)], check=True)
    else:
        mode = path.stat().st_mode
        path.chmod(0o555)
        try:
            yield True
        finally:
            path.chmod(mode)


@contextlib.contextmanager
def bind_mounted(path: Path):
    """`path` as a (still writable) bind mount of itself, so that a child can remount it read-only."""
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def snapshot(root: Path) -> dict[str, str]:
    """Every file's hash, but the run's lock file: a directory made read-only under a run keeps it
    (the run cannot remove it), and once the run has ended it holds no lock."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != DIR_LOCK_NAME
    }


# ------------------------------------------------------------------ shared inputs


@pytest.fixture(scope="module", autouse=True)
def checksum_cache(tmp_path_factory):
    old = os.environ.get("MEGATRON_LEV_CACHE_DIR")
    os.environ["MEGATRON_LEV_CACHE_DIR"] = str(tmp_path_factory.mktemp("sha-cache"))
    yield
    if old is None:
        os.environ.pop("MEGATRON_LEV_CACHE_DIR", None)
    else:
        os.environ["MEGATRON_LEV_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def docs(tmp_path_factory, shared_data) -> Path:
    """300 real Wikipedia documents as JSON lines."""
    path = tmp_path_factory.mktemp("docs") / "wiki.jsonl"
    lines = []
    with open(shared_data / "minipile" / "Wikipedia_en.jsonl.zst", "rb") as f:
        for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8"):
            lines.append(line)
            if len(lines) == 300:
                break
    path.write_text("".join(lines))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory, shared_data, docs) -> dict:
    from megatron_lev.data.preprocess import PreprocessOptions, preprocess

    work = tmp_path_factory.mktemp("iodata")
    tok = str(shared_data / "tokenizers" / "gpt-neox-20b.json")
    prefix = str(work / "wiki_text_document")
    preprocess(PreprocessOptions([str(docs)], prefix, "hf", tok, workers=1, progress=False))
    return {"prefix": prefix, "tokenizer": tok, "cache": work / "cache"}


def overrides(data: dict, out: Path, **extra) -> list[str]:
    return tiny_run_overrides(data["prefix"], data["tokenizer"], data["cache"], out, **extra)


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> Path:
    """A finished 4-iteration run with checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("iotrained") / "run"
    expect_ok(run_child(["train", "--config", TINY, *overrides(data, out)]))
    return out


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(trained, dst)
    return dst


# ------------------------------------------------------------------ train: an unwritable save directory


UNWRITABLE_SAVE = [
    # (how it refuses writes, when: "start" = before the run, "mid-run" = at its first save)
    pytest.param("mount", "start", id="save-dir-read-only-mount-at-start"),
    pytest.param("chmod", "start", id="save-dir-without-write-permission-at-start"),
    pytest.param("mount", "mid-run", id="save-dir-turns-read-only-mid-run"),
    pytest.param("chmod", "mid-run", id="save-dir-loses-write-permission-mid-run"),
]


@pytest.mark.parametrize("how,when", UNWRITABLE_SAVE)
def test_a_save_directory_that_refuses_writes_is_one_line_naming_it(run_copy, data, how, when):
    """Resume 4 -> 6: refused at start, or the save at iteration 6 fails; either way one line naming
    train.save, and the checkpoint at 4 is intact."""
    ckpt = run_copy / "ckpt"
    before = snapshot(ckpt)
    over = overrides(data, run_copy, **{"train.train_iters": 6})
    if when == "start":
        with unwritable(ckpt, how) as drop:
            res = run_child(["train", "--config", TINY, *over], drop_dac=drop)
        line = expect_error(res, rf"train.save={ckpt}", "not writable", rc=1)
        assert "iter_0000005" not in res.err, "it trained before finding out it cannot save"
    else:
        how = how if CAN_MOUNT else "chmod"
        if how == "chmod" and not _permissions_bind():
            pytest.skip("root without setpriv: permissions cannot be made to apply")
        over.append("train.callbacks=[tests.reliability.save_dir_faults:SaveDirTurnsReadOnly]")
        env = {
            "MEGATRON_LEV_TEST_READONLY_AT": "6",
            "MEGATRON_LEV_TEST_READONLY_HOW": "remount" if how == "mount" else "chmod",
        }
        mounted = bind_mounted(ckpt) if how == "mount" else contextlib.nullcontext()
        try:
            with mounted:
                res = run_child(["train", "--config", TINY, *over], env=env, drop_dac=how == "chmod")
        finally:
            ckpt.chmod(0o755)
        line = expect_error(
            res, r"saving checkpoint .*iter_0000006 failed", rf"train.save={ckpt} is not writable", rc=1
        )
        assert re.search(r"iter_0000004 is unchanged", line), line
    assert snapshot(ckpt) == before, "the existing checkpoints were changed"
    assert ck.read_latest(ckpt)[0] == ck.tag_for(4)


# ------------------------------------------------------------------ train: the rendezvous port is taken


@pytest.fixture
def busy_port():
    """A port another process listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


PORT_ENVS = [
    pytest.param(
        {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, "unset it", id="master-port-in-use-one-process"
    ),
    pytest.param(
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
        "torchrun_local.sh",
        id="master-port-in-use-rank0-of-two",
    ),
]


@pytest.mark.parametrize("env,advice", PORT_ENVS)
def test_a_master_port_in_use_is_one_line_naming_it(data, tmp_path, busy_port, env, advice):
    env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(busy_port)}
    res = run_child(["train", "--config", TINY, *overrides(data, tmp_path / "run")], env=env, timeout=180)
    expect_error(res, rf"MASTER_PORT={busy_port}", "already in use", "free port", advice, rc=1)
    assert not (tmp_path / "run" / "ckpt").exists()


# ---------------------------------------------- train-tokenizer: an unwritable output directory


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("mount", id="tokenizer-dir-read-only-mount"),
        pytest.param("chmod", id="tokenizer-dir-without-permission"),
    ],
)
def test_train_tokenizer_into_a_directory_that_refuses_writes(docs, tmp_path, how):
    out = tmp_path / "tok"
    out.mkdir()
    with unwritable(out, how) as drop:
        res = run_child(
            [
                "train-tokenizer",
                "--input",
                docs,
                "--model-prefix",
                out / "spm",
                "--vocab-size",
                "400",
                "--max-mb",
                "0.2",
            ],
            drop_dac=drop,
        )
    expect_error(res, r"--model-prefix .*tok/spm", rf"cannot write in {out}", rc=1)
    assert "SentencePiece could not train" not in res.err
    assert list(out.iterdir()) == [], "files left in the output directory"


# ----------------------------------------- evaluate: pickled, truncated or garbled weight files


class Payload:
    """Unpickling this runs `open(marker, "w")`: a stand-in for code planted in a weights file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """A tiny random Llama with the GPT-NeoX vocabulary, saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=50277,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    out = tmp_path_factory.mktemp("tiny_hf") / "model"
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> Path:
    """A held-out shard set with its manifest."""
    from megatron_lev.data.indexed import IndexedDatasetBuilder
    from megatron_lev.data.manifest import write_manifest

    prefix = tmp_path_factory.mktemp("heldout") / "heldout"
    builder = IndexedDatasetBuilder(prefix, dtype=np.uint16)
    builder.add_document(np.arange(1, 60))
    builder.finalize()
    write_manifest(prefix, [str(prefix)], {}, 59)
    return prefix


def _as_bin(model: Path, extra: dict | None = None) -> None:
    from safetensors.torch import load_file

    state = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    torch.save({**state, **(extra or {})}, model / "pytorch_model.bin")


def pickled_bin(model: Path, marker: Path) -> str:
    _as_bin(model, {"evil": Payload(marker)})
    return "pytorch_model.bin"


def truncated_bin(model: Path, marker: Path) -> str:
    _as_bin(model)
    path = model / "pytorch_model.bin"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return "pytorch_model.bin"


def truncated_safetensors(model: Path, marker: Path) -> str:
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return "model.safetensors"


def garbled_safetensors(model: Path, marker: Path) -> str:
    path = model / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[:8] = b"\xff" * 8  # the header length
    path.write_bytes(bytes(raw))
    return "model.safetensors"


BAD_WEIGHTS = [
    pytest.param(pickled_bin, ("refused to unpickle", "safetensors", "convert"), id="evaluate-pickled-bin"),
    pytest.param(truncated_bin, ("truncated or damaged",), id="evaluate-truncated-bin"),
    pytest.param(
        truncated_safetensors,
        ("not a readable safetensors file", "truncated"),
        id="evaluate-truncated-safetensors",
    ),
    pytest.param(
        garbled_safetensors, ("not a readable safetensors file",), id="evaluate-garbled-safetensors"
    ),
]


@pytest.mark.parametrize("damage,fragments", BAD_WEIGHTS)
def test_evaluate_of_unusable_weight_files_names_the_file(
    tiny_hf, heldout, tmp_path, capsys, damage, fragments
):
    model = tmp_path / "model"
    shutil.copytree(tiny_hf, model)
    marker = tmp_path / "PAYLOAD_RAN"
    name = damage(model, marker)
    argv = [
        "evaluate",
        model,
        "--data",
        heldout,
        "--out",
        tmp_path / "ev",
        "--threads",
        "1",
        "--seq-len",
        "8",
    ]
    expect_error(run_cli(argv, capsys), re.escape(str(model / name)), *fragments, rc=1)
    assert not marker.exists(), "a pickle payload ran"
    assert not (tmp_path / "ev").exists(), "results written for a refused evaluation"


def test_evaluate_of_plain_tensor_bin_still_works(tiny_hf, heldout, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_hf, model)
    _as_bin(model)
    argv = [
        "evaluate",
        model,
        "--data",
        heldout,
        "--out",
        tmp_path / "ev",
        "--threads",
        "1",
        "--seq-len",
        "8",
    ]
    expect_ok(run_cli(argv, capsys))
    assert json.loads((tmp_path / "ev" / "eval.json").read_text())["results"][0]["tokens"] == 58
