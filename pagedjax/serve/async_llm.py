"""AsyncLLM: one LLMEngine behind an asyncio front end.

The engine is not thread-safe and its step blocks (the device runs it), so it lives on one thread
of its own, the engine loop:

    while serving:
        apply the requests added and aborted since the last step
        step() while any request is unfinished, else sleep until one arrives
        hand every RequestOutput to the event loop (one callback per step)

Requests join and leave between steps exactly as in the offline `LLM`: same scheduler, same
packer, same jitted step, so greedy and seeded outputs equal the offline ones token for token.
`generate()` is an async iterator of a request's RequestOutputs (DELTA or FINAL_ONLY, as its
SamplingParams say); if the consumer stops iterating before the request finished (a client that
disconnects), the request is aborted and its blocks return to the pool at the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from pagedjax.engine import LLMEngine
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, engine: LLMEngine, history_limit: int = 1000):
        self.engine = engine
        # a server runs for days: the engine's per-step records (kept whole for offline studies)
        # are dropped every `history_limit` steps, once /metrics has counted them
        self.history_limit = history_limit
        engine.scheduler.metrics.record_occupancy = False
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        # called on the engine thread after each step: (engine, outputs, step seconds, loop seconds)
        self.on_step = None
        self.on_idle = None            # called on the engine thread before it waits for work: (engine,)
        self.on_finished = None        # called on the event loop for each finished RequestOutput
        self.num_steps = 0
        self.step_seconds = 0.0        # wall time inside engine.step() on the engine thread

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine loop; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedjax-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort every request still in flight (their consumers see the abort), stop the loop."""
        in_flight = list(self._streams)
        await asyncio.wrap_future(self._submit("abort_all", in_flight))
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)
        logger.warning("engine loop stopped; %d request(s) in flight were aborted", len(in_flight))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- requests --------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Add a request; once the engine has accepted it, returns the async iterator of its
        RequestOutputs (ValueError with the engine's message if refused). Stopping the iteration
        before the request finished aborts it; a caller that never iterates must `abort` it."""
        if not self.is_running:
            raise RuntimeError("the engine loop is not running")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        try:
            await asyncio.wrap_future(self._submit("add", (request_id, prompt, params)))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return self._outputs(request_id, stream)

    async def generate(self, prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """`add_request`, then its outputs."""
        outputs = await self.add_request(request_id, prompt, params)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                yield out

    async def _outputs(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it finished); safe from any thread."""
        self._submit("abort", request_id)

    def _submit(self, kind: str, payload) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((kind, payload, fut))
        self._wake.set()
        return fut

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        mark = time.perf_counter()   # the end of the last step, or when the loop last woke up
        while not self._stopping:
            self._apply_commands()
            if not eng.has_unfinished_requests():
                if self.on_idle is not None:  # aborts may have changed the state since the last step
                    self.on_idle(eng)
                self._wake.wait()
                self._wake.clear()
                mark = time.perf_counter()
                continue
            t0 = time.perf_counter()
            try:
                outputs = eng.step()
            except Exception as e:  # the engine rolled the step back; fail what is in flight, keep serving
                logger.exception("engine step failed")
                self._fail_all(e)
                continue
            t1 = time.perf_counter()
            self.num_steps += 1
            self.step_seconds += t1 - t0
            if self.on_step is not None:  # the step's time, and the loop's since the previous step ended
                try:
                    self.on_step(eng, outputs, t1 - t0, t1 - mark)
                except Exception:   # statistics must never stop the serving
                    logger.exception("on_step callback failed")
            if len(eng.scheduler.metrics.steps) >= self.history_limit:
                eng.scheduler.metrics.reset()
                eng.step_timings.clear()
            mark = t1
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)
        self._apply_commands()

    def _apply_commands(self) -> None:
        eng = self.engine
        while True:
            try:
                kind, payload, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                if kind == "add":
                    request_id, prompt, params = payload
                    fut.set_result(eng.add_request(request_id, prompt, params))
                elif kind == "abort":
                    eng.abort_request(payload)
                    fut.set_result(None)
                elif kind == "abort_all":
                    ids = payload
                    eng.abort_request(ids)
                    self._loop.call_soon_threadsafe(self._close, ids, asyncio.CancelledError("server shutting down"))
                    fut.set_result(None)
            except Exception as e:
                fut.set_exception(e)

    def _fail_all(self, error: Exception) -> None:
        ids = list(self.engine.output_processor.groups)
        self.engine.abort_request(ids)
        self._loop.call_soon_threadsafe(self._close, ids, RuntimeError(f"engine step failed: {error}"))

    # -- the event loop --------------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
            if out.finished and self.on_finished is not None:
                self.on_finished(out)

    def _close(self, ids, error: BaseException) -> None:
        for rid in ids:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put_nowait(error)
