"""The config is read by attribute: no dotted-path or item reads of it in engine/, partitioner/
or experiments/ (issue 43). A new `get_field(cfg, "a.b")` or `cfg["a"]["b"]` fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATH_READ = re.compile(r"\b(get_field|_get|_field)\(|OmegaConf\.select\(")
ITEM_READ = re.compile(r"\b(cfg|tcfg|lcfg|ccfg|bc|job\.config|self\.cfg)(\[[\"']|\.get\([\"'])")


def _hits(pattern: re.Pattern, packages: tuple[str, ...] = ("engine", "partitioner", "experiments")) -> list[str]:
    out = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "fields.py":  # the old reader's own definition and doctest
                continue
            for no, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    out.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    return out


def test_no_dotted_path_reads_of_the_config():
    assert _hits(PATH_READ) == []


def test_no_item_reads_of_the_config():
    """In experiments/, where the config lives (engine/ and partitioner/ take keyword arguments; a
    `cfg` there is e.g. the DeepSpeed dict engine/zero.py writes)."""
    assert _hits(ITEM_READ, ("experiments",)) == []


def test_the_patterns_catch_the_old_style():
    assert PATH_READ.search('x = get_field(cfg, "pipeline.stages")') and PATH_READ.search('_get(cfg, "a", 0)')
    assert ITEM_READ.search('cfg["train"]["seed"]') and ITEM_READ.search('self.tcfg.get("log_every")')
