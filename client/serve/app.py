"""The HTTP face: Starlette routes in the OpenAI API's shape, streams as server-sent events.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /health`` (200, or 503 once a worker is lost), ``GET /metrics`` (Prometheus), and
``POST /admin/workers`` ``{"endpoint": "tcp://HOST:PORT"}`` (loopback clients only: 403
otherwise), which connects to that worker and has it take over layers at the model's next step
boundary (:meth:`~.engine.Engine.add_worker`; 202 once queued). A generation
request is checked (:mod:`.jobs`), queued on the :class:`~.engine.Engine` and answered from its
:class:`~.engine.Stream`: as one JSON body, or with ``stream: true`` as ``data: {chunk}`` events
ending with ``data: [DONE]``. The response starts once the request's first token (or its error)
is in, so a request refused by the engine still gets its status code. A client that goes away
cancels its stream, whether it waits in the queue, for a JSON body or on a stream.

Runs on the event loop (uvicorn's); it only reads the tokenizer and calls the engine's
thread-safe methods.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ...broker.errors import BadEndpoint, RpcError
from ..client import Client
from .engine import Engine, Event, Stream
from .jobs import APIError, ChatTokenizer, Job, Kind, bad, parse_job

__all__ = ["build_app"]

T = TypeVar("T")
CREATED = int(time.time())
"""The ``created`` time /v1/models gives the model: when this server started."""
MAX_BODY = 16 << 20
"""Bytes a request body may have: far more than any prompt that fits a context."""


class EventStream(StreamingResponse):
    """Server-sent events whose generator is cancelled as soon as the client goes away (whatever
    ASGI version the server speaks), so its stream is cancelled within one step."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:
            async def respond() -> None:
                await self.stream_response(send)
                group.cancel_scope.cancel()
            group.start_soon(respond)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()


class API:
    """The routes' state: the engine, the tokenizer, the model's name and context."""

    def __init__(self, engine: Engine, tokenizer: ChatTokenizer, model_id: str,
                 connect: Callable[[str], Client] = Client) -> None:
        self.engine, self.tokenizer, self.model_id = engine, tokenizer, model_id
        self.connect = connect
        """Opens the client of a worker added at runtime (the server's request timeout)."""
        self.metrics = engine.metrics

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
                Route("/admin/workers", self.add_worker, methods=["POST"])]

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": CREATED, "owned_by": "zmq-rpc",
             "max_model_len": self.engine.steps.n_ctx}]})

    async def health(self, request: Request) -> Response:
        if self.engine.healthy:
            return JSONResponse({"status": "ok", "slots_in_use": self.engine.slots_in_use(),
                                 "queue_depth": self.engine.scheduler.inbox.qsize()})
        return JSONResponse({"status": "unavailable", "error": self.engine.problem
                             or "the engine is not running"}, status_code=503)

    async def add_worker(self, request: Request) -> Response:
        """``{"endpoint": ...}``: connect to that worker (off the event loop: HELLO blocks) and
        queue it to join the model. Loopback clients only (the HTTP port may face a network;
        this route places weights on a machine of the caller's choosing)."""
        route = "/admin/workers"
        try:
            endpoint = await self._admin_endpoint(request)
            client = await asyncio.to_thread(self.connect, endpoint)
        except APIError as exc:
            return self._error(route, exc)
        except BadEndpoint as exc:
            return self._error(route, APIError(400, str(exc), code="bad_endpoint"))
        except RpcError as exc:
            return self._error(route, APIError(502, f"cannot connect to the worker at "
                                               f"{endpoint}: {exc}", code="worker_unreachable"))
        try:
            self.engine.add_worker(client)
        except ValueError as exc:
            client.close()
            return self._error(route, APIError(409, str(exc), code="worker_refused"))
        self.metrics.answered(route, 202)
        return JSONResponse({"status": "joining", "endpoint": endpoint}, status_code=202)

    async def _admin_endpoint(self, request: Request) -> str:
        host = request.client.host if request.client is not None else ""
        try:
            loopback = ipaddress.ip_address(host.split("%")[0]).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise APIError(403, "/admin/workers answers loopback clients only",
                           code="forbidden")
        body = await _json(request)
        endpoint = body.get("endpoint") if isinstance(body, dict) else None
        if not isinstance(endpoint, str) or not endpoint:
            raise bad("endpoint", 'the body must be {"endpoint": "tcp://HOST:PORT"}')
        return endpoint

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    # ------------------------------------------------------------------------ generation

    async def _generate(self, request: Request, kind: Kind) -> Response:
        route = request.url.path
        try:
            job = parse_job(kind, await _json(request), self.tokenizer,
                            self.engine.steps.n_ctx, self.model_id)
            stream = self.engine.submit(job, asyncio.get_running_loop())
        except APIError as exc:
            return self._error(route, exc)
        except ClientDisconnect:
            return self._gone(route)
        handed_off = False
        try:
            first = await _unless_disconnected(request, stream.get())
            if first is None:
                return self._gone(route)
            if first.error is not None:
                return self._error(route, first.error)
            if job.stream:
                handed_off = True
                self.metrics.answered(route, 200)
                return EventStream(self._events(Answer(job, self.model_id), stream, first))
            return await self._body(request, route, Answer(job, self.model_id), stream, first)
        finally:
            if not handed_off:
                stream.cancel()   # a no-op once the stream has ended

    async def _body(self, request: Request, route: str, answer: Answer, stream: Stream,
                    first: Event) -> Response:
        last = await _unless_disconnected(request, _last(stream, first, answer))
        if last is None:
            return self._gone(route)
        if last.error is not None:
            return self._error(route, last.error)
        self.metrics.answered(route, 200)
        return JSONResponse(answer.whole(last))

    async def _events(self, answer: Answer, stream: Stream, event: Event) -> AsyncIterator[str]:
        try:
            if answer.chat:
                yield _sse(answer.chunk(role=True))
            while True:
                if event.error is not None:
                    yield _sse(event.error.body())
                    break
                if event.text:
                    yield _sse(answer.chunk(text=event.text))
                if event.finish is not None:
                    yield _sse(answer.chunk(finish=event.finish))
                    if answer.job.include_usage:
                        yield _sse(answer.usage_chunk(event.completion_tokens))
                    break
                event = await stream.get()
            yield "data: [DONE]\n\n"
        finally:
            stream.cancel()

    def _gone(self, route: str) -> Response:
        """The client went away: nobody reads this (499 is nginx's "client closed request")."""
        self.metrics.answered(route, 499)
        return Response(status_code=499)

    def _error(self, route: str, exc: APIError) -> Response:
        self.metrics.answered(route, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


class Answer:
    """The OpenAI shapes of one request's answer: a whole body, or its stream's chunks."""

    def __init__(self, job: Job, model_id: str) -> None:
        self.job = job
        self.chat = job.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = job.model or model_id
        self.text: list[str] = []

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = len(self.job.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}

    def whole(self, last: Event) -> dict[str, Any]:
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat
                      else {"text": text})
        return {**self._head(False), "choices": [choice],
                "usage": self.usage(last.completion_tokens)}

    def chunk(self, *, text: str = "", role: bool = False,
              finish: str | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else \
                ({"content": text} if text else {})
            choice["delta"] = delta
        else:
            choice["text"] = text
        out = {**self._head(True), "choices": [choice]}
        return {**out, "usage": None} if self.job.include_usage else out

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": self.usage(completion_tokens)}


async def _last(stream: Stream, event: Event, answer: Answer) -> Event:
    """Read ``stream`` to its end, gathering its text in ``answer``; the last event."""
    while True:
        answer.text.append(event.text)
        if event.finish is not None or event.error is not None:
            return event
        event = await stream.get()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _json(request: Request) -> object:
    """The body's JSON; 413 past :data:`MAX_BODY` bytes (read no further), 400 if not JSON."""
    if int(request.headers.get("content-length") or 0) > MAX_BODY:
        raise _too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise _too_large()
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(None, f"the request body is not valid JSON: {exc}") from None


def _too_large() -> APIError:
    return APIError(413, f"the request body is over {MAX_BODY >> 20} MiB", code="too_large")


async def _unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T | None:
    """``awaitable``'s result, or None (it cancelled) if the client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnect(request.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            task.cancel()
    return work.result() if work.done() and not work.cancelled() else None


async def _disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (the body has been read: nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def build_app(engine: Engine, tokenizer: ChatTokenizer, model_id: str,
              connect: Callable[[str], Client] = Client) -> Starlette:
    """The ASGI application serving ``engine`` (``connect``: how ``/admin/workers`` opens a
    worker's client)."""
    return Starlette(routes=API(engine, tokenizer, model_id, connect).routes())
