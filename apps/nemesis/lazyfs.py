"""A FUSE filesystem that loses what was not fsynced, on command (the nemesis' power cut).

Modelled on LazyFS (the Jepsen team's tool): a passthrough over a backing folder whose writes stay
in an in-memory page cache until the file is fsynced; ``drop`` forgets every unsynced byte, as a
power cut would. Metadata (create, rename, unlink, mkdir) goes to the backing folder at once: a file
created and never fsynced survives the cut with the size its synced data gives it.

Run it in the foreground, one per NATS store::

    python -m apps.nemesis.lazyfs BACKING MOUNTPOINT CONTROL_SOCKET

and talk to it over the control socket (one line each): ``drop`` (answers how much was lost),
``stats``. ``fusermount3 -u MOUNTPOINT`` ends it. Needs ``mfusepy`` and libfuse (Debian's fuse3).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

BLOCK = 4096


class _Unsynced:
    """A file's writes since its last fsync: whole blocks, and its size as written."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.blocks: dict[int, bytearray] = {}
        self.zero_from: int | None = None  # truncated here: the backing bytes past it read as zeros

    def nbytes(self) -> int:
        return len(self.blocks) * BLOCK


class LazyFS:
    """The operations (``mfusepy.Operations``): paths are relative to the backing folder."""

    def __init__(self, backing: str) -> None:
        self.backing = os.path.realpath(backing)
        self._mutex = threading.RLock()
        self.unsynced: dict[str, _Unsynced] = {}
        self.dropped_bytes = 0
        self.synced_files = 0
        self.sync_fds: set[int] = set()  # opened with O_SYNC or O_DSYNC: every write is durable on return
        self.opened: dict[str, int] = {}  # flags seen at open (what the store asks for), for ``stats``

    # -- helpers ------------------------------------------------------------------------------------

    def _real(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _dirty(self, path: str, fd: int | None = None) -> _Unsynced:
        entry = self.unsynced.get(path)
        if entry is None:
            size = os.fstat(fd).st_size if fd is not None else os.lstat(self._real(path)).st_size
            entry = self.unsynced[path] = _Unsynced(size)
        return entry

    def _backing_block(self, path: str, entry: _Unsynced | None, index: int, fd: int | None) -> bytearray:
        start = index * BLOCK
        if entry is not None and entry.zero_from is not None and start >= entry.zero_from:
            return bytearray(BLOCK)
        if fd is None:
            with open(self._real(path), "rb") as f:
                f.seek(start)
                data = f.read(BLOCK)
        else:
            data = os.pread(fd, BLOCK, start)
        block = bytearray(data.ljust(BLOCK, b"\0"))
        if entry is not None and entry.zero_from is not None and entry.zero_from < start + BLOCK:
            cut = entry.zero_from - start
            block[cut:] = bytes(BLOCK - cut)
        return block

    def _flush(self, path: str, fd: int | None) -> None:
        """Write the unsynced blocks of ``path`` to its backing file and fsync it."""
        entry = self.unsynced.pop(path, None)
        own = fd is None
        if own:
            fd = os.open(self._real(path), os.O_WRONLY)
        try:
            if entry is not None:
                if entry.zero_from is not None:
                    os.ftruncate(fd, min(entry.zero_from, entry.size))
                os.ftruncate(fd, entry.size)
                for index, block in sorted(entry.blocks.items()):
                    start = index * BLOCK
                    if start >= entry.size:
                        continue
                    os.pwrite(fd, bytes(block[: entry.size - start]), start)
                self.synced_files += 1
            os.fsync(fd)
        finally:
            if own:
                os.close(fd)

    # -- control --------------------------------------------------------------------------------------

    def drop(self) -> tuple[int, int]:
        """The power cut: forget every unsynced write. (bytes, files) lost."""
        with self._mutex:
            lost = sum(e.nbytes() for e in self.unsynced.values()), len(self.unsynced)
            self.unsynced.clear()
            self.dropped_bytes += lost[0]
            return lost

    def stats(self) -> dict[str, int]:
        with self._mutex:
            return {
                "unsynced_files": len(self.unsynced),
                "unsynced_bytes": sum(e.nbytes() for e in self.unsynced.values()),
                "dropped_bytes": self.dropped_bytes,
                "synced_files": self.synced_files,
                **{f"opened_{k}": v for k, v in self.opened.items()},
            }

    # -- filesystem operations --------------------------------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        with self._mutex:
            st = os.lstat(self._real(path))  # an OSError is answered with its errno by mfusepy
            attrs = {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size")}
            attrs |= {"st_atime": st.st_atime, "st_mtime": st.st_mtime, "st_ctime": st.st_ctime}
            entry = self.unsynced.get(path)
            if entry is not None:
                attrs["st_size"] = entry.size
            return attrs

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._real(path))]

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._real(path), amode):
            raise OSError(errno.EACCES, "access denied")
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        st = os.statvfs(self._real(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag", "f_frsize")
        return {k: getattr(st, k) for k in keys} | {"f_namemax": st.f_namemax}

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._real(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._real(path))
        return 0

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._real(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        os.chown(self._real(path), uid, gid)
        return 0

    def utimens(self, path: str, times: Any = None) -> int:
        os.utime(self._real(path), times)
        return 0

    def unlink(self, path: str) -> int:
        with self._mutex:
            os.unlink(self._real(path))
            self.unsynced.pop(path, None)
        return 0

    def rename(self, old: str, new: str) -> int:
        with self._mutex:
            os.rename(self._real(old), self._real(new))
            self.unsynced.pop(new, None)
            prefix = old.rstrip("/") + "/"
            for key in [k for k in self.unsynced if k == old or k.startswith(prefix)]:
                self.unsynced[new + key[len(old) :]] = self.unsynced.pop(key)
        return 0

    def open(self, path: str, flags: int) -> int:
        with self._mutex:
            fd = os.open(self._real(path), flags & ~(os.O_TRUNC | os.O_APPEND))
            self._note_flags(fd, flags)
            if flags & os.O_TRUNC:
                self._truncate(path, 0, fd)
            return fd

    def _note_flags(self, fd: int, flags: int) -> None:
        synchronous = bool(flags & (os.O_SYNC | os.O_DSYNC))
        if synchronous:
            self.sync_fds.add(fd)
        key = "sync" if synchronous else "plain"
        self.opened[key] = self.opened.get(key, 0) + 1

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        with self._mutex:
            fd = os.open(self._real(path), os.O_RDWR | os.O_CREAT, mode)
            flags = fi if isinstance(fi, int) else getattr(fi, "flags", 0)  # mfusepy passes the open flags
            self._note_flags(fd, flags)
            if path in self.unsynced:  # created over a file that was unlinked meanwhile
                self.unsynced.pop(path)
            self._truncate(path, 0, fd)
            return fd

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        with self._mutex:
            entry = self.unsynced.get(path)
            end = min(offset + size, entry.size if entry is not None else os.fstat(fh).st_size)
            if entry is None or end <= offset:
                return os.pread(fh, max(0, end - offset), offset) if end > offset else b""
            out = bytearray()
            position = offset
            while position < end:
                index, within = divmod(position, BLOCK)
                block = entry.blocks.get(index)
                if block is None:
                    block = self._backing_block(path, entry, index, fh)
                take = min(BLOCK - within, end - position)
                out += block[within : within + take]
                position += take
            return bytes(out)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        with self._mutex:
            entry = self._dirty(path, fh)
            position, view = offset, memoryview(data)
            while view:
                index, within = divmod(position, BLOCK)
                block = entry.blocks.get(index)
                if block is None:
                    block = entry.blocks[index] = self._backing_block(path, entry, index, fh)
                take = min(BLOCK - within, len(view))
                block[within : within + take] = view[:take]
                view = view[take:]
                position += take
            entry.size = max(entry.size, offset + len(data))
            if fh in self.sync_fds:
                self._flush(path, fh)
            return len(data)

    def _truncate(self, path: str, length: int, fd: int | None) -> None:
        entry = self._dirty(path, fd)
        entry.blocks = {i: b for i, b in entry.blocks.items() if i * BLOCK < length}
        last = entry.blocks.get(length // BLOCK)
        if last is not None and length % BLOCK:
            cut = length % BLOCK
            last[cut:] = bytes(BLOCK - cut)
        entry.zero_from = length if entry.zero_from is None else min(entry.zero_from, length)
        entry.size = length

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        with self._mutex:
            self._truncate(path, length, fh)
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0  # close() is not fsync: what was written stays unsynced

    def release(self, path: str, fh: int) -> int:
        with self._mutex:
            self.sync_fds.discard(fh)
        with contextlib.suppress(OSError):
            os.close(fh)
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        with self._mutex:
            self._flush(path, fh)
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        fd = os.open(self._real(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return 0

    def opendir(self, path: str) -> int:
        return 0

    def releasedir(self, path: str, fh: int) -> int:
        return 0


def serve_control(fs: LazyFS, path: str) -> None:
    """Answer ``drop`` and ``stats`` on a Unix socket (a thread of its own)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)

    def loop() -> None:
        while True:
            conn, _ = server.accept()
            with conn:
                command = conn.recv(64).decode().strip()
                if command == "drop":
                    lost, files = fs.drop()
                    conn.sendall(f"dropped {lost} {files}\n".encode())
                elif command == "stats":
                    conn.sendall((" ".join(f"{k}={v}" for k, v in fs.stats().items()) + "\n").encode())
                else:
                    conn.sendall(f"unknown command {command!r}\n".encode())

    threading.Thread(target=loop, daemon=True, name="lazyfs-control").start()


def control(path: str | os.PathLike[str], command: str, timeout: float = 10.0) -> str:
    """Send one command to a running lazyfs and return its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(command.encode() + b"\n")
        return s.recv(256).decode().strip()


def main(argv: list[str] | None = None) -> None:
    from mfusepy import FUSE

    backing, mountpoint, control_path = (argv or sys.argv[1:])[:3]
    Path(backing).mkdir(parents=True, exist_ok=True)
    Path(mountpoint).mkdir(parents=True, exist_ok=True)
    fs = LazyFS(backing)
    serve_control(fs, control_path)
    # direct_io and no attribute cache: after a drop every read and size comes from here again.
    FUSE(fs, mountpoint, foreground=True, direct_io=True, attr_timeout=0, entry_timeout=0)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
