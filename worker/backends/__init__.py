"""Compute backends, owned by the backend thread: ``base`` (the ``Backend`` protocol, with its explicit
capabilities), ``numpy_backend`` and ``numpy_ops`` (the CPU backend and its kernels),
``cupy_backend`` and ``cupy_ops`` (NVIDIA GPUs; cupy is imported only when asked for), ``staging``
(pinned host staging for device transfers). Imports nothing on import.
"""
