"""Build modules on the meta device without running their initialisers.

`with torch.device("meta")` alone runs every `nn.init.*_` and `Tensor.normal_` on the meta
tensors. Their meta kernels are Python references decorated to disable TorchDynamo, so the
first one imports `torch._dynamo`: about 0.9 s in every process that counts a model's
parameters, for values that the meta device throws away anyway. `meta_device()` skips those
in-place initialisers on meta tensors; everything else (shapes, dtypes, forward on meta) is
unchanged.

Example:
    >>> import torch
    >>> with meta_device():
    ...     layer = torch.nn.Linear(4, 3)
    >>> layer.weight.is_meta, tuple(layer.weight.shape)
    (True, (3, 4))
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

__all__ = ["meta_device"]

_TENSOR_INITS = ("normal_", "uniform_", "zero_", "fill_", "exponential_", "random_", "bernoulli_")


@functools.cache
def _tensor_inits() -> frozenset:
    import torch

    return frozenset(getattr(torch.Tensor, name) for name in _TENSOR_INITS)


def _is_initialiser(func: Any) -> bool:
    if func in _tensor_inits():
        return True
    # nn.init's in-place initialisers (normal_, kaiming_uniform_, ...); not its helpers
    # (calculate_gain, _calculate_fan_in_and_fan_out), which return numbers
    name = getattr(func, "__name__", "")
    return getattr(func, "__module__", None) == "torch.nn.init" and name.endswith("_") and not name.startswith("_")


@functools.cache
def _skip_mode() -> type:
    import torch
    from torch.overrides import TorchFunctionMode

    class SkipMetaInit(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta and _is_initialiser(func):
                return target
            return func(*args, **kwargs)

    return SkipMetaInit


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """`with torch.device("meta")`, minus the initialisers' work (module docstring)."""
    import torch

    with torch.device("meta"), _skip_mode()():
        yield
