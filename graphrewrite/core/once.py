"""Warnings said once over repeated work: a planner that runs the same analyses and passes
many times (every lever set of a budget, every batch probed) would repeat each warning as
often (a Keras Adamax step's diet warning, 12 times)."""

from __future__ import annotations

import contextlib
import logging

__all__ = ["SaidOnce", "each_warning_once"]


class SaidOnce(logging.Filter):
    """Drops a record its logger already said with the same text, at `level` and above."""

    def __init__(self, level: int = logging.NOTSET):
        super().__init__()
        self.level, self.said = level, set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.level:
            return True
        key = (record.name, record.levelno, record.getMessage())
        fresh = key not in self.said
        self.said.add(key)
        return fresh


@contextlib.contextmanager
def each_warning_once(package: str = "graphrewrite"):
    """Within the block, a record logged again by the same logger of `package` with the same
    text is dropped."""
    first = SaidOnce()
    loggers = [logging.getLogger(package)] + [
        logger for name, logger in logging.Logger.manager.loggerDict.items()
        if name.startswith(package + ".") and isinstance(logger, logging.Logger)]
    for logger in loggers:
        logger.addFilter(first)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(first)
