"""The workers of a parallel map: processes or threads applying a transform to `Task`s,
returning a `Result` per task (the outputs up to the first failure, and the failure)."""

from __future__ import annotations

import os
import pickle
import queue
import select
import threading
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from .._core.checks import batch_outputs
from .._core.notes import call_origin
from . import segments, shm, wire
from .errors import ErrorReport, WorkerError, died, local_error, report_error
from .lifecycle import (
    JOIN_S,
    Resource,
    get_context,
    parent_alive,
    queue_get,
    start_process,
    stop_process,
    wait_for,
    worker_setup,
)
from .messages import Result, Task
from .stacks import answers_dir
from .worker_gc import WorkerGC, worker_gc


def _apply(
    transform: Callable[[Any], Any], task: Task, owner: str, batched: bool
) -> tuple[list[Any], BaseException | None, str, float]:
    """The outputs of `transform` over the task's items (`batched`: one call on the list
    of them), up to an error if one is raised; the error, which call raised it (e.g.
    ``by ParallelMapIterator's transform f on item 7``), and the seconds it took if the
    task is `timed` (else 0)."""
    outputs: list[Any] = []
    start = time.perf_counter() if task.timed else 0.0
    try:
        if batched:
            outputs = batch_outputs(owner, transform, task.items)
        else:
            outputs.extend(map(transform, task.items))  # keeps the outputs before a failure
    except Exception as error:
        origin = call_origin(owner, "transform", transform, task.items[len(outputs)])
        if batched:
            origin += f" (the first of a batch of {len(task.items)})"
        return outputs, error, origin, _since(start)
    return outputs, None, "", _since(start)


def _since(start: float) -> float:
    return time.perf_counter() - start if start else 0.0


class Pool(Resource):
    """Workers applying a transform to tasks; `receive` returns any finished task's result."""

    def submit(self, task: Task) -> None:
        raise NotImplementedError

    def receive(self) -> Result:
        raise NotImplementedError


# -- processes -----------------------------------------------------------------------------


def _map_main(
    payload: bytes | None,
    transform: Callable[[Any], Any] | None,
    tasks: Connection,
    results: Connection,
    parent: int,
    owner: str,
    where: str,
    collector: WorkerGC,
    answers: str,
    batched: bool,
    incoming: str | None,
) -> None:
    """Entry point of a map worker process of `owner` (the stage's name); `answers`: where
    it writes its stacks when asked (`stacks.answers_dir`); `incoming`: the prefix of the
    names of the segments of the tasks it is sent (None: no transport)."""
    outgoing = shm.Outgoing() if shm.ENABLED else None

    def unlink_names() -> None:
        """What neither side will map any more: results not read, tasks not received."""
        if outgoing is not None:
            outgoing.unlink_names()
        if incoming is not None:
            segments.remove_prefixed(incoming)

    worker_setup(parent, unlink_names, collector, answers)
    if payload is not None:
        transform = pickle.loads(payload)
    assert transform is not None
    reader, out = wire.FrameReader(tasks.fileno()), results.fileno()
    try:
        while True:
            frame = wire.read_until(reader, lambda: parent_alive(parent), 1.0, 0.0)
            if frame is None:
                return
            task: Task | None = pickle.loads(frame)
            if task is None:
                return
            result = _result_frame(transform, task, owner, where, batched, outgoing)
            wire.write_frame(out, result)
    finally:  # stopped: what the other side did not map is of no use to it
        unlink_names()


def _result_frame(
    transform: Callable[[Any], Any],
    task: Task,
    owner: str,
    where: str,
    batched: bool,
    outgoing: shm.Outgoing | None,
) -> bytes:
    """The encoded `Result` of `task` (large arrays through `outgoing`'s shared memory). An
    output that cannot be pickled ends it like an error of the transform on that item: the
    outputs before it, then its pickling error."""
    outputs, error, origin, busy = _apply(transform, task, owner, batched)
    failure: ErrorReport | None = None
    if error is not None:
        failure = report_error(error, f"{origin}, {where}")
    try:
        return shm.encode(Result(task.number, outputs, failure, busy), outgoing)
    except Exception as pickling_error:
        found = wire.first_unpicklable(outputs)
        if found is None:  # each output pickles alone: the result as a whole did not
            failure = report_error(pickling_error, f"pickling the transform's outputs, {where}")
            return pickle.dumps(Result(task.number, [], failure, busy), wire.PROTOCOL)
        index, cause = found
        origin = call_origin(owner, "transform", transform, task.items[index])
        what = f"pickling the output returned {origin} (source position {task.first + index})"
        failure = report_error(cause, f"{what}, {where}")
        return shm.encode(Result(task.number, outputs[:index], failure, busy), outgoing)


class _Sender:
    """A thread of the consumer writing tasks to the workers' pipes, so that the consumer
    never blocks on a busy worker's full pipe."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[int, bytes] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name=f"infinibatch_like.{name}.sender", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        get = self._queue.get
        try:
            while (entry := get()) is not None:
                wire.write_frame(*entry)
        except OSError:  # a worker is gone; the consumer notices it
            pass

    def send(self, fd: int, data: bytes) -> None:
        self._queue.put((fd, data))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(JOIN_S)


class ProcessPool(Pool):
    """`num_processes` processes; a task goes to the one with the fewest unfinished tasks."""

    def __init__(
        self,
        transform: Callable[[Any], Any],
        num_processes: int,
        name: str,
        start_method: str | None,
        batched: bool = False,
    ) -> None:
        context = get_context(name, start_method)
        method = context.get_start_method()
        payload = None
        if method != "fork":
            payload = wire.dumps_for_worker(name, f"transform {transform!r}", transform, method)
        super().__init__()
        self._name = name
        where = f"in a worker process of {name}"
        self._processes: list[BaseProcess] = []
        self._pipes: list[Connection] = []  # the consumer's ends: tasks out, results in
        self._readers: dict[int, wire.FrameReader] = {}  # result fd -> reader
        self._task_fds: list[int] = []
        self._unfinished: list[int] = []
        self._worker_of: dict[int, int] = {}  # task number -> worker index
        self._outgoing: list[shm.Outgoing | None] = []  # the segments of each one's tasks
        self._poll = select.poll()
        self._sender = _Sender(name)
        try:
            for index in range(num_processes):
                task_reader, task_writer = context.Pipe(duplex=False)
                result_reader, result_writer = context.Pipe(duplex=False)
                self._pipes += [task_writer, result_reader]
                outgoing = shm.Outgoing() if shm.ENABLED else None
                self._outgoing.append(outgoing)
                process: BaseProcess = context.Process(  # type: ignore[attr-defined]
                    target=_map_main,
                    args=(
                        payload,
                        None if payload is not None else transform,
                        task_reader,
                        result_writer,
                        os.getpid(),
                        name,
                        where,
                        worker_gc(),
                        answers_dir(),
                        batched,
                        None if outgoing is None else outgoing.prefix,
                    ),
                    name=f"infinibatch_like.{name}.worker-{index}",
                    daemon=False,
                )
                try:
                    start_process(process)
                finally:
                    task_reader.close()
                    result_writer.close()
                self._processes.append(process)
                self._task_fds.append(task_writer.fileno())
                self._readers[result_reader.fileno()] = wire.FrameReader(result_reader.fileno())
                self._poll.register(result_reader.fileno(), select.POLLIN)
                self._unfinished.append(0)
        except BaseException:
            self.shutdown()
            raise

    def submit(self, task: Task) -> None:
        index = self._unfinished.index(min(self._unfinished))
        self._unfinished[index] += 1
        self._worker_of[task.number] = index
        self._sender.send(self._task_fds[index], shm.encode(task, self._outgoing[index]))

    def receive(self) -> Result:
        # Checked before every result: a dead worker may hold none of the tasks the
        # consumer waits for, while the others keep everything flowing.
        if self._dead() is None:
            result = wait_for(self._poll_result, lambda: self._dead() is None)
            if result is not None:
                return result
        dead = self._dead()
        assert dead is not None  # what ended the wait
        raise died(self._name, dead.pid, dead.exitcode)

    def _dead(self) -> BaseProcess | None:
        """A worker process that is gone, if one is."""
        return next((p for p in self._processes if p.exitcode is not None), None)

    def _poll_result(self, timeout: float) -> Result | None:
        """A result that came within `timeout` seconds, if one did."""
        for fd, _ in self._poll.poll(1000 * timeout):
            try:
                frame = self._readers[fd].read(0)
            except EOFError:
                continue  # the worker is gone: `_all_alive` tells
            if frame is not None:
                result: Result = pickle.loads(frame)
                self._unfinished[self._worker_of.pop(result.number)] -= 1
                return result
        return None

    def pids(self) -> list[int]:
        return [p.pid for p in self._processes if p.pid is not None and p.exitcode is None]

    def _shutdown(self) -> None:
        for process in self._processes:
            if process.exitcode is None:
                process.terminate()
        for process in self._processes:
            stop_process(process)
            shm.remove_names(process.pid)  # type: ignore[arg-type]
            process.close()
        self._processes = []
        self._sender.stop()
        for outgoing in self._outgoing:  # tasks that no worker will read
            if outgoing is not None:
                outgoing.unlink_names()
        self._outgoing = []
        for pipe in self._pipes:
            pipe.close()
        self._pipes = []


# -- threads -------------------------------------------------------------------------------


class ThreadPool(Pool):
    """`num_threads` threads, for transforms that release the GIL."""

    def __init__(
        self, transform: Callable[[Any], Any], num_threads: int, name: str, batched: bool = False
    ) -> None:
        super().__init__()
        self._name, self._batched = name, batched
        self._tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(
                target=self._run,
                args=(transform,),
                name=f"infinibatch_like.{name}.worker-{index}",
                daemon=True,
            )
            for index in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, transform: Callable[[Any], Any]) -> None:
        where = f"in a worker thread of {self._name}"
        while (task := self._tasks.get()) is not None:
            outputs, error, origin, busy = _apply(transform, task, self._name, self._batched)
            failure = None if error is None else local_error(error, f"{origin}, {where}")
            self._results.put(Result(task.number, outputs, failure, busy))

    def submit(self, task: Task) -> None:
        self._tasks.put(task)

    def receive(self) -> Result:
        result = wait_for(partial(queue_get, self._results), self._all_alive)
        if result is None:
            raise WorkerError(f"{self._name}: a worker thread stopped")
        return result

    def _all_alive(self) -> bool:
        return all(thread.is_alive() for thread in self._threads)

    def _shutdown(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)
        for thread in self._threads:
            thread.join()
