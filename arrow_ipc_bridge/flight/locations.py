"""The bridge's local location: how a Flight front names the Unix socket of the publisher it serves.

A front lists ``aib+unix:///abs/path.sock?publisher_id=...&boot_id=...&uid=...`` next to its gRPC
location in every endpoint (plain Flight clients skip a scheme they do not know), and answers the
action ``arrow-ipc-bridge.local`` with it. A consumer takes the socket only when it is provably the
same publisher on the same host: the boot id (``/proc/sys/kernel/random/boot_id``, distinct per
host and per boot) matches its own, the socket is reachable, and the publisher it greets there
reports the advertised ``publisher_id``. A path that names another publisher (another host's
``/tmp/x.sock`` that happens to exist here too) fails the last check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import parse_qs, quote, unquote, urlsplit

__all__ = ["LOCAL_ACTION", "LOCAL_SCHEME", "LocalLocation", "boot_id"]

LOCAL_SCHEME = "aib+unix"
LOCAL_ACTION = "arrow-ipc-bridge.local"
_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    """This host's boot id ("" where the kernel does not offer one: then no socket is ever taken
    for the same host's)."""
    try:
        with open(_BOOT_ID_PATH, "rb") as f:
            return f.read().decode("ascii", "replace").strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class LocalLocation:
    """A publisher's socket as a Flight location."""

    socket_path: str
    publisher_id: str
    boot_id: str
    uid: int

    @property
    def uri(self) -> str:
        query = f"publisher_id={quote(self.publisher_id)}&boot_id={quote(self.boot_id)}&uid={self.uid}"
        return f"{LOCAL_SCHEME}://{quote(self.socket_path)}?{query}"

    @classmethod
    def parse(cls, uri: str) -> LocalLocation:
        """The location ``uri`` names; ``ValueError`` for anything that is not one (it came from
        the network)."""
        parts = urlsplit(uri)
        if parts.scheme != LOCAL_SCHEME or parts.netloc:
            raise ValueError(f"not an {LOCAL_SCHEME}:// location: {uri[:200]!r}")
        path = unquote(parts.path)
        if not path.startswith("/") or "\0" in path or len(path.encode()) > 107:
            raise ValueError("the local location's socket path is not an absolute socket path")
        query = parse_qs(parts.query, strict_parsing=True)
        try:
            (publisher_id,) = query["publisher_id"]
            (boot,) = query["boot_id"]
            (uid_text,) = query["uid"]
            uid = int(uid_text)
        except (KeyError, ValueError):
            raise ValueError("the local location lacks publisher_id, boot_id or uid") from None
        return cls(path, publisher_id, boot, uid)

    def same_host(self) -> bool:
        """Whether this process runs on the host (and boot) the location was made on."""
        here = boot_id()
        return bool(here) and here == self.boot_id

    @staticmethod
    def this_host(socket_path: str, publisher_id: str) -> LocalLocation:
        return LocalLocation(os.path.abspath(socket_path), publisher_id, boot_id(), os.getuid())
