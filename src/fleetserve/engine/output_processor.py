"""Turns EngineCoreOutputs (token ids) into RequestOutputs (text), frontend side.

Detokenizes incrementally, finds stop strings (which the core cannot see) and holds
back text that may be the start of a stop string, so that the visible text only ever
grows by appending. One user request with n > 1 fans out to n core requests.
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
    index: int
    detok: IncrementalDetokenizer
    output: CompletionOutput
    full_text: str = ""


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, _Child]
    arrival_time: float
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(c.output.finish_reason is not None for c in self.children.values())


class OutputProcessor:
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

        `resume` is the request's last output as its client saw it on a replica that was
        lost: the children start from it (tokens, logprobs, text, finished ones stay
        finished), so the outputs continue it without repeating or dropping a token."""
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if resume is not None and len(resume.outputs) != params.n:
            raise ValueError(f"resume has {len(resume.outputs)} outputs for n={params.n}")
        children = {}
        for i in range(params.n):
            cid = child_request_id(request_id, i, params.n)
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens
            )
            if resume is None:
                out = CompletionOutput(
                    index=i,
                    text="",
                    token_ids=[],
                    logprobs=[] if params.logprobs is not None else None,
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                )
                children[cid] = _Child(i, detok, out)
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
            state.prompt_logprobs = (
                list(resume.prompt_logprobs) if resume.prompt_logprobs is not None else None
            )
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
        st = self.parents.pop(request_id, None)
        if st is None:
            return None
        for cid, child in st.children.items():
            self.child_to_parent.pop(cid, None)
            if child.output.finish_reason is None:
                child.output.finish_reason = "abort"
        return self._make_output(st)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated request outputs and the core ids to stop (stop strings)."""
        touched: dict[str, _ParentState] = {}
        to_stop: list[str] = []
        now = time.monotonic()
        for eo in outputs:
            pid = self.child_to_parent.get(eo.req_id)
            if pid is None:
                continue
            st = self.parents[pid]
            child = st.children[eo.req_id]
            if child.output.finish_reason is not None:
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
            results.append(self._make_output(st))
            if st.finished:
                st.metrics["e2e_latency"] = now - st.arrival_time
                results[-1].metrics = dict(st.metrics)
                del self.parents[pid]
                for cid in st.children:
                    self.child_to_parent.pop(cid, None)
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
        out = child.output
        prev_len = len(child.full_text)
        out.token_ids.extend(eo.new_token_ids)
        if eo.new_logprobs is not None and out.logprobs is not None:
            for tok, lp in zip(eo.new_token_ids, eo.new_logprobs, strict=False):
                out.logprobs.append(lp)
                if out.cumulative_logprob is not None:
                    out.cumulative_logprob += lp.get(tok, 0.0)
        child.full_text += child.detok.add_tokens(eo.new_token_ids)
        if eo.finish_reason is not None:
            # A sequence cut mid-character still owes its last bytes.
            child.full_text += child.detok.flush()
        stops = params.stop_strings
        stopped = False
        if stops and len(out.token_ids) >= params.min_tokens:
            window = max(0, prev_len - max(len(s) for s in stops) + 1)
            hit = _find_first(child.full_text, stops, window)
            if hit is not None:
                pos, s = hit
                end = pos + len(s) if params.include_stop_str_in_output else pos
                child.full_text = child.full_text[:end]
                out.finish_reason, out.stop_reason = "stop", s
                stopped = True
        if not stopped and eo.finish_reason is not None:
            out.finish_reason, out.stop_reason = eo.finish_reason, eo.stop_reason
        if out.finish_reason is not None or not stops:
            out.text = child.full_text
        else:
            out.text = child.full_text[: len(child.full_text) - _held_back(child.full_text, stops)]
        return stopped

    def _make_output(self, st: _ParentState) -> RequestOutput:
        return RequestOutput(
            request_id=st.request_id,
            prompt=st.prompt,
            prompt_token_ids=st.prompt_token_ids,
            outputs=[_snapshot(c.output) for c in st.children.values()],
            finished=st.finished,
            prompt_logprobs=st.prompt_logprobs,
            num_cached_tokens=st.num_cached_tokens,
            metrics=dict(st.metrics),
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
    """A child that continues `seen`: its detokenizer replays the tokens one at a time, as
    they were first decoded, so the text it goes on from (held-back stop-string prefixes
    included) is the text the first replica had."""
    full_text = "".join(detok.add_tokens([t]) for t in seen.token_ids)
    if seen.finish_reason is not None:
        full_text = seen.text
    return _Child(index, detok, _snapshot(seen), full_text)


def _snapshot(out: CompletionOutput) -> CompletionOutput:
    """A copy the caller may keep while the engine goes on appending."""
    return replace(
        out,
        token_ids=list(out.token_ids),
        logprobs=list(out.logprobs) if out.logprobs is not None else None,
    )
