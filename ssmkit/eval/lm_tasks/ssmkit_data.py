"""The ``custom_dataset`` of ssmkit's offline lm-eval tasks: their JSONL, read from this file's
folder.

lm-eval loads this file by path (``custom_dataset: !function ssmkit_data.load`` in a task YAML) and
calls ``load(**metadata, **dataset_kwargs)``; ``data_files`` maps a split to a JSONL file name next
to this file. (``datasets.load_dataset("json", data_files=...)`` would resolve a relative name
against the current directory.) Nothing is downloaded or cached: the rows are read into memory.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(data_files: dict[str, str], **_metadata):
    """``{split: datasets.Dataset}`` of the JSONL files named in ``data_files`` (relative to this
    folder)."""
    import datasets

    splits = {}
    for split, name in data_files.items():
        path = HERE / name
        with path.open(encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        splits[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(splits)
