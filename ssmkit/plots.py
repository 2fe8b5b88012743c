"""Figures for the notebooks: a live loss curve while training, and several runs on one plot.

    live = LivePlot("runs/x/loss.png")        # a Trainer callback: on_log / on_eval / on_end
    trainer = Trainer(cfg, callbacks=[live])  # redraws in Jupyter; in a terminal, saves at the end
    plot_curves({"mamba": live.train, "llama": other.train}, "runs/x/compare.png")

Figures are built as ``matplotlib.figure.Figure`` objects rendered by the Agg canvas: no pyplot,
no global backend, no window, so the same code runs in JupyterLab, under papermill, in a
terminal and on a headless GPU node. In a Jupyter kernel the PNG is shown through an IPython
display handle that is updated in place. A saved figure is written whole
(:func:`ssmkit.io.write_atomically`): a reader never sees half a PNG. matplotlib is imported inside
the functions, so ``import ssmkit`` never needs it; of ssmkit, only :mod:`ssmkit.io` is imported.
"""

from __future__ import annotations

import math
import time
from io import BytesIO
from pathlib import Path

from .io import write_atomically


def _in_kernel() -> bool:
    """True inside a Jupyter kernel (JupyterLab, papermill); False in a terminal or plain Python."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def _save(fig, path: str | Path) -> Path:
    """Render in memory, then :func:`ssmkit.io.write_atomically`; the format follows the suffix
    (.png, .pdf, .svg; none: matplotlib's default, png)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = BytesIO()
    fig.savefig(buf, format=path.suffix[1:].lower() or None, dpi=110, bbox_inches="tight")
    return write_atomically(path, buf.getvalue())


def _png(fig) -> bytes:
    buf = BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return buf.getvalue()


def save_and_show(fig, path: str | Path | None = None, show: bool | None = None):
    """Write ``fig`` to ``path`` (atomically; format from the suffix) when given, and show it as a
    PNG in a Jupyter kernel (``show`` None: only there). Returns ``fig``. What every figure function
    of the workbook ends with."""
    if path is not None:
        _save(fig, path)
    if _in_kernel() if show is None else show:
        from IPython.display import Image, display

        display(Image(data=_png(fig), format="png"))
    return fig


def _new_figure(title: str | None, xlabel: str, ylabel: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if title:
        ax.set_title(title)
    return fig, ax


class LivePlot:
    """A training callback that draws loss against tokens and keeps the records.

    Trainer hooks: ``on_log(trainer, record)`` (record keys ``step, tokens, loss, lr, ...``),
    ``on_eval(trainer, record)`` (``step, tokens, val_loss, val_ppl``), ``on_end(trainer)``.
    ``trainer`` is not used, so the object can be fed by hand too.

    path: where the figure is saved (at the end, and every ``save_every`` updates if > 0).
    interval: in a Jupyter kernel, redraw in place at most once per this many seconds (the last
    state is always drawn by ``on_end``). display: True / False / None (auto: in a kernel only).
    title: None: the trainer's ``name``. total_tokens: the run's length, where the x axis ends
    (None: read from the trainer, ``config.total_steps() * config.batch_tokens``; without one, a
    margin past the last point). The y axis runs from 0 to 10% above the highest loss, so the first
    point already has a frame.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        title: str | None = None,
        interval: float = 2.0,
        save_every: int = 0,
        display: bool | None = None,
        total_tokens: int | None = None,
    ):
        self.path = Path(path) if path is not None else None
        self.title, self.interval, self.save_every = title, interval, save_every
        self.total_tokens = total_tokens
        self.display = _in_kernel() if display is None else display
        self.train: list[dict] = []  # on_log records
        self.eval: list[dict] = []  # on_eval records
        self.draws = 0  # how many times the figure was rendered
        self._handle = None
        self._last = -float("inf")
        self._updates = 0

    # --- Trainer callback interface ---
    def on_log(self, trainer, record: dict) -> None:
        self._learn(trainer)
        self.train.append(dict(record))
        self._update()

    def on_eval(self, trainer, record: dict) -> None:
        self._learn(trainer)
        self.eval.append(dict(record))
        self._update()

    def _learn(self, trainer) -> None:
        """The run's length and the model's name, from a Trainer (anything else: left as they
        are)."""
        if self.title is None and isinstance(getattr(trainer, "name", None), str):
            self.title = trainer.name
        if self.total_tokens is None:
            cfg = getattr(trainer, "config", None)
            try:
                self.total_tokens = int(cfg.total_steps() * cfg.batch_tokens)
            except (AttributeError, TypeError, ValueError):
                pass

    def on_end(self, trainer=None) -> Path | None:
        """Draw the final figure (in place in Jupyter) and save it; returns the saved path."""
        fig = self.figure()
        self._show(fig)
        return _save(fig, self.path) if self.path is not None else None

    # --- drawing ---
    def figure(self):
        """The current figure: training loss as a line, validation loss as markers, against
        tokens."""
        fig, ax = _new_figure(self.title, "tokens", "loss (nats/token)")
        train = [r for r in self.train if "loss" in r]
        if train:
            ax.plot(
                [r.get("tokens", r.get("step")) for r in train],
                [r["loss"] for r in train],
                lw=1.2,
                label="train loss",
            )
        val = [r for r in self.eval if "val_loss" in r]
        if val:
            ax.plot(
                [r.get("tokens", r.get("step")) for r in val],
                [r["val_loss"] for r in val],
                "o-",
                ms=4,
                label="validation loss",
            )
        if train or val:
            ax.legend()
            self._frame(
                ax,
                [(r.get("tokens", r.get("step")), r["loss"]) for r in train]
                + [(r.get("tokens", r.get("step")), r["val_loss"]) for r in val],
                tokens=all("tokens" in r for r in train + val),
            )
        return fig

    def _frame(self, ax, points: list[tuple], tokens: bool) -> None:
        """Axes for the whole run from its first point (matplotlib would frame one point in +-0.04):
        x from 0 to the run's total tokens (or 5% past the last point), y from 0 to 10% above the
        highest loss."""
        points = [
            (x, y)
            for x, y in points
            if isinstance(x, (int, float))
            and isinstance(y, (int, float))
            and math.isfinite(x)
            and math.isfinite(y)
        ]
        if not points:
            return
        right = max(x for x, _ in points)
        right = max(right, self.total_tokens) if tokens and self.total_tokens else 1.05 * right
        if right > 0:
            ax.set_xlim(0, right)
        top, bottom = max(y for _, y in points), min(y for _, y in points)
        if top > 0 and bottom >= 0:
            ax.set_ylim(0, 1.1 * top)

    def _update(self) -> None:
        self._updates += 1
        now = time.monotonic()
        if self.display and now - self._last >= self.interval:
            self._last = now
            self._show(self.figure())
        if self.save_every and self.path is not None and self._updates % self.save_every == 0:
            _save(self.figure(), self.path)

    def _show(self, fig) -> None:
        self.draws += 1
        if not self.display:
            return
        from IPython.display import Image, display

        image = Image(data=_png(fig), format="png")
        if self._handle is None:
            self._handle = display(image, display_id=True)
        else:
            self._handle.update(image)


def plot_curves(
    histories: dict[str, list[dict]],
    path: str | Path | None = None,
    x: str = "tokens",
    y: str = "loss",
    *,
    title: str | None = None,
    logy: bool = False,
    show: bool | None = None,
):
    """Several runs on one plot: ``histories`` maps a label to its records (dicts with keys ``x``
    and ``y``).

    Records without ``y`` (an eval record among train records, say) are skipped. Saves to ``path``
    (if given) and, in a Jupyter kernel (or with ``show=True``), displays the PNG. Returns the
    figure (a ``matplotlib.figure.Figure``; its lines are in ``fig.axes[0].lines``, in order).
    """
    if not histories:
        raise ValueError("plot_curves: no histories given")
    fig, ax = _new_figure(title, x, y)
    for label, records in histories.items():
        points = [(r[x], r[y]) for r in records if x in r and y in r and r[y] is not None]
        if not points:
            raise ValueError(f"plot_curves: run {label!r} has no records with keys {x!r} and {y!r}")
        xs, ys = zip(*points)
        ax.plot(xs, ys, lw=1.2, label=label)
    if logy:
        ax.set_yscale("log")
    ax.legend()
    return save_and_show(fig, path, show)


__all__ = ["LivePlot", "plot_curves", "save_and_show"]


def plot_panels(
    rows: list[dict],
    path,
    x: str,
    panels: dict,
    group: str | None = "model",
    *,
    logx: bool = False,
    logy=(),
    title: str | None = None,
    show: bool | None = None,
):
    """One panel per entry of ``panels`` ({row key: panel title}), side by side: y = that key
    against ``x``, one line per value of ``group`` (None: one line). ``logy``: the keys drawn on a
    log scale. Saved to ``path`` (written whole) and, in a Jupyter kernel, shown. Returns the
    figure."""

    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * len(panels), 3.6), layout="constrained")
    for ax, (key, name) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels.items()):
        lines: dict = {}
        for r in rows:
            if r.get(key) is not None and r.get(x) is not None:
                lines.setdefault(r.get(group, "") if group else "", []).append((r[x], r[key]))
        for label, points in lines.items():
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, "o-", ms=4, lw=1.2, label=str(label) if label != "" else None)
        ax.set_xlabel(x)
        ax.set_title(name, fontsize=10)
        ax.grid(True, alpha=0.3)
        if logx:
            ax.set_xscale("log", base=2)
        if key in logy:
            ax.set_yscale("log")
        if len(lines) > 1:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return save_and_show(fig, path, show)
