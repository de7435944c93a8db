"""CPU stand-ins and test scaffolding: a CUDA shim so real megatron-core runs on CPU (gloo), CPU
kernels for Mamba, grouped GEMM, context-parallel and MLA attention, a tiny GPT, a launcher, the
scenarios the tests and benchmarks run, a SeaweedFS starter and fault injection.

Shipped in the wheel (setup.py), because it is used outside this repository's tests/ and bench/:
- Megatron-LM runs on a CPU-only machine: `cpu_shim` imported first (patches/README.md,
  tools/mlm_resume/), and for hybrid (Mamba) models `--spec megatron_ucp.testing.mamba_cpu
  hybrid_stack_spec_local`, whose CPU Mamba kernels only this package provides;
- the recompute profiler's CPU run: `python -m megatron_ucp.testing.recompute_profile`, named by
  megatron_ucp.recompute.profiler's messages, and `recompute_plans.make_plan` (tools/mlm_resume/);
- tools/demo.py (`make demo`).
The library itself never imports it (tests/test_hygiene.py): importing `cpu_shim` (tiny_gpt and
the scenarios import it) replaces torch.cuda's functions for the whole process where no GPU is
present, which only a run that asks for it may do.
"""
