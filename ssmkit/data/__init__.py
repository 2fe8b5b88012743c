"""Data: tokenizers (so far); sources, packing into token shards and the resumable loader follow."""

from .tokenizers import EOS, get_tokenizer

__all__ = ["EOS", "get_tokenizer"]
