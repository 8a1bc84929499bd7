"""The model's turns (kvcdn_server.turns): who computes next when a forward pass ends.

Deterministic: the clock is a number the test moves, and threads only wait for each other.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvcdn_server.turns import CANCEL_POLL, TurnCancelled, Turns


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _wait(condition, limit: float = 10.0) -> None:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < limit, "condition not reached in time"
        time.sleep(0.005)


def _compute(turns: Turns, clock: Clock, tenant: str, seconds: float) -> None:
    with turns.request(tenant) as ticket, turns.step(ticket):
        clock.now += seconds


class Queue:
    """Requests waiting for a turn, each in its thread; ``order`` lists them as their turns came."""

    def __init__(self, turns: Turns):
        self.turns, self.order, self.threads = turns, [], []

    def add(self, name: str, tenant: str, cancel: threading.Event | None = None) -> None:
        def run():
            try:
                with self.turns.request(tenant) as ticket, self.turns.step(ticket, cancel):
                    self.order.append(name)
            except TurnCancelled:
                self.order.append(f"{name} cancelled")

        before = self.turns.waiting()
        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)
        _wait(lambda: self.turns.waiting() == before + 1)  # queued in this order

    def join(self) -> None:
        for thread in self.threads:
            thread.join(10)


@pytest.fixture
def held():
    """``held(turns)``: a context in which tenant ``x`` holds the model until it exits."""

    def hold(turns: Turns):
        release, holding = threading.Event(), threading.Event()

        def run():
            with turns.request("x") as ticket, turns.step(ticket):
                holding.set()
                release.wait(10)

        thread = threading.Thread(target=run)
        thread.start()
        holding.wait(10)
        return release, thread

    return hold


def test_a_tenant_that_computed_less_goes_before_one_that_waited_longer(held):
    clock = Clock()
    turns = Turns(clock=clock)
    _compute(turns, clock, "A", 5.0)  # A has flooded; B has computed a little
    _compute(turns, clock, "B", 1.0)
    release, holder = held(turns)
    queue = Queue(turns)
    queue.add("A1", "A")
    queue.add("A2", "A")
    queue.add("B1", "B")  # arrives last
    release.set()
    holder.join(10)
    queue.join()
    assert queue.order == ["B1", "A1", "A2"]  # then A's own requests in arrival order


def test_equal_usage_is_first_come_first_served(held):
    clock = Clock()
    turns = Turns(clock=clock)
    release, holder = held(turns)
    queue = Queue(turns)
    for name in ("D1", "C1", "D2"):
        queue.add(name, name[0])
    release.set()
    holder.join(10)
    queue.join()
    assert queue.order == ["D1", "C1", "D2"]


def test_tenants_that_both_compute_all_the_time_alternate():
    """Each turn is charged what it took: two busy tenants end up with half the turns each."""
    clock = Clock()
    turns = Turns(clock=clock)
    order: list[str] = []
    for _ in range(6):  # A and B both want the next turn every time; the scheduler picks one
        waiting = {"A": turns.usage("A"), "B": turns.usage("B")}
        tenant = min(waiting, key=lambda t: (waiting[t], t))
        _compute(turns, clock, tenant, 1.0)
        order.append(tenant)
    assert order == ["A", "B", "A", "B", "A", "B"]
    assert turns.usage("A") == pytest.approx(turns.usage("B"), rel=0.1)


def test_usage_decays_with_its_half_life():
    clock = Clock()
    turns = Turns(half_life=10.0, clock=clock)
    _compute(turns, clock, "A", 4.0)
    clock.now += 10.0
    assert turns.usage("A") == pytest.approx(2.0)
    clock.now += 200.0
    _compute(turns, clock, "B", 0.5)
    assert turns.usage("A") == 0.0  # forgotten: the table keeps only tenants that computed lately


def test_a_cancelled_request_leaves_the_queue_without_its_turn(held):
    clock = Clock()
    turns = Turns(clock=clock)
    release, holder = held(turns)
    queue = Queue(turns)
    cancel = threading.Event()
    queue.add("A1", "A", cancel)
    queue.add("B1", "B")
    cancel.set()
    _wait(lambda: queue.order == ["A1 cancelled"])  # gone while the model is still held
    assert turns.waiting() == 1
    release.set()
    holder.join(10)
    queue.join()
    assert queue.order == ["A1 cancelled", "B1"]


def test_a_request_between_two_of_its_steps_keeps_its_turn():
    """The model is free, A waits, but B (which computed less) is between two steps: A waits on."""
    clock = Clock()
    turns = Turns(clock=clock)
    _compute(turns, clock, "A", 5.0)
    queue = Queue(turns)
    with turns.request("B") as b:
        queue.add("A1", "A")
        time.sleep(3 * CANCEL_POLL)  # A1 rechecks at least twice meanwhile; it must not take the turn
        assert queue.order == []
        with turns.step(b):
            queue.order.append("B step")
    queue.join()  # B's request ended: A1's turn
    assert queue.order == ["B step", "A1"]
