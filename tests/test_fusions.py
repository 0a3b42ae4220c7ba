"""`analysis.fusions`: a rewrite must not change which one-column matrix products Grappler's
remapper fuses (fused and unfused round differently on the CPU: a GAN's logit, issue 31); and
gated copies are fused as their originals (`triggers.keep_fusable`)."""

import pytest

from conftest import graph_def, run_cli
from test_onednn import conv_step

from graphrewrite.analysis import step
from graphrewrite.analysis.fusions import refused
from graphrewrite.analysis.shapes import Shapes, TensorInfo
from graphrewrite.core import io
from graphrewrite.core.graph import Graph
from graphrewrite.core.names import COPY_SUFFIX, GATE_PREFIX
from graphrewrite.core.tensor_ref import TensorRef


def _as_run(*nodes):
    return Graph.from_graph_def(graph_def(*nodes))


def _shapes(columns):
    return Shapes({TensorRef("logit"): TensorInfo(1, (32, columns)),
                   TensorRef("mm"): TensorInfo(1, (32, columns))})


UNFUSED = (("x", "Placeholder", []), ("w", "Placeholder", []), ("b", "Placeholder", []),
           ("mm", "MatMul", ["x", "w"]), ("logit", "BiasAdd", ["mm", "b"]))
FUSED = (("x", "Placeholder", []), ("w", "Placeholder", []), ("b", "Placeholder", []),
         ("logit", "_FusedMatMul", ["x", "w", "b"]))


def test_a_one_column_product_fused_in_the_rewrite_only_is_refused():
    assert refused(_as_run(*UNFUSED), _as_run(*FUSED), _shapes(1)) == ["logit"]
    assert refused(_as_run(*FUSED), _as_run(*UNFUSED), _shapes(1)) == ["logit"]


def test_a_copy_fused_otherwise_than_its_original_names_the_original():
    copy = ("logit" + COPY_SUFFIX, "BiasAdd", ["mm", "b"])
    assert refused(_as_run(*FUSED), _as_run(*FUSED, copy), _shapes(1)) == ["logit"]


def test_products_of_several_columns_and_equal_kernels_pass():
    assert refused(_as_run(*UNFUSED), _as_run(*FUSED), _shapes(8)) == []  # GEMM: same bits
    assert refused(_as_run(*FUSED), _as_run(*FUSED), _shapes(1)) == []
    assert refused(_as_run(*UNFUSED), _as_run(*UNFUSED), _shapes(1)) == []


@pytest.mark.tf
def test_a_gated_copy_is_fused_as_its_original(tmp_path):
    """A trigger's control edge on a recomputed convolution kept Grappler from fusing it with
    its BiasAdd and ReLU as the original is; with oneDNN the two round differently (a CPU
    without AVX-512, issue 31). The copies wait through an Identity on their input instead."""
    original = conv_step(tmp_path / "step.meta")
    assert run_cli("optimize", original, "-o", tmp_path / "opt.meta").exit_code == 0
    steps = []
    for path in (original, tmp_path / "opt.meta"):
        model = io.load(path)
        steps.append(step.as_run_step(model, model.graph, step.analyse(model))[0])
    before, after = steps
    fused = [n for n in before.nodes() if before.op(n) == "_FusedConv2D"]
    copies = [n + COPY_SUFFIX for n in fused if n + COPY_SUFFIX in after]
    assert copies  # the rewrite recomputes some of them
    assert all(after.op(c) == "_FusedConv2D" and not after.control_inputs(c) for c in copies)
    gates = [n for n in after.nodes() if n.startswith(GATE_PREFIX)]
    assert gates and all(after.control_inputs(g) for g in gates)
