"""Text sources: the embedded ``stdlib-docs`` corpus, local files, and the plan's remote corpora.

Every source is an iterator of :class:`Document` (an id and its text) in a stable order, so a
prepared token stream is reproducible. Nothing is held in memory but the current document.

* ``stdlib-docs`` (the offline default): English prose that ships with every CPython, the language
  reference in ``pydoc_data.topics`` plus the docstrings of the standard library's modules, read by
  parsing the source files with ``ast`` (importing every module would have side effects). A
  document goes to the validation split when its id's sha256 falls in the first
  ``VALIDATION_PERCENT`` of the hash range: stable across machines and Python versions of a file.
* local files: ``.txt`` (one document per file), ``.jsonl`` (one per line, field ``text``),
  ``.parquet`` / ``.arrow`` (column ``text``; needs pyarrow), or a directory of them.
  :func:`source_fingerprint` tells when they changed (paths, sizes, modification times).
* remote corpora by name (see :data:`REMOTE`), streamed with ``datasets.load_dataset(...,
  streaming=True)``; offline and not cached, a clear error names the offline alternatives.
"""

from __future__ import annotations

import ast
import hashlib
import json
import platform
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

VALIDATION_PERCENT = 5
MIN_DOC_CHARS = 200  # stdlib modules with less docstring text than this are skipped
SPLITS = ("train", "validation", "all")

# name -> (hub dataset id, config, text field): the corpora of the plan
REMOTE = {
    "slimpajama": ("cerebras/SlimPajama-627B", None, "text"),
    "slimpajama-6b": ("DKYoon/SlimPajama-6B", None, "text"),
    "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", "text"),
    "pile": ("monology/pile-uncopyrighted", None, "text"),
    "c4": ("allenai/c4", "en", "text"),
    "openwebtext2": ("segyges/OpenWebText2", None, "text"),
}
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet", ".arrow")


@dataclass(frozen=True)
class Document:
    id: str
    text: str


def in_validation(doc_id: str, percent: int = VALIDATION_PERCENT) -> bool:
    """The split of a document, from its id alone."""
    return int(hashlib.sha256(doc_id.encode("utf-8")).hexdigest()[:8], 16) % 100 < percent


def _split(docs: Iterator[Document], split: str) -> Iterator[Document]:
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not valid; valid splits: {', '.join(SPLITS)}")
    for doc in docs:
        if split == "all" or in_validation(doc.id) == (split == "validation"):
            yield doc


def _module_docstrings(path: Path) -> str:
    """The module's, classes' and functions' docstrings in source order, or "" if it does not
    parse."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                parts.append(doc.strip())
    return "\n\n".join(parts)


def stdlib_docs(split: str = "train") -> Iterator[Document]:
    """The embedded corpus: ``pydoc:<topic>`` documents, then ``stdlib:<path>`` ones, sorted."""

    def documents():
        from pydoc_data.topics import topics

        for name in sorted(topics):
            yield Document(f"pydoc:{name}", topics[name].strip())
        root = Path(sysconfig.get_paths()["stdlib"])
        skip = {
            "test",
            "tests",
            "idle_test",
            "site-packages",
            "dist-packages",
            "lib2to3",
            "__pycache__",
        }
        files = sorted(
            p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)
        )
        for path in files:
            text = _module_docstrings(path)
            if len(text) >= MIN_DOC_CHARS:
                yield Document(f"stdlib:{path.relative_to(root).as_posix()}", text)

    return _split(documents(), split)


def _files(path: Path) -> list[Path]:
    """The files of a local source, in the order they are read."""
    files = [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_SUFFIXES and p.is_file())
    if not files or not all(p.is_file() and p.suffix in LOCAL_SUFFIXES for p in files):
        raise ValueError(
            f"{path}: no readable text files; "
            f"expected {', '.join(LOCAL_SUFFIXES)} or a directory of them"
        )
    return files


def _jsonl(p: Path, field: str) -> Iterator[Document]:
    """One document per non-blank line, each a JSON object with a string ``field``."""
    with p.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            where = f"{p}, line {i + 1}"
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(
                    f"{where}: not valid JSON ({exc}); each line must be a JSON object "
                    f"with a string field {field!r}"
                ) from None
            text = row.get(field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                what = (
                    "is not a JSON object"
                    if not isinstance(row, dict)
                    else f"has no field {field!r}"
                    if field not in row
                    else f"has {field!r} of type {type(text).__name__}"
                )
                raise ValueError(
                    f"{where}: the line {what}; each line must be a JSON object with a string "
                    f"field {field!r}"
                )
            yield Document(f"file:{p.name}:{i}", text)


def _table(p: Path, field: str) -> Iterator[Document]:
    """One document per row of a parquet or arrow file's string column ``field`` (needs pyarrow)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"{p}: reading {p.suffix} files needs pyarrow (pip install pyarrow)"
        ) from None
    try:
        if p.suffix == ".parquet":
            table = pq.read_table(p)
        else:  # the IPC file format, or the stream format (datasets)
            try:
                table = pa.ipc.open_file(p).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_stream(p).read_all()
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(
            f"{p}: cannot be read as {p.suffix[1:]} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    if field not in table.column_names:
        raise ValueError(
            f"{p}: no column {field!r}; its columns: {', '.join(table.column_names) or 'none'}"
        )
    for i, text in enumerate(table.column(field).to_pylist()):
        if not isinstance(text, str):
            raise ValueError(
                f"{p}, row {i + 1}: column {field!r} is {type(text).__name__}, expected a string"
            )
        yield Document(f"file:{p.name}:{i}", text)


def local_files(path: str | Path, split: str = "all", field: str = "text") -> Iterator[Document]:
    """Documents from a file or a directory of .txt / .jsonl / .parquet / .arrow files (sorted).

    A line (jsonl) or row (parquet, arrow) without a string ``field``, or a file that is not UTF-8
    text, is a ValueError naming the file and the line or row (1-based)."""
    files = _files(Path(path))

    def documents():
        for p in files:
            try:
                if p.suffix == ".txt":
                    yield Document(f"file:{p.name}", p.read_text(encoding="utf-8"))
                elif p.suffix == ".jsonl":
                    yield from _jsonl(p, field)
                else:
                    yield from _table(p, field)
            except UnicodeDecodeError as exc:
                raise ValueError(f"{p}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None

    return _split(documents(), split)


def source_fingerprint(source: str) -> str | None:
    """16 hex digits that change when the documents of ``source`` may have changed, without reading
    them.

    A local path: each file's relative path, size and modification time (an edit, an added or a
    removed file changes it). ``"stdlib-docs"``: the Python implementation and version (the corpus
    is that interpreter's). A remote corpus or an unknown name: None (nothing cheap to check)."""
    if source == "stdlib-docs":
        parts = ["stdlib-docs", sys.implementation.name, platform.python_version()]
    elif not isinstance(source, str) or source in REMOTE or not Path(source).exists():
        return None
    else:
        root = Path(source)
        parts = []
        for p in _files(root):
            st = p.stat()
            parts.append(
                [
                    p.relative_to(root).as_posix() if root.is_dir() else p.name,
                    st.st_size,
                    st.st_mtime_ns,
                ]
            )
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def remote(name: str, split: str = "train") -> Iterator[Document]:
    """A corpus of the plan streamed from the hub (needs the ``datasets`` package and a network or
    cache)."""
    hub_id, config, field = REMOTE[name]
    try:
        from datasets import load_dataset

        stream = load_dataset(
            hub_id, config, split="validation" if split == "validation" else "train", streaming=True
        )
        first = iter(stream)
    except Exception as exc:
        raise ValueError(
            f"source {name!r} ({hub_id}) cannot be streamed here "
            f"({type(exc).__name__}: {str(exc).splitlines()[0]}). "
            "Offline, use 'stdlib-docs' or local files (.txt, .jsonl, .parquet, .arrow)."
        ) from None
    # prepare checks the text
    return (Document(f"{name}:{i}", row.get(field)) for i, row in enumerate(first))


def check_source(name: str, split: str = "train") -> None:
    """ValueError unless ``name`` is "stdlib-docs", a remote corpus name or an existing path, and
    ``split`` is valid: what :func:`load_source` would refuse, found before anything is read or
    written."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not valid; valid splits: {', '.join(SPLITS)}")
    if not isinstance(name, str) or not (
        name == "stdlib-docs" or name in REMOTE or (name and Path(name).exists())
    ):
        raise ValueError(
            f"unknown source {name!r}; valid: 'stdlib-docs', "
            f"{', '.join(repr(n) for n in REMOTE)}, "
            "or a path to .txt / .jsonl / .parquet / .arrow files"
        )


def load_source(name: str, split: str = "train") -> Iterator[Document]:
    """Documents of a named source: "stdlib-docs", a remote corpus name, or a local path."""
    check_source(name, split)
    if name == "stdlib-docs":
        return stdlib_docs(split)
    if name in REMOTE:
        return remote(name, split)
    return local_files(name, split)
