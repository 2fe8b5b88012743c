"""Data: tokenizers, text sources, synthetic tasks, packing into token shards, and the resumable
loader.

    tok = ssmkit.data.get_tokenizer("gpt2")
    ssmkit.data.prepare("stdlib-docs", "gpt2", "data/stdlib-gpt2")
    loader = ssmkit.data.TokenLoader("data/stdlib-gpt2", seq_len=256, batch_size=8)
    for input_ids, labels in loader:  # already shifted: model(x, labels=y, shift_labels=False)
        ...
    ssmkit.data.write_mds("data/stdlib-gpt2", "data/stdlib-gpt2/mds", seq_len=256)  # MosaicML copy
    ssmkit.data.source_fingerprint("corpus/")  # changes with a local corpus; None: remote
    ssmkit.data.prepare_sft("sft-arith", "data/arith-train")  # SFT: trl's formats or an offline set
    sft = ssmkit.data.SFTLoader("data/arith-train", seq_len=256, batch_size=8)
    for input_ids, labels, seq_idx in sft:  # packed samples
        ...  # model(x, labels=y, shift_labels=False, seq_idx=s)
"""

from .loader import TokenLoader
from .mds import read_mds, write_mds
from .pipeline import prepare
from .sft import SFT_SOURCES, SFTLoader, open_sft, prepare_sft
from .sources import REMOTE, Document, load_source, source_fingerprint, stdlib_docs
from .synthetic import TASKS, SyntheticBatch, accuracy, check, make_task
from .tokenizers import EOS, get_tokenizer, vocab_size

__all__ = [
    "Document",
    "EOS",
    "REMOTE",
    "SFTLoader",
    "SFT_SOURCES",
    "SyntheticBatch",
    "TASKS",
    "TokenLoader",
    "accuracy",
    "check",
    "get_tokenizer",
    "load_source",
    "make_task",
    "open_sft",
    "prepare",
    "prepare_sft",
    "read_mds",
    "source_fingerprint",
    "stdlib_docs",
    "vocab_size",
    "write_mds",
]
