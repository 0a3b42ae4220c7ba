"""What is known about a step without changing it: shapes, the forward/backward split,
parameters, FLOPs, the memory model (schedule, liveness, allocator, scratch, loops) and the step
as TensorFlow runs it (after Grappler). `step.analyse` runs them in order."""

__all__ = ["bfc", "bind", "flops", "grappler", "inline", "loop_shapes", "loops", "memory",
           "optimizers", "parameters", "schedule", "scratch", "shapes", "split", "state", "step"]
