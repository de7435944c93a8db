from megatron_ucp.testing import tiny_gpt as tg
from megatron_ucp.layout import Layout
import torch
import torch.distributed as dist
def run(layout, dtype="fp32", swiglu=False, rank_show=0):
    L = Layout.parse(layout)
    tg.init_distributed(L)
    cfg = tg.TinyGPTConfig(dtype=dtype, swiglu=swiglu)
    st = tg.build(cfg, L)
    losses = [tg.train_step(st) for _ in range(2)]
    lines = []
    if dist.get_rank() == rank_show:
        from megatron.core.utils import unwrap_model
        for m in st.model:
            m = unwrap_model(m)
            sd = m.sharded_state_dict()
            for k, v in sd.items():
                lines.append(" ".join(map(str,(k, type(v).__name__, getattr(v, "key", None), getattr(v, "global_shape", None), getattr(v, "global_offset", None), getattr(v, "axis_fragmentations", None), getattr(v, "replica_id", None), getattr(v,"prepend_axis_num",None), getattr(v, 'data', torch.zeros(0)).dtype if hasattr(v,'data') and v.data is not None else None))))
        lines.append(str(type(st.optimizer)))
        opt = st.optimizer
        lines.append(str([ (g.get('wd_mult'), g.get('lr_mult'), g['weight_decay'], len(g['params'])) for g in opt.param_groups]))
        lines.append(str(opt.optimizer.state[opt.optimizer.param_groups[0]['params'][0]].keys()))
        lines.append(str(st.scheduler.state_dict()))
    return {"losses": losses, "lines": lines}
