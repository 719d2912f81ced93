"""Speculative decoding in the core (no model): config validation, n-gram lookup, the
scheduler's verify-and-roll-back cycle against a fake runner, and KV block give-back.

The fake target "samples" a pure function of the tokens so far; its fake proposer drafts
the true continuation for a pseudo-random number of tokens, then wrong ones, so every
verification accepts a known prefix. Outputs must equal those of a run without drafts,
with the block manager's invariants checked after every step.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from fleetserve.core.block_manager import BlockManager
from fleetserve.core.config import SchedulerConfig
from fleetserve.core.request import Request
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.core.scheduler import Scheduler
from fleetserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from fleetserve.spec_decode.base import ProposalRequest
from fleetserve.spec_decode.config import SpeculativeConfig
from fleetserve.spec_decode.ngram import (
    NgramIndex,
    NgramProposer,
    cut_at_stop,
    find_ngram_continuation,
    find_ngram_match,
)
from fleetserve.spec_decode.rejection_sampler import _argmax_rows

BS = 4


def fake_token(token_ids: list[int]) -> int:
    return (sum(token_ids) * 31 + len(token_ids)) % 97 + 3


def true_continuation(tokens: list[int], k: int) -> list[int]:
    out, seq = [], list(tokens)
    for _ in range(k):
        seq.append(fake_token(seq))
        out.append(seq[-1])
    return out


class FakeSpecRunner:
    """Mirrors the scheduler's diffs (block lists cut back where blocks were given back),
    verifies drafts greedily against fake_token and proposes the next drafts."""

    def __init__(self, sched: Scheduler, k: int) -> None:
        self.sched = sched
        self.k = k
        self.states: dict[str, tuple[list[int], list[int]]] = {}
        self.step = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.step += 1
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.states[new.req_id] = (list(new.token_ids), list(new.block_ids))
        for c in so.scheduled_cached_reqs:
            tokens, blocks = self.states[c.req_id]
            tokens.extend(c.new_token_ids)
            assert c.num_kept_block_ids is not None
            del blocks[c.num_kept_block_ids :]
            blocks.extend(c.new_block_ids)
        bm = self.sched.block_manager
        sampled, proposals = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            tokens, blocks = self.states[req_id]
            req = self.sched.requests[req_id]
            assert tokens == req.all_token_ids and blocks == bm.block_ids(req_id)
            drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            computed = req.num_computed_tokens
            assert computed + n == len(tokens) + len(drafts) or not drafts
            assert len(blocks) * BS >= computed + n, "drafts need slots"
            if computed + n < len(tokens):
                sampled.append([])
                proposals.append([])
                continue
            truth = true_continuation(tokens, len(drafts) + 1)
            out = []
            for d, t in zip(drafts, truth, strict=False):
                out.append(t)
                if d != t:
                    break
            else:
                out.append(truth[len(drafts)])
            sampled.append(out)
            # Right for a pseudo-random prefix, then wrong.
            seq = tokens + out
            good = zlib.crc32(f"{req_id}:{len(seq)}".encode()) % (self.k + 1)
            nxt = true_continuation(seq, self.k)
            proposals.append(nxt[:good] + [t + 1 for t in nxt[good:]])
        return ModelRunnerOutput(
            req_ids=list(so.num_scheduled_tokens),
            sampled_token_ids=sampled,
            spec_token_ids=proposals,
        )


def check_cache_holds_only_verified(sched: Scheduler) -> None:
    """A block registered in the prefix cache holds computed, verified tokens of every
    request that holds it."""
    bm = sched.block_manager
    for req in sched.running:
        for i, b in enumerate(bm.block_ids(req.req_id)):
            h = bm.blocks[b].block_hash
            if h is not None and bm.cached.get(h) == b:
                assert (i + 1) * bm.block_size <= req.num_computed_tokens <= req.num_tokens
                assert req.block_hashes[i] == h


def run(
    spec_k: int | None,
    prompts: dict[str, list[int]],
    num_blocks: int = 64,
    budget: int = 64,
    max_tokens: int = 24,
    lookahead: int = 0,
    n_siblings: int = 1,
) -> tuple[dict[str, list[int]], Scheduler]:
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget, max_model_len=256, num_lookahead_tokens=lookahead
    )
    sched = Scheduler(cfg, BlockManager(num_blocks, BS, True))
    for i, (rid, prompt) in enumerate(prompts.items()):
        for s in range(n_siblings):
            sched.add_request(
                Request(
                    f"{rid}-{s}",
                    prompt,
                    SamplingParams(max_tokens=max_tokens),
                    arrival_time=float(i * n_siblings + s),
                    group_id=rid if n_siblings > 1 else None,
                )
            )
    runner = FakeSpecRunner(sched, spec_k or 0)
    tokens: dict[str, list[int]] = {}
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        sched.block_manager.check_invariants()
        result = runner.execute(so)
        if spec_k is None:
            result.spec_token_ids = None
        for o in sched.update_from_output(so, result):
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
        sched.block_manager.check_invariants()
        check_cache_holds_only_verified(sched)
    assert not sched.has_unfinished_requests()
    return tokens, sched


PROMPTS = {f"r{i}": [10 + i, 20, 30 + i, 40, 50, 60 + i, 70][: 3 + i] for i in range(5)}


@pytest.mark.parametrize("k", [1, 3, 5])
def test_drafts_give_the_same_tokens_with_fewer_steps(k: int) -> None:
    ref, ref_sched = run(None, PROMPTS)
    got, sched = run(k, PROMPTS)
    assert got == ref
    assert sched.num_spec_verifications > 0
    assert 0 < sched.num_accepted_tokens < sched.num_draft_tokens
    assert all(len(t) == 24 for t in got.values())


def test_preemption_chunked_prefill_and_prefix_sharing_with_drafts() -> None:
    shared = list(range(100, 114))  # 3.5 blocks shared by every prompt
    prompts = {f"p{i}": shared + [200 + i, 201] for i in range(4)}
    ref, _ = run(None, prompts, n_siblings=2)
    # Few blocks (preemptions), a small budget (chunked prefill, drafts cut by budget).
    got, sched = run(4, prompts, num_blocks=14, budget=10, n_siblings=2)
    assert got == ref
    assert sched.num_preemptions > 0
    assert sched.num_accepted_tokens > 0
    assert sched.block_manager.hit_rate > 0


def test_lookahead_slots_are_reserved_then_given_back() -> None:
    ref, _ = run(None, PROMPTS)
    got, sched = run(3, PROMPTS, lookahead=3)
    assert got == ref
    assert sched.block_manager.num_free_blocks == 64


def test_rejected_drafts_roll_back_computed_tokens_and_blocks() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_model_len=64)
    bm = BlockManager(16, BS, True)
    sched = Scheduler(cfg, bm)
    req = Request("a", [5, 6, 7], SamplingParams(max_tokens=20))
    sched.add_request(req)
    so = sched.schedule()
    sched.update_from_output(
        so, ModelRunnerOutput(["a"], [[8]], spec_token_ids=[[9, 10, 11, 12, 13, 14]])
    )
    assert req.num_computed_tokens == 3 and req.all_token_ids == [5, 6, 7, 8]
    so = sched.schedule()
    # The pending token plus six drafts: positions 3..9, blocks for 10 tokens.
    assert so.num_scheduled_tokens == {"a": 7}
    assert so.scheduled_spec_decode_tokens == {"a": [9, 10, 11, 12, 13, 14]}
    assert bm.block_ids("a") == [0, 1, 2]
    # Two drafts accepted, the third replaced by the target's 99.
    sched.update_from_output(so, ModelRunnerOutput(["a"], [[9, 10, 99]], spec_token_ids=[[]]))
    assert req.all_token_ids == [5, 6, 7, 8, 9, 10, 99]
    assert req.num_computed_tokens == 6  # K/V of 5..10; 99's is computed next step
    assert bm.block_ids("a") == [0, 1]  # block 2 held only rejected drafts
    assert list(bm.free_queue)[0] == 2  # reused first: its content is worthless
    assert bm.blocks[0].block_hash is not None and bm.blocks[1].block_hash is None
    bm.check_invariants()
    so = sched.schedule()
    assert so.scheduled_cached_reqs[0].num_kept_block_ids == 2
    assert so.scheduled_cached_reqs[0].new_block_ids == []


def test_drafts_capped_by_max_tokens() -> None:
    sched = Scheduler(SchedulerConfig(max_model_len=64), BlockManager(16, BS, True))
    req = Request("a", [5, 6, 7], SamplingParams(max_tokens=3))
    sched.add_request(req)
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(["a"], [[8]], spec_token_ids=[[1, 2, 3, 4]]))
    # Two more tokens allowed: one draft plus the target's own.
    assert req.spec_token_ids == [1]


def test_ngram_continuation() -> None:
    seq = [1, 2, 3, 4, 5, 9, 9, 2, 3]
    # The suffix [2, 3] occurred at 1..2: propose what followed.
    assert find_ngram_continuation(seq, 3, 1, 4) == [4, 5, 9]
    assert find_ngram_continuation(seq, 10, 1, 4) == [4, 5, 9, 9, 2, 3]
    # Longest n first: [9, 2, 3] never occurred before, [2, 3] did.
    assert find_ngram_continuation(seq, 2, 3, 4) == []
    # The latest earlier occurrence wins.
    assert find_ngram_continuation([7, 1, 7, 2, 7], 1, 1, 1) == [2]
    assert find_ngram_continuation([1, 2, 3], 4, 1, 2) == []
    assert find_ngram_continuation([5], 4, 1, 2) == []


def test_ngram_match_length_and_unigram_matches_propose_one_draft() -> None:
    seq = [1, 2, 3, 4, 5, 9, 9, 2, 3]
    assert find_ngram_match(seq, 1, 4) == (3, 2)  # [2, 3] matched; 4 follows at 3
    assert find_ngram_match([5], 1, 2) == (-1, 0)
    greedy = SamplingParams(temperature=0.0)

    def propose(tokens: list[int], k: int, max_n: int) -> list[int]:
        cfg = SpeculativeConfig("ngram", k, prompt_lookup_max=max_n)
        ask = ProposalRequest("r", tokens, [], greedy)
        return NgramProposer(cfg).propose([ask])[0].token_ids

    assert propose(seq, 3, 4) == [4, 5, 9]  # a bigram match: every draft
    # Only the last token (7) occurred before: one draft, not four.
    assert propose([7, 1, 2, 3, 4, 8, 7], 4, 4) == [1]
    # ... unless the config allows unigram matches only.
    assert propose([7, 1, 2, 3, 4, 8, 7], 4, 1) == [1, 2, 3, 4]
    assert propose([1, 2, 3], 4, 4) == []


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 4), (2, 3), (1, 1), (3, 8)])
def test_ngram_index_matches_the_scan_as_the_sequence_grows(min_n: int, max_n: int) -> None:
    """The incremental index gives find_ngram_match's answer after every extension
    (one token or several at a time, as verification appends them), and starts afresh
    on a sequence that does not extend the indexed one."""
    g = torch.Generator().manual_seed(min_n * 10 + max_n)
    for vocab in (2, 3, 7):
        index = NgramIndex(min_n, max_n)
        seq: list[int] = []
        for step in range(120):
            if step == 60:  # another sequence, shorter: indexed afresh
                seq = seq[:10]
                seq[-1] = (seq[-1] + 1) % vocab
            grow = int(torch.randint(0, 5, (1,), generator=g))
            seq = seq + torch.randint(0, vocab, (grow,), generator=g).tolist()
            assert index.match(seq) == find_ngram_match(seq, min_n, max_n), (vocab, seq)
    # The same length but another last token is another sequence too.
    index = NgramIndex(1, 2)
    assert index.match([1, 2, 1]) == (1, 1)
    assert index.match([1, 2, 3]) == find_ngram_match([1, 2, 3], 1, 2) == (-1, 0)


def test_ngram_proposer_keeps_an_index_per_request_until_forgotten() -> None:
    cfg = SpeculativeConfig("ngram", 3, prompt_lookup_max=3)
    prop = NgramProposer(cfg)
    greedy = SamplingParams(temperature=0.0)
    a = [5, 6, 7, 8, 5, 6]
    b = [1, 2, 3, 1, 2]
    out = prop.propose([ProposalRequest("a", a, [], greedy), ProposalRequest("b", b, [], greedy)])
    assert [p.token_ids for p in out] == [[7, 8, 5], [3, 1, 2]]
    assert set(prop.indexes) == {"a", "b"}
    out = prop.propose([ProposalRequest("a", a + [7], [], greedy)])
    assert out[0].token_ids == [8, 5, 6]
    prop.forget("a")
    assert set(prop.indexes) == {"b"}
    # A restarted request (another sequence under the same id) gets a fresh index.
    out = prop.propose([ProposalRequest("b", [9, 9, 4, 9], [], greedy)])
    assert out[0].token_ids == [4]  # a unigram match: one draft


def test_greedy_verification_argmax_is_torchs() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 3, (7, 300), generator=g).float()  # many ties
    logits[2, 5] = float("nan")
    logits[4] = 1.0
    assert _argmax_rows(logits) == logits.argmax(dim=-1).tolist()
    assert _argmax_rows(logits.double()) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
            "prompt_lookup_min",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"num_speculative_tokens": 2, "draft": "x"}, "unknown fields"),
        ("{not json", "JSON"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_speculative_config_names_the_field(value: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(value)  # type: ignore[arg-type]


def test_speculative_config_parse() -> None:
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert c == SpeculativeConfig("ngram", 3, prompt_lookup_max=4, prompt_lookup_min=1)
    assert c is not None and c.num_lookahead_tokens == 0
    c = SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 2})
    assert c is not None and (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 2)
    d = SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 5})
    assert d is not None and d.method == "draft_model" and d.num_lookahead_tokens == 5


def test_spec_decode_metrics_pool_replicas_and_count_deltas() -> None:
    from fleetserve.metrics import ServerMetrics
    from fleetserve.serve.telemetry.pooled_stats import spec_decode_totals

    assert spec_decode_totals([{"num_requests_running": 1.0}]) == {}
    pooled = spec_decode_totals(
        [
            {"spec_decode_num_drafts": 2, "spec_decode_num_draft_tokens": 8,
             "spec_decode_num_accepted_tokens": 6},
            {"spec_decode_num_drafts": 2, "spec_decode_num_draft_tokens": 8,
             "spec_decode_num_accepted_tokens": 2},
        ]
    )  # fmt: skip
    assert pooled["spec_decode_acceptance_rate"] == 0.5
    assert pooled["spec_decode_mean_accepted_length"] == 3.0
    server = ServerMetrics()
    m = server.model("m")
    m.set_engine_stats(pooled)
    m.set_engine_stats({**pooled, "spec_decode_num_accepted_tokens": 10})
    text = server.render().decode()
    assert 'fleetserve:spec_decode_num_accepted_tokens_total{model_name="m"} 10.0' in text
    assert 'fleetserve:spec_decode_num_draft_tokens_total{model_name="m"} 16.0' in text
    assert 'fleetserve:spec_decode_acceptance_rate{model_name="m"} 0.5' in text


@pytest.mark.parametrize("draft_length", ["fixed", "adaptive"])
def test_ngram_drafts_end_at_a_stop_token(draft_length: str) -> None:
    """Drafts past a token that ends the request are never used: they stop at it (it
    stays: verification accepts or rejects it like any draft)."""
    cfg = SpeculativeConfig("ngram", 5, prompt_lookup_max=2, draft_length=draft_length)
    greedy = SamplingParams(temperature=0.0)
    seq = [4, 5, 6, 0, 7, 8, 4, 5]  # "4 5" matched: 6 0 7 8 4 follow
    ask = ProposalRequest("a", seq, [], greedy, frozenset({0, 99}))
    assert NgramProposer(cfg).propose([ask])[0].token_ids == [6, 0]
    # No stop among them (or none given): all k.
    assert NgramProposer(cfg).propose([ProposalRequest("a", seq, [], greedy)])[0].token_ids == [
        6, 0, 7, 8, 4,
    ]  # fmt: skip
    assert cut_at_stop([3, 2, 1], frozenset({9})) == [3, 2, 1]
    assert cut_at_stop([9, 2], frozenset({9})) == [9] and cut_at_stop([], frozenset({9})) == []
