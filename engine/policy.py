"""The runtime's transport policy when the caller leaves it unset: how many receives a rank posts
ahead, what it does about its pending sends before each compute, and the scheduling policy of
gloo's transport thread. Pure Python (no torch import): the planner reads the same defaults to
price the runtime it predicts (``partitioner.planner``), and ``engine.runtime`` applies them.

Example::

    >>> from engine.policy import default_transport_threads
    >>> from engine.schedules import build_schedule
    >>> default_transport_threads("nccl", build_schedule("1f1b", 2, 4)) is None
    True
"""

from __future__ import annotations

from typing import Any

__all__ = ["default_recv_lookahead", "default_send_wait", "default_transport_threads"]


def default_recv_lookahead(backend: str, schedule: Any) -> int:
    """How many upcoming receives a rank posts ahead of the compute that needs them, when
    ``recv_lookahead`` is not given. NCCL: 2 (pre-posting is what lets transfers overlap).
    gloo: 2 for a schedule with several chunks per rank (interleaved-1f1b, zbv), else 0.

    gloo's transfers rendezvous: the data moves only once the receiver has posted its receive.
    With one chunk per rank the next receive is for data the peer is still computing, and an early
    post only made every later call on the pair slower (overhead benchmark). With several chunks
    per rank the next receive is often for data the peer sent while this rank ran another chunk;
    posted when needed it costs a round trip on the critical path (paired runs, 2 ahead against 0:
    interleaved-1f1b ~15% faster on the equal-layer MLP, 4 of 5 on the issue's GPT; zbv 15% faster
    on the equal-layer MLP, 1-2% on the issue's GPT and the bench preset; docs/performance.md).

    >>> from engine.schedules import build_schedule
    >>> [default_recv_lookahead("gloo", build_schedule(n, 2, 4, v)) for n, v in
    ...  (("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2), ("zb-h2", 1))]
    [0, 2, 2, 0]
    >>> default_recv_lookahead("nccl", build_schedule("1f1b", 2, 4))
    2
    """
    if backend == "nccl":
        return 2
    return 2 if schedule.virtual_stages > 1 else 0


def default_send_wait(backend: str, schedule: Any, transport_threads: str | None,
                      send_wait: str | None = None) -> str:
    """What a rank does about its sends before each compute: ``"compute"`` waits for them (as
    torch's 1F1B runtime does), ``"yield"`` gives up its core once while one is not yet waited, and
    ``"step"`` does neither; all are waited at the end of the step. ``send_wait`` is the caller's
    choice, checked; ``None`` picks, on gloo with its transport thread under SCHED_BATCH
    (:mod:`engine.transport`), the schedule's :func:`engine.schedules.send_mode` (``"compute"``
    for gpipe and 1f1b, ``"yield"`` for interleaved-1f1b), else ``"step"``.

    Why: under SCHED_BATCH gloo's transport thread waits for a free core. A rank that computes on
    while its send is still pending (the peer's receive was not yet known when it was issued)
    delays its own transport thread, and so the message; waiting for the send frees the core at
    once (overhead benchmark, paired: docs/performance.md). Under the default policy the same wait
    was 1.2-1.3x slower, so the two go together. interleaved-1f1b cannot wait (its peers post some
    receives only after waiting on this rank: :func:`engine.schedules.sends_can_block`), and
    waiting where it could was 8% slower (receives posted ahead mostly take the data at once);
    one yield lets a transport thread that is ready move the rest (equal-layer MLP, paired: 0.91
    of the default policy's step). A zero-bubble schedule fills its bubbles with weight gradients
    (W) while a peer has not yet posted its receive; waiting there gives the bubble back (zb-h1 on
    the issue's GPT: 16% slower) and yielding was 5-8% slower, so it keeps ``"step"``.

    >>> from engine.schedules import build_schedule
    >>> [default_send_wait("gloo", build_schedule(n, 2, 4, v), "batch")
    ...  for n, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1))]
    ['compute', 'yield', 'step']
    """
    from engine.schedules import send_mode, sends_can_block

    if send_wait is None:
        fits = backend == "gloo" and transport_threads == "batch"
        return send_mode(schedule) if fits else "step"
    if send_wait not in ("compute", "yield", "step"):
        raise ValueError(f"send_wait={send_wait!r}: use 'compute' (wait each compute's sends "
                         "before it), 'yield' (give up the core once before a compute while a "
                         "send is not yet waited) or 'step' (wait them at the end of the step)")
    if send_wait == "compute" and not sends_can_block(schedule):
        raise ValueError(f"send_wait='compute' would deadlock {schedule.name}: a rank would "
                         "wait for a send whose receive its peer posts only after waiting on "
                         "this rank; use send_wait='yield' or 'step' (or leave it unset)")
    return send_wait


def default_transport_threads(backend: str, schedule: Any) -> str | None:
    """The policy the runtime gives gloo's transport thread when ``transport_threads`` is not
    given: on gloo ``"batch"`` for the schedules whose sends it waits or yields to before each
    compute (:func:`engine.schedules.send_mode` ``"compute"`` or ``"yield"``), else ``"normal"``
    (the kernel's default, set again in case an earlier pipeline of the process changed it);
    ``None`` (left as it is) on NCCL. On the zero-bubble schedules, with sends left pending while
    the rank computes, SCHED_BATCH delayed them (the equal-layer MLP's zb-h2 and zbv 7-12% slower
    in one five-round run).

    >>> from engine.schedules import build_schedule
    >>> [default_transport_threads("gloo", build_schedule(n, 2, 4)) for n in ("1f1b", "zb-h2")]
    ['batch', 'normal']
    """
    from engine.schedules import send_mode

    if backend != "gloo":
        return None
    return "normal" if send_mode(schedule) == "step" else "batch"
