"""Running graphs in TensorFlow sessions: measured peaks and step times, `verify`, and
why a rewrite's outputs differ. The rewrite path never imports this layer."""

__all__ = ["measure", "mismatch", "trace", "verify"]
