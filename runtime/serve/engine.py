"""The serving engine: one thread drives the captured decoder through its slot API (admit ->
step -> finished -> release); requests' images join free slots between steps and leave when done.
The `Scheduler` (queue, cancellations, the method for the current occupancy, the job in each
slot) decides, handing the engine a `Schedule` value per step (the slots to free, the jobs to
admit); the decoder (any `SlotDecoder`) executes; the engine's loop is the one place that
connects them.

An image is a `Job` (its class, seed and a future for its tokens; with previews asked, the tokens
committed so far). `Engine.submit` queues a
request's jobs or refuses them whole when the queue would exceed `max_queue` (the server answers
429); `Engine.cancel` frees a request's slots before the next step (a client that went away).
Each image's tokens depend only on its seed (the core's guarantee), so a request's images equal
`runtime run`'s with the same seed and index whatever else is decoding. An engine error fails
the jobs it touched and the engine carries on with the queue; the server stays up.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Callable, TypedDict

import torch

from runtime.core.slots import ImageStats, SlotDecoder, SlotRequest

_log = logging.getLogger("runtime.serve")


class QueueFull(Exception):
    """The queue cannot take a request's images now; retry after `retry_after` seconds."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"queue full; retry after {retry_after:.0f} s")
        self.retry_after = retry_after


class DoneInfo(TypedDict):
    """What the engine tells of a done image beside its tokens."""

    tau: float  # tokens accepted per target forward
    latency_s: float  # from queued to done
    queue_s: float  # from queued to admitted
    target_forwards: int
    accepted_tokens: int
    method: str  # the method that made it (under --method auto, the one in use then)


Done = tuple[torch.Tensor, DoneInfo]  # a done image: its tokens (block_size,) long CPU and DoneInfo


@dataclass
class Job:
    """One image to make: class id `label` (or None and a text prompt's `cond` (1, L, ...) and
    `mask` (1, L): caption features, or prompt token ids), random stream `seed`; `future` gets
    (tokens (block_size,) long CPU, stats dict) or the engine's exception; `tokens_done` rises
    while it decodes (a streamed request reports it)."""

    request: str
    index: int
    label: int | None
    seed: int
    future: Future[Done] = field(default_factory=Future)
    cond: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    tokens_done: int = 0  # tokens known so far, updated by the engine thread every few steps
    steps_done: int = 0  # decoding steps it has been through, with tokens_done (tokens_done / steps: live tau)
    admitted_step: int = 0  # the engine's step count when it took a slot
    partial_images: int = 0  # previews the client asked for: the engine then keeps `committed` too
    committed: torch.Tensor | None = None  # (tokens_done,) long CPU: the tokens known, when previews are asked


@dataclass
class EngineStats:
    """Counters the metrics endpoint reads (the engine thread writes them)."""

    images_done: int = 0
    images_failed: int = 0
    busy_slots: int = 0
    accepted_tokens: int = 0
    target_forwards: int = 0
    # per method: [sum of step TVDs, sum of stated bounds, steps measured] (`Decoder.measure_law`)
    law: dict[str, list[float]] = field(default_factory=dict)
    bound_warnings: dict[str, str] = field(default_factory=dict)  # method -> the one warning logged

    def step_tvd(self, method: str) -> tuple[float | None, float | None, int]:
        """(mean step TVD, mean stated bound, steps) measured for `method` so far."""
        tvd, bound, steps = self.law.get(method, (0.0, 0.0, 0))
        return (tvd / steps, bound / steps, int(steps)) if steps else (None, None, 0)


@dataclass(frozen=True)
class Schedule:
    """What the engine does to its decoder before one step, as the scheduler decided it: free the
    slots whose image is done (`release`) and those whose client went away (`cancel`), then start
    each job of `admit` in its slot. The slots it names are the scheduler's map after the step."""

    release: tuple[int, ...] = ()
    cancel: tuple[tuple[int, Job], ...] = ()
    admit: tuple[tuple[int, Job], ...] = ()


class Scheduler:
    """Decides what the engine runs next; thread-safe (the server's threads submit and cancel,
    the engine thread schedules, takes and waits). `slots`: the job each busy slot of the decoder
    holds (the request-to-slot map; the engine thread's).

    Holds the queue (at most `max_queue` images; a request is queued whole or refused whole),
    the method in use (`current`) and, with several methods, `choose(occupancy)`: the method for
    the images waiting and running (at most `batch`). When that names another method than the
    current one, `take` admits nothing until the running images are done, and `wait` then says
    "switch" (each image is made by one method, start to end)."""

    def __init__(self, methods: list[str], batch: int, *, max_queue: int = 64,
                 choose: Callable[[int], str] | None = None) -> None:
        self.current = methods[0]
        self.batch = batch
        self.max_queue = max_queue
        self.choose = choose
        self.switches = 0
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._drain = True
        self._seconds_per_image = 1.0  # a running estimate, for Retry-After
        self.slots: dict[int, Job] = {}

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def submit(self, jobs: list[Job]) -> None:
        """Queue a request's jobs, or raise QueueFull (nothing queued) / RuntimeError (stopping)."""
        with self._cv:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            if len(self._queue) + len(jobs) > self.max_queue:
                wait = (len(self._queue) + len(jobs)) * self._seconds_per_image / max(self.batch, 1)
                raise QueueFull(max(1.0, wait))
            self._queue.extend(jobs)
            self._cv.notify()

    def cancel(self, jobs: list[Job]) -> None:
        """Drop jobs: the queued ones leave the queue; a running one's cancelled future is the
        mark `cancelled` reads before the next step (done ones stay done)."""
        for job in jobs:
            job.future.cancel()
        with self._cv:
            self._queue = collections.deque(j for j in self._queue if not j.future.cancelled())

    @staticmethod
    def cancelled(job: Job) -> bool:
        """Whether a running job's slot is to be freed now (its client went away)."""
        return job.future.cancelled()

    def stop(self, drain: bool) -> None:
        """Take nothing new; with `drain` the queued images still run, else they are cancelled."""
        with self._cv:
            self._stopping, self._drain = True, drain
            if not drain:
                for job in self._queue:
                    job.future.cancel()
                self._queue.clear()
            self._cv.notify_all()

    def desired(self, running: int) -> str:
        """The method for the images waiting and `running` now (the one in use without `choose`)."""
        if self.choose is None:
            return self.current
        return self.choose(max(1, min(self.batch, running + len(self._queue))))

    def take(self, running: int) -> Job | None:
        """The next queued job to admit beside `running` others, or None: nothing is queued, or a
        method switch is due (the running images finish first)."""
        with self._cv:
            if self._queue and self.desired(running) != self.current:
                return None
            while self._queue:
                job = self._queue.popleft()
                if not job.future.cancelled():
                    return job
            return None

    def schedule(self, finished: tuple[int, ...] | list[int] = ()) -> Schedule:
        """This step's plan: `finished` (the slots whose image the decoder just finished) are
        released; running jobs whose client went away are cancelled; then queued jobs fill the
        free slots, lowest first, while `take` hands them out (none while a method switch is due)."""
        release = tuple(slot for slot in finished if self.slots.pop(slot, None) is not None)
        cancel = tuple((slot, job) for slot, job in self.slots.items() if self.cancelled(job))
        for slot, _ in cancel:
            del self.slots[slot]
        admit = []
        for slot in range(self.batch):
            if slot in self.slots:
                continue
            job = self.take(len(self.slots))
            if job is None:
                break
            self.slots[slot] = job
            admit.append((slot, job))
        return Schedule(release, cancel, tuple(admit))

    def wait(self) -> str:
        """Every slot is free: block until there is work; "work", "switch" (then `switch()`) or "stop"."""
        with self._cv:
            while not self._queue and not self._stopping:
                self._cv.wait()
            if self._stopping and (not self._drain or not self._queue):
                return "stop"
            return "switch" if self.desired(0) != self.current else "work"

    def switch(self) -> str:
        """Adopt the method `desired` names (every slot is free); returns it."""
        wanted = self.desired(0)
        _log.info("occupancy %d: switching from %s to %s", len(self._queue), self.current, wanted)
        self.current = wanted
        self.switches += 1
        return wanted

    def observe(self, seconds: float) -> None:
        """An image took `seconds` from admission to done (the Retry-After estimate)."""
        self._seconds_per_image = 0.9 * self._seconds_per_image + 0.1 * seconds


class Engine:
    """Owns the decoders and the `Scheduler`; `start()` runs its thread, `stop(drain)` ends it
    (after finishing what is queued and running when `drain`).

    decoders: method -> a decoder of that method (all of one batch size). One decoder: it serves
    everything. Several (`--method auto`): `choose(occupancy)` names the method for the images
    waiting and running (see `Scheduler`)."""

    def __init__(self, decoders: dict[str, SlotDecoder], device: torch.device, *, max_queue: int = 64,
                 choose: Callable[[int], str] | None = None,
                 on_done: Callable[[Job, DoneInfo], None] | None = None,
                 capture_count: dict[str, int] | None = None) -> None:
        self.decoders = decoders
        batch = next(iter(decoders.values())).config.batch
        self.scheduler = Scheduler(list(decoders), batch, max_queue=max_queue, choose=choose)
        self.capture_count = capture_count if capture_count is not None else {}  # the backend's, live
        self._captured_at_ready: dict[str, int] = {}
        self.device = device
        self.on_done = on_done
        self.stats = EngineStats()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()

    # -- the server's side -------------------------------------------------------------------
    @property
    def current(self) -> str:
        """The method in use."""
        return self.scheduler.current

    @property
    def decoder(self) -> SlotDecoder:
        """The decoder in use."""
        return self.decoders[self.scheduler.current]

    @property
    def queue_depth(self) -> int:
        return self.scheduler.queue_depth

    @property
    def recompiles(self) -> int:
        """Step compilations or captures since `ready` (the steady state should have none)."""
        if not self.ready.is_set():
            return 0
        return sum(max(0, n - self._captured_at_ready.get(name, 0)) for name, n in dict(self.capture_count).items())

    def submit(self, jobs: list[Job]) -> None:
        """Queue a request's jobs (`Scheduler.submit`: QueueFull or RuntimeError refuse them whole)."""
        self.scheduler.submit(jobs)

    def cancel(self, jobs: list[Job]) -> None:
        """Drop a request's jobs: queued ones now, running ones' slots before the next step."""
        self.scheduler.cancel(jobs)

    def start(self, warm_up: Job | None = None) -> None:
        """Start the engine thread; `warm_up` (an image decoded and thrown away) captures the
        steps before `ready` is set."""
        self._thread = threading.Thread(target=self._run, args=(warm_up,), name="runtime-serve-engine", daemon=True)
        self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop admitting; with `drain` finish the queued and running images first, else drop them."""
        self.scheduler.stop(drain)
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the engine thread ---------------------------------------------------------------------
    def _request(self, job: Job) -> SlotRequest:
        """The decoder's `SlotRequest` for a job, which starts running now."""
        job.started_at = time.perf_counter()
        cond = job.cond if job.cond is not None else torch.tensor([job.label], device=self.device)
        return SlotRequest(job, cond, job.mask, job.seed)

    def _done(self, job: Job, tokens: torch.Tensor, stats: ImageStats) -> None:
        now = time.perf_counter()
        info: DoneInfo = {"tau": stats.accepted_tokens / max(stats.target_forwards, 1),
                "latency_s": now - job.queued_at, "queue_s": (job.started_at or now) - job.queued_at,
                "target_forwards": stats.target_forwards, "accepted_tokens": stats.accepted_tokens,
                "method": self.current}
        self.stats.images_done += 1
        self.stats.accepted_tokens += stats.accepted_tokens
        self.stats.target_forwards += stats.target_forwards
        self._watch_law(stats)
        self.scheduler.observe(now - (job.started_at or now))
        if self.on_done is not None:
            self.on_done(job, info)
        _settle(job.future, result=(tokens.cpu(), info))

    def _watch_law(self, stats: ImageStats) -> None:
        """Add an image's measured law to its method's sums; log once per method when the
        relaxation is clearly past its stated bound (`runtime.core.law.bound_warning`)."""
        if not stats.law_steps:
            return
        from runtime.core.law import bound_warning

        sums = self.stats.law.setdefault(self.current, [0.0, 0.0, 0])
        sums[0] += stats.law_tvd
        sums[1] += stats.law_bound
        sums[2] += stats.law_steps
        if self.current not in self.stats.bound_warnings:
            warning = bound_warning(self.decoder.config.spec, *self.stats.step_tvd(self.current))
            if warning is not None:
                self.stats.bound_warnings[self.current] = warning
                _log.warning(warning)

    def _decode(self, decoder: SlotDecoder) -> str:
        """Serve with one decoder until every slot is free and the scheduler says switch or stop:
        update (collect finished images, progress), schedule (`Scheduler.schedule`: the slots to
        free, the jobs to admit), execute (the schedule, then one step). Returns "switch" or "stop"."""
        scheduler = self.scheduler
        decoder.reset_slots()
        iteration = 0
        while True:
            progress = iteration > 0 and iteration % PROGRESS_EVERY == 0
            done = decoder.finished(progress=progress)
            plan = scheduler.schedule(finished=[image.slot for image in done])
            self.stats.busy_slots = len(scheduler.slots)  # before the done images' futures are settled
            for slot in plan.release:
                decoder.release(slot)
            for image in done:
                self._done(image.key, image.tokens, image.stats)
            for slot, job, known in decoder.progress():
                if job.partial_images and known > job.tokens_done:  # a preview's tokens (one device read)
                    job.committed = decoder.committed(slot, known)
                job.tokens_done, job.steps_done = known, iteration - job.admitted_step
            for slot, _ in plan.cancel:  # a client that went away: its slot is free now
                decoder.release(slot)
            for slot, job in plan.admit:
                job.admitted_step = iteration
                decoder.admit(slot, self._request(job))
            if not decoder.busy():
                what = scheduler.wait()
                if what != "work":
                    return what
                continue
            decoder.step()
            iteration += 1

    def _warm_up(self, job: Job) -> None:
        """Decode `job` once with every decoder (their steps captured before `ready`); its
        tokens are thrown away."""
        for decoder in self.decoders.values():
            decoder.reset_slots()
            decoder.admit(0, self._request(job))
            while not decoder.finished():
                decoder.step()

    def _run(self, warm_up: Job | None) -> None:
        torch.set_grad_enabled(False)
        if warm_up is not None:
            self._warm_up(warm_up)
        self._captured_at_ready = dict(self.capture_count)
        self.ready.set()
        while True:
            try:
                what = self._decode(self.decoder)
            except Exception as err:  # noqa: BLE001 - fail the images it touched, keep serving
                failed = list(self.scheduler.slots.values())
                _log.error("engine error: %s (request ids: %s)", err,
                           ", ".join(sorted({job.request for job in failed})) or "none")
                self.scheduler.slots.clear()
                self.stats.busy_slots = 0
                for job in failed:
                    self.stats.images_failed += 1
                    _settle(job.future, error=err)
                what = self.scheduler.wait()
            if what == "stop":
                return
            if what == "switch":  # the method switch: every slot is free
                self.scheduler.switch()


# the busy slots' token counts are read (with the iteration's host read) every this many steps
PROGRESS_EVERY = 8


def _settle(future: Future[Done], result: Done | None = None, error: BaseException | None = None) -> None:
    """Resolve a job's future, unless the server thread cancelled it meanwhile (a client that went
    away): that race must not raise in the engine thread, where it would fail the other images."""
    try:
        if error is not None:
            future.set_exception(error)
        elif result is not None:
            future.set_result(result)
    except InvalidStateError:
        pass
