"""The background layer: workers (threads or processes) that produce items ahead of the
consumer, shared by every background stage.

- `errors`: `WorkerError`, and how a worker's exception reaches the consumer.
- `lifecycle`: start methods, starting and stopping worker processes, the registry of
  live workers (stopped at exit), the timeouts, and `wait_for`: the consumer's one wait
  loop (interrupts, worker death, last words).
- `worker_gc`: the garbage collector of worker processes (`set_worker_gc`).
- `wire`: how objects and bytes cross a process boundary (cloudpickle for pipelines,
  framed messages on pipes that the reader polls, so that a dead writer never hangs it).
- `shm`: the shared-memory transport of the large numpy arrays and torch tensors that
  worker processes send (pooled segments, unlinked once mapped); `segments`: creating,
  mapping and naming the segments, registered with the resource tracker;
  `shm_broadcast`: one copy of an item's arrays for every fan-out consumer process;
  `shm_arrays`: arrays made in shared memory, which a fan-out sends without a copy.
- `messages`: the typed messages between workers and the consumer.
- `channels`: one producer worker (thread or process) behind a bounded buffer.
- `pool`: the workers of a parallel map (processes or threads).
- `readers`: chunks read ahead by threads of the consumer's process (`SelectManyIterator`).
- `cursor`: the consumer's position: a source snapshot and the items consumed since.
- `stage`: `BackgroundStage`, the base of `PrefetchIterator` and `ParallelMapIterator`.
- `stacks`: the stacks of this process's threads and of its worker processes (for the
  `Watchdog`'s reports).
- `watchdog`: `Watchdog`, which names the stage a waiting consumer is stuck on.
- `fanout_hub`, `fanout_server`: the book of a fan-out (one upstream, the position of each
  consumer) and the owner's side of consumers in other processes.
"""

from .errors import WorkerError
from .shm_arrays import empty_shared_pool, shared_empty, shared_zeros
from .stage import start_background
from .watchdog import StallError, Watchdog
from .worker_gc import set_worker_gc

__all__ = [
    "StallError",
    "Watchdog",
    "WorkerError",
    "empty_shared_pool",
    "set_worker_gc",
    "shared_empty",
    "shared_zeros",
    "start_background",
]
