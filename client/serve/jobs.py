"""OpenAI request bodies checked into :class:`Job` records, and the API's error shape.

Decoding is validation: a body that is not what the route takes becomes an :class:`APIError`
(400, naming the field), never a half-read request; a prompt that leaves no room in the context
is refused here too (400 ``context_length_exceeded``), before it reaches the engine.

Runs on the event loop (:mod:`.app`); the tokenizer it encodes with is only read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

__all__ = ["APIError", "Job", "Sampling", "chat_prompt", "parse_job"]

Kind = Literal["completion", "chat"]
MAX_STOPS = 4
"""Stop strings a request may give (the OpenAI API's limit)."""
DEFAULT_COMPLETION_TOKENS = 16
"""``max_tokens`` of a completion that gives none (the OpenAI API's default); a chat completion
without it runs until the end of its turn or of the context."""


class ChatTokenizer(Protocol):
    """What the requests need of :class:`zmq_rpc.client.tokenizer.Tokenizer`."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True) -> str: ...


class APIError(Exception):
    """An error answered as the OpenAI API does: ``{"error": {message, type, param, code}}``
    with the HTTP ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str | None, message: str, code: str | None = None) -> APIError:
    """A 400 about ``param``."""
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """How one request picks its tokens."""

    max_tokens: int
    """Tokens to generate at most (the context may end the sequence sooner)."""
    temperature: float = 1.0
    """0: greedy (the argmax)."""
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k cut."""
    seed: int | None = None
    """The request's own RNG seed: the same seed gives the same tokens (None: a fresh one)."""
    stop: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """One checked request: what the engine runs and how the answer is shaped."""

    kind: Kind
    model: str
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False


def parse_job(kind: Kind, body: object, tokenizer: ChatTokenizer, n_ctx: int,
              model: str) -> Job:
    """Check ``body`` (the decoded JSON) of a ``/v1/completions`` (``kind="completion"``) or
    ``/v1/chat/completions`` request; APIError (400) says what is wrong."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    _check_unsupported(body)
    ids = (_completion_prompt(body, tokenizer) if kind == "completion"
           else tokenizer.encode(chat_prompt(tokenizer, _messages(body))))
    if not ids:
        raise bad("prompt", "the prompt is empty")
    if len(ids) >= n_ctx:
        raise bad("messages" if kind == "chat" else "prompt",
                  f"the prompt is {len(ids)} tokens; this model's context is {n_ctx} tokens "
                  "and must leave room for at least one generated token",
                  code="context_length_exceeded")
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, None)
    if options is not None and not stream:
        raise bad("stream_options", "stream_options is only allowed with stream: true")
    return Job(kind=kind, model=_get(body, "model", str, model), prompt_ids=tuple(ids),
               sampling=_sampling(kind, body), stream=stream,
               include_usage=bool(options and _get(options, "include_usage", bool, False)))


def chat_prompt(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, str]]) -> str:
    """The prompt text of a chat: the model's chat template, the one place it is applied."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except (TypeError, ValueError) as exc:
        raise bad("messages", f"cannot apply the chat template: {exc}") from exc


def _check_unsupported(body: Mapping[str, Any]) -> None:
    for name in ("n", "best_of"):
        if body.get(name, 1) not in (1, None):
            raise bad(name, f"only {name}=1 is supported")
    if body.get("echo") or body.get("logprobs") or body.get("tools"):
        field = next(n for n in ("echo", "logprobs", "tools") if body.get(n))
        raise bad(field, f"{field} is not supported")


def _completion_prompt(body: Mapping[str, Any], tokenizer: ChatTokenizer) -> list[int]:
    """``prompt``: a string, a list of one string, or one list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        bad_ids = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
        if bad_ids:
            raise bad("prompt", f"token ids {bad_ids[:5]} are outside the vocabulary of "
                      f"{tokenizer.vocab_size}")
        return list(prompt)
    raise bad("prompt", "prompt must be a string or a list of token ids (one prompt per request)")


def _messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(message: object, index: int) -> dict[str, str]:
    """One message as ``{"role", "content"}`` strings (content parts of type text joined)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad(f"messages[{index}]", "each message needs a string role")
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad(f"messages[{index}].content", "content must be a string or a list of text parts")
    return {"role": message["role"], "content": content}


def _sampling(kind: Kind, body: Mapping[str, Any]) -> Sampling:
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else \
        "max_tokens"
    default = DEFAULT_COMPLETION_TOKENS if kind == "completion" else 1 << 30
    return Sampling(
        max_tokens=_number(body, limit, int, default, low=1),
        temperature=_number(body, "temperature", float, 1.0, low=0.0, high=2.0),
        top_p=_number(body, "top_p", float, 1.0, low=0.0, high=1.0, low_open=True),
        top_k=_number(body, "top_k", int, 0, low=0),
        seed=_get(body, "seed", int, None),
        stop=_stops(body.get("stop")))


def _stops(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)):
        raise bad("stop", f"stop must be a non-empty string or a list of up to {MAX_STOPS}")
    return tuple(stops)


def _get(body: Mapping[str, Any], name: str, kind: type[Any], default: Any) -> Any:
    """``body[name]`` of type ``kind`` (absent or null: ``default``)."""
    value = body.get(name)
    if value is None:
        return default
    if kind is int and (type(value) is not int):
        raise bad(name, f"{name} must be an integer")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise bad(name, f"{name} must be a number")
    if not isinstance(value, kind) and kind is not float:
        raise bad(name, f"{name} must be a {kind.__name__}")
    return float(value) if kind is float else value


def _number(body: Mapping[str, Any], name: str, kind: type[Any], default: Any, *,
            low: float, high: float | None = None, low_open: bool = False) -> Any:
    value = _get(body, name, kind, default)
    if not math.isfinite(value) or value < low or (low_open and value == low) or (high is not None and value > high):
        where = f"{'(' if low_open else '['}{low:g}, {'inf' if high is None else f'{high:g}'}]"
        raise bad(name, f"{name} must be in {where}, got {value}")
    return value
