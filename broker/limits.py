"""The numbers a worker's limits start from: what a graph may hold and cost, how many sessions.

The protocol's modules (:mod:`.graph`, :mod:`.ops`) and the worker's quotas enforce them; they live
here, apart, because ``zmq-rpc-worker`` shows them in ``--help`` while it parses its flags, before
it binds, and the worker listens before anything heavy is imported (``worker/cli.py``). Imports
nothing.
"""

from __future__ import annotations

from typing import Final

MAX_NODES: Final = 8192
"""Nodes of one graph. Each costs the worker a decode, a check and plan, and a run even when tiny,
so this bounds a graph's fixed cost before its element work (:func:`~zmq_rpc.broker.ops.node_work`)
does: about a second at worst (the figures: docs/SECURITY.md, "What one request may cost"). A llama
layer is ~34 nodes: SmolLM2's 30-layer graph has ~1,000, a 240-layer stage would fit."""

DEFAULT_MAX_WORK: Final = 1 << 35
"""Element-ops (:func:`~zmq_rpc.broker.ops.node_work`) one graph run may ask for by default:
~3.4e10, tens of seconds of numpy on one core in the worst case (elementwise work over repeated
views); SmolLM2's 128-token prefill on one worker asks ~1e9. ``--max-graph-work`` sets it."""

NODE_WORK: Final = 1 << 17
"""Element-ops one node counts for being a node, whatever its size: checking, planning and
dispatching a tiny node costs about what numpy does ~1e5 element-ops in (docs/DESIGN.md). A graph
of many tiny nodes is then bounded by ``--max-graph-work`` like one of few big ones (and by :data:`MAX_NODES` before it is even decoded)."""

DEFAULT_MAX_SESSIONS: Final = 64
"""Sessions a worker serves at once unless told otherwise (``--max-sessions``)."""
