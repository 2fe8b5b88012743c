"""ssmkit models as lm-evaluation-harness's ``ssmkit`` model (the only ssmkit module importing
lm_eval).

    from ssmkit.eval.harness import SsmkitLM               # registers "ssmkit" with lm-eval
    lm = SsmkitLM(pretrained="runs/cpu-tiny/checkpoints/latest/model", tokenizer="gpt2",
                  batch_size=8)
    lm_eval.simple_evaluate(model=lm, tasks=[...])
    # or: lm_eval.simple_evaluate(model="ssmkit", model_args="pretrained=DIR", tasks=[...])

The three request kinds of lm-eval (Gao et al., "A framework for few-shot language model
evaluation"):

* ``loglikelihood(context, continuation)`` -> (log p(continuation | context), is_greedy): the sum
  over the continuation's tokens of log softmax(logits) at the position before each, and whether the
  argmax at every such position is that token. Context and continuation are tokenized as lm-eval's
  HFLM does (lm-eval's ``TemplateLM``: the whole string, then split at the context's length; an
  empty context is the EOS token).
* ``loglikelihood_rolling(text)`` -> log p(text | EOS), over windows of ``max_length`` tokens
  (``lm_eval.utils.get_rolling_token_windows``): each token scored once, with as much context as
  fits.
* ``generate_until(context, {until, max_gen_toks, ...})`` -> text: greedy (or sampled,
  ``do_sample``) continuation by :func:`ssmkit.generate`, cut at the first stop sequence or EOS.

Batching. Requests are sorted by length, longest first (lm-eval's ``Collator``, as HFLM), and scored
``batch_size`` at a time, RIGHT-padded with token 0 and without a mask: the models are causal, so a
position's logits depend only on the tokens up to it and padding after the real tokens never changes
them; only the real positions are read. Results are the same for any batch size (to float rounding).
Requests sharing ``context + continuation[:-1]`` are scored once (HFLM's one-token-continuation
cache). Generation batches LEFT-pad with an ``attention_mask``, which :func:`ssmkit.generate`
supports exactly.

Truncation (the rule of HFLM): a request whose context + continuation exceeds ``max_length + 1``
tokens keeps its last ``max_length + 1`` tokens (the model reads the last ``max_length``), so the
context is cut from the left and the continuation is always scored whole (it must fit in
``max_length``). Generation keeps the last ``max_length - max_gen_toks`` tokens of the context. A
state-space model has no length limit of its own; ``max_length`` (default 2048) bounds memory and
matches what the model was evaluated with.

Log-probabilities are computed in fp32 over every row of the LM head (the vocabulary padded to a
multiple, as training does), so ``-loglikelihood_rolling(text) / n_tokens`` is the validation loss
of those tokens.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from torch import nn
from tqdm import tqdm

from ..data import get_tokenizer
from ..data.tokenizers import TOKENIZER_FILES
from ..env import pick_device
from ..hub import from_pretrained, parse_dtype
from ..models import generate

DEFAULT_MAX_LENGTH = 2048
DEFAULT_MAX_GEN_TOKS = 256
FIRST_ROUND = 16  # generation runs in rounds of 16, 32, 64, ... new tokens until all rows stop


def _int(value, name: str, minimum: int = 1) -> int:
    """An int >= minimum from an int or a digit string (lm-eval's --model_args and --batch_size are
    text)."""
    try:
        number = int(value)
        ok = number >= minimum and float(value) == number
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return number


def resolve_tokenizer(tokenizer, model: nn.Module, source=None):
    """A tokenizer object: ``tokenizer`` itself, or ``get_tokenizer(tokenizer)`` for a name ("gpt2",
    "byte", "bpe-<N>", a hub id, a directory); None: the tokenizer files of the model's directory
    (``source`` or the ``name_or_path`` from_pretrained records). ValueError when there is none or
    it does not fit the model."""
    if tokenizer is None:
        from pathlib import Path

        where = source if source is not None else getattr(model, "name_or_path", None)
        folder = Path(where) if where is not None else None
        if (
            folder is not None
            and folder.is_dir()
            and any((folder / f).is_file() for f in TOKENIZER_FILES)
        ):
            tokenizer = str(folder)
        elif (
            where is not None
            and folder is not None
            and not folder.exists()
            and str(where).count("/") == 1
        ):
            tokenizer = str(where)  # a hub id: its tokenizer (or the hub's error)
        else:
            raise ValueError(
                f"no tokenizer: {'the model' if where is None else where} holds no tokenizer "
                "files; pass tokenizer= (gpt2, byte, bpe-<N>, a hub id or a directory), the "
                "tokenizer the model was trained with"
            )
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    vocab = model.config.vocab_size
    if len(tok) > vocab:
        raise ValueError(
            f"the tokenizer {getattr(tok, 'name_or_path', '') or tokenizer!r} has {len(tok):,} "
            f"tokens, more than the model's vocabulary of {vocab:,}: it is not the tokenizer "
            "this model was trained with"
        )
    if tok.eos_token_id is None and tok.bos_token_id is None:
        raise ValueError(
            "the tokenizer has neither an end-of-text nor a beginning-of-text token; lm-eval "
            "conditions an empty context on one of them"
        )
    return tok


@register_model("ssmkit")
class SsmkitLM(TemplateLM):
    """An ssmkit model for lm-eval. ``pretrained``: what :func:`ssmkit.from_pretrained` reads (a
    model directory in transformers or mamba_ssm layout, a hub id) or a model (``nn.Module``: an
    ssmkit ``MambaLM``, or anything whose ``model(input_ids)`` gives ``.logits`` and that has
    ``config.vocab_size``).

    tokenizer: a name for :func:`ssmkit.data.get_tokenizer` or a tokenizer (default: the model
    directory's). batch_size: requests per forward pass. max_length: tokens the model reads at most
    (see the module docstring for truncation). device: "cpu" (default), "cuda", "cuda:N", "mps" or
    "auto"; a loaded model is moved there (an ``nn.Module`` in place, as ``.to`` does). dtype: for a
    path, the dtype to load in (default fp32); for a module, None keeps its dtype. seed: of sampled
    generation (``do_sample``).
    """

    backend = "causal"

    def __init__(
        self,
        pretrained,
        tokenizer=None,
        batch_size=8,
        max_length: int = DEFAULT_MAX_LENGTH,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        device: str | None = "cpu",
        dtype=None,
        seed: int = 0,
        max_batch_size=None,
    ):
        super().__init__()
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            raise ValueError(
                "batch_size 'auto' is not supported by the ssmkit model; give a number"
            )
        self._batch_size = _int(batch_size, "batch_size")
        self._max_length = _int(max_length, "max_length", minimum=2)
        self._max_gen_toks = _int(max_gen_toks, "max_gen_toks")
        self.seed = _int(seed, "seed", minimum=0)
        source = None
        if isinstance(pretrained, nn.Module):
            model = pretrained
            if device is not None or dtype is not None:
                model.to(
                    device=pick_device(str(device)) if device is not None else None,
                    dtype=parse_dtype(dtype),
                )
        else:
            source = str(pretrained)
            model = from_pretrained(source, dtype=dtype or "float32", device=device)
        self._model = model
        self.tokenizer = resolve_tokenizer(tokenizer, model, source)
        self._prefix_text = self.tokenizer.decode([self.prefix_token_id])
        param = next(model.parameters(), None)
        self._device = param.device if param is not None else torch.device("cpu")
        self.name = source or getattr(model, "name_or_path", None) or type(model).__name__

    # --- what lm-eval reads -----------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        return self._model

    @property
    def eot_token_id(self) -> int:
        tok = self.tokenizer
        return tok.eos_token_id if tok.eos_token_id is not None else tok.bos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context (and a rolling window's start) is conditioned on: BOS, else
        EOS."""
        tok = self.tokenizer
        return tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "")).replace("/", "__")

    def get_model_info(self) -> dict:
        params = {id(p): p for p in self._model.parameters()}
        first = next(iter(params.values()), None)
        return {
            "model_num_parameters": sum(p.numel() for p in params.values()),
            "model_dtype": str(first.dtype) if first is not None else None,
            "model_name": self.name,
            "max_length": self.max_length,
        }

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kwargs
    ) -> list[int]:
        """Token ids of ``string``, as HFLM encodes it (the tokenizer's special tokens unless told,
        none added when the string already starts with the prefix token); the last
        ``left_truncate_len`` only."""
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and string.startswith(self._prefix_text):
            special = {"add_special_tokens": False}
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    @contextlib.contextmanager
    def _eval_mode(self):
        """Eval mode and no autograd while scoring; the model's mode is restored after."""
        training = self._model.training
        self._model.eval()
        try:
            with torch.inference_mode():
                yield
        finally:
            self._model.train(training)

    # --- scoring ----------------------------------------------------------------------------------

    def _logits(self, batch: torch.Tensor, keep: int) -> torch.Tensor:
        """Logits (batch, keep, vocab) of the last ``keep`` positions of ``batch`` (batch,
        seqlen)."""
        try:
            out = self._model(batch, logits_to_keep=0 if keep >= batch.shape[1] else keep)
        except TypeError:  # a model without logits_to_keep
            out = self._model(batch)
        logits = out.logits if hasattr(out, "logits") else out
        return logits[:, -keep:]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple]:
        """requests: ``((context, continuation) or None, context ids, continuation ids)`` each;
        returns ``(sum of the continuation's log-probabilities, whether greedy decoding gives it)``
        in order."""
        results = []
        reorder = Collator(
            requests,
            sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])),
            group_by="contexts",
            group_fn=lambda r: r[1] + r[2][:-1],
        )
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="ssmkit loglikelihood")
        with self._eval_mode():
            for chunk in reorder.get_batched(n=self.batch_size):
                inputs, spans = [], []
                for _, context, continuation in chunk:
                    if not context or not continuation or len(continuation) > self.max_length:
                        raise ValueError(
                            f"a request needs a context and a continuation of 1.."
                            f"{self.max_length} tokens; got {len(context)}, {len(continuation)}"
                        )
                    ids = (context + continuation)[-(self.max_length + 1) :][:-1]
                    inputs.append(ids)
                    spans.append((len(ids) - len(continuation), len(ids)))  # positions scored
                width = max(len(ids) for ids in inputs)
                batch = torch.zeros(len(inputs), width, dtype=torch.long)
                for i, ids in enumerate(inputs):
                    batch[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                first = min(start for start, _ in spans)
                logits = self._logits(batch.to(self.device), width - first)
                for i, ((request, context, continuation), (start, end)) in enumerate(
                    zip(chunk, spans)
                ):
                    logprobs = F.log_softmax(
                        logits[i, start - first : end - first].float(), dim=-1
                    )[None]
                    for request, cont, lp in reorder.get_cache(
                        req_str=request, cxt_toks=context, cont_toks=continuation, logits=logprobs
                    ):
                        lp = lp[:, -len(cont) :]  # (1, len(cont), vocab)
                        target = torch.tensor(cont, dtype=torch.long, device=lp.device)[None]
                        greedy = bool((lp.argmax(dim=-1) == target).all())
                        answer = (float(lp.gather(2, target[..., None]).sum()), greedy)
                        results.append(answer)
                        if request is not None:
                            self.cache_hook.add_partial("loglikelihood", request, answer)
                        bar.update(1)
        bar.close()
        return reorder.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log p(text) of each request's text, conditioned on the prefix token, over disjoint
        windows of at most ``max_length`` scored tokens (each with the longest context that
        fits)."""
        windows, owners = [], []
        for i, (text,) in enumerate(r.args for r in requests):
            for context, target in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, target))
                owners.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, scores):
            totals[i] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # --- generation -------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The continuation of each request's context, stopped at its ``until`` strings (cut there)
        or the EOS token, at most ``max_gen_toks`` tokens (lm-eval's generation kwargs; greedy
        unless do_sample)."""
        results = []
        reorder = Collator(
            [r.args for r in requests],
            sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
            group_by="gen_kwargs",
            group_fn=lambda a: a[1],
        )
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="ssmkit generate_until")
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        with self._eval_mode():
            for chunk in reorder.get_batched(n=self.batch_size):
                contexts, all_kwargs = zip(*chunk)
                kwargs = normalize_gen_kwargs(dict(all_kwargs[0]), self.max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                texts = self._generate(list(contexts), until, kwargs)
                for context, text in zip(contexts, texts):
                    results.append(text)
                    self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), text)
                    bar.update(1)
        bar.close()
        return reorder.get_original(results)

    def _generate(self, contexts: list[str], until: list[str], kwargs: dict) -> list[str]:
        """One batch: left-padded prompts continued by ssmkit.generate in rounds until every row has
        hit a stop string or EOS or ``max_gen_toks`` tokens; each text cut at its first stop
        string."""
        max_new = _int(kwargs.get("max_gen_toks"), "max_gen_toks")
        if max_new >= self.max_length:
            raise ValueError(
                f"max_gen_toks {max_new} must be less than max_length {self.max_length}"
            )
        sample = bool(kwargs.get("do_sample"))
        temperature = float(kwargs.get("temperature") or 1.0) if sample else 0.0
        top_k, top_p = (kwargs.get("top_k"), kwargs.get("top_p")) if sample else (None, None)
        prompts = [
            self.tok_encode(c, left_truncate_len=self.max_length - max_new)
            or [self.prefix_token_id]
            for c in contexts
        ]
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        eos = self.tokenizer.eos_token_id
        eos = eos if eos is not None and eos < self._model.config.vocab_size else None
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        done, produced, step = [False] * len(prompts), 0, FIRST_ROUND
        while produced < max_new and not all(done):
            n = min(step, max_new - produced)
            out = generate(
                self._model,
                ids,
                max_new_tokens=n,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                eos_token_id=eos,
                attention_mask=mask,
                generator=generator,
            )
            added = out.shape[1] - ids.shape[1]
            ids, mask = out, torch.cat([mask, mask.new_ones(mask.shape[0], added)], dim=1)
            produced, step = produced + added, step * 2
            for i in range(len(prompts)):
                new = ids[i, width:].tolist()
                done[i] = (eos is not None and eos in new) or any(
                    s and s in self.tok_decode(new) for s in until
                )
        texts = []
        for i in range(len(prompts)):
            new = ids[i, width:].tolist()
            if eos is not None and eos in new:
                new = new[: new.index(eos)]
            texts.append(postprocess_generated_text(self.tok_decode(new), until, None))
        return texts
