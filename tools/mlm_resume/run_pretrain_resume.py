"""Stock Megatron-LM `pretrain_gpt.py` on CPU for resume checks: the fixture harness's CUDA shim
(`$MLM_HARNESS/cpushim_mlm.py`, with its two opt-in legacy load fixes) plus two load-only fixes for
torch_dist resumes. No Megatron-LM file is changed; `pretrain_gpt.py` runs through runpy.

Why the fix: megatron-core 0.16.1 without TE/Apex builds torch AdamW, whose per-parameter state
(and its `step`) exists only after a first step, and DistributedOptimizer.sharded_state_dict(
is_loading=True) calls state_dict(), which asserts one `step` over that empty state, so no
torch_dist checkpoint (Megatron-LM's own included) can be loaded here. Before the load template is
built, every parameter gets the zero state init_state_fn would create plus a zero `step` tensor;
the load then overwrites all of it from the checkpoint (the step from the saved param groups).

Why the second (env MLM_RESUME_KEEP_STEP=1): with torch AdamW, the dp_reshardable load copies
each parameter's `step` from the load template (the fresh optimizer's, 0) over the step that
load_state_dict has just restored from the saved param groups, so every dp_reshardable resume,
of Megatron-LM's own checkpoints too, restarts Adam's bias correction at step 0. The fix drops
that template `step`; the harness's MLM_SHIM_DISTOPT_STEP_LOAD_FIX then keeps the restored one.
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
script = os.path.join(src, "pretrain_gpt.py")
sys.argv = [script] + sys.argv[1:]
runpy.run_path(script, run_name="__main__")
