"""The package works when installed, not only from a checkout.

The configs and DeepSpeed templates live once, in the package (megatron_lev/resources/); a checkout's
top-level pretrain/configs and ds_configs are symbolic links to them. Names resolve as given first,
then in the package. The wheel is built from a copy of the sources, installed into a fresh directory,
and run from elsewhere with the checkout out of sight: `params` and a 2-step `train` of the packaged
tiny.yaml.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from megatron_lev import resources
from megatron_lev.config import load_config
from megatron_lev.plan.ds_config import resolve_template_path
from tests.conftest import ROOT
from tests.data.conftest import read_docs
from tests.tiny_run import CONFIG_SCHEDULE, tiny_overrides

LINKS = {ROOT / "pretrain" / "configs": resources.CONFIG_DIR, ROOT / "ds_configs": resources.DS_CONFIG_DIR}


def _files(folder: Path) -> list[str]:
    return [
        p.relative_to(folder).as_posix()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    ]


@pytest.mark.parametrize("link, packaged", LINKS.items(), ids=["configs", "ds_configs"])
def test_top_level_folders_link_to_the_package(link, packaged):
    """One copy: the checkout's documented folders are relative links into the package, not second copies."""
    where = f"{link.relative_to(ROOT)} -> {packaged.relative_to(ROOT)}"
    assert link.is_symlink(), f"{where} should be a symbolic link, not a second copy"
    assert not Path(os.readlink(link)).is_absolute(), os.readlink(link)
    assert link.resolve() == packaged.resolve()
    assert _files(packaged) and not any((packaged / rel).is_symlink() for rel in _files(packaged))


def test_names_resolve_as_given_then_packaged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no pretrain/ or ds_configs/ here
    tiny = resources.CONFIG_DIR / "tiny.yaml"
    assert resources.config_path("tiny.yaml") == tiny
    assert resources.config_path("pretrain/configs/tiny.yaml") == tiny
    assert resources.config_path("models/200m.yaml") == resources.CONFIG_DIR / "models" / "200m.yaml"
    assert resources.config_path("nope.yaml") == Path("nope.yaml")  # unchanged: the caller says "not found"
    assert resources.config_path("../resources/__init__.py") == Path("../resources/__init__.py")
    assert resolve_template_path("zero2") == resources.DS_CONFIG_DIR / "zero2.json"
    assert resolve_template_path("ds_configs/zero2.json") == resources.DS_CONFIG_DIR / "zero2.json"
    # includes resolve inside the package (tiny.yaml includes models/tiny.yaml)
    assert load_config("tiny.yaml", validate=False).model.name == "tiny"
    assert load_config("experiments/small/small.yaml", validate=False).model.num_layers == 4
    # a user's own file of the same name wins
    (tmp_path / "tiny.yaml").write_text("model:\n  name: mine\n")
    (tmp_path / "zero2.json").write_text("{}")
    assert resources.config_path("tiny.yaml") == Path("tiny.yaml")
    assert load_config("tiny.yaml", validate=False).model.name == "mine"
    assert resolve_template_path("zero2.json") == Path("zero2.json")


def _child_env(site: Path) -> dict[str, str]:
    """The installed package first, then the venv's own site-packages (read without its .pth files, so the
    editable install's finder is never loaded), and no trace of the checkout."""
    paths = sysconfig.get_paths()
    keep = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    return {
        **keep,
        "PYTHONPATH": os.pathsep.join(dict.fromkeys([str(site), paths["purelib"], paths["platlib"]])),
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _pip(*args: str) -> None:
    """Offline: the venv's own setuptools builds, nothing is downloaded."""
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"pip {args[0]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A wheel built from a copy of the sources (with the checkout's top-level links), installed into its
    own directory: that directory."""
    work = tmp_path_factory.mktemp("install")
    src = work / "src"
    shutil.copytree(
        ROOT / "megatron_lev",
        src / "megatron_lev",
        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"),
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for link in LINKS:
        (src / link.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        (src / link.relative_to(ROOT)).symlink_to(os.readlink(link), target_is_directory=True)
    dist, site = work / "dist", work / "site"
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), str(src))
    (wheel,) = dist.glob("megatron_lev-*.whl")
    entries = {info.filename: info for info in zipfile.ZipFile(wheel).infolist()}
    for packaged in LINKS.values():
        for rel in _files(packaged):
            name = f"megatron_lev/resources/{packaged.name}/{rel}"
            assert name in entries, f"{rel} is not in {wheel.name}"
            mode = entries[name].external_attr >> 16
            assert not stat.S_ISLNK(mode), f"{name} is a link in {wheel.name}, not a file"
    assert not [n for n in entries if n.startswith(("pretrain/", "ds_configs/"))], "links packaged"
    _pip("install", "--no-deps", "--no-index", "--target", str(site), str(wheel))
    return site


def _run(site: Path, cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -S ARGS` (no site hooks, so no editable install) in `cwd`, with the installed package."""
    proc = subprocess.run(
        [sys.executable, "-S", *args],
        cwd=cwd,
        env=_child_env(site),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"{args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def test_installed_package_resolves_from_itself(installed, tmp_path):
    probe = (
        "import json, megatron_lev\n"
        "from megatron_lev import resources\n"
        "from megatron_lev.plan.ds_config import resolve_template_path\n"
        "print(json.dumps({'package': megatron_lev.__file__, 'tiny': str(resources.config_path('tiny.yaml')),"
        " 'zero1': str(resolve_template_path('zero1')), 'checkout': str(resources.checkout_root())}))"
    )
    where = json.loads(_run(installed, tmp_path, "-c", probe).stdout)
    assert where["checkout"] == "None"
    for key in ("package", "tiny", "zero1"):
        assert Path(where[key]).resolve().is_relative_to(installed.resolve()), (key, where[key])


def test_installed_package_runs_params_and_trains(installed, tmp_path, shared_data):
    script = installed / "bin" / "megatron-lev"  # the console script, run with -S like the rest
    table = _run(installed, tmp_path, str(script), "params", "--sizes", "tiny", "200m").stdout
    assert "tiny" in table and "200m" in table and "lev" in table

    from megatron_lev.data.preprocess import PreprocessOptions, preprocess

    tokenizer = str(shared_data / "tokenizers" / "gpt-neox-20b.json")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(
        "".join(
            json.dumps(d) + "\n" for d in read_docs(shared_data / "minipile" / "Wikipedia_en.jsonl.zst", 200)
        )
    )
    prefix = tmp_path / "shard" / "wiki"
    preprocess(PreprocessOptions([str(jsonl)], str(prefix), "hf", tokenizer, workers=1, progress=False))
    out = tmp_path / "run"
    overrides = tiny_overrides(
        prefix, tokenizer, out, **{**CONFIG_SCHEDULE, "train.train_iters": 2, "train.lr_warmup_iters": 1}
    )
    _run(
        installed,
        tmp_path,
        "-m",
        "megatron_lev",
        "train",
        "--config",
        "tiny.yaml",
        *overrides,
        timeout=240,
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = sorted(r["iteration"] for r in records if r.get("kind") == "train")
    assert steps == [1, 2], records
