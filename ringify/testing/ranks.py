"""Reusable rank processes for tests and benchmarks.

A ``RankPool(world_size)`` spawns its ranks once (a free TCP port, one torch
thread each, a short process-group timeout; ``backend="nccl"`` puts rank r on GPU r) and then runs any number of jobs:
``pool.run(fn, *args)`` calls ``fn(*args)`` on every rank and returns the
per-rank results, or re-raises the first rank's exception. A job that does not
finish within its timeout kills the pool, so a hung ring fails a test in
seconds instead of hanging the suite; the next ``pool.run`` starts fresh ranks.
"""

from __future__ import annotations

import datetime
import queue
import socket
import sys
import time
import traceback

import torch.multiprocessing as mp

PG_TIMEOUT_S = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, backend: str, port: int, path: list[str], jobs, results
) -> None:
    sys.path[:] = path
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args = job
        try:
            results.put((rank, True, fn(*args)))
        except BaseException as exc:  # report any failure to the test process
            detail = "".join(traceback.format_exception(exc))
            try:
                results.put((rank, False, (exc, detail)))
            except Exception:
                results.put((rank, False, (RuntimeError(detail), detail)))
    dist.destroy_process_group()


def outcome(fn) -> tuple[str, str, float]:
    """On a rank: ``fn()``'s outcome, (exception type name or "ok", message, seconds taken),
    so that a test sees what *every* rank did, not only the first rank that raised."""
    start = time.monotonic()
    try:
        fn()
        return ("ok", "", time.monotonic() - start)
    except Exception as e:
        return (type(e).__name__, str(e), time.monotonic() - start)


class RankPool:
    def __init__(self, world_size: int, backend: str = "gloo"):
        self.world_size = world_size
        self.backend = backend
        self._procs, self._jobs = [], []  # started on the first run

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.world_size)]
        port = _free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    self.world_size,
                    self.backend,
                    port,
                    list(sys.path),
                    self._jobs[r],
                    self._results,
                ),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout: float = 120.0) -> list:
        """``fn(*args)`` on every rank; the list of results indexed by rank."""
        if not self._procs:
            self._start()
        for q in self._jobs:
            q.put((fn, args))
        results, errors = [None] * self.world_size, {}
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=timeout)
            except queue.Empty:
                self.close()
                raise TimeoutError(
                    f"ranks did not finish within {timeout}s (pool restarted)"
                ) from None
            if ok:
                results[rank] = value
            else:
                errors[rank] = value
        if errors:
            rank = min(errors)
            exc, detail = errors[rank]
            raise exc from RuntimeError(f"rank {rank} of {self.world_size} failed:\n{detail}")
        return results

    def close(self) -> None:
        for q, p in zip(self._jobs, self._procs, strict=False):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self._procs = []
