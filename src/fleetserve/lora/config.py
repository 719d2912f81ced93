"""LoRA settings of one engine (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass

# Ranks a slot holds at most; PEFT's own default is 8, fine-tunes rarely pass 64.
MAX_SUPPORTED_RANK = 256
# How the slots store A and B (vLLM's --lora-dtype): "auto" is bfloat16 where the C kernel
# runs (a decode step's LoRA work is bound by reading the slots: bf16 halves it; the math
# stays float32), else the model's dtype.
LORA_DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class LoRAConfig:
    """`max_loras` adapters may run in one step (their rows share the batch);
    `max_cpu_loras` stay loaded in memory, least recently used beyond that dropped;
    `modules` are adapters known by name from the start (`--lora-modules name=path`)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    modules: tuple[tuple[str, str], ...] = ()
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {LORA_DTYPES}, got {self.lora_dtype!r}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_SUPPORTED_RANK:
            raise ValueError(
                f"max_lora_rank must be in [1, {MAX_SUPPORTED_RANK}], got {self.max_lora_rank}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}"
            )
        names = [n for n, _ in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names must be unique, got {names}")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def parse_lora_modules(value: object) -> tuple[tuple[str, str], ...]:
    """`lora_modules` as given: {"name": "path"}, ["name=path", ...] or [{"name", "path"}]."""
    if value is None:
        return ()
    items: list[tuple[str, str]] = []
    if isinstance(value, dict):
        items = [(str(k), str(v)) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        for entry in value:
            if isinstance(entry, str):
                name, sep, path = entry.partition("=")
                if not sep or not name or not path:
                    raise ValueError(f"lora_modules entry {entry!r} must be name=path")
                items.append((name, path))
            elif isinstance(entry, dict) and {"name", "path"} <= set(entry):
                items.append((str(entry["name"]), str(entry["path"])))
            elif isinstance(entry, (list, tuple)) and len(entry) == 2:
                items.append((str(entry[0]), str(entry[1])))
            else:
                raise ValueError(f"lora_modules entry {entry!r} must be name=path")
    else:
        raise ValueError(f"lora_modules must be a mapping or a list of name=path, got {value!r}")
    return tuple(items)
