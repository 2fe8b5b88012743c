"""SFT data (ssmkit.data.sft*, ssmkit.eval.sft): trl's formats and their errors, the chat template's
text, completion-only masks worked by hand, EOS, packing and seq_idx, no-packing rows, order, ranks,
resume, checksums, the offline sets' splits, and the evaluation against one-by-one runs and oracle
models.

Most tests use the "byte" tokenizer (token id = byte value, EOS = 256), so positions can be counted
by hand. Oracles: hand-written token lists and labels, the tokenizer called on the texts directly,
answers re-derived from the questions here, one-sample-at-a-time model runs. fp32 tolerance: 1e-5
(relative).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import perturb_

import ssmkit
from ssmkit.data import get_tokenizer
from ssmkit.data.sft import SFTLoader, open_sft, pack_windows, prepare_sft
from ssmkit.data.sft_format import CHAT_TEMPLATE, parse_record, read_jsonl, render, render_messages
from ssmkit.data.sft_sets import SFT_SOURCES, docstring_items, sft_arith, sft_docstrings
from ssmkit.eval.sft import completion_loss, exact_match, generation_table

EOS = 256  # the byte tokenizer's EOS


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def chat(q, a):
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    """sft-arith, byte tokenizer: 240 train and 40 val samples."""
    base = tmp_path_factory.mktemp("sft")
    prepare_sft("sft-arith", base / "train", tokenizer="byte", max_samples=240)
    prepare_sft("sft-arith", base / "val", tokenizer="byte", split="val", max_samples=40)
    return base


# --- formats and errors ---------------------------------------------------------------------------


def test_both_formats_parse(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "Q: 2+2\nA:", "completion": " 4", "id": 7},  # extra keys are ignored
            "",
            chat("hi", "yo"),
            {
                "prompt": [{"role": "user", "content": "a"}],
                "completion": [{"role": "assistant", "content": "b"}],
            },
        ],
    )
    plain, msgs, conv = read_jsonl(path)
    assert (plain.templated, plain.messages, plain.trained) == (
        False,
        (("prompt", "Q: 2+2\nA:"), ("completion", " 4")),
        (False, True),
    )
    assert (msgs.templated, msgs.messages, msgs.trained) == (
        True,
        (("user", "hi"), ("assistant", "yo")),
        (False, True),
    )
    assert conv.messages == (("user", "a"), ("assistant", "b")) and conv.trained == (False, True)
    assert msgs.where.endswith("line 3")
    assert render(plain) == "Q: 2+2\nA: 4<|endoftext|>"  # plain: not templated


BAD = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON list, not an object"),
    ({"text": "plain"}, "prepare it with ssmkit.data.prepare"),
    ({"messages": [], "prompt": "x", "completion": "y"}, "both 'messages' and 'prompt'"),
    ({"prompt": "x"}, "has prompt but no completion"),
    ({"prompt": "x", "completion": ""}, "completion is empty"),
    ({"prompt": "x", "completion": "  \n"}, "completion is empty"),
    ({"prompt": 3, "completion": "y"}, "must both be strings or both lists of messages"),
    ({"messages": []}, "non-empty list of messages"),
    (
        {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]},
        "role 'tool'; valid roles: system, user, assistant",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "x", "name": "bob"},
                {"role": "assistant", "content": "y"},
            ]
        },
        "exactly the keys 'role' and 'content'",
    ),
    (
        {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]},
        "content must be a string",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "system", "content": "s"},
                {"role": "assistant", "content": "y"},
            ]
        },
        "system message may only come first",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]},
        "an empty completion trains nothing",
    ),
    (
        {"messages": [{"role": "assistant", "content": "y"}, {"role": "user", "content": "x"}]},
        "must end with the assistant's turn",
    ),
    (
        {
            "prompt": [{"role": "user", "content": "x"}],
            "completion": [{"role": "user", "content": "y"}],
        },
        "every message of 'completion' must have role 'assistant'",
    ),
    (chat("see <|assistant|> here", "y"), "marker of the chat template"),
    # valid JSON, but no text: a tokenizer fails on it naming no line (before: TextEncodeInput)
    (
        '{"prompt": "\\ud800 hi", "completion": "a"}',
        r"the prompt holds a lone surrogate '\ud800' at character 0",
    ),
    (chat("x", "y\udc00"), r"message 1 (assistant) holds a lone surrogate '\udc00'"),
    # json's decoder recurses per bracket (before: RecursionError, no file or line)
    ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "completion": "x"}', "nested too deeply"),
]


@pytest.mark.parametrize("line, message", BAD)
def test_bad_lines_name_file_line_and_valid_formats(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [chat("ok", "fine"), "", line])
    with pytest.raises(ValueError) as err:
        read_jsonl(path)
    text = str(err.value)
    assert f"{path}, line 3" in text and message in text and "trl's formats" in text


def test_empty_file_eos_text_and_unknown_source(tmp_path):
    with pytest.raises(ValueError, match="holds no records"):
        read_jsonl(write_jsonl(tmp_path / "empty.jsonl", ["", "  "]))
    eos_inside = write_jsonl(
        tmp_path / "eos.jsonl", [chat("ok", "fine"), chat("a<|endoftext|>b", "c")]
    )
    with pytest.raises(
        ValueError, match=r"line 2: message 0 \(user\) holds the tokenizer's special token"
    ):
        prepare_sft(eos_inside, tmp_path / "out", tokenizer="byte")
    with pytest.raises(
        ValueError, match="unknown SFT source 'nope'; valid: sft-docstrings, sft-arith"
    ):
        prepare_sft("nope", tmp_path / "out2")
    with pytest.raises(ValueError, match="chat_template='chatml' is not valid; valid: ssmkit"):
        prepare_sft("sft-arith", tmp_path / "out3", chat_template="chatml")
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_directory_named_jsonl_is_called_a_directory(tmp_path):
    """Fault injected: ``X.jsonl`` is a directory (before: "the file X.jsonl does not exist")."""
    from ssmkit.train.data import sft_source

    folder = tmp_path / "dir.jsonl"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"dir\.jsonl is a directory, not a \.jsonl file"):
        sft_source(f"sft:{folder}")
    with pytest.raises(ValueError, match=r"dir\.jsonl is a directory, not a \.jsonl file"):
        prepare_sft(folder, tmp_path / "out", tokenizer="byte")
    assert not (tmp_path / "out").exists()


def test_jsonl_val_split_is_the_sibling_file(tmp_path):
    train = write_jsonl(tmp_path / "qa.jsonl", [chat("a", "b"), chat("c", "d")])
    with pytest.raises(ValueError, match=r"qa\.val\.jsonl, which does not exist"):
        prepare_sft(train, tmp_path / "v", tokenizer="byte", split="val")
    write_jsonl(tmp_path / "qa.val.jsonl", [chat("e", "f")])
    assert (
        open_sft(prepare_sft(train, tmp_path / "v", tokenizer="byte", split="val")).index["samples"]
        == 1
    )
    assert open_sft(prepare_sft(train, tmp_path / "t", tokenizer="byte")).index["samples"] == 2


# --- the template, masks, EOS ---------------------------------------------------------------------


def test_chat_template_exact_text():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6"},
    ]
    assert CHAT_TEMPLATE == "<|{role}|>\n{content}"
    assert render_messages(messages) == (
        "<|system|>\nBe brief.\n<|user|>\nWhat is 2 + 2?\n<|assistant|>\n4"
        "<|endoftext|><|user|>\nAnd 3 + 3?\n<|assistant|>\n6<|endoftext|>"
    )
    record = parse_record({"messages": messages})
    assert record.prompt == (
        "<|system|>\nBe brief.\n<|user|>\nWhat is 2 + 2?\n<|assistant|>\n4<|endoftext|>"
        "<|user|>\nAnd 3 + 3?\n<|assistant|>\n"
    )
    assert record.completion == "6"


def one_batch(tmp_path, name, rows, seq_len, **kw):
    out = prepare_sft(
        write_jsonl(tmp_path / f"{name}.jsonl", rows), tmp_path / name, tokenizer="byte", **kw
    )
    x, y, s = next(iter(SFTLoader(out, seq_len=seq_len, batch_size=1, packing=False)))
    return x[0].tolist(), y[0].tolist(), s[0].tolist()


def test_completion_only_mask_worked_by_hand(tmp_path):
    # "<|user|>\nhi\n<|assistant|>\n" is 26 bytes (positions 0..25); "yo" is 26, 27; EOS is 28;
    # padding 29..31
    text = b"<|user|>\nhi\n<|assistant|>\n"
    assert len(text) == 26
    x, y, s = one_batch(tmp_path, "chat", [chat("hi", "yo")], seq_len=32)
    assert x == list(text) + [ord("y"), ord("o"), EOS] + [EOS] * 3
    expected = [-100] * 32
    expected[25], expected[26], expected[27] = ord("y"), ord("o"), EOS  # 25 predicts 'y', 27 EOS
    assert y == expected  # 28 (EOS) predicts nothing
    assert s == [0] * 29 + [1] * 3  # padding: an index of its own
    # completion_only=False: every position but the sample's last predicts the next token
    x2, y2, _ = one_batch(tmp_path, "all", [chat("hi", "yo")], seq_len=32, completion_only=False)
    assert x2 == x and y2 == x[1:29] + [-100] * 4
    # plain prompt-completion "ab" -> "c": tokens a b c EOS; labels: -, c, EOS, -
    x3, y3, s3 = one_batch(tmp_path, "plain", [{"prompt": "ab", "completion": "c"}], seq_len=4)
    assert (x3, y3, s3) == ([97, 98, 99, EOS], [-100, 99, EOS, -100], [0, 0, 0, 0])


def test_eos_after_each_assistant_turn_with_gpt2_tokens(tmp_path):
    tok = get_tokenizer("gpt2")
    eos = tok.eos_token_id
    conv = {
        "prompt": [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3 + 3?"},
        ],
        "completion": [{"role": "assistant", "content": "6"}],
    }
    out = prepare_sft(write_jsonl(tmp_path / "c.jsonl", [conv]), tmp_path / "c")
    data = open_sft(out)
    ids, mask = data.sample(0)

    def enc(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    head1 = enc("<|user|>\nWhat is 2 + 2?\n<|assistant|>\n")
    head2 = enc("<|user|>\nAnd 3 + 3?\n<|assistant|>\n")
    expected = head1 + enc("4") + [eos] + head2 + enc("6") + [eos]
    assert ids.tolist() == expected
    # only the completion message ("6") and its EOS are trained; the context answer "4" and its EOS
    # are not
    assert mask.tolist() == [False] * (len(expected) - len(enc("6")) - 1) + [True] * (
        len(enc("6")) + 1
    )
    assert data.prompt(0).tolist() == head1 + enc("4") + [eos] + head2  # the generation prompt
    assert data.index["loss_tokens"] == len(enc("6")) + 1


# --- packing, no packing, order, ranks, resume ----------------------------------------------------


def sample_ids(data):
    """token tuple -> sample index (sft-arith questions are distinct, so every sample's tokens
    are)."""
    table = {tuple(data.sample(k)[0].tolist()): k for k in range(len(data))}
    assert len(table) == len(data)
    return table


def epoch_samples(loader, table):
    """The samples of one epoch of ``loader``, checking every row on the way (the packing
    oracle)."""
    seen, data, batches = [], loader.data, iter(loader)
    for _ in range(loader.batches_per_epoch):
        x, y, s = next(batches)
        assert x.dtype == y.dtype == torch.int64 and s.dtype == torch.int32
        assert x.shape == y.shape == s.shape == (loader.batch_size, loader.seq_len)
        for ids, labels, idx in zip(x.tolist(), y.tolist(), s.tolist(), strict=True):
            assert idx[0] == 0 and all(
                b - a in (0, 1) for a, b in zip(idx, idx[1:])
            )  # 0, 1, 2, ...
            pos = 0
            for part in range(idx[-1] + 1):
                n = idx.count(part)
                chunk = tuple(ids[pos : pos + n])
                if chunk in table:  # a sample, whole
                    k = table[chunk]
                    _, mask = data.sample(k)
                    want = [chunk[j + 1] if mask[j + 1] else -100 for j in range(n - 1)] + [-100]
                    assert labels[pos : pos + n] == want
                    seen.append(k)
                else:  # padding: only at the end
                    assert part == idx[-1] and set(chunk) == {loader.eos_token_id}
                    assert labels[pos : pos + n] == [-100] * n
                pos += n
            # no label at a boundary predicts the next sample's first token
            assert all(labels[t] == -100 for t in range(len(idx) - 1) if idx[t] != idx[t + 1])
    return seen


def test_packing_rows_seq_idx_and_labels(arith):
    loader = SFTLoader(arith / "train", seq_len=128, batch_size=4, seed=3)
    table = sample_ids(loader.data)
    seen = epoch_samples(loader, table)
    assert len(seen) == len(set(seen))  # each sample at most once per epoch
    lengths = loader.data.lengths
    assert sorted(k for w in loader.windows for k in w) == list(
        range(len(lengths))
    )  # every sample placed
    assert all(sum(lengths[k] for k in w) <= 128 for w in loader.windows)
    assert max(len(w) for w in loader.windows) >= 2 and loader.skipped == 0
    used = sum(len(loader.windows[w]) for w in loader._my_windows(0).tolist())
    assert len(seen) == used


def test_best_fit_decreasing_by_hand():
    # longest first: 6 -> w0 (room 4); 5 -> w1 (room 5); 4 -> w0 (fits exactly, least room); 3 -> w1
    # (room 2); 2 -> w1 (room 0); 1 -> w2
    assert pack_windows([3, 6, 1, 5, 2, 4], seq_len=10) == [[1, 5], [3, 0, 4], [2]]
    with pytest.raises(ValueError, match="does not fit seq_len 4"):
        pack_windows([5], 4)


def test_no_packing_one_sample_per_row(arith):
    loader = SFTLoader(arith / "train", seq_len=96, batch_size=8, packing=False)
    assert all(len(w) == 1 for w in loader.windows) and len(loader.windows) == 240
    table = sample_ids(loader.data)
    seen = epoch_samples(loader, table)
    assert len(seen) == loader.batches_per_epoch * 8 == len(set(seen))
    x, _, s = next(iter(SFTLoader(arith / "train", seq_len=96, batch_size=8, packing=False)))
    for row, idx in zip(x.tolist(), s.tolist(), strict=True):
        n = idx.count(0)
        assert tuple(row[:n]) in table and set(idx[n:]) <= {1}  # right padding, index 1


def batches(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def same(a, b):
    return all(
        torch.equal(u, v) for p, q in zip(a, b, strict=True) for u, v in zip(p, q, strict=True)
    )


def test_order_is_deterministic_by_seed_and_epoch(arith):
    make = lambda seed: SFTLoader(arith / "train", seq_len=128, batch_size=4, seed=seed)  # noqa: E731
    a, b, c = make(0), make(0), make(1)
    n = a.batches_per_epoch
    first, again, other = batches(a, 2 * n), batches(b, 2 * n), batches(c, 2 * n)
    assert same(first, again)
    assert not same(first[:n], other[:n])
    assert not same(first[:n], first[n:])  # epoch 1 is another order
    rows = {tuple(a.row(w)[0].tolist()) for w in a.windows}  # ... of the same windows
    for epoch in (first[:n], first[n:]):
        got = [tuple(r) for x, _, _ in epoch for r in x.tolist()]
        assert len(set(got)) == len(got) == n * 4 and set(got) <= rows


@pytest.mark.parametrize("packing", [True, False])
def test_ranks_take_disjoint_samples(arith, packing):
    loaders = [
        SFTLoader(arith / "train", seq_len=128, batch_size=2, rank=r, world_size=3, packing=packing)
        for r in range(3)
    ]
    table = sample_ids(loaders[0].data)
    seen = [set(epoch_samples(lo, table)) for lo in loaders]
    assert len({lo.batches_per_epoch for lo in loaders}) == 1 and all(seen)
    assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])


def test_resume_is_exact(arith):
    a = SFTLoader(arith / "train", seq_len=128, batch_size=4, seed=5)
    it = iter(a)
    for _ in range(a.batches_per_epoch - 2):
        next(it)
    state = json.loads(json.dumps(a.state_dict()))  # survives JSON (a checkpoint)
    rest = [next(it) for _ in range(5)]  # crosses into epoch 1
    b = SFTLoader(arith / "train", seq_len=128, batch_size=4, seed=5)
    b.load_state_dict(state)
    assert same(rest, batches(b, 5)) and (b.epoch, b.step) == (a.epoch, a.step)
    with pytest.raises(ValueError, match="seq_len=128, this loader has 96"):
        SFTLoader(arith / "train", seq_len=96, batch_size=4, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="packing=True, this loader has False"):
        SFTLoader(
            arith / "train", seq_len=128, batch_size=4, seed=5, packing=False
        ).load_state_dict(state)
    with pytest.raises(ValueError, match="expected integers >= 0"):
        b.load_state_dict({**state, "step": 10_000})


def test_long_samples_are_skipped_and_counted(arith):
    lengths = np.diff(np.load(arith / "train" / "offsets.npy"))  # an independent read of the file
    index = json.loads((arith / "train" / "index.json").read_text())
    assert index["longer_than"]["64"] == int((lengths > 64).sum())
    limit = int(np.median(lengths))
    with pytest.warns(UserWarning, match="longer than seq_len .* skipped, not truncated"):
        loader = SFTLoader(arith / "train", seq_len=limit, batch_size=2, packing=False)
    assert loader.skipped == int((lengths > limit).sum()) > 0
    assert all(lengths[w[0]] <= limit for w in loader.windows)
    with pytest.raises(ValueError, match="not one batch"), pytest.warns(UserWarning):
        SFTLoader(arith / "train", seq_len=limit, batch_size=1000, packing=False)


# --- files ----------------------------------------------------------------------------------------


def test_checksums_and_options(tmp_path):
    out = prepare_sft("sft-arith", tmp_path / "d", tokenizer="byte", max_samples=20)
    stamp = (out / "tokens.npy").stat().st_mtime_ns
    assert (
        prepare_sft("sft-arith", out, tokenizer="byte", max_samples=20) == out
    )  # same options: kept
    assert (out / "tokens.npy").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="other options .*max_samples: 20 there, 30 now"):
        prepare_sft("sft-arith", out, tokenizer="byte", max_samples=30)
    index = json.loads((out / "index.json").read_text())
    assert set(index["files"]) == {"tokens", "loss_mask", "offsets", "completion_start"}
    good = (out / "tokens.npy").read_bytes()
    raw = bytearray(good)
    raw[-1] ^= 1  # one flipped bit in the last token
    (out / "tokens.npy").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"tokens\.npy is corrupt: its sha256 differs"):
        SFTLoader(out, seq_len=64, batch_size=1)
    (out / "tokens.npy").write_bytes(good)
    assert len(open_sft(out)) == 20
    (out / "index.json").write_text(json.dumps({**index, "samples": 21}))
    with pytest.raises(ValueError, match="arrays do not fit together or with index.json"):
        open_sft(out)
    (out / "index.json").write_text(json.dumps(index)[:-9])
    with pytest.raises(ValueError, match="SFT index .* cannot be read"):
        open_sft(out)
    (out / "index.json").write_text(json.dumps(index))
    (out / "offsets.npy").unlink()
    with pytest.raises(ValueError, match=r"offsets\.npy is missing"):
        open_sft(out)
    assert not list(out.glob(".*tmp*"))  # no temporary file left


# --- the offline sets -----------------------------------------------------------------------------


def test_docstring_set_splits_share_no_function():
    train, val = sft_docstrings("train"), sft_docstrings("val")

    def name(row):
        return re.fullmatch(r"What does `(.+)` do\?", row["messages"][0]["content"]).group(1)

    names_train, names_val = {name(r) for r in train}, {name(r) for r in val}
    assert len(names_train) == len(train) and len(names_val) == len(val)
    assert not names_train & names_val
    assert 1000 <= len(train) <= 5000 and 100 <= len(val) <= 600 and len(val) < len(train) / 5
    items = docstring_items()
    found = [r for r in train + val if name(r) == "json.dumps"]
    assert found and found[0]["messages"][1]["content"] == items["json.dumps"]
    assert items["json.dumps"].startswith("Serialize ``obj`` to a JSON formatted ``str``")
    assert sft_docstrings("val", seed=1) != val and sorted(
        map(name, sft_docstrings("val", seed=1))
    ) == sorted(names_val)  # seed: order, never membership


def oracle(question):
    """The answer, derived here from the question's words."""
    words = question.rstrip("?").split()
    if words[:2] == ["What", "is"]:
        return str(int(words[2]) + int(words[4]))
    numbers = [int(w) for w in words[3:]]
    return " ".join(str(v) for v in (numbers[::-1] if words[0] == "Reverse" else sorted(numbers)))


def test_arith_set_is_checkable_and_its_splits_disjoint():
    train, val = sft_arith("train"), sft_arith("val")
    assert (len(train), len(val)) == (3000, 300)
    for row in train + val:
        q, a = (m["content"] for m in row["messages"])
        assert a == oracle(q)
    qs_train = {r["messages"][0]["content"] for r in train}
    qs_val = {r["messages"][0]["content"] for r in val}
    assert len(qs_train) == 3000 and not qs_train & qs_val
    other = {r["messages"][0]["content"] for r in sft_arith("train", seed=1)}
    assert other != qs_train and not other & qs_val  # any seed: still disjoint from val
    assert sft_arith("val", n=5) == val[:5]  # deterministic
    assert set(SFT_SOURCES) == {"sft-docstrings", "sft-arith"}
    with pytest.raises(
        ValueError, match="split 'test' is not valid for an offline SFT set; valid: train"
    ):
        sft_arith("test")


# --- evaluation -----------------------------------------------------------------------------------


def test_completion_loss_equals_samples_run_one_by_one(arith):
    torch.manual_seed(0)
    model = perturb_(
        ssmkit.build_model(ssmkit.ModelConfig(d_model=32, n_layer=2, vocab_size=257)), 1
    )
    got = completion_loss(model, arith / "val", batch_size=4, n=12)
    data = open_sft(arith / "val")
    total, count, per = 0.0, 0, []
    with torch.no_grad():
        for k in range(12):
            ids, mask = data.sample(k)
            logits = model(torch.from_numpy(ids)[None]).logits[0].double()
            logp = F.log_softmax(logits, -1)
            nll = [-logp[t, ids[t + 1]].item() for t in range(len(ids) - 1) if mask[t + 1]]
            per.append(sum(nll) / len(nll))
            total, count = total + sum(nll), count + len(nll)
    assert got["samples"] == 12 and got["tokens"] == count
    np.testing.assert_allclose(got["per_sample"], per, rtol=1e-5)
    assert got["loss"] == pytest.approx(total / count, rel=1e-5)
    assert completion_loss(model, arith / "val")["tokens"] == data.index["loss_tokens"]


@pytest.mark.parametrize("mixer", ["mamba1", "mamba2"])
def test_packed_batch_gives_the_one_by_one_losses(arith, mixer):
    """The loader's batches through the model's packed-sample API: each sample's logits and the
    batch loss equal those of the samples run alone (fp32, atol 1e-5)."""
    torch.manual_seed(0)
    cfg = ssmkit.ModelConfig(d_model=32, n_layer=2, vocab_size=257, mixer=mixer, headdim=16)
    model = perturb_(ssmkit.build_model(cfg), 2).eval()
    x, y, s = next(iter(SFTLoader(arith / "train", seq_len=160, batch_size=2, seed=1)))
    with torch.no_grad():
        packed = model(x, labels=y, shift_labels=False, seq_idx=s, loss_chunk_size=0)
        total, count = 0.0, 0
        for b in range(x.shape[0]):
            for k in range(int(s[b].max()) + 1):
                pos = (s[b] == k).nonzero()[:, 0]
                alone = model(x[b : b + 1, pos]).logits[0]
                torch.testing.assert_close(packed.logits[b, pos], alone, rtol=0, atol=1e-5)
                scored = y[b, pos] != -100
                total += F.cross_entropy(
                    alone[scored].double(), y[b, pos][scored], reduction="sum"
                ).item()
                count += int(scored.sum())
    assert int(s.max()) >= 2 and packed.loss.item() == pytest.approx(total / count, rel=1e-5)


class Oracle(torch.nn.Module):
    """A stand-in model that answers sft-arith questions: it reads the prompt's bytes (the byte
    tokenizer), finds the question, and emits ``answer(question)`` byte by byte, then ``tail``.
    Logits are one-hot."""

    def __init__(self, answer, tail=(EOS,)):
        super().__init__()
        self.answer, self.tail = answer, list(tail)
        self.config = type("Cfg", (), {"vocab_size": 257, "padded_vocab_size": 257})()

    def allocate_cache(self, batch_size, *a, **k):
        return type("Cache", (), {"rows": [[] for _ in range(batch_size)], "seqlen_offset": 0})()

    def forward(self, input_ids, cache=None, logits_to_keep=0, attention_mask=None, **kw):
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        out = torch.zeros(input_ids.shape[0], 1, 257)
        for b, (row, m) in enumerate(zip(input_ids.tolist(), mask.tolist(), strict=True)):
            cache.rows[b] += [t for t, keep in zip(row, m, strict=True) if keep]
            text = bytes(t for t in cache.rows[b] if t < 256).decode()
            prompt, _, sofar = text.partition("<|assistant|>\n")
            q = re.search(r"<\|user\|>\n(.*)\n$", prompt).group(1)
            want = list(self.answer(q).encode()) + self.tail
            done = len(cache.rows[b]) - len(prompt.encode()) - len("<|assistant|>\n")
            out[b, 0, want[done] if done < len(want) else EOS] = 1.0
        return type("Out", (), {"logits": out})()


def test_exact_match_against_oracle_models(arith):
    right = exact_match(Oracle(oracle), arith / "val", batch_size=8)
    assert right["accuracy"] == 1.0 and right["n"] == 40
    assert all(
        r["answer"] == oracle(re.search(r"\n(.*)\n<", r["prompt"]).group(1))
        for r in right["results"]
    )
    wrong = exact_match(Oracle(lambda q: oracle(q) + "0"), arith / "val", batch_size=8)
    assert wrong["accuracy"] == 0.0
    # an answer followed by a newline and more text, without EOS: the first line is the answer
    rambling = exact_match(Oracle(oracle, tail=list(b"\nblah blah")), arith / "val", n=10)
    assert rambling["accuracy"] == 1.0 and "\nblah" in rambling["results"][0]["generated"]
    half = exact_match(Oracle(lambda q: oracle(q) if "+" in q else "x"), arith / "val")
    share = sum("+" in r["prompt"] for r in half["results"]) / 40
    assert 0 < share < 1 and half["accuracy"] == pytest.approx(share)
    table = generation_table(
        {"oracle": Oracle(oracle), "wrong": Oracle(lambda q: "x")}, arith / "val", n=3
    )
    lines = table.splitlines()
    assert lines[0] == "| prompt | reference | oracle | wrong |" and len(lines) == 6
    assert (
        lines[-1] == "| exact match | | 3/3 | 0/3 |" and "<|user|>" not in table and "✓" in lines[2]
    )
