"""What the docs, the Makefile and pyproject.toml promise holds: the config files the docs name exist,
the size table is what `megatron-lev params` prints, DeepSpeed's accelerator follows the machine, and
the dependencies are pinned to the ranges tested (with the installed versions inside them)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "slurm").glob("*.sbatch"))]


def test_the_docs_name_only_config_files_that_exist():
    named = {
        (doc.name, m)
        for doc in DOCS
        for m in re.findall(r"pretrain/configs/[A-Za-z0-9_./-]+\.yaml", doc.read_text())
    }
    assert named, "no config path found in the docs"
    missing = sorted(f"{doc}: {path}" for doc, path in named if not (ROOT / path).is_file())
    assert not missing, missing


def test_the_size_table_is_what_params_prints():
    """docs/model.md's sizes at o200k_base: layers, width, heads, TIED and LEV parameters, FLOPs."""
    from megatron_lev.config import load_config
    from megatron_lev.model.flops import flops_per_token, parameter_count
    from megatron_lev.model.vocab import padded_vocab_size

    rows = re.findall(r"^\| (200m|400m|1\.2b) \| (.+) \|$", (ROOT / "docs" / "model.md").read_text(), re.M)
    assert [r[0] for r in rows] == ["200m", "400m", "1.2b"]
    for name, rest in rows:
        layers, width, heads, tied, lev, gflops = (c.strip() for c in rest.split("|"))
        base = [str(ROOT / "pretrain" / "configs" / "models" / f"{name}.yaml")]
        cfg = {v: load_config(base, [f"model.embedding={v}"]).model for v in ("tied", "lev")}
        vocab = padded_vocab_size(199_999, cfg["tied"], 1)
        m = cfg["tied"]
        assert (layers, width, heads) == (str(m.num_layers), str(m.hidden_size), str(m.num_attention_heads))
        for text, variant in ((tied, "tied"), (lev, "lev")):
            count = parameter_count(cfg[variant], vocab)["total"]
            assert text.split(" ")[0] == f"{count / 1e6:,.1f}M", (name, variant, count)
        assert gflops == f"{flops_per_token(m, vocab) / 1e9:.3f}", name


def _accelerator(tmp_path, gpu: bool) -> str:
    bin_dir = tmp_path / ("gpu" if gpu else "cpu")
    bin_dir.mkdir()
    # what nvidia-smi -L does on a GPU node (list a device, status 0), or on a machine without one
    # (first on PATH, so this machine's own nvidia-smi, if any, is not asked)
    fake = bin_dir / "nvidia-smi"
    answer = "echo 'GPU 0: NVIDIA H100 80GB HBM3'" if gpu else "echo 'No devices were found' >&2; exit 6"
    fake.write_text(f"#!/bin/sh\n{answer}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    out = subprocess.run(
        ["make", "-s", "--no-print-directory", "accelerator"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_makefile_leaves_the_accelerator_to_deepspeed_on_a_gpu_node(tmp_path):
    assert _accelerator(tmp_path, gpu=False) == "DS_ACCELERATOR=cpu"
    assert _accelerator(tmp_path, gpu=True).startswith("DS_ACCELERATOR=unset")


def test_the_dependencies_are_pinned_to_the_tested_ranges_and_hold_the_installed_versions():
    import tomllib
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    for name in ("deepspeed", "torch", "transformers"):
        specs = [r.specifier for r in reqs if r.name == name]
        assert specs, name
        for spec in specs:
            assert any(s.operator == "<" for s in spec), f"{name}{spec}: no upper bound"
            installed = Version(version(name).split("+")[0])
            assert spec.contains(installed), f"installed {name} {installed} is outside {spec}"
