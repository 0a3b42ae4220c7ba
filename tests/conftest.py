"""Shared test helpers: the fixture catalogue, hand-made GraphDefs, and a CLI runner."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from graphrewrite.execution.measure import measurement_environment  # noqa: E402  (no TensorFlow import)

measurement_environment()  # as the CLI does, before TensorFlow loads: oneDNN off for `verify`

from click.testing import CliRunner  # noqa: E402
from tensorflow.core.framework import graph_pb2  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
GOLDENS = FIXTURES / "goldens"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]
FIXTURE_NAMES = [f["name"] for f in MANIFEST]


def fixture_path(name: str) -> Path:
    entry = next(f for f in MANIFEST if f["name"] == name)
    return FIXTURES / entry["file"]


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true",
                     help="rewrite golden files from the current output instead of comparing")


@pytest.fixture
def update_goldens(request) -> bool:
    return request.config.getoption("--update-goldens")


def graph_def(*nodes, versions: bool = True) -> graph_pb2.GraphDef:
    """A GraphDef from (name, op, [inputs]) triples; ops get a float `T` where they need one."""
    out = graph_pb2.GraphDef()
    if versions:
        out.versions.producer = 1645
    for name, op, inputs in nodes:
        node = out.node.add(name=name, op=op)
        node.input.extend(inputs)
        if op == "Placeholder":
            node.attr["dtype"].type = 1
        elif op not in ("NoOp",):
            node.attr["T"].type = 1
    return out


def run_cli(*args: str):
    """Run the `graphrewrite` command in-process; returns click's Result (stdout/stderr apart).
    The library's logger is left as it was: the command points it at its own stderr and stops
    it propagating, which would hide later tests' log records from `caplog`."""
    from graphrewrite.cli.main import main

    logger = logging.getLogger("graphrewrite")
    saved = (logger.handlers[:], logger.propagate, logger.level)
    try:
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    finally:
        logger.handlers[:], logger.propagate, logger.level = saved
