"""fit's estimating workers (memlab.cli.fit.search): forked after the parent's first estimate,
they must run parallel torch ops without waiting on the parent's OpenMP pool."""

from __future__ import annotations

import multiprocessing

import torch

from memlab.cli.fit.search import _worker_init


def _nonzero(_: int) -> int:
    x = torch.ones(1 << 20)  # large enough that torch splits it over its threads
    return int((x != 0).nonzero().numel())


def test_forked_workers_run_parallel_ops_after_the_parents():
    threads = torch.get_num_threads()  # (the suite runs on one: a user's process has more)
    torch.set_num_threads(2)
    pool = None
    try:
        _nonzero(0)  # the parent's OpenMP pool, as fit's first estimate starts it
        pool = multiprocessing.get_context("fork").Pool(2, initializer=_worker_init)
        # without one thread per worker, this waited forever (GNU OpenMP after fork)
        assert pool.map_async(_nonzero, range(4)).get(timeout=60) == [1 << 20] * 4
    finally:
        torch.set_num_threads(threads)
        if pool is not None:
            pool.terminate()
            pool.join()
