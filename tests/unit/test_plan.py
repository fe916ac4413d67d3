"""Plan construction details not tied to one planner."""

from flashcp.plan import Shard, make_plan


def test_make_plan_merges_contiguous_pieces_anywhere_in_a_ranks_order():
    # rank 0 holds doc 0's tokens 6..8 and 4..6 apart in its order: one shard (0, 4, 4), at the
    # place of the first piece, and it is the document's last shard, so it is not sent
    plan = make_plan(
        "x", 2, [8, 4], [0, 0, 0, 1, 1], [0, 1, 0, 0, 1], [6, 0, 4, 0, 2], [2, 2, 2, 4, 2]
    )
    assert plan.ranks() == [[Shard(0, 4, 4), Shard(1, 0, 2)], [Shard(0, 0, 4), Shard(1, 2, 2)]]
    assert plan.send_tokens_per_rank.tolist() == [2, 4]
    assert plan.comm_tokens == 4


def test_make_plan_keeps_each_ranks_order_and_drops_empty_pieces():
    plan = make_plan("x", 2, [3, 3], [1, 0, 1, 0], [0, 1, 0, 0], [2, 0, 0, 0], [1, 3, 2, 0])
    assert plan.ranks() == [[Shard(1, 0, 3)], [Shard(0, 0, 3)]]  # (0, 0, 2) + (0, 2, 1) merged
