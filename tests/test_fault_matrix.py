"""Fault matrix: SIGKILL one rank (or raise ENOSPC) at enumerated points of saves and conversions.

Kill points are deterministic: `megatron_ucp.testing.faults.KillSwitch`, installed in the victim
process only, counts every write / fsync / rename / mkdir / rmtree / copy under the checkpoint
directory and SIGKILLs the process before point N. A fault-free run of the same save or conversion
lists the points first (the baseline); the matrix then picks points from that list: every
structural point (file creation, fsync, rename, replace, mkdir, rmtree) and seeded-random tensor
writes. Ranks are forked from one preloaded server (`faults.ForkLauncher`), ~2 s a launch instead
of ~9 s for a fresh torchrun-like launch, so the default run affords a few kill points per kind and
UCP_FULL_MATRIX=1 the whole matrix (>= 50 save kills over sync and async, >= 10 conversion kills).

After every save kill (2 ranks, TP2; iteration 2 committed, the victim dies in the save of 3):
`latest` names iteration 2 or a complete iteration 3; iteration 2 verifies and its tensors equal a
fault-free run's bitwise; iteration 3 is absent or verifies and equals the fault-free one; a left
`.iter_0000003.partial` is reported by `verify` (API and CLI); a fresh launch loads iteration 2 and
the save root and their raw megatron-core state equals the state dumped at those saves, bit for bit;
its next save removes the leftovers and commits. After every conversion kill: the source is
byte-for-byte unchanged, the output is absent (or complete and equal to a fault-free conversion)
and a retry into the same path succeeds and leaves no scratch behind. Disk full (ENOSPC from the
writers, and a real tmpfs where mounting one is permitted): a UCPError that says no space is left
and names the directory, nothing committed, `latest` unchanged.

The table (kind, victim rank, point, outcome) is printed by the last test (`pytest -s`) and written
as JSON to $UCP_FAULT_TABLE when set.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from megatron_ucp.testing.faults import CONVERSIONS, ForkLauncher

FULL = os.environ.get("UCP_FULL_MATRIX") == "1"
LAYOUT = "tp2"
FAULTS = "megatron_ucp.testing.faults"
PREV, NEW = "iter_0000002", "iter_0000003"
SAVE_KILLS_PER_MODE = 28 if FULL else 3  # full: 56 save kills over sync + async
CONVERT_KILLS_PER_KIND = 12 if FULL else 1  # full: 48 conversion kills over 4 conversions
MEGATRON_SOURCE = Path(__file__).parent / "fixtures" / "megatron_lm" / "torch_tp2_pp2" / "ckpt"
TABLE: list[dict] = []  # one row per injected fault, printed by test_fault_table


# ---------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ForkLauncher]]:
    """Both servers start together: their imports (~8 s each) overlap."""
    s = {"save": ForkLauncher(f"megatron_ucp.testing.scenarios,{FAULTS}"),
         "convert": ForkLauncher(f"megatron_ucp.conversion,{FAULTS}")}
    yield s
    for server in s.values():
        server.close()


def _launched(res: dict) -> str:
    return f"exit codes {res['codes']}; logs:\n" + "\n---\n".join(log[-2500:] for log in res["logs"])


def _tensors(path: Path) -> dict[tuple[str, str], torch.Tensor]:
    """Every (parameter, state) of a megatron-ucp checkpoint, read whole (checksums checked)."""
    from megatron_ucp.formats import open_source

    src = open_source(path, progress=False)
    return {(n, s): src.read(n, s, (0,) * len(p.shape), tuple(p.shape))
            for n, p in src.manifest.params.items() for s in p.states}


def _assert_same_tensors(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys(), f"{where}: parameters differ"
    for key, t in a.items():
        assert t.dtype == b[key].dtype and torch.equal(t, b[key]), f"{where}: {key} differs"


def _assert_same_dump(saved_dir: Path, loaded_dir: Path, where: str) -> None:
    """The raw megatron-core state loaded equals the state dumped at the save, bit for bit."""
    for rank in range(2):
        saved, loaded = (torch.load(d / f"rank{rank}.pt", weights_only=False)["params"]
                         for d in (saved_dir, loaded_dir))
        saved = {(e["chunk"], e["name"]): e for e in saved}
        loaded = {(e["chunk"], e["name"]): e for e in loaded}
        assert saved.keys() == loaded.keys(), f"{where}: rank {rank} parameters differ"
        for key, s in saved.items():
            lo = loaded[key]
            assert torch.equal(s["model"], lo["model"]), f"{where}: rank {rank} {key} model"
            assert s["range"] == lo["range"], f"{where}: rank {rank} {key} range"
            if s["range"] is not None:
                assert s["step"] == lo["step"], f"{where}: rank {rank} {key} step"
                for state in ("param", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(s[state], lo[state]), f"{where}: rank {rank} {key} {state}"


def _verify_cli(path: Path) -> str:
    """`megatron-ucp verify PATH` (the CLI's main, in this process): its stdout; exit 0 asserted."""
    from megatron_ucp import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["verify", str(path)])
    assert code == 0, f"megatron-ucp verify {path} exited {code}"
    return out.getvalue()


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _pick(points: list[list[str]], n: int, seed: int,
          reduced: list[tuple[int, Callable[[list[str]], int]]]) -> list[tuple[int, int]]:
    """(victim rank, 1-based point) pairs. Full: every structural point of every rank, then
    seeded-random tensor writes up to n. Reduced: `reduced` (rank, index chooser) only."""
    if not FULL:
        return [(rank, choose(points[rank]) + 1) for rank, choose in reduced][:n]
    structural = [(r, i + 1) for r, pts in enumerate(points) for i, p in enumerate(pts)
                  if not p.startswith("write ")]
    writes = [(r, i + 1) for r, pts in enumerate(points) for i, p in enumerate(pts)
              if p.startswith("write ")]
    rng = random.Random(seed)
    if len(structural) > n - 2 * bool(writes):
        # too many (a conversion to Megatron-LM): every rename and replace and the last two
        # points (the commit), then a sample of the rest; two writes besides
        key = [(r, i) for r, i in structural if points[r][i - 1].split()[0] in ("rename", "replace")
               or i > len(points[r]) - 2]
        rest = [x for x in structural if x not in key]
        room = n - 2 * bool(writes) - len(key)
        structural = sorted(key + rng.sample(rest, max(0, min(len(rest), room))))
    return structural + sorted(rng.sample(writes, max(0, min(len(writes), n - len(structural)))))


def _index(match: str, nth: int = 0) -> Callable[[list[str]], int]:
    """Chooser: the index of the nth point containing `match` (nth=-1: the last)."""
    return lambda pts: [i for i, p in enumerate(pts) if match in p][nth]


def _middle_write(pts: list[str]) -> int:
    writes = [i for i, p in enumerate(pts) if p.startswith("write ")]
    return writes[len(writes) // 2]


def _record(kind: str, rank: int, at: int, label: str, check: Callable[[], str]) -> dict:
    """Run one fault's checks; a failed assertion is a lost fault (kept for the table)."""
    row = {"kind": kind, "rank": rank, "point": at, "label": label}
    try:
        row.update(outcome="survived", state=check())
    except Exception as e:  # an assertion, or e.g. a half-written output that cannot be opened
        row.update(outcome="lost", state=f"{type(e).__name__}: {e}"[:2000])
    TABLE.append(row)
    return row


def _no_losses(rows: list[dict]) -> None:
    lost = [r for r in rows if r["outcome"] == "lost"]
    assert not lost, "lost faults:\n" + "\n\n".join(
        f"{r['kind']} rank {r['rank']} point {r['point']} ({r['label']}): {r['state']}" for r in lost)


# -------------------------------------------------------------------------------- save kills


class SaveBaselines:
    """The fault-free save per mode: its kill points per rank and its committed tensors."""

    def __init__(self, server: ForkLauncher, root: Path):
        self.server, self.root, self.cache = server, root, {}

    def get(self, mode: str) -> dict:
        if mode not in self.cache:
            d = self.root / f"baseline_{mode}"
            res = self.server.launch(2, f"{FAULTS}:save_kill_trial",
                                     {"layout": LAYOUT, "cfg": {}, "root": str(d / "ckpt"),
                                      "dump_dir": str(d / "dump"), "async_save": mode == "async",
                                      "victim": 0, "at": None})
            assert res["codes"] == [0, 0], _launched(res)
            assert [r["latest"] for r in res["results"]] == [NEW, NEW]
            self.cache[mode] = {"ckpt": d / "ckpt", "points": [r["points"] for r in res["results"]],
                                PREV: _tensors(d / "ckpt" / PREV), NEW: _tensors(d / "ckpt" / NEW)}
        return self.cache[mode]


@pytest.fixture(scope="module")
def save_baselines(servers, tmp_path_factory) -> SaveBaselines:
    return SaveBaselines(servers["save"], tmp_path_factory.mktemp("save_baselines"))


def _check_after_save_fault(root: Path, base: dict) -> str:
    """The on-disk state a fault left: returns 'old' (latest on iteration 2) or 'new'."""
    from megatron_ucp import storage
    from megatron_ucp.checks import verify
    from megatron_ucp.formats import manifest as mf

    latest = (root / "latest").read_text().strip()
    assert latest in (PREV, NEW), f"latest names {latest!r}"
    assert verify(root / PREV).startswith("OK "), "the previous checkpoint does not verify"
    _assert_same_tensors(_tensors(root / PREV), base[PREV], f"{root / PREV} vs the fault-free run")
    if (root / NEW).exists():  # complete (the rename is the commit) and equal, or absent
        assert verify(root / NEW).startswith("OK "), f"{NEW} exists but does not verify"
        _assert_same_tensors(_tensors(root / NEW), base[NEW], f"{root / NEW} vs the fault-free run")
    else:
        assert latest == PREV, f"latest names {latest} which does not exist"
    assert verify(root).startswith(f"OK {root / latest}:"), "latest does not resolve to what it names"
    stale = [p.name for p in storage.interrupted_saves(root, mf.MANIFEST)]
    assert stale in ([], [f".{NEW}.partial"]), f"unexpected leftovers {stale}"
    if stale:  # reported by verify, API and CLI, never loaded
        for report in (verify(root), _verify_cli(root)):
            assert stale[0] in report and "interrupted" in report, report
    entries = sorted(p.name for p in root.iterdir())
    tmp = [n for n in entries if n.startswith(".latest.tmp")]  # killed in write_text_atomic
    unexpected = [n for n in entries if n not in (PREV, NEW, "latest", f".{NEW}.partial", *tmp)]
    assert not unexpected, f"unexpected entries {entries}"
    return (f"latest={latest[-1]}" + (f", {NEW} complete" if (root / NEW).exists() else "")
            + (f", {stale[0]} reported" if stale else "") + (", .latest.tmp left" if tmp else ""))


def _check_resume(server: ForkLauncher, root: Path, dumps: Path, tmp: Path) -> None:
    """A fresh launch loads iteration 2 and then the save root: both bitwise as dumped at their
    saves; its save of iteration 4 removes the leftovers and commits."""
    from megatron_ucp.checks import verify

    latest = (root / "latest").read_text().strip()
    res = server.launch(2, f"{FAULTS}:resume_and_save",
                        {"layout": LAYOUT, "cfg": {}, "loads": [str(root / PREV), str(root)],
                         "dump_dir": str(tmp / "loaded"), "save_dir": str(root), "iteration": 4})
    assert res["codes"] == [0, 0], "resume failed: " + _launched(res)
    loaded = res["results"][0]["loaded"]
    assert [x["iteration"] for x in loaded] == [2, int(latest.removeprefix("iter_"))], loaded
    assert all(x["rng_restored"] for x in loaded), loaded
    _assert_same_dump(dumps / PREV, tmp / "loaded" / "0", f"load {PREV}")
    _assert_same_dump(dumps / latest, tmp / "loaded" / "1", f"load {root} ({latest})")
    assert (root / "latest").read_text().strip() == "iter_0000004"
    left = [p.name for p in root.iterdir() if p.name.startswith(".")]
    assert not left, f"the next save left {left}"
    report = verify(root)
    assert report.startswith(f"OK {root / 'iter_0000004'}:") and "interrupted" not in report, report


def _save_matrix(servers, save_baselines, tmp_path, mode: str,
                 reduced: list[tuple[int, Callable[[list[str]], int]]]) -> list[dict]:
    server, base = servers["save"], save_baselines.get(mode)
    rows = []
    for victim, at in _pick(base["points"], SAVE_KILLS_PER_MODE, seed=1 + (mode == "async"),
                            reduced=reduced):
        d = tmp_path / f"r{victim}_p{at}"
        label = base["points"][victim][at - 1]

        def check(d=d, victim=victim, at=at) -> str:
            res = server.launch(2, f"{FAULTS}:save_kill_trial",
                                {"layout": LAYOUT, "cfg": {}, "root": str(d / "ckpt"),
                                 "dump_dir": str(d / "dump"), "async_save": mode == "async",
                                 "victim": victim, "at": at})
            assert res["codes"][victim] == -9, "the victim was not SIGKILLed: " + _launched(res)
            state = _check_after_save_fault(d / "ckpt", base)
            _check_resume(server, d / "ckpt", d / "dump", d)
            return state

        rows.append(_record(f"save-{mode}", victim, at, label, check))
    return rows


def test_sync_save_kill_matrix(servers, save_baselines, tmp_path):
    rows = _save_matrix(servers, save_baselines, tmp_path, "sync", reduced=[
        (1, _middle_write),  # rank 1 half-way through its rank file
        (0, _index("rename")),  # rank 0: manifest written, rename not done
        (0, lambda pts: len(pts) - 1),  # latest replaced, its directory not fsynced yet
    ])
    _no_losses(rows)


def test_async_save_kill_matrix(servers, save_baselines, tmp_path):
    rows = _save_matrix(servers, save_baselines, tmp_path, "async", reduced=[
        (0, _middle_write),  # rank 0's background writer half-way through its file
        (0, _index("replace")),  # the manifest's atomic replace (commit in finalize)
        (0, _index("replace", -1)),  # iteration 3 renamed in, latest not replaced yet
    ])
    _no_losses(rows)


# -------------------------------------------------------------------------- conversion kills


class ConvertBaselines:
    """Per conversion kind: a private copy of its source, the source digest, the kill points and
    a fault-free output (the reference)."""

    def __init__(self, server: ForkLauncher, root: Path, save_baselines: SaveBaselines):
        self.server, self.root, self.saves, self.cache = server, root, save_baselines, {}

    def source(self, kind: str) -> Path:
        d = self.root / f"source_{kind}"
        if kind == "convert":
            shutil.copytree(self.saves.get("sync")["ckpt"], d)  # fragment save root
        elif kind == "reshard_universal":
            shutil.copytree(self.get("convert")["ref"], d)  # universal directory
        else:
            shutil.copytree(MEGATRON_SOURCE, d)  # Megatron-LM torch tp2 pp2
        return d

    def get(self, kind: str) -> dict:
        if kind not in self.cache:
            src = self.source(kind)
            ref = self.root / f"ref_{kind}" / "out"
            res = self.server.launch(1, f"{FAULTS}:convert_kill_trial",
                                     {"kind": kind, "source": str(src), "out": str(ref), "at": None})
            assert res["codes"] == [0] and res["results"][0]["error"] is None, _launched(res)
            self.cache[kind] = {"source": src, "digest": _tree_digest(src), "ref": ref,
                                "points": [res["results"][0]["points"]],
                                "tensors": _output_tensors(kind, ref, self.root / f"ref_{kind}")}
        return self.cache[kind]


@pytest.fixture(scope="module")
def convert_baselines(servers, save_baselines, tmp_path_factory) -> ConvertBaselines:
    return ConvertBaselines(servers["convert"], tmp_path_factory.mktemp("convert_baselines"),
                            save_baselines)


def _output_tensors(kind: str, out: Path, scratch: Path) -> dict:
    """A conversion output's tensors: universal outputs verified and read; Megatron-LM outputs
    converted back to universal first (a complete checkpoint converts, a partial one cannot)."""
    from megatron_ucp.checks import verify
    from megatron_ucp.conversion import convert

    if kind in ("convert", "reshard_universal"):
        assert verify(out).startswith("OK "), f"{out} does not verify"
        return _tensors(out)
    back = scratch / f"back_{out.parent.name}"
    shutil.rmtree(back, ignore_errors=True)
    fmt = {"reshard_torch": "megatron_torch", "reshard_torch_dist": "megatron_torch_dist"}[kind]
    convert(out, back, progress=False, fmt=fmt)
    try:
        return _tensors(back)
    finally:
        shutil.rmtree(back)


def _check_after_convert_fault(server: ForkLauncher, kind: str, base: dict, out: Path) -> str:
    from megatron_ucp.errors import UCPError

    assert _tree_digest(base["source"]) == base["digest"], "the conversion changed its source"
    left = sorted(p.name for p in out.parent.iterdir())
    if out.exists():  # committed before the kill: complete, equal, and a retry is refused
        _assert_same_tensors(_output_tensors(kind, out, out.parent.parent), base["tensors"],
                             f"{out} vs the fault-free conversion")
        from megatron_ucp.testing.faults import run_conversion

        with pytest.raises(UCPError, match="exists and is not empty"):
            run_conversion(kind, str(base["source"]), str(out))
        return f"complete; left {left}"
    res = server.launch(1, f"{FAULTS}:convert_kill_trial",
                        {"kind": kind, "source": str(base["source"]), "out": str(out), "at": None})
    assert res["codes"] == [0] and res["results"][0]["error"] is None, "retry failed: " + _launched(res)
    _assert_same_tensors(_output_tensors(kind, out, out.parent.parent), base["tensors"],
                         f"{out} (retried) vs the fault-free conversion")
    after = sorted(p.name for p in out.parent.iterdir())
    assert after == ["out"], f"the retry left {after}"
    assert _tree_digest(base["source"]) == base["digest"], "the retry changed its source"
    return f"absent, left {left}; retry ok"


def _relative(label: str, kind: str) -> str:
    """A baseline point's label with its output's parent directory left out."""
    return label.replace(f"ref_{kind}/", "").replace(f"ref_{kind}", "<parent>")


@pytest.mark.parametrize("kind", CONVERSIONS)
def test_conversion_kill_matrix(servers, convert_baselines, tmp_path, kind):
    server, base = servers["convert"], convert_baselines.get(kind)
    rows = []
    for _, at in _pick(base["points"], CONVERT_KILLS_PER_KIND, seed=10 + CONVERSIONS.index(kind),
                       reduced=[(0, _middle_write if kind != "reshard_universal"
                                 else _index("copy", 1))]):
        out = tmp_path / f"p{at}" / "out"
        out.parent.mkdir()

        def check(out=out, at=at) -> str:
            res = server.launch(1, f"{FAULTS}:convert_kill_trial",
                                {"kind": kind, "source": str(base["source"]), "out": str(out),
                                 "at": at})
            assert res["codes"] == [-9], "the conversion was not SIGKILLed: " + _launched(res)
            return _check_after_convert_fault(server, kind, base, out)

        label = _relative(base["points"][0][at - 1], kind)
        rows.append(_record(f"convert-{kind}", 0, at, label, check))
    _no_losses(rows)


# -------------------------------------------------------------------------------- disk full


def _assert_disk_full(error: str | None, directory: Path) -> None:
    assert error, "no error although the disk was full"
    assert "No space left on device" in error, error
    assert str(directory) in error, f"the error does not name {directory}: {error}"


@pytest.mark.parametrize("mode,rank,point", [
    ("sync", 1, "middle write"), ("async", 0, "manifest fsync"), ("sync", 0, "latest fsync")])
def test_disk_full_save(servers, save_baselines, tmp_path, mode, rank, point):
    """ENOSPC from a writer: a UCPError on every rank naming the checkpoint, `latest` unchanged."""
    from megatron_ucp.checks import verify

    base = save_baselines.get(mode)
    pts = base["points"][rank]
    choose, expect = {"middle write": (_middle_write, "write "),
                      "manifest fsync": (_index("fsync " + f"ckpt/.{NEW}.partial/.manifest"), "fsync"),
                      "latest fsync": (_index("fsync ckpt/.latest.tmp"), "fsync")}[point]
    at = choose(pts) + 1
    assert pts[at - 1].startswith(expect), pts[at - 1]
    root = tmp_path / "ckpt"

    def check() -> str:
        res = servers["save"].launch(2, f"{FAULTS}:save_kill_trial",
                                     {"layout": LAYOUT, "cfg": {}, "root": str(root),
                                      "dump_dir": str(tmp_path / "dump"), "async_save": mode == "async",
                                      "victim": rank, "at": at, "action": "enospc"})
        assert res["codes"] == [0, 0], _launched(res)
        for r in res["results"]:
            _assert_disk_full(r["error"], root / NEW)
            assert r["latest"] == PREV
        assert (root / "latest").read_text().strip() == PREV
        assert not (root / f".{NEW}.partial").exists(), "the failed save left its .partial"
        if (root / NEW).exists():  # renamed in before `latest` failed: complete, never named
            assert verify(root / NEW).startswith("OK ")
        assert verify(root).startswith(f"OK {root / PREV}:")
        _assert_same_tensors(_tensors(root / PREV), base[PREV], "previous after ENOSPC")
        return ("no commit, latest unchanged" + (f"; {NEW} complete, unnamed" if (root / NEW).exists()
                                                  else "")
                + " | rank 0: " + res["results"][0]["error"].replace(str(tmp_path), "<tmp>"))

    _no_losses([_record(f"enospc-save-{mode}", rank, at, pts[at - 1], check)])


@pytest.mark.parametrize("kind", ["convert", "reshard_torch"])
def test_disk_full_conversion(servers, convert_baselines, tmp_path, kind):
    base = convert_baselines.get(kind)
    at = _middle_write(base["points"][0]) + 1
    out = tmp_path / "out"

    def check() -> str:
        res = servers["convert"].launch(1, f"{FAULTS}:convert_kill_trial",
                                        {"kind": kind, "source": str(base["source"]), "out": str(out),
                                         "at": at, "action": "enospc"})
        assert res["codes"] == [0], _launched(res)
        error = res["results"][0]["error"]
        _assert_disk_full(error, out.parent)  # the output, or its scratch copy beside it
        assert error.startswith("UCPError"), error
        assert sorted(p.name for p in tmp_path.iterdir()) == [], "the failed conversion left files"
        assert _tree_digest(base["source"]) == base["digest"]
        return "no output | " + error.replace(str(tmp_path), "<tmp>")

    label = _relative(base["points"][0][at - 1], kind)
    _no_losses([_record(f"enospc-{kind}", 0, at, label, check)])


@contextlib.contextmanager
def _tmpfs(path: Path, size: int) -> Iterator[Path]:
    """A tmpfs of `size` bytes at `path`; skips where mounting is not permitted."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"mounting a tmpfs is not permitted here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_disk_full_tmpfs(servers, save_baselines, convert_baselines, tmp_path):
    """A real full disk: the tmpfs holds iteration 2 but not iteration 3 beside it; then a
    conversion into a tmpfs too small for the universal output."""
    from megatron_ucp.checks import verify

    base = save_baselines.get("sync")
    size = sum(f.stat().st_size for f in (base["ckpt"] / PREV).rglob("*") if f.is_file())
    rows = []
    with _tmpfs(tmp_path / "small", size + size // 2 + 64 * 1024) as fs:
        root = fs / "ckpt"

        def check_save() -> str:
            res = servers["save"].launch(2, f"{FAULTS}:save_kill_trial",
                                         {"layout": LAYOUT, "cfg": {}, "root": str(root),
                                          "dump_dir": str(tmp_path / "dump"), "async_save": False,
                                          "victim": 0, "at": None})
            assert res["codes"] == [0, 0], _launched(res)
            errors = [r["error"] for r in res["results"]]
            assert any(errors), "the save of iteration 3 fitted: make the tmpfs smaller"
            for e in errors:
                _assert_disk_full(e, root / NEW)
            assert (root / "latest").read_text().strip() == PREV
            assert not (root / NEW).exists() and not (root / f".{NEW}.partial").exists()
            assert verify(root).startswith(f"OK {root / PREV}:")
            _assert_same_tensors(_tensors(root / PREV), base[PREV], "previous after a full tmpfs")
            return "no commit, latest unchanged | " + next(e for e in errors if e).replace(
                str(tmp_path), "<tmp>")

        rows.append(_record("tmpfs-save-sync", -1, 0, "real ENOSPC", check_save))
    cbase = convert_baselines.get("convert")
    with _tmpfs(tmp_path / "tiny", 64 * 1024) as fs:
        out = fs / "out"

        def check_convert() -> str:
            res = servers["convert"].launch(1, f"{FAULTS}:convert_kill_trial",
                                            {"kind": "convert", "source": str(cbase["source"]),
                                             "out": str(out), "at": None})
            assert res["codes"] == [0], _launched(res)
            error = res["results"][0]["error"]
            _assert_disk_full(error, out)
            assert error.startswith("UCPError"), error
            assert list(fs.iterdir()) == [], "the failed conversion left files"
            return "no output | " + error.replace(str(tmp_path), "<tmp>")

        rows.append(_record("tmpfs-convert", -1, 0, "real ENOSPC", check_convert))
    _no_losses(rows)


# ---------------------------------------------------------------------------------- the table


def test_fault_table():
    """Runs last: prints the table, writes it to $UCP_FAULT_TABLE, and no fault was lost."""
    if not TABLE:
        pytest.skip("no fault ran (select the matrix tests too)")
    kinds: dict[str, dict[str, int]] = {}
    for r in TABLE:
        k = kinds.setdefault(r["kind"], {"injected": 0, "survived": 0, "lost": 0})
        k["injected"] += 1
        k[r["outcome"]] += 1
    lines = [f"{'kind':<28} {'rank':>4} {'point':>5}  {'outcome':<8}  at / state"]
    lines += [f"{r['kind']:<28} {r['rank']:>4} {r['point']:>5}  {r['outcome']:<8}  {r['label']}"
              f"  => {r['state']}" for r in TABLE]
    lines += ["", f"{'kind':<28} {'injected':>8} {'survived':>8} {'lost':>5}"]
    lines += [f"{k:<28} {v['injected']:>8} {v['survived']:>8} {v['lost']:>5}" for k, v in kinds.items()]
    total = {s: sum(v[s] for v in kinds.values()) for s in ("injected", "survived", "lost")}
    lines.append(f"{'total':<28} {total['injected']:>8} {total['survived']:>8} {total['lost']:>5}")
    print("\n" + "\n".join(lines))
    if os.environ.get("UCP_FAULT_TABLE"):
        Path(os.environ["UCP_FAULT_TABLE"]).write_text(
            json.dumps({"full": FULL, "rows": TABLE, "kinds": kinds, "total": total}, indent=1))
    assert total["lost"] == 0
    if FULL:
        saves = sum(v["injected"] for k, v in kinds.items() if k.startswith("save-"))
        converts = sum(v["injected"] for k, v in kinds.items() if k.startswith("convert-"))
        assert saves >= 50 and converts >= 10, (saves, converts)
