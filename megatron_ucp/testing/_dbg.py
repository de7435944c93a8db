from megatron_ucp.testing import tiny_gpt as tg
from megatron_ucp.testing.scenarios import _setup
import megatron_ucp as ucp
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core import parallel_state as ps
def fwd(layout, load_dir):
    st = _setup(layout, {})
    ucp.load(st.model, st.optimizer, st.scheduler, load_dir)
    batches = tg._micro_batches(st.config, 3)
    iters = [iter(batches) for _ in st.model]
    out = get_forward_backward_func()(forward_step_func=tg._forward_step, data_iterator=iters if len(iters) > 1 else iters[0], model=st.model, num_microbatches=len(batches), seq_length=32, micro_batch_size=2, forward_only=True)
    return [float(x["lm loss"]) for x in out] if ps.is_pipeline_last_stage(ignore_virtual=True) else []
import torch.distributed as dist
def trace(layout):
    st = _setup(layout, {})
    batches = tg._micro_batches(st.config, 0)
    for i, b in enumerate(batches): b["id"] = i
    seen = []
    def fs(data_iterator, model):
        b = next(data_iterator)
        seen.append((id(data_iterator) % 1000, b["id"]))
        return tg._forward_step(iter([b]), model)
    iters = [iter(batches) for _ in st.model]
    get_forward_backward_func()(forward_step_func=fs, data_iterator=iters, model=st.model, num_microbatches=len(batches), seq_length=32, micro_batch_size=2, forward_only=False)
    return {"rank": dist.get_rank(), "seen": seen}
def trainfwd(layout, load_dir):
    st = _setup(layout, {})
    ucp.load(st.model, st.optimizer, st.scheduler, load_dir)
    batches = tg._micro_batches(st.config, 3)
    iters = [iter(batches) for _ in st.model]
    for m in st.model: m.zero_grad_buffer()
    out = get_forward_backward_func()(forward_step_func=tg._forward_step, data_iterator=iters if len(iters) > 1 else iters[0], model=st.model, num_microbatches=len(batches), seq_length=32, micro_batch_size=2, forward_only=False)
    return [float(x["lm loss"]) for x in out] if ps.is_pipeline_last_stage(ignore_virtual=True) else []
