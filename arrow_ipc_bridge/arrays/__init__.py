"""Arrow data and array libraries: GPU uploads and downloads (:mod:`.device`: ``to_device``,
``to_host``, ``from_cuda_arrays``) and imported columns as NumPy, CuPy and PyTorch arrays
(:mod:`.columns`: ``column_view``, ``column_arrays``)."""
