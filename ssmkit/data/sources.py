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
* remote corpora by name (see :data:`REMOTE`), streamed with ``datasets.load_dataset(...,
  streaming=True)``; offline and not cached, a clear error names the offline alternatives.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

VALIDATION_PERCENT = 5
MIN_DOC_CHARS = 200          # stdlib modules with less docstring text than this are skipped
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
    """The module's, classes' and functions' docstrings in source order, or "" if it does not parse."""
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
        skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "lib2to3", "__pycache__"}
        files = sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))
        for path in files:
            text = _module_docstrings(path)
            if len(text) >= MIN_DOC_CHARS:
                yield Document(f"stdlib:{path.relative_to(root).as_posix()}", text)

    return _split(documents(), split)


def local_files(path: str | Path, split: str = "all", field: str = "text") -> Iterator[Document]:
    """Documents from a file or a directory of .txt / .jsonl / .parquet / .arrow files (sorted)."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_SUFFIXES) if path.is_dir() else [path]
    if not files or not all(p.exists() and p.suffix in LOCAL_SUFFIXES for p in files):
        raise ValueError(f"{path}: no readable text files; expected {', '.join(LOCAL_SUFFIXES)} or a directory of them")

    def documents():
        for p in files:
            if p.suffix == ".txt":
                yield Document(f"file:{p.name}", p.read_text(encoding="utf-8"))
            elif p.suffix == ".jsonl":
                with p.open(encoding="utf-8") as f:
                    for i, line in enumerate(f):
                        if line.strip():
                            yield Document(f"file:{p.name}:{i}", json.loads(line)[field])
            else:
                try:
                    import pyarrow.parquet as pq
                    import pyarrow as pa
                except ImportError:
                    raise ValueError(f"{p}: reading {p.suffix} files needs pyarrow (pip install pyarrow)") from None
                table = pq.read_table(p) if p.suffix == ".parquet" else pa.ipc.open_stream(p).read_all()
                for i, text in enumerate(table.column(field).to_pylist()):
                    yield Document(f"file:{p.name}:{i}", text)

    return _split(documents(), split)


def remote(name: str, split: str = "train") -> Iterator[Document]:
    """A corpus of the plan streamed from the hub (needs the ``datasets`` package and a network or cache)."""
    hub_id, config, field = REMOTE[name]
    try:
        from datasets import load_dataset

        stream = load_dataset(hub_id, config, split="validation" if split == "validation" else "train", streaming=True)
        first = iter(stream)
    except Exception as exc:
        raise ValueError(
            f"source {name!r} ({hub_id}) cannot be streamed here ({type(exc).__name__}: {str(exc).splitlines()[0]}). "
            "Offline, use 'stdlib-docs' or local files (.txt, .jsonl, .parquet, .arrow)."
        ) from None
    return (Document(f"{name}:{i}", row[field]) for i, row in enumerate(first))


def load_source(name: str, split: str = "train") -> Iterator[Document]:
    """Documents of a named source: "stdlib-docs", a remote corpus name, or a local path."""
    if name == "stdlib-docs":
        return stdlib_docs(split)
    if name in REMOTE:
        return remote(name, split)
    if Path(name).exists():
        return local_files(name, split)
    raise ValueError(f"unknown source {name!r}; valid: 'stdlib-docs', {', '.join(repr(n) for n in REMOTE)}, "
                     "or a path to .txt / .jsonl / .parquet / .arrow files")
