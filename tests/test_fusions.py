"""`analysis.fusions`: a rewrite must not change which one-column matrix products Grappler's
remapper fuses (fused and unfused round differently on the CPU: a GAN's logit, issue 31)."""

from conftest import graph_def

from graphrewrite.analysis.fusions import refused
from graphrewrite.analysis.shapes import Shapes, TensorInfo
from graphrewrite.core.graph import Graph
from graphrewrite.core.names import COPY_SUFFIX
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
