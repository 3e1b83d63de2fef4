"""The step profile (pagedspec.bench.step_profile) on the shipped demo pair: every phase is
measured, the phases add up to the step, and speculation shows up as drafting time."""
from __future__ import annotations

import json

import pytest

from pagedspec.bench import step_profile

pytestmark = pytest.mark.usefixtures("one_thread")


def test_step_profile_splits_the_step(tmp_path):
    assert step_profile.main(["--quick", "--threads", "1", "--steps", "3", "--batch", "1,3",
                              "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "step_profile.json").read_text())["rows"]
    assert [(r["mode"].split()[0], r["batch"]) for r in rows] == \
           [("plain", 1), ("plain", 3), ("spec", 1), ("spec", 3)]
    for r in rows:
        phases = r["phases_ms"]
        assert set(phases) == set(step_profile.PHASES)
        assert all(v >= 0 for v in phases.values())
        assert phases["gemm"] > 0 and phases["attention"] > 0 and phases["sample_verify"] > 0
        # The clock covers the step from its first line to the outputs: only the loop's own
        # overhead between steps is left out.
        assert 0.8 * r["step_ms"] <= sum(phases.values()) <= 1.01 * r["step_ms"]
        assert (phases["drafting"] > 0) == r["mode"].startswith("spec")
    assert "outside GEMM+attn" in (tmp_path / "step_profile.md").read_text()


def test_step_profile_times_sampled_steps(tmp_path):
    """--temperature: the requests sample, and the mode says so."""
    assert step_profile.main(["--quick", "--threads", "1", "--steps", "3", "--batch", "2",
                              "--temperature", "0.7", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "step_profile.json").read_text())["rows"]
    assert [r["mode"].split(",")[-1].strip() for r in rows] == ["T=0.7", "T=0.7"]
    assert all(r["phases_ms"]["sample_verify"] > 0 for r in rows)
