"""Point-to-point transfer of activations and gradients between pipeline ranks.

Activations (direction ``"F"``) travel as a tensor or a flat tuple of tensors. The first
activation message of a step on each channel (chunk ``s`` -> ``s + 1``) carries a compact int64
header (tuple-ness, and per tensor dtype, requires_grad and shape); later microbatches of the same
step reuse it, because all microbatches of a step have equal shapes. Gradients (direction ``"B"``)
never need a header: they have the shapes of the activations the receiver sent itself, one per
float tensor that required grad.

On gloo both ends of a channel keep the shapes of its previous step, and the step's first message
is the header and the first microbatch's data packed into one buffer (:func:`packed_size` of those
shapes): the receiver posts one receive of that size with the header's tag and views the data in
it, so in training, where shapes hold, the header costs no message of its own and the data does not
wait for the header's round trip (gloo moves data only once its receive is posted). When the
shapes changed, the packed buffer holds the new header followed by zeros, and the data follows
in its own messages, which the receiver posts on reading the header. A channel's first step (and
every step after a failed one, or with ``speculate=False``: :meth:`P2P.new_step`) sends the
header alone, then the data. NCCL, which matches in order, always sends the header alone.

A message can carry a ``note``: a small float64 tensor sent after its data, which the receiver
asks for with ``note_len`` and reads from :attr:`Recv.note`. On gloo a gradient message with a note
is one buffer, the gradients then the note; elsewhere the note is a message of its own. The executor uses
it for the step's verdict (loss and non-finite flags), which rides the last microbatch's messages
down the pipeline and back instead of needing a collective.

Sends are non-blocking and waited by :meth:`P2P.wait_sends` (at the end of the step, or before
each compute: ``engine.policy.default_send_wait``). Receives
are posted ahead (:meth:`P2P.post`) and waited when the data is needed (:meth:`Recv.wait`), so
compute overlaps the transfer. With ``hold`` set (the executor sets it for a step; NCCL always
holds), operations are queued and issued back to back by :meth:`P2P.flush` (or the first wait
that needs one): a send and the receive after it then reach the peer together, as in torch's
fused batches, and the peer's transport thread handles them in one wake-up.

Two clocks are kept: ``wait_s``, the time blocked in waits, and ``issue_s``, the time spent
inside the backend's calls that start a send or post a receive (``isend`` / ``irecv`` on gloo,
``batch_isend_irecv`` on NCCL). On gloo on a busy CPU the latter is not small: each call takes
the peer connection's lock and writes to its socket.

Every wait is bounded by ``timeout_s`` and fails with :class:`CommError` naming the peer and the
awaited message. On gloo, every message carries a tag unique to (direction, chunk, microbatch,
tensor), so matching is exact; on NCCL, which matches in order, activations and gradients use
separate communicators and the schedule's validation guarantees the same order at both ends;
consecutive transfers are batched with ``batch_isend_irecv``.

Example::

    p2p = P2P(mesh, timeout_s=60)
    p2p.send("F", stage=0, microbatch=0, value=out, peer=1)      # on rank 0
    x = p2p.post("F", stage=1, microbatch=0, peer=0).wait()       # on rank 1
    p2p.wait_sends()
"""
from __future__ import annotations

import datetime
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from engine.mesh import Mesh

__all__ = ["P2P", "Recv", "Spec", "CommError", "spec_of", "flatten", "unflatten", "HEADER_LEN",
           "MAX_TENSORS", "packed_size"]

HEADER_LEN = 256
_ALIGN = 64  # each tensor of a packed message starts on a 64-byte boundary
MAX_TENSORS = 62  # per boundary value: tag slots 1..62 (0: the header, 63: a note)
_NOTE_IDX = 63
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_ELEMENT_SIZE = {d: torch.empty((), dtype=d).element_size() for d in _DTYPES}


class CommError(RuntimeError):
    """A point-to-point transfer failed or timed out."""


@dataclass(frozen=True)
class Spec:
    """Structure of a stage-boundary value: tuple or bare tensor; per tensor (shape, dtype, rg)."""
    is_tuple: bool
    tensors: tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]

    def encode(self) -> Tensor:
        vals = [1 if self.is_tuple else 0, len(self.tensors)]
        for shape, dtype, rg in self.tensors:
            vals += [_CODE[dtype], int(rg), len(shape), *shape]
        if len(vals) > HEADER_LEN:
            raise CommError(f"stage boundary value too complex for the {HEADER_LEN}-slot header "
                            f"({len(self.tensors)} tensors); pass fewer tensors between stages")
        return torch.tensor(vals + [0] * (HEADER_LEN - len(vals)), dtype=torch.int64)

    @staticmethod
    def decode(h: Tensor) -> "Spec":
        v = h.tolist()
        is_tuple, n, i, out = bool(v[0]), v[1], 2, []
        for _ in range(n):
            code, rg, nd = v[i], v[i + 1], v[i + 2]
            out.append((tuple(v[i + 3:i + 3 + nd]), _DTYPES[code], bool(rg)))
            i += 3 + nd
        return Spec(is_tuple, tuple(out))

    def grad_spec(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes/dtypes of the gradient message that answers a value of this spec."""
        return [(s, d) for s, d, rg in self.tensors if rg]


def flatten(value: Any) -> tuple[bool, list[Tensor]]:
    """(is_tuple, tensors) of a stage-boundary value; raises for anything else."""
    if isinstance(value, Tensor):
        return False, [value]
    if isinstance(value, (tuple, list)) and all(isinstance(t, Tensor) for t in value):
        return True, list(value)
    raise TypeError(f"a value passed between pipeline stages must be a Tensor or a flat tuple of "
                    f"Tensors, got {type(value).__name__}; make the layer at the cut return "
                    "tensors only (or move the cut)")


def unflatten(is_tuple: bool, tensors: Sequence[Tensor]) -> Any:
    return tuple(tensors) if is_tuple else tensors[0]


Layout = Sequence[tuple[tuple[int, ...], torch.dtype]]  # a packed message's parts, in order
_HEADER_PART = ((HEADER_LEN,), torch.int64)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _layout_bytes(layout: Layout) -> int:
    return sum(_aligned(math.prod(s) * _ELEMENT_SIZE[d]) for s, d in layout)


def _data_layout(spec: Spec) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(s, d) for s, d, _ in spec.tensors]


def packed_size(spec: Spec) -> int:
    """Bytes of a step's first activation message on gloo: the header, then each tensor of
    ``spec``, each part starting on a 64-byte boundary."""
    return _layout_bytes([_HEADER_PART, *_data_layout(spec)])


def _views(buf: Tensor, layout: Layout) -> list[Tensor]:
    """The parts of a packed uint8 buffer, as tensors viewing it."""
    out, off = [], 0
    for shape, dtype in layout:
        n = math.prod(shape) * _ELEMENT_SIZE[dtype]
        out.append(buf[off:off + n].view(dtype).view(shape))
        off += _aligned(n)
    return out


def _pack(parts: Sequence[Tensor], size: int | None, device: Any) -> Tensor:
    """A uint8 buffer of ``size`` bytes (default: just enough) holding ``parts`` one after
    another (aligned); bytes past the last part are zeros."""
    layout = [(tuple(t.shape), t.dtype) for t in parts]
    end = _layout_bytes(layout)
    size = end if size is None else size
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    for view, t in zip(_views(buf, layout), parts):
        view.copy_(t.detach())
    if end < size:
        buf[end:].zero_()
    return buf


def spec_of(value: Any) -> Spec:
    is_tuple, ts = flatten(value)
    if len(ts) > MAX_TENSORS:
        raise TypeError(f"{len(ts)} tensors passed between two stages; at most {MAX_TENSORS} "
                        "can be: concatenate some of them, or move the cut")
    for t in ts:
        if t.dtype not in _CODE:
            raise TypeError(f"dtype {t.dtype} cannot be sent between stages")
    return Spec(is_tuple, tuple((tuple(t.shape), t.dtype,
                                 bool(t.requires_grad and t.is_floating_point())) for t in ts))


def _tag(direction: str, boundary: int, microbatch: int, idx: int) -> int:
    # ``boundary`` b is the cut between chunks b and b + 1, the same number at both ends.
    # < 2**31: boundary < 1024, microbatch wraps at 16384, idx < 64 (0 = header, 63 = note).
    return ((((boundary % 1024) * 2 + (direction == "B")) << 20)
            | ((microbatch % 16384) << 6) | (idx % 64))


class Recv:
    """A posted receive; :meth:`wait` returns the value (bare tensor, tuple, or grad list)."""

    def __init__(self, p2p: "P2P", direction: str, stage: int, microbatch: int, peer: int,
                 note_len: int = 0):
        self.p2p, self.direction, self.stage, self.microbatch, self.peer = \
            p2p, direction, stage, microbatch, peer
        self.note_len = note_len
        self.note: Tensor | None = None  # the message's note (float64), once posted
        self.header: tuple[Tensor, Any] | None = None
        self.packed: Spec | None = None  # the shapes the header's buffer was posted packed with
        self.spec: Spec | None = None
        self.bufs: list[Tensor] = []
        self.works: list[Any] = []
        self.value: Any = None
        self.done = False

    def what(self) -> str:
        thing = "activations for chunk" if self.direction == "F" else \
            "gradients of the output of chunk"
        return (f"{thing} {self.stage} microbatch {self.microbatch} from rank "
                f"{self.p2p.mesh.global_rank(self.peer)} (pipeline rank {self.peer})")

    def wait(self) -> Any:
        if self.done:
            return self.value
        if self.header is not None:
            self.p2p._wait(self.header[1], self)
            self.p2p._on_header(self)
        for w in self.works:
            self.p2p._wait(w, self)
        self.works = []
        if self.direction == "F":
            ts = []
            for t, (_, _, rg) in zip(self.bufs, self.spec.tensors):
                ts.append(t.requires_grad_(True) if rg and t.is_floating_point() else t)
            self.value = unflatten(self.spec.is_tuple, ts)
        else:
            self.value = self.bufs
        self.done = True
        return self.value


class P2P:
    """Point-to-point channels of one rank (see module docstring)."""

    def __init__(self, mesh: Mesh, timeout_s: float = 60.0, device: torch.device | None = None):
        self.mesh, self.timeout_s = mesh, timeout_s
        self._timeout = datetime.timedelta(seconds=timeout_s)  # built once: every wait takes it
        self.device = device or torch.device("cpu")
        self.nccl = mesh.backend == "nccl"
        self._sends: list[tuple[Any, Any, tuple[str, int, int, int]]] = []
        self._sends_done = 0  # self._sends[:_sends_done] are known complete
        self._pending_ops: list[Any] = []
        self.hold = False  # gloo: queue operations until flush (NCCL always queues)
        self.wait_s = 0.0
        self.issue_s = 0.0
        self.bytes_sent = 0
        self.in_specs: dict[int, Spec] = {}          # receiving chunk -> spec of its input
        self.out_specs: dict[int, Spec] = {}         # sending chunk -> spec of its output
        self._prev_in_specs: dict[int, Spec] = {}    # the same, as of each channel's last step
        self._prev_out_specs: dict[int, Spec] = {}
        self.new_step()

    def new_step(self, *, speculate: bool = True) -> None:
        """Start a step's handshakes (shapes may change between steps). With ``speculate`` (gloo),
        a channel's first message of the step is its header packed with the first data, sized by
        the shapes that channel had in its previous step (module docstring); pass False where
        shapes change every time (generation's prefill and decode rounds), and after a failed
        step."""
        # both ends of a channel keep the spec of the last step that used it (the same one at
        # either end, since the receiver learnt it from the sender's header)
        if speculate:
            self._prev_in_specs = {**self._prev_in_specs, **self.in_specs}
            self._prev_out_specs = {**self._prev_out_specs, **self.out_specs}
        else:
            self._prev_in_specs, self._prev_out_specs = {}, {}
        self._sent_header: set[int] = set()          # F channels (by sending chunk) this step
        self._recv_header: set[int] = set()          # F channels (by receiving chunk) posted
        self.in_specs, self.out_specs = {}, {}

    def _group(self, direction: str) -> Any:
        return self.mesh.p2p_forward_group if direction == "F" else self.mesh.p2p_backward_group

    # ---- batching (NCCL needs paired send/recv issued together) ----------------------------
    def _issue(self, op: Any, tensor: Tensor, peer: int, direction: str, tag: int) -> "_Handle":
        dst = self.mesh.global_rank(peer)
        group = self._group(direction)
        h = _Handle(self)
        if self.nccl or self.hold:
            self._pending_ops.append((op, tensor, dst, group, tag, h))
        else:
            t0 = time.perf_counter()
            h.work = op(tensor, dst, group=group, tag=tag)
            self.issue_s += time.perf_counter() - t0
        return h

    def flush(self) -> None:
        """Issue the held operations, back to back, in the order they were made."""
        if not self._pending_ops:
            return
        pending, self._pending_ops = self._pending_ops, []
        t0 = time.perf_counter()
        if self.nccl:
            # batch_isend_irecv wants one group per batch: activations and gradients use
            # separate communicators, so each gets its own batch (they cannot block each other).
            for group in dict.fromkeys((self.mesh.p2p_forward_group,
                                        self.mesh.p2p_backward_group)):
                part = [(dist.P2POp(op, t, dst, g, tag), h)
                        for op, t, dst, g, tag, h in pending if g is group]
                if part:
                    for (_, h), w in zip(part, dist.batch_isend_irecv([o for o, _ in part])):
                        h.work = w
        else:
            for op, t, dst, g, tag, h in pending:
                h.work = op(t, dst, group=g, tag=tag)
        self.issue_s += time.perf_counter() - t0

    def discard_held(self) -> None:
        """Forget operations held and not issued (after a failed step)."""
        self._pending_ops = []

    # ---- send ------------------------------------------------------------------------------
    def send(self, direction: str, stage: int, microbatch: int, value: Any, peer: int,
             note: Tensor | None = None) -> None:
        """Non-blocking send of chunk ``stage``'s output (F) or its input gradient (B), and of
        ``note`` after it (the receiver posts with ``note_len=note.numel()``)."""
        if direction == "F":
            _, ts = flatten(value)
            if stage not in self._sent_header:  # the spec only for the step's first message
                ts = self._send_header(stage, microbatch, value, ts, peer)
        else:
            ts = list(value)
        boundary = stage if direction == "F" else stage - 1
        what = ("activations of" if direction == "F" else "gradients of", stage, microbatch, peer)
        if note is not None and direction == "B" and not self.nccl:
            self._send_with_note(stage, microbatch, ts, note, peer)
            return
        for i, t in enumerate(ts):
            if t.numel() == 0:
                continue
            t = t.detach().contiguous()
            self.bytes_sent += t.numel() * t.element_size()
            self._track(self._issue(dist.isend, t, peer, direction,
                                    _tag(direction, boundary, microbatch, i + 1)), t, what)
        if note is not None:
            self._track(self._issue(dist.isend, note, peer, direction,
                                    _tag(direction, boundary, microbatch, _NOTE_IDX)), note,
                        ("the note after", stage, microbatch, peer))

    def _send_with_note(self, stage: int, microbatch: int, ts: list[Tensor], note: Tensor,
                        peer: int) -> None:
        """gloo: gradients and their note as one message, the note last (see ``_post_data``)."""
        buf = _pack([*ts, note], None, self.device)
        self.bytes_sent += sum(t.numel() * t.element_size() for t in ts)
        self._track(self._issue(dist.isend, buf, peer, "B",
                                _tag("B", stage - 1, microbatch, _NOTE_IDX)),
                    buf, ("the gradients and the note of", stage, microbatch, peer))

    def _send_header(self, stage: int, microbatch: int, value: Any, ts: list[Tensor],
                     peer: int) -> list[Tensor]:
        """Send the step's header on channel ``stage``; returns the tensors still to send (none
        when they went packed with it: the receiver posted last step's shapes, and they hold)."""
        spec = spec_of(value)
        self._sent_header.add(stage)
        self.out_specs[stage] = spec
        h = spec.encode().to(self.device)
        prev = None if self.nccl else self._prev_out_specs.get(stage)
        if prev is not None:  # the header and last step's shapes of data: zeros if they changed
            same = prev == spec
            h = _pack([h, *ts] if same else [h], packed_size(prev), self.device)
            if same:
                self.bytes_sent += sum(t.numel() * t.element_size() for t in ts)
                ts = []
        self._track(self._issue(dist.isend, h, peer, "F", _tag("F", stage, microbatch, 0)),
                    h, ("the header of", stage, microbatch, peer))
        return ts

    def _track(self, work: Any, tensor: Tensor, what: tuple[str, int, int, int]) -> None:
        # ``what`` is formatted only if the send fails (_send_what): not once per message
        self._sends.append((work, tensor, what))

    def _send_what(self, what: tuple[str, int, int, int]) -> str:
        thing, stage, microbatch, peer = what
        return (f"the send of {thing} chunk {stage} microbatch {microbatch} to rank "
                f"{self.mesh.global_rank(peer)} (pipeline rank {peer})")

    # ---- receive ---------------------------------------------------------------------------
    def can_post(self, direction: str, stage: int) -> bool:
        """Whether a receive for ``stage`` can be posted now without waiting."""
        if direction == "B":
            return stage in self.out_specs
        return stage in self.in_specs or stage not in self._recv_header

    def post(self, direction: str, stage: int, microbatch: int, peer: int,
             grad_spec: list[tuple[tuple[int, ...], torch.dtype]] | None = None,
             note_len: int = 0) -> Recv:
        """Post a receive of chunk ``stage``'s input (F) or its output gradient (B); with
        ``note_len``, also of the float64 note of that length sent after it."""
        r = Recv(self, direction, stage, microbatch, peer, note_len)
        if direction == "F":
            if stage in self.in_specs:
                self._post_data(r, self.in_specs[stage])
            elif stage not in self._recv_header:
                self._recv_header.add(stage)
                r.packed = None if self.nccl else self._prev_in_specs.get(stage)
                if r.packed is None:
                    h = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
                else:  # the header and last step's shapes of data, in one message (send)
                    h = torch.empty(packed_size(r.packed), dtype=torch.uint8, device=self.device)
                r.header = (h, self._issue(dist.irecv, h, peer, "F",
                                           _tag("F", stage - 1, microbatch, 0)))
                if r.packed is not None:
                    self._post_note(r)  # else posted with the data, once the header is read
            else:
                raise CommError(f"internal: receive of chunk {stage} posted before its header "
                                "arrived")
        else:
            if grad_spec is None and stage not in self.out_specs:
                raise CommError(f"gradient receive for chunk {stage} posted before chunk {stage} "
                                "sent its activations this step (gradient shapes come from them)")
            shapes = grad_spec if grad_spec is not None else self.out_specs[stage].grad_spec()
            self._post_data(r, Spec(True, tuple((s, d, False) for s, d in shapes)))
        return r

    def _on_header(self, r: Recv) -> None:
        buf = r.header[0]
        parts = [buf] if r.packed is None else _views(buf, [_HEADER_PART, *_data_layout(r.packed)])
        spec = Spec.decode(parts[0])
        self.in_specs[r.stage] = spec
        r.header = None
        if r.packed is None:
            self._post_data(r, spec)
        elif r.packed == spec:
            r.spec, r.bufs = spec, parts[1:]
        else:  # the shapes changed: the data follows in its own messages (send)
            self._post_data(r, spec, note=False)
        self.flush()

    def poll_header(self, r: Recv) -> None:
        """If ``r``'s header has arrived, post its data receive (without blocking). On gloo a
        receive reports completion only once waited, so there this posts nothing."""
        if r.header is not None and r.header[1].is_completed():
            self._wait(r.header[1], r)
            self._on_header(r)

    def _post_data(self, r: Recv, spec: Spec, note: bool = True) -> None:
        r.spec = spec
        boundary = r.stage - 1 if r.direction == "F" else r.stage
        if r.note_len and r.direction == "B" and not self.nccl:  # one message: _send_with_note
            layout = [*_data_layout(spec), ((r.note_len,), torch.float64)]
            buf = torch.empty(_layout_bytes(layout), dtype=torch.uint8, device=self.device)
            *r.bufs, r.note = _views(buf, layout)
            r.works.append(self._issue(dist.irecv, buf, r.peer, "B",
                                       _tag("B", boundary, r.microbatch, _NOTE_IDX)))
            return
        for i, (shape, dtype, _) in enumerate(spec.tensors):
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            r.bufs.append(buf)
            if buf.numel():
                r.works.append(self._issue(dist.irecv, buf, r.peer, r.direction,
                                           _tag(r.direction, boundary, r.microbatch, i + 1)))
        if note:
            self._post_note(r)

    def _post_note(self, r: Recv) -> None:
        if r.note_len:
            boundary = r.stage - 1 if r.direction == "F" else r.stage
            r.note = torch.empty(r.note_len, dtype=torch.float64, device=self.device)
            r.works.append(self._issue(dist.irecv, r.note, r.peer, r.direction,
                                       _tag(r.direction, boundary, r.microbatch, _NOTE_IDX)))

    # ---- waiting ---------------------------------------------------------------------------
    def _wait(self, work: Any, r: Recv | None, what: str | None = None) -> None:
        if work is None:
            return
        t0 = time.perf_counter()
        try:
            ok = work.wait(self._timeout)
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise CommError(self._describe(r, what, exc)) from exc
        finally:
            self.wait_s += time.perf_counter() - t0
        if ok is False:
            raise CommError(self._describe(r, what, None))

    def _describe(self, r: Recv | None, what: str | None, exc: BaseException | None) -> str:
        me = (f"rank {self.mesh.rank} (pipeline rank {self.mesh.pipeline_rank}, replica "
              f"{self.mesh.replica})")
        target = r.what() if r is not None else what
        if exc is None or "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            return (f"{me} timed out after {self.timeout_s:g} s waiting for {target}. The peer "
                    "probably failed (see its error) or runs a different schedule; raise "
                    "comm_timeout_s if a stage is legitimately this slow.")
        return f"{me} failed while waiting for {target}: {exc}"

    def yield_to_sends(self) -> None:
        """Give up this thread's core once if a send of this step is not known complete (issued
        before its receive was known, the data leaves from gloo's transport thread, which under
        SCHED_BATCH waits for a free core: ``engine.policy.default_send_wait``). Never blocks.
        gloo's point-to-point works report completion only once waited, so on gloo this yields
        before every compute after the step's first send, until the step's end waits them."""
        self.flush()
        done = self._sends_done
        while done < len(self._sends) and self._sends[done][0].is_completed():
            done += 1
        self._sends_done = done
        if done < len(self._sends):
            os.sched_yield()

    def wait_sends(self, keep_last: int = 0) -> None:
        """Wait for every send of this step (bounded by the timeout), except the newest
        ``keep_last`` messages (a stream of sends, e.g. generation's, waits only for old ones)."""
        self.flush()
        cut = max(0, len(self._sends) - keep_last)
        sends, self._sends = self._sends[:cut], self._sends[cut:]
        self._sends_done = max(0, self._sends_done - cut)
        for work, _tensor, what in sends:
            self._wait(work, None, self._send_what(what) + " to complete")


class _Handle:
    """A transfer's work; on NCCL it exists only once the batch is flushed."""

    def __init__(self, p2p: P2P):
        self.p2p, self.work = p2p, None

    def is_completed(self) -> bool:
        return self.work is not None and self.work.is_completed()

    def wait(self, timeout: Any) -> Any:
        if self.work is None:
            self.p2p.flush()
        return self.work.wait(timeout)
