"""The fixed-cost fit: pure functions on numbers, and one short measurement on two ranks."""
from __future__ import annotations

import math

import pytest

from engine.overhead import _fit_line, fit_action_cost, measure_fixed_costs
from engine.schedules import build_schedule
from engine.simulate import simulate


def test_fit_line_recovers_latency_and_rate():
    lat, rate = 50e-6, 2e9
    pts = [(n, lat + n / rate) for n in (256, 65536, 1 << 20)]
    got_lat, got_rate = _fit_line(pts)
    assert got_lat == pytest.approx(lat, rel=1e-6)
    assert got_rate == pytest.approx(rate, rel=1e-6)


@pytest.mark.parametrize("a", [1e-5, 3e-4, 2e-3])
def test_fit_action_cost_inverts_the_simulator(a):
    lat = 8e-5
    t = {m: simulate(build_schedule("1f1b", 2, m), forward_s=a, backward_s=a, comm_s=lat).step_s
         + 0.004 for m in (16, 32)}                       # + a per-step constant
    assert fit_action_cost(16, t[16], 32, t[32], latency_s=lat) == pytest.approx(a, rel=1e-6)


@pytest.mark.parametrize("a", [1e-5, 3e-4])
def test_fit_action_cost_inverts_the_simulator_of_another_schedule(a):
    lat = 8e-5
    t = {m: simulate(build_schedule("interleaved-1f1b", 2, m, 2), forward_s=a, backward_s=a,
                     comm_s=lat).step_s + 0.002 for m in (8, 16)}
    got = fit_action_cost(8, t[8], 16, t[16], latency_s=lat, schedule="interleaved-1f1b",
                          virtual_stages=2)
    assert got == pytest.approx(a, rel=1e-6)


@pytest.mark.slow
def test_measure_fixed_costs_runs_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPESHARD_CACHE_DIR", str(tmp_path))
    costs = measure_fixed_costs(microbatches=(4, 8), steps=3, exchanges=4)
    assert costs["action_s"] > 0 and costs["link_bytes_per_s"] > 0
    for mode in ("send_wait", "yield"):                  # the other modes
        assert costs[f"action_s_{mode}"] > 0 and costs[f"step_s_{mode}"] >= 0
        assert set(costs["measured"][f"steps_s_{mode}"]) == set(costs["measured"]["steps_s"])
    assert costs["message_busy_s"] >= 0 and len(costs["measured"]["exchange"]) == 2   # both ranks
    assert all(math.isfinite(e["busy_s"]) and e["idle_s"] > 0 for e in costs["measured"]["exchange"])
    assert set(costs["optimizer_s_per_byte"]) == {"sgd", "adam", "adamw"}
    assert all(v > 0 for v in costs["optimizer_s_per_byte"].values())
    assert list(tmp_path.iterdir())                      # cached ...
    assert measure_fixed_costs(microbatches=(4, 8), steps=3, exchanges=4) == costs  # ... read back


@pytest.mark.slow
def test_measure_collectives_runs_and_caches(tmp_path, monkeypatch):
    """gloo's all-reduce, all-gather and reduce-scatter timed idle (2 ranks) at every size and
    busy (4 ranks on 2 cores) at every size but the smallest; cached, read back."""
    from engine.overhead import measure_collectives

    monkeypatch.setenv("PIPESHARD_CACHE_DIR", str(tmp_path))
    got = measure_collectives(sizes=(4096, 65536, 262144), repeats=3, blocks=2)
    kinds = {"all_reduce", "all_gather", "reduce_scatter"}
    assert {(k, b) for k, n, b, _ in got["points"]} == {(k, b) for k in kinds for b in (4096, 65536, 262144)}
    assert {(k, b) for k, n, b, _ in got["busy_points"]} == {(k, b) for k in kinds for b in (65536, 262144)}
    assert all(n == 2 and t > 0 for _, n, _, t in got["points"])
    assert all(math.isfinite(t) and t >= 0 for *_, t in got["busy_points"])
    assert measure_collectives(sizes=(4096,), repeats=1) == got   # read back from the cache


@pytest.mark.slow
def test_measure_cpu_costs_runs_and_caches(tmp_path, monkeypatch):
    """The CPU off the actions on two ranks: a per-step CPU per runtime mode, a per-byte CPU of a
    message end (>= 0), the per-step transport CPU recorded; cached, read back."""
    from engine.overhead import measure_cpu_costs

    monkeypatch.setenv("PIPESHARD_CACHE_DIR", str(tmp_path))
    costs = measure_cpu_costs(microbatches=(2, 4), steps=3, sizes=(256, 1 << 20))
    assert set(costs["step_cpu_s"]) == {"step", "compute", "yield"}
    assert all(v >= 0 for v in costs["step_cpu_s"].values())
    assert costs["message_cpu_byte_s"] >= 0 and costs["message_busy_bytes"] == 16384
    assert all(v > 0 for v in dict(costs["measured"]["main_cpu_s_per_step"]["compute"]).values())
    # three ranks on two cores at two microbatch sizes: each schedule's step, a layer alone
    assert [rec["size"] for rec in costs["shared"]] == [48, 12]
    for shared in costs["shared"]:
        assert (shared["ranks"], shared["cores"]) == (3, 2)
        assert {(r["schedule"], r["microbatches"]) for r in shared["runs"]} == {
            *((s, m) for s in ("1f1b", "gpipe", "zb-h2") for m in (4, 8)), ("interleaved-1f1b", 6)}
        assert all(r["step_s"] > 0 for r in shared["runs"])
        assert all(shared["layer"][k] > 0 for k in ("forward_s", "backward_s", "input_grad_s", "weight_grad_s"))
    small, large = (sum(rec["layer"][k] for k in ("forward_s", "backward_s")) for rec in costs["shared"][::-1])
    assert small < large   # a quarter of the samples: a smaller action
    assert measure_cpu_costs(microbatches=(2, 4), steps=3, sizes=(256, 1 << 20)) == costs
