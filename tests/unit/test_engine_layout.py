"""Where engines of several GPUs sit, and which policy rank feeds each of their processes."""

import pytest

from rlkit.cluster.placement import plan_placement
from rlkit.envs.reward_models.server import shared_gpus
from rlkit.refit.receiver import ANY_GPU, sender_for
from rlkit.refit.transport import BroadcastGroup, broadcast_groups


def test_colocated_engines_span_consecutive_bundles_each_shared_with_a_policy_rank():
    placement = plan_placement("colocated", num_policy=4, num_generation=2, device="GPU", engine_gpus=2)
    assert len(placement.bundles) == 4 and placement.policy_bundles == [0, 1, 2, 3]
    assert placement.engine_bundles == [[0, 1], [2, 3]]
    assert placement.generation_bundles == [0, 2]  # each engine's actor on its first bundle
    assert placement.share == 0.5


def test_disaggregated_engines_take_bundles_after_the_policy():
    placement = plan_placement("disaggregated", num_policy=1, num_generation=2, device="GPU", engine_gpus=2)
    assert len(placement.bundles) == 5
    assert placement.policy_bundles == [0] and placement.engine_bundles == [[1, 2], [3, 4]]


def test_one_gpu_engines_are_placed_as_before():
    placement = plan_placement("colocated", num_policy=2, num_generation=2, device="CPU")
    assert placement.engine_bundles == [[0], [1]] and placement.generation_bundles == [0, 1]


def test_a_model_servers_share_of_each_gpu_is_left_out_of_the_bundles():
    """A reward model of env.num_gpus=0.1 beside a colocated policy and engine on one GPU: the
    bundle holds the other 0.9, its two actors 0.45 each."""
    env = {"parts": {"correct": {"_target_": "rule"}, "preference": {"_target_": "rm", "num_gpus": 0.1}}}
    placement = plan_placement("colocated", num_policy=1, num_generation=1, device="GPU", server_gpus=shared_gpus(env))
    assert placement.bundles == [{"CPU": 1.0, "GPU": 0.9}] and placement.gpu_share == pytest.approx(0.45)
    assert shared_gpus({"num_gpus": 1}) == 0.0 and shared_gpus(None) == 0.0  # whole GPUs: GPUs of its own
    assert plan_placement("colocated", 1, 1, "CPU").gpu_share == 0.0
    with pytest.raises(ValueError, match="keep the sum below 1"):
        plan_placement("colocated", 1, 1, "GPU", server_gpus=shared_gpus({"parts": {
            "a": {"num_gpus": 0.5}, "b": {"num_gpus": 0.5}}}))


def test_colocated_engines_need_a_policy_rank_on_every_gpu():
    with pytest.raises(ValueError, match=r"x GPUs per engine \(4\) <= policy.num_workers \(2\)"):
        plan_placement("colocated", num_policy=2, num_generation=2, device="GPU", engine_gpus=2)


def test_each_engine_process_takes_the_sender_on_its_own_gpu():
    """An engine of two GPUs colocated with two policy ranks: the process on each GPU must map
    the slots of the rank on that GPU. Taking the first rank's (what a receiver that used rank
    0's metadata would do) would load bytes from another device."""
    senders = {"GPU-b": ("127.0.0.1", 2002), "GPU-a": ("127.0.0.1", 2001)}
    assert [sender_for(senders, gpu, "engine 0") for gpu in ("GPU-a", "GPU-b")] == [("127.0.0.1", 2001),
                                                                                    ("127.0.0.1", 2002)]


def test_a_gpu_without_a_policy_rank_is_named():
    with pytest.raises(RuntimeError, match="generation worker 1 runs on GPU GPU-c, which no policy rank shares"):
        sender_for({"GPU-a": ("127.0.0.1", 1)}, "GPU-c", "generation worker 1")


def test_one_sender_for_every_gpu():
    assert sender_for({ANY_GPU: ("10.0.0.1", 7)}, "GPU-z", "engine 3") == ("10.0.0.1", 7)


def test_one_broadcast_group_numbers_every_engine_process_after_policy_rank_0():
    group, = broadcast_groups("one", policy_ranks=2, engines=2, engine_gpus=2)
    assert group == BroadcastGroup(sender=0, engines=(0, 1), engine_gpus=2)
    assert group.world_size == 5 and [group.first_rank(e) for e in (0, 1)] == [1, 3]


def test_spread_groups_pair_engine_i_with_policy_rank_i():
    groups = broadcast_groups("spread", policy_ranks=3, engines=2, engine_gpus=2)
    assert [(g.sender, g.engines, g.world_size, g.first_rank(g.engines[0])) for g in groups] == [(0, (0,), 3, 1),
                                                                                                (1, (1,), 3, 1)]


def test_spread_groups_deal_more_engines_than_policy_ranks_round_robin():
    groups = broadcast_groups("spread", policy_ranks=2, engines=3, engine_gpus=1)
    assert [(g.sender, g.engines) for g in groups] == [(0, (0, 2)), (1, (1,))]
    assert groups[0].world_size == 3 and groups[0].first_rank(2) == 2


def test_spread_over_one_policy_rank_is_one_group():
    assert broadcast_groups("spread", 1, 3, 2) == broadcast_groups("one", 1, 3, 2)
