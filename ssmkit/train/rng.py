"""Every RNG state of a process (python, numpy, torch, cuda) as plain JSON values, and back: what a
checkpoint keeps per rank (``rng/rank_N.json``) so a resumed run draws the same numbers (dropout
masks, shuffles) as an uninterrupted one. JSON, never pickle: nothing read back can run code."""

from __future__ import annotations

import base64
import random

import numpy as np
import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def rng_state() -> dict:
    """Every RNG state of this process as plain JSON values."""
    version, keys, gauss = random.getstate()
    name, mt, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(keys), gauss],
        "numpy": [name, mt.tolist(), pos, has_gauss, cached],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict):
    """Restore :func:`rng_state`'s output; a malformed state raises ValueError before anything is
    set."""
    try:
        version, keys, gauss = state["python"]
        name, mt, pos, has_gauss, cached = state["numpy"]
        python = (
            int(version),
            tuple(int(k) for k in keys),
            None if gauss is None else float(gauss),
        )
        numpy = (
            str(name),
            np.asarray(mt, dtype=np.uint32),
            int(pos),
            int(has_gauss),
            float(cached),
        )
        cpu = _bytes_tensor(state["torch"])
        cuda = [_bytes_tensor(s) for s in state.get("cuda", [])]
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(cpu)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"malformed RNG state ({type(exc).__name__}: {exc})") from None
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
