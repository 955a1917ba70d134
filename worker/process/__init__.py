"""The worker process around its threads, set up by the main thread: ``--device`` names
(``devices``, parsed without importing numpy), the package version (``version``), the garbage
collector's pacing (``gc_pacing``) and giving idle heap back to the system (``heap``, glibc only).
Imports nothing on import.
"""
