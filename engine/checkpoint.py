"""Layer-keyed, atomic, re-splittable checkpoints on torch.distributed.checkpoint (DCP).

A checkpoint stores model weights and optimizer state **per global layer index**, so a run saved
with one split (stages x replicas) resumes with any other: each rank loads just the layers it
now holds, and one process can read the whole model (export). Layout under a root directory::

    root/
      latest                  -> text "step_000123" (replaced atomically; informative)
      step_000123/
        __0_0.distcp ...      DCP data: each rank writes its own file(s), in parallel
        .metadata             DCP index: every tensor's shape, dtype and place in the files
        manifest.json         written last, by rank 0, once every rank finished: step, world
                              size, layer count, model fingerprint, per-layer parameter specs,
                              size and sha256 of every file, the run's meta (JSON)

DCP keys: ``layer.<i>.<name>`` (module tensors of global layer i), ``optim.<i>.<param>.<key>``
(full optimizer state tensors) and ``rng.<rank>.*`` (each rank's RNG states). Replicas may all
pass their layers: DCP writes a key held by several ranks once (deduplication).

Writing is atomic: every rank writes into ``root/.tmp_step_000123`` through ``dcp.save`` (or
``dcp.async_save``: the tensors are copied to host memory and the step loop goes on while a
background thread writes, fsyncs and finalises); after all ranks finished, rank 0 writes the
manifest, renames the directory to ``step_000123`` and replaces ``latest``. A checkpoint without
a manifest, or whose files do not match it, is never loaded: :func:`find_resumable` skips it and
says which one and why. ``keep_last`` prunes older ones. All ranks must see one shared filesystem.

Loading reads DCP's index with a restricted unpickler (DCP metadata classes only), checks the
sha256 of the files it reads, reads tensors with ``torch.load(weights_only=True)`` (no code runs
from a file), and verifies the checkpoint against this model: layer count, and per layer the
parameter names, shapes and dtypes, with an error naming what differs. It needs no process
group: each rank (or a single export process) reads what it needs.

Optimizer state is passed per layer as ``{layer: {param_name: {state_key: tensor}}}`` with the
*full* (unsharded) tensors: ZeRO backends gather them in ``state_dict()`` and re-shard them in
``load_state_dict()``. :func:`split_optimizer_state` / :func:`merge_optimizer_state` convert
between the backends' ``state_dict()`` (names ``"<layer>.<param>"``) and this per-layer form.

Example::

    saver = Checkpointer(run_dir / "checkpoints", num_layers=12, keep_last=3, async_save=True)
    stall_s = saver.save(step, layers=my_layers, optimizer=per_layer_state,
                         meta={"step": step, "data_position": i})   # collective, returns fast
    ...
    saver.close()                                                    # waits for the last one
    ckpt = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"), my_layer_indices,
                           expected=my_layers, num_layers=12, rank=rank, world=world)
    restore_rng(ckpt.rng)
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch  # noqa: F401 - the doctests
from torch import Tensor

from engine import ckpt_format as fmt
from engine.ckpt_format import (FORMAT, MANIFEST, CheckpointError, capture_rng, layer_specs,
                                model_fingerprint, restore_rng)

__all__ = ["Checkpoint", "CheckpointError", "Checkpointer", "SavedCheckpoint", "save_checkpoint",
           "load_checkpoint", "latest_checkpoint", "list_checkpoints", "find_resumable",
           "checkpoint_problem", "layer_specs", "model_fingerprint", "split_optimizer_state",
           "merge_optimizer_state", "capture_rng", "restore_rng", "FORMAT", "MANIFEST"]

LATEST = "latest"
_PREFIX = "step_"
_TMP = ".tmp_"
_OLD = ".old_"


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` returns for the requested layers."""

    path: Path
    step: int
    layers: dict[int, dict[str, Tensor]]
    optimizer: dict[int, dict[str, dict[str, Tensor]]]
    meta: dict
    rng: dict | None = None                   # this rank's RNG states (same world size only)
    manifest: dict = field(default_factory=dict)


@dataclass
class SavedCheckpoint:
    """A finished save: where, which step, how long the step loop waited (``stall_s``) and how
    long the whole save took until the manifest was written (``total_s``)."""

    path: Path
    step: int
    stall_s: float
    total_s: float
    asynchronous: bool
    bytes: int


# ---------------------------------------------------------------------------- optimizer state
def split_optimizer_state(sd: Mapping[str, Any]) -> tuple[dict[int, dict[str, dict[str, Tensor]]], dict]:
    """A backend ``state_dict()`` -> (per-layer state, the remaining JSON-able scalars).

    Parameter names must look like ``"<global layer>.<param>"`` (the runtime's naming).

    >>> per_layer, scalars = split_optimizer_state({"state": {"3.w": {"m": torch.ones(1)}}, "steps": 2})
    >>> sorted(per_layer), scalars
    ([3], {'steps': 2})
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


# ---------------------------------------------------------------------------- saving
def _group_info(process_group: Any) -> tuple[int, int]:
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


class Checkpointer:
    """Writes checkpoints under ``root``; one per job, constructed and used on every rank.

    ``save`` is collective. With ``async_save=True`` it returns once this rank's tensors are
    copied to host memory; the write, fsync and the manifest happen in the background and the
    next ``save`` (or :meth:`wait` / :meth:`close`) waits for them. ``process_group``: the ranks
    that write (default: all; an async saver makes its own gloo group, so the background thread
    never shares a group with the step loop). Construct it on every rank at the same point.

    Example::

        saver = Checkpointer(root, num_layers=8, async_save=True)
        stall = saver.save(10, layers={2: layer2.state_dict()}, meta={"step": 10})
        for done in saver.poll():          # finished saves, without blocking
            print(done.path, done.total_s)
        saver.close()
    """

    def __init__(self, root: str | os.PathLike, *, num_layers: int, keep_last: int | None = None,
                 async_save: bool = False, process_group: Any = None) -> None:
        import torch.distributed as dist
        self.root, self.num_layers = Path(root), int(num_layers)
        self.keep_last, self.asynchronous = keep_last, bool(async_save)
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and process_group is None and async_save and dist.get_world_size() > 1:
            process_group = dist.new_group(backend="gloo")  # collective: every rank, same point
        self.group = process_group
        self.rank, self.world = _group_info(process_group)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._done: list[SavedCheckpoint] = []

    def save(self, step: int, *, layers: Mapping[int, Mapping[str, Tensor]],
             optimizer: Mapping[int, Mapping[str, Mapping[str, Tensor]]] | None = None,
             meta: Mapping[str, Any] | None = None, rng: Mapping[str, Any] | None = None,
             started: float | None = None) -> float:
        """Start (async) or write (sync) checkpoint ``step``; returns the seconds the step loop
        stalled: since ``started`` (a ``time.perf_counter()`` value, e.g. taken before gathering
        the state; default: this call's start). ``layers``: this rank's layers by global index
        (``module.state_dict()`` each); ``optimizer``: full per-layer state for them; ``meta``:
        JSON-able run state (rank 0's is kept); ``rng``: default :func:`capture_rng`."""
        t0 = time.perf_counter() if started is None else started
        self.wait_pending()
        state = fmt.build_state_dict(layers, optimizer, dict(rng) if rng is not None else capture_rng(),
                                     self.rank, self.num_layers)
        tmp = self._fresh_tmp(step)
        job = _SaveJob(self, step, tmp, dict(meta or {}), t0, sorted(int(i) for i in layers))
        if self.asynchronous:
            future = fmt.dcp_save(state, tmp, self.group, self.world, asynchronous=True)
            job.stall_s = time.perf_counter() - t0
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="pipeshard-checkpoint")
            self._pending = self._pool.submit(job.complete, future)
            return job.stall_s
        done = job.complete(fmt.dcp_save(state, tmp, self.group, self.world, asynchronous=False))
        done.stall_s = done.total_s  # synchronous: the step loop waited for all of it
        self._done.append(done)
        return done.stall_s

    def _fresh_tmp(self, step: int) -> Path:
        tmp = self.root / f"{_TMP}{_step_name(step)}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # debris of a writer that died
                shutil.rmtree(tmp)
            tmp.mkdir()
        _barrier(self.group, self.world)
        return tmp

    def wait_pending(self) -> None:
        """Block until the save in flight (if any) is finished; raise its error on every rank."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._done.append(pending.result())

    def poll(self) -> list[SavedCheckpoint]:
        """Saves finished since the last call (non-blocking); raises a background save's error."""
        if self._pending is not None and self._pending.done():
            self.wait_pending()
        done, self._done = self._done, []
        return done

    def wait(self) -> list[SavedCheckpoint]:
        """Finish the save in flight; returns the saves finished since the last poll/wait."""
        self.wait_pending()
        return self.poll()

    def close(self) -> list[SavedCheckpoint]:
        """:meth:`wait`, then stop the background thread."""
        try:
            return self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


class _SaveJob:
    """The part of one save after DCP wrote the data: hashes, manifest, rename, prune."""

    def __init__(self, saver: Checkpointer, step: int, tmp: Path, meta: dict, t0: float,
                 given: list[int]) -> None:
        self.saver, self.step, self.tmp, self.meta, self.t0 = saver, step, tmp, meta, t0
        self.given, self.stall_s = given, 0.0

    def complete(self, metadata_or_future: Any) -> SavedCheckpoint:
        s = self.saver
        metadata = metadata_or_future.result() if isinstance(metadata_or_future, Future) \
            else metadata_or_future
        from engine.faults import inject
        inject("save", self.step, rank=s.rank)  # fault-injection point: data written, no manifest
        parts = _gather((fmt.hash_rank_files(self.tmp, s.rank), self.given), s.group, s.world)
        files = {k: v for hashes, _ in parts for k, v in hashes.items()}
        error, final = None, self.saver.root / _step_name(self.step)
        if s.rank == 0:
            try:
                given = sorted({i for _, layers in parts for i in layers})
                _finish(s.root, self.tmp, final, (self.step, s.world, s.num_layers), self.meta,
                        metadata, files, given, s.keep_last)
            except Exception as exc:  # noqa: BLE001 - every rank must hear about it
                error = f"{type(exc).__name__}: {exc}"
        error = _broadcast(error, s.group, s.world)
        if error is not None:
            raise CheckpointError(f"rank 0 failed to finalise checkpoint {final}: {error}")
        size = sum(v["bytes"] for v in files.values())
        return SavedCheckpoint(final, self.step, self.stall_s, time.perf_counter() - self.t0,
                               s.asynchronous, size)


def _barrier(group: Any, world: int) -> None:
    if world > 1:
        import torch.distributed as dist
        dist.barrier(group=group)


def _gather(obj: Any, group: Any, world: int) -> list[Any]:
    if world <= 1:
        return [obj]
    import torch.distributed as dist
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast(obj: Any, group: Any, world: int) -> Any:
    if world <= 1:
        return obj
    import torch.distributed as dist
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def save_checkpoint(root: str | os.PathLike, step: int, *, layers: Mapping[int, Mapping[str, Tensor]],
                    num_layers: int, optimizer: Mapping[int, Mapping[str, Mapping[str, Tensor]]] | None = None,
                    meta: Mapping[str, Any] | None = None, rng: Mapping[str, Any] | None = None,
                    keep_last: int | None = None, process_group: Any = None) -> Path:
    """Write this rank's part of checkpoint ``step`` under ``root`` and wait for it (collective
    over ``process_group``, default all ranks; a single process needs no process group).
    Returns the final directory. See :class:`Checkpointer` for the arguments and async saves.

    >>> save_checkpoint(tmp, 3, layers={0: {"w": torch.ones(2)}}, num_layers=1)  # doctest: +SKIP
    PosixPath('.../step_000003')
    """
    saver = Checkpointer(root, num_layers=num_layers, keep_last=keep_last, process_group=process_group)
    saver.save(step, layers=layers, optimizer=optimizer, meta=meta, rng=rng)
    return saver.close()[-1].path


def _step_name(step: int) -> str:
    return f"{_PREFIX}{step:06d}"


def _finish(root: Path, tmp: Path, final: Path, sizes: tuple[int, int, int], meta: dict,
            metadata: Any, files: dict, given: list[int], keep_last: int | None) -> None:
    step, world, num_layers = sizes
    specs = fmt.specs_from_metadata(metadata)
    specs.update({i: {} for i in given if i not in specs})  # parameter-free layers
    specs = dict(sorted(specs.items()))
    missing = [i for i in range(num_layers) if i not in specs]
    if missing:
        raise CheckpointError(f"no rank saved layers {missing}; every layer must be given by "
                              "some rank (e.g. replica 0 of its stage)")
    files[fmt.DCP_METADATA] = fmt.file_entry(tmp / fmt.DCP_METADATA)
    manifest = {"format": FORMAT, "step": step, "world": world, "num_layers": num_layers,
                "fingerprint": model_fingerprint(specs),
                "specs": {str(k): v for k, v in specs.items()},
                "optimizer_layers": fmt.optimizer_layers(metadata), "files": files, "meta": meta}
    fmt.write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
    fmt.fsync_dir(tmp)
    from engine.faults import inject
    inject("manifest", step, rank=0)
    if final.exists():  # re-saving a step: move the old one aside first
        _discard(final)
    os.replace(tmp, final)
    fmt.fsync_dir(root)
    fmt.write_atomic(root / LATEST, final.name)
    fmt.fsync_dir(root)
    for p in root.iterdir():  # debris of writers that died, and half-deleted old checkpoints
        if p.is_dir() and (p.name.startswith(_OLD) or (p.name.startswith(_TMP) and p != tmp)):
            shutil.rmtree(p, ignore_errors=True)
    if keep_last is not None and keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            if old != final:
                _discard(old)


def _discard(path: Path) -> None:
    """Delete a checkpoint so that no half-deleted one can look complete: rename, then delete."""
    aside = path.with_name(_OLD + path.name)
    if aside.exists():
        shutil.rmtree(aside)
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


# ---------------------------------------------------------------------------- finding
def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Checkpoints with a manifest under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if p.is_dir() and p.name.startswith(_PREFIX) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why the checkpoint directory ``path`` cannot be loaded (cheap: sizes, not hashes), or None."""
    path = Path(path)
    if path.name.startswith(_TMP) or not (path / MANIFEST).is_file():
        return (f"incomplete: it was being written when the job stopped (no {MANIFEST}; the "
                "manifest is written only after every rank finished)")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable {MANIFEST} ({exc})"
    if manifest.get("format") != FORMAT:
        return f"format {manifest.get('format')!r}, not {FORMAT!r} (written by another pipeshard version)"
    for name, entry in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file():
            return f"torn: {name} is missing"
        if f.stat().st_size != entry["bytes"]:
            return f"torn: {name} has {f.stat().st_size} bytes, the manifest says {entry['bytes']}"
    return None


def find_resumable(root: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest loadable checkpoint under ``root`` or None, the newer ones skipped with why).

    >>> path, skipped = find_resumable("run/checkpoints")          # doctest: +SKIP
    >>> [f"skipping {p.name}: {why}" for p, why in skipped]         # doctest: +SKIP
    ['skipping .tmp_step_000006: incomplete: it was being written when the job stopped ...']
    """
    root = Path(root)
    if not root.is_dir():
        return None, []
    candidates = []
    for p in root.iterdir():
        name = p.name[len(_TMP):] if p.name.startswith(_TMP) else p.name
        if p.is_dir() and name.startswith(_PREFIX) and name[len(_PREFIX):].isdigit():
            candidates.append((int(name[len(_PREFIX):]), not p.name.startswith(_TMP), p))
    skipped: list[tuple[Path, str]] = []
    for _, _, p in sorted(candidates, reverse=True):
        why = checkpoint_problem(p)
        if why is None:
            return p, skipped
        skipped.append((p, why))
    return None, skipped


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest loadable checkpoint under ``root`` (see :func:`find_resumable`), or None."""
    return find_resumable(root)[0]


# ---------------------------------------------------------------------------- loading
def _read_manifest(path: Path) -> dict:
    man_path = path / MANIFEST
    if not man_path.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST}); use "
                              "latest_checkpoint(root) to find the newest complete one")
    manifest = json.loads(man_path.read_text())
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def _check_model(path: Path, manifest: dict, wanted: list[int], num_layers: int | None,
                 expected: Mapping[int, Mapping[str, Tensor]] | None) -> None:
    saved_layers = int(manifest["num_layers"])
    if num_layers is not None and num_layers != saved_layers:
        raise CheckpointError(f"checkpoint is for a model with {saved_layers} layers, this model "
                              f"has {num_layers}; it comes from another model")
    absent = [i for i in wanted if str(i) not in manifest["specs"]]
    if absent:
        raise CheckpointError(f"checkpoint {path.name} has no layers {absent} (it holds "
                              f"0..{saved_layers - 1})")
    if expected is not None:
        mine = layer_specs({i: expected[i] for i in wanted if i in expected})
        problems = [msg for i, spec in mine.items()
                    for msg in fmt.describe_mismatch(i, manifest["specs"][str(i)], spec)]
        if problems:
            raise CheckpointError("checkpoint does not match this model:\n  " + "\n  ".join(problems))


def load_checkpoint(path: str | os.PathLike, layer_indices: Iterable[int], *,
                    expected: Mapping[int, Mapping[str, Tensor]] | None = None,
                    num_layers: int | None = None, rank: int | None = None,
                    world: int | None = None, map_location: Any = "cpu",
                    verify_checksums: bool = True) -> Checkpoint:
    """Load the given global layers (weights and optimizer state) from checkpoint ``path``.

    ``expected``: this model's tensors for (some of) those layers, to verify names, shapes and
    dtypes; ``num_layers``: this model's layer count. ``rank``/``world``: also return this rank's
    RNG states when the checkpoint was written by the same number of ranks. Needs no process
    group (any process can read any layer).
    """
    path = Path(path)
    manifest = _read_manifest(path)
    wanted = sorted({int(i) for i in layer_indices})
    _check_model(path, manifest, wanted, num_layers, expected)
    metadata = fmt.read_dcp_metadata(path, manifest["files"] if verify_checksums else None)
    keys = fmt.keys_for(metadata, wanted, rng_rank=rank if rank is not None and (
        world is None or world == manifest["world"]) and rank < manifest["world"] else None)
    if verify_checksums:
        fmt.verify_files(path, manifest["files"], fmt.files_of(metadata, keys))
    flat = fmt.dcp_load(path, metadata, keys)
    if str(map_location) != "cpu":
        flat = {k: v.to(map_location) for k, v in flat.items()}
    layers, optim, rng = fmt.unflatten(flat, wanted)
    return Checkpoint(path=path, step=int(manifest["step"]), layers=layers, optimizer=optim,
                      meta=manifest.get("meta", {}), rng=rng, manifest=manifest)
