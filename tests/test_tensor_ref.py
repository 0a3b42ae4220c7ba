import pytest

from graphrewrite.core.tensor_ref import CONTROL, TensorRef


@pytest.mark.parametrize("text, node, port", [
    ("a", "a", 0), ("a:1", "a", 1), ("^a", "a", CONTROL), ("scope/op:12", "scope/op", 12),
    ("odd:name", "odd:name", 0),
])
def test_parse(text, node, port):
    assert TensorRef.parse(text) == TensorRef(node, port)


@pytest.mark.parametrize("text", ["a", "a:1", "^a", "s/b:3"])
def test_canonical_spellings_round_trip(text):
    assert str(TensorRef.parse(text)) == text


def test_explicit_port_zero_prints_canonically():
    assert str(TensorRef.parse("a:0")) == "a"


def test_empty_is_refused():
    with pytest.raises(ValueError):
        TensorRef.parse("")
