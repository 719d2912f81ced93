"""What the kernel's scheduler says about each thread of this process (Linux /proc).

A step's team at 2 threads loses time in ways a wall clock does not separate: a thread
that waits at a barrier longer than libgomp's spin (GOMP_SPINCOUNT) goes to sleep in a
futex (a voluntary context switch) and must be woken; a thread that other processes
push off its core waits on the run queue. /proc/self/task/<tid>/schedstat gives each
thread's time on a CPU and time runnable but waiting, status its voluntary and
involuntary switches.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadSample:
    """One thread's counters since it started."""

    tid: int
    name: str
    cpu_s: float  # on a CPU
    runqueue_s: float  # runnable, waiting for a CPU
    voluntary: int  # went to sleep (futex waits, I/O)
    involuntary: int  # preempted

    def minus(self, earlier: ThreadSample) -> ThreadSample:
        return ThreadSample(
            self.tid,
            self.name,
            self.cpu_s - earlier.cpu_s,
            self.runqueue_s - earlier.runqueue_s,
            self.voluntary - earlier.voluntary,
            self.involuntary - earlier.involuntary,
        )


def sample_thread(tid: int) -> ThreadSample | None:
    """`tid`'s counters, or None when it has exited (or /proc has no schedstat)."""
    base = f"/proc/self/task/{tid}"
    try:
        with open(f"{base}/schedstat") as f:
            run_ns, wait_ns, _ = (int(v) for v in f.read().split())
        with open(f"{base}/comm") as f:
            name = f.read().strip()
        vol = invol = 0
        with open(f"{base}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    vol = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    invol = int(line.split()[1])
    except (OSError, ValueError):
        return None
    return ThreadSample(tid, name, run_ns * 1e-9, wait_ns * 1e-9, vol, invol)


def sample_all() -> dict[int, ThreadSample]:
    """Every thread of this process, by tid."""
    out = {}
    for entry in os.listdir("/proc/self/task"):
        s = sample_thread(int(entry))
        if s is not None:
            out[s.tid] = s
    return out


def since(before: dict[int, ThreadSample], after: dict[int, ThreadSample]) -> list[ThreadSample]:
    """Each thread's counters between two samples (a thread started in between counts
    from zero), busiest first."""
    zero = ThreadSample(0, "", 0.0, 0.0, 0, 0)
    diffs = [a.minus(before.get(tid, zero)) for tid, a in after.items()]
    return sorted(diffs, key=lambda s: -s.cpu_s)


def main_tid() -> int:
    return threading.main_thread().native_id or os.getpid()
