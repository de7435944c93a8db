"""The GPU check's wheels (tools/gpu/wheels.txt): download them here, check them, install them there.

    python3 tools/gpu/wheels.py download [--update] [--pythons 3.12]  # `make gpu-wheels`: into .whl/
    python3 tools/gpu/wheels.py check [--install-test]
    python3 tools/gpu/wheels.py install --target DIR  # on the GPU machine: what its Python lacks

`download` runs `pip download --no-deps --only-binary=:all:` per row for that row's Python (the
GPU image's Python is not known here: 3.10, 3.11 and 3.12 are carried), compares bytes and sha256
with the list (`--update` rewrites them instead), removes unlisted files and fails when the folder
is over WHEEL_BUDGET_MIB. `check` needs no network and no folder: without the folder it checks the
list alone. `install` picks, for the Python that runs it, the rows whose `need` says so and installs
them offline with pip (`--no-index --no-deps --target`), or unzips them where that Python has no pip.
Every command prints what travels to the GPU machine (tracked + untracked-not-ignored files +
the wheels) against the device tool's 64 MiB.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIST = ROOT / "tools" / "gpu" / "wheels.txt"
WHEEL_DIR = ROOT / ".whl"
PYTHONS = ("3.10", "3.11", "3.12")  # the GPU image's plausible Pythons (3.12.3 when last seen)
WHEEL_BUDGET_MIB = 12.0  # the folder; the whole working tree that travels is limited to 64 MiB
TRAVEL_LIMIT_MIB = 64.0
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
MIB = 1 << 20
SELECTED = "SELECTED"  # in the folder: the Pythons `download --pythons` fetched for (default: all)


@dataclass
class Row:
    python: str  # "3.12" or "any"
    dist: str
    version: str
    module: str  # the import that says whether the image has it
    need: str  # "always", "present" or ">=X"
    nbytes: int | None
    sha256: str | None
    file: str | None

    def pythons(self) -> tuple[str, ...]:
        return PYTHONS if self.python == "any" else (self.python,)

    def line(self) -> str:
        return " ".join([f"{self.python:<8}", f"{self.dist:<13}", f"{self.version:<7}", f"{self.module:<13}",
                         f"{self.need:<8}", f"{self.nbytes if self.nbytes is not None else '-':<8}",
                         self.sha256 or "-", self.file or "-"])


def read_list(path: Path = LIST) -> tuple[list[str], list[Row]]:
    """The comment lines (kept by --update) and the rows of wheels.txt."""
    head, rows = [], []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            head.append(line)
            continue
        f = line.split()
        if len(f) != 8:
            raise SystemExit(f"{path}:{n}: expected 8 columns, got {len(f)}: {line!r}")
        rows.append(Row(f[0], f[1], f[2], f[3], f[4], None if f[5] == "-" else int(f[5]),
                        None if f[6] == "-" else f[6], None if f[7] == "-" else f[7]))
    return head, rows


def write_list(head: list[str], rows: list[Row], path: Path = LIST) -> None:
    path.write_text("\n".join(head + [r.line() for r in rows]) + "\n")


def _tags(file: str) -> tuple[str, str, str, str, str]:
    """(distribution, version, python tag, abi tag, platform tag) of a wheel file name."""
    parts = file[:-len(".whl")].split("-")
    if not file.endswith(".whl") or len(parts) not in (5, 6):
        raise ValueError(f"not a wheel file name: {file}")
    return parts[0], parts[1], parts[-3], parts[-2], parts[-1]


def fits(file: str, python: str) -> bool:
    """Can CPython `python` (e.g. "3.11") on x86-64 Linux install this wheel?"""
    _, _, py, abi, plat = _tags(file)
    minor = int(python.split(".")[1])
    plat_ok = plat == "any" or all(p.startswith(("manylinux", "linux")) and p.endswith("x86_64")
                                   for p in plat.split("."))
    py_ok = False
    for tag in py.split("."):
        m = re.fullmatch(r"(cp|py)3(\d*)", tag)
        if not m:
            continue
        n = int(m.group(2)) if m.group(2) else None
        if n is None or n == minor or (abi == "abi3" and n <= minor) or (m.group(1) == "py" and n <= minor):
            py_ok = True
    return py_ok and plat_ok


def list_problems(rows: list[Row]) -> list[str]:
    """What is wrong with the list itself (no folder needed)."""
    out = []
    for r in rows:
        where = f"{r.dist} {r.version} ({r.python})"
        if r.python != "any" and r.python not in PYTHONS:
            out.append(f"{where}: python must be one of {PYTHONS} or 'any'")
        if r.need not in ("always", "present") and not re.fullmatch(r">=\d+(\.\d+)*", r.need):
            out.append(f"{where}: need must be always, present or >=X, not {r.need!r}")
        if r.nbytes is None or r.sha256 is None or r.file is None:
            out.append(f"{where}: bytes, sha256 and file not filled in (make gpu-wheels, then "
                       "tools/gpu/wheels.py download --update)")
            continue
        if not re.fullmatch(r"[0-9a-f]{64}", r.sha256):
            out.append(f"{where}: sha256 is not 64 hex digits")
        try:
            dist, version, *_ = _tags(r.file)
        except ValueError as e:
            out.append(f"{where}: {e}")
            continue
        if dist.lower().replace("_", "-") != r.dist.lower() or version != r.version:
            out.append(f"{where}: file {r.file} is not {r.dist} {r.version}")
        for py in r.pythons():
            if not fits(r.file, py):
                out.append(f"{where}: {r.file} does not install on CPython {py} x86-64")
    for py in PYTHONS:
        mc = [r for r in rows if r.dist == "megatron-core" and py in r.pythons()]
        if len(mc) != 1:
            out.append(f"Python {py}: {len(mc)} megatron-core rows, expected 1")
    files = [r.file for r in rows if r.file]
    if len(files) != len(set(files)):
        out.append("a file is listed twice")
    total = sum(r.nbytes or 0 for r in rows)
    if total > WHEEL_BUDGET_MIB * MIB:
        out.append(f"the wheels total {total / MIB:.1f} MiB, over the {WHEEL_BUDGET_MIB:.0f} MiB budget")
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def selected(folder: Path) -> tuple[str, ...]:
    """The Pythons the folder was filled for (its SELECTED file; all of PYTHONS without one)."""
    f = folder / SELECTED
    return tuple(f.read_text().split()) if f.is_file() else PYTHONS


def for_pythons(rows: list[Row], pythons: tuple[str, ...]) -> list[Row]:
    return [r for r in rows if set(r.pythons()) & set(pythons)]


def folder_problems(rows: list[Row], folder: Path) -> list[str]:
    out = []
    listed = {r.file for r in rows if r.file} | {SELECTED}
    rows = for_pythons(rows, selected(folder))
    for r in rows:
        if not r.file:
            continue
        p = folder / r.file
        if not p.is_file():
            out.append(f"{folder.name}/{r.file}: missing (make gpu-wheels)")
        elif p.stat().st_size != r.nbytes:
            out.append(f"{folder.name}/{r.file}: {p.stat().st_size} bytes, the list says {r.nbytes}")
        elif sha256(p) != r.sha256:
            out.append(f"{folder.name}/{r.file}: sha256 differs from the list")
    for p in sorted(folder.iterdir()):
        if p.name not in listed:
            out.append(f"{folder.name}/{p.name}: not in tools/gpu/wheels.txt (it would travel too)")
    return out


def travel_report(folder: Path) -> str:
    """What the device tool sends: tracked and untracked-not-ignored files, plus the carried folder."""
    try:
        names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                               cwd=ROOT, capture_output=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "travel: no git here, working tree size not counted"
    tree = 0
    for name in set(names.decode().split("\0")) - {""}:
        try:
            tree += os.lstat(ROOT / name).st_size
        except FileNotFoundError:
            pass
    wheels = sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) if folder.is_dir() else 0
    total = (tree + wheels) / MIB
    line = (f"travel: working tree {tree / MIB:.1f} MiB + {folder.name}/ {wheels / MIB:.1f} MiB = "
            f"{total:.1f} MiB of the device tool's {TRAVEL_LIMIT_MIB:.0f} MiB")
    if total > TRAVEL_LIMIT_MIB:
        line += ("\nWARNING: over the limit: the device tool refuses the call ('the working tree is "
                 "larger than 64 MiB') until less travels (tests/fixtures is most of the tree)")
    return line


def _pip_env() -> dict:
    # no pip configuration files: the list is exact (no constraints, no indexes from a config)
    return dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")


def download(rows: list[Row], folder: Path, update: bool, pythons: tuple[str, ...]) -> list[str]:
    folder.mkdir(exist_ok=True)
    problems = []
    todo = for_pythons(rows, pythons)
    for r in todo:
        py = r.pythons()[0]  # `any` rows: the oldest, so that an abi3 or py3 wheel fits all
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".whl-dl-") as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                   "--python-version", py, "--implementation", "cp", "--dest", tmp,
                   *[a for p in PLATFORMS for a in ("--platform", p)], f"{r.dist}=={r.version}"]
            env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")  # the index of this machine
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            got = sorted(Path(tmp).glob("*.whl"))
            if done.returncode or len(got) != 1:
                problems.append(f"{r.dist}=={r.version} for Python {py}: pip download failed:\n"
                                + (done.stderr or done.stdout)[-2000:])
                continue
            f = got[0]
            digest, size = sha256(f), f.stat().st_size
            if update:
                r.file, r.nbytes, r.sha256 = f.name, size, digest
            elif (f.name, size, digest) != (r.file, r.nbytes, r.sha256):
                problems.append(f"{r.dist}=={r.version} for Python {py}: got {f.name} ({size} bytes, "
                                f"sha256 {digest[:12]}), the list says {r.file} ({r.nbytes} bytes, "
                                f"{(r.sha256 or '-')[:12]}): rerun with --update if intended")
                continue
            shutil.move(str(f), folder / f.name)
        print(f"  {r.python:<4} {r.dist}=={r.version}: {r.file} ({(r.nbytes or 0) / MIB:.2f} MiB)")
    keep = {r.file for r in todo}
    for p in folder.iterdir():
        if p.name not in keep:
            print(f"  removed {folder.name}/{p.name} (not in the list for Python {', '.join(pythons)})")
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    if pythons != PYTHONS:
        (folder / SELECTED).write_text(" ".join(pythons) + "\n")
    return problems


def this_python() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def needed(r: Row) -> tuple[bool, str]:
    """Does this interpreter need row r installed? (and why, for the log)."""
    if r.need == "always":
        return True, "always"
    try:
        present = importlib.util.find_spec(r.module) is not None
    except (ImportError, ValueError):
        present = False
    if not present:
        return True, f"{r.module} missing"
    if r.need.startswith(">="):
        try:
            have = importlib.metadata.version(r.dist)
        except importlib.metadata.PackageNotFoundError:
            return True, f"{r.module} importable but no {r.dist} metadata"
        if _version_tuple(have) < _version_tuple(r.need[2:]):
            return True, f"{r.dist} {have} < {r.need[2:]}"
        return False, f"the image's {r.dist} {have}"
    return False, f"the image's {r.module}"


def rows_for(rows: list[Row], python: str) -> list[Row]:
    return [r for r in rows if python in r.pythons()]


def install_files(files: list[Path], target: Path) -> None:
    """pip install --no-index --no-deps --target, or (no pip in this Python) unzip each wheel."""
    target.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("pip") is not None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target),
                        *map(str, files)], env=_pip_env(), check=True, timeout=300)
        return
    for f in files:  # a wheel is a zip of its import packages (+ NAME.data/purelib|platlib)
        with zipfile.ZipFile(f) as z:
            for m in z.infolist():
                parts = m.filename.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue
                    parts = parts[2:]
                dest = target.joinpath(*parts)
                if m.is_dir():
                    dest.mkdir(parents=True, exist_ok=True)
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                with z.open(m) as src, open(dest, "wb") as out:
                    shutil.copyfileobj(src, out)


NOT_SELECTED = 3  # install's exit code when the folder was filled for other Pythons only


def install(rows: list[Row], folder: Path, target: Path) -> int:
    py = this_python()
    if py not in selected(folder):
        print(f"wheels: {folder.name}/ holds the wheels of Python {', '.join(selected(folder))} only, "
              f"not {py}: nothing installed")
        return NOT_SELECTED
    mine = rows_for(rows, py)
    if not any(r.dist == "megatron-core" for r in mine):
        print(f"wheels: no megatron-core wheel for Python {py} in tools/gpu/wheels.txt (carried: "
              f"{', '.join(PYTHONS)}); add a row and run make gpu-wheels")
        return 1
    todo = []
    for r in mine:
        need, why = needed(r)
        print(f"wheels: {r.dist} {r.version}: {'install' if need else 'skip'} ({why})")
        if need:
            todo.append(folder / r.file)
    missing = [str(f) for f in todo if not f.is_file()]
    if missing:
        print("wheels: missing (was .whl carried? make gpu-wheels here):\n  " + "\n  ".join(missing))
        return 1
    install_files(todo, target)
    print(f"wheels: {len(todo)} installed into {target} for Python {py}")
    return 0


def install_test(rows: list[Row], folder: Path) -> list[str]:
    """Install every row of this Python into a temporary target and import each from there."""
    mine = rows_for(rows, this_python())
    if not mine:
        return [f"no rows for Python {this_python()}"]
    with tempfile.TemporaryDirectory(prefix="ucp_whl_test_") as tmp:
        install_files([folder / r.file for r in mine], Path(tmp))
        code = ("import importlib, json, sys; mods = sys.argv[1:]; "
                "print(json.dumps({m: importlib.import_module(m).__file__ for m in mods}))")
        env = dict(os.environ, PYTHONPATH=tmp)
        r = subprocess.run([sys.executable, "-c", code, *[r.module for r in mine]], env=env,
                           capture_output=True, text=True, timeout=120)
        if r.returncode:
            return [f"importing the installed wheels failed:\n{r.stderr[-2000:]}"]
        import json

        where = json.loads(r.stdout.strip().splitlines()[-1])
        out = [f"{m} imported from {p}, not from the installed wheel" for m, p in where.items()
               if not str(Path(p).resolve()).startswith(str(Path(tmp).resolve()))]
        print(f"wheels: install test: {len(mine)} wheels for Python {this_python()} installed and "
              f"imported from the target ({', '.join(sorted(where))})")
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["download", "check", "install"])
    ap.add_argument("--dir", type=Path, default=WHEEL_DIR, help="the wheel folder (default .whl)")
    ap.add_argument("--update", action="store_true", help="download: rewrite bytes/sha256/file")
    ap.add_argument("--pythons", default=" ".join(PYTHONS),
                    help="download: only the wheels of these Pythons (default all: %(default)s)")
    ap.add_argument("--target", type=Path, help="install: the folder to install into")
    ap.add_argument("--install-test", action="store_true",
                    help="check: install this Python's wheels into a temporary folder and import them")
    a = ap.parse_args(argv)
    head, rows = read_list()
    if a.command == "install":
        if a.target is None:
            ap.error("install needs --target")
        return install(rows, a.dir, a.target)
    if a.command == "download":
        pythons = tuple(a.pythons.replace(",", " ").split())
        if not pythons or not set(pythons) <= set(PYTHONS):
            ap.error(f"--pythons: some of {' '.join(PYTHONS)}")
        problems = download(rows, a.dir, a.update, pythons)
        if a.update and not problems:
            write_list(head, rows)
            print(f"wheels: {LIST.relative_to(ROOT)} updated")
    else:
        problems = []
    problems += list_problems(rows)
    if a.dir.is_dir() and not (a.command == "download" and problems):
        problems += folder_problems(rows, a.dir)
        if a.install_test and not problems:
            problems += install_test(rows, a.dir)
    elif a.command == "check":
        print(f"wheels: {a.dir.name}/ absent: checked the list only (make gpu-wheels downloads it)")
    total = sum(r.nbytes or 0 for r in rows)
    print(f"wheels: {len(rows)} listed, {total / MIB:.2f} MiB (budget {WHEEL_BUDGET_MIB:.0f} MiB); "
          f"the folder is for Python {', '.join(selected(a.dir))}")
    print(travel_report(a.dir))
    for p in problems:
        print(f"wheels: PROBLEM: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
