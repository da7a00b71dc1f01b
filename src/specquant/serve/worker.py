"""The engine worker: one thread owns the engine and runs one request at a time (batch 1, the seed's latency
setting), so the event loop never waits on the model. Requests come in through `submit`, their text goes back to
the loop as events on the job's asyncio queue.

Events: ("started",) once the engine accepted the request; ("text", delta); ("done", finish_reason, usage);
("error", RequestError) for a request the engine refused before starting; ("error", Exception) for a failure."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

import torch

from specquant.errors import SpecquantError
from specquant.serve.metrics import ServerMetrics
from specquant.serve.prefix import PrefixCache
from specquant.serve.requests import Request, RequestError
from specquant.serve.text import TextStream
from specquant.spec_decode.metrics import SpecMetrics

log = logging.getLogger("specquant.serve")


class Job:
    """One admitted request. cancel() (from the loop, when the client went away) frees its slot at once if it is
    still waiting; a running job stops at its next step."""

    def __init__(self, request: Request, endpoint: str, arrival: float, loop: asyncio.AbstractEventLoop):
        self.request, self.endpoint, self.arrival, self.loop = request, endpoint, arrival, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.state = "waiting"  # -> running -> finished, or -> cancelled while waiting; guarded by the worker lock

    def emit(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop has closed (server shutdown): nobody is listening any more
            self.cancelled.set()


class EngineWorker:
    def __init__(self, engine, tokenizer, metrics: ServerMetrics, max_queue: int, threads: int = 0,
                 prefix_cache: PrefixCache | None = None):
        self.engine, self.tokenizer, self.metrics, self.max_queue = engine, tokenizer, metrics, max_queue
        self.prefix_cache = prefix_cache
        self.threads = threads
        self.device = next(engine.target.parameters()).device
        self.eos = set(engine.target.config.eos_ids)
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.admitted = 0  # waiting + running
        self.current: Job | None = None  # the running job (guarded by the lock)
        self.thread = threading.Thread(target=self._run, name="specquant-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop the running request at its next step, refuse the waiting ones, end the thread."""
        with self.lock:
            if self.current is not None:
                self.current.cancelled.set()
            pending = []
            while not self.jobs.empty():
                pending.append(self.jobs.get_nowait())
        for job in pending:
            if job is not None:
                self.cancel(job)
                job.emit("error", RequestError(None, "the server is shutting down; retry elsewhere", 503))
        self.jobs.put(None)
        if self.thread.is_alive():
            self.thread.join()

    def submit(self, job: Job) -> bool:
        """Admit job, or False when max_queue requests are already admitted (the caller answers 503)."""
        with self.lock:
            if self.admitted >= self.max_queue:
                return False
            self.admitted += 1
        self.metrics.waiting.inc()
        self.metrics.prompt_tokens.inc(len(job.request.prompt_ids))
        self.jobs.put(job)
        return True

    def cancel(self, job: Job) -> None:
        """The client is gone: stop generating for it and free its slot."""
        job.cancelled.set()
        with self.lock:
            if job.state != "waiting":
                return  # running: the worker frees the slot when it sees the flag, within one step
            job.state = "cancelled"
            self.admitted -= 1
        self.metrics.waiting.dec()
        self.metrics.requests.labels(job.endpoint, "cancelled").inc()

    def _run(self) -> None:
        torch.set_grad_enabled(False)  # grad mode is per thread
        if self.threads:
            torch.set_num_threads(self.threads)
        while (job := self.jobs.get()) is not None:
            with self.lock:
                if job.state == "cancelled":
                    continue
                job.state = "running"
                self.current = job
            self.metrics.waiting.dec()
            self.metrics.running.inc()
            try:
                outcome = self._serve(job)
            except Exception as e:  # a model failure must not kill the worker: the request gets a 500
                log.exception("request failed in the engine")
                self._release(job)
                job.emit("error", e)
                outcome = "error"
            finally:
                self._release(job)
            self.metrics.requests.labels(job.endpoint, outcome).inc()

    def _release(self, job: Job) -> None:
        """Free a running job's slot (once). Called before its last event is sent: a client that gets its reply
        and sends the next request at once must find the slot free, or a full load of max_queue clients, each
        sending one request after another, would see spurious 503s."""
        with self.lock:
            if job.state != "running":
                return
            job.state = "finished"
            self.admitted -= 1
            self.current = None
        self.metrics.running.dec()

    def _serve(self, job: Job) -> str:
        """Run one request; returns its outcome (stop, length, cancelled, refused)."""
        req = job.request
        prompt = torch.tensor([req.prompt_ids], device=self.device)
        try:
            steps = self.engine.stream(prompt, req.max_tokens, req.sampling, stop_on_eos=not req.ignore_eos,
                                       prefill=self.prefix_cache.prefill if self.prefix_cache else None)
        except SpecquantError as e:  # a limit of the drafter's the HTTP layer does not know (e.g. its window)
            self._release(job)
            job.emit("error", RequestError("prompt", str(e)))
            return "refused"
        job.emit("started")
        text, spec = TextStream(self.tokenizer, req.stop), SpecMetrics()
        generated, first, last_id, finish = 0, None, None, "length"
        try:
            for step in steps:
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
                ids = step.token_ids[0]
                spec.record_step(step.metrics.proposed, step.metrics.accepted)
                if ids:
                    generated, last_id = generated + len(ids), ids[-1]
                if first is None:
                    first = time.perf_counter()
                    self.metrics.ttft.observe(first - job.arrival)
                delta = text.feed(ids)
                if delta:
                    job.emit("text", delta)
                if text.stopped:
                    finish = "stop"
                    break
            else:
                if last_id in self.eos and not req.ignore_eos:
                    finish = "stop"
        finally:
            steps.close()  # a cut-short request ends its generator here: no more forwards run for it
        end = time.perf_counter()
        self.metrics.generation_tokens.inc(generated)
        self.metrics.record_spec(spec)
        if finish == "cancelled":
            return finish
        if generated > 1:
            self.metrics.tpot.observe((end - first) / (generated - 1))
        self.metrics.e2e.observe(end - job.arrival)
        tail = text.finish()
        if tail:
            job.emit("text", tail)
        self._release(job)
        usage = {"prompt_tokens": len(req.prompt_ids), "completion_tokens": generated,
                 "total_tokens": len(req.prompt_ids) + generated}
        if self.prefix_cache is not None:  # OpenAI's field for prompt tokens served from a cache
            usage["prompt_tokens_details"] = {"cached_tokens": self.prefix_cache.last[1]}
        job.emit("done", finish, usage)
        return finish
