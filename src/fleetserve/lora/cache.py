"""The engine core's LoRA adapters: loaded off the step loop, kept up to `max_cpu_loras`.

A request whose adapter is not loaded waits here (not in the scheduler) while a loader
thread reads and checks the folder; the step loop only picks up finished loads between
steps (`poll`), hands the adapter to the workers and lets its requests in. Beyond
`max_cpu_loras` the least recently used adapter that no unfinished request uses is
dropped (an adapter in use is never dropped, so the cache may hold more while they run).
A load that fails fails its waiting requests with the loader's ValueError.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from fleetserve.config import ModelConfig
from fleetserve.core.lora_request import LoRARequest
from fleetserve.core.request import Request
from fleetserve.lora.adapter import LoRAAdapter, load_adapter
from fleetserve.lora.config import LoRAConfig


@dataclass
class LoRAStats:
    """Per adapter name: loads done, evictions; both monotonic (exported as counters)."""

    loads: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)
    load_seconds: dict[str, float] = field(default_factory=dict)


class AdapterCache:
    def __init__(
        self,
        lcfg: LoRAConfig,
        model_cfg: ModelConfig,
        add_to_workers: Callable[[LoRAAdapter], None],
        remove_from_workers: Callable[[str], None],
    ) -> None:
        self.lcfg = lcfg
        self.model_cfg = model_cfg
        self._add = add_to_workers
        self._remove = remove_from_workers
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()  # LRU first
        self._loading: dict[str, tuple[LoRARequest, Future[LoRAAdapter]]] = {}
        self.parked: dict[str, list[Request]] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        self._wake = threading.Event()
        self.stats = LoRAStats()

    # -------------------------------------------------------------- requests
    def is_ready(self, lora: LoRARequest) -> bool:
        held = self.loaded.get(lora.lora_name)
        if held is not None and held.path == lora.lora_path:
            self.loaded.move_to_end(lora.lora_name)
            return True
        return False

    def park(self, request: Request) -> None:
        """Hold `request` until its adapter is loaded (starting the load if need be)."""
        lora = request.lora_request
        assert lora is not None
        self.parked.setdefault(lora.lora_name, []).append(request)
        if lora.lora_name not in self._loading:
            self._start(lora)

    def _start(self, lora: LoRARequest) -> None:
        fut = self._pool.submit(
            load_adapter, lora.lora_name, lora.lora_path, self.model_cfg, self.lcfg.max_lora_rank
        )
        fut.add_done_callback(lambda _: self._wake.set())
        self._loading[lora.lora_name] = (lora, fut)

    def num_parked(self) -> int:
        return sum(len(v) for v in self.parked.values())

    def unpark(self, req_ids: set[str]) -> list[Request]:
        """Take parked requests out (aborted before their adapter came)."""
        taken: list[Request] = []
        for name, reqs in list(self.parked.items()):
            keep = [r for r in reqs if r.req_id not in req_ids]
            taken.extend(r for r in reqs if r.req_id in req_ids)
            self.parked[name] = keep
        return taken

    def wait(self, timeout_s: float) -> None:
        """Sleep until a load finishes (or `timeout_s`): the loop's idle wait while only
        parked requests are left."""
        self._wake.wait(timeout_s)
        self._wake.clear()

    # ---------------------------------------------------------------- loads
    def poll(self, in_use: set[str]) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Finished loads: (requests now free to run, (request, error) for failed ones).

        `in_use`: adapters of the scheduler's unfinished requests (never evicted)."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for name, (lora, fut) in list(self._loading.items()):
            if not fut.done():
                continue
            del self._loading[name]
            waiting = self.parked.pop(name, [])
            try:
                adapter = fut.result()
            except Exception as e:  # ValueError from the checks, OSError from the disk
                msg = str(e) if isinstance(e, ValueError) else f"LoRA adapter {name!r}: {e}"
                failed.extend((r, msg) for r in waiting)
                continue
            # Requests of another version of this name (a new path) wait for the next load.
            same = [r for r in waiting if r.lora_request == lora]
            other = [r for r in waiting if r.lora_request != lora]
            if name in self.loaded:
                if name in in_use:
                    # The old version still runs: try again once its requests are done.
                    self.parked.setdefault(name, []).extend(waiting)
                    self._start(lora)
                    continue
                self._drop(name, evicted=False)
            self.loaded[name] = adapter
            self._add(adapter)
            self.stats.loads[name] = self.stats.loads.get(name, 0) + 1
            ready.extend(same)
            if other:
                self.parked[name] = other
                assert other[0].lora_request is not None
                self._start(other[0].lora_request)
        self._evict(in_use | {r.lora_name for r in ready if r.lora_name})
        return ready, failed

    def preload(self, lora: LoRARequest, in_use: frozenset[str] = frozenset()) -> LoRAAdapter:
        """Load now, in the caller's thread (adapters named at start-up, the offline
        engine); `in_use` as for `poll`."""
        adapter = load_adapter(
            lora.lora_name, lora.lora_path, self.model_cfg, self.lcfg.max_lora_rank
        )
        if lora.lora_name in self.loaded:
            self._drop(lora.lora_name, evicted=False)
        self.loaded[lora.lora_name] = adapter
        self._add(adapter)
        self.stats.loads[lora.lora_name] = self.stats.loads.get(lora.lora_name, 0) + 1
        self._evict(set(in_use) | {lora.lora_name})
        return adapter

    def _evict(self, in_use: set[str]) -> None:
        excess = len(self.loaded) - self.lcfg.cpu_capacity
        for name in list(self.loaded):
            if excess <= 0:
                break
            if name not in in_use:
                self._drop(name, evicted=True)
                excess -= 1

    def _drop(self, name: str, evicted: bool) -> None:
        del self.loaded[name]
        self._remove(name)
        if evicted:
            self.stats.evictions[name] = self.stats.evictions.get(name, 0) + 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
