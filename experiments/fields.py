"""Reading a config field, whatever the config is: a composed `DictConfig`, a dataclass or plain dicts.

The one config reader of experiments/ (config validation, the wiring, models and data use it).
No dependencies, so a model or dataset built from plain dicts imports nothing of Hydra.

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
