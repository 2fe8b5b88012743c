r"""Sliders for the ideas a learner would rather move than edit: what is drawn, and how it is shown.

    from ssmkit.workbook import widgets
    ui = widgets.explore(widgets.draw_ssm_memory, log10_dt=(-3.0, 0.0, 0.1), re_a=(-2.0, -0.1, 0.1))

Each picture has a pure function that computes it (tested against a closed form or the library's own
op) and a ``draw_*`` function that returns a ``matplotlib.figure.Figure`` (Agg, no pyplot):

* :func:`ssm_memory` / :func:`draw_ssm_memory` -- S4's step: Ā = exp(ΔA), the memory |Ā|^k =
  exp(kΔ Re A) and its half-life ln 2 / (Δ |Re A|) steps (papers/01_s4);
* :func:`selective_state` / :func:`draw_selective_state` -- a one-channel S6 (Mamba's selective
  scan, :func:`ssmkit.ops.selective_scan_reference`): the state h_t and output y_t as Δ, a Δ gate
  on one token, and the scales of B and C change (papers/03_mamba);
* :func:`ssd_mask` / :func:`draw_ssd_mask` -- Mamba-2's 1-semiseparable mask L = exp(segsum(log
  a)) (:func:`ssmkit.ops.segsum`) cut into chunks: full diagonal blocks, rank-1 blocks below them
  (papers/04_mamba2);
* :func:`hybrid_stack` / :func:`draw_hybrid_stack` -- a Jamba-style stack
  (:func:`~ssmkit.workbook.chapters.ch03_hybrid.hybrid_config`): which layers attend, their share
  of the parameters and of the inference cache at a context length (notebooks/03_hybrid).

:func:`explore` shows a ``draw_*`` function with sliders, or a static figure where sliders cannot
move. Glossary: Δ = ``dt`` / ``delta``, A, B, C the SSM's matrices (A < 0 real, or Re A < 0), N =
``d_state``, a_t = exp(Δ_t A) Mamba-2's scalar decay, Q = ``chunk`` the SSD chunk length.

**Live or static.** Sliders need a Jupyter *frontend* to move them. A kernel run by papermill (or
nbclient) has none, yet ipywidgets would still emit widget JSON there, which a saved notebook shows
as a dead "Loading widget..." line. So :func:`widget_mode` answers "static" when any of these holds,
checked in this order, and "live" otherwise:

1. ``$SSMKIT_WIDGETS`` is "static" (or "live", which forces sliders); unset or "auto": go on;
2. not in a Jupyter kernel (a terminal, plain Python, pytest);
3. ipywidgets is not installed;
4. the cell being run came from a client that cannot answer ``input()``: every execute request
   says whether it may (``allow_stdin``); JupyterLab, Notebook and VS Code send True, nbclient --
   under papermill, nbconvert and ``ssmkit workbook run`` -- sends False. Unlike a parameters
   cell papermill injected, this holds for a parameterized notebook opened in JupyterLab (live)
   and for a papermill run without parameters (static).

A frontend that runs cells without stdin and still renders widgets (Voila) needs
``SSMKIT_WIDGETS=live``. Static: the figure is drawn for a few slider values side by side
(the first slider at its low end, its start and its high end, the others at their start; or the
values ``static=`` lists), with one printed line saying so. Live: an ``ipywidgets.interactive``
whose own output area draws the starting figure at once (saved with the widget state), displayed
together with that figure as a PNG for viewers without widgets (nbviewer, GitHub).
"""

from __future__ import annotations

import base64
import inspect
import math
import os
from io import BytesIO

import torch

from ..plots import _in_kernel, save_and_show

WIDGETS_ENV = "SSMKIT_WIDGETS"
MODES = ("auto", "static", "live")

__all__ = [
    "WIDGETS_ENV",
    "draw_hybrid_stack",
    "draw_selective_state",
    "draw_ssd_mask",
    "draw_ssm_memory",
    "explore",
    "hybrid_stack",
    "selective_state",
    "ssd_mask",
    "ssm_memory",
    "widget_mode",
]


# --- live or static -------------------------------------------------------------------------------


def _frontend_present() -> bool:
    """Whether the cell being run came from a frontend (its execute request allows stdin)."""
    from IPython import get_ipython

    kernel = getattr(get_ipython(), "kernel", None)
    return bool(getattr(kernel, "_allow_stdin", False))


def widget_mode() -> tuple[str, str]:
    """("live" | "static", why): whether sliders can move here (the module docstring's rule)."""
    asked = os.environ.get(WIDGETS_ENV, "").strip().lower() or "auto"
    if asked not in MODES:
        raise ValueError(
            f"{WIDGETS_ENV}={os.environ[WIDGETS_ENV]!r} is not a widget mode; valid: auto (the "
            "default: sliders in a live Jupyter frontend), static (figures only), live"
        )
    if asked != "auto":
        return asked, f"{WIDGETS_ENV}={asked}"
    if not _in_kernel():
        return "static", "not in a Jupyter kernel"
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return "static", "ipywidgets is not installed"
    if not _frontend_present():
        return "static", "a headless run (no frontend: papermill, nbclient)"
    return "live", "a Jupyter kernel"


def _png(fig) -> bytes:
    buf = BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return buf.getvalue()


def _controls(draw, sliders: dict) -> tuple[dict, dict]:
    """({name: (low, start, high, step) or ("choice", options, start)}, {name: fixed value}).

    A tuple (low, high[, step]) is a slider (integers when all are ints), a list a choice; any other
    value is passed to ``draw`` unchanged. The start is ``draw``'s default when it is in range,
    else the middle."""
    params = inspect.signature(draw).parameters
    specs, fixed = {}, {}
    for name, spec in sliders.items():
        default = params[name].default if name in params else inspect.Parameter.empty
        if isinstance(spec, tuple):
            if len(spec) not in (2, 3) or not all(isinstance(v, (int, float)) for v in spec):
                raise ValueError(
                    f"explore: slider {name}={spec!r}; give (low, high) or (low, high, step)"
                )
            low, high = spec[0], spec[1]
            ints = all(isinstance(v, int) for v in spec)
            step = spec[2] if len(spec) == 3 else (1 if ints else (high - low) / 100)
            if not low < high:
                raise ValueError(f"explore: slider {name}={spec!r} needs low < high")
            mid = (low + high) // 2 if ints else (low + high) / 2
            ok = isinstance(default, (int, float)) and low <= default <= high
            specs[name] = (low, default if ok else mid, high, step)
        elif isinstance(spec, list):
            if not spec:
                raise ValueError(f"explore: choice {name} has no options")
            specs[name] = ("choice", spec, default if default in spec else spec[0])
        else:
            fixed[name] = spec
    return specs, fixed


def _start(specs: dict) -> dict:
    return {n: s[2] if s[0] == "choice" else s[1] for n, s in specs.items()}


def _representative(specs: dict) -> list[dict]:
    """The first control at its low end, its start and its high end; the others at their start."""
    start = _start(specs)
    if not specs:
        return [start]
    name, spec = next(iter(specs.items()))
    values = (
        [spec[1][0], spec[2], spec[1][-1]] if spec[0] == "choice" else [spec[0], spec[1], spec[2]]
    )
    unique = list(dict.fromkeys(values))
    return [{**start, name: v} for v in unique]


def _grid(figures: list, titles: list[str]):
    """The figures rendered side by side as one figure (each panel titled)."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    images = []
    for fig in figures:
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        images.append(np.asarray(canvas.buffer_rgba()))
    h, w = images[0].shape[:2]
    dpi = figures[0].dpi
    column = w > 1.6 * h  # wide figures one above the other, the others side by side
    rows, cols = (len(images), 1) if column else (1, len(images))
    out = Figure(figsize=(cols * w / dpi, rows * (h / dpi + 0.3)), layout="constrained")
    for ax, image, title in zip(out.subplots(rows, cols, squeeze=False).ravel(), images, titles):
        ax.imshow(image)
        ax.set_title(title, fontsize=10)
        ax.axis("off")
    return out


def explore(
    draw, *, static: list[dict] | None = None, mode: str | None = None, path=None, **sliders
):
    """``draw(**values)`` (a function returning a matplotlib Figure) with a slider per keyword.

    sliders: ``name=(low, high)`` or ``(low, high, step)`` a slider (ints: an integer slider),
    ``name=[a, b, ...]`` a choice, any other value passed to ``draw`` unchanged; each starts at
    ``draw``'s default for it (in range) or the middle. ``mode``: "live" / "static"; None:
    :func:`widget_mode`. ``static``: the values drawn side by side in the static figure (each dict
    completed with the starts); None: the first slider at its low end, start and high end.
    ``path``: where the static figure is saved (written whole).

    Shows what it builds and returns it: the ``ipywidgets.interactive`` (live; its ``result`` is the
    figure last drawn, its ``children`` the controls, then the output area) or the static Figure.
    Assign the result in a cell (``ui = explore(...)``), or Jupyter shows it a second time."""
    specs, fixed = _controls(draw, sliders)
    why = f"mode={mode}"
    if mode is None:
        mode, why = widget_mode()
    if mode not in ("live", "static"):
        raise ValueError(f"explore: mode={mode!r}; valid: live, static, None (auto)")
    if mode == "live":
        return _live(draw, specs, fixed)
    start = _start(specs)
    cases = [{**start, **case} for case in static] if static is not None else _representative(specs)
    figures = [draw(**case, **fixed) for case in cases]
    moved = [n for n in specs if len({repr(c[n]) for c in cases}) > 1]
    titles = [", ".join(f"{n} = {_fmt(c[n])}" for n in moved) or "start" for c in cases]
    print(
        f"static figure ({why}): {'; '.join(titles)}. Open the notebook in JupyterLab to move "
        f"the sliders ({', '.join(specs) or 'none'})."
    )
    fig = figures[0] if len(figures) == 1 else _grid(figures, titles)
    return save_and_show(fig, path)


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _live(draw, specs: dict, fixed: dict):
    import ipywidgets as W
    from IPython.display import Image, display

    controls = {}
    for name, spec in specs.items():
        if spec[0] == "choice":
            controls[name] = W.Dropdown(options=spec[1], value=spec[2], description=name)
        else:
            low, value, high, step = spec
            kind = W.IntSlider if all(isinstance(v, int) for v in spec) else W.FloatSlider
            controls[name] = kind(
                min=low,
                max=high,
                step=step,
                value=value,
                description=name,
                continuous_update=False,
                style={"description_width": "initial"},
            )

    def update(**values):
        fig = draw(**values, **fixed)
        display(Image(data=_png(fig), format="png"))
        return fig

    ui = W.interactive(update, **controls)  # draws the starting figure into its output area
    if ui.result is None:  # interactive swallowed draw's error: raise it here, in the cell
        draw(**_start(specs), **fixed)
    bundle = ui._repr_mimebundle_()
    bundle["image/png"] = base64.b64encode(_png(ui.result)).decode()  # for viewers without widgets
    display(bundle, raw=True)
    return ui


# --- papers/01_s4: the step Δ and the state's memory ----------------------------------------------


def ssm_memory(log10_dt: float = -2.0, re_a: float = -0.5, im_a: float = 0.0, steps: int = 10_000):
    """One diagonal mode A = re_a + i·im_a discretised with step Δ = 10**log10_dt by zero-order hold
    (:func:`ssmkit.ops.discretize`, S4 / S4D: Ā = exp(ΔA)), and what it remembers after k steps.

    Returns ``dt``, ``A`` and ``Abar`` (complex numbers), ``k`` (steps + 1,) the step counts
    0..steps, ``memory`` (steps + 1,) |Ā|^k = exp(kΔ Re A) (what is left of an input k steps
    back), ``real`` (steps + 1,) Re Ā^k (the impulse response of the mode, with its oscillation) and
    ``half_life`` = ln 2 / (Δ |Re A|) steps (inf for Re A = 0)."""
    from ..ops import discretize

    dt = 10.0**log10_dt
    A = torch.tensor([complex(re_a, im_a)], dtype=torch.complex128)
    Abar, _ = discretize(A, torch.ones_like(A), dt, "zoh")
    k = torch.arange(steps + 1, dtype=torch.float64)
    powers = Abar[0] ** k
    half = math.log(2) / (dt * abs(re_a)) if re_a != 0 else math.inf
    return {
        "dt": dt,
        "A": complex(A[0]),
        "Abar": complex(Abar[0]),
        "k": k,
        "memory": powers.abs(),
        "real": powers.real,
        "half_life": half,
    }


def draw_ssm_memory(log10_dt: float = -2.0, re_a: float = -0.5, im_a: float = 0.0):
    """Left: |Ā|^k and Re Ā^k against k (log axis), the half-life marked. Right: Ā in the complex
    plane, inside the unit circle (Δ -> 0 moves it to 1: long memory; Δ large, towards 0)."""
    from matplotlib.figure import Figure

    m = ssm_memory(log10_dt, re_a, im_a)
    fig = Figure(figsize=(8.5, 3.4), layout="constrained")
    ax, plane = fig.subplots(1, 2, width_ratios=[2.4, 1])
    k = m["k"][1:]
    ax.plot(k, m["memory"][1:], lw=1.8, label=r"$|\bar A|^k = e^{k\Delta\,\mathrm{Re}A}$")
    if im_a:
        ax.plot(k, m["real"][1:], lw=0.8, alpha=0.7, label=r"$\mathrm{Re}\,\bar A^k$")
    if math.isfinite(m["half_life"]) and m["half_life"] <= k[-1]:
        ax.axvline(m["half_life"], color="C3", ls="--", lw=1)
        ax.annotate(
            f"half-life {m['half_life']:.3g} steps",
            (m["half_life"], 0.5),
            xytext=(4, 0),
            textcoords="offset points",
            color="C3",
            fontsize=9,
        )
    ax.set(
        xscale="log",
        xlim=(1, k[-1]),
        ylim=(-1.05, 1.05) if im_a else (0, 1.05),
        xlabel="steps back, k",
        ylabel="what is left of an input",
    )
    ax.set_title(
        rf"$\Delta$ = {m['dt']:.3g}, A = {re_a:g}{im_a:+g}i: "
        rf"$\bar A = e^{{\Delta A}}$ = {m['Abar']:.4g}",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    theta = torch.linspace(0, 2 * math.pi, 200)
    plane.plot(theta.cos(), theta.sin(), color="0.6", lw=0.8)
    plane.plot([m["Abar"].real], [m["Abar"].imag], "o", color="C0")
    plane.set(
        aspect="equal", xlim=(-1.1, 1.1), ylim=(-1.1, 1.1), title=r"$\bar A$ in the unit disc"
    )
    plane.grid(True, alpha=0.3)
    return fig


# --- papers/03_mamba: the selective scan's state --------------------------------------------------


def selective_state(
    log10_delta: float = -0.5,
    gate_token: int = 8,
    log10_gate: float = 0.5,
    b_scale: float = 1.0,
    c_scale: float = 1.0,
    length: int = 24,
    d_state: int = 4,
):
    """A one-channel S6 (Mamba, Algorithm 2) over a short input of pulses, run by
    :func:`ssmkit.ops.selective_scan_reference`: Δ_t = 10**log10_delta on every token but
    ``gate_token``, where Δ = 10**log10_gate (the selection: a large Δ resets the state to that
    token's input, a tiny Δ skips the token); A_n = -(n + 1) (S4D-Real, Mamba's init), B_t =
    ``b_scale`` · 1, C_t = ``c_scale`` · 1 (N = ``d_state`` each).

    Returns float64 tensors ``x`` (length,) the input, ``delta`` (length,), ``A`` (d_state,), ``B``,
    ``C`` (d_state,), ``h`` (length, d_state) the state h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B x_t
    (read out of the op with C = e_n, one batch row per n) and ``y`` (length,) = C^T h_t."""
    from ..ops import selective_scan_reference

    t = torch.arange(length)
    x = torch.where(t % 6 == 2, torch.where((t // 6) % 2 == 0, 1.0, -1.0), 0.0).double()
    delta = torch.full((length,), 10.0**log10_delta, dtype=torch.float64)
    if 0 <= gate_token < length:
        delta[gate_token] = 10.0**log10_gate
    A = -torch.arange(1, d_state + 1, dtype=torch.float64)
    B = torch.full((d_state,), float(b_scale), dtype=torch.float64)
    C = torch.full((d_state,), float(c_scale), dtype=torch.float64)
    rows = d_state + 1  # rows 0..N-1 read h_t[n] (C = e_n), row N reads y_t (C = C)
    readout = torch.cat([torch.eye(d_state, dtype=torch.float64), C[None]])  # (rows, N)
    y = selective_scan_reference(
        x.expand(rows, 1, length),  # u: (batch, dim=1, seqlen)
        delta.expand(rows, 1, length),
        A[None],  # (dim, N)
        B[None, :, None].expand(rows, d_state, length),  # (batch, N, seqlen)
        readout[:, :, None].expand(rows, d_state, length),
    )[:, 0]  # (rows, seqlen)
    return {"x": x, "delta": delta, "A": A, "B": B, "C": C, "h": y[:d_state].T, "y": y[d_state]}


def draw_selective_state(
    log10_delta: float = -0.5,
    gate_token: int = 8,
    log10_gate: float = 0.5,
    b_scale: float = 1.0,
    c_scale: float = 1.0,
):
    """Top: the input x_t and Δ_t (log scale); middle: the state h_t, one line per n; bottom: the
    output y_t = C^T h_t."""
    from matplotlib.figure import Figure

    s = selective_state(log10_delta, gate_token, log10_gate, b_scale, c_scale)
    t = torch.arange(len(s["x"]))
    fig = Figure(figsize=(8, 5.6), layout="constrained")
    top, mid, bottom = fig.subplots(3, 1, sharex=True)
    top.bar(t, s["x"], color="0.5", label="input $x_t$")
    top.set_ylabel("$x_t$")
    right = top.twinx()
    right.plot(t, s["delta"], "o-", color="C3", ms=3, lw=1)
    right.set(yscale="log", ylim=(1e-3, 1e2))
    right.set_ylabel(r"$\Delta_t$", color="C3")
    for n in range(s["h"].shape[1]):
        mid.plot(t, s["h"][:, n], "o-", ms=2.5, lw=1, label=f"$h_t[{n}]$, A = {s['A'][n]:g}")
    mid.set_ylabel("state $h_t$")
    mid.legend(fontsize=7, ncol=2, loc="upper right")
    bottom.plot(t, s["y"], "o-", color="k", ms=3, lw=1.2)
    bottom.set(xlabel="token t", ylabel="$y_t = C^T h_t$")
    for ax in (top, mid, bottom):
        ax.grid(True, alpha=0.3)
        if 0 <= gate_token < len(t):
            ax.axvline(gate_token, color="C3", alpha=0.25, lw=6)
    top.set_title(
        rf"$h_t = e^{{\Delta_t A}} h_{{t-1}} + \Delta_t B x_t$: $\Delta$ = "
        f"{10**log10_delta:.3g}, on token {gate_token}: {10**log10_gate:.3g}",
        fontsize=10,
    )
    return fig


# --- papers/04_mamba2: the SSD mask and its chunks ------------------------------------------------


def ssd_mask(length: int = 32, chunk: int = 8, decay: float = 0.1, seed: int = 0):
    """Mamba-2's mask L = 1SS(a) (SSD, section 3): L_ts = a_{s+1} ··· a_t for t >= s, else 0,
    with a_t = exp(Δ_t A), A = -``decay``, Δ_t = softplus(N(0, 1)) drawn with ``seed``. Computed as
    exp(segsum(log a)) (:func:`ssmkit.ops.segsum`, what the chunked algorithm uses).

    Returns ``log_a`` (length,), ``L`` (length, length) float64, and ``blocks``: per pair of chunks
    (Q = ``chunk`` steps; the last may be shorter) below or on the diagonal, ``(t0, t1, s0, s1,
    kind)`` with kind "diagonal" (a chunk with itself: computed whole, the quadratic form) or
    "low-rank" (an earlier chunk: rank 1, L[t, s] = (decay from the chunk start to t) · (decay
    of the chunks between) · (decay from s to its chunk's end), passed on as a state)."""
    from ..ops import segsum

    g = torch.Generator().manual_seed(seed)
    dt = torch.nn.functional.softplus(torch.randn(length, generator=g, dtype=torch.float64))
    log_a = -float(decay) * dt
    L = torch.exp(segsum(log_a))
    starts = list(range(0, length, chunk))
    blocks = [
        (
            t0,
            min(t0 + chunk, length),
            s0,
            min(s0 + chunk, length),
            "diagonal" if t0 == s0 else "low-rank",
        )
        for t0 in starts
        for s0 in starts
        if s0 <= t0
    ]
    return {"log_a": log_a, "L": L, "chunk": chunk, "blocks": blocks}


def draw_ssd_mask(length: int = 32, chunk: int = 8, decay: float = 0.1):
    """The mask as a heatmap (t down, s across), the diagonal blocks outlined white, the rank-1
    blocks below them dashed orange."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    m = ssd_mask(length, chunk, decay)
    fig = Figure(figsize=(5.6, 4.8), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(m["L"], cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    fig.colorbar(image, ax=ax, shrink=0.8, label="$L_{ts}$")
    for t0, t1, s0, s1, kind in m["blocks"]:
        diag = kind == "diagonal"
        ax.add_patch(
            Rectangle(
                (s0 - 0.5, t0 - 0.5),
                s1 - s0,
                t1 - t0,
                fill=False,
                ec="white" if diag else "C1",
                ls="-" if diag else "--",
                lw=1.6 if diag else 1.2,
            )
        )
        if not diag and (t1 - t0) * 30 >= length:
            ax.text(
                (s0 + s1 - 1) / 2,
                (t0 + t1 - 1) / 2,
                "rank 1",
                ha="center",
                va="center",
                color="C1",
                fontsize=8,
            )
    n_diag = sum(b[4] == "diagonal" for b in m["blocks"])
    ax.set(xlabel="s (source)", ylabel="t (target)")
    ax.set_title(
        f"L = 1SS(a), T = {length}, Q = {chunk}: {n_diag} diagonal blocks, "
        f"{len(m['blocks']) - n_diag} rank-1 blocks",
        fontsize=10,
    )
    return fig


# --- notebooks/03_hybrid: the layer pattern -------------------------------------------------------


def hybrid_stack(
    cfg,
    attn_every: int,
    n_layer: int | None = None,
    context: int = 4096,
    vocab_size: int | None = None,
):
    """The Jamba-style hybrid of the run config ``cfg`` (a TrainConfig) with attention at layer i
    when i % attn_every == attn_every // 2 (0: none, 1: all; see
    :func:`~ssmkit.workbook.chapters.ch03_hybrid.hybrid_config`), ``n_layer`` layers (None: the
    config's), built on the meta device (no memory, no init) and read back.

    Returns ``pattern`` (:func:`~ssmkit.workbook.chapters.ch03_hybrid.layer_pattern`, e.g. "M M A
    M"), ``mixers`` (the built layers' mixer classes, bottom first), ``attention_layers``,
    ``params`` (:func:`~ssmkit.workbook.chapters.ch03_hybrid.parameter_split`), and the inference
    cache of one sequence (fp32, bytes, from each layer's own ``allocate_state``): ``state_bytes``
    (SSM states and convs: constant in length), ``kv_bytes_per_token`` (keys + values of every
    attention layer), ``cache_bytes`` = {"ssm": ..., "kv": ...} at ``context`` tokens."""
    from ..models import build_model
    from ..models.cache import KVState
    from .chapters import ch03_hybrid as chapter

    over = {} if n_layer is None else {"n_layer": n_layer}
    mc = chapter.hybrid_config(cfg, attn_every, **over).model_config(vocab_size=vocab_size)
    with torch.device("meta"):
        model = build_model(mc)
    fixed = per_token = 0
    for state in model.backbone.allocate_states(1, torch.float32, "meta"):
        if isinstance(state, KVState):
            fixed += state.nbytes() - 2 * state.k.numel() * state.k.element_size()  # its conv
            per_token += 2 * state.k.shape[1] * state.k.shape[3] * state.k.element_size()
        else:
            fixed += state.nbytes()
    mixers = [type(layer.mixer).__name__ for layer in model.backbone.layers]
    return {
        "pattern": chapter.layer_pattern(model),
        "mixers": mixers,
        "attention_layers": [i for i, m in enumerate(mixers) if "Attention" in m],
        "params": chapter.parameter_split(model),
        "state_bytes": fixed,
        "kv_bytes_per_token": per_token,
        "cache_bytes": {"ssm": fixed, "kv": per_token * context},
        "context": context,
    }


def draw_hybrid_stack(cfg, attn_every: int = 4, n_layer: int = 8, log2_context: int = 12):
    """Top: the stack, bottom layer left, attention orange and SSM blue. Bottom left: the share of
    the parameters outside the embedding. Bottom right: the cache of one sequence against its
    length (SSM states flat, keys and values growing), the chosen length marked."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    context = 2**log2_context
    s = hybrid_stack(cfg, attn_every, n_layer, context)
    fig = Figure(figsize=(9, 4.6), layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 2.2])
    strip = fig.add_subplot(grid[0, :])
    letters = s["pattern"].split()
    for i, letter in enumerate(letters):
        attn = i in s["attention_layers"]
        strip.add_patch(Rectangle((i + 0.05, 0), 0.9, 1, color="C1" if attn else "C0", alpha=0.85))
        strip.text(i + 0.5, 0.5, letter, ha="center", va="center", color="white", fontsize=9)
    strip.set(xlim=(0, len(letters)), ylim=(0, 1), yticks=[], xlabel="layer (input at the left)")
    strip.set_title(
        f"attn_every = {attn_every}: {len(s['attention_layers'])} attention layers of "
        f"{len(letters)}",
        fontsize=10,
    )
    bars, cache = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    parts = {k: s["params"][k] for k in ("ssm", "attention", "mlp", "norms")}
    body = sum(parts.values()) or 1
    left = 0.0
    for i, (name, count) in enumerate(parts.items()):
        if count:
            bars.barh(0, count / body, left=left, color=f"C{(0, 1, 2, 7)[i]}", label=name)
            left += count / body
    bars.set(xlim=(0, 1), yticks=[], xlabel="share of the parameters (embedding aside)")
    bars.set_title(
        f"{body / 1e6:.2f}M in the layers, {s['params']['embedding'] / 1e6:.2f}M embedding",
        fontsize=9,
    )
    bars.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4)
    lengths = torch.logspace(8, 17, 60, base=2, dtype=torch.float64)
    mib = 2.0**20
    cache.plot(
        lengths, torch.full_like(lengths, s["state_bytes"] / mib), color="C0", label="SSM states"
    )
    cache.plot(lengths, lengths * s["kv_bytes_per_token"] / mib, color="C1", label="keys + values")
    cache.axvline(context, color="k", ls="--", lw=1)
    total = s["cache_bytes"]["ssm"] + s["cache_bytes"]["kv"]
    share = s["cache_bytes"]["kv"] / total if total else 0.0
    cache.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="cache, MiB")
    cache.set_title(
        f"at {context} tokens: {total / mib:.2f} MiB, {share:.0%} keys + values", fontsize=9
    )
    cache.grid(True, alpha=0.3)
    cache.legend(fontsize=8)
    return fig
