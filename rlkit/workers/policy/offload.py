"""A trained model's GPU memory lent to a colocated vLLM while it generates (policy.offload).

Storages are emptied in place (every view of them, Megatron's parameter views into its flat
buffers included, stays valid) and refilled on wake, so nothing is rebuilt. What must survive goes
to pinned host buffers that are allocated once and reused every step, with asynchronous copies
and one synchronisation per direction: a fresh `.cpu().pin_memory()` per step ran at about
1.2 GB/s on an H100, the reused pinned buffers at about 55 GB/s
(benchmarks/results/kernel_probe_h100.md).
"""

import time

import torch


class HostOffload:
    def __init__(self, pin: bool):
        """pin: pinned host buffers (asynchronous DMA); False only where no accelerator can pin."""
        self.pin = pin
        self.host: dict[int, torch.UntypedStorage] = {}  # storage identity -> its host buffer, reused
        self.asleep: list[tuple[torch.UntypedStorage, int, bool]] = []  # (storage, bytes, kept)

    def sleep(self, keep: list[torch.UntypedStorage], drop: list[torch.UntypedStorage]) -> tuple[int, float]:
        """Copy `keep` to host, then free `keep` and `drop` on the device. Returns (bytes copied,
        seconds)."""
        start = time.perf_counter()
        self.host = {key: self.host[key] for key in map(_identity, keep) if key in self.host}  # drop stale ones
        for storage in keep:
            buffer = self.host.get(_identity(storage))
            if buffer is None or buffer.nbytes() != storage.nbytes():
                buffer = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=self.pin).untyped_storage()
                self.host[_identity(storage)] = buffer
            buffer.copy_(storage, non_blocking=self.pin)
        _wait_for_copies()  # before the memory is freed and handed back to the driver
        self.asleep = [(s, s.nbytes(), True) for s in keep] + [(s, s.nbytes(), False) for s in drop]
        for storage, _, _ in self.asleep:
            storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return sum(s.nbytes() for s in self.host.values()), time.perf_counter() - start

    def wake(self) -> tuple[int, float]:
        """Undo sleep(): reallocate every storage, copy the kept ones back, zero the dropped ones
        (gradient buffers, zeroed before each step anyway). Returns (bytes copied, seconds)."""
        start, copied = time.perf_counter(), 0
        for storage, nbytes, kept in self.asleep:
            storage.resize_(nbytes)
            if kept:
                storage.copy_(self.host[_identity(storage)], non_blocking=self.pin)
                copied += nbytes
            else:
                storage.fill_(0)
        _wait_for_copies()
        self.asleep = []
        return copied, time.perf_counter() - start

    @property
    def is_asleep(self) -> bool:
        return bool(self.asleep)


def _identity(storage: torch.UntypedStorage) -> int:
    """The storage itself (its C++ object), unchanged when resize_ moves its memory."""
    return storage._cdata


def _wait_for_copies():
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def pinned_bandwidth(gbytes: float = 0.5, repeats: int = 3) -> dict:
    """GB/s of device->host and host->device copies between a device buffer and a pinned host
    buffer: the ceiling sleep and wake are measured against, in the same run."""
    device = torch.empty(int(gbytes * 1e9), dtype=torch.uint8, device="cuda")
    host = torch.empty(device.shape, dtype=torch.uint8, pin_memory=True)
    rates = {}
    for name, copy in [("d2h", lambda: host.copy_(device, non_blocking=True)),
                       ("h2d", lambda: device.copy_(host, non_blocking=True))]:
        copy()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            copy()
        torch.cuda.synchronize()
        rates[name] = gbytes * repeats / (time.perf_counter() - start)
    return rates
