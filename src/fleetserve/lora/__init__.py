"""LoRA adapters served beside their base model.

config.py (LoRAConfig, pure), adapter.py (a PEFT folder -> validated A/B tensors),
cache.py (the engine core's CPU cache: loads off the step loop, LRU, pinned while used),
slots.py (the worker's fixed pool of `max_loras` stacked slots per layer),
layers.py (LoRALinear: a base projection + the grouped shrink/expand of its rows),
kernel.py (that kernel: kernels/lora.c through ctypes, or the torch reference),
context.py (the step's rows -> slots, set around a forward).
"""

from fleetserve.core.lora_request import LoRARequest

__all__ = ["LoRARequest"]
