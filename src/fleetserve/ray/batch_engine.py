"""Batch lines on one in-process engine: what each Ray Data actor of `fleetserve.ray.batch`
holds. No Ray here, so it is tested without a cluster.

A line goes the way `FleetLineExecutor` (entrypoints/openai/batch_executor.py) takes it on
the server: the body is validated by the server's request models, turned into prompts and
SamplingParams by the handlers' pure halves (`chat_inputs`, `completion_inputs`), answered
in the handlers' response shapes (`chat_completion_body`, `completion_body`,
`create_embedding`) and written by the batch store's formatter (`response_result`), so an
output line is the one `fleetserve batch run` writes for it. What differs is the engine:
a generate job holds the offline `LLM` and runs all the lines it is given as one
continuous batch; an embed job holds an `EmbedService` (the embedding model and its
dynamic batcher) on an event loop of its own.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from fleetserve.batch.lines import (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    BatchLine,
    LineResult,
    response_result,
)
from fleetserve.batch.runner import LineAnswer
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.embedding_result import MINILM_NAME
from fleetserve.entrypoints.openai.errors import APIError, error_body, from_value_error
from fleetserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fleetserve.entrypoints.openai.protocol_embed import EmbeddingRequest
from fleetserve.entrypoints.openai.serving_chat import chat_completion_body, chat_inputs
from fleetserve.entrypoints.openai.serving_common import (
    GenerateFrontend,
    ModelContext,
    new_id,
    parse,
    shorten,
)
from fleetserve.entrypoints.openai.serving_completion import completion_body, completion_inputs
from fleetserve.entrypoints.openai.serving_embedding import create_embedding
from fleetserve.outputs import OutputFold, RequestOutput
from fleetserve.serve.config.fleet_config import FleetConfig
from fleetserve.serve.microbatch.batcher import MicroBatchConfig

log = logging.getLogger(__name__)

KIND_URLS = {"generate": (CHAT_URL, COMPLETIONS_URL), "embed": (EMBEDDINGS_URL,)}
# Response ids as FleetLineExecutor names them.
_PREFIX = {CHAT_URL: "chatcmpl", COMPLETIONS_URL: "cmpl", EMBEDDINGS_URL: "embd"}


@dataclass(frozen=True)
class LineModel:
    """The one model a job's engines hold, and every (name, kind) its lines may name (in
    the fleet file's order), so that a line naming another model gets the answer the
    server's registry gives: 404 unknown, 400 another kind."""

    name: str
    kind: str  # "generate" | "embed"
    listing: tuple[tuple[str, str], ...]
    engine_args: EngineArgs | None = None  # generate
    embed_model: str | None = None  # embed: a folder, or all-MiniLM-L6-v2
    batching: MicroBatchConfig | None = None  # embed: inputs per forward, wait

    def __post_init__(self) -> None:
        if self.kind not in KIND_URLS:
            raise ValueError(f"kind must be one of {', '.join(KIND_URLS)}; got {self.kind!r}")
        if (self.name, self.kind) not in self.listing:
            raise ValueError(f"listing must hold the model itself ({self.name!r}, {self.kind})")
        same_kind = [n for n, k in self.listing if k == self.kind]
        if len(same_kind) > 1:
            raise ValueError(
                f"a job runs one {self.kind} model; the listing has {len(same_kind)}: "
                + ", ".join(same_kind)
            )
        if self.kind == "generate" and self.engine_args is None:
            raise ValueError("engine_args is required for a generate model")
        if self.kind == "embed" and self.embed_model is None:
            raise ValueError("embed_model is required for an embed model")

    def check(self, name: str | None, kind: str) -> None:
        """Raises the APIError the server's registry lookup raises for `name` at an
        endpoint serving `kind`; passes when `name` is this model (or None for it)."""
        listing = ", ".join(f"{n!r} ({k})" for n, k in self.listing)
        kinds = dict(self.listing)
        if name is None:
            if sum(k == kind for _, k in self.listing) == 1:
                return
            message = f"model is required: this server has {listing}"
            raise APIError(400, shorten(message, 400), "model", "wrong_model_kind")
        if name not in kinds:
            message = f"the model {name!r} does not exist; this server has {listing}"
            raise APIError(404, shorten(message, 400), "model", "model_not_found")
        if kinds[name] != kind:
            message = (
                f"the model {name!r} is a {kinds[name]} model; this endpoint serves {kind} models"
            )
            raise APIError(400, shorten(message, 400), "model", "wrong_model_kind")


class LineEngine(Protocol):
    """Runs lines to their records. Contract: every line gets exactly one result, in the
    order given; a line's own failure is its error record; an exception means the engine
    itself failed, and none of the lines is done."""

    def run(self, lines: Sequence[BatchLine]) -> list[LineResult]: ...

    def close(self) -> None: ...


def line_model(fleet: FleetConfig, endpoint: str) -> LineModel:
    """The model of `fleet` that serves `endpoint`'s lines: its only model of that kind."""
    kind = next(k for k, urls in KIND_URLS.items() if endpoint in urls)
    entries = [m for m in fleet.models if m.kind == kind]
    if len(entries) != 1:
        names = ", ".join(m.name for m in entries) or "none"
        raise ValueError(
            f"--config: a Ray batch job runs one {kind} model for {endpoint} lines; "
            f"the fleet file has {len(entries)} ({names})"
        )
    entry = entries[0]
    listing = tuple((m.name, str(m.kind)) for m in fleet.models)
    if kind == "generate":
        return LineModel(entry.name, kind, listing, engine_args=entry.engine_args())
    return LineModel(
        entry.name,
        kind,
        listing,
        embed_model=entry.model or MINILM_NAME,
        batching=entry.batching,
    )


def load_engine(model: LineModel) -> LineEngine:
    """The engine of `model`, loaded."""
    if model.kind == "generate":
        return GenerateLines(model)
    return EmbedLines(model)


def _error_answer(request_id: str, e: Exception, line: BatchLine) -> LineAnswer:
    """What FleetLineExecutor answers for a failed line: the API error, or a 500."""
    if isinstance(e, APIError):
        if e.status == 503:  # the engine cannot serve now: not this line's fault
            raise RuntimeError(f"the engine is unavailable: {e.message}") from e
        return LineAnswer(e.status, request_id, error_body(e.status, e.message, e.param, e.code))
    log.error("batch line %s failed", line.custom_id, exc_info=e)
    return LineAnswer(500, request_id, error_body(500, f"internal error: {e}"))


def _check_url(model: LineModel, line: BatchLine) -> None:
    if line.body.get("stream"):
        raise APIError(400, "stream is not supported in a batch line", "stream")
    if line.url not in KIND_URLS[model.kind]:
        raise APIError(
            400,
            f"url {line.url} needs another kind of model; this job runs the "
            f"{model.kind} model {model.name!r}",
            "url",
        )


@dataclass(frozen=True)
class _Frontend:
    """The model as the handlers' pure halves see it: they read its tokenizer only."""

    name: str
    tokenizer: Any
    max_model_len: int


@dataclass(frozen=True)
class _Pending:
    """A line whose requests are in the engine; `finish` builds its body from their
    final outputs, in prompt order."""

    index: int
    request_id: str
    engine_ids: list[str]
    finish: Callable[[list[RequestOutput]], dict[str, Any]]


class GenerateLines:
    """Chat and completion lines on the offline `LLM`, all the lines of one `run` in one
    continuous batch (the scheduler fills each step from all of them)."""

    def __init__(self, model: LineModel) -> None:
        from fleetserve.engine.llm import LLM

        assert model.engine_args is not None  # LineModel checks it for generate models
        self.model = model
        self.llm = LLM(**dataclasses.asdict(model.engine_args))
        frontend = _Frontend(model.name, self.llm.get_tokenizer(), self.llm.engine.max_model_len)
        # chat_inputs and the *_body builders read `engine.tokenizer` and nothing else
        # of the frontend; admission is this class's own loop over the engine.
        self.ctx = ModelContext(cast(GenerateFrontend, frontend), model.name)

    def run(self, lines: Sequence[BatchLine]) -> list[LineResult]:
        answers: dict[int, LineAnswer] = {}
        pending: list[_Pending] = []
        for i, line in enumerate(lines):
            request_id = new_id(_PREFIX.get(line.url, "req"))
            try:
                pending.append(self._submit(i, line, request_id))
            except Exception as e:  # noqa: BLE001 -- one line's failure is its record
                answers[i] = _error_answer(request_id, e, line)
        finals = self._step_until_done()
        for p in pending:
            try:
                body = p.finish([finals[rid] for rid in p.engine_ids])
                answers[p.index] = LineAnswer(200, p.request_id, body)
            except Exception as e:  # noqa: BLE001
                answers[p.index] = _error_answer(p.request_id, e, lines[p.index])
        return [
            response_result(line, answers[i].status_code, answers[i].request_id, answers[i].body)
            for i, line in enumerate(lines)
        ]

    def _submit(self, index: int, line: BatchLine, request_id: str) -> _Pending:
        _check_url(self.model, line)
        if line.url == CHAT_URL:
            chat = parse(ChatCompletionRequest, line.body)
            self.model.check(chat.model, "generate")
            prompt, base = chat_inputs(self.ctx, chat)
            ids = self._add(request_id, [prompt], base, chat.priority)
            return _Pending(
                index,
                request_id,
                ids,
                lambda finals: chat_completion_body(self.ctx, chat, request_id, finals[0]),
            )
        cmpl = parse(CompletionRequest, line.body)
        self.model.check(cmpl.model, "generate")
        prompts, base = completion_inputs(cmpl)
        ids = self._add(request_id, prompts, base, cmpl.priority)
        return _Pending(
            index,
            request_id,
            ids,
            lambda finals: completion_body(self.ctx, cmpl, request_id, finals),
        )

    def _add(self, request_id: str, prompts: list[Any], base: Any, priority: int) -> list[str]:
        """One engine request per prompt, all or none (as the server admits them)."""
        engine = self.llm.engine
        ids: list[str] = []
        try:
            for k, prompt in enumerate(prompts):
                rid = f"{request_id}-{k}"
                # Each request owns its params: the engine fills max_tokens per prompt.
                engine.add_request(rid, prompt, copy.copy(base), priority=priority)
                ids.append(rid)
        except ValueError as e:
            engine.abort_request(ids)
            raise from_value_error(e) from None
        return ids

    def _step_until_done(self) -> dict[str, RequestOutput]:
        engine = self.llm.engine
        finals: dict[str, RequestOutput] = {}
        folds: dict[str, OutputFold] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():  # deltas, folded per request into its whole answer
                rid = out.request_id
                folds.setdefault(rid, OutputFold(rid)).add(out)
                if out.finished:
                    finals[rid] = folds.pop(rid).output()
        return finals

    def close(self) -> None:
        self.llm.engine.shutdown()


class EmbedLines:
    """Embedding lines on an `EmbedService`: every input of every line of one `run` is a
    batcher item, so inputs of different lines share forwards, as on the server."""

    def __init__(self, model: LineModel) -> None:
        from fleetserve.serve.microbatch.services import EmbedService

        assert model.embed_model is not None  # LineModel checks it for embed models
        self.model = model
        # The queue bound sheds load on a server; here the caller sizes `run`, and every
        # line's inputs must be taken at once.
        batching = dataclasses.replace(model.batching or MicroBatchConfig(), max_waiting=2**31 - 1)
        self.service = EmbedService(model.name, model.embed_model, batching=batching)
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.service.start())

    def run(self, lines: Sequence[BatchLine]) -> list[LineResult]:
        async def run_all() -> list[LineAnswer]:
            return list(await asyncio.gather(*(self._one(line) for line in lines)))

        answers = self.loop.run_until_complete(run_all())
        return [
            response_result(line, a.status_code, a.request_id, a.body)
            for line, a in zip(lines, answers, strict=True)
        ]

    async def _one(self, line: BatchLine) -> LineAnswer:
        request_id = new_id(_PREFIX.get(line.url, "req"))
        try:
            _check_url(self.model, line)
            emb = parse(EmbeddingRequest, line.body)
            self.model.check(emb.model, "embed")
            body = await create_embedding(self.service, emb)
        except Exception as e:  # noqa: BLE001 -- one line's failure is its record
            return _error_answer(request_id, e, line)
        return LineAnswer(200, request_id, body)

    def close(self) -> None:
        self.loop.run_until_complete(self.service.shutdown())
        self.loop.close()
