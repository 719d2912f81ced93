"""The decode step in C (decode_step.c): the plan's ctypes mirror and the call.

A `DecodePlan` holds, per decoder layer, the raw pointers of what does not change
between steps (norm weights, projection weights in their kernel layouts, the layer's KV
cache, the rotary tables), bound once after the model is loaded and its caches are
allocated. `run` then takes only what a step changes: the embeddings of its rows and
where each row's key and value go and are read from. The tensors behind the pointers
are kept alive by the plan (``_keep``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.bf16 import TiledBf16
from fleetserve.kernels.cpu import PackedWeight
from fleetserve.kernels.quant import QuantWeight

W_QUANT, W_PACKED, W_BF16, W_BF16_TILED = 0, 1, 2, 3
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # the MLP's gate activation (ACT_* in C)
MAX_SEGMENTS = 3
_p, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class _Segment(ctypes.Structure):
    _fields_ = [("kind", _i32), ("qtype", _i32), ("data", _p), ("row_bytes", _i64), ("n", _i64)]


class _Linear(ctypes.Structure):
    _fields_ = [
        ("seg", _Segment * MAX_SEGMENTS),
        ("num_segments", _i32),
        ("k", _i64),
        ("bias", _p),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p),
        ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
        ("k_cache", _p), ("v_cache", _p), ("window", _i32),
        ("attn_out_norm", _p), ("mlp_out_norm", _p), ("cos", _p), ("sin", _p),
        ("kv_bf16", _i32),
    ]  # fmt: skip


class _Plan(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i32), ("hidden", _i32), ("num_heads", _i32), ("num_kv_heads", _i32),
        ("head_dim", _i32), ("intermediate", _i32), ("block_size", _i32),
        ("eps", _f32), ("scale", _f32), ("cos", _p), ("sin", _p), ("final_norm", _p),
        ("layers", ctypes.POINTER(_Layer)), ("lora", _p), ("activation", _i32),
        ("head", _Linear), ("reduce", _p), ("profile", _p), ("profile_threads", _i32),
        ("profile_cpu", _i32), ("dot_chunked", _i32), ("split_min_rows", _i32),
        ("sampled_only", _i32), ("lead_max_rows", _i32), ("lead_share", _i32),
        ("lead_spin_us", _i32), ("lead_chunk_bytes", _i32), ("lead_counts", _p),
        ("lead_multi", _i32), ("lead_prefetch_bytes", _i32),
    ]  # fmt: skip


class _Embedding(ctypes.Structure):
    _fields_ = [("qtype", _i32), ("data", _p), ("row_bytes", _i64), ("vocab", _i64)]


class SpecLimits(ctypes.Structure):
    """decode_step.c's ds_spec_limits: where a speculative burst stops and how it drafts
    (see DecodePlan.spec_burst)."""

    _fields_ = [
        ("budget", _i64), ("max_output", _i64), ("max_position", _i64), ("k", _i64),
        ("unigram_drafts", _i64), ("min_n", _i64), ("max_n", _i64),
    ]  # fmt: skip


# Steps of at least this many rows per byte a weight takes (bf16: 2 x 12 = 24, Q4_1
# ~8) may split by sequences over the threads (see DecodePlan.split_min_rows): below it
# a step's GEMMs are bound by reading the weights, which each sub-step reads again.
# Measured on the bench Llama's bf16 decode steps (Zen 4, 2 threads, best of 8): split
# against team 14.1 / 12.5 ms at 16 rows, 21.9 / 22.4 at 32, 40.4 / 42.5 at 64.
SPLIT_ROWS_PER_WEIGHT_BYTE = 12

# Steps of one sequence (or a few) and up to this many rows run as lead steps on 2 threads (see
# DecodePlan.lead_max_rows): one-stream decoding, where one core reads ~96% of what two
# read and the team's barriers cost more than the second core's share of the GEMVs.
LEAD_MAX_ROWS = 1
# The same where every layer's weights are in the dot layout (GGUF Q4/Q5/Q8, int8 with
# int8 activations): verifications of up to 16 rows too, their projections' weight rows
# and attention items shared with the second thread (lead_multi). Replayed SmolLM2 Q4_1
# verifications at 2 threads, ms a step, team / lead: 2 rows 4.03 / 4.06, 5 rows 6.39 /
# 4.78, 7 rows 7.39 / 5.42, 9 rows 8.28 / 6.95, 13 rows 10.29 / 9.07 (load ~1-2). Other
# weights leave the layers' GEMMs on one thread, compute-bound past one row.
LEAD_MAX_ROWS_DOT = 16

# The projections whose weight rows a lead step's second thread takes a share of (see
# DecodePlan.lead_share; decode_step.c's bits in this order), the default set, and how
# long that thread spins after a shared GEMV before it sleeps (microseconds).
LEAD_PROJECTIONS = ("qkv", "o", "gate_up", "down")
LEAD_SHARE = ("gate_up", "down")
# What a lead step of several rows (a verification) shares (DecodePlan.lead_multi): the
# projections as LEAD_PROJECTIONS, each row's heads (rotary, cache writes) and the
# attention items (decode_step.c's bits in this order). Several rows make qkv and o
# compute-bound, so they pay for a job's sync where one row's do not; the heads (~1 us a
# row) measured level either way (replayed SmolLM2 verifications, 7 and 13 rows).
LEAD_MULTI_PARTS = (*LEAD_PROJECTIONS, "heads", "attention")
LEAD_MULTI = (*LEAD_PROJECTIONS, "attention")
# What a one-row lead step may share (DecodePlan.lead_share): a row's heads are not items.
LEAD_SHARE_PARTS = (*LEAD_PROJECTIONS, "attention")
LEAD_SPIN_US = 50
LEAD_CHUNK_BYTES = 16384
# Weight bytes of each coming shared GEMV's tail (at most half of it) that a one-row lead
# step's second thread reads into its cache while the first runs the norms, qkv, attention
# and o (DecodePlan.lead_prefetch_bytes; kernels/lead_share.h: it then grabs chunks from
# the back, those bytes first).
LEAD_PREFETCH_BYTES = 768 * 1024


def _lead_names(bits: int) -> tuple[str, ...]:
    """The LEAD_MULTI_PARTS whose bits (decode_step.c's order) are set."""
    return tuple(n for i, n in enumerate(LEAD_MULTI_PARTS) if bits >> i & 1)


def _lead_bits(field: str, names: Sequence[str], allowed: tuple[str, ...]) -> int:
    """`names` (each one of `allowed`, else a ValueError naming `field`) as decode_step.c's
    bits."""
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(f"{field}: {unknown} not among {list(allowed)}")
    return sum(1 << LEAD_MULTI_PARTS.index(n) for n in set(names))


# The phases an opt-in profile times (decode_step.c's PH_*, in order).
PHASES = ("rows", "qkv", "attention", "o", "gate_up", "down", "head", "argmax")
_LINEAR_PHASE = {"qkv": "qkv", "o": "o", "gate_up": "gate_up", "down": "down"}


# Tensor parallelism's sum across ranks, called back from inside the step (C's `reduce`).
REDUCE = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


def _lib() -> ctypes.CDLL:
    lib = cpu_kernels.load()
    if lib is None:
        raise RuntimeError("the decode step needs the CPU kernels (a C compiler)")
    lib.decode_step.argtypes = [
        _p, _p, _p, _i64, _p, _p, _p, _i64, _p, _p, _p, _p, _i64, _p, _p, _p, _i64,
        _i64, _p, _p, _p, ctypes.c_int,
    ]  # fmt: skip
    lib.decode_step.restype = ctypes.c_int
    lib.decode_burst.argtypes = [
        _p, _p, _i64, _i64, _p, _i64, _i64, _p, _i64, _p, _p, _p, _p, ctypes.c_int,
    ]  # fmt: skip
    lib.decode_burst.restype = _i64
    lib.spec_burst.argtypes = [
        _p, _p, _p, _i64, _p, _i64, _p, _p, _i64, _p, _p, _p, _p, _p, _p, ctypes.c_int,
    ]  # fmt: skip
    lib.spec_burst.restype = _i64
    lib.rows_argmax.argtypes = [_p, _i64, _i64, ctypes.c_int, _p]
    lib.rows_argmax.restype = None
    lib.decode_step_max_rows.argtypes = []
    lib.decode_step_max_rows.restype = ctypes.c_int
    lib.decode_step_rows_independent.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.decode_step_rows_independent.restype = ctypes.c_int
    lib.decode_step_phases.argtypes = []
    lib.decode_step_phases.restype = ctypes.c_int
    if lib.decode_step_phases() != len(PHASES):
        raise RuntimeError("decode_step.c's phases and PHASES differ")
    return lib


# One projection's weight: the segments of its output features in order (each a
# QuantWeight), one PackedWeight, one [n, k] bfloat16 tensor (gemm_bf16.c) or one bf16
# weight laid out as AMX B tiles (TiledBf16, gemm_bf16_tiled.c).
Weights = list[QuantWeight] | PackedWeight | torch.Tensor | TiledBf16


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer as the C step reads it (float32 CPU tensors, contiguous)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: Weights
    qkv_bias: torch.Tensor | None
    o: Weights
    gate_up: Weights
    down: Weights
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    # Sliding window W: keys p - W + 1 .. p only (None: every key).
    window: int | None = None
    # Gemma 3: the norms of the attention's and the MLP's outputs (None: none), and the
    # layer's own rotary tables [max_position, head_dim / 2] (None: the plan's).
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


@dataclass(frozen=True)
class WindowSlots:
    """Where the sliding-window layers' keys and values go and are read from, when they
    have their own block pool (a model with local and global layers): the runner's
    `slot_blocks`, `slot_offsets` [m] and block tables [num_seqs, max_blocks] of it."""

    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    block_tables: torch.Tensor


@dataclass(frozen=True)
class PlanShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    block_size: int
    eps: float
    scale: float
    activation: str = "silu"  # a key of ACTIVATIONS


class DecodePlan:
    def __init__(
        self,
        shape: PlanShape,
        layers: list[LayerWeights],
        cos: torch.Tensor,
        sin: torch.Tensor,
        final_norm: torch.Tensor | None,
        head: Weights | None = None,
        reduce: Callable[[torch.Tensor], object] | None = None,
    ) -> None:
        """final_norm None: the step's output is the residual stream (a pipeline stage
        before the last). head: the LM head's weight (or this rank's vocab shard of it),
        which `run` then applies to the rows it is asked for; None: the caller does.
        reduce: sums a float32 tensor across the tensor-parallel ranks in place, called
        from inside the step after each row-parallel projection (o, down)."""
        self._lib = _lib()
        self.shape = shape
        # Steps of up to this many rows run the decode-sized GEMM shares; larger ones
        # the any-rows shares (both as the module path's kernels for the same rows).
        self.max_rows = int(self._lib.decode_step_max_rows())
        # Steps run, and those that ran the LM head (a worker reports them: the proof
        # that the C path ran on a rank).
        self.steps = self.head_steps = 0
        # Steps that ran split by sequences over the threads (split_min_rows), and those
        # that ran as lead steps (lead_max_rows).
        self.split_steps = self.lead_steps = 0
        self._keep: list[object] = [cos, sin]
        # Some projection keeps bf16 weights (gemm_bf16.c: AMX tiles at any row count where
        # the CPU has them; every step runs here, as for the other kinds).
        self.has_bf16 = False
        # Weight bytes one step reads per phase (all layers), for a profile's GB/s.
        self.weight_bytes = dict.fromkeys(PHASES, 0)
        # KV cache bytes a step's attention reads per cached position (all layers; a
        # sliding-window layer's reads stop at its window).
        self.kv_bytes_per_position = 0
        self._profile: torch.Tensor | None = None
        # Every weight so far multiplies a row the same whatever the call's other rows
        # (bf16 rows or tiles: one chain per row at any row count): steps may split.
        self._rows_independent = True
        self._layers_dot = True  # every layer weight in the dot layout (lead_max_rows)
        self._weight_elems = 0  # of the layers and the head, beside weight_bytes
        self._layers = (_Layer * len(layers))()
        for i, w in enumerate(layers):
            dst = self._layers[i]
            dst.input_norm = self._ptr(w.input_norm)
            dst.post_norm = self._ptr(w.post_norm)
            dst.q_norm = None if w.q_norm is None else self._ptr(w.q_norm)
            dst.k_norm = None if w.k_norm is None else self._ptr(w.k_norm)
            self._linear(dst.qkv, w.qkv, w.qkv_bias)
            self._linear(dst.o, w.o, None)
            self._linear(dst.gate_up, w.gate_up, None)
            self._linear(dst.down, w.down, None)
            for name in _LINEAR_PHASE:
                self.weight_bytes[name] += _bytes(getattr(w, name))
            dst.k_cache = self._ptr(w.k_cache, cpu_kernels.KV_DTYPES)
            dst.v_cache = self._ptr(w.v_cache, cpu_kernels.KV_DTYPES)
            dst.kv_bf16 = int(w.k_cache.dtype == torch.bfloat16)
            self.kv_bytes_per_position += (
                2 * shape.num_kv_heads * shape.head_dim * w.k_cache.element_size()
            )
            dst.window = w.window or 0
            for name in ("attn_out_norm", "mlp_out_norm", "cos", "sin"):
                t = getattr(w, name)
                setattr(dst, name, None if t is None else self._ptr(t))
        s = shape
        if s.activation not in ACTIVATIONS:
            raise ValueError(f"activation {s.activation!r} is not one of {sorted(ACTIVATIONS)}")
        self._plan = _Plan(
            len(layers), s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate,
            s.block_size, s.eps, s.scale, self._ptr(cos), self._ptr(sin),
            None if final_norm is None else self._ptr(final_norm),
            self._layers, None, ACTIVATIONS[s.activation],
        )  # fmt: skip
        # Output features of the head (0: no head in the step).
        self.vocab = 0
        self.head_bf16 = isinstance(head, torch.Tensor | TiledBf16)
        if head is not None:
            layers_bf16, layers_dot = self.has_bf16, self._layers_dot
            self._linear(self._plan.head, head, None)
            self._layers_dot = layers_dot  # the layers' weights, not the head's
            self.weight_bytes["head"] = _bytes(head)
            self.has_bf16 = layers_bf16  # the layers' weights, not the head's
            self.vocab = sum(self._plan.head.seg[j].n for j in range(self._plan.head.num_segments))
        if self._rows_independent:
            # Fewer bytes a weight, fewer rows keep a sub-step's GEMMs compute-bound.
            per_weight = sum(self.weight_bytes.values()) / max(1, self._weight_elems)
            self._plan.split_min_rows = max(2, round(SPLIT_ROWS_PER_WEIGHT_BYTE * per_weight))
        # One-row steps on 2 threads: the layers on one thread, the LM head on both;
        # verifications too where the second thread can take shares of every projection.
        self._plan.lead_max_rows = LEAD_MAX_ROWS_DOT if self._layers_dot else LEAD_MAX_ROWS
        self.lead_share = LEAD_SHARE
        self._plan.lead_spin_us = LEAD_SPIN_US
        self._plan.lead_chunk_bytes = LEAD_CHUNK_BYTES
        self.lead_multi = LEAD_MULTI
        self._plan.lead_prefetch_bytes = LEAD_PREFETCH_BYTES
        self._lead_counts = torch.zeros(4, dtype=torch.int64)
        self._plan.lead_counts = self._lead_counts.data_ptr()
        self._reduce = reduce
        self._reduce_error: BaseException | None = None
        if reduce is not None:
            self._reduce_cb = REDUCE(self._call_reduce)
            self._plan.reduce = ctypes.cast(self._reduce_cb, _p)

    def start_profile(self, threads: int, cpu: bool = False) -> None:
        """Time each phase of every later step on threads 0 .. threads - 1 (wall
        seconds added up per thread; a phase ending in a barrier includes its wait).
        `cpu`: each thread's CPU seconds instead (a preempted thread's time off the CPU
        left out: a loaded machine's profile; a barrier's wait counts while it spins)."""
        self._profile = torch.zeros(threads, len(PHASES), dtype=torch.float64)
        self._plan.profile = self._profile.data_ptr()
        self._plan.profile_threads = threads
        self._plan.profile_cpu = int(cpu)

    @property
    def dot_chunked(self) -> bool:
        """Whether narrow steps' dot-layout GEMMs hand out one ~16 KB chunk of weight rows
        per grab (quant_dot_share's schedule) instead of the step's guided runs of
        consecutive chunks (the default; the same outputs either way): A/B runs."""
        return bool(self._plan.dot_chunked)

    @dot_chunked.setter
    def dot_chunked(self, on: bool) -> None:
        self._plan.dot_chunked = int(on)

    @property
    def split_min_rows(self) -> int:
        """Steps of at least this many rows and of several sequences run as one sub-step
        per thread over its own sequences (decode_step.c's split_step) where their costs
        share out evenly; 0: never (every step runs as one team). Non-zero by default
        only where every weight multiplies a row the same whatever the other rows (bf16),
        so the outputs are the team's bit for bit."""
        return int(self._plan.split_min_rows)

    @split_min_rows.setter
    def split_min_rows(self, rows: int) -> None:
        if rows < 0:
            raise ValueError(f"split_min_rows must be >= 0, got {rows}")
        if rows and not self._rows_independent:
            raise ValueError("split_min_rows: this plan's weights depend on the call's rows")
        self._plan.split_min_rows = rows

    @property
    def lead_max_rows(self) -> int:
        """Steps of at most 4 sequences and this many rows, on exactly 2 threads, run as
        a lead step (decode_step.c's lead_step): one thread runs the layers as a team of
        one (no barrier), the other taking the shares lead_share (one row) or lead_multi
        (several rows) name, then both run the LM head; 0: never. Default LEAD_MAX_ROWS_DOT
        where every layer weight is in the dot layout, else LEAD_MAX_ROWS. Steps of more
        than 16 rows, and of more than the decode-sized shares' rows where some weight
        depends on the call's rows, still run as a team. The outputs are the team's bit
        for bit (each output is computed by the same code whichever thread runs it)."""
        return int(self._plan.lead_max_rows)

    @lead_max_rows.setter
    def lead_max_rows(self, rows: int) -> None:
        if rows < 0:
            raise ValueError(f"lead_max_rows must be >= 0, got {rows}")
        self._plan.lead_max_rows = rows

    @property
    def lead_share(self) -> tuple[str, ...]:
        """The projections (LEAD_PROJECTIONS) whose weight rows a lead step's second thread
        takes a share of while the first runs the layers (kernels/lead_share.c: chunks
        grabbed from one counter, the first thread never waiting for the second to
        start); dot-layout weights only, others stay on the first thread; "attention": the
        attention's items (one a kv head) too. (): the layers on one thread. The same bits
        either way (each weight row is one dot product, each head's attention the team's)."""
        return _lead_names(self._plan.lead_share)

    @lead_share.setter
    def lead_share(self, names: Sequence[str]) -> None:
        self._plan.lead_share = _lead_bits("lead_share", names, LEAD_SHARE_PARTS)

    @property
    def lead_multi(self) -> tuple[str, ...]:
        """What a lead step of several rows (lead_max_rows > 1: a verification) shares with
        its second thread (LEAD_MULTI_PARTS): the projections' weight rows as lead_share,
        "heads" each row's rotary and cache writes, "attention" the (row range, kv head)
        attention items, each an item grabbed from one counter (kernels/lead_share.c).
        (): as a one-row lead step (lead_share). The same bits either way."""
        return _lead_names(self._plan.lead_multi)

    @lead_multi.setter
    def lead_multi(self, names: Sequence[str]) -> None:
        self._plan.lead_multi = _lead_bits("lead_multi", names, LEAD_MULTI_PARTS)

    def tune_lead_share(self, spin_us: int, chunk_bytes: int) -> None:
        """How long the second thread spins after a shared GEMV before it sleeps, and the
        weight bytes of a chunk it grabs (LEAD_SPIN_US, LEAD_CHUNK_BYTES): tests, tuning."""
        if not 0 <= spin_us < 2**31:
            raise ValueError(f"spin_us must be in [0, 2**31), got {spin_us}")
        if not 1 <= chunk_bytes < 2**31:
            raise ValueError(f"chunk_bytes must be in [1, 2**31), got {chunk_bytes}")
        self._plan.lead_spin_us = spin_us
        self._plan.lead_chunk_bytes = chunk_bytes

    @property
    def lead_prefetch_bytes(self) -> int:
        """Weight bytes of each coming shared GEMV's tail (at most half of it) that a
        one-row lead step's second thread reads into its cache while the first runs the
        layer's unshared work, then multiplies first (it grabs chunks from the back); 0:
        none. Reads only: the same bits either way."""
        return int(self._plan.lead_prefetch_bytes)

    @lead_prefetch_bytes.setter
    def lead_prefetch_bytes(self, nbytes: int) -> None:
        if not 0 <= nbytes < 2**31:
            raise ValueError(f"lead_prefetch_bytes must be in [0, 2**31), got {nbytes}")
        self._plan.lead_prefetch_bytes = nbytes

    @property
    def lead_chunks(self) -> tuple[int, int]:
        """Chunks of shared projections' weight rows the first and the second thread of
        lead steps took since the plan was built (the second's share: how much it helped)."""
        return int(self._lead_counts[0]), int(self._lead_counts[1])

    @property
    def lead_items(self) -> tuple[int, int]:
        """Items (a row's heads, an attention item) of lead steps of several rows, and of
        one-row ones sharing "attention", the first and the second thread took since the
        plan was built."""
        return int(self._lead_counts[2]), int(self._lead_counts[3])

    def stop_profile(self) -> dict[str, list[float]]:
        """Seconds per phase and thread since start_profile; timing off again."""
        if self._profile is None:
            raise ValueError("no profile was started")
        out = {name: self._profile[:, i].tolist() for i, name in enumerate(PHASES)}
        self._plan.profile, self._plan.profile_threads, self._profile = None, 0, None
        return out

    def burst(
        self,
        inp: BurstInput,
        token: int,
        position: int,
        block_table: torch.Tensor,
        num_steps: int,
        stop_ids: torch.Tensor,
    ) -> list[int]:
        """A lone greedy sequence's next tokens in one C call (decode_step.c's
        decode_burst): `token` decoded at `position`, the step's argmax decoded at the next
        one, and so on, `num_steps` tokens or up to the first in `stop_ids` (int64, kept).
        Each step is this plan's step of one row with the LM head and its argmax, on
        `token`'s embedding through `inp`'s table. block_table: the sequence's block ids
        (int64 [n], holding the slots of every position written)."""
        if not self.vocab or self._plan.reduce:
            raise ValueError("a burst needs a plan with the LM head, in one process")
        if block_table.dtype != torch.int64 or not block_table.is_contiguous():
            raise ValueError("block_table must be a contiguous int64 tensor")
        if stop_ids.dtype != torch.int64 or not stop_ids.is_contiguous():
            raise ValueError("stop_ids must be a contiguous int64 tensor")
        if inp.tokens.shape[0] < num_steps:
            inp.tokens = torch.empty(num_steps, dtype=torch.int64)
        self._plan.lora = None
        n = self._lib.decode_burst(
            ctypes.byref(self._plan), inp.ref, token, position, block_table.data_ptr(),
            block_table.shape[0], num_steps, stop_ids.data_ptr(), stop_ids.shape[0],
            inp.x.data_ptr(), inp.out.data_ptr(), inp.logits.data_ptr(),
            inp.tokens.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if n == -1:
            raise MemoryError("decode_burst: could not allocate its buffers")
        if n < 0:
            raise ValueError(f"decode_burst: token {token} or a position from {position} "
                             "is outside the embedding or the blocks")  # fmt: skip
        self.steps += n
        self.head_steps += n
        return inp.tokens[:n].tolist()

    def spec_burst(
        self,
        inp: BurstInput,
        tokens: torch.Tensor,
        length: int,
        block_table: torch.Tensor,
        limits: SpecLimits,
        stop_ids: torch.Tensor,
    ) -> tuple[int, tuple[int, int, int]]:
        """A lone greedy sequence's speculative decoding in one C call (decode_step.c's
        spec_burst): n-gram drafts from `tokens[:length]` (int64, its last token pending
        at position length - 1), verified by this plan's step of 1 + drafts rows with the
        LM head and its argmax, accepted greedily, round after round within `limits`.
        The emitted tokens are appended to `tokens` (capacity: length + budget + k).
        Returns their number and (verifications, drafts, accepted drafts) (rounds without
        a match are one-row steps, not verifications)."""
        if not self.vocab or self._plan.reduce:
            raise ValueError("a speculative burst needs a plan with the LM head, in one process")
        for name, t in (("tokens", tokens), ("block_table", block_table), ("stop_ids", stop_ids)):
            if t.dtype != torch.int64 or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous int64 tensor")
        if length < 1:
            raise ValueError(f"length must be >= 1 (the pending token's), got {length}")
        if tokens.shape[0] < length + limits.budget + limits.k:
            raise ValueError("tokens has no room for the burst's tokens")
        rows = limits.k + 1
        if inp.x.shape[0] < rows * self.shape.hidden:
            inp.x = torch.empty(rows * self.shape.hidden)
            inp.out = torch.empty(rows * self.shape.hidden)
            inp.logits = torch.empty(rows * self.vocab)
        if inp.tokens.shape[0] < 2 * rows:
            inp.tokens = torch.empty(2 * rows, dtype=torch.int64)
        counts = (ctypes.c_int64 * 4)()
        self._plan.lora = None
        n = self._lib.spec_burst(
            ctypes.byref(self._plan), inp.ref, tokens.data_ptr(), length,
            block_table.data_ptr(), block_table.shape[0], ctypes.byref(limits),
            stop_ids.data_ptr(), stop_ids.shape[0], inp.x.data_ptr(), inp.out.data_ptr(),
            inp.logits.data_ptr(), inp.tokens.data_ptr(), inp.tokens[rows:].data_ptr(),
            counts, torch.get_num_threads(),
        )  # fmt: skip
        if n == -1:
            raise MemoryError("spec_burst: could not allocate its buffers")
        if n == -3:
            raise ValueError(f"spec_burst: a token of the sequence or its drafts is outside "
                             f"the embedding's {inp.num_rows} rows")  # fmt: skip
        if n == -4:  # length < 1 is refused above: k is what C refused
            raise ValueError(f"spec_burst: limits.k must be <= 63 (k + 1 rows, at most 64 "
                             f"a round), got {limits.k}")  # fmt: skip
        if n < 0:  # decode_step's -2 (no rows): an internal error, not the caller's
            raise RuntimeError(f"spec_burst: the decode step failed ({n})")
        self.steps += counts[0]
        self.head_steps += counts[0]
        return n, (counts[1], counts[2], counts[3])

    def _call_reduce(self, ptr: ctypes._Pointer[ctypes.c_float], n: int) -> None:
        # An exception cannot cross C: kept, and raised once the step returns.
        try:
            assert self._reduce is not None
            self._reduce(torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(n,))))
        except BaseException as e:  # noqa: BLE001
            self._reduce_error = self._reduce_error or e

    def _ptr(self, t: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> int:
        """`t`'s data (kept alive with the plan); float32 unless `dtypes` (the KV caches:
        float32 or bf16) say otherwise."""
        if t.dtype not in dtypes or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("the decode step's tensors must be contiguous float32 CPU tensors")
        self._keep.append(t)
        return t.data_ptr()

    def _linear(self, dst: _Linear, w: Weights, bias: torch.Tensor | None) -> None:
        if isinstance(w, PackedWeight):
            dst.seg[0] = _Segment(W_PACKED, 0, w.data.data_ptr(), 0, w.out_features)
            dst.num_segments, dst.k = 1, w.in_features
            self._keep.append(w)
        elif isinstance(w, TiledBf16):
            dst.seg[0] = _Segment(W_BF16_TILED, 0, w.data_ptr(), 0, w.out_features)
            self.has_bf16 = True
            dst.num_segments, dst.k = 1, w.in_features
            self._keep.append(w)
        elif isinstance(w, torch.Tensor):
            if w.dtype != torch.bfloat16 or w.dim() != 2 or not w.is_contiguous():
                raise ValueError("a bf16 projection must be a contiguous 2-D bfloat16 tensor")
            dst.seg[0] = _Segment(W_BF16, 0, w.data_ptr(), 0, w.shape[0])
            self.has_bf16 = True
            dst.num_segments, dst.k = 1, w.shape[1]
            self._keep.append(w)
        else:
            if not 1 <= len(w) <= MAX_SEGMENTS:
                raise ValueError(f"a projection takes 1 to {MAX_SEGMENTS} weight segments")
            for j, q in enumerate(w):
                dst.seg[j] = _Segment(W_QUANT, q.qtype_id, q.data_ptr, q.row_bytes, q.out_features)
                self._keep.append(q)
            dst.num_segments, dst.k = len(w), w[0].in_features
        dst.bias = None if bias is None else self._ptr(bias)
        for j in range(dst.num_segments):
            g = dst.seg[j]
            independent = bool(self._lib.decode_step_rows_independent(g.kind, g.qtype))
            self._rows_independent &= independent
            self._layers_dot &= independent and g.kind == W_QUANT  # the dot layout
            self._weight_elems += g.n * dst.k

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        slot_blocks: torch.Tensor,
        slot_offsets: torch.Tensor,
        q_starts: torch.Tensor,
        q_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        window: WindowSlots | None = None,
        lora: int | None = None,
        logit_rows: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
        argmax: torch.Tensor | None = None,
        sampled_only: bool = False,
    ) -> torch.Tensor:
        """The final-norm hidden states [m, hidden] of the step's m rows: sequences laid
        out back to back, sequence i owning rows q_starts[i] .. q_starts[i] + q_lens[i]
        (decodes, prefill chunks and draft verification alike; causal inside each).
        x: [m, hidden] embeddings; positions, slot_blocks, slot_offsets: int64 [m];
        q_starts, q_lens, seq_lens: int64 [num_seqs]; block_tables: int64 [num_seqs,
        max_blocks] (the runner's tensors, contiguous by construction). window: the
        sliding-window layers' own slots and tables (None: they use the ones above). lora: the
        address of the step's LoRA rows and slots (lora/fused.py), or None. logit_rows
        (int64 [r], distinct rows of the step: the caller checks) and logits (float32 [r,
        vocab]): the head's output for those rows is written to `logits` (the plan must
        have a head). argmax (int64 [r], with logits): each of those rows' argmax, as
        numpy's (the first maximum, or the first NaN), found by the step's threads inside
        its region: greedy sampling without a scan of the logits in Python. sampled_only
        (with logit_rows, possibly empty): the caller reads no hidden state but those of
        logit_rows, so a wide step may run its last layer's o projection and MLP on those
        rows alone (where this plan's weights multiply a row the same whatever the other
        rows); the other rows of the result are then undefined."""
        m = x.shape[0]
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape[1] != self.shape.hidden:
            raise ValueError(f"x must be a contiguous float32 [m, {self.shape.hidden}] tensor")
        nr = 0
        if logit_rows is not None:
            nr = logit_rows.shape[0]
            want = (nr, self.vocab)
            if not self.vocab or logits is None or tuple(logits.shape) != want:
                raise ValueError(f"logits must be a float32 {want} tensor (a plan with a head)")
            if logits.dtype != torch.float32 or not logits.is_contiguous() or nr > m:
                raise ValueError("logits must be contiguous float32, logit_rows at most m rows")
            if logit_rows.dtype != torch.int64 or not logit_rows.is_contiguous():
                raise ValueError("logit_rows must be a contiguous int64 tensor")
        if argmax is not None and (
            logit_rows is None
            or argmax.dtype != torch.int64
            or not argmax.is_contiguous()
            or tuple(argmax.shape) != (nr,)
        ):
            raise ValueError(f"argmax must be a contiguous int64 ({nr},) tensor, with logits")
        self._reduce_error = None
        self.steps += 1
        self.head_steps += nr > 0
        out = torch.empty(m, self.shape.hidden)
        self._plan.lora = lora
        self._plan.sampled_only = sampled_only and logit_rows is not None and self._rows_independent
        rc = self._lib.decode_step(
            ctypes.byref(self._plan), x.data_ptr(), out.data_ptr(), m, positions.data_ptr(),
            slot_blocks.data_ptr(), slot_offsets.data_ptr(), q_starts.shape[0],
            q_starts.data_ptr(), q_lens.data_ptr(), seq_lens.data_ptr(),
            block_tables.data_ptr(), block_tables.shape[1],
            None if window is None else window.slot_blocks.data_ptr(),
            None if window is None else window.slot_offsets.data_ptr(),
            None if window is None else window.block_tables.data_ptr(),
            0 if window is None else window.block_tables.shape[1],
            nr, None if logit_rows is None else logit_rows.data_ptr(),
            None if logits is None else logits.data_ptr(),
            None if argmax is None else argmax.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if self._reduce_error is not None:
            raise RuntimeError("decode_step: the all-reduce failed") from self._reduce_error
        if rc == -1:
            raise MemoryError("decode_step: could not allocate its buffers")
        if rc < 0:
            raise ValueError(f"decode_step needs at least one row and one sequence, got {m}")
        # 1: it ran as one sub-step per thread; 2: as a lead step
        self.split_steps += rc == 1
        self.lead_steps += rc == 2
        return out


class BurstInput:
    """What `DecodePlan.burst` embeds its tokens with: the model's embedding table in
    GGUF blocks (a QuantWeight, as quant_embedding reads it) or float32 rows [vocab,
    hidden] (as embed_rows reads them), and the step's scratch."""

    def __init__(self, plan: DecodePlan, table: QuantWeight | torch.Tensor) -> None:
        hidden = plan.shape.hidden
        if isinstance(table, QuantWeight):
            if table.in_features != hidden:
                raise ValueError(f"the embedding's rows must have {hidden} values")
            self._emb = _Embedding(table.qtype_id, table.data_ptr, table.row_bytes,
                                   table.out_features)  # fmt: skip
        else:
            if table.dtype != torch.float32 or table.dim() != 2 or not table.is_contiguous():
                raise ValueError("a float embedding must be a contiguous float32 2-D tensor")
            if table.shape[1] != hidden:
                raise ValueError(f"the embedding's rows must have {hidden} values")
            self._emb = _Embedding(-1, table.data_ptr(), 0, table.shape[0])
        self._table = table  # kept alive
        self.x = torch.empty(hidden)
        self.out = torch.empty(hidden)
        self.logits = torch.empty(plan.vocab)
        self.tokens = torch.empty(0, dtype=torch.int64)

    @property
    def ref(self) -> ctypes._CArgObject:
        return ctypes.byref(self._emb)

    @property
    def num_rows(self) -> int:
        """The embedding's rows: token ids at or past it (or below 0) embed nothing."""
        return int(self._emb.vocab)


def rows_argmax(x: torch.Tensor, spans: int = 1) -> torch.Tensor:
    """Each row's argmax of a float32 [rows, n] tensor (n >= 1) through the C code the
    decode step's fused argmax runs, each row cut into `spans` (at most 64) as the step
    cuts it over its threads: numpy's answer (the first maximum, or the first NaN)."""
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] < 1:
        raise ValueError("x must be a contiguous float32 [rows, n >= 1] tensor")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _lib().rows_argmax(x.data_ptr(), x.shape[0], x.shape[1], spans, out.data_ptr())
    return out


def _bytes(w: Weights) -> int:
    """Bytes of a projection's weight as the step reads them."""
    if isinstance(w, PackedWeight):
        return int(w.data.numel() * w.data.element_size())
    if isinstance(w, torch.Tensor | TiledBf16):
        return int(w.numel() * w.element_size())
    return sum(int(q.row_bytes * q.out_features) for q in w)
