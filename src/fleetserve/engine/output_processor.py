"""Turns EngineCoreOutputs (token ids) into RequestOutputs (text), frontend side.

Detokenizes incrementally, finds stop strings (which the core cannot see) and holds
back text that may be the start of a stop string, so that the visible text only ever
grows by appending. One user request with n > 1 fans out to n core requests.

Each step gives each touched request one delta (outputs.py): the new token ids, text and
logprobs of the choices that changed. Nothing of a request is kept whole here: a choice
keeps its detokenizer, counts and the few characters held back for stop strings, so a
step costs what it adds, however long the answer has grown.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.core.scheduler_output import EngineCoreOutput
from fleetserve.detokenizer import IncrementalDetokenizer
from fleetserve.outputs import CompletionOutput, RequestOutput
from fleetserve.tokenizer import Tokenizer


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


@dataclass
class _Child:
    """One choice's state. The text is not kept whole: only `pending`, decoded text held
    back because it may be the start of a stop string (or, once a stop string may end the
    choice, what is searched for one); everything before it was sent."""

    index: int
    detok: IncrementalDetokenizer
    num_tokens: int = 0
    pending: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    # This step's delta, built by _update_child and taken by _take_delta.
    new_token_ids: list[int] = field(default_factory=list)
    new_text: list[str] = field(default_factory=list)
    new_logprobs: list[dict[int, float]] | None = None
    ended_now: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, _Child]
    arrival_time: float
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        if len(self.children) == 1:
            return next(iter(self.children.values())).finish_reason is not None
        return all(c.finished for c in self.children.values())


class OutputProcessor:
    """Owned by one engine client; `process` returns each touched request's delta."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _ParentState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        resume: RequestOutput | None = None,
    ) -> list[str]:
        """Registers a request; returns the core request ids of its n children.

        `resume` is the request's whole output so far (cumulative: an OutputFold's) as its
        client saw it on a replica that was lost: the children go on from it (finished
        ones stay finished), so the deltas continue it without repeating or dropping a
        token."""
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if resume is not None and len(resume.outputs) != params.n:
            raise ValueError(f"resume has {len(resume.outputs)} outputs for n={params.n}")
        if resume is not None and all(c.finish_reason is not None for c in resume.outputs):
            # Nothing would be sent to the core, and the stream would wait for ever.
            raise ValueError("resume: every output has finished already; nothing to resume")
        children = {}
        for i in range(params.n):
            cid = child_request_id(request_id, i, params.n)
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens
            )
            if resume is None:
                lp = 0.0 if params.logprobs is not None else None
                children[cid] = _Child(i, detok, cumulative_logprob=lp)
            else:
                children[cid] = _resumed_child(i, detok, resume.outputs[i])
            self.child_to_parent[cid] = request_id
        state = _ParentState(
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            children,
            arrival_time=time.monotonic(),
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
        )
        if resume is not None:
            # The reader has the prompt's logprobs already (or never asked for them).
            state.prompt_logprobs, state.prompt_logprobs_sent = None, True
            state.num_cached_tokens = resume.num_cached_tokens
            state.metrics = dict(resume.metrics)
            if any(c.token_ids for c in resume.outputs):
                state.first_token_time = state.arrival_time  # measured on the first replica
        self.parents[request_id] = state
        return list(children)

    def child_ids(self, request_id: str) -> list[str]:
        st = self.parents.get(request_id)
        return list(st.children) if st else []

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forgets the request; its last delta ends every unfinished choice with "abort"."""
        st = self.parents.pop(request_id, None)
        if st is None:
            return None
        for cid, child in st.children.items():
            self.child_to_parent.pop(cid, None)
            if child.finish_reason is None:
                child.finish_reason, child.ended_now = "abort", True
        return self._take_delta(st)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the touched requests' deltas and the core ids to stop (stop strings)."""
        touched: dict[str, _ParentState] = {}
        to_stop: list[str] = []
        now = time.monotonic()
        for eo in outputs:
            pid = self.child_to_parent.get(eo.req_id)
            if pid is None:
                continue
            st = self.parents[pid]
            child = st.children[eo.req_id]
            if child.finish_reason is not None:
                continue
            touched[pid] = st
            st.num_cached_tokens = max(st.num_cached_tokens, eo.num_cached_tokens)
            if eo.new_prompt_logprobs is not None and st.prompt_logprobs is not None:
                if eo.new_prompt_logprobs and eo.new_prompt_logprobs[0] is None:
                    st.prompt_logprobs = []  # recomputed from the start after preemption
                if child.index == 0:
                    st.prompt_logprobs.extend(eo.new_prompt_logprobs)
            if eo.new_token_ids and st.first_token_time is None:
                st.first_token_time = now
                st.metrics["time_to_first_token"] = now - st.arrival_time
            if self._update_child(st.params, child, eo):
                to_stop.append(eo.req_id)
        results = []
        for pid, st in touched.items():
            finished = st.finished
            if finished:
                st.metrics["e2e_latency"] = now - st.arrival_time
                del self.parents[pid]
                for cid in st.children:
                    self.child_to_parent.pop(cid, None)
            results.append(self._take_delta(st, finished))
        return results, to_stop

    def _update_child(self, params: SamplingParams, child: _Child, eo: EngineCoreOutput) -> bool:
        """Apply one core output to a child; True when a stop string ended it."""
        n = len(eo.new_token_ids)
        if n > 1 and params.stop_strings:
            # Several tokens in one step (accepted draft tokens): a stop string that one
            # of them completes ends the output at that token, as one token a step would.
            for i, tok in enumerate(eo.new_token_ids):
                last = i == n - 1
                part = replace(
                    eo,
                    new_token_ids=[tok],
                    new_logprobs=None if eo.new_logprobs is None else eo.new_logprobs[i : i + 1],
                    finish_reason=eo.finish_reason if last else None,
                    stop_reason=eo.stop_reason if last else None,
                )
                if self._update_child_tokens(params, child, part):
                    return True
            return False
        return self._update_child_tokens(params, child, eo)

    def _update_child_tokens(
        self, params: SamplingParams, child: _Child, eo: EngineCoreOutput
    ) -> bool:
        child.num_tokens += len(eo.new_token_ids)
        child.new_token_ids.extend(eo.new_token_ids)
        if eo.new_logprobs is not None and child.cumulative_logprob is not None:
            if child.new_logprobs is None:
                child.new_logprobs = []
            for tok, lp in zip(eo.new_token_ids, eo.new_logprobs, strict=False):
                child.new_logprobs.append(lp)
                child.cumulative_logprob += lp.get(tok, 0.0)
        # `text`: what this child has decoded and not sent yet. A stop string that the new
        # tokens complete starts in it: text before it was sent only when no suffix of it
        # could begin a stop string (_held_back), so no stop string starts there.
        text = child.pending + child.detok.add_tokens(eo.new_token_ids)
        if eo.finish_reason is not None:
            text += child.detok.flush()  # a sequence cut mid-character owes its last bytes
        stops = params.stop_strings
        stopped = False
        if stops and child.num_tokens >= params.min_tokens:
            hit = _find_first(text, stops, 0)
            if hit is not None:
                pos, s = hit
                text = text[: pos + len(s) if params.include_stop_str_in_output else pos]
                child.finish_reason, child.stop_reason = "stop", s
                stopped = True
        if not stopped and eo.finish_reason is not None:
            child.finish_reason, child.stop_reason = eo.finish_reason, eo.stop_reason
        keep = 0 if child.finished or not stops else _held_back(text, stops)
        if len(text) > keep:
            child.new_text.append(text[: len(text) - keep])
        child.pending = text[len(text) - keep :] if keep else ""
        child.ended_now = child.finished
        return stopped

    def _take_delta(self, st: _ParentState, finished: bool | None = None) -> RequestOutput:
        """What is new for the reader since the request's previous delta; resets it.
        finished: `st.finished`, if the caller has it."""
        if finished is None:
            finished = st.finished
        outputs = []
        for c in st.children.values():
            if not (c.new_token_ids or c.new_text or c.ended_now):
                continue
            text = c.new_text[0] if len(c.new_text) == 1 else "".join(c.new_text)
            outputs.append(
                CompletionOutput(
                    c.index,
                    text,
                    c.new_token_ids,
                    c.finish_reason if c.ended_now else None,
                    c.stop_reason if c.ended_now else None,
                    c.new_logprobs,
                    c.cumulative_logprob,
                )  # fmt: skip
            )
            c.new_token_ids, c.new_text, c.new_logprobs, c.ended_now = [], [], None, False
        prompt_logprobs = None
        if not st.prompt_logprobs_sent and st.prompt_logprobs is not None:
            # Once, when the prompt is prefilled (the first token, or the end).
            complete = len(st.prompt_logprobs) >= len(st.prompt_token_ids)
            if complete or st.first_token_time is not None or finished:
                prompt_logprobs, st.prompt_logprobs_sent = st.prompt_logprobs, True
                st.prompt_logprobs = None  # the reader owns that list now
        return RequestOutput(
            request_id=st.request_id,
            prompt=st.prompt,
            prompt_token_ids=st.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=st.num_cached_tokens,
            metrics=dict(st.metrics) if finished else {},
        )


def _find_first(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        pos = text.find(s, start)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    return best


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


def _resumed_child(index: int, detok: IncrementalDetokenizer, seen: CompletionOutput) -> _Child:
    """A child that continues `seen` (cumulative): its detokenizer replays the tokens one
    at a time, as they were first decoded, so the text it goes on from (held-back
    stop-string prefixes included) is the text the first replica had."""
    child = _Child(index, detok, num_tokens=len(seen.token_ids),
                   cumulative_logprob=seen.cumulative_logprob)  # fmt: skip
    if seen.finish_reason is not None:
        child.finish_reason, child.stop_reason = seen.finish_reason, seen.stop_reason
        return child
    full_text = "".join(detok.add_tokens([t]) for t in seen.token_ids)
    child.pending = full_text[len(seen.text) :]
    return child
