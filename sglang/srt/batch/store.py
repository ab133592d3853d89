"""Durable metadata of uploaded files and batches: one SQLite database (WAL mode) under the storage folder.

Every state change is one transaction, so after a crash the database holds either the old or the new state,
never a mix. File bodies live next to the database; a result file's committed length is its `bytes` column,
so bytes appended after the last commit (a crash between the write and the commit) are cut off on restart.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

# Ids are generated here and matched against this pattern before any lookup, so no id from a request can
# name a path outside the storage folder.
FILE_ID_RE = re.compile(r"^backend_(input|result|error)_file-[0-9a-f]{32}$")
BATCH_ID_RE = re.compile(r"^batch_[0-9a-f]{32}$")

ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL_STATUSES = ("completed", "failed", "expired", "cancelled")

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    output_file_id TEXT,
    error_file_id TEXT,
    errors TEXT,
    created_at INTEGER NOT NULL,
    in_progress_at INTEGER,
    expires_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    metadata TEXT
);
-- One row per input line that was submitted at least once: how often it was submitted, and where its
-- result went once it was durably written ('output' or 'error'); NULL while unfinished.
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL,
    line_index INTEGER NOT NULL,
    custom_id TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    outcome TEXT,
    PRIMARY KEY (batch_id, line_index)
);
"""

BATCH_FIELDS = (
    "id", "endpoint", "input_file_id", "completion_window", "status", "output_file_id", "error_file_id",
    "errors", "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
    "expired_at", "cancelling_at", "cancelled_at", "total", "completed", "failed", "metadata",
)


def new_file_id(kind: str) -> str:
    return f"backend_{kind}_file-{uuid.uuid4().hex}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


class Store:
    """Thread-safe: routes read on the event loop, writes run in worker threads; one lock serializes them."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.tmp_dir = os.path.join(self.root, "tmp")
        self.db_path = os.path.join(self.root, "metadata.db")
        self.lock = threading.RLock()
        self._db: Optional[sqlite3.Connection] = None

    def exists(self) -> bool:
        return self._db is not None or os.path.exists(self.db_path)

    def open(self) -> None:
        """Create the storage folder and the database now (the first upload does)."""
        _ = self.db

    @property
    def db(self) -> sqlite3.Connection:
        """Opened on first use, so a server that never sees a file or batch leaves no folder behind."""
        with self.lock:
            if self._db is None:
                os.makedirs(self.tmp_dir, exist_ok=True)
                db = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None)
                db.row_factory = sqlite3.Row
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=FULL")  # a commit is on disk before the API reports it
                db.executescript(SCHEMA)
                self._db = db
            return self._db

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def path_of(self, file_id: str) -> str:
        if not FILE_ID_RE.match(file_id):
            raise ValueError(f"invalid file id {file_id!r}")
        return os.path.join(self.root, file_id + ".jsonl")

    # ---- files ----------------------------------------------------------------------------------------
    def add_file(self, file_id: str, filename: str, purpose: str, size: int) -> dict:
        row = {"id": file_id, "filename": filename, "purpose": purpose, "bytes": size, "created_at": int(time.time())}
        with self.tx() as c:
            c.execute("INSERT INTO files (id, filename, purpose, bytes, created_at) VALUES (?, ?, ?, ?, ?)",
                      (file_id, filename, purpose, size, row["created_at"]))
        return row

    def get_file(self, file_id: str) -> Optional[dict]:
        if not self.exists():  # reads never create the storage folder
            return None
        with self.lock:
            row = self.db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        return _file_dict(row) if row else None

    def list_files(self, purpose: Optional[str], limit: int, after: Optional[str], newest_first: bool) -> list[dict]:
        if not self.exists():  # reads never create the storage folder
            return []
        sql = "SELECT * FROM files WHERE 1=1"
        params: list[object] = []
        if purpose:
            sql += " AND purpose = ?"
            params.append(purpose)
        if after:
            sql += f" AND seq {'<' if newest_first else '>'} (SELECT seq FROM files WHERE id = ?)"
            params.append(after)
        sql += f" ORDER BY seq {'DESC' if newest_first else 'ASC'} LIMIT ?"
        params.append(limit)
        with self.lock:
            return [_file_dict(r) for r in self.db.execute(sql, params).fetchall()]

    def batch_using_file(self, file_id: str) -> Optional[str]:
        """The id of an unfinished batch that reads or writes this file, if any."""
        marks = ",".join("?" * len(ACTIVE_STATUSES))
        with self.lock:
            row = self.db.execute(
                f"SELECT id FROM batches WHERE status IN ({marks}) AND (input_file_id = ? OR output_file_id = ? "
                "OR error_file_id = ?) LIMIT 1", (*ACTIVE_STATUSES, file_id, file_id, file_id),
            ).fetchone()
        return row["id"] if row else None

    def delete_file(self, file_id: str) -> Optional[str]:
        """Remove the row, then the body. Returns None when deleted, else the id of the batch using it."""
        with self.tx() as c:
            busy = self.batch_using_file(file_id)
            if busy is not None:
                return busy
            c.execute("DELETE FROM files WHERE id = ?", (file_id,))
        try:
            os.unlink(self.path_of(file_id))
        except FileNotFoundError:
            pass
        return None

    def remove_orphans(self) -> None:
        """Bodies without a row (a crash between writing and registering an upload) and partial uploads."""
        with self.lock:
            known = {r["id"] for r in self.db.execute("SELECT id FROM files").fetchall()}
        for name in os.listdir(self.tmp_dir):
            os.unlink(os.path.join(self.tmp_dir, name))
        for name in os.listdir(self.root):
            stem = name[:-len(".jsonl")] if name.endswith(".jsonl") else None
            if stem and FILE_ID_RE.match(stem) and stem not in known and stem.startswith("backend_input"):
                os.unlink(os.path.join(self.root, name))

    # ---- batches --------------------------------------------------------------------------------------
    def add_batch(self, endpoint: str, input_file_id: str, window: str, window_s: int,
                  metadata: Optional[dict]) -> dict:
        bid, created = new_batch_id(), int(time.time())
        with self.tx() as c:
            c.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, expires_at,"
                " metadata) VALUES (?, ?, ?, ?, 'validating', ?, ?, ?)",
                (bid, endpoint, input_file_id, window, created, created + window_s,
                 json.dumps(metadata) if metadata is not None else None),
            )
        return self.get_batch(bid)

    def get_batch(self, batch_id: str) -> Optional[dict]:
        if not self.exists():  # reads never create the storage folder
            return None
        with self.lock:
            row = self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return dict(row) if row else None

    def list_batches(self, limit: int, after: Optional[str]) -> list[dict]:
        if not self.exists():  # reads never create the storage folder
            return []
        sql = "SELECT * FROM batches"
        params: list[object] = []
        if after:
            sql += " WHERE seq < (SELECT seq FROM batches WHERE id = ?)"
            params.append(after)
        sql += " ORDER BY seq DESC LIMIT ?"
        params.append(limit)
        with self.lock:
            return [dict(r) for r in self.db.execute(sql, params).fetchall()]

    def unfinished_batches(self) -> list[dict]:
        marks = ",".join("?" * len(ACTIVE_STATUSES))
        with self.lock:
            rows = self.db.execute(f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY seq", ACTIVE_STATUSES)
            return [dict(r) for r in rows.fetchall()]

    def transition(self, batch_id: str, to: str, allowed_from: tuple[str, ...], **fields: Any) -> bool:
        """Move a batch to `to` (stamping `<to>_at`) only if its status is in `allowed_from`: a terminal
        status such as `cancelled` can then never be overwritten by a late writer."""
        stamp = {f"{to}_at": int(time.time())} if f"{to}_at" in BATCH_FIELDS else {}
        values = {"status": to, **stamp, **fields}
        sets = ", ".join(f"{k} = ?" for k in values)
        marks = ",".join("?" * len(allowed_from))
        with self.tx() as c:
            cur = c.execute(f"UPDATE batches SET {sets} WHERE id = ? AND status IN ({marks})",
                            (*values.values(), batch_id, *allowed_from))
            return cur.rowcount == 1

    def start_batch(self, batch_id: str, total: int, input_name: str) -> bool:
        """validating -> in_progress, registering the (empty) output and error files in the same step."""
        out_id, err_id = new_file_id("result"), new_file_id("error")
        now = int(time.time())
        with self.tx() as c:
            cur = c.execute(
                "UPDATE batches SET status = 'in_progress', in_progress_at = ?, total = ?, output_file_id = ?,"
                " error_file_id = ? WHERE id = ? AND status = 'validating'", (now, total, out_id, err_id, batch_id))
            if cur.rowcount != 1:
                return False
            for fid, purpose in ((out_id, "batch_output"), (err_id, "batch_output")):
                c.execute("INSERT INTO files (id, filename, purpose, bytes, created_at) VALUES (?, ?, ?, 0, ?)",
                          (fid, f"{fid}.jsonl", purpose, now))
        return True

    def note_attempt(self, batch_id: str, line_index: int, custom_id: str) -> None:
        with self.tx() as c:
            c.execute(
                "INSERT INTO batch_lines (batch_id, line_index, custom_id, attempts) VALUES (?, ?, ?, 1) "
                "ON CONFLICT (batch_id, line_index) DO UPDATE SET attempts = attempts + 1",
                (batch_id, line_index, custom_id))

    def finished_lines(self, batch_id: str) -> set[int]:
        with self.lock:
            rows = self.db.execute("SELECT line_index FROM batch_lines WHERE batch_id = ? AND outcome IS NOT NULL",
                                   (batch_id,)).fetchall()
        return {r["line_index"] for r in rows}

    def record_results(self, batch_id: str, results: list[tuple[int, Optional[str], str]],
                       sizes: dict[str, int]) -> None:
        """Mark lines finished (outcome 'output' or 'error'), bump the counts and commit the result files'
        new lengths, all in one transaction, after the lines were appended and fsynced."""
        ok = sum(1 for _, _, outcome in results if outcome == "output")
        with self.tx() as c:
            for index, custom_id, outcome in results:
                c.execute(
                    "INSERT INTO batch_lines (batch_id, line_index, custom_id, attempts, outcome)"
                    " VALUES (?, ?, ?, 0, ?)"
                    " ON CONFLICT (batch_id, line_index) DO UPDATE SET outcome = excluded.outcome",
                    (batch_id, index, custom_id, outcome))
            c.execute("UPDATE batches SET completed = completed + ?, failed = failed + ? WHERE id = ?",
                      (ok, len(results) - ok, batch_id))
            for fid, size in sizes.items():
                c.execute("UPDATE files SET bytes = ? WHERE id = ?", (size, fid))

    def drop_empty_error_file(self, batch_id: str) -> None:
        """A batch without failures reports no error file (as OpenAI does)."""
        batch = self.get_batch(batch_id)
        fid = batch and batch["error_file_id"]
        if not fid or batch["failed"] > 0:
            return
        with self.tx() as c:
            c.execute("UPDATE batches SET error_file_id = NULL WHERE id = ?", (batch_id,))
            c.execute("DELETE FROM files WHERE id = ?", (fid,))
        try:
            os.unlink(self.path_of(fid))
        except FileNotFoundError:
            pass


def _file_dict(row: sqlite3.Row) -> dict:
    return {k: row[k] for k in ("id", "filename", "purpose", "bytes", "created_at")}
