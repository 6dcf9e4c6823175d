r"""An embedded SQLite journal: every evaluation is committed before the next suggestion."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from aml_ppl.errors import InputDataError

try:  # POSIX advisory locks, released by the kernel when the holder dies (SIGKILL included)
    import fcntl
except ImportError:  # Windows: no writer lock
    fcntl = None


@dataclass(frozen=True)
class EvaluationRecord:
    r"""One evaluation of a loop.

    Attributes:
        step: 0, 1, ... in the order of evaluation (seed points first).
        x: The point, as a list.
        values: The observed objective and constraint values, or ``None`` when it failed.
        status: ``"seed"``, ``"ok"``, ``"failed"``, or ``"interrupted"`` (dispatched to an
            executor but not finished when the loop's process ended: no data, and the
            point may be proposed again).
        message: Why it failed or was interrupted, else ``""``.
        safe_set_size: :math:`|S_n|` when the point was chosen (0 for seeds).
        area_size: :math:`|A_n|` likewise.
        certificate: :math:`\max_{\hat S_n} u_f - \max_{S_n} l_f` likewise (NaN for seeds).
        seconds: Time spent choosing the point.
    """

    step: int
    x: list[float]
    values: list[float] | None
    status: str
    message: str = ""
    safe_set_size: int = 0
    area_size: int = 0
    certificate: float = float("nan")
    seconds: float = 0.0


class Journal:
    r"""Append-only record of a loop's evaluations in one SQLite file.

    Each :meth:`append` is its own committed transaction (SQLite's journal makes it
    atomic), so a process killed at any moment leaves exactly the finished evaluations.
    Points dispatched to an executor are kept in a ``pending`` table until their result is
    committed (:meth:`complete` removes the one and adds the other in one transaction);
    reopening turns any left over into ``"interrupted"`` records (:meth:`interrupt_pending`).
    The loop's configuration is stored once and checked when the journal is reopened.

    One writer at a time: the journal holds an exclusive lock on ``<path>.lock`` (with the
    holder's process id) until :meth:`close`; a loop in another process is refused with an
    error naming that process. The kernel drops the lock when its holder dies, so a killed
    loop's journal resumes at once. In one process (a notebook cell run again) a new
    journal on the same file takes the lock over from the earlier one, whether that is
    closed, garbage or still open: the lock stays held throughout, and the earlier journal
    writes no more (its next write raises, naming the file), so two loops never interleave
    evaluations. Readers take no lock: :func:`read_journal`.

    Args:
        path: The database file (created if absent).
        config: JSON-compatible settings of the loop that wrote it.
        resume: Continue a journal that holds evaluations; without it such a file is
            refused, so that running the same script twice never appends to the first run.
    """

    def __init__(self, path: str | Path, *, config: dict[str, Any], resume: bool = False) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise InputDataError(f"`journal` {self.path} is a directory; give a file path.")
        if not self.path.parent.is_dir():
            raise InputDataError(f"`journal`: folder `{self.path.parent}/` does not exist; create it first.")
        self._writing = threading.Lock()  # held by each write; a takeover waits for it
        self._superseded = False
        self._taken_from: weakref.ref | None = None  # the journal of this process it took the lock from
        self._lock = self._take_lock()
        try:
            self._connection = sqlite3.connect(self.path, isolation_level=None)
            self._connection.execute("PRAGMA journal_mode=WAL")
            self._connection.execute("CREATE TABLE IF NOT EXISTS config (body TEXT NOT NULL)")
            self._connection.execute(
                "CREATE TABLE IF NOT EXISTS evaluations (step INTEGER PRIMARY KEY, body TEXT NOT NULL)"
            )
            self._connection.execute("CREATE TABLE IF NOT EXISTS pending (id INTEGER PRIMARY KEY, x TEXT NOT NULL)")
            stored = self._connection.execute("SELECT body FROM config").fetchone()
            count = self._connection.execute("SELECT COUNT(*) FROM evaluations").fetchone()[0]
        except sqlite3.DatabaseError as error:  # not a database, malformed, truncated
            self._refuse()
            raise InputDataError(
                f"`{self.path}` is not a safe-BO journal (not an SQLite database, or a damaged one: "
                f"{error}); give another file."
            ) from error
        if count and not resume:
            self._refuse()
            raise InputDataError(
                f"the journal {self.path} already holds {count} evaluations; continue it with "
                "SafeBayesianOptimization.resume(path, problem, ...) (or resume=True), or give a new file."
            )
        if stored is None:
            self._connection.execute("INSERT INTO config VALUES (?)", (json.dumps(config, sort_keys=True),))
            return
        written, wanted = json.loads(stored[0]), json.loads(json.dumps(config, sort_keys=True))
        differing = sorted(key for key in written.keys() | wanted.keys() if written.get(key) != wanted.get(key))
        if differing:
            self._refuse()
            details = "; ".join(f"{key}: journal {written.get(key)!r}, now {wanted.get(key)!r}" for key in differing)
            raise InputDataError(
                f"the journal {self.path} was written by a loop with other settings ({details}); "
                "resume with the same settings or use a new file."
            )

    def append(self, record: EvaluationRecord) -> None:
        r"""Commit one record (a duplicate step is refused: nothing is written twice)."""
        with self._transaction():
            self._insert(record)

    def _insert(self, record: EvaluationRecord) -> None:
        self._connection.execute(
            "INSERT INTO evaluations VALUES (?, ?)", (record.step, json.dumps(asdict(record)))
        )

    def add_pending(self, x: list[float]) -> int:
        r"""Record a point dispatched for evaluation; its id for :meth:`complete`."""
        with self._transaction():
            return self._connection.execute("INSERT INTO pending (x) VALUES (?)", (json.dumps(x),)).lastrowid

    def complete(self, pending_id: int, record: EvaluationRecord) -> None:
        r"""Commit a dispatched point's result and drop it from the pending points, atomically."""
        with self._transaction():
            self._connection.execute("DELETE FROM pending WHERE id = ?", (pending_id,))
            self._insert(record)

    def interrupt_pending(self, first_step: int) -> list[EvaluationRecord]:
        r"""Turn the points left pending (by a process that ended with evaluations in flight)
        into ``"interrupted"`` records from step ``first_step`` on, atomically; those records."""
        with self._transaction():
            rows = self._connection.execute("SELECT id, x FROM pending ORDER BY id").fetchall()
            records = [
                EvaluationRecord(first_step + offset, json.loads(x), None, "interrupted",
                                 "dispatched, but the loop's process ended before the result came")
                for offset, (_, x) in enumerate(rows)
            ]
            for record in records:
                self._insert(record)
            self._connection.execute("DELETE FROM pending")
        return records

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        with self._writing:
            if self._superseded:
                raise InputDataError(
                    f"the journal {self.path} was taken over by a newer loop in this process (a cell run "
                    "again?); this loop writes it no more: continue with the newer one."
                )
            self._connection.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._connection.execute("ROLLBACK")
                raise
            self._connection.execute("COMMIT")

    def _take_lock(self) -> int | None:
        r"""The open lock file, locked exclusively with this process's id in it (taken over
        from an earlier journal of this process on the same file); or raise naming the
        process that holds it."""
        if fcntl is None:
            return None
        self._lock_path = os.path.realpath(self.path.with_name(self.path.name + ".lock"))
        with _LOCKS_GUARD:
            held = _LOCKS_HELD.get(self._lock_path)
            if held is not None:  # this process holds it: take it over, the holder writing no more
                descriptor, holder = held[0], held[1]()
                if holder is not None:
                    with holder._writing:
                        holder._superseded, holder._lock = True, None
                    self._taken_from = weakref.ref(holder)
                _LOCKS_HELD[self._lock_path] = (descriptor, weakref.ref(self))
                return descriptor
            descriptor = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder_pid = os.pread(descriptor, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(descriptor)
                raise InputDataError(
                    f"the journal {self.path} is in use by another loop (process {holder_pid}); one loop writes "
                    "a journal at a time: wait for it to finish, or give this loop another file."
                ) from None
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, str(os.getpid()).encode(), 0)
            _LOCKS_HELD[self._lock_path] = (descriptor, weakref.ref(self))
            return descriptor

    def _release_lock(self) -> None:
        with _LOCKS_GUARD:
            if self._lock is not None:
                _LOCKS_HELD.pop(self._lock_path, None)
                os.ftruncate(self._lock, 0)  # no writer's id left for readers to find
                os.close(self._lock)  # closing the descriptor drops the lock
                self._lock = None

    def records(self) -> list[EvaluationRecord]:
        rows = self._connection.execute("SELECT body FROM evaluations ORDER BY step").fetchall()
        return [EvaluationRecord(**json.loads(body)) for (body,) in rows]

    def close(self) -> None:
        r"""Close the database and release the writer lock (unless taken over since)."""
        self._connection.close()
        self._release_lock()

    def _refuse(self) -> None:
        r"""Close a journal refused while opening: a lock taken over from a journal of this
        process still open goes back to it, which writes on as before; else it is released."""
        if getattr(self, "_connection", None) is not None:
            self._connection.close()
        earlier = self._taken_from() if self._taken_from is not None else None
        if earlier is None or self._lock is None:
            self._release_lock()
            return
        with _LOCKS_GUARD, earlier._writing:
            earlier._superseded, earlier._lock = False, self._lock
            _LOCKS_HELD[self._lock_path] = (self._lock, weakref.ref(earlier))
            self._lock = None


# The writer locks this process holds: lock file (real path) -> (descriptor, the Journal
# holding it, weakly: a journal dropped without `close` leaves its lock for the next to take).
_LOCKS_HELD: dict[str, tuple[int, weakref.ref]] = {}
_LOCKS_GUARD = threading.Lock()


@dataclass(frozen=True)
class JournalContents:
    r"""What a safe-BO journal holds, read without taking its writer lock (:func:`read_journal`).

    Attributes:
        records: Every committed evaluation, seeds first, in order.
        settings: The loop's settings, as stored when the journal was created.
        pending: Points dispatched to an executor whose results are not yet committed.
        writer: The process id of the loop that holds the journal open for writing (read
            from the lock file, checked to be alive), or ``None`` when none does.
    """

    records: list[EvaluationRecord]
    settings: dict[str, Any]
    pending: list[list[float]]
    writer: int | None

    @property
    def status(self) -> str:
        r"""``"open (process N)"`` while a loop writes the journal, else ``"closed"``."""
        return "closed" if self.writer is None else f"open (process {self.writer})"


def read_journal(path: str | Path) -> JournalContents:
    r"""Read a safe-BO journal, also while its loop runs (here or in another process): a
    read-only SQLite connection (``mode=ro``), one read transaction, no writer lock taken,
    so a dashboard or a notebook never blocks or refuses the loop.

    Args:
        path: The journal's database file.

    Returns:
        Its :class:`JournalContents`: records, settings, pending points and writer.

    Raises:
        InputDataError: When there is no journal at ``path`` (or not a safe-BO journal).

    Example:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "j.sqlite"
        >>> journal = Journal(path, config={"problem": "demo"})
        >>> journal.append(EvaluationRecord(0, [0.5], [1.0], "seed"))
        >>> contents = read_journal(path)
        >>> len(contents.records), contents.settings["problem"], contents.status.startswith("open")
        (1, 'demo', True)
        >>> journal.close(); read_journal(path).status
        'closed'
    """
    path = Path(path)
    if not path.is_file():
        raise InputDataError(f"no journal at {path}.")
    try:
        connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.DatabaseError as error:
        raise InputDataError(f"`{path}` cannot be opened read-only ({error}).") from error
    try:
        with connection:  # one read transaction: a consistent snapshot while the loop writes
            connection.execute("BEGIN")
            settings = connection.execute("SELECT body FROM config").fetchone()
            rows = connection.execute("SELECT body FROM evaluations ORDER BY step").fetchall()
            pending = connection.execute("SELECT x FROM pending ORDER BY id").fetchall()
    except sqlite3.DatabaseError as error:
        raise InputDataError(f"`{path}` is not a safe-BO journal ({error}).") from error
    finally:
        connection.close()
    return JournalContents(
        records=[EvaluationRecord(**json.loads(body)) for (body,) in rows],
        settings=json.loads(settings[0]) if settings else {},
        pending=[json.loads(x) for (x,) in pending],
        writer=_writer(path),
    )


def _writer(path: Path) -> int | None:
    r"""The live process whose id the journal's lock file holds (a writer clears it on
    close; one killed leaves it, hence the check), else ``None``."""
    try:
        pid = int(path.with_name(path.name + ".lock").read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        pass
    return pid


def domain_fingerprint(domain: torch.Tensor) -> str:
    r"""The candidate domain's shape and a hash of its values, for the journal's settings check."""
    values = domain.detach().to("cpu", torch.float64).contiguous().numpy().tobytes()
    return f"{tuple(domain.shape)} sha256:{hashlib.sha256(values).hexdigest()[:16]}"


def model_fingerprint(model: Any) -> str:
    r"""A GP's (:class:`~aml_ppl.models.GaussianProcess`) structure and a hash of its parameter values, for the journal's settings check."""
    values = b"".join(value.detach().to("cpu", torch.float64).contiguous().numpy().tobytes() for value in model.state_dict().values())
    return f"{type(model.gp.covar_module).__name__} sha256:{hashlib.sha256(values).hexdigest()[:16]}"
