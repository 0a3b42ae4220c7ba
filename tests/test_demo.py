"""`make demo` shows what graphrewrite is for (issue 32): a Keras CNN's TF2 training step, cut
well below half and bitwise; the README says what it measures."""

import json
import re
from pathlib import Path

import pytest

from graphrewrite.core import io
from graphrewrite.execution import verify

from conftest import FIXTURES, MANIFEST, run_cli

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def _demo():
    """The Makefile's DEMO fixture and its manifest entry."""
    path = re.search(r"^DEMO\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    entry = next(e for e in MANIFEST if FIXTURES / e["file"] == ROOT / path)
    return ROOT / path, entry


def _readme_demo_peaks():
    """The demo's measured peaks as the README states them: ranges (low, high) before, after."""
    text = " ".join((ROOT / "README.md").read_text().split())
    passage = text.split("The demo's step,")[1].split("Other targets")[0]
    found = [float(g) for g in re.search(r"(\d+)-(\d+) MiB -> (\d+)-(\d+) MiB", passage).groups()]
    return found[:2], found[2:]


def test_demo_is_a_keras_training_step_modelled_well_below_half(tmp_path):
    path, entry = _demo()
    assert entry["kind"] == "tf2_step" and "Keras CNN" in entry["description"]
    ran = run_cli("optimize", path, "-o", tmp_path / path.name, "--json")
    assert ran.exit_code == 0, ran.stderr
    peaks = json.loads(ran.stdout)["peak_bytes_as_run"]
    assert peaks["after"] < 0.4 * peaks["before"], peaks


@pytest.mark.tf
def test_demo_measures_well_below_half_bitwise_as_the_readme_says(tmp_path):
    path, _ = _demo()
    out = tmp_path / path.name
    assert run_cli("optimize", path, "-o", out).exit_code == 0
    checked = verify.verify(io.load(path), io.load(out), verify.VerifyOptions(runs=0),
                            isolated=False)
    assert checked.match, checked.to_json()["mismatched"]
    before, after = checked.original.peak_bytes / MiB, checked.rewritten.peak_bytes / MiB
    assert after < 0.4 * before, (before, after)
    (low_before, high_before), (low_after, high_after) = _readme_demo_peaks()
    assert 0.95 * low_before <= before <= 1.05 * high_before, (before, low_before, high_before)
    assert 0.9 * low_after <= after <= 1.1 * high_after, (after, low_after, high_after)
