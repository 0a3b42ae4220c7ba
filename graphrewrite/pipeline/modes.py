"""Modes: named rewrite pipelines. Kept apart from `pipeline` (which imports the passes, and so
TensorFlow) so that `graphrewrite --help` can list them without loading TensorFlow."""

__all__ = ["MODES", "MODE_HELP"]

MODES: dict[str, str] = {
    "none": "",
    "memory": "inline ungate loop_recompute rerun defer accumulate(min_share=0.1) "
              "micro_batches recompute(policy=memory) serialize tails_first apply_early",
    "speed": "inline defer(terms=false) recompute(policy=speed)",
    "collection": "inline recompute(policy=collection)",
    "manual": "recompute(policy=manual) swap(policy=manual)",
    "swap": "inline swap",
    "diet": "diet",
}
MODE_HELP = {
    "none": "load, check and save; nothing rewritten",
    "memory": "keep ~sqrt(N) bottleneck activations, recompute the rest (most memory saved); "
              "updates no longer wait behind a gate for every gradient (ungate: GATE_GRAPH's "
              "tuple, resource variables); optimizer arithmetic on the parameters alone waits "
              "for its gradient, and a gradient term computed long before the other terms of "
              "its sum waits for them (defer); a recurrent layer's step values computed again "
              "in its gradient loop (loop_recompute) and its forward pass run again before its "
              "backward pass (rerun); a sum of gradient terms holding a tenth of the peak adds "
              "each as it arrives (accumulate); micro-batches whose gradients are summed, a "
              "tape each, run one after another (micro_batches); the convolution gradients run "
              "one at a time (serialize: their scratch is not held at once; so do a loop of "
              "micro-batches' iterations); a head's backward pass waits for another head's "
              "loss gradient where that lowers the peak as run (tails_first); each parameter's "
              "update runs before the backward pass goes on (apply_early, kept where the peak "
              "as run does not rise)",
    "speed": "keep outputs of MatMul/Conv/Einsum, recompute cheap ops (least slowdown); defer "
             "(its early gradient terms left to run when ready, beside the others)",
    "collection": "keep what --checkpoints selects (or the 'checkpoints' collection)",
    "manual": "recompute what _recompute_hint marks, swap what _swap_to_host marks (or --swap)",
    "swap": "move long-lived activations to host memory and back (--swap-form, --budget)",
    "diet": "16-bit variables dequantized where read (those the step only reads too), a lean "
            "Adam state (factored second moment, no first moment), other momentum (SGD's, "
            "RMSProp's, Lion's) in bfloat16, stochastic rounding; other optimizers (Nadam, "
            "Adamax, hand-written): weights 16-bit, their state bfloat16; frozen graphs: 16-bit "
            "constants. Lossy: check with verify --steps N --rtol R. Options: --passes "
            "'diet(format=int16|bfloat16, scale=0.000305, momentum=auto|drop|keep|bfloat16, "
            "factored=true, rounding=stochastic|nearest, min_size=1024, "
            "reads=priced|gated|ungated, read_only=true, generic=true)'",
}
