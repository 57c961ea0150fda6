"""experiments.bench.trace: per-rank torch.profiler traces of the timed steps, time by category."""

from __future__ import annotations

import dataclasses
import json

import pytest

from experiments.bench.spec import tiny_spec
from experiments.bench.trace import _self_times, category_of, format_trace, traced


def test_categories_and_self_times_on_plain_events() -> None:
    assert [category_of(n) for n in ("aten::mm", "c10d::recv_", "aten::empty_strided", "aten::copy_",
                                      "autograd::engine::evaluate_function: MmBackward0", "foo")] == \
        ["compute", "communication", "allocation", "copies", "autograd engine", "other"]
    events = [{"name": "outer", "ts": 0, "dur": 10}, {"name": "inner", "ts": 2, "dur": 3},
              {"name": "inner2", "ts": 6, "dur": 2}, {"name": "next", "ts": 12, "dur": 1}]
    got = {name: (self_us, top) for name, self_us, top, _ in _self_times(events)}
    assert got == {"outer": (5, True), "inner": (3, False), "inner2": (2, False), "next": (1, True)}


def test_traced_gives_each_run_its_own_directory() -> None:
    spec = tiny_spec()
    assert traced(spec, "pipeshard_1f1b") is spec                   # not tracing: unchanged
    t = traced(dataclasses.replace(spec, trace_dir="/x"), "pipeshard_1f1b")
    assert t.trace_dir == "/x/pipeshard_1f1b_0_4-4_8"


@pytest.mark.slow
def test_a_traced_run_writes_traces_and_accounts_for_its_wall_time(tmp_path) -> None:
    from experiments.bench.pipeshard_pp import run_pipeshard

    spec = dataclasses.replace(tiny_spec(steps=2), trace_dir=str(tmp_path))
    row = run_pipeshard(spec, "1f1b", timeout_s=300)
    assert len(row["trace"]) == 2
    for rank, t in enumerate(row["trace"]):
        (run_dir,) = tmp_path.iterdir()
        assert run_dir.name == "pipeshard_1f1b_v1_m4_capNone_0_4-4_8"
        trace = json.loads((run_dir / f"r{rank}.json").read_text())
        assert any(e.get("name") == "aten::addmm" for e in trace["traceEvents"])
        assert t["compute"] > 0 and t["communication"] > 0
        parts = sum(v for k, v in t.items() if k != "wall")
        assert parts == pytest.approx(t["wall"], rel=1e-6)   # self times of top-level ops + gaps = wall
        assert t["wall"] == pytest.approx(sum(row["step_s_all"]), rel=0.5)
    table = format_trace([row])
    assert table.count("| pipeshard | 1f1b |") == 2
