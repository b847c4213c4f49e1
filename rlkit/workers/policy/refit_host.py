"""A training backend's rank hosting its half of refit (rlkit/refit/sender.py): the TrainingBackend
methods the refit driver calls, over the rank's RefitSender (self.refit_sender)."""

from typing import Iterator

from rlkit.observability.profiling import profiled
from rlkit.refit.delta import EncodedBucket
from rlkit.refit.plan import PackedBucket, RefitPlan
from rlkit.refit.sender import SentRefit


class RefitHost:
    def refit_manifest(self) -> list[tuple[str, tuple[int, ...], str]]:
        return self.refit_sender.manifest()

    def stream_refit_buckets(self, plan: RefitPlan, with_checksum: bool, delta: bool = False,
                             base_held: bool = False) -> Iterator[PackedBucket | EncodedBucket]:
        yield from self.refit_sender.stream_buckets(plan, with_checksum, delta, base_held)

    def join_refit_communicator(self, transport: str, host: str, port: int, world_size: int, timeout_s: float):
        self.refit_sender.join(transport, host, port, world_size, timeout_s)

    def refit_gpu(self) -> str:
        """This rank's GPU, as the engine process beside it finds it (cuda_ipc)."""
        from rlkit.refit.transports.cuda_ipc import gpu_identity
        return gpu_identity()

    def open_refit_channel(self, transport: str, receivers: int, timeout_s: float, channel_host: str) -> tuple:
        """channel_host (refit.channel_host): loopback, or node_ip for receivers on other nodes."""
        import ray

        host = "127.0.0.1" if channel_host == "loopback" else ray.util.get_node_ip_address()
        return self.refit_sender.open_channel(transport, receivers, timeout_s, host)

    @profiled
    def send_refit(self, plan: RefitPlan, with_checksum: bool, delta: bool = False) -> SentRefit:
        return self.refit_sender.send(plan, with_checksum, delta)

    def refit_stats(self) -> SentRefit | None:
        return self.refit_sender.sent()
