"""Device profiles: how fast a device computes and moves bytes, for timing a step's schedule.

The swap pass times its swap-ins on a profile: a node takes the longer of its arithmetic (at the
device's FP32 rate, or its TF32 rate for the matrix products and convolutions TensorFlow runs in
TF32 by default on such GPUs) and its memory traffic, plus a launch overhead; a transfer takes
its bytes over the pinned host link (TensorFlow's GPU host allocator pins what it swaps). A
profile says where each figure comes from:

- `h200`: measured (fixtures/gpu/h200.json, by fixtures/gpu/gpu_profile.py beside it: the median
  of its two runs); TensorFlow cannot run on that machine, PyTorch measured it;
- `h100`: compute and memory from NVIDIA's H100 SXM5 specification (dense TF32, half the
  sparsity figure), the host link as measured on one (the same file's notes);
- `a100`, `v100`: NVIDIA's A100 SXM4 80 GB and V100 SXM2 specifications (PCIe 4.0 and 3.0 x16:
  32 and 16 GB/s each way; V100 has no TF32);
- `cpu`: host and device are one memory: nothing a swap moves leaves the device; its rates are
  those the memory model times the CPU executor's kernels at (measured on this project's
  2-core machine);
- `default`: the figures the swap pass used before profiles (a V100-class device: 10 TFLOP/s
  achieved, 900 GB/s, and Grappler's own 16 GB/s link), kept so an unnamed profile rewrites as
  before.

The launch overhead (5 us) is assumed for every GPU, not measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import GraphRewriteError

__all__ = ["DeviceProfile", "PROFILES", "TF32_OPS", "profile", "node_times"]

GB, TFLOP = 1e9, 1e12
# The ops TensorFlow runs in TF32 on Ampere and later GPUs unless told otherwise
# (`tf.config.experimental.enable_tensor_float_32_execution`, on by default).
TF32_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
                      "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3D",
                      "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2", "_FusedMatMul",
                      "_FusedConv2D", "DepthwiseConv2dNative"})


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    source: str                  # where the figures come from: measured, or whose specification
    fp32_flops: float            # FLOP/s
    tf32_flops: float | None     # FLOP/s of TF32 matrix products; None: no TF32
    memory_bandwidth: float      # device memory, bytes/s
    host_to_device: float        # pinned host memory to the device, bytes/s (a swap-in)
    device_to_host: float        # ... and back (a swap-out)
    node_overhead: float = 5e-6  # seconds a kernel takes at least (assumed)
    has_host: bool = True        # False: host and device are one memory (nothing to swap to)

    def node_seconds(self, op: str, flops: float, traffic: float) -> float:
        """A node's modelled time: launch overhead plus the longer of arithmetic and traffic."""
        rate = self.tf32_flops if self.tf32_flops and op in TF32_OPS else self.fp32_flops
        return self.node_overhead + max(flops / rate, traffic / self.memory_bandwidth)


PROFILES = {
    "default": DeviceProfile(
        "default", "assumed: a V100-class device (10 TFLOP/s achieved, 900 GB/s) and Grappler's "
        "16 GB/s host link: the swap pass's figures before device profiles",
        10 * TFLOP, None, 900 * GB, 16 * GB, 16 * GB),
    "h200": DeviceProfile(
        "h200", "measured on one H200 (fixtures/gpu/h200.json, median of two runs)",
        51.2 * TFLOP, 403.65 * TFLOP, 4252 * GB, 55.25 * GB, 55.15 * GB),
    "h100": DeviceProfile(
        "h100", "NVIDIA H100 SXM5 specification (FP32 67, dense TF32 494.5 TFLOP/s, HBM3 "
        "3.35 TB/s); host link measured on one (54.9 GB/s pinned)",
        67 * TFLOP, 494.5 * TFLOP, 3350 * GB, 54.9 * GB, 54.9 * GB),
    "a100": DeviceProfile(
        "a100", "NVIDIA A100 SXM4 80 GB specification (FP32 19.5, dense TF32 156 TFLOP/s, "
        "HBM2e 2,039 GB/s, PCIe 4.0 x16 32 GB/s each way)",
        19.5 * TFLOP, 156 * TFLOP, 2039 * GB, 32 * GB, 32 * GB),
    "v100": DeviceProfile(
        "v100", "NVIDIA V100 SXM2 specification (FP32 15.7 TFLOP/s, no TF32, HBM2 900 GB/s, "
        "PCIe 3.0 x16 16 GB/s each way)",
        15.7 * TFLOP, None, 900 * GB, 16 * GB, 16 * GB),
    "cpu": DeviceProfile(
        "cpu", "the host itself, device memory is host memory; measured on the 2-core machine "
        "of this project's CPU figures (analysis.memory's CPU_FLOPS, CPU_BANDWIDTH)",
        200e9, None, 8.6 * GB, float("inf"), float("inf"), node_overhead=5e-6, has_host=False),
}


def profile(name: str) -> DeviceProfile:
    """The profile called `name`, or an error naming those there are."""
    if name not in PROFILES:
        raise GraphRewriteError(f"${{device_profile}}: unknown profile '{name}' (profiles: "
                                f"{', '.join(PROFILES)})")
    return PROFILES[name]


def node_times(graph, shapes, order: list[str], device: DeviceProfile) -> dict[str, float]:
    """Each node of `order` (a schedule) timed on `device`: its FLOPs and the bytes it reads
    and writes. Their sum is the step's modelled time (kernels one after another)."""
    from ..analysis import flops  # not at import: the CLI lists the profiles without TensorFlow

    return {name: device.node_seconds(graph.op(name), flops.node_flops(graph, shapes, name),
                                      flops.node_traffic(graph, shapes, name))
            for name in order}
