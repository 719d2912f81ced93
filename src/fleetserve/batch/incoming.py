"""A file of the batch store written chunk by chunk, as an upload arrives.

Until `commit` it is a `.part` file beside the store's files that no row points to, so a
failed or abandoned upload (or a crash) never leaves a File object with partial content;
`commit` makes the content durable (fsync), gives it its final name, then adds the row,
the order `BatchStore.add_file` keeps too.
"""

from __future__ import annotations

import contextlib
import os

from fleetserve.batch.records import FileRecord
from fleetserve.batch.store import BatchStore


class IncomingFile:
    def __init__(self, store: BatchStore) -> None:
        self.store = store
        self.id = store.new_file_id()
        self.part_path = f"{store.file_path(self.id)}.part"
        self._f = open(self.part_path, "wb")  # noqa: SIM115 -- closed by commit or discard
        self.size = 0

    def write(self, data: bytes) -> None:
        self._f.write(data)
        self.size += len(data)

    def commit(self, filename: str, purpose: str) -> FileRecord:
        """Blocks on the disk (fsync): call it off the event loop for a large file."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.part_path, self.store.file_path(self.id))
        return self.store.add_file_row(self.id, self.size, filename, purpose)

    def discard(self) -> None:
        """Removes what was written; nothing once committed."""
        if not self._f.closed:
            self._f.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.part_path)
