"""run_pretrain_resume.py for a hybrid Mamba model: stock Megatron-LM's hybrid entry point
(MLM_HYBRID_SCRIPT: core_v0.19.0's `pretrain_hybrid.py`, the default, or core_v0.16.1's
`pretrain_mamba.py`) instead of `pretrain_gpt.py`, on CPU, with everything run_pretrain_resume.py
does (the CUDA shim: megatron-ucp's, or with MLM_HARNESS the shared harness's `cpushim_mlm`; the
load-only optimizer-step fixes it documents) plus megatron_ucp.testing.mamba_cpu imported first, as
the hybrid fixtures' harnesses (tests/fixtures/megatron_lm_v019/harness/run_pretrain_hybrid.py,
tests/fixtures/megatron_lm/harness/run_pretrain_mamba.py) did: mamba_ssm's and causal_conv1d's
pure-PyTorch reference math and the stack's final norm without Transformer Engine. The stack spec
comes from argv (`--spec megatron_ucp.testing.mamba_cpu hybrid_stack_spec_local`). No Megatron-LM
file is changed. Environment: as run_pretrain_resume.py (MLM_SRC, MLM_HARNESS, ...).
"""

import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, os.environ["MLM_SRC"])
if os.environ.get("MLM_HARNESS"):  # the core_v0.16.1 fixtures' shim (run_pretrain_resume.py's too)
    sys.path.insert(0, os.environ["MLM_HARNESS"])
    import cpushim_mlm  # noqa: E402,F401  (before any megatron import)
else:
    import megatron_ucp.testing.cpu_shim  # noqa: E402,F401  (before any megatron import)
import megatron_ucp.testing.mamba_cpu  # noqa: E402,F401  (the Mamba kernels' stand-ins)

SCRIPT = os.environ.get("MLM_HYBRID_SCRIPT", "pretrain_hybrid.py")
_run_path = runpy.run_path


def run_path(path: str, *args, **kwargs):
    """runpy.run_path, with the hybrid entry point where run_pretrain_resume.py runs pretrain_gpt.py."""
    if os.path.basename(path) == "pretrain_gpt.py":
        path = os.path.join(os.path.dirname(path), SCRIPT)
        sys.argv[0] = path
    return _run_path(path, *args, **kwargs)


runpy.run_path = run_path
print(f"> [resume] megatron_ucp.testing.mamba_cpu stand-ins; {SCRIPT}")
_run_path(str(Path(__file__).with_name("run_pretrain_resume.py")), run_name="__main__")
