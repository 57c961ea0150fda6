"""The user's files: which ones (`data.files`), in what format, read as documents with `datasets`.

`data.files` is a path, a glob (`data/*.jsonl`, `corpus/**/*.parquet`), a directory (its
supported files, recursively) or a list of these; files are taken in the order given, each
glob or directory sorted. The format follows the suffix (a `.gz`, `.bz2`, `.xz` or `.zst`
after it is decompressed by `datasets`):

    plain text   .txt .text .md          one document per line, paragraph or file (data.sample_by)
    JSON lines   .jsonl .json .ndjson    one document per record, its `data.text_field`
    parquet      .parquet                one document per row, its `data.text_field`

`load_documents` reads them with `datasets.load_dataset` and the packaged local builders
(`text`, `json`, `parquet`; nothing is downloaded) into one column `text`, in file order;
`streaming=True` gives an iterable dataset that reads as it goes.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "a.txt").write_text("one\\ntwo\\n")
    >>> resolve_files(str(d / "*.txt")) == [str(d / "a.txt")]
    True
    >>> [row["text"] for row in load_documents([str(d / "a.txt")], streaming=True)]
    ['one', 'two']
"""

from __future__ import annotations

import glob
import os
import threading
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from experiments.hfdata.layout import DataError

__all__ = ["FORMATS", "file_format", "resolve_files", "format_groups", "load_documents", "iter_texts",
           "offline_datasets"]

FORMATS = {"text": (".txt", ".text", ".md"), "json": (".jsonl", ".json", ".ndjson"), "parquet": (".parquet",)}
"""The `datasets` builder for each file suffix."""
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
_SUPPORTED = ", ".join(s for suffixes in FORMATS.values() for s in suffixes)


def offline_datasets() -> Any:
    """`import datasets` with the Hub switched off (only local files are read), quietly."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import tqdm

    if getattr(tqdm.tqdm, "_lock", None) is None:
        # tqdm's default lock holds a multiprocessing semaphore that a worker leaving by
        # os._exit leaks (a resource_tracker warning); progress bars here need no process lock.
        tqdm.tqdm.set_lock(threading.RLock())
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def file_format(path: str | os.PathLike) -> str | None:
    """`text`, `json` or `parquet` from the suffix (ignoring a compression suffix); None if unknown.

    >>> file_format("a/b.jsonl.gz"), file_format("x.parquet"), file_format("y.csv")
    ('json', 'parquet', None)
    """
    name = Path(path).name.lower()
    for comp in _COMPRESSED:
        if name.endswith(comp):
            name = name[: -len(comp)]
    for fmt, suffixes in FORMATS.items():
        if name.endswith(suffixes):
            return fmt
    return None


def _expand(entry: str) -> list[str]:
    path = Path(entry).expanduser()
    if glob.has_magic(str(path)):
        found = sorted(p for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not found:
            raise DataError(f"data.files: no file matches {entry!r}; check the pattern (quote it on the "
                            "command line so the shell does not expand it)")
        return [str(Path(p).resolve()) for p in found]
    if path.is_dir():
        found = sorted(str(p.resolve()) for p in path.rglob("*") if p.is_file() and file_format(p))
        if not found:
            raise DataError(f"data.files: the directory {entry!r} holds no {_SUPPORTED} files")
        return found
    if not path.is_file():
        raise DataError(f"data.files: {entry!r} does not exist; give a file, a directory or a glob of "
                        f"{_SUPPORTED} files (e.g. data.files='data/*.jsonl')")
    return [str(path.resolve())]


def resolve_files(spec: str | Sequence[str] | None) -> list[str]:
    """Absolute paths of `data.files` (see the module docstring), duplicates dropped."""
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        raise DataError("data=hf needs data.files: a file, directory or glob of your text, e.g. "
                        "data.files='corpus/*.jsonl' (or a list: data.files=[a.txt,b.jsonl])")
    entries = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    out: list[str] = []
    for entry in entries:
        for path in _expand(str(entry)):
            if file_format(path) is None:
                raise DataError(f"data.files: {path} is not a supported format; use {_SUPPORTED} "
                                "(optionally compressed: .gz, .bz2, .xz, .zst)")
            if path not in out:
                out.append(path)
    return out


def format_groups(files: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Consecutive runs of files of one format (one `load_dataset` call each, file order kept).

    >>> format_groups(["a.txt", "b.txt", "c.jsonl", "d.txt"])
    [('text', ['a.txt', 'b.txt']), ('json', ['c.jsonl']), ('text', ['d.txt'])]
    """
    groups: list[tuple[str, list[str]]] = []
    for path in files:
        fmt = file_format(path) or "?"
        if groups and groups[-1][0] == fmt:
            groups[-1][1].append(path)
        else:
            groups.append((fmt, [path]))
    return groups


def _columns(ds: Any) -> list[str] | None:
    if ds.features is not None:
        return list(ds.features)
    first = next(iter(ds), None)  # a streaming JSON dataset knows its columns once read
    return list(first) if first is not None else None


def _load_group(fmt: str, group: list[str], *, text_field: str, sample_by: str, streaming: bool,
                cache_dir: str | None) -> Any:
    datasets = offline_datasets()
    kwargs = {"sample_by": sample_by} if fmt == "text" else {}
    try:
        ds = datasets.load_dataset(fmt, data_files=group, split="train", streaming=streaming,
                                   cache_dir=cache_dir, **kwargs)
    except Exception as exc:  # datasets' own message, with the files named
        raise DataError(f"data.files: could not read {_names(group)} as {fmt}: {exc}") from None
    column = "text" if fmt == "text" else text_field
    columns = _columns(ds)
    if columns is not None and column not in columns:
        others = [c for c in columns if c != column]
        hint = f"; set data.text_field={others[0]}" if len(others) == 1 else ""
        raise DataError(f"data.text_field={column!r} is not a field of {_names(group)}: its fields are "
                        f"{columns}{hint} (data.text_field names the field holding each document's text)")
    feature = ds.features.get(column) if ds.features is not None else None
    if feature is not None and getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(f"data.text_field={column!r} of {_names(group)} holds {feature}, not text; set "
                        "data.text_field to the field with each document's text")
    ds = ds.select_columns([column])
    return ds.rename_column(column, "text") if column != "text" else ds


def _names(group: Sequence[str]) -> str:
    return ", ".join(group[:3]) + (f" and {len(group) - 3} more" if len(group) > 3 else "")


def load_documents(files: Sequence[str], *, text_field: str = "text", sample_by: str = "line",
                   streaming: bool = False, cache_dir: str | None = None) -> Any:
    """The files as one `datasets` dataset with a column `text` (an `IterableDataset` when
    `streaming`), in file order. Empty documents are kept here; readers skip them."""
    datasets = offline_datasets()
    parts = [_load_group(fmt, group, text_field=text_field, sample_by=sample_by, streaming=streaming,
                         cache_dir=cache_dir) for fmt, group in format_groups(files)]
    if len(parts) == 1:
        return parts[0]
    if not streaming:
        target = parts[0].features
        parts = [p.cast(target) if p.features != target else p for p in parts]
    return datasets.concatenate_datasets(parts)


def iter_texts(docs: Iterable[dict]) -> Iterator[str]:
    """The non-empty documents of an (iterable) dataset, in order (what every reader counts)."""
    for row in docs:
        text = row["text"]
        if text and text.strip():
            yield text
