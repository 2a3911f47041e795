"""A session's imports made or wrapped in Python: the message's first sight, a remembered message
imported again in Python, and a new message the C core imported over regions open here.

:class:`MessageImporter` holds what those need of the session (the host mapping cache, the remembered
messages, the content checks, the set of live imports) and nothing of its connection: the session
(``consumer/session.py``) decides which path a message takes, passes what the connection gives (the lease
token, the pool-fd fetch, the lease keeper) and keeps the requests, the leases and the get paths.
The steady state, a remembered message imported by the C core, is the session's (``Session.get``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.consumer import region_import
from arrow_ipc_bridge.consumer.content_check import check_content, cuda_reader
from arrow_ipc_bridge.consumer.imported import (
    ImportedArray,
    ImportedStream,
    imported_class,
    imported_from,
)
from arrow_ipc_bridge.consumer.remembered import RememberedMessage, RememberedMessages
from arrow_ipc_bridge.errors import UnsupportedFormatError
from arrow_ipc_bridge.host.mappings import HostMappingCache
from arrow_ipc_bridge.process_stats import import_counters
from arrow_ipc_bridge.wire.capsules import DEVICE_CPU, DEVICE_CUDA, owner_address
from arrow_ipc_bridge.wire.metadata import Decoded

__all__ = ["ImportedRefs", "MessageImporter", "track"]

Imported = ImportedArray | ImportedStream
# Weak references to a session's live imports (Session.close releases those alive), each removing
# itself when its import dies, as a WeakSet's do; a plain set, so that the C core's local get adds
# to it in one call.
ImportedRefs = set[weakref.ref[Imported]]


def track(imported_refs: ImportedRefs, imported: Imported) -> None:
    """Add ``imported`` to a session's live imports (as the C core's local get does)."""
    imported_refs.add(weakref.ref(imported, imported_refs.discard))


class MessageImporter:
    """The Python import paths of one session (see the module's docstring)."""

    def __init__(
        self,
        cache: HostMappingCache,
        remembered: RememberedMessages,
        imported_refs: ImportedRefs,
        *,
        host_check: str,
        cuda_check: str,
    ) -> None:
        self._cache = cache
        self._remembered = remembered
        self._imported_refs = imported_refs
        self._host_check = host_check
        self._cuda_check = cuda_check

    def import_message(
        self,
        message: bytes,
        fds: Sequence[int],
        *,
        name: str | None,
        token: int,
        fetch_pool_fd: Callable[[bytes], int] | None,
    ) -> Imported:
        """``message`` arriving with ``fds``, imported under the lease ``token`` (0: none): from its
        remembered template when the set has it, else decoded, validated, mapped or opened, and
        remembered when a re-get can use it. ``fetch_pool_fd``: asks the publisher for an IPC
        pool's descriptor (None: not connected)."""
        found = self._remembered.lookup(message, fds, token)
        if found is not None:
            hit, owner, event = found
            return self._import_remembered(owner, hit, event, name)
        files = region_import.file_identities(fds)  # what a remembered message will be matched by (in C)
        template = Decoded(message, len(fds))
        lease_owner: Any = None
        try:
            device = template.device()
            regions = template.regions() if device.device_type == DEVICE_CUDA else []
            if self._remembered.keeps_pool_lease(regions, message, name, token):
                # The template will keep this lease (with the pool imports) after the import ends:
                # the lease gets an owner of its own, which both hold.
                decoded = Decoded.sharing(template, 0)
                owner = lib.aib_owner_new(token)
                if owner == ffi.NULL:
                    decoded.close()
                    raise MemoryError("allocating a lease owner")
                lease_owner = ffi.gc(owner, lib.aib_owner_unref)
                try:
                    decoded.depend_on(lease_owner)
                except BaseException:
                    decoded.close()
                    raise
            else:
                decoded = Decoded.sharing(template, token)
        except BaseException:
            template.close()
            if lease_owner is not None:
                ffi.release(lease_owner)
            raise
        template_kept = False
        try:
            if device.device_type == DEVICE_CPU:
                bases = region_import.map_host_regions(self._cache, decoded, fds, template)
                # After mapping, before anything is handed out; a re-get of these bytes with these
                # files (remembered below) is not checked again (wire-format.md says why).
                check_content(decoded, ffi.new("uint64_t[]", bases or [0]), self._host_check)
                imported = imported_from(decoded, bases, device_type=DEVICE_CPU, device_id=-1, name=name)
                if files is not None:
                    # The template holds the mappings: a re-get with the same bytes and files is
                    # imported by the C core (also all-null data, which maps nothing).
                    base_array = ffi.new("uint64_t[]", bases or [0])
                    self._remembered.remember(template, base_array, DEVICE_CPU, -1, 0, files=files, name=name)
                    template_kept = True
            elif device.device_type == DEVICE_CUDA:
                imported, template_kept = region_import.open_cuda_regions(
                    template,
                    decoded,
                    regions,
                    fds,
                    device,
                    name=name,
                    lease_owner=lease_owner,
                    remembered=self._remembered,
                    cuda_check=self._cuda_check,
                    fetch_pool_fd=fetch_pool_fd,
                )
            else:
                raise UnsupportedFormatError(
                    f"the message holds data on device type {device.device_type}, "
                    "which this build cannot import"
                )
        except BaseException:
            decoded.close()
            raise
        finally:
            if not template_kept:
                template.close()  # the import's owner keeps what it needs alive
            if lease_owner is not None:
                ffi.release(lease_owner)  # the import (and a remembering template) hold it
        if name is not None and not template_kept:
            self._remembered.forget_replaced(name, message)
        track(self._imported_refs, imported)
        next(import_counters.python_imports)
        return imported

    def _import_remembered(
        self, owner: Any, hit: RememberedMessage, event: int, name: str | None
    ) -> Imported:
        """The same message again (same publication), its regions already open: ``owner`` (this
        import's, sharing the template) wrapped by the remembered message, as the C core's gets
        are (``RememberedMessage.adopt``); ``event``: its opened producer event (0: none)."""
        sync = ffi.NULL
        if event:
            sync = lib.aib_owner_slot(owner)
            sync[0] = event
        imported: Imported = hit.adopt(owner, sync, name, owner_address(owner))
        track(self._imported_refs, imported)
        next(import_counters.python_remembered_imports)
        return imported

    def adopt_new(
        self, imported_now: tuple[int, Any, int, Any, int, int], message: bytes, name: str, lease_keeper: Any
    ) -> Imported:
        """The import of a message the session had not seen, which the C core made because all its
        regions are open in this process (``aib_import_new``): its owner carries the decode, the
        view and the lease token; wrap it. ``message``: the bytes the C core decoded;
        ``imported_now``: what ``Channel.get`` returns for it; ``lease_keeper``: the session's."""
        _, owner, address, sync_slot, version, _ = imported_now
        # The C core checked the message it decoded (and a GET's lease id).
        decoded = Decoded.adopt_owned(owner, message)  # owns the reference from here on
        found = ffi.new("const uint64_t **")
        device_id = ffi.new("int64_t *")
        n = lib.aib_owner_view_bases(owner, found, device_id)
        bases = ffi.new("uint64_t[]", ffi.unpack(found[0], n) if n else [0])
        if self._cuda_check != "none":
            try:
                check_content(decoded, bases, self._cuda_check, cuda_reader(int(device_id[0])))
            except BaseException:
                decoded.close()  # ends the lease
                raise
        imported_type = imported_class(decoded.is_stream, DEVICE_CUDA)
        imported: Imported = imported_type.adopt(
            decoded,
            bases,
            n_bases=n,
            device_type=DEVICE_CUDA,
            device_id=int(device_id[0]),
            sync_event=sync_slot or None,
            name=name,
            owner_address=address,
        )
        if version:
            imported.version = version
        next(import_counters.new_message_gets)
        track(self._imported_refs, imported)
        self._remembered.forget_replaced(name, message)
        if self._remembered.limit and self._remembered.got_again(name, message):
            # The same new message twice in a row (a consumer polling a name the producer has not
            # republished yet): remember it, so the next gets skip even the C decode.
            self._remembered.remember_new(
                owner, message, bases, int(device_id[0]), name=name, lease_keeper=lease_keeper
            )
        return imported
