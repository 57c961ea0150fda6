"""`docs/configuration.md`, generated from the schema dataclasses of `experiments.config`.

Every key's meaning is the one-line doc written beside its field declaration (the trailing
comment, read with `tokenize`; a subclass field without one takes its base class's), and its
default is what `conf/config.yaml` composes to (the dataclass default, or the option's own value
where a group option such as `model=hf_llama` sets one). A test regenerates the page and fails
when the committed one differs, so the page cannot go stale.

Example::

    python -m experiments.config_doc            # rewrite docs/configuration.md
    python -m experiments.config_doc --check    # exit 1 if docs/configuration.md is stale
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
from enum import Enum
from typing import Any

from experiments import config as schema

__all__ = ["field_docs", "render", "DOC_PATH", "main"]

DOC_PATH = schema.CONF_DIR.parent / "docs" / "configuration.md"
"""Where the generated reference lives."""

# (group key, its schema, the options of the group whose defaults differ: each listed separately)
_GROUPS: list[tuple[str, type, tuple[str, ...]]] = [
    ("model", schema.ModelConfig, ("gpt", "mlp", "hf", "hf_gpt2", "hf_llama")),
    ("data", schema.DataConfig, ("text", "synthetic", "hf")),
    ("pipeline", schema.PipelineConfig, ()),
    ("partitioner", schema.PartitionerConfig, ()),
    ("optimizer", schema.OptimConfig, ("adamw", "adam", "sgd")),
    ("train", schema.TrainConfig, ()),
    ("checkpoint", schema.CheckpointConfig, ()),
    ("logger", schema.LoggerConfig, ()),
    ("bench", schema.BenchConfig, ()),
    ("generate", schema.GenerateConfig, ()),
]


def _own_docs(cls: type) -> dict[str, str]:
    """The trailing comment of each field declared in `cls` itself (on its last line, else its
    first, else the comment lines right above it)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    docs = {}
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = comments.get(node.end_lineno or node.lineno) or comments.get(node.lineno)
            if doc:
                docs[node.target.id] = doc
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """`{field: one-line doc}` for a schema dataclass, base classes' docs filling the gaps.

    >>> field_docs(schema.PipelineConfig)["stages"]
    'pipeline ranks (p)'
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_docs(klass))
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


def _text(value: Any) -> str:
    """A value as it is written in an override (YAML)."""
    if isinstance(value, Enum):
        return str(value.value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):
        return "(group)"
    if value == "???":
        return "required"
    return str(value)


def _values(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _table(prefix: str, values: dict[str, Any], docs: dict[str, str]) -> list[str]:
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for name, value in values.items():
        if dataclasses.is_dataclass(value):
            continue  # a nested group: its own table
        cell, doc = (x.replace("|", "\\|") for x in (_text(value), docs[name]))
        rows.append(f"| `{prefix}{name}` | `{cell}` | {doc} |")
    return rows


def _summary(cls: type) -> str:
    return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())


def _group(key: str, cls: type, options: tuple[str, ...], composed: Any) -> list[str]:
    lines = [f"## `{key}`", ""]
    if not options:
        obj = getattr(composed, key)
        lines += [_summary(type(obj)), ""] + _table(f"{key}.", _values(obj), field_docs(type(obj))) + [""]
        for f in dataclasses.fields(obj):  # nested groups (partitioner.search)
            sub = getattr(obj, f.name)
            if dataclasses.is_dataclass(sub):
                lines += [f"### `{key}.{f.name}`", "", _summary(type(sub)), ""]
                lines += _table(f"{key}.{f.name}.", _values(sub), field_docs(type(sub))) + [""]
        return lines
    default = schema.choice_text(getattr(composed, key).name)
    lines += [f"{_summary(cls)} Choose an option with `{key}=<option>` (default `{key}={default}`), then "
              f"override its keys as `{key}.<key>=<value>`.", ""]
    for option in options:
        obj = getattr(schema.as_config(schema.compose_config(f"{key}={option}")), key)
        lines += [f"### `{key}={option}`", "", _summary(type(obj)), ""]
        lines += _table(f"{key}.", _values(obj), field_docs(type(obj))) + [""]
    return lines


def render() -> str:
    """The whole page (Markdown)."""
    composed = schema.as_config(schema.compose_config())
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m experiments.config_doc` from the dataclasses in experiments/config.py;",
        "     do not edit by hand (tests/experiments/test_config_doc.py fails when this page is stale). -->",
        "",
        "Every `python -m experiments.<app>` is a Hydra app on `conf/config.yaml`: override any key below on the",
        "command line (`pipeline.stages=4 train.steps=100`), pick a group option (`model=hf_llama`,",
        "`optimizer=sgd`) or a preset (`experiment=smoke`). Hydra checks each key and type against these",
        "dataclasses when it composes; `experiments.config.validate_config` then checks what spans several keys,",
        "before any worker starts. The code reads the composed config as the typed `experiments.config.Config`",
        "(`cfg.pipeline.stages`). Defaults are those `conf/config.yaml` composes to.",
        "",
        "## Top level",
        "",
    ]
    plain = {name: value for name, value in _values(composed).items() if not dataclasses.is_dataclass(value)}
    lines += _table("", plain, field_docs(schema.Config))
    lines.append("| `experiment` | `null` | a preset of overrides from `conf/experiment/`: "
                 + ", ".join(sorted(p.stem for p in (schema.CONF_DIR / "experiment").glob("*.yaml"))) + " |")
    lines.append("")
    for key, cls, options in _GROUPS:
        lines += _group(key, cls, options, composed)
    lines += ["## `python -m experiments.export_hf`", "", "Its own config, `conf/export_hf.yaml`.", ""]
    export = schema.ExportConfig
    lines += _table("", {f.name: f.default for f in dataclasses.fields(export)}, field_docs(export)) + [""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write `docs/configuration.md` (or, with `--check`, report whether it is current)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page differs from the generated one")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = DOC_PATH.read_text() if DOC_PATH.is_file() else ""
        if current != text:
            print(f"{DOC_PATH} is stale: run python -m experiments.config_doc", file=sys.stderr)
            return 1
        return 0
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
