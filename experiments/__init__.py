"""pipeshard experiments: Hydra configuration, reference models, data, W&B tracking, entry points.

One way through: the entry points (`train`, `partition`, `bench`, each a Hydra app through
`app.hydra_entry`) read the config (`config`, `fields`), turn it into engine and partitioner
arguments (`wiring`), prepare a `job.Job` and start the workers (`runner.run_worker`), which
use `models`, `data` and `tracking`. Nothing below an entry point imports one.

Importing this package is light (no hydra, wandb, transformers or DeepSpeed at import time);
the submodules import what they need.

Example:
    >>> from experiments.models import build_model
    >>> from experiments.data import make_dataset
"""

__all__ = ["app", "bench", "config", "data", "fields", "job", "models", "partition", "runner", "tracking",
           "train", "wiring"]
