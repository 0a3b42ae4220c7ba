"""Golden dumps: `graphrewrite dump` of every fixture, checked in and diffed on every run.

Regenerate on purpose with `make goldens` (pytest --update-goldens) and review the diff.
"""

import difflib

import pytest

from graphrewrite.core import io
from graphrewrite.core.text import dump

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


# golden label -> (mode, swap options); manual and collection need hints or selectors
REWRITES = {
    "memory": ("memory", None),
    "speed": ("speed", None),
    "swap": ("swap", None),
    "swap-grappler": ("swap", {"form": "grappler"}),
}


@pytest.mark.parametrize("label", REWRITES)
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_rewrite_matches_golden(name, label, update_goldens):
    from graphrewrite.pipeline import run as pipeline

    mode, swap_options = REWRITES[label]
    model = io.load(fixture_path(name))
    # The passes' rewrite, whatever the step as run on this machine (see pipeline.optimize).
    result = pipeline.optimize(model, mode, swap_options=swap_options, as_run=False)
    compare_with_golden(dump(result.graph, model.meta_graph), f"{name}.{label}.dump",
                        update_goldens)


def test_goldens_show_rewrites():
    """The rewrite goldens are not all copies of the originals' dumps."""
    changed = [p.name for p in GOLDENS.glob("*.memory.dump")
               if p.read_text() != (GOLDENS / p.name.replace(".memory", "")).read_text()]
    assert {"mlp.memory.dump", "resnet_cnn.memory.dump"} <= set(changed)
    swapped = [p.name for p in GOLDENS.glob("*.swap.dump")
               if p.read_text() != (GOLDENS / p.name.replace(".swap", "")).read_text()]
    assert {"mlp.swap.dump", "transformer_dropout.swap.dump"} <= set(swapped)
