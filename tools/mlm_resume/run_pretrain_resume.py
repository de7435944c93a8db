"""Stock Megatron-LM `pretrain_gpt.py` on CPU for resume checks. No Megatron-LM file is changed;
`pretrain_gpt.py` runs through runpy after a CUDA shim and a few load-only fixes.

The shim: core_v0.16.1 (env MLM_HARNESS set): the shared fixture harness's `cpushim_mlm.py`, with its
two opt-in legacy load fixes (MLM_SHIM_DISTOPT_STEP_LOAD_FIX, MLM_SHIM_DISTOPT_UNSHARE_STEP).
core_v0.19.0 (no MLM_HARNESS): megatron-ucp's own `megatron_ucp.testing.cpu_shim` (what wrote
tests/fixtures/megatron_lm_v019) and the same two fixes, defined below (`legacy_step_fixes`).

Why the legacy fixes: megatron-core without TE/Apex builds torch AdamW, whose per-parameter state
has a `step` tensor; `distrib_optim.pt` holds only param/exp_avg/exp_avg_sq, so
`_set_main_param_and_optimizer_states` raises KeyError: 'step' (the step restored from the param
groups is kept instead), and `load_state_dict` gives every parameter ONE shared step tensor, which
AdamW then increments once per parameter (each gets its own copy).

Why the torch_dist fix: megatron-core without TE/Apex builds torch AdamW, whose per-parameter state
(and its `step`) exists only after a first step, and DistributedOptimizer.sharded_state_dict(
is_loading=True) calls state_dict(), which asserts one `step` over that empty state, so no
torch_dist checkpoint (Megatron-LM's own included) can be loaded here. Before the load template is
built, every parameter gets the zero state init_state_fn would create plus a zero `step` tensor;
the load then overwrites all of it from the checkpoint (the step from the saved param groups).

Why the second (env MLM_RESUME_KEEP_STEP=1): with torch AdamW, the dp_reshardable load copies
each parameter's `step` from the load template (the fresh optimizer's, 0) over the step that
load_state_dict has just restored from the saved param groups, so every dp_reshardable resume,
of Megatron-LM's own checkpoints too, restarts Adam's bias correction at step 0. The fix drops
that template `step`; the legacy step fix then keeps the restored one.

`--optimizer muon|lion` in argv: megatron_ucp.testing.gloo_all_gather, the gloo stand-in
for the uneven all-gather of megatron-core 0.19's LayerWiseDistributedOptimizer (the Muon/Lion
fixtures' harness installs the same; tests/fixtures/megatron_lm_v019/README.md).

`--multi-latent-attention` in argv: megatron_ucp.testing.mla_attention.install_local_spec(), the
core attention that local-spec MLA needs on CPU without Transformer Engine (the DeepSeek-V3-shape
fixtures' harness installs the same; tests/fixtures/megatron_lm_v019/README.md). No parameter.

MLM_RECOMPUTE_COUNTS=1 (overlap_recompute.py) counts, per rank, the recomputation that ran: each
TransformerLayer's forwards re-run under grad inside a checkpoint recomputation, megatron-core's
CheckpointFunction backwards, and megatron-ucp's --overlap-recompute runtime counters; one JSON
line "> [recompute] {...}" at exit. Counting only; no value changes.
"""

import os
import runpy
import sys

import torch

src = os.environ["MLM_SRC"]  # Megatron-LM tree whose megatron/core was moved away
sys.path.insert(0, src)
if os.environ.get("MLM_HARNESS"):  # the core_v0.14-0.16 fixtures' shim
    sys.path.insert(0, os.environ["MLM_HARNESS"])
    import cpushim_mlm  # noqa: E402,F401  (patches torch.cuda before any megatron import)
else:  # Megatron-LM trees without megatron/legacy (core_v0.19): megatron-ucp's own CUDA shim
    import importlib

    import megatron_ucp.testing.cpu_shim  # noqa: E402,F401
    # the wheel ships the dataset helper prebuilt, not its Makefile (initialize.py runs make)
    importlib.import_module("megatron.core.datasets.helpers_cpp")
    importlib.import_module("megatron.core.datasets.utils").compile_helpers = lambda: None
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402

_sharded_state_dict = DistributedOptimizer.sharded_state_dict


def sharded_state_dict_with_state(self, model_sharded_state_dict=None, is_loading=False, *a, **k):
    if is_loading:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state[p]
                if "step" not in state:
                    state.setdefault("exp_avg", torch.zeros_like(p.data))
                    state.setdefault("exp_avg_sq", torch.zeros_like(p.data))
                    state["step"] = torch.tensor(0.0)
    return _sharded_state_dict(self, model_sharded_state_dict or {}, is_loading, *a, **k)


DistributedOptimizer.sharded_state_dict = sharded_state_dict_with_state


def legacy_step_fixes() -> None:
    """The harness's two opt-in legacy load fixes (core_v0.19.0 runs; see the docstring)."""
    set_states, load_state_dict = (DistributedOptimizer._set_main_param_and_optimizer_states,
                                   DistributedOptimizer.load_state_dict)

    def set_states_keep_step(self, model_param, tensors):
        if "step" not in tensors:
            gi, go = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[gi]["params"][go]]
            if "step" in state:
                tensors = dict(tensors, step=state["step"].clone())  # copied onto itself
        return set_states(self, model_param, tensors)

    def load_state_dict_unshared_step(self, state_dict):
        result = load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if "step" in state and torch.is_tensor(state["step"]):
                state["step"] = state["step"].detach().clone()
        return result

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_keep_step
    DistributedOptimizer.load_state_dict = load_state_dict_unshared_step
    print("> [resume] legacy step load fixes active (load-only)")


if not os.environ.get("MLM_HARNESS"):
    legacy_step_fixes()
print("> [resume] torch_dist load-template state fix active (load-only)")

if os.environ.get("MLM_RESUME_KEEP_STEP") == "1":
    _set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states_without_template_step(self, model_param, tensors):
        tensors = {k: v for k, v in tensors.items() if k != "step"}
        if not os.environ.get("MLM_HARNESS"):  # no harness shim to keep the restored step: here
            gi, go = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[gi]["params"][go]]
            if "step" in state:
                tensors["step"] = state["step"].clone()
        return _set_states(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_without_template_step
    if not os.environ.get("MLM_HARNESS"):  # the harness shim's MLM_SHIM_DISTOPT_UNSHARE_STEP
        _load_state_dict = DistributedOptimizer.load_state_dict

        def load_state_dict_unshared_step(self, state_dict):
            # load_state_dict gives every parameter the same step tensor (torch AdamW then bumps
            # it once per parameter): one copy each, as a fresh run has
            result = _load_state_dict(self, state_dict)
            for state in self.optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].detach().clone()
            return result

        DistributedOptimizer.load_state_dict = load_state_dict_unshared_step
    print("> [resume] dp_reshardable step fix active (load-only)")
if os.environ.get("MLM_RECOMPUTE_COUNTS") == "1":  # overlap_recompute.py: which recomputation ran
    import atexit
    from collections import Counter

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_ucp.recompute import runtime as recompute_runtime

    _counts = Counter()  # ("layer", index) -> recomputed forwards; "CheckpointFunction" -> backwards
    _stage = []
    _checkpoint_backward = tp_random.CheckpointFunction.backward
    _layer_forward = TransformerLayer.forward

    def checkpoint_backward_counted(ctx, *grads):
        _counts["CheckpointFunction"] += 1  # megatron's full layers and selective groups
        return _checkpoint_backward(ctx, *grads)

    def layer_forward_counted(self, *args, **kwargs):
        # a forward under grad inside a checkpoint recomputation (megatron's CheckpointFunction
        # backward or megatron-ucp's deferred one); the first forward of a full layer is no_grad
        if tp_random.is_checkpointing() and torch.is_grad_enabled():
            _counts[("layer", self.layer_number - 1)] += 1
        if not _stage:
            _stage.append(parallel_state.get_pipeline_model_parallel_rank())
        return _layer_forward(self, *args, **kwargs)

    tp_random.CheckpointFunction.backward = staticmethod(checkpoint_backward_counted)
    TransformerLayer.forward = layer_forward_counted

    def report_recompute_counts() -> None:
        import json

        ucp = recompute_runtime.recompute_counts()
        print("> [recompute] " + json.dumps({
            "rank": int(os.environ.get("RANK", 0)), "stage": _stage[0] if _stage else None,
            "layer_forwards_recomputed": {k[1]: v for k, v in sorted(_counts.items(), key=str)
                                          if isinstance(k, tuple)},
            "megatron_checkpoint_backwards": _counts["CheckpointFunction"],
            "ucp_in_p2p_wait": ucp["in_wait"], "ucp_inline": ucp["inline"]}), flush=True)

    atexit.register(report_recompute_counts)
if os.environ.get("MLM_UCP_INSTALL") == "1":  # --ckpt-format universal without (or with) the patch
    import megatron_ucp
    import megatron_ucp.saver as saver
    from megatron_ucp import megatron_lm

    megatron_lm.install()
    _finalize = megatron_ucp.finalize

    def finalize_logged(blocking: bool = True) -> bool:
        """megatron_ucp.finalize, saying when it commits a pending save (and whether the training
        loop's call was the blocking one at the end of training)."""
        pending = saver._PENDING
        done = _finalize(blocking=blocking)
        if pending is not None and done and torch.distributed.get_rank() == 0:
            print(f"> [resume] megatron-ucp async save of iteration {pending.iteration} committed by "
                  f"maybe_finalize_async_save(blocking={blocking})", flush=True)
        return done

    megatron_ucp.finalize = finalize_logged
    print("> [resume] megatron_ucp.megatron_lm.install() in effect")
if any(sys.argv[i] == "--optimizer" and sys.argv[i + 1] in ("muon", "lion")
       for i in range(len(sys.argv) - 1)):  # LayerWise's uneven all-gather on gloo (the harness's)
    import megatron_ucp.testing.gloo_all_gather as gloo_all_gather

    gloo_all_gather.install()
    print("> [resume] megatron_ucp.testing.gloo_all_gather for LayerWise on gloo")
if "--multi-latent-attention" in sys.argv:  # local MLA's core attention (the fixture harness's)
    import megatron_ucp.testing.mla_attention as mla_attention

    mla_attention.install_local_spec()
    print("> [resume] megatron_ucp.testing.mla_attention core attention for local MLA")
script = os.path.join(src, "pretrain_gpt.py")
sys.argv = [script] + sys.argv[1:]
runpy.run_path(script, run_name="__main__")
