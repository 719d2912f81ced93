"""Which LoRA adapter a request runs with (pure Python, so core/ can carry it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter by name (what clients call it), id and folder.

    The name is the adapter's identity in the engine and the fleet: its slot, its CPU
    cache entry, its metrics label and (with the path) its prefix-cache salt. `id` is
    vLLM's `lora_int_id`, kept for API compatibility; it must be positive.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name or self.lora_name != self.lora_name.strip():
            raise ValueError(f"lora_name must be a non-empty name, got {self.lora_name!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("lora_path must name the adapter's folder")

    @property
    def cache_salt(self) -> int:
        """Seeds the prefix-cache hash chain of this adapter's requests: blocks computed
        under one adapter (or the base model, salt None) are never another's hits."""
        return hash(("lora", self.lora_name, self.lora_path))
