"""The GPU check's steps and its figures block (run by tools/gpu/gpu_check.sh after the offline
wheel install; `--step NAME` runs one step in its own process, the rest is the orchestrator).

Steps, in order, each in a process session of its own with a time cap (killed whole on expiry),
all inside one overall budget (`--budget`, seconds; a step that no longer fits is skipped):

- probe: Python, torch, CUDA, the GPU, NCCL, where megatron-core and megatron_ucp come from;
- bitwise_ws1_sync / bitwise_ws1_async: megatron-core's GPT (local spec, bf16 with fp32 master
  weights, megatron-core's Adam, DistributedOptimizer) trained 3 steps on the GPU under NCCL at world
  size 1, saved by megatron_ucp (sync; async with the writer held until training has changed the
  state), loaded into a fresh process: every model tensor, fp32 master weight, Adam moment and
  step equal bitwise to the state dumped at the save; the next 3 losses against the uninterrupted
  run's are reported (bitwise with deterministic kernels; tests/test_gpu.py requires it);
- staging: megatron_ucp.staging.HostStager copying `--staging-gib` GiB of device fragments into
  pinned host memory, GB/s, against a raw `torch.empty(pin_memory=True).copy_(cuda, non_blocking=True)`
  of the same bytes in the same process (the ratio is the figure), and the peak host memory;
- bitwise_ws2_one_gpu: the same at DP2, two processes on the one GPU; NCCL refuses two ranks on one
  device ("Duplicate GPU detected"), which is then reported as the reason, not as a failure;
- pytest_test_gpu: `pytest -m gpu tests/test_gpu.py` (what `make test-gpu` runs; the TE tests skip).

The figures block is printed at the end and written as JSON to $OUT/gpu_check.json (with the
steps' log, $OUT/gpu_check.log) when OUT is set. `--cpu-rehearsal` runs the same steps on a CPU
host (the CUDA shim, gloo): a check of this script, not a GPU result. `--dry-run`: the imports the
steps need, the staging step at a tiny size and the figures block, on whatever host.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = "megatron_ucp.testing.scenarios"
STEPS = 3  # trained before the save, and after the resume (tests/conftest.py's STEPS)
# cuBLAS picks deterministic kernels: a same-layout resume then trains bitwise alike (test_gpu.py)
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
# tests/test_gpu.py's LOCAL: megatron-core's local layers, bf16 (fp32 master weights and Adam state)
CFG = {"dtype": "bf16", "swiglu": True, "num_query_groups": 2, "hidden_size": 128,
       "num_attention_heads": 8, "ffn_hidden_size": 256, "seq_length": 64, "transformer_impl": "local"}
# name, time cap (s), required for PASS
PLAN = (("probe", 90, True), ("bitwise_ws1_sync", 150, True), ("bitwise_ws1_async", 150, True),
        ("staging", 150, True), ("bitwise_ws2_one_gpu", 100, False), ("pytest_test_gpu", 200, True))
OK = ("pass", "refused")  # refused: NCCL does not run two ranks on one GPU (said why)
GB = 1e9
GIB = 1 << 30


# ---------------------------------------------------------------------------------------------- steps

def step_probe(rehearsal: bool, **_) -> dict:
    import torch

    out: dict = {"python": sys.version.split()[0], "executable": sys.executable,
                 "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                 "cuda_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count()}
    if out["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, capability=f"sm_{p.major}{p.minor}", gpu_memory_gib=p.total_memory / GIB,
                   nccl=".".join(map(str, torch.cuda.nccl.version())),
                   pinned_ok=torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True).is_pinned())
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            out["driver"] = smi.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            out["driver"] = None
    import megatron.core
    import numpy

    import megatron_ucp
    from megatron_ucp.mcore_compat import release_name

    out.update(megatron_core=release_name().split()[-1],
               megatron_core_from=str(Path(megatron.core.__file__).parent),
               megatron_ucp_from=str(Path(megatron_ucp.__file__).parent), numpy=numpy.__version__)
    problems = []
    if not out["cuda_available"] and not rehearsal:
        problems.append("torch sees no CUDA device (GPU_CHECK_CPU_REHEARSAL=1 rehearses on a CPU)")
    if out["cuda_available"] and not out["pinned_ok"]:
        problems.append("pin_memory=True gave an unpinned tensor")
    out["status"] = "fail" if problems else "pass"
    out["problems"] = problems
    return out


def compare_dumps(saved: Path, loaded: Path) -> dict:
    """Every model tensor, optimizer state and step of each rank's dump (scenarios.dump_local_state)
    at the save against the one after the load, bitwise."""
    import torch

    out = {"model_tensors": 0, "optimizer_tensors": 0, "steps": set(), "mismatches": []}
    ranks = sorted(p.name for p in saved.glob("rank*.pt"))
    if not ranks or ranks != sorted(p.name for p in loaded.glob("rank*.pt")):
        theirs = sorted(p.name for p in loaded.glob("rank*.pt"))
        out["mismatches"].append(f"rank files differ: {ranks} vs {theirs}")
    for name in ranks:
        a = {(e["chunk"], e["name"]): e for e in torch.load(saved / name, weights_only=False)["params"]}
        b = {(e["chunk"], e["name"]): e for e in torch.load(loaded / name, weights_only=False)["params"]}
        if a.keys() != b.keys():
            out["mismatches"].append(f"{name}: parameter names differ: {sorted(set(a) ^ set(b))[:5]}")
        for key in sorted(set(a) & set(b)):
            s, lo = a[key], b[key]
            out["model_tensors"] += 1
            if not torch.equal(s["model"], lo["model"]):
                out["mismatches"].append(f"{name} {key[1]}: model")
            if s["range"] != lo["range"]:
                out["mismatches"].append(f"{name} {key[1]}: range {s['range']} vs {lo['range']}")
            if s["range"] is None:
                continue
            out["steps"].add(s["step"])
            if s["step"] != lo["step"]:
                out["mismatches"].append(f"{name} {key[1]}: step {s['step']} vs {lo['step']}")
            for state in s["states"]:
                out["optimizer_tensors"] += 1
                if state not in lo or not torch.equal(s[state], lo[state]):
                    out["mismatches"].append(f"{name} {key[1]}: {state}")
    out["steps"] = sorted(out["steps"])
    return out


def _launch_failure(e: Exception, what: str, seconds: float, limit: float) -> dict:
    """A failed launch as the figures name it: NCCL's refusal, a time-out, or the error line."""
    text = str(e)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for marker in ("Duplicate GPU", "ncclInvalidUsage"):
        if marker in text:
            line = next(ln for ln in lines if marker in ln)
            return {"status": "refused", "reason": f"NCCL refuses two ranks on one GPU: {line[:300]}",
                    "log_tail": text[-3000:]}
    if seconds >= limit - 1:
        return {"status": "timeout", "reason": f"{what} ran past its {limit:.0f} s", "log_tail": text[-3000:]}
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return {"status": "fail", "reason": f"{what}: {lines[0][:200]} {(errors or lines)[-1][:300]}",
            "log_tail": text[-3000:]}


def step_bitwise(world_size: int, mode: str, cap: float, rehearsal: bool, **_) -> dict:
    from megatron_ucp.testing.launch import LaunchError, launch

    layout = "tp1" if world_size == 1 else f"dp{world_size}"
    out: dict = {"world_size": world_size, "layout": layout, "mode": mode,
                 "backend": "gloo (CPU shim)" if rehearsal else "nccl"}
    with tempfile.TemporaryDirectory(prefix=f"ucp_gpu_{layout}_{mode}_") as tmp:
        d = Path(tmp)
        t0 = time.perf_counter()
        try:
            res = launch(world_size, f"{SCENARIOS}:train_and_save",
                         {"layout": layout, "cfg": CFG, "steps": STEPS, "save_dir": str(d / "ckpt"),
                          "continue_steps": STEPS, "dump_dir": str(d / "saved"),
                          "async_save": mode == "async"}, timeout=cap * 0.55, env=DETERMINISTIC)
        except LaunchError as e:
            return {**out, **_launch_failure(e, "train and save", time.perf_counter() - t0, cap * 0.55)}
        t1 = time.perf_counter()
        try:
            got = launch(world_size, f"{SCENARIOS}:load_and_train",
                         {"layout": layout, "cfg": CFG, "load_dir": str(d / "ckpt"), "steps": STEPS,
                          "dump_dir": str(d / "loaded")}, timeout=cap * 0.4, env=DETERMINISTIC)
        except LaunchError as e:
            return {**out, **_launch_failure(e, "load and train", time.perf_counter() - t1, cap * 0.4)}
        t2 = time.perf_counter()
        cmp = compare_dumps(d / "saved", d / "loaded")
    r0, g0 = res[0], got[0]
    problems = list(cmp["mismatches"][:20])
    if cmp["optimizer_tensors"] == 0:
        problems.append("no optimizer state compared")
    if cmp["steps"] != [float(STEPS)]:
        problems.append(f"Adam steps at the save {cmp['steps']}, expected [{float(STEPS)}]")
    if g0["iteration"] != STEPS or not g0["rng_restored"]:
        problems.append(f"iteration {g0['iteration']}, rng restored {g0['rng_restored']}")
    # reported, not required: equal losses need deterministic kernels as well as an exact state
    losses_equal = g0["losses"] == r0["continued"]
    loss_diff = max((abs(x - y) for x, y in zip(g0["losses"], r0["continued"])), default=0.0)
    if mode == "async" and r0["pending_while_training"] != STEPS:
        problems.append(f"the async save was not pending while training ({r0['pending_while_training']})")
    return {**out, "status": "fail" if problems else "pass", "problems": problems,
            "model_tensors": cmp["model_tensors"], "optimizer_tensors": cmp["optimizer_tensors"],
            "adam_step": cmp["steps"], "losses_equal": losses_equal, "max_loss_diff": loss_diff,
            "losses": r0["losses"], "losses_after_load": g0["losses"],
            "continued": r0["continued"], "optimizer": r0["optimizer"],
            "save_seconds": r0["save_seconds"], "load_seconds": g0["load_seconds"],
            "train_save_run_s": t1 - t0, "load_run_s": t2 - t1}


def _proc_status_gib(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return None


def _fragment_numels(total_bytes: int, count: int = 64) -> list[int]:
    """fp32 fragment sizes that sum to total_bytes (a save's mix: a few large, many small)."""
    weights = [4.0 ** (i % 5) for i in range(count)]
    elems = total_bytes // 4
    sizes = [max(1, int(elems * w / sum(weights))) for w in weights]
    sizes[0] += elems - sum(sizes)
    return sizes


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def _timed(fn, cuda: bool) -> float:
    import torch

    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t


def _stage_size(gib: float, reps: int, with_loop: bool, cuda: bool) -> dict:
    """One size: HostStager (first call, then steady state) against the raw pinned copy."""
    import torch

    from megatron_ucp.staging import HostStager

    dev = torch.device("cuda" if cuda else "cpu")
    nbytes = int(gib * GIB) // 4 * 4
    srcs = [torch.rand(n, device=dev) for n in _fragment_numels(nbytes)]
    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)  # the raw copy's one source tensor
    flat.view(torch.float32).copy_(torch.cat(srcs))  # the same bytes
    rss0 = _proc_status_gib("VmRSS")
    stager = HostStager(batched=True)
    first_stager = _timed(lambda: stager.stage(srcs), cuda)  # with the pinned buffer's allocation
    rss1 = _proc_status_gib("VmRSS")
    held: dict = {}
    first_raw = _timed(lambda: held.update(dst=torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
                                           .copy_(flat, non_blocking=cuda)), cuda)
    dst = held["dst"]
    rss2 = _proc_status_gib("VmRSS")
    t_stager, t_raw = [], []
    for _ in range(reps):  # interleaved, so that drift hits both alike
        t_raw.append(_timed(lambda: dst.copy_(flat, non_blocking=cuda), cuda))
        t_stager.append(_timed(lambda: stager.stage(srcs), cuda))
    host = stager.stage(srcs)  # compared on the device: no host copy to inflate the peak RSS
    bitwise = all(torch.equal(h.to(dev), s) for h, s in zip(host, srcs)) and torch.equal(dst.to(dev), flat)
    row = {"gib": gib, "bytes": nbytes, "fragments": len(srcs),
           "stager_gbps": nbytes / _median(t_stager) / GB, "stager_best_gbps": nbytes / min(t_stager) / GB,
           "raw_gbps": nbytes / _median(t_raw) / GB, "raw_best_gbps": nbytes / min(t_raw) / GB,
           "stager_first_call_s": first_stager, "raw_first_call_s": first_raw,
           "stager_allocations": stager.allocations, "stager_pinned": bool(stager.buffer.is_pinned()),
           "bitwise": bitwise, "rss_added_by_stager_gib": None if rss0 is None else rss1 - rss0,
           "rss_added_by_raw_gib": None if rss1 is None else rss2 - rss1}
    row["ratio"] = row["stager_gbps"] / row["raw_gbps"]
    if with_loop:  # the non-batched path (one copy_ per tensor)
        loop = HostStager(batched=False)
        loop.stage(srcs)
        row["stager_loop_gbps"] = nbytes / _median([_timed(lambda: loop.stage(srcs), cuda)
                                                    for _ in range(reps)]) / GB
    row["peak_rss_gib"] = _proc_status_gib("VmHWM")
    return row


def step_staging(sizes_gib: list[float], reps: int, **_) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    out: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "pinned": cuda,
                 "rss_start_gib": _proc_status_gib("VmRSS"), "sizes": []}
    problems = []
    for i, gib in enumerate(sizes_gib):
        row = _stage_size(gib, reps, with_loop=i == 0, cuda=cuda)
        out["sizes"].append(row)
        if not row["bitwise"]:
            problems.append(f"{gib} GiB: staged bytes differ from the device's")
        if cuda and not row["stager_pinned"]:
            problems.append(f"{gib} GiB: the stager's buffer is not pinned")
        if row["stager_allocations"] != 1:
            problems.append(f"{gib} GiB: the stager allocated {row['stager_allocations']} times")
        if cuda:  # this size's device and pinned blocks go back before the next
            torch.cuda.empty_cache()
            getattr(torch._C, "_host_emptyCache", lambda: None)()
    out["peak_rss_gib"] = _proc_status_gib("VmHWM")
    out["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / GIB if cuda else None
    out["status"] = "fail" if problems else "pass"
    out["problems"] = problems
    return out


def step_pytest(cap: float, rehearsal: bool, **_) -> dict:
    with tempfile.TemporaryDirectory(prefix="ucp_gpu_pytest_") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "tests/test_gpu.py",
               "-p", "no:cacheprovider", f"--junitxml={xml}", f"--basetemp={tmp}/t"]
        r = subprocess.run(cmd, cwd=ROOT, timeout=cap - 5)
        if not xml.is_file():
            return {"status": "fail", "reason": f"pytest exited {r.returncode} without a report"}
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        skips = sorted({s.get("message", "") for s in suite.iter("skipped")})
    n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    ok = r.returncode == 0 and n["failures"] == n["errors"] == 0 and (n["passed"] > 0 or rehearsal)
    return {"status": "pass" if ok else "fail", "exit_code": r.returncode, **n, "skip_reasons": skips,
            **({} if ok else {"reason": f"exit code {r.returncode}, {n['passed']} passed"})}


def run_step(name: str, cap: float, a: argparse.Namespace) -> dict:
    kw = {"cap": cap, "rehearsal": a.cpu_rehearsal}
    if name == "probe":
        return step_probe(**kw)
    if name.startswith("bitwise_"):
        ws = 1 if "_ws1_" in name else 2
        return step_bitwise(ws, "async" if name.endswith("async") else "sync", **kw)
    if name == "staging":
        return step_staging([float(x) for x in a.staging_gib.split(",")], a.reps, **kw)
    if name == "pytest_test_gpu":
        return step_pytest(**kw)
    raise SystemExit(f"unknown step {name}")


# ---------------------------------------------------------------------------------------- figures

def _fmt_s(x) -> str:
    return "-" if x is None else f"{x:.2f} s"


def figures(results: dict, elapsed: float, budget: float, rehearsal: bool, dry: bool) -> str:
    """The one figures block the GPU session reads."""
    lines = ["=" * 100, "GPU CHECK FIGURES" + (" (CPU REHEARSAL: not a GPU result)" if rehearsal else "")
             + (" (DRY RUN: no GPU step ran)" if dry else ""), "-" * 100]
    p = results.get("probe", {})
    if p.get("status") in OK or "torch" in p:
        gpu = (f"{p.get('gpu')} ({p.get('capability')}, {p.get('gpu_memory_gib', 0):.0f} GiB), driver "
               f"{p.get('driver')}, NCCL {p.get('nccl')}" if p.get("cuda_available") else "no CUDA device")
        lines.append(f"{'device':<22}{gpu}")
        lines.append(f"{'software':<22}Python {p.get('python')}, torch {p.get('torch')} (CUDA "
                     f"{p.get('torch_cuda')}), megatron-core {p.get('megatron_core')}, "
                     f"numpy {p.get('numpy')}")
        lines.append(f"{'imported from':<22}megatron-core {p.get('megatron_core_from')}; megatron_ucp "
                     f"{p.get('megatron_ucp_from')}")
    for name, _, _ in PLAN:
        r = results.get(name)
        if r is None:
            lines.append(f"{name:<22}NOT RUN (the probe failed)")
            continue
        if name == "probe":
            if r.get("status") not in OK:
                lines.append(f"{name:<22}{r['status'].upper()}: {_reason(r)}")
            continue
        head = f"{name:<22}{r['status'].upper():<8}"
        if name.startswith("bitwise_") and r["status"] == "pass":
            lines.append(head + f"{r['layout']} {r['mode']} over {r['backend']}: {r['model_tensors']} model "
                         f"tensors, {r['optimizer_tensors']} fp32 master/Adam tensors, step {r['adam_step']} "
                         f"bitwise; next losses bitwise: {r['losses_equal']} (max diff "
                         f"{r['max_loss_diff']:.3g}); save "
                         f"{_fmt_s(r['save_seconds'])}, load {_fmt_s(r['load_seconds'])} ({r['optimizer']})")
        elif name == "staging" and r["status"] == "pass":
            lines.append(head + f"{r['device']}, pinned {r['pinned']}; peak host RSS "
                         f"{r['peak_rss_gib']:.2f} GiB" + (f", GPU peak {r['gpu_peak_gib']:.2f} GiB"
                                                           if r.get("gpu_peak_gib") is not None else ""))
            for s in r["sizes"]:
                loop = f", loop {s['stager_loop_gbps']:.1f}" if "stager_loop_gbps" in s else ""
                lines.append(f"{'':<30}{s['gib']:g} GiB in {s['fragments']} fragments: HostStager "
                             f"{s['stager_gbps']:.1f} GB/s{loop} vs raw {'pinned ' * r['pinned']}copy "
                             f"{s['raw_gbps']:.1f} GB/s "
                             f"= ratio {s['ratio']:.2f}; first call (allocation) stager "
                             f"{_fmt_s(s['stager_first_call_s'])}, raw {_fmt_s(s['raw_first_call_s'])}; "
                             f"host RSS +{s['rss_added_by_stager_gib'] or 0:.2f} GiB (stager) "
                             f"+{s['rss_added_by_raw_gib'] or 0:.2f} GiB (raw)")
        elif name == "pytest_test_gpu" and "tests" in r:
            lines.append(head + f"{r['passed']} passed, {r['failures']} failed, {r['errors']} errors, "
                         f"{r['skipped']} skipped ({'; '.join(r['skip_reasons'])[:200]})")
        else:
            lines.append(head + _reason(r))
    verdict = "DRY RUN (imports and the staging code on this host)" if dry else overall(results)
    spent = f"{elapsed:.0f} s" + ("" if dry else f" of a {budget:.0f} s budget")
    lines += ["-" * 100, f"{'elapsed':<22}{spent}", f"{'RESULT':<22}{verdict}", "=" * 100]
    return "\n".join(lines)


def _reason(r: dict) -> str:
    text = r.get("reason") or "; ".join(r.get("problems", [])) or ""
    return text.strip().splitlines()[-1][:400] if text.strip() else ""


def overall(results: dict) -> str:
    required = [n for n, _, req in PLAN if req]
    if any(results.get(n, {}).get("status") not in OK for n in required):
        return "FAIL"
    return "PASS"


# ------------------------------------------------------------------------------------ orchestrator

class Stopped(Exception):
    """SIGTERM (gpu_check.sh's `timeout`): the running step's process group is killed on the way out."""


def _stop(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def orchestrate(a: argparse.Namespace) -> int:
    start = time.monotonic()
    signal.signal(signal.SIGTERM, _stop)
    out_dir = Path(a.out) if a.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    log_path = (out_dir / "gpu_check.log") if out_dir else Path(tempfile.mkdtemp()) / "gpu_check.log"
    results: dict = {}
    with open(log_path, "w") as log:
        for name, cap, _ in PLAN:
            left = a.budget - (time.monotonic() - start) - 5
            if left < 25:
                results[name] = {"status": "skipped", "reason": f"the {a.budget:.0f} s budget is spent"}
                print(f"[gpu_check] {name}: skipped (budget)", flush=True)
                continue
            t = min(cap, left)
            print(f"[gpu_check] {name} (at most {t:.0f} s) ...", flush=True)
            try:
                results[name] = _subprocess_step(name, t, a, log)
            except Stopped as e:
                results[name] = {"status": "timeout", "reason": f"the run's overall limit ({e})",
                                 "seconds": time.monotonic() - start}
                break
            results[name]["seconds"] = round(results[name].get("seconds", 0), 1)
            print(f"[gpu_check] {name}: {results[name]['status']} in {results[name]['seconds']} s",
                  flush=True)
            if name == "probe" and results[name]["status"] != "pass":
                break  # nothing else can run
    elapsed = time.monotonic() - start
    text = figures(results, elapsed, a.budget, a.cpu_rehearsal, dry=False)
    print(text, flush=True)
    if out_dir:
        (out_dir / "gpu_check.json").write_text(json.dumps(
            {"result": overall(results), "rehearsal": a.cpu_rehearsal, "elapsed_s": elapsed,
             "budget_s": a.budget, "steps": results, "figures": text}, indent=1, default=str))
        if log_path.stat().st_size > 15 << 20:  # the device tool brings back files up to 16 MiB
            data = log_path.read_bytes()[-(15 << 20):]
            log_path.write_bytes(data)
    print(f"[gpu_check] log: {log_path}", flush=True)
    return 0 if overall(results) == "PASS" else 1


def _subprocess_step(name: str, cap: float, a: argparse.Namespace, log) -> dict:
    with tempfile.TemporaryDirectory(prefix="ucp_step_") as tmp:
        res = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--step", name, "--cap", str(cap), "--result", str(res),
               "--staging-gib", a.staging_gib, "--reps", str(a.reps)]
        cmd += ["--cpu-rehearsal"] if a.cpu_rehearsal else []
        log.write(f"\n===== {name} (cap {cap:.0f} s): {' '.join(cmd)}\n")
        log.flush()
        t0 = time.monotonic()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)  # its own group: a timeout kills the ranks too
        try:
            code = p.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return {"status": "timeout", "reason": f"killed after {cap:.0f} s", "seconds": cap}
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # whatever it left running
            except ProcessLookupError:
                pass
        seconds = time.monotonic() - t0
        if res.is_file():
            return {**json.loads(res.read_text()), "seconds": seconds}
        log.flush()
        tail = Path(log.name).read_text()[-2000:]
        return {"status": "fail", "reason": f"exit code {code}, no result; log tail:\n{tail}",
                "seconds": seconds}


def dry_run(a: argparse.Namespace) -> int:
    """Imports the steps need (on this host), the staging step at a tiny size, the figures block."""
    problems = []
    t0 = time.monotonic()
    # before megatron_ucp.testing is imported: its CUDA shim would make torch.cuda answer on a CPU host
    staging = step_staging([0.002], reps=2)
    probe = step_probe(rehearsal=True)
    import importlib

    for mod in ("torch", "numpy", "safetensors", "yaml", "tqdm", "pytest", "megatron.core", "megatron_ucp",
                "megatron_ucp.staging", "megatron_ucp.testing.launch", SCENARIOS):
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 (report every import that fails, whatever it raises)
            problems.append(f"import {mod}: {type(e).__name__}: {e}")
    import megatron.core

    where = Path(megatron.core.__file__).resolve()
    if a.expect_site and not str(where).startswith(str(Path(a.expect_site).resolve())):
        problems.append(f"megatron.core imported from {where}, not from the installed wheels {a.expect_site}")
    results = {"probe": probe, "staging": staging}
    results.update({n: {"status": "skipped", "reason": "dry run"} for n, _, _ in PLAN if n not in results})
    print(figures(results, time.monotonic() - t0, 0, rehearsal=False, dry=True))
    print(f"[gpu_check] dry run: megatron.core from {where.parent}")
    problems += staging["problems"] + probe["problems"]
    for p in problems:
        print(f"[gpu_check] PROBLEM: {p}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for all steps together")
    ap.add_argument("--out", default=os.environ.get("OUT") or None, help="folder for the JSON and log")
    ap.add_argument("--staging-gib", default="1,4", help="staging sizes, GiB, comma-separated")
    ap.add_argument("--reps", type=int, default=5, help="timed copies per staging size and method")
    ap.add_argument("--cpu-rehearsal", action="store_true", help="run the steps on a CPU host")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--expect-site", help="dry run: megatron.core must come from this folder")
    ap.add_argument("--step", help=argparse.SUPPRESS)
    ap.add_argument("--cap", type=float, default=600.0, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.dry_run:
        return dry_run(a)
    if a.step:
        try:
            r = run_step(a.step, a.cap, a)
        except Exception as e:  # noqa: BLE001 (the figures block names whatever broke the step)
            import traceback

            traceback.print_exc()
            r = {"status": "fail", "reason": f"{type(e).__name__}: {e}"}
        Path(a.result).write_text(json.dumps(r, default=str))
        return 0
    return orchestrate(a)


if __name__ == "__main__":
    sys.exit(main())
