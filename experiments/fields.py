"""`choice_text` (a choice as plain text), and the old dotted-path reader `get_field`.

experiments/ reads the typed `experiments.config.Config` by attribute (`cfg.pipeline.stages`);
`get_field` is kept only so that code written before the typed config still imports while it is
converted: tests/experiments/test_config_reads.py fails on any use of it in engine/,
partitioner/ or experiments/.

Example:
    >>> get_field({"pipeline": {"stages": 2}}, "pipeline.stages")
    2
    >>> get_field({"model": {}}, "model.layers", 4)
    4
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

__all__ = ["get_field", "choice_text"]


def get_field(cfg: Any, path: str, default: Any = None) -> Any:
    """`cfg` at a dotted path, for a mapping (DictConfig included) or an object (`default` if absent)."""
    node = cfg
    for key in path.split("."):
        if node is None:
            return default
        node = node.get(key, default) if isinstance(node, Mapping) else getattr(node, key, default)
    return node


def choice_text(value: Any) -> str:
    """A choice (Enum member or string) as its plain text: `choice_text(ScheduleName["1f1b"]) == "1f1b"`."""
    return str(value.value) if isinstance(value, Enum) else str(value)
