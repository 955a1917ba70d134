# Type stubs for the part of msgpack zmq-rpc uses (msgpack ships none). Decoded values are Any:
# they come off the wire and are checked field by field by the protocol's decoders.
from collections.abc import Callable
from typing import Any

import zmq

class Packer:
    def __init__(self, *, use_bin_type: bool = ..., autoreset: bool = ...) -> None: ...
    def pack(self, obj: Any) -> bytes: ...

def packb(o: Any, *, use_bin_type: bool = ...) -> bytes: ...
# packed: any object with the buffer protocol; pyzmq's stubs do not say that zmq.Frame has it
def unpackb(packed: bytes | bytearray | memoryview | zmq.Frame, *, raw: bool = ...,
            strict_map_key: bool = ..., use_list: bool = ..., max_array_len: int = ...,
            max_map_len: int = ..., list_hook: Callable[[Any], Any] | None = ...,
            object_hook: Callable[[Any], Any] | None = ...) -> Any: ...
