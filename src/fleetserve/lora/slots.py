"""The worker's side of LoRA: the model's projections wrapped, adapters held in memory,
and a fixed pool of `max_loras` slots the step's adapters are copied into.

The engine core decides which adapters are loaded (lora/cache.py) and hands each one
over once (`add`) and takes it back when it drops it (`remove`); the scheduler never
puts more than `max_loras` adapters in one step, so `prepare` always finds them slots:
a free one, else the least recently used one no row of this step needs. Under tensor
parallelism each rank copies only its share: column-parallel projections (q/k/v,
gate/up) their rows of B, row-parallel ones (o_proj, down_proj) their columns of A.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from fleetserve.distributed.parallel_state import ParallelContext
from fleetserve.lora.adapter import FUSED, LoRAAdapter
from fleetserve.lora.config import LoRAConfig
from fleetserve.lora.kernel import RowGroups, c_kernel_available, group_rows
from fleetserve.lora.layers import LoRALinear
from fleetserve.models.llama import LlamaForCausalLM

# (global layer, HF projection, dim the rank's share is cut along (-1: whole), start, end)
_Source = tuple[int, str, int, int, int]


def _sources(
    model: LlamaForCausalLM, parallel: ParallelContext | None, local_layer: int, fused: str
) -> list[_Source]:
    """Where each segment of this rank's `fused` module of `local_layer` comes from."""
    if parallel is None:
        return [(local_layer, hf, -1, 0, 0) for hf in FUSED[fused]]
    from fleetserve.models.sharding import _pieces

    sub = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
    pieces = _pieces(f"model.layers.{local_layer}.{sub}.{fused}.weight", model, parallel)
    assert pieces is not None
    out: list[_Source] = []
    for src, dim, start, end, _ in pieces:
        parts = src.split(".")  # model.layers.{global}.{sub}.{hf}.weight
        out.append((int(parts[2]), parts[4], dim, start, end))
    return out


class LoRASlots:
    def __init__(
        self,
        model: LlamaForCausalLM,
        lcfg: LoRAConfig,
        parallel: ParallelContext | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.max_loras = lcfg.max_loras
        self.adapters: dict[str, LoRAAdapter] = {}
        # slot -> adapter name; most recently used last.
        self.slots: OrderedDict[int, str | None] = OrderedDict(
            (i, None) for i in range(lcfg.max_loras)
        )
        self.slot_of: dict[str, int] = {}
        self.modules: list[tuple[LoRALinear, list[_Source]]] = []
        # Per decoder layer: its wrapped projections by fused name.
        self.by_layer: list[dict[str, LoRALinear]] = []
        self.dtype = slot_dtype(lcfg.lora_dtype, model.config.dtype, device)
        for i, layer in enumerate(model.decoder_layers()):
            attn, mlp = layer.self_attn, layer.mlp
            # A mixture-of-experts block has no gate_up/down: attention projections only
            # (adapters that target the MLP are refused at load: lora/adapter.py).
            inter = getattr(mlp, "intermediate_size", 0)  # this rank's share under TP
            specs = {
                "qkv_proj": (attn, attn.qkv_proj, [attn.q_size, attn.kv_size, attn.kv_size]),
                "o_proj": (attn, attn.o_proj, [model.config.hidden_size]),
                "gate_up_proj": (mlp, getattr(mlp, "gate_up_proj", None), [inter] * 2),
                "down_proj": (mlp, getattr(mlp, "down_proj", None), [model.config.hidden_size]),
            }
            in_features = {
                "qkv_proj": model.config.hidden_size,
                "o_proj": attn.q_size,
                "gate_up_proj": model.config.hidden_size,
                "down_proj": inter,
            }
            wrapped_here: dict[str, LoRALinear] = {}
            for fused, (owner, base, sizes) in specs.items():
                if base is None:
                    continue
                wrapped = LoRALinear(
                    base,
                    in_features[fused],
                    sizes,
                    lcfg.max_loras,
                    lcfg.max_lora_rank,
                    self.dtype,
                    device,
                )
                setattr(owner, fused, wrapped)
                self.modules.append((wrapped, _sources(model, parallel, i, fused)))
                wrapped_here[fused] = wrapped
            self.by_layer.append(wrapped_here)

    def bind_decode_step(self, model: LlamaForCausalLM) -> bool:
        """Let the model's C step (if it has one) apply the slots to adapter rows, instead of
        sending such steps down the module path. Returns whether it did."""
        from fleetserve.lora.fused import PROJECTIONS, FusedLoRA, fusable

        if model.model.decode_plan is None or not all(fusable(m) for m, _ in self.modules):
            return False
        if any(set(layer) != set(PROJECTIONS) for layer in self.by_layer):
            return False
        model.model.decode_lora = FusedLoRA(self.by_layer)
        return True

    # ------------------------------------------------------------- adapters
    def add(self, adapter: LoRAAdapter) -> None:
        self.remove(adapter.name)
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self.slots[slot] = None
            self.slots.move_to_end(slot, last=False)  # a free slot is taken first
            for module, _ in self.modules:
                module.clear_slot(slot)

    # ----------------------------------------------------------------- step
    def prepare(self, row_adapters: list[str | None]) -> RowGroups | None:
        """Slots for this step's adapters (copied in where missing); rows -> groups."""
        needed = {n for n in row_adapters if n is not None}
        if not needed:
            return None
        if len(needed) > self.max_loras:
            raise RuntimeError(f"{len(needed)} adapters in one step, max_loras={self.max_loras}")
        for name in needed:
            if name not in self.slot_of:
                self._load(name, needed)
            self.slots.move_to_end(self.slot_of[name])
        return group_rows([None if n is None else self.slot_of[n] for n in row_adapters])

    def _load(self, name: str, needed: set[str]) -> None:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise RuntimeError(f"LoRA adapter {name!r} was scheduled before it was added")
        slot = next(s for s, held in self.slots.items() if held is None or held not in needed)
        old = self.slots[slot]
        if old is not None:
            del self.slot_of[old]
        self.slots[slot] = name
        self.slot_of[name] = slot
        for module, sources in self.modules:
            module.set_slot(slot, [_share(adapter, src) for src in sources])


def slot_dtype(
    lora_dtype: str, model_dtype: torch.dtype, device: torch.device | None
) -> torch.dtype:
    """The dtype the slots store A and B in (see LoRAConfig.lora_dtype)."""
    if lora_dtype == "float32":
        return torch.float32
    if lora_dtype == "bfloat16":
        return torch.bfloat16
    on_cpu = device is None or device.type == "cpu"
    if model_dtype == torch.float32 and on_cpu and c_kernel_available():
        return torch.bfloat16
    return model_dtype


def _share(adapter: LoRAAdapter, src: _Source) -> tuple[torch.Tensor, torch.Tensor] | None:
    """This rank's part of one projection's pair (None: the adapter does not target it)."""
    layer, hf, dim, start, end = src
    w = adapter.weights.get((layer, hf))
    if w is None:
        return None
    if dim == 0:  # column-parallel: this rank's output rows
        return w.a, w.b[start:end]
    if dim == 1:  # row-parallel: this rank's input columns
        return w.a[:, start:end], w.b
    return w.a, w.b
