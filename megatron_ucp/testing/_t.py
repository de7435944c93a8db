from megatron_ucp.testing import tiny_gpt as tg
from megatron_ucp.layout import Layout
import megatron_ucp as ucp
import torch.distributed as dist
def src(layout, path, dtype="fp32", swiglu=False, n=3):
    L = Layout.parse(layout); tg.init_distributed(L)
    st = tg.build(tg.TinyGPTConfig(dtype=dtype, swiglu=swiglu), L)
    losses = [tg.train_step(st) for _ in range(n)]
    ucp.save(st.model, st.optimizer, st.scheduler, path, st.iteration)
    losses += [tg.train_step(st) for _ in range(n)]
    return losses
def dst(layout, path, dtype="fp32", swiglu=False, n=3):
    L = Layout.parse(layout); tg.init_distributed(L)
    st = tg.build(tg.TinyGPTConfig(dtype=dtype, swiglu=swiglu), L)
    r = ucp.load(st.model, st.optimizer, st.scheduler, path)
    st.iteration = r.iteration
    losses = [tg.train_step(st) for _ in range(n)]
    return {"losses": losses, "bytes": r.bytes_read}
