"""Find embedding matrices in `.npy` files, `.safetensors` files and Hugging Face model directories."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

# the usual names of the input-embedding table, most specific first
INPUT_NAMES = (
    "model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight", "wte.weight",
    "gpt_neox.embed_in.weight", "embed_in.weight", "embeddings.word_embeddings.weight",
    "word_embeddings.weight", "model.decoder.embed_tokens.weight", "transformer.word_embeddings.weight",
    "language_model.model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
    "backbone.embeddings.weight", "tok_embeddings.weight",
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
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / fname for name, fname in weight_map.items()}
    locations = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            locations.update({name: f for name in fh.keys()})
    return locations


def _read_tensor(file: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as fh:
        return fh.get_tensor(name)


def _tied(path: Path) -> bool:
    cfg = path / "config.json"
    if not cfg.exists():
        return False
    data = json.loads(cfg.read_text())
    return bool(data.get("tie_word_embeddings", data.get("text_config", {}).get("tie_word_embeddings", False)))


def load_matrices(path: str | Path, tensor: str | None = None) -> dict[str, torch.Tensor]:
    """{"<path>:<role or name>": (V, d) tensor}: the input table and the output head when both exist."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.suffix == ".npy":
        if tensor is not None:
            raise ValueError(f"--tensor {tensor!r} does not apply to a .npy file ({path})")
        return {f"{path.name}": torch.from_numpy(np.load(path))}
    if path.is_dir() and not _safetensors_files(path):
        bins = sorted(path.glob("pytorch_model*.bin"))
        if not bins:
            raise ValueError(f"{path}: no *.safetensors or pytorch_model*.bin weights in this directory")
        state = {}
        for b in bins:
            state.update(torch.load(b, map_location="cpu", weights_only=True))
        locations = {name: None for name in state}
        read = lambda name: state[name]  # noqa: E731
    elif path.suffix == ".safetensors" or path.is_dir():
        locations = _tensor_locations(path)
        read = lambda name: _read_tensor(locations[name], name)  # noqa: E731
    else:
        raise ValueError(f"{path}: expected a .npy or .safetensors file or a Hugging Face model directory")
    label = path.name
    if tensor is not None:
        if tensor not in locations:
            raise KeyError(f"{path}: no tensor named {tensor!r}; it has {sorted(locations)[:20]}...")
        return {f"{label}:{tensor}": read(tensor)}
    found = {}
    for role, names in (("input", INPUT_NAMES), ("output", OUTPUT_NAMES)):
        name = next((n for n in names if n in locations), None)
        if name is not None:
            found[f"{label}:{role} ({name})"] = read(name)
    if not found:
        raise KeyError(f"{path}: no input-embedding or output-head tensor under the usual names; "
                       f"pass --tensor NAME (it has {sorted(locations)[:20]}...)")
    if path.is_dir() and _tied(path) and len(found) == 1:
        key = next(iter(found))
        found[key.replace(":input", ":input = output (tied)")] = found.pop(key)
    return found
