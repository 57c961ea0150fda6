"""Point-to-point transfers: header round trip, tuples with non-float tensors, per-step shape
changes, gradients without a header, and bounded waits that name the peer."""
from __future__ import annotations


import pytest
import torch

from dist_helpers import run_workers

from engine.comm import MAX_TENSORS, Spec, flatten, spec_of


def test_header_round_trip():
    value = (torch.randn(2, 3, requires_grad=True), torch.zeros(4, dtype=torch.int64),
             torch.ones(1, 2, 3, dtype=torch.bfloat16))
    spec = spec_of(value)
    assert Spec.decode(spec.encode()) == spec
    assert spec.grad_spec() == [((2, 3), torch.float32)]
    bare = spec_of(torch.randn(5))
    assert Spec.decode(bare.encode()) == bare and not bare.is_tuple


class _OneRankMesh:
    """Just what P2P reads of a mesh, for a gloo rank 0 whose peer is rank 1."""
    backend, rank, pipeline_rank, replica = "gloo", 0, 0, 0
    p2p_forward_group = p2p_backward_group = None

    def global_rank(self, pipeline_rank: int) -> int:
        return pipeline_rank


def test_issue_clock_counts_the_backend_calls_and_nothing_else(monkeypatch):
    import time

    import torch.distributed as dist
    from engine.comm import P2P

    calls = []

    def slow_call(tensor, dst, group=None, tag=0):
        calls.append((dst, tag))
        time.sleep(0.02)
        return None

    monkeypatch.setattr(dist, "isend", slow_call)
    monkeypatch.setattr(dist, "irecv", slow_call)
    p2p = P2P(_OneRankMesh(), timeout_s=5)
    p2p.send("F", 0, 0, torch.ones(3, requires_grad=True), peer=1)    # header + data: 2 calls
    r = p2p.post("B", 0, 0, peer=1)                                    # gradient: 1 call
    assert len(calls) == 3 and len(r.works) == 1
    assert 0.06 <= p2p.issue_s < 1.0 and p2p.wait_s == 0.0
    issued = p2p.issue_s
    time.sleep(0.05)                           # time outside the calls is not counted
    p2p.flush()                                # gloo issues at once: nothing left to issue
    assert p2p.issue_s == issued


def test_hold_queues_until_flush_then_issues_back_to_back_in_order(monkeypatch):
    import torch.distributed as dist
    from engine.comm import P2P

    calls = []
    monkeypatch.setattr(dist, "isend", lambda t, dst, group=None, tag=0: calls.append(("s", tag)))
    monkeypatch.setattr(dist, "irecv", lambda t, dst, group=None, tag=0: calls.append(("r", tag)))
    p2p = P2P(_OneRankMesh(), timeout_s=5)
    p2p.hold = True
    p2p.send("F", 0, 0, torch.ones(3, requires_grad=True), peer=1)    # header + data
    p2p.post("B", 0, 0, peer=1)
    assert calls == []                          # held: nothing reached the backend yet
    p2p.flush()
    assert [k for k, _ in calls] == ["s", "s", "r"]
    p2p.flush()
    assert len(calls) == 3                      # issued once


def test_a_header_travels_packed_with_the_first_data_and_a_note_with_its_gradients(monkeypatch):
    import torch.distributed as dist
    from engine.comm import HEADER_LEN, P2P, packed_size

    sent = []
    monkeypatch.setattr(dist, "isend",
                        lambda t, dst, group=None, tag=0: sent.append((tag % 64, t.clone())))
    p2p = P2P(_OneRankMesh(), timeout_s=5)

    def step(n: int) -> list[tuple[int, torch.Tensor]]:
        sent.clear()
        p2p.new_step()
        for mb in range(2):
            p2p.send("F", 0, mb, (torch.full((n, 3), mb + 1.0), torch.arange(n)), peer=1)
        return list(sent)

    first = step(4)       # a channel's first step: the header alone, then the data
    assert [i for i, _ in first] == [0, 1, 2, 1, 2] and first[0][1].numel() == HEADER_LEN
    same = step(4)        # shapes hold: one message for the header and microbatch 0
    spec = Spec.decode(first[0][1])
    assert [i for i, _ in same] == [0, 1, 2] and same[0][1].numel() == packed_size(spec)
    packed = same[0][1]
    assert Spec.decode(packed[:HEADER_LEN * 8].view(torch.int64)) == spec
    assert torch.equal(packed[HEADER_LEN * 8:HEADER_LEN * 8 + 48].view(torch.float32),
                       torch.ones(12))
    changed = step(5)     # the packed size is last step's; header and zeros, then the data
    assert [i for i, _ in changed] == [0, 1, 2, 1, 2]
    assert changed[0][1].numel() == packed_size(spec)
    assert Spec.decode(changed[0][1][:HEADER_LEN * 8].view(torch.int64)).tensors[0][0] == (5, 3)
    assert not changed[0][1][HEADER_LEN * 8:].any()
    # data bytes, the packed copy included and the header not: 2 steps of 4 rows, 1 of 5
    assert p2p.bytes_sent == 2 * 2 * (12 * 4 + 4 * 8) + 2 * (15 * 4 + 5 * 8)
    sent.clear()          # a gradient message with a note: one buffer, the gradients then the note
    p2p.send("B", 1, 0, [torch.full((5, 3), 2.0)], peer=0,
             note=torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert [i for i, _ in sent] == [63] and sent[0][1].numel() == 64 + 64
    assert torch.equal(sent[0][1][:60].view(torch.float32), torch.full((15,), 2.0))
    assert sent[0][1][64:80].view(torch.float64).tolist() == [1.0, 2.0]


def test_bad_boundary_value_is_refused():
    with pytest.raises(TypeError, match="flat tuple of"):
        flatten({"a": torch.ones(1)})


def test_more_tensors_than_tag_slots_is_refused_with_the_remedy():
    spec_of(tuple(torch.ones(1) for _ in range(MAX_TENSORS)))
    with pytest.raises(TypeError, match="at most 62 .* concatenate"):
        spec_of(tuple(torch.ones(1) for _ in range(MAX_TENSORS + 1)))


def _notes():
    """A note rides after a message in each direction, also on a header's first message."""
    from engine.comm import P2P
    from engine.mesh import Mesh

    mesh = Mesh(2, 1)
    p2p = P2P(mesh, timeout_s=20)
    p2p.hold = True
    out = {}
    for step in range(2):  # the second step's header travels packed with the data
        p2p.new_step()
        if mesh.rank == 0:
            x = torch.ones(2, 3, requires_grad=True) * (step + 1)
            p2p.send("F", 0, 0, x, peer=1,
                     note=torch.tensor([1.0, 0.0, 5.0 + step], dtype=torch.float64))
            r = p2p.post("B", 0, 0, peer=1, note_len=3)
            p2p.flush()
            out[step] = {"grad": r.wait()[0].clone(), "note": r.note.clone()}
        else:
            r = p2p.post("F", 1, 0, peer=0, note_len=3)
            p2p.flush()
            x = r.wait()
            out[step] = {"note": r.note.clone(), "x": x.detach().clone()}
            note = r.note.clone()
            note[2] += 1
            p2p.send("B", 1, 0, [x.detach() * 2], peer=0, note=note)
            p2p.flush()
        p2p.wait_sends()
    return out


def test_a_note_rides_after_a_message_in_both_directions():
    r0, r1 = run_workers(_notes, 2, timeout_s=60)
    for step in range(2):
        assert r1[step]["note"].tolist() == [1.0, 0.0, 5.0 + step]
        torch.testing.assert_close(r1[step]["x"], torch.full((2, 3), step + 1.0))
        assert r0[step]["note"].tolist() == [1.0, 0.0, 6.0 + step]
        assert r0[step]["note"].dtype == torch.float64
        torch.testing.assert_close(r0[step]["grad"], torch.full((2, 3), 2.0 * (step + 1)))


SIZES = (4, 6, 6, 4)


def _exchange():
    import torch.distributed as dist
    from engine.comm import CommError, P2P
    from engine.mesh import Mesh

    mesh = Mesh(2, 1)
    p2p = P2P(mesh, timeout_s=20)
    out = {}
    # shapes change between steps, stay (the first data travels packed with the header), change
    # back (packed buffer sized by last step's shapes: header and zeros, then the data)
    for step, n in enumerate(SIZES):
        p2p.new_step()
        if mesh.rank == 0:
            sent = []
            for mb in range(2):
                a = torch.full((n, 3), float(mb + step), requires_grad=True) * 2
                # float-rg, int, float without grad, empty, one-byte bool (alignment)
                v = (a, torch.arange(n), torch.ones(n), torch.empty(0, 2),
                     torch.arange(n) % 2 == 0)
                p2p.send("F", 0, mb, v, peer=1)
                sent.append(v)
            grads = [p2p.post("B", 0, mb, peer=1).wait() for mb in range(2)]
            out[step] = [g[0].clone() for g in grads]
        else:
            recvs = [p2p.post("F", 1, 0, peer=0)]
            out.setdefault("posted_packed", []).append(recvs[0].packed is not None)
            got0 = recvs[0].wait()
            got1 = p2p.post("F", 1, 1, peer=0).wait()   # header reused within the step
            out[step] = [(t.clone(), t.requires_grad) for t in got0 + got1]
            for mb, got in enumerate((got0, got1)):
                p2p.send("B", 1, mb, [got[0].detach() * 10], peer=0)
        p2p.wait_sends()
    # a receive that never comes fails with a message naming the peer (gloo then closes the
    # connection: rank 0 waits on the rendezvous store, not on a collective)
    store = dist.distributed_c10d._get_default_store()
    if mesh.rank == 1:
        slow = P2P(mesh, timeout_s=1.0)
        try:
            r = slow.post("F", 1, 5, peer=0)
            r.wait()
        except CommError as e:
            out["timeout"] = str(e)
        store.set("timeout-seen", "1")
    else:
        store.wait(["timeout-seen"])
    return out


def test_two_rank_exchange_and_timeout():
    r0, r1 = run_workers(_exchange, 2, timeout_s=90)
    for step, n in enumerate(SIZES):
        recv = r1[step]
        a0, i0, f0, e0, b0, a1, i1, f1, e1, b1 = recv
        assert a0[0].shape == (n, 3) and torch.all(a0[0] == 2.0 * step) and a0[1]
        assert torch.all(a1[0] == 2.0 * (1 + step))
        assert i0[0].dtype == torch.int64 and torch.equal(i0[0], torch.arange(n)) and not i0[1]
        assert not f0[1]                          # sender's tensor did not require grad
        assert torch.equal(f0[0], torch.ones(n)) and torch.equal(f1[0], torch.ones(n))
        assert e0[0].shape == e1[0].shape == (0, 2)
        assert b0[0].dtype == torch.bool and torch.equal(b0[0], torch.arange(n) % 2 == 0)
        assert torch.equal(b1[0], b0[0]) and torch.equal(i1[0], i0[0])
        for mb in range(2):
            torch.testing.assert_close(r0[step][mb], torch.full((n, 3), 20.0 * (mb + step)))
    # from the second step on, the first receive was posted packed with last step's shapes:
    # right at step 2, wrong at steps 1 and 3 (the data followed)
    assert r1["posted_packed"] == [False, True, True, True]
    msg = r1["timeout"]
    assert "timed out after 1 s" in msg and "from rank 0" in msg and "chunk 1 microbatch 5" in msg
