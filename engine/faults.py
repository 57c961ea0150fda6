"""Fault injection for recovery tests and soak runs: kill this rank at a named point.

``PIPESHARD_FAULT`` holds comma-separated rules ``<point>@<step>[:rank=<r>][:attempt=<a>]``;
a rank whose rank, step and restart attempt (default 0, the first run) match kills itself with
SIGKILL when it reaches the point. Points: ``step`` (the training loop, before step ``<step>``
runs), ``save`` (checkpoint ``<step>``'s data is written, its manifest is not) and ``manifest``
(rank 0 wrote the manifest but has not renamed the directory). Unset: no effect.

Example::

    PIPESHARD_FAULT="step@5:rank=1,save@6:rank=1:attempt=1" python -m experiments.train ...
"""

from __future__ import annotations

import os
import signal

__all__ = ["inject", "parse_rules", "ENV", "POINTS"]

ENV = "PIPESHARD_FAULT"
POINTS = ("step", "save", "manifest")


def parse_rules(text: str) -> list[dict]:
    """The rules of a ``PIPESHARD_FAULT`` value.

    >>> parse_rules("step@5:rank=1")
    [{'point': 'step', 'step': 5, 'rank': 1, 'attempt': 0}]
    """
    rules = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        head, *opts = item.split(":")
        point, _, step = head.partition("@")
        if point not in POINTS or not step.isdigit():
            raise ValueError(f"{ENV}: {item!r} is not '<{'|'.join(POINTS)}>@<step>[:rank=R][:attempt=A]'")
        rule = {"point": point, "step": int(step), "rank": None, "attempt": 0}
        for opt in opts:
            key, _, value = opt.partition("=")
            if key not in ("rank", "attempt") or not value.isdigit():
                raise ValueError(f"{ENV}: option {opt!r} in {item!r} is not rank=R or attempt=A")
            rule[key] = int(value)
        rules.append(rule)
    return rules


def inject(point: str, step: int, *, rank: int | None = None) -> None:
    """Kill this process with SIGKILL if a ``PIPESHARD_FAULT`` rule matches (else nothing)."""
    text = os.environ.get(ENV)
    if not text:
        return
    from engine.cluster import restart_count

    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    attempt = restart_count()
    for rule in parse_rules(text):
        if rule["point"] == point and rule["step"] == step and rule["attempt"] == attempt \
                and rule["rank"] in (None, rank):
            os.kill(os.getpid(), signal.SIGKILL)
