"""The offline lm-eval tasks that ship with ssmkit, and the function building them from the embedded
corpus.

lm-evaluation-harness tasks are YAML files naming a dataset; the plan's tasks (:data:`PLAN_TASKS`)
name datasets on the Hugging Face hub, out of reach without a network. The tasks here
(:data:`OFFLINE_TASKS`) live in :data:`TASKS_DIR` (``ssmkit/eval/lm_tasks/``): a YAML file, its
JSONL data and ``ssmkit_data.py`` (the YAML's ``custom_dataset``, which reads the JSONL next to it:
lm-eval hands ``data_files`` to ``datasets.load_dataset``, which resolves a relative path against
the current directory, not the YAML's).

Both tasks are made from the validation split of ``stdlib-docs``
(:func:`ssmkit.data.sources.in_validation`): a model trained on the train split has never seen their
text. Glossary of a built item:

* prose sentence: a sentence of a docstring paragraph that is plain text (no ``>>>`` examples, no
  indented code or lists), 5-40 words, ending in ``.``, ``!`` or ``?``;
* ``ssmkit_docstring_cloze``: ``context`` (up to 2 prose sentences of the same document, then a
  sentence up to a word), ``choices`` (that word and 3 words of other documents, same
  capitalization, 1-3 letters shorter or longer, the true word's length rank uniform among the 4;
  shuffled), ``label``; scored as multiple choice (``acc``; ``acc_norm``: log-likelihood per
  character). Chance: 0.25, also for a scorer that sees only lengths.
* ``ssmkit_lastword``: ``context`` (up to 2 prose sentences, then a sentence without its last word
  and final period) and ``target`` (that word), in LAMBADA's style; ``acc`` = the greedy
  continuation is exactly the word, ``perplexity`` = exp(-mean log p(word | context)).

:func:`build_offline_tasks` rebuilds the files (deterministically: a seeded ``random.Random`` per
item). The shipped JSONL was built once and is data, so results do not change with the Python
version whose standard library a machine has.
"""

from __future__ import annotations

import json
import platform
import random
import re
import shutil
from pathlib import Path

from .. import io

TASKS_DIR = Path(__file__).resolve().parent / "lm_tasks"
OFFLINE_TASKS = ("ssmkit_docstring_cloze", "ssmkit_lastword")
# the plan's benchmarks (stage 2.5): lm-eval's own task names; they need the hub or its datasets
# cache
PLAN_TASKS = ("hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande", "lambada_openai")

SEED = 1234
MAX_CONTEXT_CHARS = 240  # the sentences before an item, at most this long (whole sentences)
N_CHOICES = 4
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
# a paragraph is not prose when a line is an example, a list item, indented, a grammar rule or an
# underline
_NOT_PROSE = re.compile(
    r"^\s*(>>>|\.\.\.|[*\-|+]\s)|::=|^\s{2,}\S|^\s*([*=~^#-])\2{2,}\s*$", re.MULTILINE
)
_ABBREVIATION = re.compile(r"\b(e\.g|i\.e|etc|vs|cf)\.$")

_HEADER = (
    "# {task}: {what}\n"
    "# Built by ssmkit.eval.build_offline_tasks() from the validation split of ssmkit's embedded "
    "corpus\n"
    "# (stdlib-docs: CPython {python}'s pydoc topics and standard-library docstrings; "
    "a document is in the\n"
    "# validation split when ssmkit.data.sources.in_validation(its id) holds), {n} items, "
    "seed {seed}.\n"
    "# A model trained on the train split of stdlib-docs has never seen this text.\n"
    "# {how}\n"
    "# Data: {task}.jsonl next to this file, read by ssmkit_data.load (lm-eval's custom_dataset):\n"
    "# datasets.load_dataset would resolve a relative data_files path against the current "
    "directory.\n"
    "# Run: ssmkit eval --model DIR --tasks {task}\n"
)

_CLOZE = """\
task: ssmkit_docstring_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: ssmkit_docstring_cloze.jsonl
custom_dataset: !function ssmkit_data.load
output_type: multiple_choice
test_split: test
doc_to_text: "{{context}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

_LASTWORD = """\
task: ssmkit_lastword
dataset_path: json
dataset_kwargs:
  data_files:
    test: ssmkit_lastword.jsonl
custom_dataset: !function ssmkit_data.load
output_type: loglikelihood
test_split: test
doc_to_text: "{{context}}"
doc_to_target: "{{' ' + target}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

_WHAT = {
    "ssmkit_docstring_cloze": (
        "which word comes next in a stdlib docstring sentence (4-way multiple choice)",
        "Item: up to 2 prose sentences, then a sentence up to a word (its 4th or later, "
        "not its last;\n"
        "# alphabetic, 3+ letters); choices: that word and 3 words of other documents "
        "with the same\n"
        "# capitalization and 1-3 letters shorter or longer, its length rank among the 4 "
        "uniform (choosing\n"
        "# by length alone scores 0.25). Metrics: acc (highest log-likelihood), acc_norm (highest\n"
        "# log-likelihood per character). Chance is 0.25.",
        _CLOZE,
    ),
    "ssmkit_lastword": (
        "predict the last word of a docstring passage (LAMBADA-style, no final period)",
        "Item: up to 2 prose sentences, then a sentence without its last word (context); "
        "target: that\n"
        "# word (alphabetic, 3+ letters), scored as ' ' + word. Metrics: acc (the greedy "
        "continuation is\n"
        "# exactly the word), perplexity (exp of minus the mean log-likelihood of the word).",
        _LASTWORD,
    ),
}


def prose_sentences(text: str) -> list[str | None]:
    """The sentences of a docstring's plain-prose paragraphs, in order, with None where a paragraph
    was skipped (one with a ``>>>`` example, an indented line, a list item, a grammar rule or a
    heading's underline): context never reaches across it. Lines are joined with one space."""
    out: list[str | None] = []
    for para in re.split(r"\n\s*\n", text):
        if not para.strip():
            continue
        if _NOT_PROSE.search(para):
            if out and out[-1] is not None:
                out.append(None)
            continue
        joined = " ".join(line.strip() for line in para.splitlines())
        out.extend(s.strip() for s in _SENTENCE_END.split(joined) if s.strip())
    return out


def is_item_sentence(s: str | None) -> bool:
    """A sentence an item may be made of: 5-40 words, 30-240 characters, ends in . ! or ? (not an
    abbreviation), at least 80% letters and spaces."""
    if s is None:
        return False
    words = s.split()
    letters = sum(c.isalpha() or c == " " for c in s)
    return (
        5 <= len(words) <= 40
        and 30 <= len(s) <= 240
        and s[-1] in ".!?"
        and not _ABBREVIATION.search(s)
        and letters >= 0.8 * len(s)
    )


def _context(sentences: list[str | None], i: int) -> str:
    """The 1-2 sentences right before sentence i in its run of prose (whole sentences, at most
    MAX_CONTEXT_CHARS; "" if none)."""
    picked: list[str] = []
    for s in reversed(sentences[max(0, i - 2) : i]):
        if s is None or len(" ".join([s, *picked])) > MAX_CONTEXT_CHARS:
            break
        picked.insert(0, s)
    return " ".join(picked)


def _distractors(
    rng: random.Random, gold: str, candidates: list[str], shorter_ones: int, spread: int = 3
) -> list[str] | None:
    """3 different ``candidates`` whose length differs from the gold's by 1..``spread`` characters,
    ``shorter_ones`` of them shorter and the rest longer (None when there are not enough). Drawing
    ``shorter_ones`` uniformly in 0..3 makes the gold's length rank among the 4 uniform, so a scorer
    that only sees length (an untrained model's summed log-likelihood) is at chance, 1/4."""
    shorter = [c for c in candidates if 0 < len(gold) - len(c) <= spread]
    longer = [c for c in candidates if 0 < len(c) - len(gold) <= spread]
    if len(shorter) < shorter_ones or len(longer) < N_CHOICES - 1 - shorter_ones:
        return None
    return rng.sample(shorter, shorter_ones) + rng.sample(longer, N_CHOICES - 1 - shorter_ones)


def _words(sentence: str) -> list[str]:
    """The words a blank may hide: alphabetic, 3+ letters (punctuation attached disqualifies a
    word)."""
    return [w for w in sentence.split(" ") if w.isalpha() and len(w) >= 3]


def build_items(docs) -> dict[str, list[dict]]:
    """The items of both tasks from ``docs`` (:class:`~ssmkit.data.Document`, e.g. the validation
    split of stdlib-docs): ``{"ssmkit_docstring_cloze": [...], "ssmkit_lastword": [...]}``,
    deterministic."""
    per_doc = [(d.id, prose_sentences(d.text)) for d in docs]
    pool = [(doc_id, s) for doc_id, sents in per_doc for s in sents if is_item_sentence(s)]
    counts: dict[str, int] = {}
    for _, s in pool:
        counts[s] = counts.get(s, 0) + 1
    vocab = sorted({(doc_id, w) for doc_id, s in pool for w in _words(s)})
    cloze, lastword = [], []
    for doc_id, sents in per_doc:
        others = sorted({w for d, w in vocab if d != doc_id})
        for i, s in enumerate(sents):
            if (
                not is_item_sentence(s) or counts[s] > 1
            ):  # a repeated sentence would be two equal items
                continue
            context, item_id = _context(sents, i), f"{doc_id}#{i}"
            words = s.split(" ")
            blanks = [j for j in range(3, len(words) - 1) if words[j] in _words(words[j])]
            rng = random.Random(f"{SEED}:cloze:{item_id}")
            shorter_ones, label = rng.randrange(N_CHOICES), rng.randrange(N_CHOICES)
            for j in rng.sample(
                blanks, len(blanks)
            ):  # the first blank with distractors of that rank
                gold = words[j]
                same_case = [
                    w
                    for w in others
                    if w[0].isupper() == gold[0].isupper() and w.lower() != gold.lower()
                ]
                choices = _distractors(rng, gold, same_case, shorter_ones)
                if choices is not None:
                    choices.insert(label, gold)
                    text = " ".join(filter(None, [context, " ".join(words[:j])]))
                    cloze.append(
                        {"id": item_id, "context": text, "choices": choices, "label": label}
                    )
                    break
            *head, last = s[:-1].split(" ")
            if s.endswith(".") and last.isalpha() and len(last) >= 3 and len(head) >= 4:
                passage = " ".join(filter(None, [context, " ".join(head)]))
                lastword.append({"id": item_id, "context": passage, "target": last})
    return {"ssmkit_docstring_cloze": cloze, "ssmkit_lastword": lastword}


def build_offline_tasks(out_dir: str | Path = TASKS_DIR, docs=None) -> dict[str, int]:
    """Write the offline tasks into ``out_dir``: per task a YAML (its header says what it measures
    and how it was built) and a JSONL of items, plus ``ssmkit_data.py`` (the loader the YAMLs name).
    ``docs``: the documents to build from (default: the validation split of stdlib-docs). Files are
    written atomically. Returns ``{task: number of items}``. ``build_offline_tasks()`` rewrites the
    shipped copy."""
    from ..data.sources import stdlib_docs

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items = build_items(stdlib_docs("validation") if docs is None else docs)
    for task, rows in items.items():
        what, how, body = _WHAT[task]
        header = _HEADER.format(
            task=task, what=what, python=platform.python_version(), n=len(rows), seed=SEED, how=how
        )
        io.write_atomically(out / f"{task}.yaml", header + body)
        lines = (
            json.dumps(r, ensure_ascii=False, sort_keys=True, separators=(",", ":")) for r in rows
        )
        io.write_atomically(out / f"{task}.jsonl", "".join(line + "\n" for line in lines))
    loader = TASKS_DIR / "ssmkit_data.py"
    if loader.resolve() != (out / loader.name).resolve():
        shutil.copyfile(loader, out / loader.name)
    return {task: len(rows) for task, rows in items.items()}
