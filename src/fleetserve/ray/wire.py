"""What crosses between the ingress and the model deployments besides RequestOutputs: a
refusal as plain data (exception classes with custom __init__ arguments do not survive
pickling, and Ray would wrap the rest in a RayTaskError whose text is a traceback), and
the ingress's rebuilding of it into the exception the local handlers already map to HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fleetserve.engine.async_engine import (
    EngineDeadError,
    EngineNotReadyError,
    EngineOverloadedError,
    ReplicaGoneError,
)
from fleetserve.engine.delta_stream import ReplicaRefusedError
from fleetserve.serve.microbatch.batcher import (
    MicroBatchItemError,
    MicroBatchOverloadedError,
    MicroBatchStoppedError,
)
from fleetserve.serve.microbatch.isolated import HandlerTimeoutError
from fleetserve.serve.microbatch.services import ServiceNotReadyError

ErrorKind = Literal[
    "value",
    "not_ready",
    "overloaded",
    "stopped",
    "refused",
    "gone",
    "dead",
    "timeout",
    "internal",
]

_KINDS: tuple[tuple[type[BaseException], ErrorKind], ...] = (
    (MicroBatchOverloadedError, "overloaded"),
    (MicroBatchStoppedError, "stopped"),
    (ServiceNotReadyError, "not_ready"),
    (EngineNotReadyError, "not_ready"),
    (EngineOverloadedError, "overloaded"),
    (ReplicaRefusedError, "refused"),  # before its base classes
    (ReplicaGoneError, "gone"),  # before its base class: the request may move on
    (EngineDeadError, "dead"),
    (ValueError, "value"),
    (HandlerTimeoutError, "timeout"),  # a handler past its timeout_s: 504 as locally
)


@dataclass(frozen=True)
class RemoteError:
    """A request refused or failed in a model replica. `index`: the failing item of an
    embed/predict request (MicroBatchItemError), else None."""

    kind: ErrorKind
    message: str
    index: int | None = None

    @classmethod
    def of(cls, e: BaseException) -> RemoteError:
        index: int | None = None
        if isinstance(e, MicroBatchItemError):
            index, e = e.index, e.error
        kind: ErrorKind = next((k for t, k in _KINDS if isinstance(e, t)), "internal")
        return cls(kind, str(e), index)

    def exception(self, batch: bool) -> Exception:
        """The exception the local handlers map to the same HTTP error. `batch`: an embed
        or custom model's (the batch services' types) rather than a generate model's."""
        if batch:
            err: Exception = {
                "value": ValueError,
                "not_ready": ServiceNotReadyError,
                "overloaded": MicroBatchOverloadedError,
                "stopped": MicroBatchStoppedError,
                "refused": MicroBatchStoppedError,
                "gone": MicroBatchStoppedError,
                "dead": MicroBatchStoppedError,
                "timeout": HandlerTimeoutError,
                "internal": RuntimeError,
            }[self.kind](self.message)
            return err if self.index is None else MicroBatchItemError(self.index, err)
        return {
            "value": ValueError,
            "not_ready": EngineNotReadyError,
            "overloaded": EngineOverloadedError,
            "stopped": EngineDeadError,
            "refused": ReplicaRefusedError,
            "gone": ReplicaGoneError,
            "dead": EngineDeadError,
            "timeout": EngineDeadError,
            "internal": EngineDeadError,
        }[self.kind](self.message)
