"""`choice_text`: a configuration choice (an Enum member of experiments.config, or a string) as
its plain text.

experiments/ reads the typed `experiments.config.Config` by attribute (`cfg.pipeline.stages`);
tests/experiments/test_config_reads.py fails on any dotted-path read.

Example:
    >>> from experiments.config import ScheduleName
    >>> choice_text(ScheduleName["1f1b"]), choice_text("gpipe")
    ('1f1b', 'gpipe')
"""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = ["choice_text", "sequence_parallel_mode"]


def choice_text(value: Any) -> str:
    """A choice (Enum member or string) as its plain text: `choice_text(ScheduleName["1f1b"]) == "1f1b"`."""
    return str(value.value) if isinstance(value, Enum) else str(value)


def sequence_parallel_mode(value: Any) -> bool | str:
    """`model.sequence_parallel` as True, False or "auto" (the planner chooses); ValueError otherwise.
    A model group without the field (the MLP) reads False.

    >>> sequence_parallel_mode("auto"), sequence_parallel_mode(True), sequence_parallel_mode("false")
    ('auto', True, False)
    """
    text = choice_text(value).strip().lower()
    got = {"true": True, "false": False, "auto": "auto"}.get(text)
    if got is None:
        raise ValueError(f"model.sequence_parallel={value!r}; choose true (norms and residual stream split on the "
                         "sequence over the tp ranks), false, or auto (the planner chooses)")
    return got
