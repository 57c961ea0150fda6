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

__all__ = ["choice_text"]


def choice_text(value: Any) -> str:
    """A choice (Enum member or string) as its plain text: `choice_text(ScheduleName["1f1b"]) == "1f1b"`."""
    return str(value.value) if isinstance(value, Enum) else str(value)
