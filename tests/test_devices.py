"""Device profiles (`planning.devices`): their figures, and swap plans timed on them."""

import json
import pathlib
import statistics

import pytest
import tensorflow as tf

from graphrewrite.analysis.step import AnalysisOptions
from graphrewrite.core import io
from graphrewrite.core.errors import GraphRewriteError
from graphrewrite.pipeline import run as pipeline
from graphrewrite.planning import devices

MEASURED = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "gpu" / "h200.json"


def test_the_h200_profile_is_the_median_of_its_measured_runs():
    runs = json.loads(MEASURED.read_text())
    h200 = devices.PROFILES["h200"]
    assert h200.host_to_device == pytest.approx(
        statistics.median(runs["host_to_device_GBps"]["pinned"]) * 1e9)
    assert h200.device_to_host == pytest.approx(
        statistics.median(runs["device_to_host_GBps"]["pinned"]) * 1e9)
    assert h200.memory_bandwidth == pytest.approx(
        statistics.median(runs["hbm_copy_GBps_read_plus_write"]) * 1e9)
    assert h200.fp32_flops == pytest.approx(
        statistics.median(runs["matmul_8192_TFLOPs"]["fp32"]) * 1e12)
    assert h200.tf32_flops == pytest.approx(
        statistics.median(runs["matmul_8192_TFLOPs"]["tf32"]) * 1e12)
    assert "measured" in h200.source
    assert all("specification" in devices.PROFILES[n].source for n in ("a100", "v100"))


def test_the_default_profile_times_a_node_as_the_swap_pass_did_before_profiles():
    default = devices.PROFILES["default"]
    for flops, traffic in ((4e9, 1e6), (1e6, 9e8), (0, 0)):
        assert default.node_seconds("MatMul", flops, traffic) == \
            5e-6 + max(flops / 1e13, traffic / 9e11)
    assert default.host_to_device == 16e9


def test_tf32_runs_matrix_products_only():
    h200 = devices.PROFILES["h200"]
    assert h200.node_seconds("MatMul", 1e12, 0) < h200.node_seconds("Mul", 1e12, 0) / 7
    assert devices.PROFILES["v100"].node_seconds("MatMul", 1e12, 0) == \
        devices.PROFILES["v100"].node_seconds("Mul", 1e12, 0)  # no TF32 on a V100


def test_an_unknown_profile_is_refused_naming_the_known_ones():
    with pytest.raises(GraphRewriteError, match="unknown profile 'b200'.*h200"):
        devices.profile("b200")


def _tall_mlp(path, rows=8192, width=1024, layers=6):
    """Six matmul layers of a 1024-wide MLP at batch 8192 (32 MiB activations, 4 MiB fed
    weights): each layer's backward pass is 34 GFLOP of matmuls."""
    with tf.Graph().as_default() as graph:
        h = tf.compat.v1.placeholder(tf.float32, (rows, width), name="x")
        weights = [tf.compat.v1.placeholder(tf.float32, (width, width), name=f"w{i}")
                   for i in range(layers)]
        for i, w in enumerate(weights):
            h = tf.nn.relu(tf.matmul(h, w), name=f"relu{i}")
        loss = tf.reduce_mean(h, name="loss")
        for i, grad in enumerate(tf.gradients(loss, weights)):
            tf.identity(grad, name=f"grad{i}")
    path.write_bytes(graph.as_graph_def().SerializeToString())
    return io.load(path)


def test_swap_plans_follow_the_profile(tmp_path):
    """The issue's point: on an H200 a layer's backward matmuls run in TF32 at 400 TFLOP/s
    (0.1 ms) while a 32 MiB activation takes 0.6 ms over the 55 GB/s link, so the transfers a
    V100 hides (its FP32 matmuls take 3.4 ms a layer, the copy 2 ms) are exposed there: fewer
    tensors swap. On the cpu profile nothing does."""
    model = _tall_mlp(tmp_path / "mlp.pb")
    fetches = ["loss"] + [f"grad{i}" for i in range(6)]

    def swapped(profile):
        result = pipeline.optimize(model, "swap", AnalysisOptions(fetches=fetches), as_run=False,
                                   composed=f"swap(profile={profile})")
        return result.results["swap"]

    v100, h200, cpu = swapped("v100"), swapped("h200"), swapped("cpu")
    assert v100.swapped and v100.exposed_seconds == 0
    assert len(h200.swapped) < len(v100.swapped)
    assert "no backward node runs early enough to hide the transfer" in h200.skipped
    assert h200.transfer_seconds < v100.transfer_seconds  # a faster link
    assert (v100.device_profile, h200.device_profile) == ("v100", "h200")
    assert not cpu.modified and "one memory" in cpu.note


def test_the_cpu_profile_times_kernels_as_the_memory_model_times_the_cpu_executor():
    from graphrewrite.analysis import memory

    cpu = devices.profile("cpu")
    assert (cpu.fp32_flops, cpu.memory_bandwidth, cpu.node_overhead) == (
        memory.CPU_FLOPS, memory.CPU_BANDWIDTH, memory.CPU_KERNEL_SECONDS)


def test_the_swap_ins_share_one_link(tmp_path):
    """Each copy alone hides behind the backward matmuls before its reader, but the swap-ins
    run one after another on the link, each once its tensor is made and copied out: in the
    order they are needed, each ends by its first reader (here a copy takes two layers'
    backward time; timed each alone, three were swapped, one coming back 1.2 ms late)."""
    import itertools

    from graphrewrite.analysis import step

    model = _tall_mlp(tmp_path / "mlp.pb")
    fetches = ["loss"] + [f"grad{i}" for i in range(6)]
    found = step.analyse(model, options=AnalysisOptions(fetches=fetches))
    order, flow = found.memory.order, found.split.gradient_flow
    times = devices.node_times(model.graph, found.shapes, order, devices.profile("v100"))
    starts = dict(zip(order, itertools.accumulate([times[n] for n in order], initial=0.0)))
    copy = 2 * sum(times[name] for name in order if name in flow) / 6
    swap = pipeline.optimize(model, "swap", AnalysisOptions(fetches=fetches), as_run=False,
                             composed=f"swap(profile=v100, bandwidth={8192 * 1024 * 4 / copy})"
                             ).results["swap"]
    assert swap.swapped and swap.exposed_seconds == 0
    link = 0.0
    for needed, made in sorted((min(starts[r] for r in model.graph.successors(name)
                                    if r in flow), starts[name] + times[name])
                               for name in swap.swapped):
        link = max(link, made + copy) + copy
        assert link <= needed * (1 + 1e-9), swap.swapped
