"""docs/configuration.md is generated from the schema dataclasses and cannot go stale."""

from __future__ import annotations

import dataclasses

from experiments import config as schema
from experiments.config_doc import DOC_PATH, field_docs, main, render

SCHEMAS = [schema.Config, schema.GPTConfig, schema.MLPConfig, schema.HFModelConfig, schema.TextDataConfig,
           schema.SyntheticDataConfig, schema.HFDataConfig, schema.PipelineConfig, schema.SearchConfig,
           schema.PartitionerConfig, schema.OptimConfig, schema.LoggerConfig, schema.TrainConfig,
           schema.CheckpointConfig, schema.BenchConfig, schema.GenerateConfig, schema.ExportConfig]


def test_the_committed_reference_is_the_generated_one():
    assert DOC_PATH.read_text() == render(), "docs/configuration.md is stale: run python -m experiments.config_doc"
    assert main(["--check"]) == 0


def test_every_key_has_a_one_line_doc_and_is_in_the_reference():
    text = DOC_PATH.read_text()
    for cls in SCHEMAS:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs[f.name] and "\n" not in docs[f.name], f"{cls.__name__}.{f.name} has no one-line doc"
            assert f"{f.name}`" in text, f"{cls.__name__}.{f.name} is missing from {DOC_PATH.name}"


def test_the_reference_follows_a_changed_doc(monkeypatch):
    """The page is read from the field docs: a changed doc changes the page (the check can fail)."""
    real = field_docs

    def changed(cls: type) -> dict[str, str]:
        docs = real(cls)
        return {**docs, "stages": "CHANGED"} if cls is schema.PipelineConfig else docs

    monkeypatch.setattr("experiments.config_doc.field_docs", changed)
    assert "| `pipeline.stages` | `2` | CHANGED |" in render() and main(["--check"]) == 1
