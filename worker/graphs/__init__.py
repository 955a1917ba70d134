"""Compute graphs on the backend thread: the graph commands (``commands``: register, run, compute,
free), compile and execute (``execute``: validation, the scratch arena plan, the run), a compiled
graph bound once to its arrays (``bind``), and linked runs that push their outputs to a peer
(``linked``: GRAPH_RUN_LINKED and the replies they hold back).

Everything here runs on the backend thread. Imports nothing on import.
"""
