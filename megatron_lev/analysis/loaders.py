"""Find embedding matrices in `.npy` files, `.safetensors` files and Hugging Face model directories."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from megatron_lev.analysis.cosine import MatrixError

# the usual names of the input-embedding table, most specific first
INPUT_NAMES = (
    "model.embed_tokens.weight",
    "embed_tokens.weight",
    "transformer.wte.weight",
    "wte.weight",
    "gpt_neox.embed_in.weight",
    "embed_in.weight",
    "embeddings.word_embeddings.weight",
    "word_embeddings.weight",
    "model.decoder.embed_tokens.weight",
    "transformer.word_embeddings.weight",
    "language_model.model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "backbone.embeddings.weight",
    "tok_embeddings.weight",
)
OUTPUT_NAMES = ("lm_head.weight", "embed_out.weight", "output.weight", "model.lm_head.weight")


def _safetensors_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def _tensor_locations(path: Path) -> dict[str, Path]:
    """tensor name -> file holding it, for a .safetensors file or a directory of them."""
    from safetensors import safe_open

    files = [path] if path.is_file() else _safetensors_files(path)
    index = path / "model.safetensors.index.json" if path.is_dir() else None
    if index is not None and index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise MatrixError(f"{index}: not a safetensors index with a weight_map ({exc})") from None
        return {name: path / fname for name, fname in weight_map.items()}
    locations = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                locations.update({name: f for name in fh.keys()})
        except Exception as exc:  # safetensors raises its own error type for a damaged header
            raise MatrixError(f"{f}: not a readable .safetensors file ({str(exc)[:200]})") from None
    return locations


def _load_npy(path: Path) -> torch.Tensor:
    """A 2-D array of real numbers from a .npy file (never unpickled)."""
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise MatrixError(f"{path}: not a readable .npy array of numbers ({exc})") from None
    if not isinstance(arr, np.ndarray) or arr.ndim != 2:
        raise MatrixError(f"{path}: expected a 2-D (V, d) matrix, got shape {getattr(arr, 'shape', None)}")
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise MatrixError(f"{path}: expected real numbers, got dtype {arr.dtype}")
    return torch.from_numpy(arr)


def _read_tensor(file: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as fh:
            return fh.get_tensor(name)
    except Exception as exc:
        raise MatrixError(f"{file}: cannot read tensor {name!r} ({str(exc)[:200]})") from None


def _tied(path: Path) -> bool:
    cfg = path / "config.json"
    if not cfg.exists():
        return False
    data = json.loads(cfg.read_text())
    return bool(
        data.get("tie_word_embeddings", data.get("text_config", {}).get("tie_word_embeddings", False))
    )


def load_matrices(path: str | Path, tensor: str | None = None) -> dict[str, torch.Tensor]:
    """{"<path>:<role or name>": (V, d) tensor}: the input table and the output head when both exist."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.suffix == ".npy":
        if tensor is not None:
            raise MatrixError(f"--tensor {tensor!r} does not apply to a .npy file ({path})")
        return {f"{path.name}": _load_npy(path)}
    if path.is_dir() and not _safetensors_files(path):
        bins = sorted(path.glob("pytorch_model*.bin"))
        if not bins:
            raise MatrixError(f"{path}: no *.safetensors or pytorch_model*.bin weights in this directory")
        state = {}
        for b in bins:
            try:  # tensors only: a pickled object in a downloaded model never runs
                state.update(torch.load(b, map_location="cpu", weights_only=True))
            except Exception as exc:
                raise MatrixError(
                    f"{b}: not a plain PyTorch state dict of tensors "
                    f"({str(exc).strip().splitlines()[0][:200]})"
                ) from None
        locations = {name: None for name in state}
        read = lambda name: state[name]  # noqa: E731
    elif path.suffix == ".safetensors" or path.is_dir():
        locations = _tensor_locations(path)
        read = lambda name: _read_tensor(locations[name], name)  # noqa: E731
    else:
        raise MatrixError(f"{path}: expected a .npy or .safetensors file or a Hugging Face model directory")
    label = path.name
    if tensor is not None:
        if tensor not in locations:
            raise MatrixError(
                f"{path}: no tensor named {tensor!r} (--tensor); it has {sorted(locations)[:20]}..."
            )
        return {f"{label}:{tensor}": read(tensor)}
    found = {}
    for role, names in (("input", INPUT_NAMES), ("output", OUTPUT_NAMES)):
        name = next((n for n in names if n in locations), None)
        if name is not None:
            found[f"{label}:{role} ({name})"] = read(name)
    if not found:
        raise MatrixError(
            f"{path}: no input-embedding or output-head tensor under the usual names; "
            f"pass --tensor NAME (it has {sorted(locations)[:20]}...)"
        )
    if path.is_dir() and _tied(path) and len(found) == 1:
        key = next(iter(found))
        found[key.replace(":input", ":input = output (tied)")] = found.pop(key)
    return found
