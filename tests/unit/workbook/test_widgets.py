"""ssmkit.workbook.widgets: what each slider picture computes, against closed forms and the
recurrence run by hand; the static fallback; the live ipywidgets path and its redraw."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("matplotlib")

from helpers import ROOT  # noqa: E402

from ssmkit.workbook import widgets  # noqa: E402


@pytest.mark.parametrize("log10_dt,re_a,im_a", [(-2.0, -0.5, 0.0), (-0.5, -1.5, 3.0)])
def test_ssm_memory_is_the_closed_form(log10_dt, re_a, im_a):
    m = widgets.ssm_memory(log10_dt, re_a, im_a, steps=50)
    dt = 10**log10_dt
    assert m["dt"] == pytest.approx(dt)
    assert m["Abar"] == pytest.approx(
        complex(
            math.exp(dt * re_a) * math.cos(dt * im_a), math.exp(dt * re_a) * math.sin(dt * im_a)
        )
    )
    k = torch.arange(51, dtype=torch.float64)
    torch.testing.assert_close(m["memory"], torch.exp(k * dt * re_a))  # |exp(ΔA)|^k
    torch.testing.assert_close(m["real"], torch.exp(k * dt * re_a) * torch.cos(k * dt * im_a))
    assert m["half_life"] == pytest.approx(math.log(2) / (dt * abs(re_a)))
    if m["half_life"] <= 50:  # half of an input is left after half_life steps
        assert math.exp(m["half_life"] * dt * re_a) == pytest.approx(0.5)
    assert widgets.ssm_memory(-1.0, 0.0, 1.0, steps=3)["half_life"] == math.inf


def test_selective_state_is_the_recurrence_by_hand():
    s = widgets.selective_state(
        log10_delta=-0.7,
        gate_token=8,
        log10_gate=1.0,
        b_scale=0.5,
        c_scale=-2.0,
        length=12,
        d_state=3,
    )
    assert s["delta"][8] == pytest.approx(10.0) and s["delta"][7] == pytest.approx(10**-0.7)
    h, hs, ys = torch.zeros(3, dtype=torch.float64), [], []
    for t in range(12):
        h = torch.exp(s["delta"][t] * s["A"]) * h + s["delta"][t] * s["B"] * s["x"][t]
        hs.append(h)
        ys.append((s["C"] * h).sum())
    torch.testing.assert_close(s["h"], torch.stack(hs))
    torch.testing.assert_close(s["y"], torch.stack(ys))
    # Δ = 10 on token 8: exp(ΔA) <= e^-10 wipes the old state, which then holds Δ B x_8 alone
    assert s["x"][8] != 0 and s["h"][7].abs().min() > 1e-3
    torch.testing.assert_close(s["h"][8], 10 * 0.5 * s["x"][8].expand(3), atol=1e-4, rtol=0)


def test_ssd_mask_is_the_product_of_decays_and_its_chunks():
    m = widgets.ssd_mask(length=10, chunk=4, decay=0.7, seed=3)
    a, L = m["log_a"].exp(), m["L"]
    for t in range(10):
        for s in range(10):
            want = math.prod(a[s + 1 : t + 1].tolist()) if t >= s else 0.0
            assert L[t, s].item() == pytest.approx(want, abs=1e-12)
    torch.testing.assert_close(L, torch.tril(L))
    spans = [(b[0], b[1], b[2], b[3]) for b in m["blocks"]]
    assert spans == [
        (0, 4, 0, 4),
        (4, 8, 0, 4),
        (4, 8, 4, 8),
        (8, 10, 0, 4),
        (8, 10, 4, 8),
        (8, 10, 8, 10),
    ]
    for t0, t1, s0, s1, kind in m["blocks"]:
        assert kind == ("diagonal" if t0 == s0 else "low-rank")
        if kind == "low-rank":
            assert torch.linalg.matrix_rank(L[t0:t1, s0:s1]).item() == 1
    title = widgets.draw_ssd_mask(10, 4, 0.7).axes[0].get_title()
    assert "T = 10, Q = 4: 3 diagonal blocks, 3 rank-1 blocks" in title


@pytest.fixture(scope="module")
def cfg():
    from ssmkit.train import TrainConfig

    return TrainConfig.from_yaml(ROOT / "configs" / "cpu-tiny.yaml")


def test_hybrid_stack_matches_the_model_it_builds(cfg):
    from ssmkit.workbook.chapters import ch03_hybrid as chapter

    s = widgets.hybrid_stack(cfg, attn_every=3, n_layer=7, context=100, vocab_size=256)
    assert s["attention_layers"] == [1, 4]  # i % 3 == 3 // 2
    assert s["pattern"] == "M A M M A M M"
    real = chapter.hybrid_config(cfg, 3, n_layer=7).model_config(vocab_size=256)
    assert [i for i, m in enumerate(real.mixers) if m == "attn"] == s["attention_layers"]
    attn = real.attn_cfg
    per_token = 2 * attn["num_heads_kv"] * attn["head_dim"] * 4  # keys + values, fp32
    assert s["kv_bytes_per_token"] == 2 * per_token
    assert s["cache_bytes"]["kv"] == 100 * s["kv_bytes_per_token"]
    d_inner = real.mamba1.expand * real.d_model
    mamba_state = d_inner * (real.mamba1.d_state + real.mamba1.d_conv) * 4
    assert s["state_bytes"] >= 5 * mamba_state
    assert s["params"]["attention"] > 0 and s["params"]["total"] == sum(
        v for k, v in s["params"].items() if k != "total"
    )
    none = widgets.hybrid_stack(cfg, attn_every=0, n_layer=4, vocab_size=256)
    assert none["attention_layers"] == [] and none["kv_bytes_per_token"] == 0


def test_static_fallback_draws_one_figure_and_says_so(capsys, tmp_path):
    from matplotlib.figure import Figure

    seen = []

    def draw(a=0.5, n=2, label="x"):
        seen.append((a, n, label))
        fig = Figure(figsize=(3, 2))
        fig.add_subplot().plot([0, 1], [a, n])
        return fig

    fig = widgets.explore(
        draw, mode="static", path=tmp_path / "f.png", a=(0.0, 1.0), n=(1, 5), label="fixed"
    )
    assert isinstance(fig, Figure) and len(fig.axes) == 3 and (tmp_path / "f.png").is_file()
    assert seen == [(0.0, 2, "fixed"), (0.5, 2, "fixed"), (1.0, 2, "fixed")]
    line = capsys.readouterr().out.strip()
    assert line.startswith("static figure (mode=static): a = 0; a = 0.5; a = 1.")
    assert "\n" not in line
    seen.clear()
    widgets.explore(draw, mode="static", static=[{"n": 4}], a=(0.0, 1.0), n=(1, 5))
    assert seen == [(0.5, 4, "x")]


def test_auto_mode_is_static_outside_a_kernel_and_under_the_env(monkeypatch):
    monkeypatch.delenv(widgets.WIDGETS_ENV, raising=False)
    assert widgets.widget_mode() == ("static", "not in a Jupyter kernel")
    monkeypatch.setenv(widgets.WIDGETS_ENV, "live")
    assert widgets.widget_mode()[0] == "live"
    monkeypatch.setenv(widgets.WIDGETS_ENV, "sliders")
    with pytest.raises(ValueError, match="valid: auto"):
        widgets.widget_mode()


def test_in_a_kernel_only_a_frontends_request_is_live(monkeypatch):
    """The mode follows the execute request: JupyterLab's allows stdin (live), nbclient's --
    papermill, ssmkit workbook run -- does not (static), parameters injected or not."""
    pytest.importorskip("ipywidgets")
    monkeypatch.delenv(widgets.WIDGETS_ENV, raising=False)
    monkeypatch.setattr(widgets, "_in_kernel", lambda: True)
    kernel = type("Kernel", (), {"_allow_stdin": True})()
    shell = type("Shell", (), {"kernel": kernel})()
    monkeypatch.setattr("IPython.get_ipython", lambda: shell)
    assert widgets.widget_mode() == ("live", "a Jupyter kernel")  # JupyterLab
    kernel._allow_stdin = False  # nbclient: papermill, ssmkit workbook run
    assert widgets.widget_mode() == ("static", "a headless run (no frontend: papermill, nbclient)")
    monkeypatch.setattr("IPython.get_ipython", lambda: None)
    assert widgets.widget_mode()[0] == "static"


def test_live_path_builds_sliders_whose_change_redraws():
    ipywidgets = pytest.importorskip("ipywidgets")
    from matplotlib.figure import Figure

    seen = []

    def draw(length=32, chunk=8, decay=0.1, kind="a", seed=0):
        seen.append((length, chunk, decay, kind, seed))
        return Figure(figsize=(1, 1))

    ui = widgets.explore(
        draw,
        mode="live",
        length=(8, 64, 8),
        chunk=(2, 16),
        decay=(0.0, 1.0, 0.05),
        kind=["b", "a"],
        seed=7,
    )
    assert isinstance(ui, ipywidgets.interactive)
    length, chunk, decay, kind = ui.children[:4]
    assert isinstance(length, ipywidgets.IntSlider) and isinstance(decay, ipywidgets.FloatSlider)
    assert isinstance(kind, ipywidgets.Dropdown)
    assert seen == [(32, 8, 0.1, "a", 7)]  # drawn at once, at draw's defaults, seed fixed
    first = ui.result
    chunk.value = 4  # what moving the slider does
    assert seen[-1] == (32, 4, 0.1, "a", 7) and ui.result is not first
