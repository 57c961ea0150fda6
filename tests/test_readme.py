"""Every command the README shows parses: each `python -m experiments.<app> ...` in its shell
blocks composes with Hydra, as the app would compose it, and passes `validate_config`.

Commands whose model comes from a directory (`model.pretrained=...`) are composed but not
validated: the directory is the user's own, or one an earlier README command writes. A sweep
(`-m a=1,2`) is composed once per value. Nothing is trained.

Example::

    >>> readme_commands("```bash\\npython -m experiments.train -m a=1,2  # x\\n```")
    [('train', True, ['a=1,2'])]
"""
from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
# app -> the primary config it composes (experiments/app.py: "config"; export_hf its own)
APPS = {"train": "config", "partition": "config", "bench": "config", "generate": "config",
        "export_hf": "export_hf"}
_SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.S | re.M)
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def readme_commands(text: str) -> list[tuple[str, bool, list[str]]]:
    """(app, multirun, overrides) for each `-m experiments.<app>` command in the shell blocks."""
    found = []
    for block in _SHELL_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            starts = [i for i, w in enumerate(words[1:], 1)
                      if words[i - 1] == "-m" and w.startswith("experiments.")]
            for i in starts:
                app, args = words[i].split(".", 1)[1], words[i + 1:]
                multirun = any(a in ("-m", "--multirun") for a in args)
                found.append((app, multirun, [a for a in args if a not in ("-m", "--multirun")]))
    return found


def _expanded(overrides: list[str]) -> list[list[str]]:
    """One override list per point of a sweep (`a=1,2 b=3,4`: four), as Hydra's basic sweeper."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    for text, o in zip(overrides, OverridesParser.create().parse_overrides(overrides)):
        if o.is_sweep_override():
            choices.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([text])
    return [list(point) for point in itertools.product(*choices)]


def _compose(app: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from experiments.config import CONF_DIR, compose_config, register_configs

    if APPS[app] == "config":
        if app == "bench":  # the bench preset unless the command picks an experiment
            from experiments.bench.__main__ import _default_experiment
            overrides = _default_experiment(["bench", *overrides])[1:]
        return compose_config(*overrides)
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=APPS[app], overrides=overrides)


TEXT = README.read_text(encoding="utf-8")
COMMANDS = readme_commands(TEXT)
PYTHON_EXAMPLES = _PYTHON_BLOCK.findall(TEXT)


def test_the_readme_shows_every_task():
    apps = {app for app, _, _ in COMMANDS}
    assert apps == set(APPS), f"README commands cover {sorted(apps)}; expected {sorted(APPS)}"
    assert len(COMMANDS) >= 10


@pytest.mark.parametrize("app,multirun,overrides", COMMANDS,
                         ids=[f"{a}:{' '.join(o)[:60]}" for a, _, o in COMMANDS])
def test_readme_command_composes(app, multirun, overrides):
    from experiments.config import validate_config

    assert not [o for o in overrides if o.startswith("-")], f"unknown flag in {overrides}"
    points = _expanded(overrides)
    assert multirun or len(points) == 1, f"a sweep without -m: {overrides}"
    for point in points:
        cfg = _compose(app, point)
        if APPS[app] == "config" and not any(o.startswith("model.pretrained=") for o in point):
            validate_config(cfg)


@pytest.mark.parametrize("index", range(len(PYTHON_EXAMPLES)))
def test_readme_python_example_compiles(index):
    """The README's Python examples are valid Python (compiled, not run: they start processes)."""
    compile(PYTHON_EXAMPLES[index], f"README.md, python block {index}", "exec")


def test_a_bad_override_fails_here():
    """The check can fail: a key that does not exist is refused at composition."""
    from hydra.errors import ConfigCompositionException

    (app, _, overrides), = readme_commands("```bash\npython -m experiments.train pipeline.stagez=2\n```")
    with pytest.raises(ConfigCompositionException):
        _compose(app, overrides)
