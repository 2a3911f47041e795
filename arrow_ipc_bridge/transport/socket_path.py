"""The server's socket file: created with the right mode, a stale one replaced, a live one refused.

Binding runs under a lock on the directory, so that two servers starting at once on one stale path
cannot both find it stale (the second would unlink the first one's fresh socket). Closing removes
the file only while it is still the inode this server created.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import stat
import time
from types import TracebackType

from arrow_ipc_bridge.errors import TransportError

__all__ = ["SOCKET_MODE_OWNER", "SOCKET_MODE_SHARED", "bind_listening", "unlink_if_ours"]

logger = logging.getLogger(__name__)

# The socket file's mode: the owner only, unless other uids are allowed. connect() on a Unix socket
# needs write permission on the file, so a listed uid could not connect through 0600; with other
# uids allowed the file is 0666 and SO_PEERCRED (checked on every accepted connection) is the gate.
SOCKET_MODE_OWNER = 0o600
SOCKET_MODE_SHARED = 0o666


def bind_listening(path: str, mode: int, backlog: int, name: str) -> tuple[socket.socket, tuple[int, int]]:
    """A non-blocking socket listening at ``path`` (file mode ``mode``) and the file's
    ``(st_dev, st_ino)``; a stale socket file there is replaced (logged under ``name``).

    Raises :class:`~arrow_ipc_bridge.errors.TransportError` when a live server holds the path,
    something that is not a socket is there, or binding fails.
    """
    with _DirectoryLock(os.path.dirname(os.path.abspath(path))):
        _clear_stale_path(path, name)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Why not umask: it is per process, so changing it around bind() races with files other
            # threads create. On Linux bind() gives the new file the mode of the socket's own inode
            # (masked by the umask), so fchmod() before bind() creates the file as 0600 from the start.
            # Elsewhere fchmod() may fail or not carry over; the chmod() after bind() covers that (and
            # widens the mode past the umask when other uids are allowed), and it happens before
            # listen(), so no client can connect while the mode is still wider.
            with contextlib.suppress(OSError):
                os.fchmod(sock.fileno(), SOCKET_MODE_OWNER)
            try:
                sock.bind(path)
            except OSError as exc:
                raise TransportError(f"cannot bind a server socket at {path!r}: {exc}", path=path) from exc
            try:
                os.chmod(path, mode)
                st = os.lstat(path)
                sock.listen(backlog)
            except OSError as exc:
                _unlink_quietly(path)
                raise TransportError(f"cannot listen on {path!r}: {exc}", path=path) from exc
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
    return sock, (st.st_dev, st.st_ino)


def _clear_stale_path(path: str, name: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise TransportError(f"cannot inspect {path!r}: {exc}", path=path) from exc
    if not stat.S_ISSOCK(st.st_mode):
        raise TransportError(
            f"{path!r} exists and is not a socket; refusing to replace it", path=path, mode=st.st_mode
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        # Nobody accepts on it: the server that made it is gone. (A live server accepting on it would
        # have taken the probe or, with a full backlog, answered EAGAIN.)
        logger.info("%s: replacing stale socket file %r", name, path)
        _unlink_quietly(path)
        return
    except FileNotFoundError:
        return
    except BlockingIOError as exc:
        raise TransportError(
            f"a server is already listening on {path!r} (its backlog is full)", path=path
        ) from exc
    except OSError as exc:
        raise TransportError(f"cannot probe existing socket {path!r}: {exc}", path=path) from exc
    finally:
        probe.close()
    raise TransportError(f"a server is already listening on {path!r}; refusing to take it over", path=path)


def unlink_if_ours(path: str, ident: tuple[int, int]) -> None:
    """Remove the socket file at ``path`` if it is still the inode ``ident`` (``(st_dev, st_ino)``):
    it may have been replaced, e.g. by a newer server after ours was presumed dead."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if (st.st_dev, st.st_ino) == ident:
        _unlink_quietly(path)


class _DirectoryLock:
    """``flock`` on a directory, around the check-unlink-bind of a socket path.

    Without it two servers starting at once on one stale path could both find it stale; the second would
    then unlink the first one's fresh socket and bind its own, leaving the first listening on nothing. The
    lock is advisory and best effort: where the directory cannot be opened or locked, binding goes ahead
    unlocked.
    """

    def __init__(self, directory: str, timeout: float = 5.0) -> None:
        self._directory = directory
        self._timeout = timeout
        self._fd = -1

    def __enter__(self) -> None:
        try:
            fd = os.open(self._directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fd = fd
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.005)
            except OSError:
                break
        os.close(fd)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = -1


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
