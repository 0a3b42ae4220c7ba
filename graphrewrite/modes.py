"""Modes: named rewrite pipelines. Kept apart from `pipeline` (which imports the passes, and so
TensorFlow) so that `graphrewrite --help` can list them without loading TensorFlow."""

MODES: dict[str, str] = {
    "none": "",
    "memory": "recompute(policy=memory)",
    "speed": "recompute(policy=speed)",
    "collection": "recompute(policy=collection)",
    "manual": "recompute(policy=manual) swap(policy=manual)",
    "swap": "swap",
}
MODE_HELP = {
    "none": "load, check and save; nothing rewritten",
    "memory": "keep ~sqrt(N) bottleneck activations, recompute the rest (most memory saved)",
    "speed": "keep outputs of MatMul/Conv/Einsum, recompute cheap ops (least slowdown)",
    "collection": "keep what --checkpoints selects (or the 'checkpoints' collection)",
    "manual": "recompute what _recompute_hint marks, swap what _swap_to_host marks (or --swap)",
    "swap": "move long-lived activations to host memory and back (--swap-form, --budget)",
}
