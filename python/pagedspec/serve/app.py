"""The OpenAI-compatible HTTP server: ``pagedspec serve --model M [--speculative-model D]``.

    pagedspec serve --model /path/to/checkpoint --port 8000 [--max-waiting 64] [engine flags]
    curl localhost:8000/v1/completions -d '{"prompt": "def fib(n):", "max_tokens": 32}'

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (OpenAI's request and response
shapes, streaming as server-sent events ``data: {json}`` ending with ``data: [DONE]``),
``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text, see
:mod:`pagedspec.serve.metrics`).

The server drives an :class:`~pagedspec.engine.async_engine.AsyncEngine` only: each HTTP request
becomes one engine request per prompt (``n`` is the engine's ``SamplingParams.n``), streamed with
``RequestOutputKind.DELTA`` or collected with ``FINAL_ONLY``. A client that disconnects is
aborted at once (its KV blocks are freed before the next step), streaming or not.

Errors are OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input,
naming the parameter (validation errors included, where FastAPI would say 422), 404 for an
unknown model, 503 when more than ``--max-waiting`` requests queue. A user's input never gets a
500; an engine whose driver thread died answers 500 to everyone (and ``/health`` 503).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys
import time
import uuid
from typing import Any, AsyncIterator, Optional, Sequence, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import StreamingResponse

from pagedspec.serve import protocol as P
from pagedspec.serve.chat import ChatRenderer
from pagedspec.serve.metrics import ServerMetrics
from pagedspec.serve.protocol import RequestError

logger = logging.getLogger("pagedspec.serve")

# SamplingParams field -> the request field a user sets (for engine errors that name the former)
_COMPLETION_PARAMS = {"max_tokens": "max_tokens", "logprobs": "logprobs"}
_CHAT_PARAMS = {"logprobs": "top_logprobs"}


def _engine_classes():
    # imported on use, so that the protocol / chat / metrics modules load without the engine
    from pagedspec.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
    from pagedspec.engine.outputs import RequestOutputKind, SamplingParams
    return AsyncEngine, EngineDeadError, EngineOverloadedError, RequestOutputKind, SamplingParams


class _ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def _wait_for_disconnect(request) -> None:
    """Returns when the client of ``request`` (a Starlette Request whose body was read)
    disconnects, or when its response completed (the ASGI server then answers
    ``http.disconnect`` too)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class OpenAIServer:
    """The request handlers over one AsyncEngine (see :func:`build_app`)."""

    def __init__(self, engine, served_model_name: str):
        (_, self.EngineDeadError, self.EngineOverloadedError, self.OutputKind,
         self.SamplingParams) = _engine_classes()
        self.engine = engine
        core = engine.engine
        self.served_model_name = served_model_name
        self.tokenizer = core.tokenizer
        self.max_model_len = core.max_model_len
        self.model_path = str(core.checkpoint.path)
        self.chat = ChatRenderer.for_engine(core)
        self.created = int(time.time())

    # ---- shared ------------------------------------------------------------------------------
    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.served_model_name:
            raise RequestError(f"The model `{model}` does not exist; this server serves "
                               f"`{self.served_model_name}`.", param="model", status_code=404,
                               code="model_not_found")

    def _token_text(self, token_id: int, entry) -> str:
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _sampling_params(self, body: P._SamplingFields, max_tokens: int,
                         logprobs: Optional[int], streaming: bool):
        top_k = -1 if body.top_k in (None, 0) else body.top_k
        return self.SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=top_k,
            min_p=0.0 if body.min_p is None else body.min_p, max_tokens=max_tokens,
            stop=body.stop_list, stop_token_ids=body.stop_token_ids,
            ignore_eos=bool(body.ignore_eos), seed=body.seed, n=body.n or 1, logprobs=logprobs,
            output_kind=self.OutputKind.DELTA if streaming else self.OutputKind.FINAL_ONLY)

    def _prompt_ids(self, prompt: Union[str, list[int]], param: str) -> list[int]:
        """The token ids the engine will see (text is encoded with the tokenizer's special
        tokens, as the engine and the offline LLM do)."""
        if isinstance(prompt, str):
            try:
                return self.engine.engine.encode(prompt)
            except ValueError:
                raise RequestError("text prompts need a tokenizer, and this server runs without "
                                   "one (--skip-tokenizer-init); send token ids",
                                   param=param) from None
        return list(prompt)

    def _max_tokens(self, num_prompt_tokens: int, requested: Optional[int], param: str,
                    prompt_param: str) -> int:
        """The request's max_tokens within the context (vLLM's rule: a prompt plus max_tokens
        beyond max_model_len is a 400, not a silent cut); None asks for the rest of it."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise RequestError(f"{prompt_param} has {num_prompt_tokens} tokens, but this "
                               f"model's maximum context length is {self.max_model_len} tokens "
                               "(prompt plus completion); shorten it", param=prompt_param)
        if requested is None:
            return room
        if requested > room:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} "
                               f"tokens. However, you requested {num_prompt_tokens + requested} "
                               f"tokens ({num_prompt_tokens} in the {prompt_param}, "
                               f"{requested} in the completion). Reduce the length of the "
                               f"{prompt_param} or {param}.", param=param)
        return requested

    def _engine_error(self, exc: ValueError, names: dict, prompt_param: str) -> RequestError:
        """An engine ValueError as a 400 naming the request's parameter."""
        message = str(exc)
        match = re.match(r"SamplingParams\.(\w+)", message)
        if match:
            field = match.group(1)
            param = names.get(field, field)
            message = f"{param}: " + message[match.end():].lstrip()
        elif message.startswith("prompt"):
            param = prompt_param
        else:
            param = None
        return RequestError(message, param=param)

    def _add(self, request_ids: list[str], prompts: list, params: list, names: dict,
             prompt_param: str) -> list:
        """Adds one engine request per prompt (``params``: one SamplingParams each); on any
        failure aborts those already added."""
        streams = []
        try:
            for request_id, prompt, p in zip(request_ids, prompts, params):
                streams.append(self.engine.add_request(request_id, prompt, p))
        except BaseException as exc:
            for rid in request_ids[:len(streams)]:
                self.engine.abort(rid)
            if isinstance(exc, self.EngineOverloadedError):
                raise RequestError(f"The server is overloaded: more than its --max-waiting "
                                   f"requests are queued ({exc}); retry later",
                                   status_code=503, type="server_overloaded",
                                   code="engine_overloaded") from None
            if isinstance(exc, ValueError):
                raise self._engine_error(exc, names, prompt_param) from None
            raise
        return streams

    async def _merged(self, streams: list) -> AsyncIterator[tuple[int, Any]]:
        """``(prompt index, output)`` from several request streams as they come."""
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, stream) -> None:
            try:
                async for out in stream:
                    await queue.put((i, out))
                await queue.put((i, done))
            except BaseException as exc:  # forwarded to the consumer, which re-raises it
                await queue.put((i, exc))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()

    def _abort_unfinished(self, streams: list) -> None:
        """Aborts whatever of ``streams`` has not finished (frees its blocks before the next
        step). Synchronous on purpose: it runs in ``finally`` blocks of cancelled tasks, where
        an await could be cancelled before it does anything."""
        for stream in streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    async def _final_outputs(self, streams: list, request) -> list:
        """The last output of every stream (FINAL_ONLY), aborting all of them at once if the
        client disconnects first (raises _ClientGone then)."""
        async def collect() -> list:
            last = [None] * len(streams)
            async for i, out in self._merged(streams):
                last[i] = out
            return last

        collector = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not collector.done():
                raise _ClientGone()
            try:
                return collector.result()
            except ValueError as exc:   # refused by the engine when it was applied
                raise RequestError(str(exc)) from None
        finally:
            for task in (collector, watcher):
                task.cancel()
            self._abort_unfinished(streams)

    def _stream(self, streams: list, request, events: AsyncIterator[str]):
        """A StreamingResponse of ``events`` that aborts ``streams`` the moment the client goes,
        and when the stream ends in any other way (cancelled by Starlette, an error)."""
        async def body() -> AsyncIterator[str]:
            watcher = asyncio.ensure_future(_wait_for_disconnect(request))
            watcher.add_done_callback(
                lambda task: task.cancelled() or self._abort_unfinished(streams))
            try:
                async for event in events:
                    yield event
            except (self.EngineDeadError, ValueError) as exc:
                # the response has begun (status 200): the error goes in the stream, as vLLM's
                if isinstance(exc, ValueError):   # refused by the engine when it was applied
                    error = RequestError(str(exc))
                else:
                    error = RequestError(f"the engine stopped: {exc}", status_code=500,
                                         type="internal_server_error")
                yield P.sse(error.body())
                yield P.SSE_DONE
            finally:
                watcher.cancel()
                self._abort_unfinished(streams)

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # ---- /v1/completions ---------------------------------------------------------------------
    def _completion_logprobs(self, token_ids: list[int], entries, offset: int, num_top: int
                             ) -> tuple[P.CompletionLogprobs, int]:
        lp = P.CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries):
            chosen = entry.get(token_id)
            text = self._token_text(token_id, chosen)
            lp.tokens.append(text)
            lp.token_logprobs.append(None if chosen is None else chosen.logprob)
            lp.text_offset.append(offset)
            offset += len(text)
            top = sorted((e for e in entry.items() if e[1].rank <= num_top),
                         key=lambda item: item[1].rank)
            lp.top_logprobs.append({self._token_text(t, e): e.logprob for t, e in top})
        return lp, offset

    async def completions(self, body: P.CompletionRequest, request):
        self.check_model(body.model)
        body.check()
        prompts = body.prompts()
        param = "prompt" if len(prompts) == 1 else "prompt[{}]"
        ids, params = [], []
        for i, prompt in enumerate(prompts):
            name = param.format(i)
            prompt_ids = self._prompt_ids(prompt, name)
            if not prompt_ids:
                raise RequestError(f"{name} is empty", param="prompt")
            max_tokens = self._max_tokens(len(prompt_ids), body.max_tokens, "max_tokens", name)
            ids.append(prompt_ids)
            params.append(self._sampling_params(body, max_tokens, body.logprobs,
                                                bool(body.stream)))
        base_id = f"cmpl-{uuid.uuid4().hex}"
        request_ids = [base_id] if len(ids) == 1 else [f"{base_id}-{i}" for i in range(len(ids))]
        streams = self._add(request_ids, ids, params, _COMPLETION_PARAMS, "prompt")
        n = body.n or 1
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._stream(streams, request, self._completion_events(
                streams, base_id, created, n, body.logprobs, include_usage))
        finals = await self._final_outputs(streams, request)
        choices, num_prompt, num_generated = [], 0, 0
        for i, out in enumerate(finals):
            num_prompt += len(out.prompt_token_ids)
            for c in out.outputs:
                num_generated += len(c.token_ids)
                logprobs = None
                if body.logprobs is not None and c.logprobs is not None:
                    logprobs, _ = self._completion_logprobs(c.token_ids, c.logprobs, 0,
                                                            body.logprobs)
                choices.append(P.CompletionChoice(index=i * n + c.index, text=c.text,
                                                  logprobs=logprobs,
                                                  finish_reason=c.finish_reason,
                                                  stop_reason=c.stop_reason))
        choices.sort(key=lambda c: c.index)
        return P.CompletionResponse(id=base_id, created=created, model=self.served_model_name,
                                    choices=choices, usage=P.UsageInfo.of(num_prompt,
                                                                          num_generated))

    async def _completion_events(self, streams, base_id: str, created: int, n: int,
                                 num_logprobs: Optional[int], include_usage: bool
                                 ) -> AsyncIterator[str]:
        finished, offsets = set(), {}
        prompt_tokens, generated = {}, 0
        async for i, out in self._merged(streams):
            prompt_tokens[i] = len(out.prompt_token_ids)
            for c in out.outputs:
                index = i * n + c.index
                if index in finished:
                    continue
                generated += len(c.token_ids)
                logprobs = None
                if num_logprobs is not None and c.logprobs:
                    logprobs, offsets[index] = self._completion_logprobs(
                        c.token_ids, c.logprobs, offsets.get(index, 0), num_logprobs)
                if not c.text and logprobs is None and c.finish_reason is None:
                    continue
                if c.finish_reason is not None:
                    finished.add(index)
                chunk = P.CompletionResponse(id=base_id, created=created,
                                             model=self.served_model_name,
                                             choices=[P.CompletionChoice(
                                                 index=index, text=c.text, logprobs=logprobs,
                                                 finish_reason=c.finish_reason,
                                                 stop_reason=c.stop_reason)])
                yield P.sse(chunk, include_usage=include_usage)
        if include_usage:
            num_prompt = sum(prompt_tokens.values())
            yield P.sse(P.CompletionResponse(id=base_id, created=created,
                                             model=self.served_model_name, choices=[],
                                             usage=P.UsageInfo.of(num_prompt, generated)))
        yield P.SSE_DONE

    # ---- /v1/chat/completions ----------------------------------------------------------------
    def _chat_logprobs(self, token_ids: list[int], entries, num_top: int) -> P.ChoiceLogprobs:
        content = []
        for token_id, entry in zip(token_ids, entries):
            chosen = entry.get(token_id)
            text = self._token_text(token_id, chosen)
            top = sorted((e for e in entry.items() if e[1].rank <= num_top),
                         key=lambda item: item[1].rank)
            content.append(P.TokenLogprob(
                token=text, logprob=float("nan") if chosen is None else chosen.logprob,
                bytes=list(text.encode("utf-8")),
                top_logprobs=[P.TopLogprob(token=(s := self._token_text(t, e)), logprob=e.logprob,
                                           bytes=list(s.encode("utf-8"))) for t, e in top]))
        return P.ChoiceLogprobs(content=content)

    async def chat_completions(self, body: P.ChatCompletionRequest, request):
        self.check_model(body.model)
        body.check()
        prompt_ids = self.chat.encode(body.messages, bool(body.add_generation_prompt))
        max_tokens = self._max_tokens(len(prompt_ids), body.max_new_tokens,
                                      body.max_tokens_param, "messages")
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        params = self._sampling_params(body, max_tokens, num_top, bool(body.stream))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        names = {**_CHAT_PARAMS, "max_tokens": body.max_tokens_param}
        streams = self._add([request_id], [prompt_ids], [params], names, "messages")
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._stream(streams, request, self._chat_events(
                streams, request_id, created, params.n, num_top, include_usage))
        (out,) = await self._final_outputs(streams, request)
        choices = []
        for c in out.outputs:
            logprobs = None
            if num_top is not None and c.logprobs is not None:
                logprobs = self._chat_logprobs(c.token_ids, c.logprobs, num_top)
            choices.append(P.ChatChoice(index=c.index,
                                        message=P.AssistantMessage(content=c.text),
                                        logprobs=logprobs, finish_reason=c.finish_reason,
                                        stop_reason=c.stop_reason))
        usage = P.UsageInfo.of(len(out.prompt_token_ids),
                               sum(len(c.token_ids) for c in out.outputs))
        return P.ChatCompletionResponse(id=request_id, created=created,
                                        model=self.served_model_name, choices=choices,
                                        usage=usage)

    async def _chat_events(self, streams, request_id: str, created: int, n: int,
                           num_top: Optional[int], include_usage: bool) -> AsyncIterator[str]:
        def chunk(choices: list, usage: Optional[P.UsageInfo] = None) -> str:
            data = P.ChatCompletionChunk(id=request_id, created=created,
                                         model=self.served_model_name, choices=choices,
                                         usage=usage).model_dump(mode="json")
            for choice in data["choices"]:   # a delta carries only what it sets, as OpenAI's
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            if not include_usage:
                data.pop("usage")
            return P.sse(data)

        finished, prompt_tokens, generated = set(), 0, 0
        # the role first, one chunk per choice, before any token (as OpenAI and vLLM send it)
        for index in range(n):
            yield chunk([P.ChatChunkChoice(index=index, delta=P.DeltaMessage(
                role="assistant", content=""))])
        async for _, out in self._merged(streams):
            prompt_tokens = len(out.prompt_token_ids)
            for c in out.outputs:
                if c.index in finished:
                    continue
                generated += len(c.token_ids)
                logprobs = None
                if num_top is not None and c.logprobs:
                    logprobs = self._chat_logprobs(c.token_ids, c.logprobs, num_top)
                if not c.text and logprobs is None and c.finish_reason is None:
                    continue
                if c.finish_reason is not None:
                    finished.add(c.index)
                delta = P.DeltaMessage(content=c.text if c.text else None)
                yield chunk([P.ChatChunkChoice(index=c.index, delta=delta, logprobs=logprobs,
                                               finish_reason=c.finish_reason,
                                               stop_reason=c.stop_reason)])
        if include_usage:
            yield chunk([], P.UsageInfo.of(prompt_tokens, generated))
        yield P.SSE_DONE

    # ---- the rest ----------------------------------------------------------------------------
    def models(self) -> P.ModelList:
        return P.ModelList(data=[P.ModelCard(id=self.served_model_name, created=self.created,
                                             root=self.model_path,
                                             max_model_len=self.max_model_len)])


def _error_response(error: RequestError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code)


def _validation_error(exc) -> RequestError:
    """FastAPI's RequestValidationError (pydantic's errors) as a 400 naming the parameter."""
    errors = exc.errors()
    if not errors:
        return RequestError("invalid request body")
    first = errors[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return RequestError(f"the request body is not valid JSON: {first.get('msg')}",
                            code="invalid_json")
    if kind == "extra_forbidden" and loc:
        name = _param_path(loc)
        return RequestError(f"Unrecognized request argument supplied: {name}", param=name,
                            code="unrecognized_argument")
    if not loc:
        return RequestError(f"the request body must be a JSON object: {first.get('msg')}")
    name = _param_path(loc)
    given = first.get("input")
    shown = repr(given) if not isinstance(given, (dict, list)) or len(str(given)) < 80 \
        else type(given).__name__
    detail = str(first.get("msg", "")).removeprefix("Value error, ")
    message = f"{name}: {detail}"
    if kind != "missing":
        message += f" (got {shown})"
    return RequestError(message, param=name)


def _param_path(loc: Sequence) -> str:
    """``("messages", 0, "content", "str")`` -> ``messages[0].content``: field names and list
    indices, up to where pydantic starts naming union members (``str``, ``list[int]``)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_]\w*", part) and part not in (
                "str", "int", "float", "bool", "list", "dict", "none"):
            out += f".{part}" if out else part
        else:
            break
    return out


def build_app(engine, served_model_name: str, *, metrics: Optional[ServerMetrics] = None):
    """The FastAPI app serving ``engine`` (an
    :class:`~pagedspec.engine.async_engine.AsyncEngine`) as ``served_model_name``.

    ``metrics`` is what ``GET /metrics`` renders; it should be the
    :class:`~pagedspec.serve.metrics.ServerMetrics` whose ``record`` is the engine's
    ``stats_listener`` (see :func:`create_engine_and_app`). Without it ``GET /metrics`` is a
    404."""
    server = OpenAIServer(engine, served_model_name)
    app = FastAPI(title="pagedspec", docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(RequestError)
    async def on_request_error(_request: Request, exc: RequestError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_request: Request, exc: RequestValidationError):
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(RequestError(str(exc.detail), status_code=exc.status_code,
                                            type=kind))

    @app.exception_handler(Exception)
    async def on_internal_error(_request: Request, exc: Exception):
        if isinstance(exc, server.EngineDeadError):
            message = f"the engine stopped: {exc}"
        else:
            logger.exception("internal error")
            message = f"internal server error ({type(exc).__name__})"
        return _error_response(RequestError(message, status_code=500,
                                            type="internal_server_error"))

    async def answer(handler, body, request: Request):
        try:
            return await handler(body, request)
        except _ClientGone:
            return Response(status_code=499)   # nobody reads it; the engine work is aborted

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        return await answer(server.completions, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        return await answer(server.chat_completions, body, request)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        if engine.errored:
            return JSONResponse(RequestError("the engine stopped on an error",
                                             status_code=503, type="server_error").body(),
                                status_code=503)
        return Response(status_code=200)

    if metrics is not None:
        from prometheus_client import CONTENT_TYPE_LATEST

        @app.get("/metrics")
        async def prometheus_metrics():
            return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class _StatsRelay:
    """The engine's ``stats_listener`` before the metrics exist (they need the engine's
    max_model_len): forwards each StepStats to ``target`` once it is set."""

    def __init__(self):
        self.target = None

    def __call__(self, stats) -> None:
        target = self.target
        if target is not None:
            target(stats)


def create_engine_and_app(config, served_model_name: Optional[str] = None,
                          max_waiting: Optional[int] = None):
    """Builds the AsyncEngine of ``config`` (an
    :class:`~pagedspec.engine.config.EngineConfig`; loads the model), its metrics and the app.
    Returns ``(app, engine)``; the caller shuts the engine down (``engine.shutdown()``)."""
    AsyncEngine = _engine_classes()[0]
    relay = _StatsRelay()
    engine = AsyncEngine(config, max_waiting=max_waiting, stats_listener=relay)
    if engine.warm_up_seconds:
        logger.info("compiled the forward in %.1f s before serving", engine.warm_up_seconds)
    core = engine.engine
    name = served_model_name or str(config.model)
    spec = core.config.num_speculative_tokens if core.config.speculative_model else None
    metrics = ServerMetrics(name, core.max_model_len, spec)
    relay.target = metrics.record
    return build_app(engine, name, metrics=metrics), engine


def make_parser() -> argparse.ArgumentParser:
    """``pagedspec serve``'s flags: the server's, then every engine flag of EngineConfig."""
    from pagedspec.engine.config import EngineConfig
    from pagedspec.models.loader import default_model

    p = argparse.ArgumentParser(prog="pagedspec serve",
                                description="an OpenAI-compatible HTTP server (completions, "
                                            "chat, streaming, /metrics)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: --model as given)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="queued requests beyond which new ones get HTTP 503 (default: no limit)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    EngineConfig.add_cli_args(p, model_default=default_model())
    return p


def run_server(argv: Optional[Sequence[str]] = None) -> int:
    """Parses ``pagedspec serve`` flags, loads the model and serves until interrupted."""
    import prometheus_client
    import uvicorn

    from pagedspec.engine.config import EngineConfig
    from pagedspec.models import CheckpointError

    args = make_parser().parse_args(argv)
    if args.max_waiting is not None and args.max_waiting < 0:
        print(f"pagedspec serve: --max-waiting must be >= 0, got {args.max_waiting}",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        app, engine = create_engine_and_app(EngineConfig.from_cli_args(args),
                                            args.served_model_name, args.max_waiting)
    except (CheckpointError, ValueError) as exc:
        print(f"pagedspec serve: {exc}", file=sys.stderr)
        return 2
    # vLLM leaves out the *_created series too (a dashboard never reads them)
    prometheus_client.disable_created_metrics()
    try:
        # open streams get a few seconds to end on ^C, then they are cut (and aborted)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    lifespan="off", timeout_graceful_shutdown=5)
    except KeyboardInterrupt:   # uvicorn re-raises the ^C it handled, once it has shut down
        pass
    finally:
        engine.shutdown()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``pagedspec serve ...`` (what ``pagedspec.cli`` calls) and ``python -m pagedspec.serve``."""
    return run_server(sys.argv[1:] if argv is None else list(argv))
