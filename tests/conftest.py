"""Test-wide setup: one thread per process, and the Hydra ``compose_cfg`` fixture.

The packages and the shared helpers in this directory (``dist_helpers``, ``problems``,
``faults``, ``wandb_offline``) are found through pytest's ``pythonpath`` (pyproject.toml), the
one place that sets the import path.
"""
import os
from typing import Any, Callable

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The runtime's fixed costs (engine.overhead) are measured once per test session, not read from
# (or written to) the user's ~/.cache/pipeshard.
if "PIPESHARD_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["PIPESHARD_CACHE_DIR"] = tempfile.mkdtemp(prefix="pipeshard-cache-")


@pytest.fixture(scope="session")
def compose_cfg() -> Callable[..., Any]:
    """``compose_cfg(*overrides)``: ``conf/config.yaml`` composed with command-line style overrides.

    >>> def test_x(compose_cfg):
    ...     cfg = compose_cfg("experiment=smoke", "pipeline.stages=3")
    """
    from experiments.config import compose_config

    return compose_config
