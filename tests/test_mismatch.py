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


def test_an_unseeded_random_draw_is_seeded_by_its_name_and_matches_itself(tmp_path):
    """A random op without a seed drew anew in every run: the graph differed from itself, and
    verify could only say why (`measure.seeded` now gives it one from its name, as it gives the
    same op of a rewrite)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [64], name="x")
        tf.identity(x + tf.random.uniform([64]), name="out")
    path = tmp_path / "noisy.pb"
    path.write_bytes(graph.as_graph_def().SerializeToString())
    noisy = io.load(path)
    outcome = verify.verify(noisy, noisy, verify.VerifyOptions(fetches=["out"], runs=0),
                            isolated=False)
    assert outcome.match and outcome.max_abs_diff == 0.0 and outcome.cause == ""


def test_an_original_that_differs_from_itself_now_and_then_is_named(monkeypatch):
    """One run of three differs (the ViT with AdamW): two agreeing runs are not enough."""
    runs = iter(["step", "step", "other", "step", "step"])
    monkeypatch.setattr(mismatch.measure, "run_step", lambda *a, **k: next(runs))
    cause = mismatch.diagnose(tf.compat.v1.GraphDef(), tf.compat.v1.GraphDef(), {}, {}, ["out"],
                              lambda a, b: a == b, isolated=False)
    assert cause == mismatch.ORIGINAL_CAUSE


def test_an_addn_whose_buffer_reuse_races_is_named():
    """A ViT's original differed from itself now and then: its LayerNorm gradient's AddN_4 of
    four inputs summed from the first buffer it could reuse (TensorFlow's AddN), found by
    comparing every tensor of 16 runs. Three inputs, one read elsewhere too: named; two
    inputs (the sum commutes), or none read elsewhere: not."""
    graph = _racing_sum_graph()
    with graph.as_default():
        a, b, c = (graph.get_tensor_by_name(f"{n}:0") for n in "abc")
        tf.add_n([a * 3.0, b * 3.0, c * 3.0], name="alone")
        tf.add_n([graph.get_tensor_by_name("shared:0"), b], name="two")
    assert mismatch.racing_sums(graph.as_graph_def()) == ["racing"]


def _racing_sum_graph():
    """AddN `racing` of three inputs, one of which (`shared`) another op reads too."""
    graph = tf.Graph()
    with graph.as_default():
        a, b, c = (tf.compat.v1.placeholder(tf.float32, [8], name=n) for n in "abc")
        shared = tf.identity(a * 2.0, name="shared")
        tf.add_n([shared, b * 1.0, c * 1.0], name="racing")
        tf.identity(shared, name="other_reader")
    return graph


def test_an_original_whose_sums_race_is_named_when_its_runs_agree(monkeypatch):
    """An MLP-Mixer built outside the repo: its LayerNorm gradients' AddNs race; its three runs
    agreed by chance and Grappler was blamed for the rewrite's difference."""
    graph = _racing_sum_graph()
    monkeypatch.setattr(mismatch.measure, "run_step", lambda *a, **k: "step")
    cause = mismatch.diagnose(graph.as_graph_def(), graph.as_graph_def(), {}, {}, ["out"],
                              lambda a, b: a == b, isolated=False)
    assert cause.startswith(mismatch.SUM_ORDER_CAUSE) and "'racing'" in cause, cause


def test_a_rewrite_that_repeats_the_originals_outputs_when_run_again_is_named(monkeypatch):
    """A PointNet built outside the repo: its original gave three results in eleven runs (a
    batch norm's gradient sum no other op reads), its three runs here agreed, and Grappler was
    blamed; run again, the rewrite gave the original's outputs."""
    runs = iter(["step", "step", "step", "step"])  # three of the original, one rewritten
    monkeypatch.setattr(mismatch.measure, "run_step", lambda *a, **k: next(runs))
    cause = mismatch.diagnose(tf.compat.v1.GraphDef(), tf.compat.v1.GraphDef(), {}, {}, ["out"],
                              lambda a, b: a == b, isolated=False)
    assert cause == mismatch.UNSTABLE_CAUSE


def looped_draws(parallel_iterations):
    """A TF2 step's GraphDef: a while loop adding a seeded uniform draw each iteration."""
    @tf.function(input_signature=[tf.TensorSpec([64], tf.float32)])
    def step(x):
        return tf.while_loop(lambda i, v: i < 8,
                             lambda i, v: (i + 1, v + tf.random.uniform([64], seed=1)),
                             [0, x], parallel_iterations=parallel_iterations)[1]
    return step.get_concrete_function().graph.as_graph_def()


def test_random_draws_in_a_loop_are_named_before_anything_runs(monkeypatch):
    """A Keras LSTM with recurrent dropout draws its masks in the loop: the order of the draws
    is a race, which three runs of the original need not show (and with the arithmetic
    optimizer off the two agreed by chance, blaming it)."""
    graph_def = looped_draws(parallel_iterations=10)
    found = mismatch.racing_draws(graph_def)
    assert len(found) == 1 and found[0].endswith("RandomUniform")
    monkeypatch.setattr(mismatch.measure, "run_step", lambda *a, **k: pytest.fail("ran"))
    cause = mismatch.diagnose(graph_def, graph_def, {}, {}, ["out"], lambda a, b: a == b,
                              isolated=False)
    assert cause.startswith(mismatch.RACING_CAUSE) and found[0] in cause


def test_random_draws_in_a_loop_of_one_iteration_at_a_time_are_ordered():
    assert mismatch.racing_draws(looped_draws(parallel_iterations=1)) == []


def test_two_writes_of_one_variable_nothing_orders_are_named():
    """A TF1 multi-tower step built outside the repo differed from itself: each tower updates
    the batch norms' shared moving averages, and nothing orders the two updates. Writes one
    after the other, or outside the fetched step (an initializer), are not named."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.disable_resource_variables()
        racing = tf.compat.v1.Variable(tf.zeros([4]), name="racing")
        ordered = tf.compat.v1.Variable(tf.zeros([4]), name="ordered")
        tf.compat.v1.enable_resource_variables()
        x = tf.compat.v1.placeholder(tf.float32, [4], name="x")
        first = tf.compat.v1.assign_sub(racing, x, name="tower_0")
        second = tf.compat.v1.assign_sub(racing, 2 * x, name="tower_1")
        then = tf.compat.v1.assign_add(ordered, x, name="then")
        with tf.control_dependencies([then]):
            after = tf.compat.v1.assign_add(ordered, x, name="after")
        tf.group(first, second, after, name="step")
    assert mismatch.unordered_writes(graph.as_graph_def(), ["step"]) == ["racing"]
