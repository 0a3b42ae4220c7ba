"""The training zoo's builder at another batch (`--batch-scale`), without building anything."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))
import train_zoo  # noqa: E402


def test_the_default_scale_is_the_shipped_zoo():
    for model in train_zoo.MODELS_BY_ARCH.values():
        assert train_zoo.scaled(model, 1) is model


def test_half_scale_halves_every_input_batch_and_says_so():
    model = train_zoo.MODELS_BY_ARCH["resnet50_adam"]
    half = train_zoo.scaled(model, 0.5)
    assert [shape for _, _, shape in half.inputs] == [[4, 224, 224, 3], [4]]
    assert "batch 4," in half.summary and "batch 8" not in half.summary
    assert half.factory == model.factory and half.seed == model.seed


def test_a_scale_that_leaves_no_whole_batch_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        train_zoo.main(["--batch-scale", "0.3", "--list"])
    assert exit_.value.code == 2
    assert "resnet50_adam: batch 8 times 0.3" in capsys.readouterr().err


def test_list_shows_the_scaled_batches(capsys):
    assert train_zoo.main(["--batch-scale", "2", "--list"]) == 0
    out = capsys.readouterr().out
    assert "batch 16, Adam" in out and "batch 4096" in out
