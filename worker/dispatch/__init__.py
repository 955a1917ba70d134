"""The backend thread's request path: requests read ahead from the PAIR (``inbox``), scheduled and
dispatched (``executor``: sessions' queues, the ``Cmd -> Route`` table), what the worker says about
itself (``self_report``: HELLO's reply, STATUS, capabilities), replies back to the broker
(``outbox``), whole messages in and out of the PAIR (``frames``).

Everything here runs on the backend thread. Imports nothing on import: name the module you need.
"""
