"""Find a checkpoint on disk and read its tensors lazily, in HF names and layout.

Two formats are accepted: a HF folder of safetensors files, or one GGUF file (see
`gguf_loader`). Pickled weights (`*.bin`, `*.pt`, `*.pth`) are refused: loading a pickle runs
arbitrary code, so fleetserve never does it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from safetensors import safe_open

if TYPE_CHECKING:  # torch is imported by whoever reads tensors, not by resolving a model
    import torch

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


class WeightReader(Protocol):
    """Reads tensors of one checkpoint by HF name, in the checkpoint's stored dtype.

    Implementations keep file handles open; they are owned by one `ModelSource` and are not
    meant to be shared across processes (each process resolves the model itself).
    """

    def tensor_names(self) -> list[str]: ...

    def get_tensor(self, name: str) -> torch.Tensor: ...

    def get_slice(self, name: str, dim: int, start: int, end: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class ModelSource:
    path: str  # what the user gave: a folder or a .gguf file
    hf_config: dict[str, Any]  # config.json contents, or synthesized in HF style for GGUF
    tokenizer_dir: str  # a folder `AutoTokenizer.from_pretrained` can load
    weights: WeightReader = field(repr=False, compare=False)
    format: str = "safetensors"  # "safetensors" | "gguf"
    generation_config: dict[str, Any] = field(default_factory=dict)

    def tensor_names(self) -> list[str]:
        return self.weights.tensor_names()

    def get_tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """One whole tensor in HF layout and shape."""
        return self.weights.get_tensor(name).to(dtype)

    def get_slice(
        self, name: str, dim: int, start: int, end: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows/columns [start, end) of `name` along `dim`; reads only that part when it can.

        This is what a tensor-parallel rank uses to load its shard without reading the rest.
        """
        return self.weights.get_slice(name, dim, start, end).to(dtype)

    def iter_tensors(
        self, dtype: torch.dtype, skip: Collection[str] = ()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor but those in `skip` (already placed, e.g. kept quantized)."""
        for name in self.tensor_names():
            if name not in skip:
                yield name, self.get_tensor(name, dtype)


class SafetensorsReader:
    """Lazy reader over one or more safetensors files (handles opened on first use)."""

    def __init__(self, weight_map: dict[str, str]) -> None:
        # tensor name -> absolute shard path
        self._weight_map = weight_map
        self._handles: dict[str, Any] = {}

    @classmethod
    def from_files(cls, files: list[str]) -> SafetensorsReader:
        weight_map: dict[str, str] = {}
        for file in files:
            # Only the header's names: "numpy" reads them without importing torch (the API
            # process resolves a model this way); tensors are read through "pt" handles.
            with safe_open(file, framework="numpy") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    weight_map[name] = file
        return cls(weight_map)

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]

    def _file_of(self, name: str) -> str:
        try:
            return self._weight_map[name]
        except KeyError:
            raise KeyError(f"checkpoint has no tensor named {name!r}") from None

    def tensor_names(self) -> list[str]:
        return list(self._weight_map)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._handle(self._file_of(name)).get_tensor(name)

    def get_slice(self, name: str, dim: int, start: int, end: int) -> torch.Tensor:
        part = self._handle(self._file_of(name)).get_slice(name)
        shape = part.get_shape()
        check_slice(name, shape, dim, start, end)
        index = (slice(None),) * dim + (slice(start, end),)
        return part[index]


def check_slice(name: str, shape: list[int], dim: int, start: int, end: int) -> None:
    if not 0 <= dim < len(shape):
        raise ValueError(f"dim must be in [0, {len(shape)}) for {name!r}, got {dim}")
    if not 0 <= start <= end <= shape[dim]:
        raise ValueError(
            f"slice [{start}, {end}) out of range for {name!r} dim {dim} of size {shape[dim]}"
        )


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _safetensors_files(folder: str) -> list[str]:
    index_path = os.path.join(folder, _INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no 'weight_map'")
        files = [os.path.join(folder, shard) for shard in sorted(set(weight_map.values()))]
        for file in files:
            if not os.path.isfile(file):
                raise FileNotFoundError(f"shard {file} named in {index_path} does not exist")
        return files
    single = os.path.join(folder, _SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    return sorted(
        os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".safetensors")
    )


def _refuse_pickles(folder: str) -> None:
    pickles = sorted(n for n in os.listdir(folder) if n.endswith(_PICKLE_SUFFIXES))
    if pickles:
        raise ValueError(
            f"{folder} holds only pickled weights ({', '.join(pickles)}); fleetserve never "
            "unpickles checkpoints because that can run arbitrary code. Convert them to "
            "safetensors first (e.g. load with transformers and "
            "save_pretrained(..., safe_serialization=True))."
        )
    raise FileNotFoundError(
        f"{folder} has no weights: expected {_SINGLE_FILE}, {_INDEX_FILE} with shards, "
        "or one .gguf file"
    )


def _resolve_safetensors(folder: str) -> ModelSource:
    files = _safetensors_files(folder)
    if not files:
        _refuse_pickles(folder)
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path} does not exist; a HF checkpoint folder needs it")
    gen_path = os.path.join(folder, "generation_config.json")
    return ModelSource(
        path=folder,
        hf_config=_read_json(config_path),
        tokenizer_dir=folder,
        weights=SafetensorsReader.from_files(files),
        format="safetensors",
        generation_config=_read_json(gen_path) if os.path.isfile(gen_path) else {},
    )


def resolve_model(path: str) -> ModelSource:
    """Open the checkpoint at `path`: a HF safetensors folder, a .gguf file, or a folder with
    exactly one .gguf file. Tensors are read lazily, on request."""
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model path {path!r} does not exist (fleetserve loads local folders and .gguf "
            "files; it does not download from a hub)"
        )
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return _resolve_gguf(path)
        raise ValueError(f"model path {path!r} is a file but not a .gguf; pass its folder")
    folder = os.path.abspath(path)
    has_safetensors = any(n.endswith(".safetensors") for n in os.listdir(folder))
    ggufs = sorted(n for n in os.listdir(folder) if n.endswith(".gguf"))
    if has_safetensors or not ggufs:
        return _resolve_safetensors(folder)
    if len(ggufs) > 1:
        raise ValueError(
            f"{folder} holds several .gguf files ({', '.join(ggufs)}); pass one file's path"
        )
    return _resolve_gguf(os.path.join(folder, ggufs[0]))


def _resolve_gguf(path: str) -> ModelSource:
    # Imported here so that safetensors-only users (and the API process serving them)
    # never pay for importing gguf and torch.
    from fleetserve.models import gguf_loader

    return gguf_loader.resolve_gguf(path)
