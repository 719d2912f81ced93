"""A generate model's LoRA adapters, each served under its own name.

Adapters come from the fleet file (`adapters:` per model), `--lora-modules`, or
`POST /v1/load_lora_adapter` while serving; a request names one as its `model`. Loading
here checks the folder against the base model (PEFT format, rank, target modules,
shapes) in a thread, so a bad one is a 400 before any request uses it; the engines load
it again themselves when a request first needs it (off their step loops). Unloading
forgets the name: requests already sent keep their adapter and finish; the engines drop
it when it becomes their least recently used.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fleetserve.config import EngineConfig
from fleetserve.core.lora_request import LoRARequest
from fleetserve.engine.arg_utils import EngineArgs


class UnknownAdapterError(LookupError):
    """No adapter of that name (a 404 naming it)."""


class AdapterTable:
    def __init__(self, model_name: str, config: EngineConfig, args: EngineArgs) -> None:
        self.model_name = model_name
        self.config = config
        self.args = args
        self._by_name: dict[str, LoRARequest] = {}
        self._next_id = 1
        if config.lora is not None:
            for name, path in config.lora.modules:
                self._add(name, path)

    @property
    def enabled(self) -> bool:
        return self.config.lora is not None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)

    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name: str) -> LoRARequest:
        lora = self._by_name.get(name)
        if lora is None:
            raise UnknownAdapterError(
                f"the LoRA adapter {name!r} does not exist for model {self.model_name!r}"
            )
        return lora

    def _add(self, name: str, path: str) -> LoRARequest:
        lora = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        self._by_name[name] = lora
        return lora

    async def load(self, name: str, path: str) -> LoRARequest:
        """Checks the adapter at `path` against the base model and serves it as `name`
        (ValueError naming the problem)."""
        lcfg = self.config.lora
        if lcfg is None:
            raise ValueError(
                f"model {self.model_name!r} was started without LoRA (--enable-lora, or "
                "`adapters:` in the fleet file)"
            )
        if not name or name != name.strip() or any(c.isspace() for c in name):
            raise ValueError(f"lora_name {name!r}: no spaces or control characters")
        if name == self.model_name:
            raise ValueError(f"lora_name {name!r} is the base model's name")
        if name in self._by_name:
            raise ValueError(f"the LoRA adapter {name!r} is already loaded; unload it first")
        from fleetserve.lora.adapter import load_adapter  # torch: only when one is loaded

        await asyncio.to_thread(load_adapter, name, path, self.config.model, lcfg.max_lora_rank)
        if name in self._by_name:  # loaded by a concurrent call meanwhile
            raise ValueError(f"the LoRA adapter {name!r} is already loaded; unload it first")
        return self._add(name, path)

    def unload(self, name: str) -> None:
        if self._by_name.pop(name, None) is None:
            raise UnknownAdapterError(
                f"the LoRA adapter {name!r} does not exist for model {self.model_name!r}"
            )

    def cards(self, created: int) -> list[dict[str, Any]]:
        """Their /v1/models entries: each names its base model as `parent`."""
        return [
            {
                "id": lora.lora_name,
                "object": "model",
                "created": created,
                "owned_by": "fleetserve",
                "kind": "generate",
                "root": lora.lora_path,
                "parent": self.model_name,
            }
            for lora in self._by_name.values()
        ]
