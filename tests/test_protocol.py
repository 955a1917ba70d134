"""Tests for broker/protocol.py: a message class per command, golden bytes, decoding as validation.

Pure functions only: no sockets. The property tests feed ``decode_request`` random bytes and random
msgpack structures (it may only ever raise ``BadRequest``), and check the tensor geometry helpers
(``TensorRef.byte_extent``, ``split_tensor``) against brute force numpy.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zmq_rpc.broker import graph as g
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.errors import BadRequest
from zmq_rpc.broker.files import MAX_READS
from zmq_rpc.broker.protocol import Cmd, DType, ErrorCode, TensorRef

pytestmark = pytest.mark.timeout(30)

PROPERTY = settings(max_examples=200, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

F32 = DType.FLOAT32


def ref(shape: tuple[int, ...] = (3, 4), strides: tuple[int, ...] | None = None, *,
        buffer: int = 7, dtype: DType = F32, offset: int = 0) -> TensorRef:
    if strides is None:
        strides = p.contiguous_strides(shape, dtype.itemsize)
    return TensorRef(buffer=buffer, dtype=dtype, shape=shape, strides=strides, offset=offset)


def pack(*values: Any) -> bytes:
    return msgpack.packb(list(values), use_bin_type=True)


def wire(tensor: TensorRef) -> list[Any]:
    return tensor.to_wire()


def frames_of(cmd: Cmd, req_id: int, msg: p.Message, payload: list[bytes] | None = None
              ) -> list[bytes]:
    if payload is None:
        payload = [bytes(n) for n in msg.payload_sizes() or []]
    return [p.encode_request(cmd, req_id, msg), *payload]


# ----------------------------------------------------------------- one class per command

STRIDED = ref((2, 3), (48, -8), dtype=DType.FLOAT64, offset=32, buffer=(1 << 63) - 1)

REQUEST_EXAMPLES: dict[Cmd, p.Message] = {
    Cmd.HELLO: p.Hello(major=1, minor=0, client="pytest ✓"),
    Cmd.PING: p.Empty(),
    Cmd.GOODBYE: p.Empty(),
    Cmd.ALLOC_BUFFER: p.AllocBuffer(handle=3, size=(1 << 63) - 1),
    Cmd.FREE_BUFFER: p.BufferOp(handle=0),
    Cmd.CLEAR_BUFFER: p.ClearBuffer(handle=12, value=255),
    Cmd.DEVICE_MEMORY: p.Empty(),
    Cmd.SET_TENSOR: p.SetTensor(tensor=STRIDED),
    Cmd.GET_TENSOR: p.GetTensor(tensor=ref((), (), dtype=DType.BFLOAT16, offset=6)),
    Cmd.MEMSET_TENSOR: p.MemsetTensor(tensor=ref((5,), dtype=DType.UINT8), value=7, offset=1,
                                      size=-1),
    Cmd.COPY_TENSOR: p.CopyTensor(src=ref((4, 0), (0, -4)), dst=ref((4, 0), buffer=9)),
    Cmd.SYNCHRONIZE: p.Empty(),
}


BASE_COMMANDS = list(REQUEST_EXAMPLES)
"""The buffer and tensor commands; the graph commands appended after them have their own tests."""


def test_every_command_has_a_request_and_a_reply_class() -> None:
    assert set(p.REQUESTS) == set(Cmd)
    assert set(p.REPLIES) == set(Cmd)
    assert all(cmd > max(BASE_COMMANDS) for cmd in set(Cmd) - set(BASE_COMMANDS))
    for cmd in Cmd:
        for cls in (p.REQUESTS[cmd], p.REPLIES[cmd]):
            assert issubclass(cls, p.Message)
            params = vars(cls).get("__dataclass_params__")
            assert params is not None and params.frozen, f"{cls.__name__}: a frozen dataclass"


@pytest.mark.parametrize("cmd", BASE_COMMANDS, ids=lambda c: c.name)
def test_request_round_trip(cmd: Cmd) -> None:
    msg = REQUEST_EXAMPLES[cmd]
    assert isinstance(msg, p.REQUESTS[cmd])
    frames = frames_of(cmd, 2**32 + 5, msg)
    assert len(frames) - 1 == msg.payload_count()
    assert p.decode_request(frames) == (cmd, 2**32 + 5, msg)


def test_tensor_fields_survive_the_round_trip() -> None:
    _, _, msg = p.decode_request(frames_of(Cmd.SET_TENSOR, 1, p.SetTensor(tensor=STRIDED)))
    got = msg.tensor  # type: ignore[attr-defined]
    assert (got.buffer, got.dtype, got.shape, got.strides, got.offset) == \
        ((1 << 63) - 1, DType.FLOAT64, (2, 3), (48, -8), 32)
    assert type(got.dtype) is DType and type(got.shape) is tuple and type(got.strides) is tuple


REPLY_EXAMPLES: dict[Cmd, p.Message] = {
    Cmd.HELLO: p.HelloReply(
        major=1, minor=0, server="worker", alignment=64, max_buffer_size=1 << 30,
        devices=(p.Device(name="cpu", kind="cpu", total_memory=1 << 34, free_memory=1 << 33),),
        max_message_size=64 << 20, session_timeout_ms=30_000,
        capabilities=("views", "zero-copy"), peer_endpoint="tcp://127.0.0.1:5"),
    Cmd.DEVICE_MEMORY: p.DeviceMemoryReply(free=10, total=20),
    Cmd.GET_TENSOR: p.GetTensorReply(),
}


@pytest.mark.parametrize("cmd", BASE_COMMANDS, ids=lambda c: c.name)
def test_reply_round_trip(cmd: Cmd) -> None:
    msg = REPLY_EXAMPLES.get(cmd, p.Ack())
    assert isinstance(msg, p.REPLIES[cmd])
    header = p.unpack_header(p.encode_reply(77, msg))
    assert header[:2] == [p.STATUS_OK, 77]
    assert p.decode_reply(cmd, header) == msg


@pytest.mark.parametrize("code", list(ErrorCode), ids=lambda c: c.name)
def test_error_reply_maps_to_a_fixed_exception_class(code: ErrorCode) -> None:
    header = p.unpack_header(p.encode_error(3, code, "why"))
    assert header == [int(code), 3, "why"]
    exc = p.decode_reply(Cmd.PING, header)
    assert isinstance(exc, p._ERROR_CLASSES[code])
    assert exc.code == code and code.name in exc.message and "why" in exc.message


def test_error_message_is_capped() -> None:
    header = p.unpack_header(p.encode_error(1, ErrorCode.INTERNAL, "x" * 10_000))
    assert len(header[2]) == p.MAX_STRING


# ---------------------------------------------------------------------------- golden bytes
# These pin the encoding byte for byte. If one of them changes, the wire format changed: bump
# PROTOCOL_VERSION (the major: old peers would misread it) and only then update the literals.
# The enums are append-only: a new member must take a value above every pinned one; a new command
# bumps the minor (1.1: GRAPH_RUN_LINKED), and so does a field added at the end of a message
# (1.2: GRAPH_RUN_LINKED's hold_reply_us; 1.4: SET_TENSOR's cache_key, PEER_SEND's acked), which
# older peers never see while it holds its default, and so does an optional op param (1.3:
# scale's bias b, sent only when it is not 0; see test_graph.py's golden bytes).
# 1.5: STATUS (25); HELLO's timing and every reply's timing (the Ack reply class).
# 1.6: HELLO's and STATUS's device_details, last, sent only to sessions whose HELLO said 1.6+.
# 1.7: the graph ops attention and swiglu (capability fused-ops; the encoding is unchanged).
# 1.8: HELLO's key and proof (key-proof: the CURVE key that opens a session, proven).
# 1.9: PEER_RECV's source, GRAPH_RUN_LINKED's receive_from (last, off the wire when empty) and
#      the error code PEER_UNREACHABLE (only to sessions whose HELLO said 1.9+).
# 1.10: HELLO's and its reply's exchange, NOT_AUTHENTIC (16), the signed trailer after a signed
#       session's headers (tests/test_request_mac.py pins it).
# 1.11: the rope op's optional third input freq_factors (capability rope-factors; the encoding
#       is unchanged).
# 1.12: the graph ops attend_rows and sample_rows (capability row-attention; the encoding is
#       unchanged).
# 1.13: the graph op causal_mask (capability causal-mask; the encoding is unchanged).
# 1.14: replies' draining (Ack's and GraphReply's last field: the worker is leaving; capability
#       draining), sent only to sessions whose HELLO said 1.14 (test_golden_draining).
# 1.15: GRAPH_RUN_LINKED's keep (last, on the wire only when >= 0) and GRAPH_RUN_KEPT = 26
#       (capability kept-runs; test_golden_kept_runs).


def test_protocol_version_is_pinned() -> None:
    assert p.PROTOCOL_VERSION == (1, 15)


def pinned(enum: Any, table: dict[str, Any], value: Callable[[Any], Any] = lambda m: m.value
           ) -> None:
    """Every pinned member keeps its name and value; members added since come after them."""
    top = max(v[0] if isinstance(v, tuple) else v for v in table.values())
    assert {m.name: value(m) for m in enum if m.value <= top} == table
    assert all(m.value > top for m in enum if m.name not in table)


def test_enum_values_are_pinned() -> None:
    pinned(Cmd, {
        "HELLO": 1, "PING": 2, "GOODBYE": 3, "ALLOC_BUFFER": 4, "FREE_BUFFER": 5,
        "CLEAR_BUFFER": 6, "DEVICE_MEMORY": 7, "SET_TENSOR": 8, "GET_TENSOR": 9,
        "MEMSET_TENSOR": 10, "COPY_TENSOR": 11, "SYNCHRONIZE": 12})
    pinned(ErrorCode, {
        "BAD_REQUEST": 1, "UNKNOWN_COMMAND": 2, "VERSION_MISMATCH": 3, "NO_SESSION": 4,
        "INVALID_HANDLE": 5, "OUT_OF_BOUNDS": 6, "OUT_OF_MEMORY": 7, "SIZE_MISMATCH": 8,
        "GRAPH_INVALID": 9, "GRAPH_FAILED": 10, "TRANSFER_FAILED": 11, "SHUTTING_DOWN": 12,
        "INTERNAL": 13, "FILE_REFUSED": 14, "PEER_UNREACHABLE": 15})
    pinned(DType, {
        "FLOAT32": (0, 4), "FLOAT16": (1, 2), "BFLOAT16": (2, 2), "FLOAT64": (3, 8),
        "INT8": (4, 1), "UINT8": (5, 1), "INT16": (6, 2), "UINT16": (7, 2), "INT32": (8, 4),
        "UINT32": (9, 4), "INT64": (10, 8), "UINT64": (11, 8), "BOOL": (12, 1)},
        lambda d: (d.value, d.itemsize))
    assert p.STATUS_OK == 0


def test_golden_hello() -> None:
    header = p.encode_request(Cmd.HELLO, 1, p.Hello(major=1, minor=0, client="golden"))
    assert header.hex() == "9501010100a6676f6c64656e"


def test_golden_set_tensor_2d_strided() -> None:
    tensor = ref((3, 4), (32, 4), buffer=7, offset=16)  # every other row of a float32[6, 4]
    header = p.encode_request(Cmd.SET_TENSOR, 42, p.SetTensor(tensor=tensor))
    # [8, 42, [7, 0, [3, 4], [32, 4], 16]]
    assert header.hex() == "93082a95070092030492200410"


def test_golden_error_and_ok_replies() -> None:
    assert p.encode_error(9, ErrorCode.OUT_OF_BOUNDS, "view outside").hex() == \
        "930609ac76696577206f757473696465"
    assert p.encode_reply(5, p.Empty()).hex() == "920005"


@pytest.mark.parametrize("req_id", [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32,
                                    2**63 - 1, 2**64 - 1])
@pytest.mark.parametrize("cmd", [Cmd.PING, Cmd.SYNCHRONIZE, Cmd.STATUS])
def test_heads_and_packed_ids_are_the_encoders_bytes(cmd: Cmd, req_id: int) -> None:
    """A synchronous caller's fast course builds a field-less request and its Ack from a head
    and the packed id: the very bytes of encode_request / encode_reply, at every id width."""
    assert p.request_head(cmd) + p.pack_id(req_id) == p.encode_request(cmd, req_id, p.Empty())
    assert p.BARE_REPLY_HEAD + p.pack_id(req_id) == p.encode_reply(req_id, p.Ack())
    assert p.request_head(Cmd.PING).hex() == "9202" and p.BARE_REPLY_HEAD.hex() == "9200"


# ------------------------------------------------------------------- decoding is validation


def bad(frames: list[Any], code: ErrorCode = ErrorCode.BAD_REQUEST, match: str = "") -> BadRequest:
    with pytest.raises(BadRequest, match=match) as info:
        p.decode_request(frames)
    assert info.value.code == code, info.value.message
    return info.value


def test_not_msgpack() -> None:
    bad([b"\xc1"], match="not valid msgpack")  # 0xc1 is never used by msgpack
    bad([b"\x93\x01"], match="not valid msgpack")  # truncated array
    bad([b""], match="not valid msgpack")
    bad([pack(1, 2) + b"\x00"], match="not valid msgpack")  # trailing bytes


@pytest.mark.parametrize("header", [
    msgpack.packb(1), msgpack.packb("HELLO"), msgpack.packb({"cmd": 1, "req_id": 2}),
    msgpack.packb(None), msgpack.packb(b"\x01\x02"),
], ids=["int", "str", "map", "nil", "bin"])
def test_not_an_array(header: bytes) -> None:
    bad([header], match=r"array \[cmd, req_id")


@pytest.mark.parametrize("header", [pack(), pack(Cmd.PING), pack(Cmd.PING, "1"),
                                    pack(Cmd.PING, None), pack(Cmd.PING, True),
                                    pack(Cmd.PING, 1.0), pack("PING", 1), pack(False, 1)],
                         ids=["empty", "no-id", "str-id", "nil-id", "bool-id", "float-id",
                              "str-cmd", "bool-cmd"])
def test_missing_or_mistyped_req_id_and_cmd(header: bytes) -> None:
    exc = bad([header], match=r"\[cmd, req_id")
    assert not hasattr(exc, "req_id")


@pytest.mark.parametrize("cmd", [0, max(Cmd) + 1, 255, -1, 2**64 - 1])
def test_unknown_command(cmd: int) -> None:
    exc = bad([pack(cmd, 5)], ErrorCode.UNKNOWN_COMMAND, match=f"unknown command {cmd}")
    assert exc.req_id == 5  # type: ignore[attr-defined]


@pytest.mark.parametrize("header", [
    pack(Cmd.PING, 1, 0), pack(Cmd.HELLO, 1, 1, 0), pack(Cmd.HELLO, 1, 1, 0, "c", True, b"k", b"p", b"e", "x"),
    pack(Cmd.ALLOC_BUFFER, 1, 3), pack(Cmd.GET_TENSOR, 1), pack(Cmd.COPY_TENSOR, 1, wire(ref())),
])
def test_wrong_field_count(header: bytes) -> None:
    exc = bad([header], match=r"takes \d+( to \d+)? fields, got \d+")
    assert exc.req_id == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("fields,field", [
    ((3, "8"), "size"), (("3", 8), "handle"), ((True, 8), "handle"), ((3, False), "size"),
    ((3, 8.0), "size"), ((3.0, 8), "handle"), ((None, 8), "handle"), ((3, [8]), "size"),
    ((3, b"\x08"), "size"),
])
def test_wrong_field_types(fields: tuple[Any, Any], field: str) -> None:
    bad([pack(Cmd.ALLOC_BUFFER, 1, *fields)], match=f"field '{field}': expected an integer")


@pytest.mark.parametrize("fields", [
    (1, 0, 7), (1, 0, None), (1.0, 0, "c"), (True, 0, "c"), (1, 0, "x" * (p.MAX_STRING + 1)),
    (-1, 0, "c"), (2**32, 0, "c"),
])
def test_hello_field_checks(fields: tuple[Any, ...]) -> None:
    bad([pack(Cmd.HELLO, 1, *fields)], match="field")


@pytest.mark.parametrize("handle,size", [(-1, 8), (2**63, 8), (2**64 - 1, 8), (1, -1),
                                         (1, 2**63), (1, 2**64 - 1), (-(2**63), 8)])
def test_negative_and_huge_sizes_and_handles(handle: int, size: int) -> None:
    bad([pack(Cmd.ALLOC_BUFFER, 1, handle, size)], match=r"outside \[0, ")


@pytest.mark.parametrize("value", [-1, 256, True])
def test_byte_values(value: Any) -> None:
    bad([pack(Cmd.CLEAR_BUFFER, 1, 1, value)], match="field 'value'")


def tensor_header(*, buffer: Any = 1, dtype: Any = 0, shape: Any = (2,), strides: Any = (4,),
                  offset: Any = 0, cmd: Cmd = Cmd.GET_TENSOR) -> bytes:
    return pack(cmd, 1, [buffer, dtype, list(shape) if isinstance(shape, tuple) else shape,
                         list(strides) if isinstance(strides, tuple) else strides, offset])


@pytest.mark.parametrize("dtype", [13, -1, 255, 2**64 - 1, "float32", 0.0, True, None])
def test_unknown_dtype(dtype: Any) -> None:
    bad([tensor_header(dtype=dtype)], match="unknown dtype code")


@pytest.mark.parametrize("kw,match", [
    ({"shape": (1,) * 9, "strides": (4,) * 9}, "at most 8 items"),
    ({"shape": (2, 2), "strides": (4,)}, r"rank of shape \(2\) != rank of strides \(1\)"),
    ({"shape": (), "strides": (4,)}, r"rank of shape \(0\) != rank of strides \(1\)"),
    ({"shape": (-1,)}, r"outside \[0, "),
    ({"shape": (2, -3), "strides": (12, 4)}, r"outside \[0, "),
    ({"shape": (p.MAX_DIM + 1,)}, r"outside \[0, "),
    ({"shape": (2**64 - 1,)}, r"outside \[0, "),
    ({"shape": (1 << 40, 1 << 40), "strides": (4, 4)}, "over the limit"),
    ({"shape": (2**32, 2**32), "strides": (0, 0)}, "over the limit"),
    ({"strides": (p.MAX_DIM + 1,)}, r"outside \[-"),
    ({"strides": (-(2**63),)}, r"outside \[-"),
    ({"offset": -1}, "offset"),
    ({"offset": 2**63}, "offset"),
    ({"offset": 2**64 - 1}, "offset"),
    ({"buffer": -1}, "buffer"),
    ({"buffer": 2**64 - 1}, "buffer"),
    ({"shape": (2.0,)}, "expected an integer"),
    ({"shape": (True,)}, "expected an integer"),
    ({"strides": (4.0,)}, "expected an integer"),
    ({"shape": "2"}, "expected a list"),
    ({"offset": 0.0}, "expected an integer"),
])
def test_bad_tensor_fields(kw: dict[str, Any], match: str) -> None:
    bad([tensor_header(**kw)], match=match)


@pytest.mark.parametrize("value", [None, 5, [1, 0, [2], [4]], [1, 0, [2], [4], 0, 0], {"b": 1}])
def test_tensor_is_a_five_item_array(value: Any) -> None:
    bad([pack(Cmd.GET_TENSOR, 1, value)], match=r"\[buffer, dtype, shape, strides, offset\]")


def test_header_over_the_limit() -> None:
    big = pack(Cmd.HELLO, 1, 1, 0, "c") + bytes(p.MAX_HEADER_BYTES)
    bad([big], match=f"over {p.MAX_HEADER_BYTES}")
    ok = pack(Cmd.PING, 1)
    assert len(ok) <= p.MAX_HEADER_BYTES and p.decode_request([ok])[0] is Cmd.PING


def test_header_exactly_at_the_limit_is_parsed() -> None:
    # a bin field padded so the header is exactly MAX_HEADER_BYTES long: size check passes,
    # schema check (a str, not bytes) refuses it
    body = pack(Cmd.HELLO, 1, 1, 0, b"")
    pad = p.MAX_HEADER_BYTES - len(pack(Cmd.HELLO, 1, 1, 0, bytes(1 << 17)))
    header = pack(Cmd.HELLO, 1, 1, 0, bytes((1 << 17) + pad))
    assert len(header) == p.MAX_HEADER_BYTES and len(body) < len(header)
    bad([header], match="field 'client'")


@pytest.mark.parametrize("payloads", [0, 2])
def test_set_tensor_payload_frame_count(payloads: int) -> None:
    header = p.encode_request(Cmd.SET_TENSOR, 1, p.SetTensor(tensor=ref((2,))))
    bad([header, *[bytes(8)] * payloads], match=f"takes 1 payload frame\\(s\\), got {payloads}")


@pytest.mark.parametrize("cmd", [c for c in BASE_COMMANDS if c is not Cmd.SET_TENSOR],
                         ids=lambda c: c.name)
def test_payload_on_a_command_without_one(cmd: Cmd) -> None:
    bad([*frames_of(cmd, 1, REQUEST_EXAMPLES[cmd]), b"x"], match="takes 0 payload")


@pytest.mark.parametrize("size", [0, 23, 25, 48])
def test_payload_size_mismatch(size: int) -> None:
    header = p.encode_request(Cmd.SET_TENSOR, 4, p.SetTensor(tensor=ref((2, 3))))
    exc = bad([header, bytes(size)], ErrorCode.SIZE_MISMATCH,
              match=f"payload of {size} bytes, tensor needs 24")
    assert exc.req_id == 4  # type: ignore[attr-defined]


def test_payload_size_uses_dense_bytes_not_extent() -> None:
    strided = ref((2, 3), (64, -8), dtype=DType.INT16, offset=100)
    header = p.encode_request(Cmd.SET_TENSOR, 1, p.SetTensor(tensor=strided))
    assert p.decode_request([header, bytes(12)])[2] == p.SetTensor(tensor=strided)
    memoryview_frames = [memoryview(header), memoryview(bytes(12))]
    assert p.decode_request(memoryview_frames)[0] is Cmd.SET_TENSOR


def test_no_frames_at_all() -> None:
    bad([], match="frame")


# ------------------------------------------------------------------------ property tests

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
           | st.text(max_size=20) | st.binary(max_size=20))
msgpackable = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=4),
    max_leaves=30)


def decodes_or_bad_request(frames: list[bytes]) -> None:
    try:
        cmd, req_id, msg = p.decode_request(frames)
    except BadRequest as exc:
        assert isinstance(exc.code, ErrorCode) and exc.message
        return
    assert isinstance(cmd, Cmd) and type(req_id) is int and isinstance(msg, p.REQUESTS[cmd])


@PROPERTY
@given(st.binary(max_size=200), st.lists(st.binary(max_size=40), max_size=3))
def test_random_bytes_only_raise_bad_request(header: bytes, payload: list[bytes]) -> None:
    decodes_or_bad_request([header, *payload])


@PROPERTY
@given(msgpackable, st.lists(st.binary(max_size=40), max_size=3))
def test_random_structures_only_raise_bad_request(value: Any, payload: list[bytes]) -> None:
    decodes_or_bad_request([msgpack.packb(value, use_bin_type=True), *payload])


@PROPERTY
@given(st.integers(-2, 24), st.integers(-(2**63), 2**64 - 1), st.lists(msgpackable, max_size=6),
       st.lists(st.binary(max_size=64), max_size=3))
def test_random_fields_only_raise_bad_request(cmd: int, req_id: int, fields: list[Any],
                                              payload: list[bytes]) -> None:
    decodes_or_bad_request([pack(cmd, req_id, *fields), *payload])


@PROPERTY
@given(st.sampled_from(BASE_COMMANDS), st.data())
def test_mutated_valid_headers_only_raise_bad_request(cmd: Cmd, data: st.DataObject) -> None:
    frames = frames_of(cmd, 9, REQUEST_EXAMPLES[cmd])
    header = bytearray(frames[0])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(header) - 1))
        header[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        header = header[:data.draw(st.integers(0, len(header)))]
    decodes_or_bad_request([bytes(header), *frames[1:]])


@PROPERTY
@given(st.sampled_from([Cmd.GET_TENSOR, Cmd.SET_TENSOR]), st.data())
def test_random_tensor_values_only_raise_bad_request(cmd: Cmd, data: st.DataObject) -> None:
    ints = st.integers(-(2**63), 2**64 - 1) | st.integers(-3, 3)
    value = data.draw(st.lists(ints | st.lists(ints, max_size=10) | msgpackable,
                               min_size=4, max_size=6))
    decodes_or_bad_request([pack(cmd, 1, value), *data.draw(st.lists(st.binary(max_size=64),
                                                                      max_size=2))])


@st.composite
def tensor_refs(draw: st.DrawFn) -> TensorRef:
    rank = draw(st.integers(0, p.MAX_RANK))
    small = draw(st.booleans())
    dim = st.integers(0, 5) if small else st.integers(0, p.MAX_DIM)
    shape = tuple(draw(st.lists(dim, min_size=rank, max_size=rank)))
    if np.prod(shape, dtype=object) > p.MAX_DIM:
        shape = tuple(min(d, 2) for d in shape)
    strides = tuple(draw(st.lists(st.integers(-p.MAX_DIM, p.MAX_DIM), min_size=rank,
                                  max_size=rank)))
    return TensorRef(buffer=draw(st.integers(0, p.MAX_HANDLE)), dtype=draw(st.sampled_from(DType)),
                     shape=shape, strides=strides, offset=draw(st.integers(0, p.MAX_HANDLE)))


@PROPERTY
@given(tensor_refs(), st.integers(0, 2**64 - 1))
def test_valid_tensor_refs_round_trip(tensor: TensorRef, req_id: int) -> None:
    assert p.check_tensor(tensor.to_wire(), "t") == tensor
    assert p.decode_request(frames_of(Cmd.GET_TENSOR, req_id, p.GetTensor(tensor=tensor))) == \
        (Cmd.GET_TENSOR, req_id, p.GetTensor(tensor=tensor))
    src = dataclasses.replace(tensor, buffer=0, offset=tensor.offset // 2)
    copy = p.CopyTensor(src=src, dst=tensor)
    assert p.decode_request(frames_of(Cmd.COPY_TENSOR, req_id, copy))[2] == copy


@st.composite
def small_views(draw: st.DrawFn, max_dim: int = 4) -> TensorRef:
    rank = draw(st.integers(0, 3))
    dtype = draw(st.sampled_from([DType.UINT8, DType.FLOAT16, DType.FLOAT32, DType.FLOAT64]))
    shape = tuple(draw(st.lists(st.integers(0, max_dim), min_size=rank, max_size=rank)))
    stride = st.integers(-24, 24) | st.sampled_from([0, dtype.itemsize, -dtype.itemsize])
    if draw(st.booleans()):
        strides = p.contiguous_strides(shape, dtype.itemsize)
    else:
        strides = tuple(draw(st.lists(stride, min_size=rank, max_size=rank)))
    return TensorRef(buffer=1, dtype=dtype, shape=shape, strides=strides,
                     offset=draw(st.integers(0, 200)))


def element_offsets(tensor: TensorRef) -> list[int]:
    """Every element's first byte, in C order (brute force)."""
    return [tensor.offset + sum(i * s for i, s in zip(index, tensor.strides))
            for index in itertools.product(*(range(d) for d in tensor.shape))]


@PROPERTY
@given(small_views())
def test_byte_extent_matches_brute_force(tensor: TensorRef) -> None:
    starts = element_offsets(tensor)
    expected = ((min(starts), max(starts) + tensor.dtype.itemsize) if starts
                else (tensor.offset, tensor.offset))
    assert tensor.byte_extent() == expected


def test_byte_extent_examples() -> None:
    assert ref((2, 3), (-12, 4), offset=12).byte_extent() == (0, 24)  # rows reversed
    assert ref((5,), (0,), offset=8).byte_extent() == (8, 12)  # broadcast
    assert ref((0, 7), (4, 4), offset=3).byte_extent() == (3, 3)  # empty
    assert ref((), (), dtype=DType.FLOAT64, offset=1).byte_extent() == (1, 9)  # scalar


def view_bytes(data: np.ndarray, tensor: TensorRef) -> bytes:
    """The view's elements in C order, read with as_strided from a byte array."""
    if tensor.numel == 0:
        return b""
    size = tensor.dtype.itemsize
    elements = np.lib.stride_tricks.as_strided(
        data[tensor.offset:], shape=(*tensor.shape, size), strides=(*tensor.strides, 1),
        writeable=False)
    return elements.tobytes()


@PROPERTY
@given(small_views(max_dim=5), st.integers(0, 80))
def test_split_tensor_tiles_the_view(tensor: TensorRef, limit: int) -> None:
    lo, hi = tensor.byte_extent()
    if lo < 0:
        tensor = dataclasses.replace(tensor, offset=tensor.offset - lo)
        lo, hi = tensor.byte_extent()
    data = (np.arange(hi + 8) * 7 % 251).astype(np.uint8)
    whole = view_bytes(data, tensor)
    assert len(whole) == tensor.nbytes

    pieces = p.split_tensor(tensor, limit)
    position = 0
    for start, piece in pieces:
        assert start == position, "pieces must tile the data in order, without gaps"
        assert (piece.buffer, piece.dtype) == (tensor.buffer, tensor.dtype)
        assert piece.nbytes <= max(limit, tensor.dtype.itemsize) or len(pieces) == 1
        plo, phi = piece.byte_extent()
        assert lo <= plo and phi <= hi or piece.numel == 0
        assert view_bytes(data, piece) == whole[start:start + piece.nbytes]
        position += piece.nbytes
    assert position == tensor.nbytes


def test_split_tensor_examples() -> None:
    flat = ref((10,), dtype=DType.FLOAT32, offset=8)
    assert [(s, t.shape, t.offset) for s, t in p.split_tensor(flat, 16)] == \
        [(0, (4,), 8), (16, (4,), 24), (32, (2,), 40)]
    assert p.split_tensor(flat, 40) == [(0, flat)]
    rows = ref((4, 3), (24, 4))  # every other row of a float32[8, 3]
    assert [(s, t.shape, t.offset) for s, t in p.split_tensor(rows, 24)] == \
        [(0, (2, 3), 0), (24, (2, 3), 48)]


# ------------------------------------------------------------------------ GRAPH_RUN_LINKED


def linked(receive: Any = (), send: Any = (), **fields: Any) -> Any:
    from zmq_rpc.broker import graph as wire_graph
    values = dict(handle=3, inputs=[ref((2,), buffer=1)], fetch=[], receive=receive, send=send,
                  timeout_ms=1000)
    return wire_graph.GraphRunLinked(**{**values, **fields})


def test_golden_graph_run_linked() -> None:
    from zmq_rpc.broker import peer
    msg = linked(receive=(peer.Receive(b"r" * 16, ref((2,), buffer=4)),),
                 send=(peer.Send(b"s" * 16, ref((2,), buffer=5), "tcp://h:1"),))
    header = p.encode_request(Cmd.GRAPH_RUN_LINKED, 9, msg)
    # [21, 9, 3, [[1, 0, [2], [4], 0]], [], [[b"r"*16, [4, ...]]], [[b"s"*16, [5, ...], ep]], 1000]
    assert header.hex() == (
        "981509039195010091029104009091" "92c410" + "72" * 16 + "9504009102910400"
        + "91" "93c410" + "73" * 16 + "9505009102910400" + "a9" + b"tcp://h:1".hex() + "cd03e8")
    assert p.decode_request([header, bytes(8)]) == (Cmd.GRAPH_RUN_LINKED, 9, msg)


@pytest.mark.parametrize("receive, send, match", [
    ([[b"t" * 16]], [], "array of 2"),
    ([[b"t" * 15, wire(ref())]], [], "16 bytes"),
    ([[b"t" * 16, wire(ref())], [b"t" * 16, wire(ref())]], [], "appears twice"),
    ([], [[b"t" * 16, wire(ref())]], "array of 3"),
    ([], [[b"t" * 16, wire(ref()), 5]], "string"),
    ([], [[b"t" * 16, wire(ref()), "e"]] * 257, "at most 256"),
    ("nope", [], "at most 256"),
], ids=["receive-arity", "short-token", "twice", "send-arity", "endpoint", "too-many", "not-list"])
def test_graph_run_linked_is_validated(receive: Any, send: Any, match: str) -> None:
    header = pack(Cmd.GRAPH_RUN_LINKED, 4, 3, [], [], receive, send, 1000)
    bad([header], match=match)


def test_graph_run_linked_timeout_is_bounded() -> None:
    bad([pack(Cmd.GRAPH_RUN_LINKED, 4, 3, [], [], [], [], 0)], match="timeout_ms")


def test_golden_graph_run_linked_hold_reply() -> None:
    """1.2's trailing field: on the wire only when set; a 1.1 message decodes with 0."""
    held = linked(hold_reply_us=800)
    header = p.encode_request(Cmd.GRAPH_RUN_LINKED, 9, held)
    # [21, 9, 3, [[1, 0, [2], [4], 0]], [], [], [], 1000, 800]
    assert header.hex() == "99150903919501009102910400909090" "cd03e8" "cd0320"
    assert p.decode_request([header, bytes(8)]) == (Cmd.GRAPH_RUN_LINKED, 9, held)
    old = p.encode_request(Cmd.GRAPH_RUN_LINKED, 9, linked())
    assert old == b"\x98" + header[1:-3]
    assert p.decode_request([old, bytes(8)])[2].hold_reply_us == 0


@pytest.mark.parametrize("value", [-1, 1_000_001, 1.5, "1"])
def test_graph_run_linked_hold_reply_is_checked(value: Any) -> None:
    bad([pack(Cmd.GRAPH_RUN_LINKED, 4, 3, [], [], [], [], 1000, value)], match="hold_reply_us")
    bad([pack(Cmd.GRAPH_RUN_LINKED, 4, 3, [], [], [], [], 1000, 0, [], 0, 0)],
        match="6 to 9 fields")


def test_graph_run_linked_receive_from_is_checked_and_off_the_wire_when_empty() -> None:
    bad([pack(Cmd.GRAPH_RUN_LINKED, 4, 3, [], [], [], [], 1000, 0, [7])], match="receive_from")
    bad([pack(Cmd.GRAPH_RUN_LINKED, 4, 3, [], [], [], [], 1000, 0, "tcp://x")],
        match="receive_from")
    msg = g.GraphRunLinked(handle=3, inputs=[], fetch=[], receive=(), send=(), timeout_ms=1000)
    assert len(p.unpack_header(p.encode_request(Cmd.GRAPH_RUN_LINKED, 4, msg))) == 8
    watched = dataclasses.replace(msg, receive_from=("tcp://10.0.0.1:5",))
    decoded = p.decode_request([p.encode_request(Cmd.GRAPH_RUN_LINKED, 4, watched)])[2]
    assert isinstance(decoded, g.GraphRunLinked)
    assert decoded.receive_from == ("tcp://10.0.0.1:5",)


def test_golden_kept_runs() -> None:
    """1.15: ``keep`` is GRAPH_RUN_LINKED's last field, on the wire only when >= 0 (a 1.14
    worker decodes the runs that do not ask); GRAPH_RUN_KEPT is [26, id, kept, tokens, sizes]
    and its payload frames."""
    from zmq_rpc.broker import peer
    plain = linked()
    kept = dataclasses.replace(plain, keep=7)
    # [21, 9, 3, [[1, 0, [2], [4], 0]], [], [], [], 1000, 0, [], 7]
    header = p.encode_request(Cmd.GRAPH_RUN_LINKED, 9, kept)
    assert header.hex() == "9b150903919501009102910400909090" "cd03e8" "00" "90" "07"
    assert p.decode_request([header, bytes(8)]) == (Cmd.GRAPH_RUN_LINKED, 9, kept)
    assert p.encode_request(Cmd.GRAPH_RUN_LINKED, 9, plain) == b"\x98" + header[1:-3]
    again = g.GraphRunKept(kept=7, tokens=(b"r" * 16,), sizes=[8])
    header = p.encode_request(Cmd.GRAPH_RUN_KEPT, 10, again)
    assert header.hex() == "951a0a0791c410" + "72" * 16 + "9108"
    assert p.decode_request([header, bytes(8)]) == (Cmd.GRAPH_RUN_KEPT, 10, again)
    repeated = again.repeat(dataclasses.replace(
        kept, receive=(peer.Receive(b"o" * 16, ref((2,), buffer=4)),)))
    assert repeated.receive == (peer.Receive(b"r" * 16, ref((2,), buffer=4)),)
    assert repeated.keep == -1 and repeated.inputs == plain.inputs


@pytest.mark.parametrize("fields, frames, match", [
    ([256, [], []], 0, "kept"),
    ([-1, [], []], 0, "kept"),
    ([0, [b"t" * 15], []], 0, "16 bytes"),
    ([0, [b"t" * 16, b"t" * 16], []], 0, "appears twice"),
    ([0, [], [4]], 0, "takes 1 payload frame"),
    ([0, [], [4]], 1, "payload of 3 bytes"),
], ids=["id-high", "id-low", "short-token", "twice", "frames", "size"])
def test_graph_run_kept_is_validated(fields: list[Any], frames: int, match: str) -> None:
    code = ErrorCode.SIZE_MISMATCH if frames else ErrorCode.BAD_REQUEST
    bad([pack(Cmd.GRAPH_RUN_KEPT, 4, *fields), *[bytes(3)] * frames], code, match=match)


def test_a_kept_run_names_few_tensors() -> None:
    """What a session makes its worker keep stays small: at most 16 tensors per kept run
    (a run that is not kept may name up to 256 of each kind)."""
    many = [wire(ref((2,), buffer=1))] * 17
    bad([pack(Cmd.GRAPH_RUN_LINKED, 4, 3, many, [], [], [], 1000, 0, [], 0)],
        match="a kept run names at most 16 tensors, not 17")
    header = pack(Cmd.GRAPH_RUN_LINKED, 4, 3, many, [], [], [], 1000)
    assert p.decode_request([header, *[bytes(8)] * 17])[0] is Cmd.GRAPH_RUN_LINKED


def test_fields_added_by_a_later_minor_come_last_with_a_default() -> None:
    with pytest.raises(TypeError, match="needs a default"):
        p._f(p.check_u32, since=(1, 9))

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class Misordered(p.Message):
        added: int = p._f(p.check_u32, since=(1, 9), default=0)
        old: int = p._f(p.check_u32)

    with pytest.raises(TypeError, match="must come last"):
        p.wire_message(Misordered)


# ---------------------------------------------------------------------------- module imports


FIRST_IMPORTS = """
import os, sys
sys.dont_write_bytecode = False    # into PYTHONPYCACHEPREFIX: compiled once, not in every child
for dep in sys.argv[1].split():    # third-party only: no zmq_rpc module is imported before a fork
    try:
        __import__(dep)
    except ImportError:
        pass
for name in sys.argv[2:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            __import__(name)
            os._exit(0)
        except BaseException as exc:
            os.write(w, f"{type(exc).__name__}: {exc}".encode()[:2000])
            os._exit(1)
    os.close(w)
    error = os.read(r, 4096).decode()
    os.close(r)
    if os.waitpid(pid, 0)[1]:
        print(name, "|", error or "died", flush=True)
"""
THIRD_PARTY = ("numpy zmq msgpack numba llvmlite nacl.bindings nacl.public blake3 tqdm jinja2 "
               "starlette uvicorn prometheus_client gguf tokenizers httpx")
"""What the package's modules import from outside it: loaded once before the forks, so each
child pays only for the package's own modules."""


@pytest.mark.timeout(300)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_every_module_imports_first_in_a_fresh_interpreter(tmp_path: Path) -> None:
    """Whichever module a program imports first must work (``import zmq_rpc.broker.peer``
    first used to fail when the protocol modules imported each other). One interpreter that has
    imported no module of the package forks a child per module, which imports it first.
    The children share a bytecode cache of their own (PYTHONDONTWRITEBYTECODE, as CI's
    environment sets it, made each child compile every module it imported from source: the
    test cost 43-48 s, not 17)."""
    import pkgutil
    import subprocess
    import sys

    import zmq_rpc.broker
    import zmq_rpc.client
    import zmq_rpc.tools
    import zmq_rpc.worker

    names = [m.name for package in (zmq_rpc.broker, zmq_rpc.worker, zmq_rpc.client, zmq_rpc.tools)
             for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
             if not m.name.endswith("cupy_backend")]        # needs the optional extra
    assert "zmq_rpc.broker.peer" in names and len(names) > 20
    done = subprocess.run([sys.executable, "-c", FIRST_IMPORTS, THIRD_PARTY, *names],
                          capture_output=True, text=True, timeout=280,
                          env={**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == ""


# ------------------------------------------------------------------------- peer link messages


def test_golden_peer_messages() -> None:
    """Peer frames are messages like the others, behind a version and a kind."""
    from zmq_rpc.broker import peer
    chunk = peer.Chunk(b"c" * 16, 1, 2, 64, 128, "tcp://h:1")
    header = peer.encode_peer(chunk)
    assert header.hex() == ("9801" "01" "c410" + "63" * 16 + "010240cc80" "a9"
                            + b"tcp://h:1".hex())
    assert peer.decode_peer([header, b"x" * 64]) == chunk
    ack = peer.Ack(b"a" * 16, False, "no")
    assert peer.encode_peer(ack).hex() == "9501" "02" "c410" + "61" * 16 + "c2" "a26e6f"
    assert peer.decode_peer([peer.encode_peer(ack)]) == ack
    probe = peer.Probe(b"p" * 16, "tcp://h:2")
    assert peer.decode_peer([peer.encode_peer(probe)]) == probe


@pytest.mark.parametrize("head, match", [
    ([2, 1], "version 2"), ([1, 9], "kind 9"), ([1], r"\[version, kind"),
    ([[[[1]]], 1], r"\[version, kind"), ([1, 2, b"t" * 16, 1, "x"], "boolean"),
])
def test_peer_messages_are_validated(head: list[Any], match: str) -> None:
    from zmq_rpc.broker import peer
    with pytest.raises(BadRequest, match=match):
        peer.decode_peer([msgpack.packb(head)])


def test_an_oversize_peer_header_is_refused_before_it_is_decoded() -> None:
    """The peer port takes 4 MiB frames: a header of nested empty arrays that size took the
    backend thread seconds to decode before its fields were refused."""
    from zmq_rpc.broker import peer
    bomb = b"\x91" * (4 << 20) + b"\x90"
    with pytest.raises(BadRequest, match="peer header of 4194305 bytes is over"):
        peer.decode_peer([bomb])
    wide = msgpack.packb([1, 1, *([0] * (peer.MAX_PEER_FIELDS + 1))])
    with pytest.raises(BadRequest, match="not msgpack"):
        peer.decode_peer([wide])


def test_the_broker_modules_import_without_cycles() -> None:
    """wire is the leaf; ops, graph and peer build on it; protocol imports them, never back."""
    import ast
    import pathlib

    import zmq_rpc.broker.protocol as protocol_module
    folder = pathlib.Path(protocol_module.__file__).parent
    imports: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        imports[path.stem] = {name for node in ast.walk(tree)
                              if isinstance(node, ast.ImportFrom) and node.level == 1
                              for name in ([node.module] if node.module
                                           else [a.name for a in node.names])}
    assert imports["wire"] <= {"errors"}
    for leafward in ("ops", "graph", "peer", "quant"):
        assert "protocol" not in imports.get(leafward, set()), leafward


def test_golden_status() -> None:
    """1.5's STATUS: an empty request; the reply's fields in order."""
    assert p.encode_request(Cmd.STATUS, 4, p.Empty()).hex() == "921904"
    reply = p.StatusReply(
        server="w", version="0.1.0", uptime_ms=1500,
        devices=(p.Device(name="cpu", kind="cpu", total_memory=100, free_memory=60),),
        memory_used=40, memory_limit=100, sessions=1, queue_depth=2, buffers=3, graphs=1,
        transfers_in_progress=0, capabilities=("status",), peer_endpoint="tcp://p:1",
        session_list=(p.SessionInfo(sid=7, client="c", client_id="0a0b0c0d", memory=40,
                                    buffers=3, graphs=1, queued=2, idle_ms=5),))
    header = p.encode_reply(4, reply)
    # [0, 4, "w", "0.1.0", 1500, [["cpu", "cpu", 100, 60]], 40, 100, 1, 2, 3, 1, 0,
    #  ["status"], "tcp://p:1", [[7, "c", "0a0b0c0d", 40, 3, 1, 2, 5]]]
    assert header.hex() == ("dc0010" "0004" "a177" "a5302e312e30" "cd05dc"
                            "9194a3637075a36370756" "43c" "2864010203010091a6737461747573"
                            "a97463703a2f2f703a31" "919807a163a8306130623063306428" "03010205")
    assert p.decode_reply(Cmd.STATUS, p.unpack_header(header)) == reply


@pytest.mark.parametrize("sessions", [[[1, "c", "x", 0, 0, 0, 0]], [[1, 2, "x", 0, 0, 0, 0, 0]],
                                      [[-1, "c", "x", 0, 0, 0, 0, 0]], [[0] * 8] * 257])
def test_status_reply_sessions_are_checked(sessions: list[Any]) -> None:
    fields = ["w", "v", 0, [], 0, 0, 0, 0, 0, 0, 0, [], "", sessions]
    with pytest.raises(BadRequest):
        p.StatusReply.from_fields(fields)


def test_golden_timing() -> None:
    """1.4: HELLO asks with a trailing true; replies carry [queued_ns, run_ns] last, only when
    set: an Ack without it is the old empty reply, byte for byte."""
    asked = p.encode_request(Cmd.HELLO, 1, p.Hello(major=1, minor=4, client="golden", timing=True))
    assert asked.hex() == "9601010104a6676f6c64656e" "c3"
    plain = p.encode_request(Cmd.HELLO, 1, p.Hello(major=1, minor=4, client="golden"))
    assert asked[1:-1] == plain[1:] and p.decode_request([plain])[2].timing is False
    assert p.encode_reply(5, p.Ack()).hex() == "920005"
    timed = p.encode_reply(5, p.Ack(timing=(1000, 70000)))
    assert timed.hex() == "930005" "92cd03e8ce00011170"
    assert p.decode_reply(Cmd.PING, p.unpack_header(timed)) == p.Ack(timing=(1000, 70000))
    from zmq_rpc.broker.graph import GraphReply
    run = p.encode_reply(6, GraphReply(sizes=[4], compute_ns=9, timing=(1, 2)))
    assert run.hex() == "950006" "9104" "09" "920102"
    assert p.decode_reply(Cmd.GRAPH_RUN, p.unpack_header(run)).timing == (1, 2)


def test_golden_draining() -> None:
    """1.14: a draining worker's Ack and graph-run replies end with a true (an empty timing
    before it when not timed); without it they are the 1.13 bytes."""
    from zmq_rpc.broker.graph import GraphReply
    leaving = p.encode_reply(5, p.Ack(draining=True))
    assert leaving.hex() == "940005" "90" "c3"
    assert p.encode_reply(5, p.Ack(draining=False)).hex() == "920005"
    assert p.decode_reply(Cmd.PING, p.unpack_header(leaving)) == p.Ack(draining=True)
    run = p.encode_reply(6, GraphReply(sizes=[4], compute_ns=9, timing=(1, 2), draining=True))
    assert run.hex() == "960006" "9104" "09" "920102" "c3"
    assert p.decode_reply(Cmd.GRAPH_RUN, p.unpack_header(run)).draining is True
    with pytest.raises(BadRequest, match="draining"):
        p.decode_reply(Cmd.PING, [0, 1, [], 1])


@pytest.mark.parametrize("timing", [[1], [1, 2, 3], [-1, 0], [0.5, 1], "ab"])
def test_reply_timing_is_checked(timing: Any) -> None:
    with pytest.raises(BadRequest, match="timing"):
        p.decode_reply(Cmd.PING, [0, 1, timing])


def test_hello_timing_must_be_a_bool() -> None:
    bad([pack(Cmd.HELLO, 1, 1, 4, "c", 1)], match="timing")
# ------------------------------------------------------------------ 1.4: files and the cache


U8 = ref((8,), dtype=DType.UINT8, buffer=1)


def test_golden_file_and_cache_commands() -> None:
    from zmq_rpc.broker import files as f
    assert p.encode_request(Cmd.FILE_QUERY, 3, f.FileQuery(path="m.gguf")).hex() == \
        "931603a66d2e67677566"
    read = f.ReadFile(path="m.gguf", digest=bytes(range(32)), reads=(
        f.FileRead("w", "Q8_0", (32, 1), 0, 8, U8), f.FileRead("", "", (), 16, 8, U8)))
    # [23, 4, "m.gguf", digest, [["w", "Q8_0", [32, 1], 0, 8, U8], ["", "", [], 16, 8, U8]]]
    assert p.encode_request(Cmd.READ_FILE, 4, read).hex() == (
        "951704a66d2e67677566c420" + bytes(range(32)).hex() +
        "9296a177a451385f309220010008950105910891010096a0a09010089501059108910100")
    assert p.decode_request([p.encode_request(Cmd.READ_FILE, 4, read)]) == \
        (Cmd.READ_FILE, 4, read)
    fill = f.SetFromCache(tensor=U8, key=bytes(32))
    assert p.encode_request(Cmd.SET_FROM_CACHE, 5, fill).hex() == \
        "9418059501059108910100c420" + "00" * 32
    assert p.encode_reply(7, f.CacheReply(hit=True, note="hit")).hex() == "940007c3a3686974"
    assert p.encode_reply(8, f.FileQueryReply(found=False, reason="no", size=0, format="",
                                              digest=b"")).hex() == "970008c2a26e6f00a0c400"
    assert p.decode_reply(Cmd.SET_FROM_CACHE, p.unpack_header(bytes.fromhex(
        "940007c3a3686974"))) == f.CacheReply(hit=True, note="hit")


def test_golden_set_tensor_cache_key_is_off_the_wire_when_empty() -> None:
    keyed = p.SetTensor(tensor=U8, cache_key=b"\x01" * 32)
    header = p.encode_request(Cmd.SET_TENSOR, 6, keyed)
    assert header.hex() == "9408069501059108910100c420" + "01" * 32
    plain = p.encode_request(Cmd.SET_TENSOR, 6, p.SetTensor(tensor=U8))
    assert plain == b"\x93" + header[1:-34]                    # what a 1.2 peer sends and reads
    assert p.decode_request([header, bytes(8)])[2] == keyed
    assert p.decode_request([plain, bytes(8)])[2].cache_key == b""


@pytest.mark.parametrize("header, match", [
    (pack(Cmd.SET_TENSOR, 1, wire(U8), b"short"), "cache_key"),
    (pack(Cmd.SET_FROM_CACHE, 1, wire(U8), b"k" * 31), "32 bytes"),
    (pack(Cmd.READ_FILE, 1, "m", b"d" * 32, []), f"1 to {MAX_READS} reads"),
    (pack(Cmd.READ_FILE, 1, "m", b"d" * 32, [["w", "F32", [2], 0, 8]]), "a read is"),
    (pack(Cmd.READ_FILE, 1, "m", b"d" * 32, [["w", "F32", [2], 0, 7, wire(U8)]]),
     "exactly 7 bytes"),
    (pack(Cmd.READ_FILE, 1, "m", b"d" * 32, [["w", "F32", [-2], 0, 8, wire(U8)]]), "shape"),
    (pack(Cmd.READ_FILE, 1, "m", b"d" * 32, [["w", "F" * 33, [2], 0, 8, wire(U8)]]), "kind"),
    (pack(Cmd.READ_FILE, 1, "m", b"d" * 32,
          [["", "", [], 0, 8, wire(ref((2, 2), (8, 2), dtype=DType.UINT16, buffer=1))]]),
     "contiguous"),
    (pack(Cmd.FILE_QUERY, 1, 5), "path"),
])
def test_file_and_cache_requests_are_validated(header: bytes, match: str) -> None:
    payload = [bytes(8)] if header[1] == Cmd.SET_TENSOR else []
    bad([header, *payload], match=match)


def test_golden_peer_send_unacked() -> None:
    """1.4's trailing PEER_SEND field: on the wire only when false."""
    from zmq_rpc.broker import peer
    unacked = peer.PeerSend(token=b"t" * 16, src=U8, endpoint="tcp://h:1", timeout_ms=1000,
                            acked=False)
    header = p.encode_request(Cmd.PEER_SEND, 2, unacked)
    assert header.hex() == ("971102c410" + "74" * 16 + "9501059108910100a9" +
                            b"tcp://h:1".hex() + "cd03e8c2")
    acked = p.encode_request(Cmd.PEER_SEND, 2, peer.PeerSend(
        token=b"t" * 16, src=U8, endpoint="tcp://h:1", timeout_ms=1000))
    assert acked == b"\x96" + header[1:-1]
    assert p.decode_request([header])[2] == unacked
    assert p.decode_request([acked])[2].acked is True


# ------------------------------------------------------------------ 1.6: device details


HELLO_16 = p.HelloReply(
    major=1, minor=6, server="w", alignment=256, max_buffer_size=10,
    devices=(p.Device(name="H200", kind="cuda", total_memory=10, free_memory=10),),
    max_message_size=20, session_timeout_ms=30, capabilities=("views",), peer_endpoint="")


def test_golden_hello_reply_device_details_are_last_and_off_the_wire_when_empty() -> None:
    plain = p.encode_reply(1, HELLO_16)
    # [0, 1, 1, 6, "w", [["H200", "cuda", 10, 10]], 256, 10, 20, 30, ["views"], ""]
    assert plain.hex() == ("9c" "0001" "0106" "a177" "9194a448323030a463756461" "0a0a"
                           "cd0100" "0a141e" "91a5766965777" "3" "a0")
    detailed = p.encode_reply(1, dataclasses.replace(HELLO_16, device_details=(
        p.DeviceDetail(index=1, memory=150 << 30, compute_capability="9.0"),)))
    # ..., "", [] (timing, at its default but before a later field), [[1, 150 GiB, "9.0"]]
    assert detailed.hex() == plain.hex().replace("9c", "9e", 1) + "90" "9193" "01cf0000002580000000" "a3392e30"
    decoded = p.decode_reply(Cmd.HELLO, p.unpack_header(detailed))
    assert decoded.device_details == (p.DeviceDetail(index=1, memory=150 << 30, compute_capability="9.0"),)
    assert p.decode_reply(Cmd.HELLO, p.unpack_header(plain)).device_details == ()


def test_golden_status_device_details() -> None:
    reply = p.StatusReply(
        server="w", version="v", uptime_ms=0, devices=(), memory_used=0, memory_limit=0,
        sessions=0, queue_depth=0, buffers=0, graphs=0, transfers_in_progress=0,
        capabilities=(), peer_endpoint="", session_list=(),
        device_details=(p.DeviceDetail(index=0, memory=64, compute_capability=""),))
    header = p.encode_reply(2, reply)
    assert header.hex() == "dc0012" "0002" "a177" "a176" "00" "90" "00000000000000" "90" "a0" "90" "90" "919300" "40" "a0"
    assert p.decode_reply(Cmd.STATUS, p.unpack_header(header)) == reply


@pytest.mark.parametrize("details", [[[0, 1]], [[0, 1, "x", 2]], [[-1, 1, ""]], [[0, 1, 2]], "x"])
def test_device_details_are_checked(details: Any) -> None:
    fields = [1, 6, "w", [], 0, 0, 0, 0, [], "", [], details]
    with pytest.raises(BadRequest, match="device_details"):
        p.HelloReply.from_fields(fields)
