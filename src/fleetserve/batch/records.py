"""File and Batch objects as the store holds them, and in OpenAI's JSON shapes."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

# Batches a restart must pick up again (their runner was interrupted).
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")


@dataclass(frozen=True)
class FileRecord:
    id: str
    purpose: str
    bytes: int
    filename: str
    created_at: int

    def to_api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }


@dataclass(frozen=True)
class BatchRecord:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    total: int
    completed: int
    failed: int
    metadata: dict[str, str] | None
    errors: list[dict[str, Any]] | None

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> BatchRecord:
        values = dict(row)
        values.pop("seq")
        for key in ("metadata", "errors"):
            values[key] = json.loads(values[key]) if values[key] is not None else None
        return cls(**values)

    def to_api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "metadata": self.metadata,
        }
