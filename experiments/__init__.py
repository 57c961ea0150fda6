"""pipeshard experiments: Hydra configuration, reference models, data, W&B tracking, entry points.

One way through: the entry points (`train`, `partition`, `bench`, `generate`, each a Hydra app
through `app.hydra_entry`) get the composed config as the typed `config.Config` (turned into the
schema's dataclasses once, validated once) and hand that object down: `wiring` turns it into
engine and partitioner arguments, `job.Job` carries it to the workers (`runner.run_worker`),
which use `models`, `data` and `tracking`. Nothing below an entry point imports one.

Importing this package is light (no hydra, wandb, transformers or DeepSpeed at import time);
the submodules import what they need.

Example:
    >>> from experiments.models import build_model
    >>> from experiments.data import make_dataset
"""

__all__ = ["app", "bench", "config", "config_doc", "data", "fields", "job", "models", "partition", "runner",
           "tracking", "train", "wiring"]
