"""Running passes: modes (named pipelines), pipeline text, `run.optimize`, plan files, and
the check that TensorFlow imports a rewrite before it is written."""

__all__ = ["grammar", "importable", "modes", "plan", "run"]
