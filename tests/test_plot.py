"""`--plot`: the charts are written, hold the curves, and fail cleanly without matplotlib."""

import builtins

import pytest

from conftest import fixture_path, run_cli

matplotlib_image = pytest.importorskip("matplotlib.image")


def _ink(path) -> float:
    """Share of the image's pixels that are not white."""
    pixels = matplotlib_image.imread(str(path))
    return float((pixels[..., :3].mean(axis=-1) < 0.95).mean())


def test_inspect_plot_draws_the_modelled_step(tmp_path):
    out = tmp_path / "step.png"
    shown = run_cli("inspect", fixture_path("keras_train"), "--plot", out)
    assert shown.exit_code == 0, shown.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 0.01 < _ink(out) < 0.5


def test_optimize_plot_puts_both_steps_on_one_chart(tmp_path):
    out = tmp_path / "both.svg"
    shown = run_cli("optimize", fixture_path("mlp"), "-o", tmp_path / "mlp_opt.pbtxt",
                    "--plot", out)
    assert shown.exit_code == 0, shown.stderr
    svg = out.read_text()
    for label in ("original (allocator)", "rewritten (allocator)", "live tensors", "backward"):
        assert label in svg


def test_the_tradeoff_chart_draws_each_list_of_points(tmp_path):
    from graphrewrite.reporting import plot

    def points(*peaks):
        return [{"peak_bytes": peak * 2**20, "extra_seconds": i * 1e-3}
                for i, peak in enumerate(peaks)]

    found = {"original_peak_bytes": 100 * 2**20, "profile": "h200",
             "estimate": points(80, 60), "levers": points(90, 70, 30)}
    svg = plot.tradeoff(tmp_path / "curve.svg", found, "t").read_text()
    assert "estimate (as written)" in svg and "every lever, lossy ones too (as run)" in svg
    assert "exact" not in svg  # no exact planner's points, no line for them


def test_a_plot_needs_a_known_extension(tmp_path):
    shown = run_cli("inspect", fixture_path("mlp"), "--plot", tmp_path / "step.gif")
    assert shown.exit_code == 2 and "png" in shown.stderr
    assert not (tmp_path / "step.gif").exists()


def test_without_matplotlib_the_error_names_the_extra(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    shown = run_cli("inspect", fixture_path("mlp"), "--plot", tmp_path / "step.png")
    assert shown.exit_code == 2
    assert "graphrewrite[plot]" in shown.stderr and len(shown.stderr.strip().splitlines()) == 1

