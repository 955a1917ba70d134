"""The server's request checks and stop strings, without a model: bodies that are not what a route
takes get a 400 naming the field, and a stop string never goes out even in part."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("starlette")
from zmq_rpc.client.serve.jobs import APIError, parse_job  # noqa: E402
from zmq_rpc.client.serve.text import StopText  # noqa: E402


class Words:
    """A tokenizer of one id per character, with a ChatML-like template."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return [min(ord(c), 255) for c in text]

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def job(body: object, kind: str = "completion", n_ctx: int = 64):  # type: ignore[no-untyped-def]
    return parse_job(kind, body, Words(), n_ctx, "m")  # type: ignore[arg-type]


def refused(body: object, kind: str = "completion", n_ctx: int = 64) -> APIError:
    with pytest.raises(APIError) as info:
        job(body, kind, n_ctx)
    assert info.value.status == 400
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}
    return info.value


def test_a_completion_and_a_chat_are_read() -> None:
    done = job({"prompt": "abc", "max_tokens": 5, "temperature": 0, "top_k": 3, "seed": 9,
                "stop": ["x", "yz"], "stream": True, "stream_options": {"include_usage": True}})
    assert done.prompt_ids == (97, 98, 99) and done.stream and done.include_usage
    s = done.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.top_p, s.seed, s.stop) == \
        (5, 0.0, 3, 1.0, 9, ("x", "yz"))
    chat = job({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
               "chat")
    assert chat.prompt_ids == tuple(map(ord, "<user>hi<assistant>"))
    assert job({"prompt": [[1, 2, 3]]}).prompt_ids == (1, 2, 3)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "a", "n": 2}, "n"),
    ({"prompt": "a", "temperature": 2.5}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "temperature": float("nan")}, "temperature"),
    ({"prompt": "a", "top_p": float("inf")}, "top_p"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": "9"}, "max_tokens"),
    ({"prompt": "a", "seed": 1.5}, "seed"),
    ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 256]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_fields_are_named(body: dict[str, object], param: str) -> None:
    assert refused(body).param == param


def test_a_prompt_must_leave_room_in_the_context() -> None:
    assert job({"prompt": "x" * 63}).prompt_ids
    error = refused({"prompt": "x" * 64})
    assert error.code == "context_length_exceeded" and "64 tokens" in error.message
    assert refused({"messages": [{"role": "user", "content": "x" * 64}]}, "chat").param == \
        "messages"
    assert refused({"messages": [{"role": "user"}]}, "chat").param == "messages[0].content"
    assert refused([1, 2]).param is None


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_no_part_of_a_stop_string_goes_out(cut: int) -> None:
    """Whatever the pieces, the output is the text up to the stop string, and no piece sent ends
    with the start of the stop string that is then completed."""
    text = "one two <END> three"
    stop = StopText(["<END>", "zzz"])
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    out = [stop.push(p) for p in pieces]
    assert "".join(out) == "one two " and stop.stopped
    assert all("<" not in piece for piece in out)
    assert stop.flush() == ""


def test_held_text_that_is_no_stop_string_comes_out() -> None:
    stop = StopText(["<END>"])
    assert stop.push("a <E") == "a "
    assert stop.push("ND") == ""         # "<END" may still become "<END>"
    assert stop.push("?") == "<END?" and not stop.stopped
    assert stop.push("<EN") == "" and stop.flush() == "<EN"


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 300) | st.floats(-3, 3)
                    | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
FIELDS = st.sampled_from(["prompt", "messages", "max_tokens", "max_completion_tokens",
                          "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
                          "stream_options", "model", "echo"])


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(FIELDS, JSON, max_size=6) | JSON,
       kind=st.sampled_from(["completion", "chat"]))
def test_any_json_is_a_job_or_a_400(body: object, kind: str) -> None:
    """Decoding is validation: whatever JSON comes, a checked Job or an APIError 400, never
    another exception (which would be a 500)."""
    try:
        done = job(body, kind)
    except APIError as exc:
        assert exc.status == 400
        return
    assert done.prompt_ids and all(0 <= t < Words.vocab_size for t in done.prompt_ids)
    assert 1 <= done.sampling.max_tokens and 0 <= done.sampling.temperature <= 2
