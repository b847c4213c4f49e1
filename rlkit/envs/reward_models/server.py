"""A model that the environment workers share: one Ray actor (ModelServer) holds it and runs the
workers' requests in batches, and each worker's environment reaches it through a ModelHandle.

The server gathers requests into a batch until it holds batch_size of them, or one from each
worker (each steps one call at a time, so env_runner.num_workers bounds a batch), or max_wait_s
has passed since the first; while a batch runs, the next one gathers. With cache_size > 0 the
server answers a request it answered before (or is answering now) from its cache: for a model
whose answer depends on the request alone (a greedy judge).

The environment pool starts the server before its workers (Environment.start_services) and stops
it with them, so a replaced worker leaves it running. Where no pool started one (`rlkit env
check`), the ModelHandle loads the model in its own process.
"""

import asyncio
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from rlkit.envs.base import Environment

# a batch of requests -> one answer per request, in order
BatchModel = Callable[[list], list]


@dataclass(frozen=True)
class ServerSettings:
    """The env.* keys of a model server, shared by the model environments."""
    num_gpus: float  # GPUs of the server's own (0: on CPU)
    batch_size: int  # most requests in one batch
    max_wait_s: float  # how long a batch waits for more requests after its first
    timeout_s: float  # how long a request may wait for its answer: past it, the call fails as a timeout
    load_timeout_s: float  # how long a worker waits for the server to load its model

    def problem(self) -> str | None:
        """One line naming the env key out of its range, or None."""
        if self.batch_size < 1:
            return f"env.batch_size: must be >= 1 (got: {self.batch_size}); give the most requests one batch holds"
        if not (math.isfinite(self.num_gpus) and self.num_gpus >= 0):
            return f"env.num_gpus: must be >= 0 (got: {self.num_gpus}); 0 runs the model on CPU"
        if not (math.isfinite(self.max_wait_s) and self.max_wait_s >= 0):
            return f"env.max_wait_s: must be a finite number of seconds >= 0 (got: {self.max_wait_s}); e.g. 0.02"
        for key in ("timeout_s", "load_timeout_s"):
            seconds = getattr(self, key)
            if not (math.isfinite(seconds) and seconds > 0):
                return f"env.{key}: must be a finite number of seconds > 0 (got: {seconds}); e.g. 60"
        return None

    def start(self, load: Callable[[], BatchModel], cache_size: int = 0):
        """The server actor, loading its model (load() in its process). num_cpus=0: the run's
        placement group may hold every CPU of the cluster."""
        import ray  # here, not above: a config's checks read this module and import no ray

        return ray.remote(ModelServer).options(num_cpus=0, num_gpus=self.num_gpus).remote(
            load, self.batch_size, self.max_wait_s, cache_size)


def shared_gpus(env: dict | None) -> float:
    """The GPU share below a whole GPU that the environment's model servers ask for (env.num_gpus,
    or its combined parts'): the run's placement leaves it free on each of its GPUs, so a small
    model runs beside a colocated policy on one GPU. A server of whole GPUs needs GPUs of its own."""
    if env is None:
        return 0.0
    parts = [part for part in (env.get("parts") or {}).values() if isinstance(part, dict)]
    return sum(gpus for gpus in [env.get("num_gpus") or 0, *(p.get("num_gpus") or 0 for p in parts)] if 0 < gpus < 1)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


class ModelServer:
    """The Ray actor holding one model. A model that fails to load leaves the actor up with the
    reason, which ready() gives every worker as one line; its requests fail with it too."""

    def __init__(self, load: Callable[[], BatchModel], batch_size: int, max_wait_s: float, cache_size: int):
        try:
            self.model, self.problem = load(), None
        except Exception as e:  # noqa: BLE001 - any failure to load is the workers' to report
            self.model, self.problem = None, first_line(e)
        self.batch_size, self.max_wait_s, self.cache_size = batch_size, max_wait_s, cache_size
        self.cache: OrderedDict[Any, Any] = OrderedDict()  # request -> answer, least recently used first
        self.in_flight: dict[Any, asyncio.Future] = {}  # a cached model's requests queued or running
        self.queue: asyncio.Queue | None = None  # made in the actor's event loop, at the first request
        self.clients = 0  # workers that registered; one that died still counts, and its peers' batches then wait

    async def ready(self) -> str | None:
        """None when the model is loaded, else why it is not."""
        return self.problem

    async def register(self) -> None:
        """A worker that sends one request at a time: a batch holding as many requests as there
        are such workers is closed without waiting for more."""
        self.clients += 1

    async def submit(self, request) -> tuple[Any, bool]:
        """(the model's answer to the request, whether it came from the cache)."""
        if self.problem:
            raise RuntimeError(self.problem)
        if request in self.cache:
            self.cache.move_to_end(request)
            return self.cache[request], True
        if request in self.in_flight:
            return await self.in_flight[request], True
        future = asyncio.get_running_loop().create_future()
        if self.cache_size:
            self.in_flight[request] = future
        if self.queue is None:
            self.queue = asyncio.Queue()
            asyncio.get_running_loop().create_task(self._serve())
        self.queue.put_nowait((request, future))
        return await future, False

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch(loop)
            requests = [request for request, _ in batch]
            try:
                # in a thread: the event loop goes on taking requests into the next batch meanwhile
                answers = await loop.run_in_executor(None, self.model, requests)
            except Exception as e:  # noqa: BLE001 - each request of the batch fails with it, the server goes on
                for request, future in batch:
                    self.in_flight.pop(request, None)
                    future.set_exception(e)
                continue
            for (request, future), answer in zip(batch, answers):
                self._remember(request, answer)
                future.set_result(answer)

    async def _next_batch(self, loop) -> list[tuple[Any, asyncio.Future]]:
        batch = [await self.queue.get()]
        deadline = loop.time() + self.max_wait_s
        while len(batch) < min(self.batch_size, self.clients or self.batch_size):
            if self.queue.empty():
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), left))
                except asyncio.TimeoutError:
                    break
            else:
                batch.append(self.queue.get_nowait())
        return batch

    def _remember(self, request, answer) -> None:
        if not self.cache_size:
            return
        self.in_flight.pop(request, None)
        self.cache[request] = answer
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)


class ModelHandle:
    """An environment worker's way to its model: the pool's server, or (server None) the model
    loaded here. `what` names the model in errors, e.g. "reward model /ckpt/rm"."""

    def __init__(self, server, load: Callable[[], BatchModel], what: str, settings: ServerSettings):
        import ray

        self.server, self.what, self.settings = server, what, settings
        self.local = load() if server is None else None
        if server is not None:
            self._wait_until_loaded()
            ray.get(server.register.remote())

    def _wait_until_loaded(self) -> None:
        import ray

        try:
            problem = ray.get(self.server.ready.remote(), timeout=self.settings.load_timeout_s)
        except ray.exceptions.GetTimeoutError:
            gpus = f" and {self.settings.num_gpus} GPU(s) that no other worker holds" if self.settings.num_gpus else ""
            raise RuntimeError(f"{self.what} did not load within {self.settings.load_timeout_s} s "
                               f"(env.load_timeout_s): its server needs the time to load it{gpus}; raise "
                               f"env.load_timeout_s, or free the GPUs") from None
        if problem:
            raise RuntimeError(f"{self.what} could not load: {problem}")

    def request(self, request) -> tuple[Any, bool]:
        """(the model's answer, whether the server answered from its cache). A request the server
        does not answer within env.timeout_s raises TimeoutError: the runner counts a timeout."""
        if self.server is None:
            return self.local([request])[0], False
        import ray

        try:
            return ray.get(self.server.submit.remote(request), timeout=self.settings.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{self.what} did not answer within {self.settings.timeout_s} s (env.timeout_s); "
                               f"raise it, or env.batch_size for fewer, larger batches") from None


class ServedModelEnv(Environment):
    """An environment whose model its workers share through a ModelServer that the pool starts
    (in its own process where no pool does). A subclass sets `service` (its server's name, and
    the model's in errors), `model_path`, `settings` and `cache_size`, and gives `loader()`, what
    loads the model; setup() gives it `self.tokenizer` (the model's) and `self.model` (a
    ModelHandle)."""

    service: str
    model_path: str
    settings: ServerSettings
    cache_size: int = 0

    def loader(self) -> Callable[[], BatchModel]:
        raise NotImplementedError

    @classmethod
    def start_services(cls, **kwargs) -> dict:
        env = cls(**kwargs)
        return {env.service: env.settings.start(env.loader(), env.cache_size)}

    def setup(self) -> None:
        from rlkit.models.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(self.model_path)
        what = f"{self.service.replace('_', ' ')} {self.model_path}"
        self.model = ModelHandle(self.services.get(self.service), self.loader(), what, self.settings)
