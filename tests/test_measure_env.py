"""The measurement environment: flags under which `verify` measures another step than the
memory model's, said before it measures (no TensorFlow run)."""

import pytest

from graphrewrite.execution import measure


@pytest.fixture
def environment(monkeypatch):
    monkeypatch.delenv(measure.ONEDNN_FLAG, raising=False)
    monkeypatch.delenv(measure.BFC_FLAG, raising=False)
    return monkeypatch


def test_the_measurement_environment_has_no_caveats(environment):
    measure.measurement_environment()
    assert measure.measurement_caveats() == []


@pytest.mark.parametrize("value", ["1", "true", "True"])
def test_onednn_left_on_by_the_user_is_a_caveat(environment, value):
    # setdefault keeps the user's value: oneDNN's kernels measure frozen graphs 16-62% above
    # the model, which models the step without them
    environment.setenv(measure.ONEDNN_FLAG, value)
    measure.measurement_environment()
    (caveat,) = measure.measurement_caveats()
    assert caveat.startswith(f"{measure.ONEDNN_FLAG}={value}: oneDNN")
    assert f"{measure.ONEDNN_FLAG}=0" in caveat


@pytest.mark.parametrize("value", ["0", "false"])
def test_onednn_off_is_no_caveat(environment, value):
    environment.setenv(measure.ONEDNN_FLAG, value)
    assert measure.measurement_caveats() == []


def test_a_cpu_allocator_without_statistics_is_a_caveat(environment):
    environment.setenv(measure.BFC_FLAG, "false")
    measure.measurement_environment()
    (caveat,) = measure.measurement_caveats()
    assert caveat.startswith(f"{measure.BFC_FLAG}=false")
    environment.setenv(measure.BFC_FLAG, "1")
    assert measure.measurement_caveats() == []
