"""Golden dumps: `graphrewrite dump` of every fixture, checked in and diffed on every run.

Regenerate on purpose with `make goldens` (pytest --update-goldens) and review the diff.
"""

import difflib

import pytest

from graphrewrite import io
from graphrewrite.text import dump

from conftest import FIXTURE_NAMES, GOLDENS, fixture_path


def compare_with_golden(actual: str, golden_name: str, update: bool) -> None:
    path = GOLDENS / golden_name
    if update:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual)
        return
    if not path.exists():
        pytest.fail(f"no golden file {path.name}; create it with `make goldens` and review it")
    expected = path.read_text()
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True),
                                            f"golden/{path.name}", "actual", n=2))
        pytest.fail(f"dump differs from {path.name} (run `make goldens` if intended):\n"
                    + diff[:6000])


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_dump_matches_golden(name, update_goldens):
    model = io.load(fixture_path(name))
    compare_with_golden(dump(model.graph, model.meta_graph), f"{name}.dump", update_goldens)


REWRITES = [("mlp", "memory"), ("resnet_cnn", "memory"),
            ("resnet_cnn", "speed"), ("transformer_dropout", "speed")]


@pytest.mark.parametrize("name, mode", REWRITES)
def test_rewrite_matches_golden(name, mode, update_goldens):
    from graphrewrite import pipeline

    model = io.load(fixture_path(name))
    result = pipeline.optimize(model, mode)
    assert result.nodes_after > result.nodes_before, "the golden should show a rewrite"
    compare_with_golden(dump(result.graph, model.meta_graph), f"{name}.{mode}.dump",
                        update_goldens)
