"""The serve engine's scheduling against a fake decoder (no model, no server): admission into free
slots, cancellation, the method switch, an engine error, drain and stop. The end-to-end tests
(tests/test_serve.py) check the same engine with the real decoder through a server."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from runtime.core.slots import Finished, ImageStats, SlotDecoder, SlotRequest
from runtime.serve.engine import Engine, Job, QueueFull, Schedule, Scheduler


@dataclass
class FakeDecoder(SlotDecoder):
    """The slot API (`SlotDecoder`, whose `generate_many` it inherits) with images that take
    `steps_per_image` steps; an image's tokens are its seed repeated, so a mix-up between slots
    shows. `fail_at`: a step that raises."""

    batch: int = 2
    steps_per_image: int = 3
    num_tokens: int = 4
    fail_at: int | None = None
    held: list[SlotRequest | None] = field(default_factory=list)  # the request of each slot
    steps: int = 0
    admitted: list[Any] = field(default_factory=list)
    released: list[Any] = field(default_factory=list)
    age: dict[int, int] = field(default_factory=dict)
    gate: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.held = [None] * self.batch
        self.gate.set()

    def reset_slots(self) -> None:
        self.held = [None] * self.batch
        self.age = {}

    def admit(self, slot: int, request: SlotRequest) -> None:
        assert self.held[slot] is None, "admitted into a busy slot"
        self.held[slot] = request
        self.age[slot] = 0
        self.admitted.append(request.key)

    def release(self, slot: int) -> None:
        self.released.append(self.held[slot].key)
        self.held[slot] = None

    def busy(self) -> list[int]:
        return [i for i, r in enumerate(self.held) if r is not None]

    def step(self) -> None:
        self.gate.wait(10)
        self.steps += 1
        if self.fail_at is not None and self.steps == self.fail_at:
            raise RuntimeError("the device fell over")
        for slot in self.busy():
            self.age[slot] += 1

    def finished(self, progress: bool = False) -> list[Finished]:
        done = []
        for slot in self.busy():
            if self.age[slot] >= self.steps_per_image:
                request = self.held[slot]
                stats = ImageStats(tokens=self.num_tokens, target_forwards=self.steps_per_image + 1,
                                   accepted_tokens=self.num_tokens, depth_accepted=[], depth_reached=[],
                                   relax_mass=0.0, accepted_drafts=0)
                done.append(Finished(slot, request.key, torch.full((self.num_tokens,), request.seed), stats))
        return done

    def progress(self) -> list[tuple[int, Any, int]]:
        return []

    def committed(self, slot: int, known: int) -> torch.Tensor:
        return torch.full((known,), self.held[slot].seed)

    def capture_steps(self, cond: torch.Tensor, cond_mask: torch.Tensor | None) -> None:
        pass

    def state_bytes(self) -> int:
        return 0

    timer: Any = None
    measure_law: bool = False
    compile_key: str = "fake"

    @property
    def slots(self) -> list[SlotRequest | None]:
        return self.held

    @property
    def config(self) -> SimpleNamespace:
        return SimpleNamespace(batch=self.batch, num_tokens=self.num_tokens, spec=None)


def _engine(decoders: dict[str, FakeDecoder], **kw: Any) -> Engine:
    engine = Engine(decoders, torch.device("cpu"), **kw)
    engine.start()
    assert engine.ready.wait(5)
    return engine


def _jobs(n: int, request: str = "r", first_seed: int = 0) -> list[Job]:
    return [Job(request, i, 3, first_seed + i) for i in range(n)]


def test_jobs_beyond_the_batch_wait_for_free_slots_and_each_gets_its_own_tokens():
    fake = FakeDecoder(batch=2)
    engine = _engine({"ar": fake})
    try:
        jobs = _jobs(5, first_seed=10)
        engine.submit(jobs)
        results = [job.future.result(5) for job in jobs]
        assert [int(tokens[0]) for tokens, _ in results] == [10, 11, 12, 13, 14]
        assert all(info["method"] == "ar" for _, info in results)
        assert fake.admitted == jobs and sorted(fake.released, key=id) == sorted(jobs, key=id)
        assert engine.stats.images_done == 5 and engine.stats.busy_slots == 0
    finally:
        engine.stop(drain=False, timeout=5)


def test_a_cancelled_job_frees_its_slot_before_the_next_step():
    fake = FakeDecoder(batch=1, steps_per_image=3)
    engine = _engine({"ar": fake})
    try:
        first, second = _jobs(2)
        fake.gate.clear()  # the first step waits until the cancel is in
        engine.submit([first])
        while first not in fake.admitted:
            time.sleep(0.01)
        engine.submit([second])
        engine.cancel([first])
        fake.gate.set()
        second.future.result(5)
        assert fake.released[0] is first and fake.admitted == [first, second]
        assert fake.steps == 1 + 3  # the cancelled image's one step, then the second's three
        with pytest.raises(CancelledError):
            first.future.result(0)
    finally:
        engine.stop(drain=False, timeout=5)


def test_a_method_switch_waits_for_every_slot_then_takes_the_other_decoder():
    """choose() names a method per occupancy: while images of the old method run, no new image
    joins; once every slot is free the engine switches, so each image is made by one method."""
    ar, lpp = FakeDecoder(batch=2), FakeDecoder(batch=2)
    wanted = {"method": "ar"}
    engine = _engine({"ar": ar, "lantern++": lpp}, choose=lambda occupancy: wanted["method"])
    try:
        ar.gate.clear()  # hold the first images mid-way
        early = _jobs(2, "early")
        engine.submit(early)
        while len(ar.admitted) < 2:
            time.sleep(0.01)
        wanted["method"] = "lantern++"
        late = _jobs(2, "late", first_seed=50)
        engine.submit(late)
        ar.gate.set()
        methods = [job.future.result(5)[1]["method"] for job in early + late]
        assert methods == ["ar", "ar", "lantern++", "lantern++"]
        assert ar.admitted == early and lpp.admitted == late and engine.scheduler.switches == 1
    finally:
        engine.stop(drain=False, timeout=5)


def test_an_engine_error_fails_the_running_images_and_serving_goes_on():
    fake = FakeDecoder(batch=2, fail_at=2)
    engine = _engine({"ar": fake})
    try:
        hit = _jobs(2, "hit")
        engine.submit(hit)
        for job in hit:
            with pytest.raises(RuntimeError, match="the device fell over"):
                job.future.result(5)
        after = _jobs(1, "after", first_seed=7)
        engine.submit(after)
        assert int(after[0].future.result(5)[0][0]) == 7
        assert engine.stats.images_failed == 2
    finally:
        engine.stop(drain=False, timeout=5)


def test_stop_with_drain_finishes_the_queue_and_without_it_cancels_the_queue():
    fake = FakeDecoder(batch=1)
    engine = _engine({"ar": fake})
    fake.gate.clear()
    jobs = _jobs(3)
    engine.submit(jobs)
    threading.Timer(0.2, fake.gate.set).start()
    engine.stop(drain=True, timeout=10)
    assert all(job.future.done() and not job.future.cancelled() for job in jobs)
    with pytest.raises(RuntimeError, match="shutting down"):
        engine.submit(_jobs(1))

    fake = FakeDecoder(batch=1)
    engine = _engine({"ar": fake})
    fake.gate.clear()
    jobs = _jobs(3)
    engine.submit(jobs)
    while not fake.admitted:
        time.sleep(0.01)
    threading.Timer(0.2, fake.gate.set).start()
    engine.stop(drain=False, timeout=10)
    assert jobs[0].future.done() and not jobs[0].future.cancelled()  # the running one finishes
    assert all(job.future.cancelled() for job in jobs[1:])


def test_a_full_queue_refuses_a_request_whole():
    fake = FakeDecoder(batch=1)
    fake.gate.clear()
    engine = _engine({"ar": fake}, max_queue=3)
    try:
        engine.submit(_jobs(3))
        with pytest.raises(QueueFull):
            engine.submit(_jobs(2, "more"))
        assert engine.queue_depth <= 3
    finally:
        fake.gate.set()
        engine.stop(drain=False, timeout=5)


def test_the_scheduler_holds_admission_for_a_switch_and_names_it_once_the_slots_are_free():
    """With `choose`, the scheduler hands out jobs while the method fits the occupancy; once it
    names another method, `take` holds every job back and `wait` (all slots free) says switch."""
    wanted = {"method": "ar"}
    scheduler = Scheduler(["ar", "lantern++"], batch=4, choose=lambda occupancy: wanted["method"])
    scheduler.submit(_jobs(3))
    first = scheduler.take(running=0)
    assert first is not None and first.index == 0
    wanted["method"] = "lantern++"
    assert scheduler.take(running=1) is None and scheduler.queue_depth == 2  # held, not dropped
    assert scheduler.wait() == "switch" and scheduler.switch() == "lantern++"
    assert scheduler.current == "lantern++" and scheduler.switches == 1
    assert [scheduler.take(running=0).index, scheduler.take(running=1).index] == [1, 2]
    assert scheduler.take(running=2) is None  # nothing queued


def test_the_scheduler_skips_cancelled_jobs_and_stops_when_drained():
    scheduler = Scheduler(["ar"], batch=2, max_queue=3)
    jobs = _jobs(3)
    scheduler.submit(jobs)
    with pytest.raises(QueueFull):
        scheduler.submit(_jobs(1, "late"))  # 3 + 1 > 3: refused whole
    scheduler.cancel(jobs[:1])
    assert scheduler.cancelled(jobs[0]) and not scheduler.cancelled(jobs[1])
    assert scheduler.take(running=0) is jobs[1]
    scheduler.stop(drain=True)
    assert scheduler.wait() == "work"  # jobs[2] still runs
    assert scheduler.take(running=0) is jobs[2]
    assert scheduler.wait() == "stop"
    with pytest.raises(RuntimeError, match="shutting down"):
        scheduler.submit(_jobs(1))


def test_the_fake_and_both_loops_implement_the_slot_decoder_protocol():
    from tiny_models import tiny_pair

    from runtime.core import MethodSpec
    from runtime.core.decoder import Decoder
    from runtime.core.generate import new_decoder
    from runtime.core.pjd_published import PublishedPJD

    tiny_target, _ = tiny_pair(vocab=8, grid=6)
    assert isinstance(FakeDecoder(), SlotDecoder)
    exact = new_decoder(tiny_target, None, MethodSpec(method="pjd"))
    published = new_decoder(tiny_target, None, MethodSpec(method="pjd", accept="published"))
    assert type(exact) is Decoder and type(published) is PublishedPJD  # the method table's loop
    assert isinstance(exact, SlotDecoder) and isinstance(published, SlotDecoder)


def test_schedule_is_a_value_naming_the_slots_to_free_and_the_jobs_to_admit():
    """The scheduler keeps the job of each slot; a step's plan releases the finished slots,
    cancels the running jobs whose client went away, and fills the free slots lowest first."""
    scheduler = Scheduler(["ar"], batch=2)
    jobs = _jobs(4)
    scheduler.submit(jobs)
    first = scheduler.schedule()
    assert first == Schedule(admit=((0, jobs[0]), (1, jobs[1]))) and scheduler.slots == {0: jobs[0], 1: jobs[1]}
    assert scheduler.schedule() == Schedule()  # nothing done, nothing free
    scheduler.cancel([jobs[1]])  # its client went away while it ran
    plan = scheduler.schedule(finished=[0])
    assert plan.release == (0,) and plan.cancel == ((1, jobs[1]),)
    assert plan.admit == ((0, jobs[2]), (1, jobs[3])) and scheduler.slots == {0: jobs[2], 1: jobs[3]}
    assert scheduler.schedule(finished=[0, 1]) == Schedule(release=(0, 1)) and scheduler.slots == {}
