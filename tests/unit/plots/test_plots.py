"""ssmkit.plots: the live loss plot, curves of several runs and panels: figures written whole, one
line per run or group, log axes where asked, a display updated in place."""

from __future__ import annotations

import pytest

from ssmkit import plots
from ssmkit.plots import LivePlot, plot_curves


def test_plot_panels_writes_a_figure(tmp_path):
    rows = [
        {"model": m, "seq_len": n, "a": n * k, "b": None if n == 2 else 1.0}
        for m, k in (("x", 1), ("y", 2))
        for n in (1, 2, 4)
    ]
    fig = plots.plot_panels(
        rows,
        tmp_path / "f.png",
        x="seq_len",
        panels={"a": "A", "b": "B"},
        logx=True,
        logy=("a",),
        show=False,
    )
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    assert [len(ax.lines) for ax in fig.axes] == [2, 2]


def train_records(n=5, scale=1.0):
    return [
        {"step": i, "tokens": 1000 * (i + 1), "loss": scale * (5.0 - i * 0.5), "lr": 1e-3}
        for i in range(n)
    ]


def test_liveplot_records_and_saves(tmp_path):
    live = LivePlot(tmp_path / "fig" / "loss.png", display=False)
    for r in train_records():
        live.on_log(None, r)
    live.on_eval(None, {"step": 4, "tokens": 5000, "val_loss": 3.2, "val_ppl": 24.5})
    path = live.on_end(None)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and list(path.parent.iterdir()) == [path]
    train_line, val_line = live.figure().axes[0].lines
    assert list(train_line.get_xdata()) == [1000, 2000, 3000, 4000, 5000]
    assert list(train_line.get_ydata()) == [5.0, 4.5, 4.0, 3.5, 3.0]
    assert list(val_line.get_xdata()) == [5000] and list(val_line.get_ydata()) == [3.2]
    assert live.draws == 1  # no display: drawn once, at the end


def test_liveplot_updates_one_display_in_place(tmp_path, monkeypatch):
    import IPython.display

    shown = []

    class Handle:
        def update(self, obj):
            shown.append(("update", obj))

    def fake_display(obj, display_id=None):
        shown.append(("display", obj))
        return Handle()

    monkeypatch.setattr(IPython.display, "display", fake_display)
    live = LivePlot(tmp_path / "loss.png", display=True, interval=0.0)
    for r in train_records(3):
        live.on_log(None, r)
    live.on_end(None)
    assert [kind for kind, _ in shown] == ["display", "update", "update", "update"]
    assert all(obj.data[:4] == b"\x89PNG" for _, obj in shown)
    shown.clear()
    # throttled: first update, then only the end
    slow = LivePlot(None, display=True, interval=1e9, save_every=2)
    slow.path = tmp_path / "slow.png"
    for r in train_records(4):
        slow.on_log(None, r)
    assert [kind for kind, _ in shown] == [
        "display"
    ] and slow.path.exists()  # save_every=2 saved mid-run
    slow.on_end(None)
    assert [kind for kind, _ in shown] == ["display", "update"]


def test_plot_curves_several_runs(tmp_path):
    mamba, llama = train_records(4), train_records(3, scale=1.2)
    # an eval record among train records: skipped
    mamba.insert(2, {"step": 2, "tokens": 2500, "val_loss": 4.1})
    fig = plot_curves(
        {"mamba": mamba, "llama": llama}, tmp_path / "cmp.png", x="tokens", y="loss", show=False
    )
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"
    lines = fig.axes[0].lines
    assert [ln.get_label() for ln in lines] == ["mamba", "llama"]
    assert list(lines[0].get_xdata()) == [1000, 2000, 3000, 4000]
    assert list(lines[1].get_ydata()) == pytest.approx([6.0, 5.4, 4.8])
    val = plot_curves({"mamba": mamba}, None, y="val_loss", show=False)
    assert list(val.axes[0].lines[0].get_ydata()) == [4.1]
    with pytest.raises(
        ValueError, match="run 'llama' has no records with keys 'tokens' and 'val_loss'"
    ):
        plot_curves({"mamba": mamba, "llama": llama}, None, y="val_loss", show=False)
