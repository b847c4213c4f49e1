"""HostOffload on a GPU: bytes survive a sleep/wake round trip, the pinned host buffers are reused,
and the copies run near the pinned bandwidth measured in the same test."""

import torch

from rlkit.workers.policy.offload import HostOffload, pinned_bandwidth


def test_sleep_and_wake_move_the_bytes_at_pinned_speed():
    gbytes = 2.0
    weights = torch.randn(int(gbytes * 1e9) // 4, device="cuda")
    expected = weights.clone().cpu()
    grads = torch.ones(1 << 20, device="cuda")
    offload = HostOffload(pin=True)
    ceiling = pinned_bandwidth(gbytes=1.0)
    rates, buffers = [], set()
    for _ in range(3):
        free_before = torch.cuda.mem_get_info()[0]
        nbytes = weights.untyped_storage().nbytes()
        copied, sleep_s = offload.sleep([weights.untyped_storage()], [grads.untyped_storage()])
        assert copied == nbytes
        assert torch.cuda.mem_get_info()[0] - free_before >= 0.9 * gbytes * 1e9  # given back to the driver
        buffers |= {b.data_ptr() for b in offload.host.values()}
        _, wake_s = offload.wake()
        rates.append((copied / sleep_s / 1e9, copied / wake_s / 1e9))
        assert torch.equal(weights.cpu(), expected) and not grads.any()
    assert len(buffers) == 1  # one pinned buffer, allocated at the first sleep and reused
    sleep_rate, wake_rate = max(r[0] for r in rates[1:]), max(r[1] for r in rates[1:])
    print(f"sleep {sleep_rate:.1f} GB/s, wake {wake_rate:.1f} GB/s; pinned d2h {ceiling['d2h']:.1f}, "
          f"h2d {ceiling['h2d']:.1f} GB/s")
    assert sleep_rate >= 0.7 * ceiling["d2h"] and wake_rate >= 0.7 * ceiling["h2d"]
