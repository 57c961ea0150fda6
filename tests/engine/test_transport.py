"""gloo's transport thread policy (engine/transport.py), in a one-rank gloo job."""
from __future__ import annotations

import os

import pytest

from dist_helpers import run_workers


def _worker():
    import torch.distributed as dist

    from engine.transport import set_transport_threads, transport_threads

    import time

    dist.barrier()  # the group's transport thread exists once the group does
    # ... but names itself from inside, once it runs: on a loaded machine that can come later
    deadline = time.monotonic() + 10.0
    tids = transport_threads()
    while not tids and time.monotonic() < deadline:
        time.sleep(0.01)
        tids = transport_threads()
    seen = []
    for policy in ("batch", "normal", "batch"):
        assert set_transport_threads(policy) == tids
        seen.append({os.sched_getscheduler(t) for t in tids})
    return tids, seen


def test_set_transport_threads_sets_and_restores_the_policy_of_gloos_transport_thread():
    tids, seen = run_workers(_worker, 1)[0]
    assert tids, "no gloo_tcp_loop thread found in a gloo job"
    assert seen == [{os.SCHED_BATCH}, {os.SCHED_OTHER}, {os.SCHED_BATCH}]


def test_an_unknown_policy_names_the_choices():
    from engine.transport import set_transport_threads

    with pytest.raises(ValueError, match="'batch'.*'normal'"):
        set_transport_threads("fifo")

