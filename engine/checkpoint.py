"""Layer-keyed, atomic, re-splittable checkpoints.

A checkpoint stores model weights and optimizer state **per global layer index**, so a run saved
with one split (stages x replicas) resumes with any other: each rank loads just the layers it
now holds. Layout under a root directory::

    root/
      latest                  -> text "step_000123" (replaced atomically)
      step_000123/
        manifest.json         written last, by rank 0: step, world size, layer count, model
                              fingerprint, per-layer parameter specs, which file holds each
                              layer, sha256 of every file, the run's meta (JSON)
        rank_00000.pt         one per rank: its layers, their optimizer state, its RNG states

Writing is atomic: every rank writes (and fsyncs) its file into ``root/.tmp_step_000123``; after
a barrier rank 0 writes the manifest, renames the directory to ``step_000123`` and then replaces
``latest``. A crash at any point leaves the previous checkpoint complete and ``latest`` pointing
at it (a directory without a manifest is never loaded). ``keep_last`` prunes older ones. All
ranks must see one shared filesystem (several nodes: a network filesystem).

Loading uses ``torch.load(weights_only=True)`` (no code runs from a file), checks each file's
sha256, and verifies the checkpoint against this model: layer count, and per layer the parameter
names, shapes and dtypes, with an error naming what differs.

Optimizer state is passed per layer as ``{layer: {param_name: {state_key: tensor}}}`` with the
*full* (unsharded) tensors: ZeRO backends gather them in ``state_dict()`` and re-shard them in
``load_state_dict()``. :func:`split_optimizer_state` / :func:`merge_optimizer_state` convert
between the backends' ``state_dict()`` (names ``"<layer>.<param>"``) and this per-layer form.

Example::

    path = save_checkpoint(run_dir / "checkpoints", step, layers=my_layers,
                           optimizer=per_layer_state, meta={"step": step, "data_position": i},
                           rank=rank, world=world, num_layers=12, barrier=dist.barrier,
                           keep_last=3)
    ckpt = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"), my_layer_indices,
                           expected=my_layers, num_layers=12, rank=rank)
    restore_rng(ckpt.rng)
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["Checkpoint", "CheckpointError", "save_checkpoint", "load_checkpoint",
           "latest_checkpoint", "list_checkpoints", "layer_specs", "model_fingerprint",
           "split_optimizer_state", "merge_optimizer_state", "capture_rng", "restore_rng"]

FORMAT = "pipeshard-checkpoint/1"
LATEST = "latest"
MANIFEST = "manifest.json"
_PREFIX = "step_"

# Test hook: called with each file path just after it is written (the kill-mid-write test).
_after_file_hook: Callable[[Path], None] | None = None


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt, unsafe or for another model."""


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` returns for the requested layers."""

    path: Path
    step: int
    layers: dict[int, dict[str, Tensor]]
    optimizer: dict[int, dict[str, dict[str, Tensor]]]
    meta: dict
    rng: dict | None = None                   # this rank's RNG states (same rank and world only)
    manifest: dict = field(default_factory=dict)


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


# ---------------------------------------------------------------------------- optimizer state
def split_optimizer_state(sd: Mapping[str, Any]) -> tuple[dict[int, dict[str, dict[str, Tensor]]], dict]:
    """A backend ``state_dict()`` -> (per-layer state, the remaining JSON-able scalars).

    Parameter names must look like ``"<global layer>.<param>"`` (the runtime's naming).
    """
    per_layer: dict[int, dict[str, dict[str, Tensor]]] = {}
    for name, entry in sd.get("state", {}).items():
        layer, _, pname = name.partition(".")
        if not layer.isdigit() or not pname:
            raise ValueError(f"optimizer state name {name!r} is not '<layer index>.<param name>'")
        tensors = {k: v for k, v in entry.items() if isinstance(v, Tensor)}
        per_layer.setdefault(int(layer), {})[pname] = tensors
    scalars = {k: v for k, v in sd.items() if k != "state"}
    return per_layer, scalars


def merge_optimizer_state(per_layer: Mapping[int, Mapping[str, Mapping[str, Tensor]]],
                          scalars: Mapping[str, Any]) -> dict:
    """Inverse of :func:`split_optimizer_state` (for any subset of layers)."""
    state = {f"{layer}.{pname}": dict(entry)
             for layer, params in per_layer.items() for pname, entry in params.items()}
    return {**scalars, "state": state}


# ---------------------------------------------------------------------------- RNG
def capture_rng() -> dict:
    """This process's RNG states (torch CPU and CUDA, python ``random``, numpy), safe to save."""
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {"torch": torch.get_rng_state(),
                           "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                                      "gauss": gauss}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    import numpy as np

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


# ---------------------------------------------------------------------------- writing
def _fsync_dir(path: Path) -> None:
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


def _write_atomic(path: Path, write: Callable[[Any], None], mode: str = "wb") -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if _after_file_hook is not None:
        _after_file_hook(path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _step_name(step: int) -> str:
    return f"{_PREFIX}{step:06d}"


def _default_barrier(world: int) -> Callable[[], None]:
    if world <= 1:
        return lambda: None
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"save_checkpoint with world={world} needs a barrier: pass barrier= or "
                         "initialise torch.distributed")
    return dist.barrier


def _plain(t: Tensor) -> Tensor:
    return t.detach().to("cpu").clone()


def save_checkpoint(root: str | os.PathLike, step: int, *, layers: Mapping[int, Mapping[str, Tensor]],
                    num_layers: int, optimizer: Mapping[int, Mapping[str, Mapping[str, Tensor]]] | None = None,
                    meta: Mapping[str, Any] | None = None, rng: Mapping[str, Any] | None = None,
                    rank: int = 0, world: int = 1, barrier: Callable[[], None] | None = None,
                    keep_last: int | None = None) -> Path:
    """Write this rank's part of checkpoint ``step`` under ``root``; collective over ``world`` ranks.

    ``layers``: this rank's layers by global index (``module.state_dict()`` of each); replicas
    other than the first may pass ``{}`` (when several ranks give a layer, the lowest rank's copy
    is used). ``optimizer``: full per-layer optimizer state for those layers. ``meta``: JSON-able
    run state (step, schedule / data position, optimizer scalars, config); rank 0's is kept.
    ``rng``: this rank's RNG states (default: :func:`capture_rng`). Returns the final directory.
    """
    root = Path(root)
    barrier = barrier or _default_barrier(world)
    name = _step_name(step)
    tmp, final = root / f".tmp_{name}", root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # debris of a writer that died
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()

    layers_out = {int(i): {k: _plain(v) for k, v in params.items()} for i, params in layers.items()}
    optim_out = {int(i): {p: {k: _plain(v) for k, v in st.items() if isinstance(v, Tensor)}
                          for p, st in params.items()}
                 for i, params in (optimizer or {}).items()}
    bad = sorted(i for i in layers_out if not 0 <= i < num_layers)
    if bad:
        raise ValueError(f"layers {bad} are outside the model's {num_layers} layers")
    part = {"format": FORMAT, "rank": rank, "world": world, "step": step, "layers": layers_out,
            "optimizer": optim_out, "rng": dict(rng) if rng is not None else capture_rng()}
    fname = f"rank_{rank:05d}.pt"
    _write_atomic(tmp / fname, lambda f: torch.save(part, f))
    index = {"file": fname, "sha256": _sha256(tmp / fname), "layers": sorted(layers_out),
             "optimizer_layers": sorted(optim_out), "specs": {str(k): v for k, v in layer_specs(layers_out).items()}}
    _write_atomic(tmp / f"rank_{rank:05d}.json", lambda f: f.write(json.dumps(index)), mode="w")
    barrier()

    error: BaseException | None = None
    if rank == 0:
        try:
            _finish(root, tmp, final, step, world, num_layers, dict(meta or {}), keep_last)
        except BaseException as exc:  # reach the barrier anyway: the others must not hang
            error = exc
    barrier()
    if error is not None:
        raise error
    if not (final / MANIFEST).is_file():
        raise CheckpointError(f"rank 0 failed to finalise checkpoint {final}; see rank 0's error")
    return final


def _finish(root: Path, tmp: Path, final: Path, step: int, world: int, num_layers: int,
            meta: dict, keep_last: int | None) -> None:
    files, layer_file, optim_file, specs = {}, {}, {}, {}
    for r in range(world):
        idx_path = tmp / f"rank_{r:05d}.json"
        if not idx_path.exists():
            raise CheckpointError(f"rank {r} did not write its part of {final.name}")
        idx = json.loads(idx_path.read_text())
        files[idx["file"]] = idx["sha256"]
        for i in idx["layers"]:
            layer_file.setdefault(str(i), idx["file"])
        for i in idx["optimizer_layers"]:
            optim_file.setdefault(str(i), idx["file"])
        for i, spec in idx["specs"].items():
            specs.setdefault(i, spec)
    missing = [i for i in range(num_layers) if str(i) not in layer_file]
    if missing:
        raise CheckpointError(f"no rank saved layers {missing}; every layer must be given by "
                              "some rank (replica 0 of its stage)")
    int_specs = {int(k): v for k, v in specs.items()}
    manifest = {"format": FORMAT, "step": step, "world": world, "num_layers": num_layers,
                "fingerprint": model_fingerprint(int_specs), "specs": specs,
                "layer_file": layer_file, "optimizer_file": optim_file, "files": files,
                "meta": meta}
    _write_atomic(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1)), mode="w")
    _fsync_dir(tmp)
    if final.exists():  # re-saving a step: move the old one aside first
        old = root / f".old_{final.name}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    _write_atomic(root / LATEST, lambda f: f.write(final.name), mode="w")
    _fsync_dir(root)
    if keep_last is not None and keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------- reading
def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (with a manifest) under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if p.is_dir() and p.name.startswith(_PREFIX) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` points to; else the newest complete one; None if there is none."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if (target / MANIFEST).is_file():
            return target
    done = list_checkpoints(root)
    return done[-1] if done else None


def _describe_mismatch(layer: int, saved: Mapping[str, list], mine: Mapping[str, list]) -> list[str]:
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


def _load_file(path: Path, sha256: str | None, map_location: Any) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
    if sha256 is not None and _sha256(path) != sha256:
        raise CheckpointError(f"{path} does not match the checksum in its manifest (corrupt or "
                              "modified); load an older checkpoint")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the unpickler refuses anything but tensors/containers
        raise CheckpointError(f"refusing to load {path}: it is not a plain-tensor checkpoint "
                              f"(weights_only loading failed: {exc})") from exc


def load_checkpoint(path: str | os.PathLike, layer_indices: Iterable[int], *,
                    expected: Mapping[int, Mapping[str, Tensor]] | None = None,
                    num_layers: int | None = None, rank: int | None = None,
                    world: int | None = None, map_location: Any = "cpu",
                    verify_checksums: bool = True) -> Checkpoint:
    """Load the given global layers (weights and optimizer state) from checkpoint ``path``.

    ``expected``: this model's tensors for (some of) those layers, to verify names, shapes and
    dtypes; ``num_layers``: this model's layer count. ``rank``/``world``: return this rank's
    RNG states when the checkpoint was written by the same number of ranks.
    """
    path = Path(path)
    man_path = path / MANIFEST
    if not man_path.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST}); use "
                              "latest_checkpoint(root) to find the newest complete one")
    manifest = json.loads(man_path.read_text())
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    saved_layers = int(manifest["num_layers"])
    if num_layers is not None and num_layers != saved_layers:
        raise CheckpointError(f"checkpoint is for a model with {saved_layers} layers, this model "
                              f"has {num_layers}; it comes from another model")
    wanted = sorted({int(i) for i in layer_indices})
    absent = [i for i in wanted if str(i) not in manifest["layer_file"]]
    if absent:
        raise CheckpointError(f"checkpoint {path.name} has no layers {absent} (it holds "
                              f"0..{saved_layers - 1})")
    if expected is not None:
        mine = layer_specs({i: expected[i] for i in wanted if i in expected})
        problems = [msg for i, spec in mine.items()
                    for msg in _describe_mismatch(i, manifest["specs"][str(i)], spec)]
        if problems:
            raise CheckpointError("checkpoint does not match this model:\n  " + "\n  ".join(problems))

    files = manifest["files"]
    cache: dict[str, dict] = {}

    def part(fname: str) -> dict:
        if fname not in cache:
            cache[fname] = _load_file(path / fname, files.get(fname) if verify_checksums else None,
                                      map_location)
        return cache[fname]

    layers = {i: part(manifest["layer_file"][str(i)])["layers"][i] for i in wanted}
    optim = {i: part(manifest["optimizer_file"][str(i)])["optimizer"][i]
             for i in wanted if str(i) in manifest["optimizer_file"]}
    rng = None
    if rank is not None and (world is None or world == manifest["world"]) and rank < manifest["world"]:
        rng = part(f"rank_{rank:05d}.pt").get("rng")
    return Checkpoint(path=path, step=int(manifest["step"]), layers=layers, optimizer=optim,
                      meta=manifest.get("meta", {}), rng=rng, manifest=manifest)
