"""How compare-rule-configs.json was made, with the ssmkit of before ModelConfig's mixer groups:

    cd <that checkout> && PYTHONPATH=$PWD python tests/data/compare-rule-configs.py OUT.json

Notebook 01's mixer comparison rule of then (workbook/compare.py: ``_RESET`` and ``mixer_fields``
over the run's flat ``model_overrides``) applied to each CPU preset and CPU run config, for each SSM
mixer: the model's flat config, its parameter count and its initialisation under seed 0 (sum and
sum of squares of every parameter, in float64). tests/unit/models/test_config.py checks that
``ModelConfig.with_mixer`` gives the same models.
"""

import json
import sys

import torch
import yaml

import ssmkit
from ssmkit.models import ModelConfig
from ssmkit.workbook.compare import _RESET, MIXERS, mixer_fields

VOCAB = 50257  # GPT-2's, the CPU run configs' tokenizer
sources = {p: (p, {}) for p in ("tiny", "tiny-mamba2", "tiny-mamba3", "tiny-hybrid")}
for name in ("cpu-tiny", "cpu-tiny-mamba2", "cpu-tiny-mamba3", "cpu-tiny-hybrid"):
    run = yaml.safe_load(open(f"configs/{name}.yaml"))
    sources[name] = (run["model"], run.get("model_overrides") or {})
out = {}
for name, (preset, over) in sources.items():
    d_inner = ModelConfig.preset(preset, vocab_size=VOCAB, **over).d_inner
    for mixer in MIXERS:
        cfg = ModelConfig.preset(
            preset, vocab_size=VOCAB, **{**over, **_RESET, **mixer_fields(mixer, d_inner)}
        )
        torch.manual_seed(0)
        model = ssmkit.build_model(cfg)
        flat = torch.cat([p.detach().double().flatten() for p in model.parameters()])
        out[f"{name}/{mixer}"] = dict(
            source=[preset, over],
            config=cfg.to_dict(),
            params=model.num_parameters(),
            sum=float(flat.sum()),
            sum_sq=float((flat**2).sum()),
        )
text = json.dumps(out, separators=(",", ":")).replace('},"', '},\n"')
open(sys.argv[1], "w").write(text + "\n")
