"""What every layer of the bridge leans on and that knows nothing of Arrow or of the two sides.

- :mod:`.arguments`: argument checks at the public API's boundary.
- :mod:`.deferred_close`: ``close()`` that waits for borrowers on other threads.
- :mod:`.file_limit`: running out of file descriptors, reported as such.
- :mod:`.process`: this process's id, kept current across ``fork``.
- :mod:`.reaper`: "this owner died" notices from the C core delivered to Python callbacks.
"""
