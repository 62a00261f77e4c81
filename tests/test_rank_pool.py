"""The test harness's rank pool: a job's timeout times the job, never the ranks' start-up, and a
hung rank fails its test at that timeout, not when the rank would have finished."""

from __future__ import annotations

import os
import time

import pytest

from ringify.testing import RankPool

JOB_TIMEOUT_S = 0.5  # less than importing torch alone takes
HANG_S = 600  # how long the hung rank sleeps: its test must fail long before that


def hash_seed_and_rank():
    import torch.distributed as dist

    return os.environ.get("PYTHONHASHSEED"), dist.get_rank()


def hang_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(HANG_S)
    return dist.get_rank()


def test_a_job_timeout_excludes_start_up_and_a_hung_rank_fails_at_it():
    pool = RankPool(2, hash_seeds=[7, 8])
    try:
        # The first job starts the ranks (torch, ringify, the process group: seconds, more
        # than the job's timeout) and still passes: its clock starts once every rank has it.
        started = time.monotonic()
        assert pool.run(hash_seed_and_rank, timeout=JOB_TIMEOUT_S) == [("7", 0), ("8", 1)]
        assert time.monotonic() - started > JOB_TIMEOUT_S  # else this proves nothing here
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not finish"):
            pool.run(hang_on_rank_1, timeout=JOB_TIMEOUT_S)
        assert time.monotonic() - started < HANG_S / 2  # at the job's timeout, not the hang's end
        assert pool.run(hash_seed_and_rank, timeout=JOB_TIMEOUT_S)[1] == ("8", 1)  # fresh ranks
    finally:
        pool.close()
