"""CPU work proportional to a request's size (JSON of a large body, a long prompt's
tokenization, a chat template) runs here, off the event loop: the loop keeps answering
/health, streams and other requests meanwhile.

Bounded: a small pool of threads, so a flood of large requests waits its turn instead of
taking every core (the engine processes need them) or growing memory with each one at
once. The tokenizers release the GIL while they encode; json and Python code share it in
short slices, so the loop is never held for a whole request's worth of work.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

NUM_THREADS = 2
# Below this many bytes (or characters) the work takes less than the hop to a thread.
SMALL = 64 * 1024

_pool = ThreadPoolExecutor(NUM_THREADS, thread_name_prefix="fleetserve-cpu")


async def run_cpu(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """`fn(*args, **kwargs)` on the CPU pool; raises what it raises."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool, functools.partial(fn, *args, **kwargs))
