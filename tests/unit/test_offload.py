"""HostOffload: storages emptied in place and refilled with their bytes; host buffers reused."""

import torch

from rlkit.workers.policy.offload import HostOffload


def test_sleep_and_wake_keep_what_must_survive_and_reuse_the_host_buffers():
    weights, state, grads = torch.randn(1000), torch.randn(300, dtype=torch.float64), torch.ones(500)
    view = weights[10:20]  # a view into a flat buffer, as Megatron's parameters are
    expected_weights, expected_state = weights.clone(), state.clone()
    offload = HostOffload(pin=False)
    buffers = None
    for _ in range(3):
        copied, seconds = offload.sleep([weights.untyped_storage(), state.untyped_storage()],
                                        [grads.untyped_storage()])
        assert copied == 1000 * 4 + 300 * 8 and seconds >= 0 and offload.is_asleep
        assert weights.untyped_storage().nbytes() == 0 and grads.untyped_storage().nbytes() == 0
        now = [b.data_ptr() for b in offload.host.values()]
        assert buffers is None or now == buffers  # allocated once, reused every step
        buffers = now
        copied, _ = offload.wake()
        assert copied == 1000 * 4 + 300 * 8 and not offload.is_asleep
        assert torch.equal(weights, expected_weights) and torch.equal(state, expected_state)
        assert torch.equal(view, expected_weights[10:20])
        assert torch.equal(grads, torch.zeros(500))  # dropped: zero on wake
        weights.add_(1.0)  # training changes the weights between sleeps
        expected_weights += 1.0


def test_a_storage_that_is_gone_frees_its_host_buffer():
    first, second = torch.randn(100), torch.randn(200)
    expected = second.clone()
    offload = HostOffload(pin=False)
    offload.sleep([first.untyped_storage(), second.untyped_storage()], [])
    offload.wake()
    offload.sleep([second.untyped_storage()], [])  # e.g. the optimizer was rebuilt
    assert len(offload.host) == 1
    offload.wake()
    assert torch.equal(second, expected)
