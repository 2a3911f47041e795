"""The consumer's side: get a publication, map its regions once, hand out imported objects.

The get walk, top down: :mod:`.session` (the connection, leases, the re-get) ->
:mod:`.remembered` / :mod:`.message_import` (a message seen before, or its first import) ->
:mod:`.region_import` (host files mapped, CUDA handles opened) and :mod:`.content_check` ->
:mod:`.imported` (what the user holds, served through the Arrow PyCapsule protocol).
Beside it: :mod:`.waiting` (waits for names and versions), :mod:`.linger` (leases kept for
re-gets), :mod:`.array_cache` (CuPy arrays per name), :mod:`.live_stream` and :mod:`.c_stream`
(a subscription to a live stream, also as an Arrow C stream).
"""
