"""Shared fixtures: multi-process source runs are expensive, so each (layout, config) runs once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from seaweed import s3_prefix, s3_server  # noqa: F401 (fixtures: an S3 server for the object-store tests)
from store_servers import STORE_SKIP, azure_server, gcs_server, store  # noqa: F401 (fixtures: every store)

from megatron_ucp.testing.launch import launch

SCENARIOS = "megatron_ucp.testing.scenarios"
STEPS = 3  # steps before the save and after the resume (warm-up 2, then cosine decay)
FULL = os.environ.get("UCP_FULL_MATRIX") == "1"
REPORT: dict[str, dict] = {}


# The supported megatron-core releases, as the Makefile and the README read them
MCORE_RELEASES = json.loads((Path(__file__).resolve().parent.parent / "configs" / "mcore_releases.json")
                            .read_text())
# Skips of tests that only one megatron-core release can run (make test runs every tested release)
RELEASE_SKIP = "release: "
# Skips of the Transformer Engine tests outside the TE venv (make test runs them in .venvte)
TE_SKIP = "transformer engine: "


def _legacy_grouped_mlp_mark():
    from megatron_ucp import mcore_compat

    return pytest.mark.skipif(
        not mcore_compat.has_legacy_grouped_mlp(),
        reason=f"{RELEASE_SKIP}{mcore_compat.release_name()} has no legacy GroupedMLP (removed in 0.19; "
               "--moe-grouped-gemm without Transformer Engine builds SequentialMLP there)")


# tests of megatron-core's legacy GroupedMLP (fused expert weights): 0.16-0.18 only
NEEDS_LEGACY_GROUPED_MLP = _legacy_grouped_mlp_mark()


def _mcore_19_mark():
    from megatron_ucp.mcore_compat import has_core_v019_enums, release_name

    return pytest.mark.skipif(
        not has_core_v019_enums(),
        reason=f"{RELEASE_SKIP}Megatron-LM core_v0.19.0's checkpoints pickle megatron-core 0.19 enums, "
               f"which {release_name()} lacks")


# tests of Megatron-LM core_v0.19.0's checkpoints (tests/fixtures/megatron_lm_v019): the 0.19 run
READS_CORE_V019_FILES = _mcore_19_mark()


def nprocs(layout: str) -> int:
    from megatron_ucp.layout import Layout

    return Layout.parse(layout).world_size


class SourceRuns:
    """Train at a layout, dump the state independently, save, continue (the reference)."""

    def __init__(self, root: Path):
        self.root = root
        self.cache: dict[tuple, dict] = {}

    def get(self, layout: str, cfg: dict) -> dict:
        key = (layout, json.dumps(cfg, sort_keys=True))
        if key not in self.cache:
            d = self.root / f"src_{len(self.cache)}_{layout}"
            res = launch(nprocs(layout), f"{SCENARIOS}:train_and_save",
                         {"layout": layout, "cfg": cfg, "steps": STEPS, "save_dir": str(d / "ckpt"),
                          "continue_steps": STEPS, "dump_dir": str(d / "dump"), "rng_dir": str(d / "rng")})
            self.cache[key] = {"dir": d, "ckpt": d / "ckpt", "dump": d / "dump", "rng": d / "rng", **res[0]}
        return self.cache[key]


@pytest.fixture(scope="session")
def source_runs(tmp_path_factory) -> SourceRuns:
    return SourceRuns(tmp_path_factory.mktemp("sources"))


# The skips `make test` expects on a CPU host (UCP_EXPECTED_SKIPS_ONLY=1 fails the run on any other,
# so a test that silently stops running is noticed): the full transition matrix, the GPU tests, the
# tests of the other megatron-core release, and the store cases an emulator cannot serve (named).
EXPECTED_SKIPS = ("UCP_FULL_MATRIX=1", "needs a CUDA GPU", RELEASE_SKIP, STORE_SKIP, TE_SKIP)
SKIPPED: dict[str, str] = {}


def pytest_runtest_logreport(report):
    if report.skipped and isinstance(report.longrepr, tuple):
        SKIPPED[report.nodeid] = report.longrepr[2].removeprefix("Skipped: ")


def pytest_sessionfinish(session, exitstatus):
    unexpected = {k: v for k, v in SKIPPED.items() if not v.startswith(EXPECTED_SKIPS)}
    if unexpected and os.environ.get("UCP_EXPECTED_SKIPS_ONLY") == "1":
        lines = "\n".join(f"  {k}: {v}" for k, v in sorted(unexpected.items()))
        print(f"\nunexpected skips ({len(unexpected)}; expected only {EXPECTED_SKIPS}):\n{lines}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if REPORT:
        out = Path(session.config.rootpath) / "out"
        out.mkdir(exist_ok=True)
        (out / "transition_report.json").write_text(json.dumps(REPORT, indent=1, sort_keys=True))
