"""The memory model against TensorFlow's allocator, on the shipped fixtures whose measured peak
is mostly what the liveness peak leaves out: the CPU convolution gradients' column buffers and
the allocator's rounding (about 33 MiB measured against 1-3 MiB of live tensors).
"""

import pytest

from graphrewrite.analysis import step as analysis
from graphrewrite.core import io
from graphrewrite.execution import measure

from conftest import fixture_path

pytestmark = pytest.mark.tf


@pytest.mark.parametrize("name", ["keras_train", "resnet_cnn", "transformer_dropout"])
def test_allocator_peak_is_within_ten_percent_of_the_measured_one(name):
    model = io.load(fixture_path(name))
    found = analysis.analyse(model)
    report = analysis.as_run(model, model.graph, found)
    feeds = measure.random_feeds(model.graph, found.shapes)
    measured = measure.run_step_isolated(model.runnable(), feeds, found.fetches, 0).peak_bytes
    assert abs(report.allocated_peak() - measured) <= 0.10 * measured
    if name != "transformer_dropout":  # the two CNNs: the liveness peak alone is far off
        assert report.peak() < 0.2 * measured
