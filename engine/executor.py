"""Runs one rank's lowered program (``engine.schedules.lower``) for one step.

The program is a list of compute actions (F, B, I, W) and transfers (SEND_* / RECV_*).
Receives are posted ``lookahead`` entries ahead, after compute, so that the data of the next
actions arrives while this rank computes. The transfers between two computes are held and issued
together just before the next compute (``P2P.hold``): on NCCL they form one batch; on gloo a send
and the receive after it leave microseconds apart, so the peer's transport thread wakes once for
both (posted one by one, with Python between them, it woke twice; docs/performance.md).
Hand-offs between two chunks of the same rank stay in memory. Sends are waited at the end of the
step, or, with ``send_wait="compute"``, before the next compute (as torch's 1F1B runtime does);
with ``send_wait="yield"`` the rank gives up its core once before a compute while a send of the
step is not yet waited (``engine.policy.default_send_wait`` says which, when).

What runs on every step is only what a step needs: the compute and the transfers. The step's
**verdict** (the mean loss and, per chunk, whether its forward output was non-finite: a float64
vector ``[loss, bad_0, ..., bad_{k-1}]``) needs no collective: the last chunk writes the loss and
its flag, and the verdict goes back up with the last microbatch's gradients (a note,
``engine.comm``), so every rank knows it by its last backward and no rank waits for another at
the end of a step. On a **checked** step (``check``, the runtime's diagnostic steps) every forward
output is also reduced once to flag a NaN/inf (``nonfinite_flag``): after its last forward, each
chunk adds its slot to the partial verdict received with that microbatch's input and sends it on
with its output, so the verdict names the first chunk that went bad. On other steps a non-finite
loss is located by a forward replay (``engine.runtime``). A forward-only run with ``check``
returns each chunk's flag (``_flags``). The costly diagnostics (bytes saved for backward, counted
by a Python hook per saved tensor, and the peak of live activations) run only when asked
(``diagnose=True``).

Example (what ``engine.Pipeline.train_step`` does on each rank)::

    ex = Executor(chunks, p2p, schedule, lookahead=2, split=split, node_split=None,
                  send_wait="step")
    stats = ex.run(program, x_mbs, y_mbs, optimizer, train=True, diagnose=False, check=False)
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import Tensor

from engine.comm import P2P, Recv
from engine.stage import Chunk, _cut

__all__ = ["Executor", "nonfinite_flag", "mean_loss"]


def nonfinite_flag(value: Any) -> Tensor | None:
    """A scalar that is NaN/inf iff a floating tensor of ``value`` holds a NaN or inf: one sum
    per tensor, no host synchronisation (``None`` for non-float values).

    Each tensor is summed in its own precision (16-bit ones in float32), so no copy is made: a
    float32 output would raise a false alarm only if it summed past 3.4e38 in magnitude.

    >>> nonfinite_flag(torch.tensor([1.0, float("nan")])).isnan().item()
    True
    """
    flag: Tensor | None = None
    for t in (value if isinstance(value, (tuple, list)) else (value,)):
        if isinstance(t, Tensor) and t.is_floating_point():
            s = t.detach().sum(dtype=torch.float32 if t.element_size() < 4 else None)
            flag = s if flag is None else flag + s
    return flag


def mean_loss(losses: Sequence[Tensor]) -> Tensor:
    """The mean of the last chunk's per-microbatch losses, in float64 (averaged in float32, the
    losses kept as they came and converted once per step)."""
    return torch.stack(list(losses)).float().mean().double()


def _loss_flag(mean: Tensor) -> Tensor:
    """The last chunk's flag: its output is the loss, so 1.0 (float64) iff the mean loss is
    NaN/inf."""
    return (~torch.isfinite(mean)).double()


def _any_nonfinite(flags: list[Tensor]) -> Tensor:
    """1.0 (float64) iff one of ``flags`` is NaN/inf: one stack for the step, not an add per
    microbatch."""
    if len({f.dtype for f in flags}) > 1:
        flags = [f.double() for f in flags]
    return (~torch.isfinite(torch.stack(flags).sum())).double()


class Executor:
    """One rank's program runner; keeps nothing between steps but its configuration."""

    def __init__(self, chunks: dict[int, Chunk], p2p: P2P, schedule: Any, *, lookahead: int,
                 split: set[tuple[int, int]], node_split: bool | None, send_wait: str = "step"):
        self.chunks, self.p2p, self.schedule = chunks, p2p, schedule
        self.lookahead, self.split, self.node_split = lookahead, split, node_split
        self.wait_before_compute = send_wait == "compute"
        self.yield_before_compute = send_wait == "yield"
        self.rank = p2p.mesh.pipeline_rank
        self.compute_hooks = False   # the optimizer's before/after_compute run around each compute
        self.last = schedule.num_chunks - 1

    def run(self, program: Sequence[Any], x_mbs: list | None, y_mbs: list | None,
            optimizer: Any, *, train: bool, diagnose: bool, check: bool = False) -> dict:
        """Run ``program``; returns the step's figures (see ``Pipeline.train_step``) and, under
        private keys, the last chunk's losses (``_losses``), when training the step's verdict
        (``_verdict``, see the module docstring; not yet summed over replicas), and with
        ``check`` each of this rank's chunks' flag (``_flags``: 1.0 if one of its forward
        outputs, or the last chunk's loss, held a NaN/inf). Every rank of the pipeline must pass the same
        ``train`` and ``check`` (they decide which messages carry a note)."""
        step = _Step(self, program, x_mbs, y_mbs, optimizer, train, diagnose, check)
        self.p2p.new_step()
        wait0, issue0, sent0 = self.p2p.wait_s, self.p2p.issue_s, self.p2p.bytes_sent
        if diagnose:
            for c in self.chunks.values():
                c.reset_peak()
        self.p2p.hold = True
        try:
            for pos, it in enumerate(program):
                step.do(pos, it)
            self.p2p.wait_sends()
        except BaseException:
            self.p2p.new_step(speculate=False)  # no shapes carried over from a failed step
            raise
        finally:
            self.p2p.hold = False
            self.p2p.discard_held()  # empty unless the step failed: never issue them later
        leftover = [c.index for c in self.chunks.values() if c.state]
        if train and leftover:
            raise RuntimeError(f"internal: chunks {leftover} hold microbatches with no backward; "
                               "the schedule is incomplete")
        if train and step.verdict is None:
            raise RuntimeError("internal: the step ended without its verdict (the last "
                               "microbatch's messages did not carry it)")
        out = {"forward_s": step.fwd_s, "backward_s": step.bwd_s,
               "comm_wait_s": self.p2p.wait_s - wait0, "comm_issue_s": self.p2p.issue_s - issue0,
               "bytes_sent": self.p2p.bytes_sent - sent0,
               "pipeline_rank": self.rank, "replica": self.p2p.mesh.replica,
               "stages": sorted(self.chunks), "_losses": step.losses, "_verdict": step.verdict,
               "_flags": step.chunk_flags()}
        if diagnose and train:
            out["peak_activation_bytes"] = step.peak
        return out


class _Step:
    """The state of one run of a program: inboxes, outboxes, posted receives, figures."""

    def __init__(self, ex: Executor, program: Sequence[Any], x_mbs: list | None,
                 y_mbs: list | None, optimizer: Any, train: bool, diagnose: bool, check: bool):
        self.ex, self.program, self.x_mbs, self.y_mbs = ex, program, x_mbs, y_mbs
        self.optimizer, self.train, self.diagnose, self.check = optimizer, train, diagnose, check
        self.inbox_f: dict[tuple[int, int], Any] = {}
        self.inbox_b: dict[tuple[int, int], Any] = {}
        self.outbox: dict[tuple[str, int, int], Any] = {}
        self.posted: dict[tuple[str, int, int], Recv] = {}
        self.header_wait: dict[int, Recv] = {}
        self.recv_pos = [k for k, it in enumerate(program) if it.kind.startswith("RECV")]
        self.nxt = 0  # index into recv_pos of the next receive not yet posted
        self.losses: list[Tensor] = []
        self.flags: dict[int, list[Tensor]] = {}  # chunk -> its forward outputs' sums
        self.fwd_s = self.bwd_s = 0.0
        self.peak = 0
        self.last_mb = ex.schedule.microbatches - 1  # its messages carry the verdict
        self.verdict_in: dict[int, Tensor] = {}   # chunk -> partial verdict of the chunks before it
        self.verdict_out: dict[int, Tensor] = {}  # chunk -> partial verdict to send with its output
        self.verdict: Tensor | None = None
        self._ops = {"RECV_F": self._recv, "RECV_B": self._recv, "SEND_F": self._send,
                     "SEND_B": self._send, "F": self._forward, "B": self._backward,
                     "I": self._backward, "W": self._weight}

    def do(self, pos: int, it: Any) -> None:
        op = self._ops.get(it.kind)
        if op is None:
            raise ValueError(f"unknown program item {it!r}")
        compute = it.kind in _COMPUTE
        if compute:
            self.ex.p2p.flush()  # the transfers before this compute leave now, back to back
            if self.ex.wait_before_compute:  # see engine.policy.default_send_wait
                self.ex.p2p.wait_sends()
            elif self.ex.yield_before_compute:
                self.ex.p2p.yield_to_sends()
        hooks = self.optimizer if compute and self.ex.compute_hooks else None
        if hooks is not None:   # engine.fsdp: all-gather accounting and the reshard policy
            hooks.before_compute(it.kind, self.ex.chunks[it.stage], it.microbatch)
        op(it)
        if hooks is not None:
            hooks.after_compute(it.kind, self.ex.chunks[it.stage], it.microbatch, self.train)
        if compute:
            self._prefetch(pos)

    # ---- transfers ---------------------------------------------------------------------------
    def _carries_verdict(self, direction: str, microbatch: int) -> bool:
        """Whether this message has the verdict as its note: the last microbatch's gradients,
        and on a checked step its activations too (the partial verdict)."""
        return self.train and microbatch == self.last_mb and (direction == "B" or self.check)

    def _post(self, it: Any) -> Recv:
        d = it.kind[-1]
        note = self.ex.last + 2 if self._carries_verdict(d, it.microbatch) else 0
        r = self.ex.p2p.post(d, it.stage, it.microbatch, it.peer, note_len=note)
        if d == "F" and r.header is not None:
            self.header_wait[it.stage] = r
        return r

    def _postable(self, it: Any) -> bool:
        p2p, d = self.ex.p2p, it.kind[-1]
        if d == "F" and it.stage in self.header_wait and it.stage not in p2p.in_specs:
            p2p.poll_header(self.header_wait[it.stage])
        return p2p.can_post(d, it.stage)

    def _prefetch(self, pos: int) -> None:
        while self.nxt < len(self.recv_pos) and len(self.posted) < self.ex.lookahead:
            it = self.program[self.recv_pos[self.nxt]]
            if self.recv_pos[self.nxt] <= pos or not self._postable(it):
                break
            self.posted[(it.kind, it.stage, it.microbatch)] = self._post(it)
            self.nxt += 1
        self.ex.p2p.flush()

    def _recv(self, it: Any) -> None:
        key = (it.kind, it.stage, it.microbatch)
        r = self.posted.pop(key, None)
        if r is None:
            s = it.stage
            if not self.ex.p2p.can_post(it.kind[-1], s) and s in self.header_wait:
                self.header_wait[s].wait()  # an earlier message's header: it comes first
            r = self._post(it)
            self.nxt += 1
        (self.inbox_f if it.kind == "RECV_F" else self.inbox_b)[(it.stage, it.microbatch)] = r

    def _send(self, it: Any) -> None:
        d, s, i = it.kind[-1], it.stage, it.microbatch
        note = None
        if self._carries_verdict(d, i):
            note = self.verdict_out.pop(s, None) if d == "F" else self.verdict
            if note is None:
                raise RuntimeError(f"internal: chunk {s} sends its last microbatch before the "
                                   "step's verdict reached it")
        self.ex.p2p.send(d, s, i, self.outbox.pop((d, s, i)), it.peer, note=note)

    # ---- compute -----------------------------------------------------------------------------
    def _forward(self, it: Any) -> None:
        ex, s, i = self.ex, it.stage, it.microbatch
        src = None if s == 0 else self.inbox_f.pop((s, i))
        x = self.x_mbs[i] if s == 0 else _value(src)
        if isinstance(src, Recv) and src.note is not None:
            self.verdict_in[s] = src.note
        if s in ex.p2p.in_specs:
            self.header_wait.pop(s, None)  # do not keep its buffers alive all step
        last = s == ex.last
        t = time.perf_counter()
        out = ex.chunks[s].forward(i, x, self.y_mbs[i] if last else None,
                                   split=(s, i) in ex.split, keep=self.train,
                                   node_split=ex.node_split, measure=self.diagnose)
        self.fwd_s += time.perf_counter() - t
        if self.check and not last:  # the last chunk's flag is its loss (_add_verdict)
            flag = nonfinite_flag(out)
            if flag is not None:
                self.flags.setdefault(s, []).append(flag)
        if last:
            self.losses.append(out.detach())
        elif ex.schedule.rank_of(s + 1) == ex.rank:
            self.inbox_f[(s + 1, i)] = _cut(out) if self.train else out
        else:
            self.outbox[("F", s, i)] = out
        if self.diagnose and self.train:
            self.peak = max(self.peak, sum(c.live_bytes for c in ex.chunks.values()))
        if self.train and i == self.last_mb and (self.check or last):
            self._add_verdict(s)

    def _add_verdict(self, s: int) -> None:
        """Chunk ``s`` has run its last forward: its slot joins the partial verdict, which goes
        on to chunk ``s + 1`` (in memory or with the output's message); the last chunk adds the
        mean loss and holds the full verdict."""
        ex = self.ex
        v = self.verdict_in.pop(s, None)
        if v is None:
            v = torch.zeros(ex.last + 2, dtype=torch.float64, device=ex.p2p.device)
        if s == ex.last:
            v[0] = mean_loss(self.losses)
            v[1 + s] = _loss_flag(v[0])
            self.verdict = v
            return
        if s in self.flags:
            v[1 + s] = _any_nonfinite(self.flags[s])
        if ex.schedule.rank_of(s + 1) == ex.rank:
            self.verdict_in[s + 1] = v
        else:
            self.verdict_out[s] = v

    def chunk_flags(self) -> dict[int, Tensor]:
        """On a checked run, each of this rank's chunks' flag (1.0 if a forward output, or the
        last chunk's loss, held a NaN/inf); empty otherwise."""
        if not self.check:
            return {}
        flags = {s: _any_nonfinite(f) for s, f in self.flags.items()}
        if self.losses:
            flags[self.ex.last] = _loss_flag(mean_loss(self.losses))
        return flags

    def _backward(self, it: Any) -> None:
        ex, s, i = self.ex, it.stage, it.microbatch
        src = None if s == ex.last else self.inbox_b.pop((s, i))
        g = None if src is None else _value(src)
        if isinstance(src, Recv) and src.note is not None:
            self.verdict = src.note
        t = time.perf_counter()
        c = ex.chunks[s]
        gx = c.backward(i, g, self.optimizer) if it.kind == "B" else \
            c.backward_input(i, g, self.optimizer)
        self.bwd_s += time.perf_counter() - t
        if s > 0:
            if ex.schedule.rank_of(s - 1) == ex.rank:
                self.inbox_b[(s - 1, i)] = gx
            else:
                self.outbox[("B", s, i)] = gx

    def _weight(self, it: Any) -> None:
        t = time.perf_counter()
        self.ex.chunks[it.stage].backward_weight(it.microbatch, self.optimizer)
        self.bwd_s += time.perf_counter() - t


_COMPUTE = frozenset(("F", "B", "I", "W"))


def _value(x: Any) -> Any:
    return x.wait() if isinstance(x, Recv) else x
