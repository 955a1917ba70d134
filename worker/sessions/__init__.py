"""Sessions on the backend thread: a client's session, its buffers, its request queue and the
dispatch vocabulary of a queued request (``session``: the two refer to each other), the
open-session table (``table``: HELLO, closing), checked views of buffers (``views``), memory
accounting and quotas (``memory``, ``quotas``), who a session belongs to (``identities``), and
the buffer and tensor commands over a session's buffers (``buffers``).

Everything here runs on the backend thread. Imports nothing on import.
"""
