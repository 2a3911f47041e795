"""Memory regions the bridge exports and maps: host shared memory (``host``) and device memory."""
