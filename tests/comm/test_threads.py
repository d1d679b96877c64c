"""What only the threads engine has to get right: no thread left behind, hangs turned into errors.

The engine contract suite (test_contract.py) runs on threads through
engines.py; these tests cover failure handling inside one process, where a
blocked thread cannot be killed and must be woken instead.
"""

import threading
import time

import pytest
import torch

from bfexp.errors import CommError
from bfexp.comm.threads import RankAborted, ThreadWorld, current_rank, routed_output, run_threads

JOIN_S = 60.0  # hang protection only


def run_world(size: int, target) -> ThreadWorld:
    world = ThreadWorld(size)
    world.start(target)
    assert world.join(JOIN_S), f"ranks {world.alive()} still running"
    return world


def messages(world: ThreadWorld) -> dict[int, str]:
    return {r: f"{type(e).__name__}: {e}" for r, e in sorted(world.errors.items())}


def test_a_raising_rank_stops_every_rank_and_no_thread_is_left():
    """Rank 5 raises while the others are blocked in a collective, in a neighbor exchange, or computing."""
    before = threading.active_count()

    def target(e):
        x = torch.ones(4)
        for step in range(1_000_000):
            if e.rank == 5 and step == 3:
                raise ValueError("boom")
            if e.rank == 6:
                sum(range(20_000))  # outside the engine when the failure comes
            x = e.neighbor_allreduce(x, 0.5, {(e.rank - 1) % e.size: 0.5}, [(e.rank + 1) % e.size])
            e.barrier()

    world = run_world(8, target)
    assert isinstance(world.errors[5], ValueError)
    for r in set(range(8)) - {5}:
        assert isinstance(world.errors[r], RankAborted), messages(world)
        assert str(world.errors[r]) == "rank 5 failed: ValueError: boom"
    assert world.alive() == [] and threading.active_count() == before
    with pytest.raises(ValueError, match="boom"):  # run_threads re-raises the rank's own error
        run_threads(3, lambda e: (_ for _ in ()).throw(ValueError("boom")) if e.rank == 1 else e.barrier())


@pytest.mark.parametrize("slots", [None, 1])
def test_a_collective_that_completed_returns_even_when_a_member_fails_right_after(slots):
    """As on MPI: rank 1 completes the allreduce rank 0 is waiting in, then raises. Rank 0 gets the sum
    (then RankAborted at its next call), so what it does in between (a checkpoint's commit) happens.
    Rank 0 waited first 20 times over; it used to see the failure instead in about 4 of 10.

    slots=1: rank 1 keeps the one running slot computing, and reporting its failure, after the allreduce;
    rank 0's allreduce is done but its slot is not free when the failure wakes it. It still gets the sum
    (CI lost a checkpoint's commit this way: the rank that failed ran on through local steps)."""
    for _ in range(20 if slots is None else 1):
        world = ThreadWorld(2, running=slots)
        got: dict[int, list] = {}

        def main(engine):
            if engine.rank == 1:
                time.sleep(0.02)  # rank 0 is inside the allreduce when rank 1 completes it
            got[engine.rank] = engine.allreduce(torch.ones(3), op="sum").tolist()
            if engine.rank == 1:
                time.sleep(0.1 if slots else 0.0)  # computing, the only slot held
                raise ValueError("right after the allreduce")
            engine.barrier()

        world.start(main, (lambda rank, exc: time.sleep(0.3)) if slots else None)
        assert world.join(10)
        assert got.get(0) == [2.0, 2.0, 2.0], messages(world)
        assert isinstance(world.errors[0], RankAborted) and isinstance(world.errors[1], ValueError)


def test_an_abort_from_outside_wakes_every_blocked_rank():
    """What the launcher does on SIGINT/SIGTERM or timeout: ranks blocked forever end at once."""
    release = threading.Event()
    world = ThreadWorld(4)
    world.start(lambda e: e.barrier() if e.rank else release.wait(JOIN_S) or e.barrier())
    deadline = time.monotonic() + JOIN_S
    while len(world.waiting()) < 3 and time.monotonic() < deadline:  # ranks 1-3 blocked, waiting for rank 0
        time.sleep(0.01)
    world.abort(RankAborted("interrupted by SIGTERM"))
    release.set()  # rank 0 comes back from its compute and meets the abort at its next engine call
    assert world.join(JOIN_S)
    assert set(messages(world).values()) == {"RankAborted: interrupted by SIGTERM"}


def test_operations_in_different_orders_raise_instead_of_hanging():
    def target(e):
        x = torch.ones(2)
        peer = 1 - e.rank
        if e.rank == 0:
            e.barrier()
            e.neighbor_allreduce(x, 0.5, {peer: 0.5}, [peer])
        else:
            e.neighbor_allreduce(x, 0.5, {peer: 0.5}, [peer])
            e.barrier()

    errors = messages(run_world(2, target))
    expected = (
        "CommError: deadlock: rank 0 waits in barrier for rank 1; rank 1 waits in neighbor_allreduce for rank 0 "
        "(the ranks called operations in different orders)"
    )
    assert errors == {0: expected, 1: expected}


def test_waiting_for_a_rank_that_returned_raises():
    def target(e):
        if e.rank != 1:
            e.allreduce(torch.ones(3))

    errors = messages(run_world(3, target))
    assert set(errors) == {0, 2}
    assert all("allreduce waits for rank 1, which has already returned" in m for m in errors.values())


def test_different_collectives_at_the_same_point_raise():
    def target(e):
        if e.rank == 0:
            e.allreduce(torch.ones(3))
        else:
            e.broadcast(torch.ones(3), root=0)

    errors = messages(run_world(2, target))
    assert set(errors) == {0, 1}
    assert all(m.startswith("CommError: collective #1 does not match: rank ") for m in errors.values()), errors


def test_mismatch_raises_on_every_rank_and_the_engine_stays_usable():
    """Rank 2 expects from rank 0, which sends to nobody; afterwards an allreduce still works."""

    def target(e):
        try:
            e.neighbor_allreduce(torch.ones(2), 0.5, {0: 0.5} if e.rank == 2 else {}, [])
        except CommError as exc:
            failure = str(exc)
        else:
            failure = None
        return failure, e.allreduce(torch.full((2,), float(e.rank)), op="sum").tolist()

    results = run_threads(3, target)
    expected = (
        "neighbor_allreduce: send/receive declarations do not match: "
        "rank 2 expects to receive from rank 0, but rank 0 does not send to rank 2"
    )
    assert results == [(expected, [3.0, 3.0])] * 3


def test_rank_output_lands_in_its_log(tmp_path, capsys):
    def target(e):
        print(f"hello from {current_rank()}")

    with routed_output(tmp_path / "logs"):
        run_threads(3, target)
        print("driver line")
    for r in range(3):
        assert (tmp_path / "logs" / f"rank{r}.log").read_text() == f"hello from {r}\n"
    assert capsys.readouterr().out == "driver line\n"
