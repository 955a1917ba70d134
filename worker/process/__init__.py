"""The worker process around its threads, set up by the main thread: the client port listening
before anything is imported (``early_listen``, the entry points' first step), ``--device`` names
(``devices``, parsed without importing numpy), the package version (``version``), the garbage
collector's pacing (``gc_pacing``) and giving idle heap back to the system (``heap``, glibc only).
Imports nothing on import.
"""
