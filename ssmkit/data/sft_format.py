"""SFT records in trl's formats, the "ssmkit" chat template, and a record made into tokens and a
loss mask.

Formats (one JSON object per line of a ``.jsonl`` file, as trl's ``SFTTrainer`` reads them):

* prompt-completion: ``{"prompt": "...", "completion": "..."}``. Plain text, NOT templated (as in
  trl, the prompt carries its own format): the sample is ``prompt + completion`` followed by EOS.
* conversational:
  ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}``, rendered
  with the chat template below. Every assistant turn is a completion.
* conversational prompt-completion:
  ``{"prompt": [messages...], "completion": [assistant messages...]}``: one conversation, whose
  completion messages alone are completions (earlier assistant turns in the prompt are context).

Other keys of a line (``"id"``, ``"source"``) are ignored; a message holds exactly ``role`` and
``content``. Refused, with the file and line: a line that is not a JSON object, ``{"text"}`` alone
(plain language modelling: that is :func:`ssmkit.data.prepare`'s input), both or neither of
prompt/messages, a role other than system/user/assistant, a system message anywhere but first, a
conversation whose last message is not the assistant's, a completion that is empty or only
whitespace, content holding a template marker or the tokenizer's EOS text (it would turn into the
special token).

The chat template ``"ssmkit"`` (:data:`CHAT_TEMPLATE`): plain-text markers that any byte-level BPE
(GPT-2's) encodes as ordinary tokens, one header line per turn::

    <|system|>\\n{content}\\n          (optional, first)
    <|user|>\\n{content}\\n
    <|assistant|>\\n{content}<EOS>

e.g. ``[user "What is 2 + 2?", assistant "4"]`` renders as
``"<|user|>\\nWhat is 2 + 2?\\n<|assistant|>\\n4<|endoftext|>"``; the generation prompt for an
answer is everything up to and including ``"<|assistant|>\\n"``. EOS (the tokenizer's own token,
appended as an id, never tokenized from text) closes every assistant turn and is part of its
completion.

Loss: with ``completion_only=True`` (the default, as trl's ``completion_only_loss`` and
``assistant_only_loss``) only the completion tokens and their EOS are trained; with False every
token is. Tokenization is cut at the same places either way (each prompt part and each completion is
encoded on its own), so the prompt tokens at generation time are exactly the ones seen in training.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ROLES = ("system", "user", "assistant")
CHAT_TEMPLATE = "<|{role}|>\n{content}"  # one turn; user/system end with "\n", assistant with EOS
MARKERS = tuple(f"<|{role}|>" for role in ROLES)
CHAT_TEMPLATES = ("ssmkit",)
EOS_TEXT = "<|endoftext|>"  # how EOS is written in rendered text (GPT-2's and 'byte''s EOS)
VALID = (
    'each line must be a JSON object in one of trl\'s formats: {"prompt": str, "completion": str}, '
    '{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]} or '
    '{"prompt": [messages], "completion": [assistant messages]}'
)


@dataclass(frozen=True)
class SFTRecord:
    """One sample, checked. ``messages``: (role, content) pairs; a plain prompt-completion record
    has ``templated=False`` and the pairs ("prompt", p), ("completion", c). ``trained[i]``: message
    i is a completion. ``where``: the file and line (or set and index) it came from, for error
    messages."""

    messages: tuple[tuple[str, str], ...]
    trained: tuple[bool, ...]
    templated: bool
    where: str = ""

    @property
    def prompt(self) -> str:
        """The text a model is given to produce the last completion (template markers included)."""
        return _join(segments(self)[:-2])

    @property
    def completion(self) -> str:
        """The last completion's text (without EOS)."""
        return self.messages[-1][1]


def _fail(where: str, what: str):
    raise ValueError(f"{where}: {what}; {VALID}")


def _messages(value, where: str, field: str) -> list[tuple[str, str]]:
    if not isinstance(value, list) or not value:
        _fail(
            where,
            f"{field!r} must be a non-empty list of messages; got {type(value).__name__}"
            f"{' (empty)' if value == [] else ''}",
        )
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            keys = sorted(m) if isinstance(m, dict) else type(m).__name__
            _fail(
                where,
                f"{field}[{i}] must be an object with exactly the keys 'role' and 'content'; "
                f"got {keys}",
            )
        role, content = m["role"], m["content"]
        if role not in ROLES:
            _fail(where, f"{field}[{i}] has role {role!r}; valid roles: {', '.join(ROLES)}")
        if not isinstance(content, str):
            _fail(where, f"{field}[{i}] content must be a string; got {type(content).__name__}")
        out.append((role, content))
    return out


def _encodable(text: str, where: str, what: str):
    """Text a tokenizer can take: JSON's ``"\\ud800"`` (a lone surrogate, valid JSON) decodes to a
    str that is no Unicode text, and tokenizers fail on it with errors naming no line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        _fail(
            where,
            f"{what} holds a lone surrogate {text[exc.start]!r} at character {exc.start} (an "
            "unpaired \\uD800-\\uDFFF escape): not text; write the character itself or its pair",
        )


def _no_markers(text: str, where: str, what: str, markers=MARKERS):
    for marker in markers:
        if marker in text:
            _fail(
                where,
                f"{what} holds {marker!r}, a marker of the chat template (it would read as a new "
                "turn); remove or rewrite it",
            )


def parse_record(row, where: str = "record") -> SFTRecord:
    """A record in one of trl's formats (a dict read from a JSON line) checked into an
    :class:`SFTRecord`, or ValueError naming ``where``, what is wrong and the valid formats."""
    if not isinstance(row, dict):
        _fail(where, f"the line is a JSON {type(row).__name__}, not an object")
    has_messages, has_prompt = "messages" in row, "prompt" in row or "completion" in row
    if has_messages and has_prompt:
        _fail(where, "the object has both 'messages' and 'prompt'/'completion': choose one format")
    if not has_messages and not has_prompt:
        hint = (
            " ({'text'} is plain language modelling: prepare it with ssmkit.data.prepare)"
            if "text" in row
            else ""
        )
        _fail(
            where,
            f"the object has keys {sorted(row)}, neither 'messages' nor 'prompt' + "
            f"'completion'{hint}",
        )
    if has_messages:
        msgs = _messages(row["messages"], where, "messages")
        trained = [role == "assistant" for role, _ in msgs]
    else:
        if "prompt" not in row or "completion" not in row:
            _fail(
                where,
                f"the object has {'prompt' if 'prompt' in row else 'completion'} but no "
                f"{'completion' if 'prompt' in row else 'prompt'}",
            )
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion.strip():
                _fail(where, f"the completion is empty ({completion!r}): nothing to train on")
            _encodable(prompt, where, "the prompt")
            _encodable(completion, where, "the completion")
            return SFTRecord(
                (("prompt", prompt), ("completion", completion)), (False, True), False, where
            )
        if not isinstance(prompt, list) or not isinstance(completion, list):
            _fail(
                where,
                f"prompt and completion must both be strings or both lists of messages; got "
                f"{type(prompt).__name__} and {type(completion).__name__}",
            )
        head, tail = _messages(prompt, where, "prompt"), _messages(completion, where, "completion")
        if any(role != "assistant" for role, _ in tail):
            _fail(where, "every message of 'completion' must have role 'assistant'")
        msgs, trained = head + tail, [False] * len(head) + [True] * len(tail)
    for i, (role, content) in enumerate(msgs):
        if role == "system" and i > 0:
            _fail(where, f"message {i} has role 'system'; a system message may only come first")
        if role == "assistant" and not content.strip():
            _fail(
                where,
                f"message {i} (assistant) is empty ({content!r}): an empty completion trains "
                "nothing",
            )
        _encodable(content, where, f"message {i} ({role})")
        _no_markers(content, where, f"message {i} ({role})")
    if msgs[-1][0] != "assistant":
        _fail(
            where,
            f"the last message has role {msgs[-1][0]!r}; a conversation must end with the "
            "assistant's turn (what is trained)",
        )
    return SFTRecord(tuple(msgs), tuple(trained), True, where)


def read_jsonl(path: str | Path) -> list[SFTRecord]:
    """Every non-blank line of a ``.jsonl`` file as an :class:`SFTRecord` (see
    :func:`parse_record`); a bad line is a ValueError naming the file and the line (1-based)."""
    path = Path(path)
    records = []
    try:
        with path.open(encoding="utf-8") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                where = f"{path}, line {i + 1}"
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    _fail(where, f"not valid JSON ({exc})")
                except RecursionError:  # json's decoder recurses once per [ or {
                    _fail(where, "nested too deeply to read (thousands of [ or {)")
                records.append(parse_record(row, where))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except FileNotFoundError:
        raise ValueError(f"SFT file {path} does not exist") from None
    if not records:
        raise ValueError(f"{path} holds no records (only blank lines); {VALID}")
    return records


# --- the template and the tokens ------------------------------------------------------------------

EOS_SEGMENT = None  # stands for the EOS token in :func:`segments`


def segments(record: SFTRecord) -> list[tuple[str | None, bool]]:
    """The record as (text, is_completion) pieces in order, cut where tokenization is cut: every
    prompt part (all the text since the previous completion, headers included) and every completion
    is one piece, each completion followed by ``(EOS_SEGMENT, True)``. Joining the texts (EOS as
    :data:`EOS_TEXT`) gives :func:`render`'s text."""
    if not record.templated:
        (_, prompt), (_, completion) = record.messages
        return [(prompt, False), (completion, True), (EOS_SEGMENT, True)]
    out, pending = [], ""
    for (role, content), trained in zip(record.messages, record.trained, strict=True):
        header = CHAT_TEMPLATE.format(role=role, content="")
        if role != "assistant":
            pending += header + content + "\n"
            continue
        pending += header
        out += [(pending, False), (content, trained), (EOS_SEGMENT, trained)]
        pending = ""
    return out


def render(record: SFTRecord) -> str:
    """The record's text as the model reads it, EOS written as :data:`EOS_TEXT` (for reading and
    tests)."""
    return _join(segments(record))


def _join(segs) -> str:
    return "".join(EOS_TEXT if t is EOS_SEGMENT else t for t, _ in segs)


def render_messages(messages: list[dict]) -> str:
    """Messages in trl's form (``[{"role", "content"}, ...]``, ending with the assistant's turn)
    rendered with the "ssmkit" template: ``render(parse_record({"messages": messages}))``."""
    return render(parse_record({"messages": messages}, "messages"))


def check_special(record: SFTRecord, specials: list[str]):
    """ValueError if a text of ``record`` holds one of the tokenizer's special tokens (written as
    text, the tokenizer would encode it as that token)."""
    for i, (role, content) in enumerate(record.messages):
        for s in specials:
            if s and s in content:
                _fail(
                    record.where,
                    f"message {i} ({role}) holds the tokenizer's special token {s!r} as text",
                )


def encode_records(records: list[SFTRecord], tok, completion_only: bool = True):
    """Token ids of each record with its loss mask.

    tok: a transformers fast tokenizer with an EOS token. Returns ``(ids, mask, start)`` lists, one
    entry per record: ``ids[k]`` int list; ``mask[k][j]`` True when token j is a target of the loss
    (a completion token or its EOS; every token if not ``completion_only``); ``start[k]``: where the
    last completion begins (``ids[k][:start[k]]`` is its generation prompt)."""
    if tok.eos_token_id is None:
        raise ValueError(
            f"the tokenizer {getattr(tok, 'name_or_path', tok)!r} has no EOS token; SFT appends "
            "EOS after each completion"
        )
    specials = list(getattr(tok, "all_special_tokens", [tok.eos_token]))
    pieces = []
    for r in records:
        check_special(r, specials)
        pieces.append(segments(r))
    texts = [t for segs in pieces for t, _ in segs if t is not EOS_SEGMENT and t]
    encoded = iter(tok(texts, add_special_tokens=False)["input_ids"] if texts else [])
    ids, masks, starts = [], [], []
    for segs in pieces:
        row, mask, start = [], [], 0
        for k, (text, trained) in enumerate(segs):
            if k == len(segs) - 2:  # the last completion begins here
                start = len(row)
            piece = (
                [tok.eos_token_id] if text is EOS_SEGMENT else list(next(encoded)) if text else []
            )
            row += piece
            mask += [trained or not completion_only] * len(piece)
        ids.append(row)
        masks.append(mask)
        starts.append(start)
    return ids, masks, starts
