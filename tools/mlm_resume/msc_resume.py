#!/usr/bin/env python3
"""Stock Megatron-LM resumes a conversion from an object store through multi-storage-client, and
its own save there is read back by megatron-ucp from the bucket.

1. megatron-ucp reshards a core_v0.16.1 fixture (torch_dist TP2 DP2, iteration 6) to torch_dist at
   TP1 DP2 (dp_reshardable) straight into `s3://ckpt/<run>/converted` on a local SeaweedFS server,
   and the same conversion into a local directory (the reference).
2. Stock `pretrain_gpt.py` (core_v0.16.1 tree) resumes each: `--load msc://ckpt/<run>/converted`
   (an MSC profile for the same bucket) saving with `--save msc://ckpt/<run>/resumed`, and
   `--load <local copy>`; iterations 7-9 must log the same losses.
3. megatron-ucp converts Megatron-LM's save from `s3://ckpt/<run>/resumed` (no MSC involved): the
   Adam step must be 9, and its tensors equal the local resume's save bitwise.

Needs multi-storage-client beside the venv (it makes megatron-core route torch_dist I/O through
MSC, so it is not in the venv): `pip install --target /work/venvs/msc multi-storage-client==1.3.1`
and `pip install --target /work/venvs/msc --no-deps boto3==1.43.117 s3transfer==0.19.3` (the
venv's botocore), plus the resume table's setup (tools/mlm_resume/README.md "Setup"):

    MLM_SRC=/tmp/mlmfix/src MLM_HARNESS=/work/shared/fixtures/megatron_lm/harness PYTHONPATH=$PWD \\
        .venv/bin/python tools/mlm_resume/msc_resume.py --msc /work/venvs/msc \\
        --pythonpath /work/venvs/i21resume/py311 --work /tmp/msc_resume
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from resume_table import RELEASES, run_megatron  # noqa: E402

from megatron_ucp.conversion import reshard  # noqa: E402
from megatron_ucp.formats import open_source  # noqa: E402
from megatron_ucp.layout import Layout  # noqa: E402
from megatron_ucp.spec import states_of  # noqa: E402
from megatron_ucp.testing.s3_server import seaweedfs, write_msc_config  # noqa: E402

TARGET = dict(tp=1, pp=1, dp=2)


def tensors(ckpt) -> dict[str, torch.Tensor]:
    src = open_source(ckpt)
    return {f"{n}/{s}": src.read(n, s, (0,) * len(p.shape), p.shape)
            for n, p in src.manifest.params.items() for s in states_of(p.spec)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--msc", required=True, help="directory holding multi-storage-client (pip --target)")
    p.add_argument("--pythonpath", default="", help="more PYTHONPATH for the Megatron-LM runs (triton)")
    p.add_argument("--fixture", default="torch_dist_tp2_dp2")
    p.add_argument("--work", default="/tmp/msc_resume")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    fixture = RELEASES["core_v0.16.1"] / args.fixture / "ckpt"
    runner = {"src": os.environ["MLM_SRC"], "python": sys.executable, "harness": os.environ["MLM_HARNESS"],
              "pythonpath": os.pathsep.join(filter(None, [args.msc, args.pythonpath]))}
    with seaweedfs(work / "seaweedfs") as (endpoint, bucket):
        runner["env"] = write_msc_config(work / "msc.json", endpoint, "ckpt")  # msc://ckpt/K = s3://ckpt/K
        target = Layout(tp=TARGET["tp"], pp=TARGET["pp"], dp=TARGET["dp"])
        reshard(fixture, f"{bucket}/run/converted", target, target_format="torch_dist",
                optim_sharding="dp_reshardable", progress=False)
        reshard(fixture, work / "converted", target, target_format="torch_dist",
                optim_sharding="dp_reshardable", progress=False)
        from_store = run_megatron(runner, "msc://ckpt/run/converted", "msc://ckpt/run/resumed", TARGET,
                                  "torch_dist", [], work / "from_store.log", 29711)
        local = run_megatron(runner, work / "converted", work / "resumed", TARGET, "torch_dist", [],
                             work / "local.log", 29712)
        report = {"fixture": args.fixture, "target": TARGET, "from_store": from_store, "local": local}
        ok = from_store["rc"] == 0 and local["rc"] == 0
        if ok:
            saved_in_store = tensors(f"{bucket}/run/resumed")  # megatron-ucp reads Megatron-LM's save
            saved_local = tensors(work / "resumed")
            saved = open_source(f"{bucket}/run/resumed")
            report["saved_in_store_step"] = saved.step(next(iter(saved.manifest.params)))
            report["saved_bitwise_equal"] = saved_in_store.keys() == saved_local.keys() and all(
                torch.equal(saved_in_store[k], saved_local[k]) for k in saved_local)
            report["losses_equal"] = from_store["losses"] == local["losses"]
            from_store["saved_step"] = report["saved_in_store_step"]  # (run_megatron cannot open msc://)
            ok = report["saved_bitwise_equal"] and report["losses_equal"] and from_store["saved_step"] == 9
    print(json.dumps(report, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
