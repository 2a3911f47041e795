"""What a Flight request names: the publication or live stream of a ticket or descriptor, and the
device of an upload. Everything here came from the network: anything malformed is refused
INVALID_ARGUMENT (``refusals.py``).
"""

from __future__ import annotations

from pyarrow import flight

from arrow_ipc_bridge.errors import BridgeError
from arrow_ipc_bridge.flight.refusals import invalid
from arrow_ipc_bridge.transport.protocol import encode_name

__all__ = ["cuda_ordinal", "name_of_descriptor", "name_of_ticket"]


def name_of_ticket(raw: bytes) -> str:
    try:
        name = raw.decode("utf-8")
        encode_name(name)  # the bridge's own limits on names
    except (UnicodeDecodeError, ValueError, TypeError, BridgeError):
        raise invalid("a ticket is the UTF-8 name of a publication or live stream") from None
    return name


def name_of_descriptor(descriptor: flight.FlightDescriptor) -> tuple[str, str | None]:
    """``(name, device)`` of a descriptor: path ``[name]`` or ``[name, "cuda:N"]`` (do_put), or a
    command holding the UTF-8 name."""
    if descriptor.descriptor_type == flight.DescriptorType.PATH:
        parts = [p.decode("utf-8", "replace") if isinstance(p, bytes) else str(p) for p in descriptor.path]
        if len(parts) not in (1, 2):
            raise invalid("a descriptor path is [name] or [name, 'cuda:N']")
        name = name_of_ticket(parts[0].encode("utf-8"))
        return name, parts[1] if len(parts) == 2 else None
    return name_of_ticket(bytes(descriptor.command)), None


def cuda_ordinal(device: str) -> int:
    prefix = "cuda:"
    if not device.startswith(prefix) or not device[len(prefix) :].isdigit():
        raise invalid(f"device must be 'cuda:N', not {device[:40]!r}")
    return int(device[len(prefix) :])
