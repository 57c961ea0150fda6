"""The on-disk format of pipeshard checkpoints: DCP keys, safe reading, integrity, RNG states.

`engine.checkpoint` is the public interface (save, load, find); this module holds the pieces it
is built from, each small: the mapping between per-layer state and flat DCP keys, DCP save and
load calls, a restricted unpickler for DCP's ``.metadata`` (DCP itself unpickles it with plain
``pickle``), file hashes, model specs and fingerprint, and RNG capture/restore.

Example::

    state = build_state_dict({0: {"w": torch.ones(2)}}, None, capture_rng(), rank=0, num_layers=1)
    sorted(state)[:1]          # ['layer.0.w']
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["FORMAT", "MANIFEST", "DCP_METADATA", "CheckpointError", "layer_specs",
           "model_fingerprint", "describe_mismatch", "capture_rng", "restore_rng",
           "build_state_dict", "dcp_save", "dcp_load", "read_dcp_metadata", "keys_for",
           "files_of", "verify_files", "file_entry", "hash_rank_files", "specs_from_metadata",
           "optimizer_layers", "unflatten", "write_atomic", "fsync_dir"]

FORMAT = "pipeshard-checkpoint/2"
MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"
_RNG_JSON = "json"

# DCP warns that it "assumes the intent" of a single-process save/load: that is the intent here.
_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"
warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt, unsafe or for another model."""


# ---------------------------------------------------------------------------- model identity
def layer_specs(layers: Mapping[int, Mapping[str, Tensor]]) -> dict[int, dict[str, list]]:
    """Per layer, per tensor: ``[shape, dtype]`` (what a checkpoint must match).

    >>> layer_specs({0: {"weight": torch.zeros(2, 3)}})
    {0: {'weight': [[2, 3], 'torch.float32']}}
    """
    return {int(i): {name: [list(t.shape), str(t.dtype)] for name, t in sorted(params.items())}
            for i, params in layers.items()}


def model_fingerprint(specs: Mapping[int, Mapping[str, list]]) -> str:
    """sha256 of the whole model's layer count and per-layer names, shapes and dtypes."""
    canon = json.dumps({str(k): specs[k] for k in sorted(specs)}, sort_keys=True)
    return hashlib.sha256(f"{len(specs)}|{canon}".encode()).hexdigest()


def describe_mismatch(layer: int, saved: Mapping[str, list], mine: Mapping[str, list]) -> list[str]:
    """Readable differences between a checkpoint's and this model's specs of one layer."""
    out = []
    for name in sorted(set(saved) | set(mine)):
        if name not in mine:
            out.append(f"layer {layer}: the checkpoint has '{name}', this model does not")
        elif name not in saved:
            out.append(f"layer {layer}: this model has '{name}', the checkpoint does not")
        else:
            (s_shape, s_dtype), (m_shape, m_dtype) = saved[name], mine[name]
            if s_shape != m_shape:
                out.append(f"layer {layer}: '{name}' has shape {tuple(s_shape)} in the checkpoint, "
                           f"{tuple(m_shape)} in this model")
            if s_dtype != m_dtype:
                out.append(f"layer {layer}: '{name}' is {s_dtype} in the checkpoint, "
                           f"{m_dtype} in this model")
    return out


# ---------------------------------------------------------------------------- RNG
def capture_rng() -> dict:
    """This process's RNG states (torch CPU and CUDA, python ``random``, numpy), safe to save."""
    import numpy as np

    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {"torch": torch.get_rng_state(),
                           "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                                      "gauss": gauss}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached": float(cached)}
    return out


def restore_rng(state: Mapping[str, Any] | None) -> None:
    """Restore what :func:`capture_rng` captured (missing parts are left alone)."""
    if not state:
        return
    torch.set_rng_state(state["torch"])
    py = state.get("python")
    if py is not None:
        random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    npst = state.get("numpy")
    if npst is not None:
        import numpy as np
        np.random.set_state((npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
                             npst["has_gauss"], npst["cached"]))


def _pack(obj: Any, tensors: dict[str, Tensor]) -> Any:
    """A JSON skeleton of ``obj`` whose tensors are moved into ``tensors`` (``t<n>`` keys)."""
    if isinstance(obj, Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach()
        return {"__tensor__": key}
    if isinstance(obj, Mapping):
        return {str(k): _pack(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_pack(v, tensors) for v in obj]
    return obj


def _unpack(obj: Any, tensors: Mapping[str, Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        return {k: _unpack(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unpack(v, tensors) for v in obj]
    return obj


# ---------------------------------------------------------------------------- state <-> DCP keys
def build_state_dict(layers: Mapping[int, Mapping[str, Tensor]],
                     optimizer: Mapping[int, Mapping[str, Mapping[str, Tensor]]] | None,
                     rng: Mapping[str, Any] | None, rank: int, num_layers: int) -> dict[str, Tensor]:
    """The flat DCP state dict of one rank: ``layer.<i>.<name>``, ``optim.<i>.<param>.<key>``,
    ``rng.<rank>.*`` (tensors only: DCP would pickle anything else)."""
    bad = sorted(int(i) for i in layers if not 0 <= int(i) < num_layers)
    if bad:
        raise ValueError(f"layers {bad} are outside the model's {num_layers} layers")
    out: dict[str, Tensor] = {}
    for i, params in layers.items():
        for name, t in params.items():
            if not isinstance(t, Tensor):
                raise ValueError(f"layer {i}: '{name}' is a {type(t).__name__}, not a tensor; "
                                 "checkpoints hold tensors only")
            out[f"layer.{int(i)}.{name}"] = t.detach()
    for i, params in (optimizer or {}).items():
        for pname, entry in params.items():
            for key, t in entry.items():
                if isinstance(t, Tensor):
                    out[f"optim.{int(i)}.{pname}.{key}"] = t.detach()
    if rng is not None:
        tensors: dict[str, Tensor] = {}
        skeleton = json.dumps(_pack(rng, tensors)).encode()
        tensors[_RNG_JSON] = torch.frombuffer(bytearray(skeleton), dtype=torch.uint8)
        out.update({f"rng.{rank}.{k}": v for k, v in tensors.items()})
    return out


def unflatten(flat: Mapping[str, Tensor], wanted: list[int]
              ) -> tuple[dict[int, dict[str, Tensor]], dict[int, dict[str, dict[str, Tensor]]], dict | None]:
    """(layers, optimizer state, RNG states) from the flat keys read by :func:`dcp_load`."""
    layers: dict[int, dict[str, Tensor]] = {i: {} for i in wanted}
    optim: dict[int, dict[str, dict[str, Tensor]]] = {}
    rng_tensors: dict[str, Tensor] = {}
    for key, t in flat.items():
        kind, i, rest = key.split(".", 2)
        if kind == "layer":
            layers[int(i)][rest] = t
        elif kind == "optim":
            pname, skey = rest.rsplit(".", 1)
            optim.setdefault(int(i), {}).setdefault(pname, {})[skey] = t
        elif kind == "rng":
            rng_tensors[rest] = t
    rng = None
    if _RNG_JSON in rng_tensors:
        skeleton = json.loads(rng_tensors.pop(_RNG_JSON).numpy().tobytes().decode())
        rng = _unpack(skeleton, rng_tensors)
    return layers, optim, rng


def specs_from_metadata(metadata: Any) -> dict[int, dict[str, list]]:
    """Per-layer ``[shape, dtype]`` of the module tensors a DCP checkpoint holds."""
    specs: dict[int, dict[str, list]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("layer."):
            _, i, name = key.split(".", 2)
            specs.setdefault(int(i), {})[name] = [list(md.size), str(md.properties.dtype)]
    return {i: dict(sorted(s.items())) for i, s in sorted(specs.items())}


def optimizer_layers(metadata: Any) -> list[int]:
    """The layers with optimizer state in a DCP checkpoint."""
    return sorted({int(k.split(".", 2)[1]) for k in metadata.state_dict_metadata if k.startswith("optim.")})


def keys_for(metadata: Any, wanted: list[int], rng_rank: int | None) -> list[str]:
    """The DCP keys of the wanted layers (weights and optimizer state) and of one rank's RNG."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefixes = tuple(f"{kind}.{i}." for i in wanted for kind in ("layer", "optim"))
    if rng_rank is not None:
        prefixes += (f"rng.{rng_rank}.",)
    keys = [k for k in metadata.state_dict_metadata if k.startswith(prefixes)] if prefixes else []
    for k in keys:
        if not isinstance(metadata.state_dict_metadata[k], TensorStorageMetadata):
            raise CheckpointError(f"refusing to load {k!r}: the checkpoint stores it as a pickled "
                                  "object, and pipeshard checkpoints hold tensors only")
    return keys


def files_of(metadata: Any, keys: list[str]) -> set[str]:
    """The data files that hold these keys."""
    wanted = set(keys)
    return {info.relative_path for idx, info in metadata.storage_data.items() if idx.fqn in wanted}


# ---------------------------------------------------------------------------- DCP calls
def dcp_save(state: dict[str, Tensor], path: Path, group: Any, world: int, *, asynchronous: bool) -> Any:
    """``dcp.save`` (returns the metadata) or ``dcp.async_save`` (returns a future of it)."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True)
    kwargs = {"storage_writer": writer, "no_dist": world <= 1,
              "process_group": group if world > 1 else None}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        return dcp.async_save(state, **kwargs) if asynchronous else dcp.save(state, **kwargs)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's index and nothing else: a forged ``.metadata`` cannot run code."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    _OTHERS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
               ("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
               ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}

    def find_class(self, module: str, name: str) -> Any:
        if module in self._MODULES and not name.startswith("__"):
            obj = super().find_class(module, name)
            if isinstance(obj, type) or name == "_MEM_FORMAT_ENCODING":
                return obj
        if (module, name) in self._OTHERS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"refusing to load {DCP_METADATA}: it references {module}.{name}, "
                              "which a checkpoint index never contains (forged or corrupt)")


def read_dcp_metadata(path: Path, files: Mapping[str, Any] | None) -> Any:
    """DCP's index of checkpoint ``path``, checksum-verified first when ``files`` is given."""
    if files is not None:
        verify_files(path, files, {DCP_METADATA})
    try:
        with open(path / DCP_METADATA, "rb") as f:
            return _MetadataUnpickler(f).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
        raise CheckpointError(f"{path / DCP_METADATA} is unreadable ({type(exc).__name__}: {exc})") from exc


def dcp_load(path: Path, metadata: Any, keys: list[str]) -> dict[str, Tensor]:
    """Read ``keys`` (tensors) from checkpoint ``path`` in this process, without collectives."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:  # the verified, safe copy
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            raise CheckpointError(f"refusing to unpickle {read_item.dest_index.fqn!r}")

    sd = {k: torch.empty(tuple(metadata.state_dict_metadata[k].size),
                         dtype=metadata.state_dict_metadata[k].properties.dtype) for k in keys}
    if sd:
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
                dcp.load(sd, storage_reader=Reader(str(path)), planner=Planner(), no_dist=True)
        except CheckpointError:
            raise
        except (Exception, dcp.api.CheckpointException) as exc:  # noqa: BLE001 - DCP wraps reader errors
            raise CheckpointError(f"reading {path} failed: {exc}") from exc
    return sd


# ---------------------------------------------------------------------------- files
def file_entry(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex}`` of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def hash_rank_files(path: Path, rank: int) -> dict[str, dict[str, Any]]:
    """The entries of the data files this rank wrote (DCP names them ``__<rank>_<n>.distcp``)."""
    return {f.name: file_entry(f) for f in sorted(path.glob(f"__{rank}_*"))}


def verify_files(path: Path, files: Mapping[str, Any], names: set[str]) -> None:
    """Check that each named file exists with the size and sha256 the manifest records."""
    for name in sorted(names):
        f = path / name
        if name not in files:
            raise CheckpointError(f"{f} is not listed in the manifest; the checkpoint was modified")
        if not f.is_file():
            raise CheckpointError(f"{f} is missing: the checkpoint is incomplete")
        if file_entry(f) != dict(files[name]):
            raise CheckpointError(f"{f} does not match the checksum in its manifest (corrupt or "
                                  "modified); load an older checkpoint")


def fsync_dir(path: Path) -> None:
    """fsync a directory (its entries), where the OS allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a fsynced temporary file and a rename."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
