"""Keep gloo's transport thread from preempting a rank's compute when ranks share CPU cores.

gloo, the CPU backend of ``torch.distributed``, moves a process's point-to-point messages on a
background thread per device, named ``gloo_tcp_loop``. A message written by one rank wakes the
peer's transport thread. When every core is busy, the kernel may preempt the writer to run that
thread while the writer still holds the pair's mutex inside gloo's send. The writer's own
transport thread then spins on the mutex, which it only ever try-locks, until the writer runs
again: up to a scheduler slice, with a core burnt (docs/performance.md, "gloo's transport thread
under SCHED_BATCH").

Under ``SCHED_BATCH`` a woken thread does not preempt a running one: it takes a free core, or the
next one to free up, which is soon when the ranks wait on each other. The runtime sets it on gloo
(``Pipeline(transport_threads="batch")``, the default there; ``"normal"`` restores the kernel's
default policy). It is the same per-process kind of setting as :mod:`engine.allocator`'s, and
applies to every process group of the process, so another engine run in the same process gets it
too. Linux only; elsewhere a no-op.

Example::

    from engine.transport import set_transport_threads
    set_transport_threads("batch")     # the thread ids it set, e.g. [41873]
"""
from __future__ import annotations

import os

__all__ = ["set_transport_threads", "transport_threads", "POLICIES", "THREAD_NAME"]

THREAD_NAME = "gloo_tcp_loop"
POLICIES = ("batch", "normal")


def transport_threads() -> list[int]:
    """The ids of this process's gloo transport threads (none before a gloo group exists, and
    none off Linux)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    out = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == THREAD_NAME:
                    out.append(int(tid))
        except OSError:  # the thread ended while we looked
            continue
    return sorted(out)


def set_transport_threads(policy: str) -> list[int]:
    """Put this process's gloo transport threads under ``policy`` (``"batch"``: SCHED_BATCH,
    ``"normal"``: SCHED_OTHER); returns the thread ids set. Lowering a thread's policy needs no
    privilege; a thread that refuses is left as it was."""
    if policy not in POLICIES:
        raise ValueError(f"transport_threads={policy!r} is not one of {POLICIES}: use 'batch' "
                         "(gloo's transport thread does not preempt compute; the default on "
                         "gloo) or 'normal' (the kernel's default)")
    batch, other = getattr(os, "SCHED_BATCH", None), getattr(os, "SCHED_OTHER", None)
    if batch is None or other is None or not hasattr(os, "sched_setscheduler"):
        return []
    want = batch if policy == "batch" else other
    done = []
    for tid in transport_threads():
        try:
            os.sched_setscheduler(tid, want, os.sched_param(0))
        except OSError:
            continue
        done.append(tid)
    return done
