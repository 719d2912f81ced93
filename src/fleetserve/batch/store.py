"""Durable state of Batch API jobs: one SQLite database (WAL) plus a files directory.

    STATE_DIR/batch.db     files, batches, and one row per finished line
    STATE_DIR/files/<id>   file contents (uploads, outputs, error files)

Every finished line is its own transaction, so a process killed with -9 loses only the
lines in flight. A unique index on (batch_id, custom_id) over the lines that ran makes a
second result for the same custom_id impossible: a run that resumes skips committed lines,
and should one slip through anyway, the first result stays and the second is dropped.

One owner: every change to a batch goes through this class. Its methods are synchronous
and short (one small transaction), so the event loop calls them directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from fleetserve.batch.lines import LineResult, jsonl
from fleetserve.batch.records import ACTIVE_STATUSES, BatchRecord, FileRecord

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, bytes INTEGER NOT NULL,
    filename TEXT NOT NULL, created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL,
    output_file_id TEXT, error_file_id TEXT, created_at INTEGER NOT NULL,
    in_progress_at INTEGER, expires_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,
    failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0, metadata TEXT, errors TEXT
);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT,
    ran INTEGER NOT NULL, ok INTEGER NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (batch_id, line_no)
);
CREATE UNIQUE INDEX IF NOT EXISTS results_custom_id ON results (batch_id, custom_id)
    WHERE ran = 1;
CREATE TABLE IF NOT EXISTS batch_runs (
    batch_id TEXT PRIMARY KEY, running INTEGER NOT NULL, crashes INTEGER NOT NULL
);
"""

_TIMESTAMPS = {
    "in_progress": "in_progress_at",
    "finalizing": "finalizing_at",
    "completed": "completed_at",
    "failed": "failed_at",
    "expired": "expired_at",
    "cancelling": "cancelling_at",
    "cancelled": "cancelled_at",
}
COMPLETION_WINDOW_S = {"24h": 24 * 3600}


def default_state_dir() -> str:
    """$FLEETSERVE_STATE_DIR, else $XDG_STATE_HOME/fleetserve (~/.local/state/fleetserve)."""
    explicit = os.environ.get("FLEETSERVE_STATE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "fleetserve")


def _now() -> int:
    return int(time.time())


class BatchStore:
    def __init__(self, state_dir: str) -> None:
        self.state_dir = os.path.abspath(state_dir)
        self.files_dir = os.path.join(self.state_dir, "files")
        os.makedirs(self.files_dir, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            os.path.join(self.state_dir, "batch.db"), check_same_thread=False, isolation_level=None
        )
        self._db.row_factory = sqlite3.Row
        # WAL + NORMAL: a commit survives the process being killed (it is in the OS's
        # page cache); only a power cut can lose the last few, which is fine for a cache
        # of work that can be redone.
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _one(self, sql: str, args: tuple[Any, ...]) -> sqlite3.Row | None:
        with self._lock:
            row: sqlite3.Row | None = self._db.execute(sql, args).fetchone()
            return row

    # ------------------------------------------------------------------ files
    def file_path(self, file_id: str) -> str:
        return os.path.join(self.files_dir, file_id)

    @staticmethod
    def new_file_id() -> str:
        return f"file-{uuid.uuid4().hex}"

    def add_file(self, data: bytes, filename: str, purpose: str) -> FileRecord:
        """Writes the content first, then the row: a crash between leaves an orphan file,
        never a row without content."""
        file_id = self.new_file_id()
        self._write_atomic(self.file_path(file_id), data)
        return self.add_file_row(file_id, len(data), filename, purpose)

    def add_file_row(self, file_id: str, size: int, filename: str, purpose: str) -> FileRecord:
        """The row of a file whose content is already whole at `file_path(file_id)`."""
        rec = FileRecord(file_id, purpose, size, filename, _now())
        with self._tx() as db:
            db.execute(
                "INSERT INTO files VALUES (?, ?, ?, ?, ?)",
                (rec.id, rec.purpose, rec.bytes, rec.filename, rec.created_at),
            )
        return rec

    def get_file(self, file_id: str) -> FileRecord | None:
        row = self._one("SELECT * FROM files WHERE id = ?", (file_id,))
        return FileRecord(**dict(row)) if row is not None else None

    def list_files(
        self, after: str | None, limit: int, purpose: str | None = None
    ) -> tuple[list[FileRecord], bool]:
        """Newest first, paged like `list_batches`. ValueError if `after` names no file."""
        start = 2**62
        if after is not None:
            row = self._one("SELECT rowid FROM files WHERE id = ?", (after,))
            if row is None:
                raise ValueError(f"after: no file with id {after!r}")
            start = row["rowid"]
        sql = "SELECT id, purpose, bytes, filename, created_at FROM files WHERE rowid < ?"
        args: tuple[Any, ...] = (start,)
        if purpose is not None:
            sql += " AND purpose = ?"
            args += (purpose,)
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY rowid DESC LIMIT ?", (*args, limit + 1))
            found = rows.fetchall()
        return [FileRecord(**dict(r)) for r in found[:limit]], len(found) > limit

    def delete_file(self, file_id: str) -> bool:
        """False if there is no such file. ValueError if an unfinished batch reads it."""
        marks = ", ".join("?" * len(ACTIVE_STATUSES))
        with self._tx() as db:
            busy = db.execute(
                f"SELECT id FROM batches WHERE input_file_id = ? AND status IN ({marks})",
                (file_id, *ACTIVE_STATUSES),
            ).fetchone()
            if busy is not None:
                raise ValueError(f"the file is the input of batch {busy['id']}, still running")
            if db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount == 0:
                return False
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.file_path(file_id))
        return True

    def read_file(self, file_id: str) -> bytes:
        with open(self.file_path(file_id), "rb") as f:
            return f.read()

    @staticmethod
    def _write_atomic(path: str, data: bytes) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    # ---------------------------------------------------------------- batches
    def create_batch(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None = None,
    ) -> BatchRecord:
        if completion_window not in COMPLETION_WINDOW_S:
            raise ValueError(f"completion_window must be '24h'; got {completion_window!r}")
        batch_id = f"batch_{uuid.uuid4().hex}"
        created = _now()
        with self._tx() as db:
            db.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status,"
                " created_at, expires_at, metadata) VALUES (?, ?, ?, ?, 'validating', ?, ?, ?)",
                (
                    batch_id,
                    endpoint,
                    input_file_id,
                    completion_window,
                    created,
                    created + COMPLETION_WINDOW_S[completion_window],
                    json.dumps(metadata) if metadata is not None else None,
                ),
            )
        batch = self.get_batch(batch_id)
        assert batch is not None
        return batch

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        row = self._one("SELECT * FROM batches WHERE id = ?", (batch_id,))
        return BatchRecord.from_row(row) if row is not None else None

    def list_batches(self, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """Newest first; `after` is the id of the last batch of the previous page.
        Returns (page, has_more). ValueError if `after` names no batch."""
        start = 2**62
        if after is not None:
            row = self._one("SELECT seq FROM batches WHERE id = ?", (after,))
            if row is None:
                raise ValueError(f"after: no batch with id {after!r}")
            start = row["seq"]
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM batches WHERE seq < ? ORDER BY seq DESC LIMIT ?", (start, limit + 1)
            ).fetchall()
        return [BatchRecord.from_row(r) for r in rows[:limit]], len(rows) > limit

    def active_batch_ids(self) -> list[str]:
        """Batches a restart must pick up again, oldest first."""
        marks = ", ".join("?" * len(ACTIVE_STATUSES))
        with self._lock:
            rows = self._db.execute(
                f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq",
                tuple(ACTIVE_STATUSES),
            ).fetchall()
        return [r["id"] for r in rows]

    def set_status(
        self, batch_id: str, status: str, errors: list[dict[str, Any]] | None = None
    ) -> None:
        with self._tx() as db:
            self._set_status(db, batch_id, status)
            if errors is not None:
                db.execute(
                    "UPDATE batches SET errors = ? WHERE id = ?", (json.dumps(errors), batch_id)
                )

    @staticmethod
    def _set_status(db: sqlite3.Connection, batch_id: str, status: str) -> None:
        column = _TIMESTAMPS.get(status)
        if column is None:
            db.execute("UPDATE batches SET status = ? WHERE id = ?", (status, batch_id))
        else:
            db.execute(
                f"UPDATE batches SET status = ?, {column} = COALESCE({column}, ?) WHERE id = ?",
                (status, _now(), batch_id),
            )

    def start_batch(self, batch_id: str, total: int, invalid: list[LineResult]) -> None:
        """validating -> in_progress, with the unusable lines already in the error set."""
        with self._tx() as db:
            for r in invalid:
                self._insert_result(db, batch_id, r, ran=False)
            db.execute(
                "UPDATE batches SET total = ?, failed = ? WHERE id = ?",
                (total, len(invalid), batch_id),
            )
            self._set_status(db, batch_id, "in_progress")

    def request_cancel(self, batch_id: str) -> BatchRecord | None:
        """An active batch turns `cancelling` (its runner finishes the job); a finished
        one is returned unchanged."""
        with self._tx() as db:
            row = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                return None
            if row["status"] in ("validating", "in_progress"):
                self._set_status(db, batch_id, "cancelling")
        return self.get_batch(batch_id)

    def begin_run(self, batch_id: str) -> int:
        """A process starts running the batch; returns how many earlier runs ended with
        their process (a run that began and never reached end_run: killed, OOM)."""
        with self._tx() as db:
            row = db.execute(
                "SELECT running, crashes FROM batch_runs WHERE batch_id = ?", (batch_id,)
            ).fetchone()
            crashes = 0 if row is None else row["crashes"] + row["running"]
            db.execute(
                "INSERT OR REPLACE INTO batch_runs (batch_id, running, crashes) VALUES (?, 1, ?)",
                (batch_id, crashes),
            )
        return int(crashes)

    def end_run(self, batch_id: str) -> None:
        """The run stopped with its process still alive (finished, failed, or the server
        stopped it): not a crash."""
        with self._tx() as db:
            db.execute("UPDATE batch_runs SET running = 0 WHERE batch_id = ?", (batch_id,))

    def fail_batch(self, batch_id: str, code: str, message: str) -> None:
        """Marks the batch failed for good, with the lines that finished written out."""
        error = {"code": code, "message": message, "param": None, "line": None}
        self.set_status(batch_id, "failed", errors=[error])
        self.finalize(batch_id, "failed")

    # ------------------------------------------------------------------ lines
    def done_line_nos(self, batch_id: str) -> set[int]:
        with self._lock:
            rows = self._db.execute(
                "SELECT line_no FROM results WHERE batch_id = ?", (batch_id,)
            ).fetchall()
        return {r["line_no"] for r in rows}

    def commit_result(self, batch_id: str, result: LineResult) -> bool:
        """Records one finished line and its count; False if that line (or custom_id)
        already has a result, which is then kept as it was."""
        with self._tx() as db:
            if not self._insert_result(db, batch_id, result, ran=True):
                return False
            column = "completed" if result.ok else "failed"
            db.execute(f"UPDATE batches SET {column} = {column} + 1 WHERE id = ?", (batch_id,))
        return True

    @staticmethod
    def _insert_result(db: sqlite3.Connection, batch_id: str, r: LineResult, ran: bool) -> bool:
        cur = db.execute(
            "INSERT INTO results VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (batch_id, r.line_no, r.custom_id, int(ran), int(r.ok), r.record),
        )
        return cur.rowcount == 1

    def results(self, batch_id: str, ok: bool | None = None) -> list[str]:
        """The batch's committed JSON lines in input order (only ok/failed ones if given)."""
        sql = "SELECT record FROM results WHERE batch_id = ?"
        args: tuple[Any, ...] = (batch_id,)
        if ok is not None:
            sql += " AND ok = ?"
            args += (int(ok),)
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY line_no", args).fetchall()
        return [r["record"] for r in rows]

    def finalize(self, batch_id: str, status: str, extra_errors: Sequence[LineResult] = ()) -> None:
        """Writes the output and error files, then marks the batch `status` (completed,
        cancelled or expired) in one transaction. `extra_errors` (lines that will never
        run, e.g. past the window) are committed first. Safe to redo after a crash."""
        for r in extra_errors:
            self.commit_result(batch_id, r)
        if status == "completed":
            self.set_status(batch_id, "finalizing")
        ok_lines = self.results(batch_id, ok=True)
        bad_lines = self.results(batch_id, ok=False)
        out = self.add_file(jsonl(ok_lines), f"{batch_id}_output.jsonl", "batch_output")
        err = None
        if bad_lines:
            err = self.add_file(jsonl(bad_lines), f"{batch_id}_error.jsonl", "batch_output")
        with self._tx() as db:
            db.execute(
                "UPDATE batches SET output_file_id = ?, error_file_id = ? WHERE id = ?",
                (out.id, err.id if err else None, batch_id),
            )
            self._set_status(db, batch_id, status)
