"""Who this process is inside a TP x PP replica, and the collectives it calls.

Ranks are laid out stage-major, so each pipeline stage's TP group is a run of consecutive
ranks::

    rank = pp_rank * tp_size + tp_rank        e.g. TP=2 x PP=2:  stage 0 = {0, 1}
                                                                  stage 1 = {2, 3}

The output rank (TP rank 0 of the last stage) samples and returns each step's
`ModelRunnerOutput`; every other rank runs the same forward and returns nothing.
Hidden states cross stages between ranks of equal TP rank (each holds the full,
all-reduced hidden state), so stage k's rank t sends to stage k+1's rank t.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Host-side seconds spent in collectives (on CUDA these time the launch, not the wire)."""

    all_reduce_s: float = 0.0
    num_all_reduces: int = 0
    all_gather_s: float = 0.0
    send_s: float = 0.0
    num_sends: int = 0
    recv_s: float = 0.0
    num_recvs: int = 0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Consecutive layers of one stage; the first `num_layers % pp_size` stages get one more
    (the last stage also runs the norm, LM head and sampler)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """KV heads a TP rank holds: its share, or one replicated head when there are fewer
    KV heads than ranks (MQA); either way they are the heads its query heads read."""
    if num_kv_heads >= tp_size:
        per_rank = num_kv_heads // tp_size
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    head = tp_rank * num_kv_heads // tp_size
    return range(head, head + 1)


def vocab_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int, int]:
    """(start, end, padded shard rows): every rank holds ceil(vocab / tp) rows so that the
    logit shards gather into one tensor; the last shard's padding rows are zeros."""
    rows = -(-vocab_size // tp_size)
    start = min(tp_rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    tp_group: Any = field(default=None, repr=False)  # ProcessGroup | None
    pp_group: Any = field(default=None, repr=False)
    # MoE blocks hold whole experts per TP rank, not slices (models/moe_sharding.py).
    expert_parallel: bool = False
    stats: CommStats = field(default_factory=CommStats, repr=False, compare=False)
    # In-flight isend handles (with their tensors, which must outlive the send).
    _pending_sends: list[tuple[Any, torch.Tensor]] = field(
        default_factory=list, repr=False, compare=False
    )

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        return self.is_last_stage and self.tp_rank == 0

    # ------------------------------------------------------------ tensor parallel
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results of row-parallel layers across the TP group, in place."""
        if self.tp_size == 1:
            return x
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.tp_group)
        self.stats.all_reduce_s += time.perf_counter() - t0
        self.stats.num_all_reduces += 1
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] shards -> [..., tp_size * n], in TP rank order."""
        if self.tp_size == 1:
            return x
        t0 = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x, group=self.tp_group)
        self.stats.all_gather_s += time.perf_counter() - t0
        return torch.cat(parts, dim=-1)

    # ---------------------------------------------------------- pipeline parallel
    def send_next(self, hidden: torch.Tensor) -> None:
        """Hand this stage's output to the next stage without waiting for it to be taken,
        so this stage can start on the next batch."""
        t0 = time.perf_counter()
        self.wait_sends()
        hidden = hidden.contiguous()
        work = dist.isend(hidden, dst=self.rank + self.tp_size, group=self.pp_group)
        self._pending_sends.append((work, hidden))
        self.stats.send_s += time.perf_counter() - t0
        self.stats.num_sends += 1

    def wait_sends(self) -> None:
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends.clear()

    def recv_prev(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        t0 = time.perf_counter()
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buf, src=self.rank - self.tp_size, group=self.pp_group)
        self.stats.recv_s += time.perf_counter() - t0
        self.stats.num_recvs += 1
        return buf


def init_distributed(
    rank: int,
    tp_size: int,
    pp_size: int,
    init_method: str,
    backend: str,
    expert_parallel: bool = False,
) -> ParallelContext:
    """Join the replica's process group and build the TP and PP subgroups.

    Every rank creates every subgroup, in the same order (torch.distributed requires it).
    """
    world = tp_size * pp_size
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = pp_group = None
    for stage in range(pp_size):
        group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
        if stage == pp_rank:
            tp_group = group
    for t in range(tp_size):
        group = dist.new_group([t + stage * tp_size for stage in range(pp_size)])
        if t == tp_rank:
            pp_group = group
    return ParallelContext(
        tp_rank, tp_size, pp_rank, pp_size, tp_group, pp_group, expert_parallel=expert_parallel
    )
