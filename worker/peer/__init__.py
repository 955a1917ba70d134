"""The peer port: worker-to-worker transfers, on the backend thread.

``links`` owns the peer PULL socket and routes the executor's entry points to the pieces:
``push`` (the PUSH sockets to other workers), ``send`` (a send cut into chunks and pushed),
``receive`` (receives in progress, chunks landed), ``acks`` (sends and probes waiting for an
acknowledgement), ``endpoints`` (which peer endpoints may be connected to, and as whom), ``stash``
(chunks that arrive before their receive), ``queue`` (the PULL's bounded receive queues), and
``transfers``, the client commands over them (PEER_RECV / SEND / PROBE / FILL).
Imports nothing on import.
"""
