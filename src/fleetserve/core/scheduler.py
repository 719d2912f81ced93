"""Iteration-level scheduler under one token budget (pure Python).

Each step, running requests are served first (oldest first), then waiting ones. A
request is given ``min(num_tokens - num_computed_tokens, remaining budget)`` tokens, so
a long prompt is prefilled over several steps, mixed with other requests' decodes.
When blocks run out, the newest running request (or the least important one under the
priority policy) is preempted: its blocks are freed and it is recomputed later. Under the
priority policy running requests take the budget in priority order, and a waiting request
that is more important than a running one also takes its seat (full batch), its blocks, or
its tokens for the step: that is how the fleet's SLA classes reach the engine.

Speculative decoding rides on the same rule: a decoding request with draft tokens is
given its pending token plus the drafts, the runner verifies them in that one step, and
``update_from_output`` moves ``num_computed_tokens`` back past the rejected ones and gives
their blocks back.
"""

from __future__ import annotations

from collections.abc import Iterable, Set
from dataclasses import dataclass, field

from fleetserve.core.block_manager import BlockManager
from fleetserve.core.config import SchedulerConfig
from fleetserve.core.request import Request, RequestStatus
from fleetserve.core.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


@dataclass
class _Step:
    """One schedule() call's working state, which its phases share."""

    budget: int  # tokens left to give this step
    max_num_reqs: int
    in_flight: Set[str]  # in an in-flight pipeline batch: never touched this step
    num_scheduled: dict[str, int] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted: bool = False  # a running request lost its blocks: no admissions
    skip: set[str] = field(default_factory=set)  # not to be (re-)admitted this step
    lent: dict[str, int] = field(default_factory=dict)  # tokens a lender gave a borrower

    @property
    def batch_full(self) -> bool:
        return len(self.num_scheduled) >= self.max_num_reqs

    def take_back(self, req_id: str) -> None:
        """A preempted request gives back the tokens (and drafts) given it this step."""
        self.budget += self.num_scheduled.pop(req_id, 0)
        self.spec_tokens.pop(req_id, None)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Tokens and blocks the model runner already knows per running request.
        self._sent_tokens: dict[str, int] = {}
        self._sent_blocks: dict[str, int] = {}
        # The same for the sliding-window layers' own block lists (hybrid models only).
        self._sent_window_blocks: dict[str, int] = {}
        self._finished_since_last_step: set[str] = set()
        self.num_preemptions = 0
        # Speculative decoding: verifications, draft tokens verified, drafts accepted.
        self.num_spec_verifications = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # --------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        self.check_request(request)
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def check_request(self, request: Request) -> None:
        """Raise ValueError when `request` can never run here (add_request's checks)."""
        if request.req_id in self.requests:
            raise ValueError(f"request_id {request.req_id!r} is already in use")
        max_len = self.config.max_model_len
        if request.num_prompt_tokens >= max_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; max_model_len is {max_len} "
                "(the prompt must leave room for at least one generated token)"
            )
        bm = self.block_manager
        max_chunk = self.config.max_num_batched_tokens + self.config.num_lookahead_tokens
        num_tokens = min(request.num_prompt_tokens + request.max_tokens, max_len)
        if bm.max_blocks_held(num_tokens, max_chunk) > bm.num_blocks:
            raise ValueError(
                f"request needs more KV blocks than the cache holds ({bm.num_blocks} blocks of "
                f"{bm.block_size} tokens); lower max_tokens or raise num_kv_blocks"
            )

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort or stop requests (stop strings are found outside the core)."""
        done = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None or req.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)
            done.append(req)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _free(self, req: Request) -> None:
        self.block_manager.free(req)
        self.requests.pop(req.req_id, None)
        self._forget(req.req_id)

    def _forget(self, req_id: str) -> None:
        if self._sent_tokens.pop(req_id, None) is not None:
            self._finished_since_last_step.add(req_id)
        self._sent_blocks.pop(req_id, None)
        self._sent_window_blocks.pop(req_id, None)

    # ---------------------------------------------------------------- schedule
    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        self._forget(req.req_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)

    def _victim_for(
        self, req: Request, in_flight: Set[str], among: Set[str] | dict[str, int] | None = None
    ) -> Request | None:
        """Under "priority", the least important running request (of `among`, if given) if
        `req` is strictly more important (lower priority value); it gives up its seat and
        blocks to `req`. Never under fcfs, never a request in an in-flight pipeline batch."""
        if self.config.policy != "priority":
            return None
        running = [
            r
            for r in self.running
            if r.req_id not in in_flight and (among is None or r.req_id in among)
        ]
        if not running:
            return None
        victim = max(running, key=lambda r: (r.priority, r.arrival_time))
        return victim if victim.priority > req.priority else None

    def _admit(self, req: Request, num_hit_tokens: int) -> None:
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_hit_tokens
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_hit_tokens
        if self.block_manager.enable_prefix_caching:
            self.block_manager.record_lookup(req.num_tokens, num_hit_tokens)

    def _next_waiting(self, skip: set[str]) -> Request | None:
        candidates = [r for r in self.waiting if r.req_id not in skip]
        if not candidates:
            return None
        if self.config.policy == "priority":
            return min(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[0]

    def _lookahead(self, req: Request, num_computed: int, num_new: int) -> int:
        """Slots a draft model writes past this step's tokens, if the step samples (and a
        lone running request's speculative burst: worker/spec_burst.py)."""
        if num_computed + num_new < req.num_tokens:
            return 0  # mid-prompt: nothing is proposed after this step
        room = self.config.max_model_len - num_computed - num_new
        want = self.config.num_lookahead_tokens
        if len(self.running) == 1 and not self.waiting:  # alone in its step: it may burst
            want = max(want, self.config.num_burst_lookahead_tokens)
        return max(0, min(want, room))

    def _sibling_prefilling(self, req: Request) -> bool:
        """n>1 siblings wait until one of them has computed the shared prompt."""
        if req.group_id is None or not self.block_manager.enable_prefix_caching:
            return False
        # Once one sibling has the prompt, all the others may start at once: a sibling
        # admitted on its cache hits is still short of its prompt's last token.
        siblings = [r for r in self.running if r.group_id == req.group_id]
        return bool(siblings) and all(r.num_computed_tokens < r.num_prompt_tokens for r in siblings)

    def _lora_slots_taken(self, req: Request) -> bool:
        """Whether `req`'s adapter would be one too many among the running requests (the
        worker has `max_loras` slots); it waits until one of them is free."""
        max_loras = self.config.max_loras
        name = req.lora_name
        if max_loras is None or name is None:
            return False
        active = {r.lora_name for r in self.running if r.lora_name is not None}
        return name not in active and len(active) >= max_loras

    def schedule(
        self, skip_req_ids: Set[str] = frozenset(), max_num_reqs: int | None = None
    ) -> SchedulerOutput:
        """One step's batch. With pipeline parallelism the engine keeps several batches in
        flight: `skip_req_ids` are in one (never scheduled, nor re-admitted after a
        preemption, until it returns) and `max_num_reqs` caps the batch so that the running
        requests spread over the in-flight batches.

        Phases: the running requests take the budget (preempting when blocks run out),
        then waiting ones are admitted while budget, seats and blocks allow (unless a
        preemption happened), then tokens lent to more important requests go back to
        their lenders, and the step's batch is written out."""
        if max_num_reqs is None:
            max_num_reqs = self.config.max_num_seqs
        step = _Step(self.config.max_num_batched_tokens, max_num_reqs, skip_req_ids)
        step.skip.update(skip_req_ids)
        self._schedule_running(step)
        if not step.preempted:
            self._admit_waiting(step)
        self._return_lent_tokens(step)
        return self._step_output(step)

    def _schedule_running(self, step: _Step) -> None:
        """Running requests take the budget (under "priority", most important first)."""
        order = list(self.running)
        if self.config.policy == "priority":
            order.sort(key=lambda r: (r.priority, r.arrival_time))
        for req in order:
            if step.budget <= 0 or step.batch_full:
                break
            if req.status != RequestStatus.RUNNING or req.req_id in step.in_flight:
                continue  # preempted earlier in this loop, or in flight
            self._fit_running(step, req)

    def _fit_running(self, step: _Step, req: Request) -> None:
        """Gives one running request its tokens (and drafts) for this step, preempting the
        newest (or least important) running requests while blocks run out."""
        bm = self.block_manager
        num_unseen = req.num_tokens - req.num_computed_tokens
        num_new = min(num_unseen + len(req.spec_token_ids), step.budget)
        num_new = min(num_new, self.config.max_model_len - req.num_computed_tokens)
        if num_new <= 0:
            return
        num_spec = max(0, num_new - num_unseen)
        lookahead = (
            self._lookahead(req, req.num_computed_tokens, num_new)
            if self.config.reserves_lookahead
            else 0
        )
        while not bm.allocate_slots(req, num_new + lookahead):
            if num_spec or lookahead:
                # Drafts and lookahead are optional: drop them before preempting.
                num_new, num_spec, lookahead = num_new - num_spec, 0, 0
                continue
            victim = self._pick_victim()
            self._preempt(victim)
            step.preempted = True
            step.take_back(victim.req_id)  # a victim already given tokens gives them back
            if victim is req:
                break
        if req.status == RequestStatus.RUNNING:
            step.num_scheduled[req.req_id] = num_new
            step.budget -= num_new
            if num_spec:
                step.spec_tokens[req.req_id] = req.spec_token_ids[:num_spec]

    def _admit_waiting(self, step: _Step) -> None:
        """Waiting requests join while there is budget, a seat and blocks; under
        "priority" a more important one takes a less important one's tokens, seat or
        blocks."""
        while True:
            req = self._next_waiting(step.skip)
            if req is None:
                break
            if step.budget <= 0 and not self._borrow_tokens(step, req):
                break
            if self._sibling_prefilling(req) or self._lora_slots_taken(req):
                step.skip.add(req.req_id)
                continue
            if not self._take_seat(step, req):
                break
            num_new, num_hit_tokens = self._allocate_waiting(step, req)
            if num_new == 0:
                break
            self._admit(req, num_hit_tokens)
            step.num_scheduled[req.req_id] = num_new
            step.budget -= num_new

    def _borrow_tokens(self, step: _Step, req: Request) -> bool:
        """Out of token budget: a more important request takes a less important one's
        tokens for this step (the lender keeps its blocks and runs next step)."""
        lender = self._victim_for(req, step.in_flight, step.num_scheduled)
        if lender is None:
            return False
        num_given = step.num_scheduled.pop(lender.req_id)
        step.budget += num_given
        # Drafts are optional: a lender gets back only its own tokens, if any.
        step.lent[lender.req_id] = num_given - len(step.spec_tokens.pop(lender.req_id, []))
        return True

    def _take_seat(self, step: _Step, req: Request) -> bool:
        """Full batch: only a more important request gets in, in a victim's seat (one of
        this batch's, when it is the batch that is full). False: no seat for `req`."""
        batch_full = step.batch_full
        if not batch_full and len(self.running) < self.config.max_num_seqs:
            return True
        seat = self._victim_for(req, step.in_flight, step.num_scheduled if batch_full else None)
        if seat is None:
            return False
        self._preempt(seat)
        step.take_back(seat.req_id)
        step.skip.add(seat.req_id)  # not back in this step
        return True

    def _allocate_waiting(self, step: _Step, req: Request) -> tuple[int, int]:
        """Blocks for a waiting request's first tokens after its prefix-cache hits:
        (tokens this step, cached tokens); 0 tokens when it does not fit."""
        bm = self.block_manager
        while True:
            hits, num_hit_tokens = bm.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit_tokens
            fits = self.config.chunked_prefill or num_new <= step.budget
            num_new = min(num_new, step.budget)
            # Lookahead slots (for a draft model) are optional: without them if need be.
            lookahead = self._lookahead(req, num_hit_tokens, num_new)
            if fits and (
                (lookahead and bm.allocate_slots(req, num_new + lookahead, hits))
                or bm.allocate_slots(req, num_new, hits)
            ):
                return num_new, num_hit_tokens
            # Out of blocks (or budget): a more important request takes a victim's.
            donor = self._victim_for(req, step.in_flight)
            if donor is None:
                return 0, num_hit_tokens
            self._preempt(donor)
            step.take_back(donor.req_id)
            step.skip.add(donor.req_id)

    def _return_lent_tokens(self, step: _Step) -> None:
        """What the borrowers left of the budget goes back to the lenders (their blocks
        already cover the tokens they had been given)."""
        for req_id, num_lent in step.lent.items():
            if step.budget <= 0 or step.batch_full:
                break
            lender = self.requests[req_id]
            running = lender.status == RequestStatus.RUNNING
            if num_lent and running and req_id not in step.num_scheduled:
                step.num_scheduled[req_id] = min(num_lent, step.budget)
                step.budget -= step.num_scheduled[req_id]

    def _step_output(self, step: _Step) -> SchedulerOutput:
        """The batch for the model runner: new requests in full, running ones as what
        changed since the runner last saw them."""
        bm = self.block_manager
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        for req in self.running:
            if req.req_id not in step.num_scheduled:
                continue
            block_ids = bm.block_ids(req.req_id)
            window_ids = bm.window_block_ids(req.req_id)
            if req.req_id not in self._sent_tokens:
                new_reqs.append(
                    NewRequestData(
                        req_id=req.req_id,
                        token_ids=list(req.all_token_ids),
                        num_prompt_tokens=req.num_prompt_tokens,
                        sampling_params=req.sampling_params,
                        block_ids=list(block_ids),
                        num_computed_tokens=req.num_computed_tokens,
                        num_output_tokens=req.num_output_tokens,
                        eos_token_ids=req.eos_token_ids,
                        window_block_ids=None if window_ids is None else list(window_ids),
                        lora_name=req.lora_name,
                    )
                )
            else:
                cached_reqs.append(
                    CachedRequestData(
                        req_id=req.req_id,
                        new_token_ids=req.all_token_ids[self._sent_tokens[req.req_id] :],
                        new_block_ids=block_ids[self._sent_blocks[req.req_id] :],
                        num_computed_tokens=req.num_computed_tokens,
                        num_kept_block_ids=self._sent_blocks[req.req_id],
                    )
                )
                if window_ids is not None:
                    sent = self._sent_window_blocks[req.req_id]
                    cached_reqs[-1].new_window_block_ids = window_ids[sent:]
                    cached_reqs[-1].num_kept_window_block_ids = sent
            self._sent_tokens[req.req_id] = req.num_tokens
            self._sent_blocks[req.req_id] = len(block_ids)
            if window_ids is not None:
                self._sent_window_blocks[req.req_id] = len(window_ids)

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=sum(step.num_scheduled.values()),
            finished_req_ids=self._finished_since_last_step,
            scheduled_spec_decode_tokens=step.spec_tokens,
        )
        self._finished_since_last_step = set()
        return out

    # ----------------------------------------------------------------- update
    def update_from_output(
        self, sched: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        max_len = self.config.max_model_len
        # Without drafts or lookahead slots no request holds blocks past its tokens.
        may_hold_tail = result.spec_token_ids is not None or self.config.reserves_lookahead
        for idx, req_id in enumerate(result.req_ids):
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            sampled = result.sampled_token_ids[idx]
            num_computed = req.num_computed_tokens + sched.num_scheduled_tokens[req_id]
            drafts = sched.scheduled_spec_decode_tokens.get(req_id)
            burst = result.spec_bursts.get(req_id)
            if drafts:
                # sampled = the accepted drafts + one token of the target's own (then a
                # speculative burst's tokens, whose K/V are in the cache but the last's);
                # the rejected drafts' K/V are garbage, recomputed when their slots are
                # reused.
                assert sampled, "a step with drafts reaches the request's end: it samples"
                num_computed -= len(drafts) - (len(sampled) - 1)
                self.num_spec_verifications += 1
                self.num_draft_tokens += len(drafts)
                self.num_accepted_tokens += len(sampled) - 1 - (burst.num_tokens if burst else 0)
            elif len(sampled) > 1:
                # A burst (worker/decode_burst.py, spec_burst.py): the runner also decoded
                # each token after the first, so all but the last have their K/V in the
                # cache.
                num_computed += len(sampled) - 1
            if burst is not None:
                self.num_spec_verifications += burst.num_verifications
                self.num_draft_tokens += burst.num_draft_tokens
                self.num_accepted_tokens += burst.num_accepted_tokens
            req.num_computed_tokens = num_computed
            new_tokens: list[int] = []
            new_logprobs = []
            for j, tok in enumerate(sampled):
                req.append_token(tok)
                new_tokens.append(tok)
                if result.logprobs is not None:
                    new_logprobs.append(result.logprobs[idx][j])
                if req.check_stop(max_len) or req.accept_grammar_token(tok):
                    break
            # Accepted drafts after a stop are dropped with their K/V.
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
            # Only now are the accepted drafts among the request's tokens (block hashes
            # cover verified tokens only).
            self.block_manager.cache_full_blocks(req)
            if not req.finished and (may_hold_tail or drafts):
                self._after_verify(req, result, idx)
            prompt_lps = result.prompt_logprobs.get(req_id)
            if not new_tokens and prompt_lps is None:
                continue
            out = EngineCoreOutput(
                req_id=req_id,
                new_token_ids=new_tokens,
                new_logprobs=new_logprobs if result.logprobs is not None else None,
                new_prompt_logprobs=prompt_lps,
                num_cached_tokens=req.num_cached_tokens,
            )
            if req.finished:
                out.finish_reason = req.status.finish_reason
                out.stop_reason = req.stop_reason
                self.running.remove(req)
                self._free(req)
            outputs.append(out)
        return outputs

    def _after_verify(self, req: Request, result: ModelRunnerOutput, idx: int) -> None:
        """Take the next drafts and give back the blocks past the verified tokens."""
        if result.spec_token_ids is not None:
            room = req.max_tokens - req.num_output_tokens - 1  # the last token is the target's
            drafts = result.spec_token_ids[idx][: max(room, 0)]
            if req.grammar is not None:
                # Drafts the grammar refuses would only be rejected: cut them here.
                drafts = drafts[: req.grammar.validate_tokens(drafts)]
            req.spec_token_ids = drafts
        if self.block_manager.free_tail(req, req.num_tokens):
            held = len(self.block_manager.block_ids(req.req_id))
            sent = self._sent_blocks.get(req.req_id)
            if sent is not None and sent > held:
                self._sent_blocks[req.req_id] = held
            window_ids = self.block_manager.window_block_ids(req.req_id)
            sent = self._sent_window_blocks.get(req.req_id)
            if window_ids is not None and sent is not None and sent > len(window_ids):
                self._sent_window_blocks[req.req_id] = len(window_ids)
