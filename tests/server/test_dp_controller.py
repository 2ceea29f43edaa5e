"""The DP controller's choice: a named rank wins, else round robin over live ranks or the fewest in flight."""

from __future__ import annotations

import pytest

from sglang_lite.server.dp_controller import DPController, InvalidRank, requested_rank


def test_named_rank_wins_over_the_method() -> None:
    controller = DPController(4, "shortest_queue")
    assert controller.pick(3, live=[0, 1, 2, 3], in_flight=[0, 0, 0, 9]) == 3
    assert (
        requested_rank(None, 2) == 2
        and requested_rank(1, 2) == 1
        and requested_rank(None, None) is None
    )


@pytest.mark.parametrize("rank", [-1, 4])
def test_named_rank_out_of_range_is_refused(rank: int) -> None:
    with pytest.raises(InvalidRank, match=r"routed_dp_rank must be in \[0, 4\)"):
        DPController(4, "round_robin").pick(rank, live=[0, 1, 2, 3], in_flight=[0] * 4)


def test_round_robin_cycles_over_live_ranks_only() -> None:
    controller = DPController(3, "round_robin")
    assert [controller.pick(None, live=[0, 2], in_flight=[0, 0, 0]) for _ in range(4)] == [
        0,
        2,
        0,
        2,
    ]


def test_shortest_queue_takes_the_fewest_in_flight_lowest_rank_on_ties() -> None:
    controller = DPController(3, "shortest_queue")
    assert controller.pick(None, live=[0, 1, 2], in_flight=[2, 1, 1]) == 1
    assert controller.pick(None, live=[0, 2], in_flight=[2, 0, 1]) == 2
