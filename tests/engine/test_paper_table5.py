"""The Zero Bubble paper's Table 5 (arXiv 2401.10241, ICLR 2024 version), recomputed by
pipeshard's simulator from the paper's own Table 9 profiled times.

Table 9 gives, per model and layout, T_F, T_B (the input-gradient backward, pipeshard's I), T_W
and T_comm in ms; Table 5 the bubble rates of 1F1B, ZB-H1, ZB-H2 and the automatic ZB-2p. The
paper's bubble rate counts each rank from its own first action (the optimizer step does not
synchronise ranks, so the next step's warm-up overlaps this step's cool-down): it is
``simulate(..., steps=N)``'s steady-state bubble. pipeshard's zb-auto at ZB-2p's memory (2p
microbatches) is shown beside ZB-2p; it does not reach the paper's figure (docs/schedules.md).

Provenance (docs/schedules.md): the figures were typed from the paper, not read from a
machine-readable copy; three ZB-H2 entries (6.2B m=32, 64; 28.3B m=256) differ from the
simulator in the third or fourth decimal and may be transcription errors.
"""
from __future__ import annotations

import pytest

from engine.schedules import build_schedule
from engine.simulate import simulate

# model, p, m, T_F, T_B, T_W, T_comm (Table 9)
TABLE9 = [("1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601), ("1.5B", 8, 32, 18.513, 18.086, 9.331, 0.626),
          ("1.5B", 8, 64, 18.546, 18.097, 9.321, 0.762), ("6.2B", 8, 24, 29.718, 29.444, 19.927, 0.527),
          ("6.2B", 8, 32, 29.802, 29.428, 19.530, 0.577), ("6.2B", 8, 64, 29.935, 29.621, 19.388, 0.535),
          ("14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377), ("14.6B", 16, 64, 11.307, 11.254, 8.101, 0.379),
          ("14.6B", 16, 128, 11.325, 11.308, 8.109, 0.378), ("28.3B", 32, 96, 10.419, 10.207, 7.715, 0.408),
          ("28.3B", 32, 128, 10.408, 10.204, 7.703, 0.408), ("28.3B", 32, 256, 10.402, 10.248, 7.698, 0.460)]
# 1F1B, ZB-H1, ZB-H2, ZB-2p (Table 5)
TABLE5 = [(0.2431, 0.1585, 0.1083, 0.0433), (0.1985, 0.1242, 0.0837, 0.0039), (0.1240, 0.0674, 0.0444, 0.0026),
          (0.2347, 0.1323, 0.0698, 0.0029), (0.1898, 0.1045, 0.0534, 0.0022), (0.1091, 0.0554, 0.0286, 0.0010),
          (0.2552, 0.1397, 0.0672, 0.0066), (0.2082, 0.1088, 0.0516, 0.0054), (0.1251, 0.0576, 0.0266, 0.0028),
          (0.2646, 0.1421, 0.0641, 0.0038), (0.2168, 0.1106, 0.0490, 0.0047), (0.1352, 0.0594, 0.0256, 0.0025)]
STEPS = 3   # the steady state is reached by the second step; the third checks it holds


def bubble(schedule, row) -> float:
    _, p, m, f, i, w, c = row
    return simulate(schedule, f, i + w, w, c, steps=STEPS).bubbles[-1]


@pytest.mark.parametrize("row,paper", [pytest.param(r, t, marks=[pytest.mark.slow] if r[1] > 8 else [])
                                       for r, t in zip(TABLE9, TABLE5)],   # p = 16, 32: seconds each
                         ids=[f"{r[0]}-m{r[2]}" for r in TABLE9])
def test_handcrafted_bubbles_are_the_papers(row, paper):
    _, p, m, *_ = row
    got = [bubble(build_schedule(name, p, m), row) for name in ("1f1b", "zb-h1", "zb-h2")]
    assert got == pytest.approx(list(paper[:3]), abs=0.01)   # issue 40's bound
    assert got[:2] == pytest.approx(list(paper[:2]), abs=5e-5)   # 1F1B, ZB-H1: all four decimals
    # one step with a synchronous optimizer step: zb-h2 then pays the whole pipeline fill (the
    # issue's 0.1003 at 6.2B, m=24); on the 1.5B rows the steady state is no better
    one = simulate(build_schedule("zb-h2", p, m), row[3], row[4] + row[5], row[5], row[6])
    assert one.bubble_fraction >= got[2] - 1e-12
    if row[0] != "1.5B":
        assert one.bubble_fraction > got[2] + 0.01


# the paper's memory accounting for a W pending after its I (32h of 34h + 5as per token, GPT; the
# models of its Table 3: 1.5B h=2304 a=24, the others a = h / 128), s = 1024
HOLD = {"1.5B": 0.366, "6.2B": 0.432, "14.6B": 0.432, "28.3B": 0.432}
ROWS = [(r, t) for r, t in zip(TABLE9, TABLE5) if r[1] == 8 and r[2] <= 32]   # the rest: docs


@pytest.mark.slow
@pytest.mark.parametrize("row,paper", ROWS, ids=[f"{r[0]}-m{r[2]}" for r, _ in ROWS])
def test_zb_auto_at_zb_2p_memory(row, paper):
    _, p, m, f, i, w, c = row
    s = build_schedule("zb-auto", p, m, max_inflight=2 * p, forward_s=f, backward_s=i + w,
                       weight_s=w, comm_s=c, steps=2, weight_hold=HOLD[row[0]])
    got = bubble(s, row)
    assert got < bubble(build_schedule("zb-h2", p, m), row)   # better than ZB-H2
    assert got == pytest.approx(paper[3], abs=0.01)           # issue 40's bound against ZB-2p
