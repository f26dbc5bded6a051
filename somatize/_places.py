"""Where a store's files live: a directory on this machine, or any fsspec filesystem.

A place reads and writes whole files by path (`read`, `write`), creates one only if it does
not exist yet (`create`: of many creators racing, exactly one gets True), lists a folder
(`files`) and removes what killed writers left behind (`clean`). `Store` builds the paths;
nothing here knows what a blob or a binding is.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

_TMP = ".tmp-"
_CLAIMED = ".claimed"
# Without hard links a claim is decided by an exclusive marker file. A marker whose claimer
# is seen dead on this machine, or that is older than this many seconds with no binding beside
# it, was abandoned mid-claim (the claim itself takes microseconds): the next claimer goes on
# to the marker after it.
ABANDONED_AFTER = 60.0
# How often, and for how long, a claim on an object store asks again after a 409 (another
# conditional write to the same name in flight) or a 503 (slow down), before it gives up.
_TRIES, _FIRST_WAIT, _LONGEST_WAIT = 10, 0.05, 2.0


def _this_machine() -> str:
    """8 hex digits naming this machine's boot and pid namespace, where a pid means something."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as file:
            parts.append(file.read().strip())
    with contextlib.suppress(OSError, AttributeError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:8]


MACHINE = _this_machine()


def tmp_name(path: str) -> str:
    """The temp file a write of `path` goes through: beside it, named by who writes it."""
    head, _, tail = path.rpartition("/")
    tmp = f"{_TMP}{tail}-{MACHINE}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    return f"{head}/{tmp}" if head else tmp


def _gone(machine: str, pid: str, age: float, older_than: float) -> bool:
    """Whether a writer is gone. On this machine its pid says (a live writer's file is never
    touched, however old); a writer elsewhere is gone once silent past `older_than` s."""
    if not (machine == MACHINE and pid.isascii() and pid.isdigit()):
        return age > older_than
    try:  # signal 0 only asks whether the process is there (this one is)
        os.kill(int(pid), 0)
    except (ProcessLookupError, OverflowError):  # no process has a pid past a C long
        return True
    except OSError:  # someone else's process: alive
        pass
    return False


def _tmp_abandoned(name: str, age: float, older_than: float) -> bool:
    """Whether the writer of the temp file `name` (a basename, from `tmp_name`) is gone."""
    parts = name.split("-")
    if len(parts) < 4:
        return age > older_than
    return _gone(parts[-3], parts[-2], age, older_than)


class Local:
    """A directory on this machine: a temp file beside, then `os.replace`; claims by link."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)

    def where(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/"))

    def read(self, path: str) -> bytes | None:
        try:
            with open(self.where(path), "rb") as file:
                return file.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    @contextlib.contextmanager
    def _aside(self, path: str, data: bytes) -> Iterator[str]:
        """`data` in a temp file beside `path`, removed on the way out unless moved into place."""
        aside = self.where(tmp_name(path))
        try:
            file = open(aside, "wb")
        except FileNotFoundError:
            os.makedirs(os.path.dirname(aside), exist_ok=True)
            file = open(aside, "wb")
        try:
            with file:
                file.write(data)
            yield aside
        finally:
            with contextlib.suppress(OSError):
                os.unlink(aside)

    def write(self, path: str, data: bytes) -> None:
        with self._aside(path, data) as aside:
            os.replace(aside, self.where(path))

    def create(self, path: str, data: bytes) -> bool:
        final = self.where(path)
        if os.path.lexists(final):
            return False
        with self._aside(path, data) as aside:
            try:
                os.link(aside, final)  # atomic, and fails if the name exists: exactly one winner
                return True
            except FileExistsError:
                return False
            except OSError as error:
                if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                return self._create_by_marker(final, aside)

    @staticmethod
    def _create_by_marker(final: str, aside: str) -> bool:
        # An O_EXCL marker decides who wins, then the winner moves its complete file into
        # place (see ABANDONED_AFTER); markers stay while no binding stands beside them.
        generation = 0
        while True:
            marker = f"{final}{_CLAIMED}-{generation}"
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if os.path.lexists(final) or not _marker_abandoned(marker):
                    return False
                generation += 1
                continue
            try:
                with os.fdopen(fd, "w") as file:
                    file.write(f"{MACHINE} {os.getpid()}")
                if os.path.lexists(final) or os.path.lexists(f"{final}{_CLAIMED}-{generation + 1}"):
                    return False
                os.replace(aside, final)
                return True
            except BaseException:  # this process lives on: its marker must not stand in the way
                with contextlib.suppress(OSError):
                    os.unlink(marker)
                raise

    def touch(self, path: str) -> None:
        """Make `path` as new as if written now (a blob put again, about to be named)."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.where(path))

    def drop(self, path: str) -> None:
        """Remove `path`, if there."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.where(path))

    def aged(self, folder: str, older_than: float) -> list[str]:
        """The files under `folder`, but temp files, that nobody wrote for `older_than` s."""
        now, found = time.time(), []
        for path in self.files(folder):
            with contextlib.suppress(FileNotFoundError):
                old = now - os.stat(self.where(path)).st_mtime > older_than
                if old and not path.rpartition("/")[2].startswith("."):
                    found.append(path)
        return found

    def remove(self, paths: list[str], older_than: float) -> dict[str, int]:
        """Remove each of `paths` still unwritten for `older_than` s, looked at again now."""
        removed = {"files": 0, "bytes": 0}
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                info = os.stat(self.where(path))
                if time.time() - info.st_mtime > older_than:
                    os.unlink(self.where(path))
                    removed["files"] += 1
                    removed["bytes"] += info.st_size
        return removed

    def files(self, folder: str) -> Iterator[str]:
        for dirpath, _dirs, names in os.walk(self.where(folder)):
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            for name in names:
                yield f"{rel}/{name}"

    def clean(self, older_than: float) -> dict[str, int]:
        removed = {"files": 0, "bytes": 0}
        now = time.time()
        for dirpath, _dirs, names in os.walk(self.root):
            bound = ".bind" in names
            for name in names:
                aside = name.startswith(_TMP)
                if not aside and not (bound and name.startswith(".bind" + _CLAIMED)):
                    continue  # a marker may go only once the claim it decided stands
                full = os.path.join(dirpath, name)
                try:
                    info = os.stat(full)
                    if aside and not _tmp_abandoned(name, now - info.st_mtime, older_than):
                        continue
                    os.unlink(full)
                except FileNotFoundError:
                    continue
                removed["files"] += 1
                removed["bytes"] += info.st_size
        return removed


def _marker_abandoned(marker: str) -> bool:
    try:
        with open(marker) as file:
            who = file.read().split()
        age = time.time() - os.stat(marker).st_mtime
    except FileNotFoundError:
        return False
    machine, pid = (who + ["", ""])[:2]
    return _gone(machine, pid, age, ABANDONED_AFTER)


def _http_status(error: BaseException) -> int | None:
    """The HTTP status of the answer behind `error` (botocore's, as s3fs chains it), if any."""
    seen: BaseException | None = error
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return status if isinstance(status, int) else None
        seen = seen.__cause__ or seen.__context__
    return None


class Remote:
    """Any fsspec filesystem. Object stores (and memory) put a whole object or nothing, so
    files are written there in one put; other filesystems write aside, then move. `create`
    writes in exclusive mode where the filesystem has one (on S3 a conditional put,
    `If-None-Match: *`, which the server decides: a 412 loses, a 409 asks again), else looks,
    then writes (best effort: two processes racing on such a filesystem may both win). Within
    a process claims and reads are serialised by a lock, so threads on `memory://` claim
    exactly once."""

    _whole = {"s3", "s3a", "gs", "gcs", "abfs", "az", "adl", "memory"}
    _locks: dict[str, threading.RLock] = {}
    _locks_lock = threading.Lock()

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.whole = bool(set(protocols) & self._whole)
        with self._locks_lock:
            self.lock = self._locks.setdefault(f"{protocols[0]}://{self.root}", threading.RLock())
        with contextlib.suppress(OSError):  # a bucket may exist without our being allowed to ask
            self.fs.makedirs(self.root, exist_ok=True)

    def where(self, path: str) -> str:
        return f"{self.root}/{path}"

    def read(self, path: str) -> bytes | None:
        with self.lock:
            try:
                return self.fs.cat_file(self.where(path))
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                return None

    def write(self, path: str, data: bytes) -> None:
        final = self.where(path)
        with self.lock:
            if self.whole:  # object stores have no folders to make
                self.fs.pipe_file(final, data)
                return
            self.fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
            aside = self.where(tmp_name(path))
            self.fs.pipe_file(aside, data)
            try:
                self.fs.mv(aside, final)
            except BaseException:
                with contextlib.suppress(Exception):
                    self.fs.rm_file(aside)
                raise

    def create(self, path: str, data: bytes) -> bool:
        final = self.where(path)
        with self.lock:
            if not self.whole:
                self.fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
            for attempt in range(_TRIES):
                self.fs.invalidate_cache(final)  # another process may have claimed it since
                if self.fs.exists(final):
                    return False
                try:
                    with self.fs.open(final, "xb") as file:
                        file.write(data)
                    return True
                except FileExistsError:
                    return False
                except (ValueError, NotImplementedError):
                    break  # this filesystem has no exclusive create: look, then write
                except OSError as error:
                    status = _http_status(error)
                    if status == 412:  # the precondition failed: somebody's write is there
                        return False
                    if status not in (409, 503):
                        raise
                    if attempt == _TRIES - 1:
                        raise OSError(
                            errno.EBUSY,
                            f"claiming {final}: the store still answered {status} (another "
                            f"write of this name in flight) after {_TRIES} tries; claim again",
                        ) from error
                # another conditional write of this name is in flight: wait longer each time
                time.sleep(min(_FIRST_WAIT * 2**attempt, _LONGEST_WAIT))
            self.write(path, data)
            return True

    def touch(self, path: str) -> None:
        """Nothing: no file here is removed by its age but temp files (S3 has no touch)."""

    def drop(self, path: str) -> None:
        """Remove `path`, if there."""
        with self.lock, contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.where(path))

    def files(self, folder: str) -> Iterator[str]:
        with self.lock:
            self.fs.invalidate_cache(self.where(folder))  # others may have bound names since
            try:
                found = self.fs.find(self.where(folder))
            except FileNotFoundError:
                return
        prefix = self.fs._strip_protocol(self.root).rstrip("/") + "/"
        for full in found:
            full = self.fs._strip_protocol(full)
            if full.startswith(prefix):
                yield full[len(prefix) :]

    def clean(self, older_than: float) -> dict[str, int]:
        removed = {"files": 0, "bytes": 0}
        if self.whole:  # nothing is written aside on an object store
            return removed
        now = time.time()
        for path in list(self.files("")):
            name = path.rsplit("/", 1)[-1]
            if not name.startswith(_TMP):
                continue
            full = self.where(path)
            try:
                info = self.fs.info(full)
                modified = self.fs.modified(full).timestamp()
            except (FileNotFoundError, NotImplementedError, AttributeError):
                continue
            if _tmp_abandoned(name, now - modified, older_than):
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(full)
                    removed["files"] += 1
                    removed["bytes"] += int(info.get("size") or 0)
        return removed
