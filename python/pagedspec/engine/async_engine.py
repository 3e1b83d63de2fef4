"""The engine for asyncio code (the server): one background thread owns the :class:`Engine` and
runs its step loop, so steps never block the event loop; each request gets its own queue of
outputs. Adds and aborts are applied between steps, in the order they were made.

    engine = AsyncEngine(EngineConfig(model="..."))
    async for out in engine.generate("req-1", "Hello", SamplingParams(
            max_tokens=32, output_kind=RequestOutputKind.DELTA)):
        print(out.outputs[0].text, end="")

The engine is built on the driver thread, not the caller's, so every torch operation of the
model runs on one thread. torch's CPU kernels parallelize with OpenMP, which keeps a pool of
worker threads per thread that starts parallel work; two such pools on a machine with as many
cores as one pool's threads make libgomp throttle its spin-waits, and every parallel op then
pays a sleeping worker's wake-up (SmolLM2 at batch 1 on 2 cores: 45 ms per token against 30).

A consumer that stops early or is cancelled (a client that disconnects) aborts its request at
once: its blocks are freed before the next step. A failure inside a step ends the driver; every
open stream then raises :class:`EngineDeadError` (requests' own bad input never gets that far:
it is refused when added).
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import AsyncIterator, Callable, Optional

from pagedspec.engine.config import EngineConfig
from pagedspec.engine.engine import Engine, Prompt
from pagedspec.engine.metrics import StepStats
from pagedspec.engine.outputs import RequestOutput, SamplingParams

_END = object()          # a stream's end without a finished output (its request was aborted)


class EngineOverloadedError(RuntimeError):
    """More requests would wait than ``max_waiting`` allows (a server answers 503)."""


class EngineDeadError(RuntimeError):
    """The driver thread stopped on an error; no request can progress."""


class RequestStream:
    """One request's outputs as an async iterator; ends after the finished output. Leaving it
    early (``aclose()``, ``async with``, a cancelled task) aborts the request."""

    def __init__(self, engine: "AsyncEngine", request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.finished = False
        self._engine, self._loop = engine, loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = False

    def _put(self, item) -> None:        # from the driver thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            self._done = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = self.finished = True
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncEngine:
    """Args:
        config: the engine's configuration. The engine is built (the model loaded) on the
            driver thread, and the constructor returns once it is (and, compiled, warmed up:
            :meth:`Engine.warm_up`), raising what building it raised.
        max_waiting: refuse a request (:class:`EngineOverloadedError`) when more than this many
            would wait, i.e. not fit the next step's free sequence slots; None: no limit.
        stats_listener: called from the driver thread after every step with its
            :class:`StepStats` (the server's Prometheus metrics).
    """

    def __init__(self, config: EngineConfig, *, max_waiting: Optional[int] = None,
                 stats_listener: Optional[Callable[[StepStats], None]] = None):
        if max_waiting is not None and (not isinstance(max_waiting, int) or max_waiting < 0):
            raise ValueError(f"AsyncEngine: max_waiting must be None or an int >= 0, got "
                             f"{max_waiting!r}")
        self.max_waiting = max_waiting
        self.stats_listener = stats_listener
        self._streams: dict[str, RequestStream] = {}     # open requests (event loop's view)
        self._commands: deque = deque()                  # ("add", ...) / ("abort", id)
        self._wake = threading.Condition()
        self._stopping = False
        self._error: Optional[BaseException] = None
        self._num_pending = 0                            # adds not yet applied
        self._last_stats = StepStats()
        self.engine: Optional[Engine] = None
        self.warm_up_seconds = 0.0
        built = threading.Event()
        self._thread = threading.Thread(target=self._build_and_drive, args=(config, built),
                                        name="pagedspec-engine", daemon=True)
        self._thread.start()
        built.wait()
        if self.engine is None:
            raise self._error

    # ---- the caller's side (event loop thread) --------------------------------------------
    @property
    def errored(self) -> bool:
        return self._error is not None

    def num_unfinished(self) -> int:
        return len(self._streams)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams
                    ) -> RequestStream:
        """Validates the request and queues it; returns its stream. Raises ValueError (bad
        input, naming the parameter, or a request id in use), EngineOverloadedError or
        EngineDeadError; nothing is queued then. Call from the event loop's thread."""
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped on an error: {self._error!r}")
        if self._stopping:
            raise EngineDeadError("the engine is shut down")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request, text = self.engine.process_inputs(request_id, prompt, params)
        if self.max_waiting is not None:
            stats = self._last_stats
            free_slots = max(0, self.engine.config.max_num_seqs - stats.num_running)
            would_wait = stats.num_waiting + stats.num_swapped + self._num_pending + 1 - free_slots
            if would_wait > self.max_waiting:
                raise EngineOverloadedError(
                    f"{stats.num_waiting + self._num_pending} requests are waiting; this server "
                    f"queues at most {self.max_waiting} (--max-waiting): retry later")
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        self._streams[request_id] = stream
        with self._wake:
            self._num_pending += 1
            self._commands.append(("add", request, text, stream))
            self._wake.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Ends the request before the next step and frees its blocks (thread-safe; unknown
        or finished ids are ignored)."""
        with self._wake:
            self._commands.append(("abort", request_id))
            self._wake.notify()

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        """:meth:`add_request` and its outputs; aborts the request if the consumer stops
        early or is cancelled."""
        stream = self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def shutdown(self) -> None:
        """Stops the driver thread (open streams end); idempotent."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    # ---- the driver thread ----------------------------------------------------------------
    def _build_and_drive(self, config: EngineConfig, built: threading.Event) -> None:
        try:
            engine = Engine(config)
            self.warm_up_seconds = engine.warm_up()     # compile before the first request
            self.engine = engine
        except BaseException as exc:  # noqa: BLE001  (raised again by the constructor)
            self._error = exc
            return
        finally:
            built.set()
        self._drive()

    def _drive(self) -> None:
        engine = self.engine
        streams: dict[str, RequestStream] = {}           # the driver's view
        try:
            while True:
                with self._wake:
                    while not (self._commands or engine.has_unfinished() or self._stopping):
                        self._wake.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for command in commands:
                    self._apply(command, streams)
                outputs = engine.step()
                self._last_stats = engine.stats()
                with self._wake:    # the adds are in those queue sizes now
                    self._num_pending -= sum(c[0] == "add" for c in commands)
                if self.stats_listener is not None:
                    self.stats_listener(self._last_stats)
                for out in outputs:
                    stream = streams.get(out.request_id)
                    if stream is None:
                        continue
                    if out.finished:
                        del streams[out.request_id]
                        self._forget(out.request_id)
                    stream._put(out)
        except BaseException as exc:  # noqa: BLE001  (reported to every waiting consumer)
            self._error = exc
            error = EngineDeadError(f"the engine stopped on an error: {exc!r}")
            error.__cause__ = exc
            for stream in list(streams.values()) + [c[3] for c in self._commands
                                                     if c[0] == "add"]:
                stream._put(error)
            raise
        finally:
            for stream in streams.values():
                stream._put(_END)

    def _apply(self, command, streams: dict[str, RequestStream]) -> None:
        if command[0] == "add":
            _, request, text, stream = command
            if stream._done:                 # aborted before it was applied
                self._forget(request.request_id)
                return
            try:
                self.engine.add_processed(request, text)
            except ValueError as exc:
                self._forget(request.request_id)
                stream._put(exc)
                return
            streams[request.request_id] = stream
        else:
            request_id = command[1]
            self.engine.abort([request_id])
            stream = streams.pop(request_id, None)
            if stream is not None:
                self._forget(request_id)
                stream._put(_END)

    def _forget(self, request_id: str) -> None:
        """Drops the event loop's record of a request, on that loop's thread."""
        stream = self._streams.get(request_id)
        if stream is not None:
            def drop():
                if self._streams.get(request_id) is stream:
                    del self._streams[request_id]
            stream._loop.call_soon_threadsafe(drop)
