"""partitioner.batchsim: the schedule's simulation for many splits at once is engine.simulate's, float for float."""
import numpy as np
import pytest

from engine.schedules import build_schedule
from engine.simulate import simulate
from partitioner.batchsim import compile_schedule, simulate_many

LAYOUTS = [("gpipe", 3, 4, 1, None), ("1f1b", 4, 8, 1, None), ("interleaved-1f1b", 2, 4, 2, None),
           ("interleaved-1f1b", 3, 6, 3, None), ("zb-h1", 3, 6, 1, None), ("zb-h2", 3, 6, 1, 4),
           ("zbv", 3, 6, 2, None), ("1f1b", 1, 3, 1, None)]


@pytest.mark.parametrize("name,p,m,v,cap", LAYOUTS)
def test_every_candidate_ends_where_the_event_simulator_ends(name, p, m, v, cap):
    rng = np.random.default_rng(p * 31 + m)
    sched = build_schedule(name, p, m, v, max_inflight=cap)
    graph = compile_schedule(name, p, m, v, cap)
    k, C = p * v, 7
    f = rng.uniform(0.1, 2.0, (k, C))
    b = f * rng.uniform(1.0, 3.0, (k, C))
    w = b * rng.uniform(0.1, 0.9, (k, C))
    comm = rng.uniform(0.0, 0.5, (max(k - 1, 0), C))
    ends = simulate_many(graph, f, b, w, comm)
    assert ends.shape == (p, C)
    for j in range(C):
        ref = simulate(sched, list(f[:, j]), list(b[:, j]), weight_s=list(w[:, j]),
                       comm_s=list(comm[:, j]) if k > 1 else 0.0)
        want = [row[-1][2] if row else 0.0 for row in ref.timeline]
        assert list(ends[:, j]) == want          # the same float, not approximately
        assert float(ends[:, j].max()) == ref.step_s


def test_many_candidates_are_cut_into_batches_with_the_same_answer(monkeypatch):
    import partitioner.batchsim as bs
    graph = compile_schedule("1f1b", 4, 8)
    rng = np.random.default_rng(3)
    f, comm = rng.uniform(0.1, 1.0, (4, 50)), rng.uniform(0, 0.1, (3, 50))
    whole = simulate_many(graph, f, 2 * f, f, comm)
    monkeypatch.setattr(bs, "_CELLS", graph.num_actions * 3)     # three candidates per batch
    assert np.array_equal(simulate_many(graph, f, 2 * f, f, comm), whole)
