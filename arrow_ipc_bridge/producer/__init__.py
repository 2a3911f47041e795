"""The producer's side: export Arrow data into shareable regions and serve it under leases.

The publish walk, top down: :mod:`.publisher` (names, versions, leases, the server) ->
:mod:`.exporter` (capture -> describe -> place -> encode) -> ``wire/`` and ``host/`` / ``cuda/``.
Live streams: :mod:`.stream_writer` (``StreamWriter``, ``publish_stream``), :mod:`.stream_hub`
(subscribers, credit, policies), :mod:`.stream_slots` (batches filled in place),
:mod:`.stream_ring` (the shared segments small batches are copied into). :mod:`.watch` holds the
publisher's versions and the waits sessions hold on them.
"""
