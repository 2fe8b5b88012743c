"""Chapter 04, fine-tuning: what notebooks/04_lora_finetune.ipynb calls (path B of the plan: start
from a pretrained model).

    p = PARAMETERS.check(globals())
    base, history = base_checkpoint(p)                      # p["base"], or a short pretraining here
    plan_snippet_on_transformers(base, out_dir)             # the plan's LoraConfig on transformers
    cfgs = {"LoRA": finetune_config(p, base, "lora"), "full": finetune_config(p, base, "full")}
    rows, models = compare_finetuning(base, cfgs, val_dir)  # held-out loss, exact match, tok/s, MB
    export_to_transformers(models["LoRA"], out_dir)  # merge, save as transformers, reload, compare

LoRA (Hu et al. 2021) freezes each target weight W (out, in) and trains a low-rank update,

    y = x W^T + (alpha / r) · dropout(x) A^T B^T,   A (r, in) random,  B (out, r) = 0 at the start,

so the model starts as the pretrained one and only r (in + out) numbers per target train. Full
fine-tuning trains every weight with the same data and steps. Both runs use
:class:`ssmkit.train.Trainer` with ``base:`` (and ``lora:``) in the run config; the SFT data are
packed with ``seq_idx`` so the scan restarts at each sample (:mod:`ssmkit.data.sft`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

from ... import checks
from ...eval import summarize_run
from ..cells import pick_device, train_config
from ..notebooks import WorkbookError
from ..params import (
    ALLOW_CPU,
    DEVICE,
    Param,
    Parameters,
    check_data,
    check_out_dir,
    check_overrides,
    check_run_config,
    check_tokenizer,
)
from ..progress import step_line

__all__ = [
    "PARAMETERS",
    "PLAN_LORA",
    "base_checkpoint",
    "compare_finetuning",
    "export_to_transformers",
    "finetune_config",
    "plan_snippet_on_transformers",
    "sft_split",
    "state_mb",
    "step_memory",
]

# the plan's snippet: LoraConfig(r=16, lora_alpha=32, target_modules=[...], lora_dropout=0.05)
PLAN_LORA = {
    "r": 16,
    "alpha": 32,
    "dropout": 0.05,
    "target_modules": ["x_proj", "in_proj", "out_proj"],
}
FULL_LR_SHARE = (
    0.1  # full fine-tuning's peak lr as a share of LoRA's (LoRA's updates start at zero)
)


def base_checkpoint(p: dict) -> tuple[str, list[dict] | None]:
    """The pretrained model to fine-tune, as something :func:`ssmkit.from_pretrained` reads:
    ``p["base"]`` (a hub id as given; a run's out_dir or checkpoint: its model directory), or, when
    it is empty, a short pretraining of ``p["config"]`` on ``p["data"]`` for ``p["max_tokens"]``
    tokens into ``out_dir/pretrain`` (its final model directory, and the run's history)."""
    from ...train import Trainer
    from ...train.resolve import resolve

    if p["base"]:
        return resolve(p["base"]).model_source(), None
    cfg = train_config(
        p["config"],
        data=p["data"],
        tokenizer=p["tokenizer"],
        max_tokens=p["max_tokens"],
        device=p["device"],
        seed=p["seed"],
        evals=2,
        out_dir=str(p["out_dir"] / "pretrain"),
        overwrite=True,
        **_recipe(p["overrides"]),
    )
    history = Trainer(config=cfg, name="pretrain").fit()
    return resolve(cfg.out_dir).model_source(), history


def _recipe(overrides: dict) -> dict:
    """The overrides that describe how to train (micro_batch, eval_batches, precision, ...), not
    what."""
    return {
        k: v for k, v in overrides.items() if k not in ("base", "lora", "data", "val_data", "model")
    }


def finetune_config(p: dict, base: str, method: str, **extra):
    """The run config of one fine-tuning run on ``base``: ``method`` "lora" (p's lora_r, lora_alpha,
    lora_dropout, lora_targets: "plan" = the plan's x_proj, in_proj, out_proj that the model has) or
    "full"; SFT data ``p["sft_data"]`` packed into 128-token windows,
    ``p["sft_steps"]`` steps of 8 windows, warmup 10% then cosine; peak lr 3e-3 for LoRA and
    :data:`FULL_LR_SHARE` of it for full fine-tuning. ``p["overrides"]`` and ``extra`` replace any
    of it."""
    from ...train import TrainConfig

    if method not in ("lora", "full"):
        raise WorkbookError(f"method must be 'lora' or 'full'; got {method!r}")
    targets = None if p["lora_targets"] == "plan" else list(p["lora_targets"])
    lora = (
        {
            "r": p["lora_r"],
            "alpha": p["lora_alpha"],
            "dropout": p["lora_dropout"],
            "target_modules": targets,
        }
        if method == "lora"
        else None
    )
    steps = p["sft_steps"]
    values = dict(
        base=base,
        lora=lora,
        data=p["sft_data"],
        tokenizer=p["tokenizer"],
        seq_len=128,
        micro_batch=8,
        batch_tokens=8 * 128,
        lr=3e-3 if lora else 3e-3 * FULL_LR_SHARE,
        min_lr=1e-5,
        warmup_steps=max(1, steps // 10),
        max_steps=steps,
        weight_decay=0.0,
        eval_every=max(1, steps // 2),
        device=p["device"],
        seed=p["seed"],
        out_dir=str(p["out_dir"] / method),
        overwrite=True,
    )
    values.update(_recipe(p["overrides"]))
    values.update(extra)
    try:
        return TrainConfig.from_dict(values)
    except ValueError as exc:
        raise WorkbookError(str(exc)) from None


def sft_split(p: dict, split: str = "val") -> Path:
    """``p["sft_data"]``'s ``split`` tokenized into ``out_dir/sft-<split>`` (the held-out "val" by
    default), the directory the evaluations read."""
    from ...data import prepare_sft

    source = p["sft_data"][len("sft:") :] if p["sft_data"].startswith("sft:") else p["sft_data"]
    return prepare_sft(source, p["out_dir"] / f"sft-{split}", tokenizer=p["tokenizer"], split=split)


def plan_snippet_on_transformers(base: str, out_dir: str | Path) -> list[dict]:
    """The plan's ``peft.get_peft_model(model, LoraConfig(...))`` on transformers' model of the same
    weights (``base`` written in transformers' format into ``out_dir/base-hf``), with the plan's
    targets and without ``out_proj``. One row per attempt: the targets, and what peft said. A model
    transformers has no class for (Mamba-3, hybrids with attention or MLPs) gives one row saying
    so."""
    import peft
    from transformers import AutoModelForCausalLM

    from ...hub import from_pretrained, save_pretrained
    from ...hub.save import natural_format

    model = from_pretrained(base)
    if natural_format(model.config) not in ("hf", "jamba", "zamba2"):
        return [
            {
                "model": f"(mixers {', '.join(sorted(set(model.config.mixers)))})",
                "target_modules": "-",
                "result": "transformers has no class for this model "
                "(it is saved in mamba_ssm's layout): the plan's snippet has nothing to run on",
            }
        ]
    hf_dir = save_pretrained(
        model, Path(out_dir) / "base-hf", format=natural_format(model.config), overwrite=True
    )
    rows = []
    for targets in (PLAN_LORA["target_modules"], ["x_proj", "in_proj"]):
        hf = AutoModelForCausalLM.from_pretrained(hf_dir)
        config = peft.LoraConfig(
            r=PLAN_LORA["r"],
            lora_alpha=PLAN_LORA["alpha"],
            target_modules=targets,
            lora_dropout=PLAN_LORA["dropout"],
        )
        try:
            with warnings.catch_warnings():
                # peft reads hf.is_gradient_checkpointing, an alias transformers 5 deprecates with
                # a FutureWarning: not the learner's to fix, and a pink box in notebook 04
                warnings.filterwarnings(
                    "ignore",
                    message="`is_gradient_checkpointing` is deprecated",
                    category=FutureWarning,
                )
                model = peft.get_peft_model(hf, config)
            trainable = sum(t.numel() for t in model.parameters() if t.requires_grad)
            rows.append(
                {
                    "model": type(hf).__name__,
                    "target_modules": ", ".join(targets),
                    "result": f"ok: {trainable:,} trainable parameters",
                }
            )
        except ValueError as exc:
            rows.append(
                {
                    "model": type(hf).__name__,
                    "target_modules": ", ".join(targets),
                    "result": f"ValueError: {str(exc).splitlines()[0]}",
                }
            )
    return rows


def step_memory(model, batch, device="cpu") -> float:
    """Extra peak MiB of two AdamW training steps of ``model`` on ``batch`` = (input_ids, labels,
    seq_idx) (the second step holds the optimizer's states, as every later one does), measured after
    one unmeasured forward + backward (the allocator's and the thread pools' first-call costs):
    activations, gradients and optimizer states together. The steps run at learning rate 0, so the
    weights do not change and no copy of the model is needed (at 2.8B parameters a copy would not
    fit beside the others)."""
    import torch

    from ...eval.long_context import measure_call

    was_training = model.training
    model.train()
    params = [t for t in model.parameters() if t.requires_grad]
    x, y, seq_idx = (t.to(device) for t in batch)

    def loss():
        return model(x, labels=y, shift_labels=False, seq_idx=seq_idx).loss

    loss().backward()
    model.zero_grad(set_to_none=True)

    def two_steps():
        opt = torch.optim.AdamW(params, lr=0.0)  # lr 0: AdamW's update and decay leave W as it is
        for _ in range(2):
            loss().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    try:
        _, _, extra_mb = measure_call(two_steps, device)
    finally:
        model.train(was_training)
    return extra_mb


def state_mb(model) -> float:
    """MiB of what training adds per trainable parameter, counted: its gradient and AdamW's two
    moments, each in the parameter's dtype (fp32: 12 bytes per trainable parameter)."""
    params = {id(t): t for t in model.parameters() if t.requires_grad}.values()
    return 3 * sum(t.numel() * t.element_size() for t in params) / 2**20


def compare_finetuning(
    base: str, configs: dict, val_dir, exact_n: int = 64
) -> tuple[list[dict], dict]:
    """Train each run config (name -> TrainConfig on ``base``) and measure every model the same way,
    the base model first: trainable parameters and their share, the held-out completion loss on
    ``val_dir`` (:func:`ssmkit.eval.completion_loss`), exact match of greedy answers on its first
    ``exact_n`` samples (:func:`ssmkit.eval.exact_match`), the median training tokens/s, the
    training state counted (:func:`state_mb`: gradients + AdamW moments) and the measured extra peak
    MiB of training steps (:func:`step_memory`, activations included). Returns (rows, {"base":
    model, name: trained model, ...})."""
    from ...data import SFTLoader
    from ...eval import completion_loss, exact_match
    from ...finetune import parameter_counts
    from ...hub import from_pretrained
    from ...train import Trainer

    models = {"base": from_pretrained(base)}
    histories = {"base": None}
    steps = len(configs) * 2 + 1  # each run trains, then every model (the base too) is measured
    for i, (name, cfg) in enumerate(configs.items(), 1):
        step_line(i, steps, f"fine-tuning {name}: {cfg.total_steps()} steps")
        trainer = Trainer(config=cfg, name=name)
        histories[name] = trainer.fit()
        models[name] = trainer.model
    device = next(iter(configs.values())).device if configs else "cpu"
    batch = next(iter(SFTLoader(val_dir, seq_len=128, batch_size=8, seed=0)))
    rows = []
    for i, (name, model) in enumerate(models.items(), len(configs) + 1):
        step_line(i, steps, f"measuring {name}: held-out loss, {exact_n} greedy answers")
        counts = parameter_counts(model)
        row = {
            "model": name,
            "trainable": counts["trainable"] if histories[name] else 0,
            "share": round(counts["share"], 4) if histories[name] else 0.0,
            "val_loss": round(completion_loss(model, val_dir)["loss"], 4),
            "exact_match": round(exact_match(model, val_dir, n=exact_n)["accuracy"], 4),
        }
        if histories[name]:
            row["train_tok_s"] = summarize_run(histories[name])["train_tok_s"]
            row["state_mb"] = round(state_mb(model), 3)
            row["step_peak_mb"] = round(step_memory(model, batch, device=pick_device(device)), 1)
        rows.append(row)
    return rows, models


def export_to_transformers(model, out_dir: str | Path, input_ids=None) -> dict:
    """Merge a LoRA model's adapter into its weights (``merge_and_unload``), write the merged model
    in transformers' format to ``out_dir/merged-hf``, load it with ``AutoModelForCausalLM`` and
    compare its logits with the ssmkit model's on ``input_ids`` (default: 2 x 32 fixed ids). A model
    transformers has no class for (Mamba-3, hybrids) is written in its own format (mamba_ssm's
    layout) to ``out_dir/merged`` and reloaded with :func:`ssmkit.from_pretrained` instead. Also
    tries the adapter itself for transformers (:func:`ssmkit.finetune.adapter_for_transformers`) and
    reports what it said. The model is merged in place: afterwards it is the plain ssmkit model."""
    import torch

    from ...finetune import adapter_for_transformers, export_merged, merge, save_adapter
    from ...hub import from_pretrained
    from ...hub.save import natural_format

    out_dir = Path(out_dir)
    adapter = save_adapter(model, out_dir / "adapter")
    config = model.get_base_model().config
    try:
        adapter_for_transformers(adapter, out_dir / "adapter-hf", config)
        adapter_note = (
            "written for transformers: peft.PeftModel.from_pretrained(hf_model, adapter-hf)"
        )
    except ValueError as exc:
        adapter_note = str(exc)
    fmt = natural_format(config)
    path = export_merged(
        model, out_dir / ("merged-hf" if fmt != "mamba_ssm" else "merged"), format=fmt
    )
    merged = merge(model).eval()
    if fmt == "mamba_ssm":
        reloaded, name = (
            from_pretrained(path).eval(),
            "ssmkit (mamba_ssm layout; transformers has no class)",
        )
    else:
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
        name = type(reloaded).__name__
    if input_ids is None:
        input_ids = torch.arange(64).reshape(2, 32) * 37 % config.vocab_size
    with torch.no_grad():
        ours = merged(input_ids.to(next(merged.parameters()).device)).logits.float().cpu()
        theirs = reloaded(input_ids).logits.float()
    adapter_mb = sum(f.stat().st_size for f in Path(adapter).iterdir()) / 2**20
    return {
        "path": str(path),
        "hf_class": name,
        "max_abs_logit_diff": float((ours - theirs).abs().max()),
        "adapter_mb": round(adapter_mb, 3),
        "adapter_for_transformers": adapter_note,
    }


# --- the notebook's parameters --------------------------------------------------------------------


def check_base(value, name: str = "base"):
    if value == "" or (isinstance(value, str) and value.strip()):
        return value
    raise WorkbookError(
        f"base must be '' (pretrain here) or a checkpoint directory / run out_dir / hub id; "
        f"got {value!r}"
    )


def check_sft_data(value, name: str = "sft_data"):
    from ...data import SFT_SOURCES

    if isinstance(value, str) and (
        value in SFT_SOURCES
        or (value.startswith("sft:") and Path(value[4:]).expanduser().is_file())
    ):
        return value
    raise WorkbookError(
        f"sft_data={value!r} is not valid; valid: {', '.join(map(repr, SFT_SOURCES))}, or "
        "'sft:PATH.jsonl' naming an existing file in trl's prompt/completion or messages "
        "format"
    )


def check_lora_targets(value, name: str = "lora_targets"):
    if value == "plan":
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return list(value)
    raise WorkbookError(
        f"lora_targets must be 'plan' (the plan's {PLAN_LORA['target_modules']} that the "
        "model has) or a non-empty list of module names, e.g. ['in_proj', 'out_proj']; "
        f"got {value!r}"
    )


# fmt: off
PARAMETERS = Parameters(
    Param("base",         "",            check_base,
          'pretrained model: a checkpoint directory, a run\'s out_dir or a hub id; "" = pretrain '
          '`config` here (offline); GPU: "state-spaces/mamba-130m-hf"'),
    Param("config",       "cpu-tiny",    check_run_config,
          'the model pretrained here when base is "" (configs/<config>.yaml)'),
    Param("data",         "stdlib-docs", check_data,
          "its pretraining text: the embedded corpus (offline)"),
    Param("tokenizer",    "gpt2",        check_tokenizer,
          "the base's tokenizer (GPT-2 BPE; the mamba-*-hf models: their hub id)"),
    Param("max_tokens",   131_072,       checks.integer,
          'pretraining tokens when base is "" (the plan\'s path B needs none)',
          minimum=1, whole_floats=True),
    Param("sft_data",     "sft-arith",   check_sft_data,
          'SFT data: "sft-arith" (checkable), "sft-docstrings", "sft:PATH.jsonl"'),
    Param("sft_steps",    80,            checks.integer,
          "optimizer steps of each fine-tuning run (8 packed windows of 128 tokens)",
          minimum=1, whole_floats=True),
    Param("lora_r",       16,            checks.integer,
          "the plan's LoraConfig: rank r ...", minimum=1, whole_floats=True),
    Param("lora_alpha",   32,            checks.number,
          "... lora_alpha (the update is scaled by alpha / r) ...", low=0, low_open=True),
    Param("lora_dropout", 0.05,          checks.number,
          "... lora_dropout on the adapter's input ...", low=0, high=1, high_open=True),
    Param("lora_targets", "plan",        check_lora_targets,
          '... and target_modules: "plan" (x_proj, in_proj, out_proj, those the model has; '
          'Mamba-2/3 have no x_proj), or a list, e.g. ["in_proj"]'),
    DEVICE,
    ALLOW_CPU,
    Param("overrides",    {},            check_overrides,
          'more TrainConfig keys for every run, e.g. {"micro_batch": 4}'),
    Param("out_dir",      "../runs/lab/04_lora_finetune", check_out_dir,
          "checkpoints, adapter, exports, metrics.json (from notebooks/)"),
    Param("seed",         0,             checks.integer,
          "initialisation, LoRA's A, data order", minimum=0, whole_floats=True),
)
# fmt: on
