"""Chat prompts from a GGUF's ``tokenizer.chat_template``, rendered with jinja2.

This module owns turning chat messages into the prompt text a model was trained on. The
template is the model's own (the GGUF's ``tokenizer.chat_template``, copied from its Hugging Face
``tokenizer_config.json``) and is rendered the way ``transformers`` and llama.cpp's jinja path
do: a sandboxed environment (the template is data from a downloaded file: no attribute access to
Python internals), ``trim_blocks`` and ``lstrip_blocks``, the globals ``raise_exception`` and
``strftime_now``, and the variables ``messages``, ``add_generation_prompt``, ``bos_token`` and
``eos_token``. A file without a template gets the format its vocabulary's turn markers name
(:func:`fallback_template`: Gemma's, Llama 3's, Phi-3's), else ChatML (:data:`CHATML_TEMPLATE`):
each renders as llama.cpp's built-in format of that name (``llama_chat_apply_template``).

Nothing here starts threads; a :class:`ChatTemplate` is immutable and may be shared.
"""

from __future__ import annotations

import json
from collections.abc import Container, Mapping, Sequence
from datetime import datetime
from typing import Any, Final, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["CHATML_TEMPLATE", "FALLBACK_TEMPLATES", "ChatTemplate", "fallback_template"]

CHATML_TEMPLATE: Final = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The fallback for a GGUF without ``tokenizer.chat_template`` whose vocabulary names no other
format (no default system prompt)."""

GEMMA_TEMPLATE: Final = (
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set ns.system = ns.system + (message['content'] | trim) + '\n\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\n' + ns.system + (message['content'] | trim) + '<end_of_turn>\n' }}"
    "{% set ns.system = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
"""llama.cpp's ``gemma`` format: a system message opens the next turn, the assistant is
``model``."""

LLAMA3_TEMPLATE: Final = (
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + (message['content'] | trim) + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
"""llama.cpp's ``llama3`` format."""

PHI3_TEMPLATE: Final = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
"""llama.cpp's ``phi3`` format."""

FALLBACK_TEMPLATES: Final[tuple[tuple[str, tuple[str, ...], str], ...]] = (
    ("gemma", ("<start_of_turn>", "<end_of_turn>"), GEMMA_TEMPLATE),
    ("llama3", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), LLAMA3_TEMPLATE),
    ("phi3", ("<|user|>", "<|assistant|>", "<|end|>"), PHI3_TEMPLATE),
    ("chatml", ("<|im_start|>", "<|im_end|>"), CHATML_TEMPLATE),
)
"""(llama.cpp's name for the format, the tokens that mark its turns, the template), in the order
they are tried."""


def fallback_template(vocabulary: Container[str]) -> tuple[str, str]:
    """The format for a GGUF without a chat template: the first of :data:`FALLBACK_TEMPLATES`
    whose turn markers are all tokens of ``vocabulary``, else ChatML; ``(name, template)``.
    Rendering ChatML for a Gemma vocabulary would spell ``<|im_start|>`` out as text, which the
    model was never trained on."""
    for name, markers, source in FALLBACK_TEMPLATES:
        if all(marker in vocabulary for marker in markers):
            return name, source
    return "chatml", CHATML_TEMPLATE


class TemplateRaised(ValueError):
    """The template called ``raise_exception`` (its way to refuse a conversation)."""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None) -> str:
    # transformers' tojson: keeps non-ASCII characters as they are (jinja's escapes them)
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled chat template and the BOS/EOS token texts it may print."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        """Compile ``source``.

        Raises:
            ValueError: ``source`` is not a valid jinja template.
        """
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not parse: {exc}") from exc
        self.source = source
        self._bos, self._eos = bos_token, eos_token

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` (dicts with a str ``role`` and ``content``) as the prompt text.

        Raises:
            TypeError: a message lacks a str ``role`` or ``content``.
            ValueError: the template refused the conversation (its ``raise_exception``) or
                failed while rendering; the message says why.
        """
        for message in messages:
            if not isinstance(message.get("role"), str) or not isinstance(
                message.get("content"), str
            ):
                raise TypeError("each chat message needs a str 'role' and a str 'content'")
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
            )
        except TemplateRaised as exc:
            raise ValueError(f"the chat template refused the conversation: {exc}") from None
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template failed: {exc}") from exc
