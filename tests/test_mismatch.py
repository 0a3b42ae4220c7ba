"""verify names the cause of a mismatch Grappler's arithmetic optimizer makes (issue 14's GELU MLP).

The smallest form of it: `c * (a * b)` with a scalar c that is not a power of two. Grappler sorts
the inputs of commutative ops by node name and MinimizeBroadcasts pairs the scalar with the first
of them, so renaming `a` (as a recomputed copy is renamed) turns `(c * a) * b` into
`(c * b) * a`, which rounds differently, though the graph computes the same thing.
"""

import numpy as np
import pytest
import tensorflow as tf

from graphrewrite.core import io
from graphrewrite.execution import mismatch, verify

pytestmark = pytest.mark.tf

SQRT_2_OVER_PI = np.float32(np.sqrt(2 / np.pi))  # the GELU gradient's constant


def scaled_product(path, first_name, scale=SQRT_2_OVER_PI):
    """A GraphDef computing out = scale * (sin(x) * cos(x)), sin named `first_name`."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4096], name="x")
        product = tf.multiply(tf.sin(x, name=first_name), tf.cos(x, name="b"), name="m")
        tf.identity(tf.multiply(scale, product, name="root"), name="out")
    path.write_bytes(graph.as_graph_def().SerializeToString())
    return io.load(path)


def test_a_renamed_operand_mismatch_is_traced_to_the_arithmetic_optimizer(tmp_path):
    original = scaled_product(tmp_path / "original.pb", "a")
    renamed = scaled_product(tmp_path / "renamed.pb", "z")  # sorts after "b" now
    outcome = verify.verify(original, renamed, verify.VerifyOptions(fetches=["out"], runs=0),
                            isolated=False)
    assert not outcome.match and 0 < outcome.max_abs_diff < 1e-6
    assert outcome.cause == mismatch.ARITHMETIC_CAUSE
    assert outcome.to_json()["cause"] == mismatch.ARITHMETIC_CAUSE


def test_a_real_difference_gets_no_cause(tmp_path):
    original = scaled_product(tmp_path / "original.pb", "a")
    changed = scaled_product(tmp_path / "changed.pb", "a", scale=np.float32(0.8))
    outcome = verify.verify(original, changed, verify.VerifyOptions(fetches=["out"], runs=0),
                            isolated=False)
    assert not outcome.match and outcome.cause == ""
    assert outcome.to_json()["cause"] is None


def test_matching_graphs_are_not_run_again(tmp_path, monkeypatch):
    original = scaled_product(tmp_path / "original.pb", "a")
    monkeypatch.setattr(mismatch, "diagnose", lambda *a, **k: pytest.fail("diagnosed a match"))
    outcome = verify.verify(original, original, verify.VerifyOptions(fetches=["out"], runs=0),
                            isolated=False)
    assert outcome.match and outcome.cause == ""


def test_an_original_that_differs_from_itself_is_named(tmp_path):
    """An unseeded random draw differs from run to run: no rewrite can match it bitwise, and
    the cause says so instead of blaming Grappler or the rewrite, and names the missing seed
    (a graph exported unseeded was taken for a nondeterministic step)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [64], name="x")
        tf.identity(x + tf.random.uniform([64]), name="out")
    path = tmp_path / "noisy.pb"
    path.write_bytes(graph.as_graph_def().SerializeToString())
    noisy = io.load(path)
    outcome = verify.verify(noisy, noisy, verify.VerifyOptions(fetches=["out"], runs=0),
                            isolated=False)
    assert not outcome.match and outcome.cause.startswith(mismatch.ORIGINAL_CAUSE)
    assert "1 of its random ops have no seed" in outcome.cause


def test_an_original_that_differs_from_itself_now_and_then_is_named(monkeypatch):
    """One run of three differs (the ViT with AdamW): two agreeing runs are not enough."""
    runs = iter(["step", "step", "other", "step", "step"])
    monkeypatch.setattr(mismatch.measure, "run_step", lambda *a, **k: next(runs))
    cause = mismatch.diagnose("original", "rewritten", {}, {}, ["out"], lambda a, b: a == b,
                              isolated=False)
    assert cause == mismatch.ORIGINAL_CAUSE
