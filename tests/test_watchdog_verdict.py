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


def test_a_computing_rank_is_not_named_and_nothing_is_a_hang_before_timeout():
    beats = {}
    dog = Watchdog(2.0, 2, lambda: dict(beats), processes=False)
    dog.check_s = 0.0
    for now in (0.0, 1.0, 1.9):
        beats = {0: beat(0, "allreduce", 1.0, "hostA", now), 1: beat(1, None, 1.0, "hostB", now)}
        assert dog.check(now) is None
    beats = {0: beat(0, "allreduce", 1.0, "hostA", 2.5), 1: beat(1, None, 1.0, "hostB", 2.5)}
    assert [s["rank"] for s in dog.check(2.5)] == [0]
