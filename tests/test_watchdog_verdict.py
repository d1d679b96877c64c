"""The watchdog's verdict from heartbeats made up here: who counts as stuck, and who is named beside them."""

from bfexp.watchdog import Watchdog


def beat(rank, op, comm, host, t):
    return {"rank": rank, "pid": 100 + rank, "host": host, "step": 7, "comm_time_s": comm, "op": op,
            "where": "bfexp/algorithms/dsgd.py:80", "time": t, "engine": True}


def test_a_rank_still_moving_bytes_is_named_beside_the_stuck_one():
    """Rank 0 waits in one call for 2 s; rank 1, on a slow host, completes a call now and then (its counter
    moves) and has just entered another: the verdict names both, rank 1 as in communication."""
    beats = {}
    dog = Watchdog(2.0, 2, lambda: dict(beats), processes=False)
    dog.check_s = 0.0
    for k, now in enumerate((0.0, 0.5, 1.0, 1.5)):
        beats = {0: beat(0, "neighbor_allreduce", 1.0, "hostA", now), 1: beat(1, "neighbor_allreduce", 1.0 + k, "hostB", now)}
        assert dog.check(now) is None
    beats = {0: beat(0, "neighbor_allreduce", 1.0, "hostA", 2.1), 1: beat(1, "neighbor_allreduce", 9.0, "hostB", 2.1)}
    stuck = dog.check(2.1)
    assert [(s["rank"], s["why"]) for s in stuck] == [(0, "blocked in communication"), (1, "in communication")]
    assert stuck[0]["stalled_s"] >= 2.0 and stuck[1]["stalled_s"] == 0.0
    line = dog.describe(stuck)
    assert "rank 0 on hostA: blocked in communication" in line and "rank 1 on hostB: in communication" in line


def test_nothing_is_a_hang_before_timeout_and_a_rank_outside_communication_is_named_beside_it():
    """Rank 0 waits in one call; rank 1, alive, is in no communication call (it has not arrived: computing, or
    held outside the calls bfexp tracks, as CI's link_blip under srun showed). No hang before timeout_s; then
    rank 0 is the stuck one and rank 1 is named beside it, without counting as stuck itself."""
    beats = {}
    dog = Watchdog(2.0, 2, lambda: dict(beats), processes=False)
    dog.check_s = 0.0
    for now in (0.0, 1.0, 1.9):
        beats = {0: beat(0, "allreduce", 1.0, "hostA", now), 1: beat(1, None, 1.0, "hostB", now)}
        assert dog.check(now) is None
    beats = {0: beat(0, "allreduce", 1.0, "hostA", 2.5), 1: beat(1, None, 1.0, "hostB", 2.5)}
    stuck = dog.check(2.5)
    assert [(s["rank"], s["why"], s["stalled_s"] > 0) for s in stuck] == [
        (0, "blocked in communication", True), (1, "outside communication", False)]
    assert "rank 1 on hostB: outside communication at step 7" in dog.describe(stuck)


def test_ranks_outside_communication_alone_are_no_hang():
    """Every rank computing (no communication call) for longer than timeout_s is a slow step, not a hang."""
    beats = {}
    dog = Watchdog(2.0, 2, lambda: dict(beats), processes=False)
    dog.check_s = 0.0
    for now in (0.0, 1.0, 2.5, 5.0):
        beats = {r: beat(r, None, 1.0, "hostA", now) for r in (0, 1)}
        assert dog.check(now) is None
