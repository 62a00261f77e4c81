"""Reusable rank processes for tests and benchmarks.

A ``RankPool(world_size)`` spawns its ranks once (a free TCP port, one torch
thread each, a short process-group timeout; ``backend="nccl"`` puts rank r on GPU r) and then runs any number of jobs:
``pool.run(fn, *args)`` calls ``fn(*args)`` on every rank and returns the
per-rank results, or re-raises the first rank's exception.

A job's ``timeout`` times the job alone. Spawning the ranks, importing torch and
ringify, joining the process group (``STARTUP_S``) and unpickling the job (which
imports the test's module) happen before its clock starts: on a busy 2-core machine
they take from seconds to a minute and a half. A job that does not finish within its
timeout kills the pool, so a hung ring fails a test seconds after its timeout instead
of hanging the suite; the next ``pool.run`` starts fresh ranks.

``hash_seeds`` gives each rank its own ``PYTHONHASHSEED``, as torchrun does when it
leaves the variable unset: ranks that iterate over a ``set`` of strings then do so in
different orders.

Each rank compiles into an Inductor cache of its own (kept for the next pool's rank of the
same index), unless ``inductor_cache`` names one for every rank: the ranks of a pool compile
the same kernels at the same moment, and Inductor's C++ code cache is not safe for that (a
rank may load another's half-written ``.so``: "file too short", pytorch/torchdynamo#1347).
The kept caches are per version of ringify's source: Inductor's FX graph cache keys a graph
by its code, not by the schemas of the custom ops it calls, so a cache written before an op
changed its schema would run the old compiled code on the new op.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import os
import pathlib
import pickle
import queue
import shutil
import socket
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp

PG_TIMEOUT_S = 30
STALE_CACHE_S = 6 * 3600
STARTUP_S = 600  # start-up or unpickling slower than this is a broken machine, not a slow one


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

    import ringify  # noqa: F401  (imported before the ready message: start-up, not a job)

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
    results.put(("ready", rank, None))
    while True:
        job = jobs.get()  # unpickling imports the job's module: before "started"
        if job is None:
            break
        fn, args = job
        results.put(("started", rank, None))
        # A queue pickles in a thread of its own, where a failure is only printed and the
        # test process would wait for the job's timeout: each outcome is pickled here first.
        try:
            outcome = (True, fn(*args))
            pickle.dumps(outcome)
        except BaseException as exc:  # report any failure to the test process
            detail = "".join(traceback.format_exception(exc))
            try:
                pickle.dumps(exc)
            except Exception:  # an exception holding what cannot be pickled: its text
                exc = RuntimeError(detail)
            outcome = (False, (exc, detail))
        results.put(("done", rank, outcome))
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
    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        hash_seeds: list[int] | None = None,
        inductor_cache: str | None = None,
    ):
        if hash_seeds is not None and len(hash_seeds) != world_size:
            raise ValueError(f"hash_seeds: one per rank ({world_size}), got {len(hash_seeds)}")
        self.world_size = world_size
        self.backend = backend
        self.hash_seeds = hash_seeds
        self.inductor_cache = inductor_cache
        self._procs, self._jobs = [], []  # started on the first run
        self._early: list[tuple] = []  # messages a fast rank sent before the others caught up

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.world_size)]
        port = _free_port()
        for r in range(self.world_size):
            args = (r, self.world_size, self.backend, port, list(sys.path))
            process = ctx.Process(
                target=_worker, args=(*args, self._jobs[r], self._results), daemon=True
            )
            seed = None if self.hash_seeds is None else self.hash_seeds[r]
            cache = self.inductor_cache or _own_inductor_cache(r)
            with _environment(PYTHONHASHSEED=seed, TORCHINDUCTOR_CACHE_DIR=cache):
                process.start()  # a spawned child reads the environment as it is now
            self._procs.append(process)
        self._collect("ready", STARTUP_S, "start")

    def run(self, fn, *args, timeout: float = 120.0) -> list:
        """``fn(*args)`` on every rank; the list of results indexed by rank. ``timeout`` counts
        from the moment every rank has started the job."""
        if not self._procs:
            self._start()
        for q in self._jobs:
            q.put((fn, args))
        self._collect("started", STARTUP_S, "unpickle the job")
        outcomes = self._collect("done", timeout, "finish")
        errors = {rank: value for rank, (ok, value) in outcomes.items() if not ok}
        if errors:
            rank = min(errors)
            exc, detail = errors[rank]
            raise exc from RuntimeError(f"rank {rank} of {self.world_size} failed:\n{detail}")
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def _collect(self, kind: str, timeout: float, what: str) -> dict[int, object]:
        """Every rank's message of ``kind``, within ``timeout`` seconds from now. Messages
        of the next kind that a fast rank sends early are kept for the next call."""
        pending, self._early = self._early, []
        got: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world_size:
            if pending:
                message = pending.pop(0)
            else:
                try:
                    message = self._results.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    self.close(kill=True)
                    raise TimeoutError(
                        f"ranks did not {what} within {timeout}s (pool restarted)"
                    ) from None
            got_kind, rank, value = message
            if got_kind == kind:
                got[rank] = value
            else:
                self._early.append(message)
        return got

    def close(self, kill: bool = False) -> None:
        """Stop the ranks: ask them to finish (``kill``: at once, as after a hung job)."""
        for q, p in zip(self._jobs, self._procs, strict=False):
            if p.is_alive() and not kill:
                q.put(None)
        for p in self._procs:
            if not kill:
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs, self._early = [], []


def _own_inductor_cache(rank: int) -> str:
    """Rank ``rank``'s own Inductor cache, kept for the next pool's rank ``rank`` while
    ringify's source is unchanged."""
    return os.path.join(_source_cache(), f"rank{rank}")


@functools.cache
def _source_cache() -> str:
    """The kept caches' folder for this version of ringify's source. Those of other versions
    made more than a few hours ago are removed (a run of another checkout may be using a
    newer one)."""
    package = pathlib.Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    root = pathlib.Path(tempfile.gettempdir(), f"ringify-inductor-{os.getuid()}")
    here = root / digest.hexdigest()[:16]
    for other in root.glob("*") if root.is_dir() else ():
        with contextlib.suppress(FileNotFoundError):  # another pool removed it first
            if other != here and time.time() - other.stat().st_mtime > STALE_CACHE_S:
                shutil.rmtree(other, ignore_errors=True)
    return str(here)


@contextlib.contextmanager
def _environment(**values):
    """The environment variables given set (a ``None`` left as it is) for a block."""
    saved = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        if value is not None:
            os.environ[name] = str(value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
