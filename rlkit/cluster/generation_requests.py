"""Generation requests of independent trajectories (env_runner.flow=per_trajectory): one prompt
each, from many trajectories at once, answered one by one as the engines finish them."""

import asyncio
import time

from rlkit.cluster.groups import GenerationWorkers
from rlkit.cluster.worker_group import WorkerError
from rlkit.data.generation import SamplingParams
from rlkit.workers.generation.base import GenerationWorker as Engine


class GenerationRequests:
    """Whenever an engine is free it takes its share of the requests waiting (vLLM batches them
    continuously; an HF worker runs them one after another). Each request is sampled on its own
    seed, independently of the requests beside it (GenerationWorker.generate_requests), so which
    engine takes it, and when, does not change its answer. For one event loop:

        async with GenerationRequests(generation) as engines:
            token_ids, logprobs = await engines.generate(prompt_ids, params)
    """

    def __init__(self, generation: GenerationWorkers):
        self.workers = generation.workers
        self.waiting: list[tuple[list[int], SamplingParams, asyncio.Future]] = []
        self.arrived = asyncio.Event()
        self.free_engines = len(self.workers)
        self.busy_seconds = 0.0  # added up over the engines: how long each had requests in flight

    async def __aenter__(self) -> "GenerationRequests":
        self.engines = [asyncio.create_task(self._serve(rank)) for rank in range(len(self.workers))]
        return self

    async def __aexit__(self, *exc_info) -> None:
        for engine in self.engines:
            engine.cancel()
        await asyncio.gather(*self.engines, return_exceptions=True)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], list[float]]:
        """The generated token ids and their sampler logprobs (as Generations holds them)."""
        answer = asyncio.get_running_loop().create_future()
        self.waiting.append((prompt_ids, params, answer))
        self.arrived.set()
        return await answer

    async def _serve(self, rank: int) -> None:
        while True:
            await self.arrived.wait()
            # the free engines split what waits (a burst of first turns goes to all of them)
            share = -(-len(self.waiting) // self.free_engines)
            taken, self.waiting = self.waiting[:share], self.waiting[share:]
            if not self.waiting:
                self.arrived.clear()
            if not taken:
                continue
            self.free_engines -= 1
            start = time.perf_counter()
            try:
                (ref,) = self.workers.submit(Engine.generate_requests, [p for p, _, _ in taken],
                                             [q for _, q, _ in taken], ranks=[rank])
                out = await asyncio.wait_for(ref, self.workers.timeout_s)
                for (_, _, answer), token_ids, logprobs in zip(taken, out.token_ids, out.logprobs):
                    answer.set_result((token_ids, logprobs))
            except Exception as e:  # noqa: BLE001 - raised in the trajectories that wait for these answers
                error = WorkerError(f"{self.workers.role} worker {rank} did not finish 'generate_requests' within "
                                    f"{self.workers.timeout_s:.0f}s (cluster.call_timeout_s)"
                                    if isinstance(e, asyncio.TimeoutError) else
                                    f"{self.workers.role} worker {rank} failed in 'generate_requests': {e}")
                for _, _, answer in taken:
                    answer.set_exception(error)
            finally:
                self.free_engines += 1
                self.busy_seconds += time.perf_counter() - start
