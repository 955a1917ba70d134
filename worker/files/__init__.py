"""Weights from the worker's own disk: model files in ``--model-dir`` (``model_files``: confined paths,
identity, tensor metadata, reads), hashed off the backend thread (``hasher``: its one hashing thread),
the content-addressed tensor cache of ``--cache-dir`` (``tensor_cache``), and the commands over them
(``loading``: FILE_QUERY, READ_FILE, SET_FROM_CACHE, cached uploads).

The backend thread runs all of it but the hashing thread's jobs. Imports nothing on import.
"""
