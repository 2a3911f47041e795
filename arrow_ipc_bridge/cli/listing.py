"""``list SOCKET``: the names a running publisher serves, with kind, rows, device and size.

GPU data names its GPU twice: ``cuda:N`` is this process's ordinal of it (what a consumer here
would see as ``device_id``; ``CUDA_VISIBLE_DEVICES`` may number GPUs differently in each process),
and its UUID (``GPU-...``, as ``nvidia-smi -L`` prints it) is the same in every process. JSON rows
of GPU data carry the UUID as ``gpu_uuid``.

The LIST frame carries names only, so each name is fetched (``Session.get``) and released at once to
read its facts from the message: a get per name, which a diagnostic command can afford. Live streams
are not listed: the publisher answers LIST with its publications alone.
"""

from __future__ import annotations

from typing import Any

from arrow_ipc_bridge.cli._output import CommandError, human_bytes, print_json, print_table

__all__ = ["list_names"]


def _facts(session: Any, name: str) -> dict[str, Any]:
    """One publication's facts, or the reason it could not be read (unpublished since the LIST,
    device data this process cannot open, ...)."""
    from arrow_ipc_bridge.errors import BridgeError

    try:
        with session.get(name) as imported:
            facts: dict[str, Any] = {
                "name": name,
                "kind": "table" if _is_stream(imported) else _array_kind(imported),
                "rows": imported.num_rows,
                "device": imported.device,
                "bytes": imported.nbytes,
                "columns": len(imported.schema),
                "error": None,
            }
            if imported.device.startswith("cuda:"):
                facts["gpu_uuid"] = _gpu_uuid(imported.device_id)
            return facts
    except BridgeError as exc:
        return {
            "name": name,
            "kind": None,
            "rows": None,
            "device": None,
            "bytes": None,
            "columns": None,
            "error": f"{type(exc).__name__}: {exc}",
        }


def _gpu_uuid(ordinal: int) -> str:
    """The UUID of this process's GPU ``ordinal``: the GPU the message named (the import mapped
    that UUID to the ordinal)."""
    from arrow_ipc_bridge import cuda

    return cuda.format_uuid(cuda.device_uuid(ordinal))


def _device_cell(row: dict[str, Any]) -> str:
    """``cpu``, or ``cuda:N (GPU-...)`` for GPU data."""
    uuid = row.get("gpu_uuid")
    return f"{row['device']} ({uuid})" if uuid else str(row["device"])


def _is_stream(imported: Any) -> bool:
    from arrow_ipc_bridge.consumer.imported import ImportedStream

    return isinstance(imported, ImportedStream)


def _array_kind(imported: Any) -> str:
    return "record batch" if imported.root_format == "+s" else "array"


def list_names(socket_path: str, *, timeout: float, as_json: bool = False) -> int:
    """Print what the publisher at ``socket_path`` serves; exit 1 when it cannot be reached."""
    import arrow_ipc_bridge as aib
    from arrow_ipc_bridge.errors import BridgeError

    try:
        session = aib.connect(socket_path, timeout=timeout)
    except (BridgeError, OSError) as exc:
        raise CommandError(str(exc)) from None
    with session:
        try:
            rows = [_facts(session, name) for name in sorted(session.list())]
        except BridgeError as exc:
            raise CommandError(f"{socket_path}: {exc}") from None
    if as_json:
        print_json(rows)
        return 0
    if not rows:
        print(f"{socket_path}: no publications")
        return 0
    print_table(
        ["NAME", "KIND", "ROWS", "COLUMNS", "DEVICE", "SIZE"],
        [
            [row["name"], "?", "", "", "", row["error"]]
            if row["error"]
            else [
                row["name"],
                row["kind"],
                str(row["rows"]),
                str(row["columns"]),
                _device_cell(row),
                human_bytes(row["bytes"]),
            ]
            for row in rows
        ],
    )
    return 0
