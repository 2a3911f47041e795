"""``inspect FILE``: decode a message file (what ``export(...).message`` holds) and print what it
describes: its kind, batches, rows, bytes, device, regions by name and schema.

Nothing is mapped: the regions the message names are not opened, only described.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from arrow_ipc_bridge.cli._output import CommandError, human_bytes, print_json

__all__ = ["REGION_FLAG_NAMES", "REGION_KIND_NAMES", "describe_message", "inspect"]


def _region_names() -> tuple[dict[int, str], dict[int, str]]:
    from arrow_ipc_bridge.wire import metadata as m

    kinds = {
        m.REGION_PROCESS: "process",
        m.REGION_HOST_FD: "host_fd",
        m.REGION_CUDA_LEGACY: "cuda_legacy",
        m.REGION_CUDA_POOL: "cuda_pool",
        m.REGION_CUDA_VMM: "cuda_vmm",
    }
    flags = {
        m.REGION_FLAG_SEALED: "sealed",
        m.REGION_FLAG_ZERO_COPY: "zero_copy",
        m.REGION_FLAG_KEPT: "kept",
    }
    return kinds, flags


REGION_KIND_NAMES, REGION_FLAG_NAMES = _region_names()
# Placeholder base address of every region when counting rows: rebuilding a batch needs one per
# region, and only the root lengths of the rebuilt structs are read, never a buffer.
_UNMAPPED_BASE = 1 << 16


def _flag_names(flags: int) -> list[str]:
    names = [name for bit, name in REGION_FLAG_NAMES.items() if flags & bit]
    unknown = flags & ~sum(REGION_FLAG_NAMES)
    return names + ([f"0x{unknown:x}"] if unknown else [])


def describe_message(data: bytes, n_fds: int) -> dict[str, Any]:
    """What a message holds, as plain values (the ``--json`` output); raises ``ProtocolError``
    (or another ``BridgeError``) for a message the decoder refuses."""
    from arrow_ipc_bridge._ffi import ffi
    from arrow_ipc_bridge.consumer.imported import (
        _describe_root,
        batch_lengths,
        device_label,
        message_schema,
        referenced_bytes,
    )
    from arrow_ipc_bridge.wire.metadata import Decoded

    decoded = Decoded(data, n_fds)
    try:
        regions = decoded.regions()
        schema = message_schema(decoded)
        bases = ffi.new("uint64_t[]", [_UNMAPPED_BASE] * max(len(regions), 1))
        lengths = batch_lengths(decoded, bases)
        device = decoded.device()
        root_format = _root_format(decoded)
        return {
            "message_bytes": len(data),
            "wire_version": f"{data[4]}.{data[5]}",
            "kind": "stream" if decoded.is_stream else "array",
            "root": _describe_root(decoded.is_stream, root_format, decoded.batch_count),
            "batches": decoded.batch_count,
            "rows": sum(lengths),
            "rows_per_batch": lengths,
            "data_bytes": referenced_bytes(decoded),
            "schema_nodes": decoded.node_count,
            "device": {
                "type": device_label(device.device_type, 0).split(":")[0],
                "identity": device.identity.hex(),
                "sync_event": bool(device.sync),
            },
            "regions": [
                {
                    "index": i,
                    "kind": REGION_KIND_NAMES.get(region.kind, f"unknown ({region.kind})"),
                    "size": region.size,
                    "file_offset": region.file_offset,
                    "fd_index": region.fd_index,
                    "handle_bytes": len(region.handle),
                    "flags": _flag_names(region.flags),
                }
                for i, region in enumerate(regions)
            ],
            "schema": [{"name": field.name, "type": str(field.type)} for field in schema],
            "schema_text": str(schema),
        }
    finally:
        decoded.close()


def _root_format(decoded: Any) -> str:
    """The root's Arrow format string (``"+s"`` for record batches and tables)."""
    from arrow_ipc_bridge._ffi import ffi
    from arrow_ipc_bridge.wire.capsules import new_capsule

    capsule, out = new_capsule("schema")
    decoded.rebuild_schema(out)
    root = str(ffi.string(out.format).decode())
    del capsule
    return root


def inspect(path: str, n_fds: int, *, as_json: bool = False) -> int:
    """Print what the message in ``path`` holds; a file that cannot be read or a message the
    decoder refuses is a :class:`CommandError`."""
    from arrow_ipc_bridge.errors import BridgeError

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        facts = describe_message(data, n_fds)
    except BridgeError as exc:
        raise CommandError(f"{path}: invalid message: {exc}") from None
    if as_json:
        print_json(facts)
        return 0
    print(
        f"{path}: {facts['message_bytes']} bytes, wire {facts['wire_version']}, {facts['root']}, "
        f"{facts['rows']} rows, {human_bytes(facts['data_bytes'])} of data, "
        f"{facts['schema_nodes']} schema nodes"
    )
    device = facts["device"]
    extra = f", GPU {device['identity']}" if device["identity"] else ""
    print(f"device: {device['type']}{extra}{', with a sync event' if device['sync_event'] else ''}")
    for region in facts["regions"]:
        flags = ",".join(region["flags"]) or "-"
        fd = f"fd #{region['fd_index']}" if region["fd_index"] >= 0 else "no fd"
        print(
            f"region {region['index']}: {region['kind']}, {region['size']} bytes, {fd}, "
            f"offset {region['file_offset']}, flags {flags}"
        )
    print("schema:")
    for line in facts["schema_text"].splitlines():
        print(f"  {line}")
    return 0
