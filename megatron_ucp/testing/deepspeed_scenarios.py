"""Launched scenario for the DeepSpeed import tests: one megatron-core training step from an
imported DeepSpeed checkpoint, on a fixed batch, to compare with DeepSpeed's own next step.

The DeepSpeed run (tests/fixtures/deepspeed/make_fixture.py) is a torch GPT: pre-norm
TransformerEncoderLayer blocks with ReLU, learned positions, untied head, trained with
torch.optim.Adam (no weight decay, constant LR, DeepSpeed's default gradient clipping to norm 1)
under ZeRO-1 bf16. The megatron-core run matches it: the tiny GPT with ReLU, clip_grad 1.0, and the
Adam hyper-parameters
the name map put in the imported param groups (lr, betas, eps, weight decay 0). DeepSpeed's loss
is the mean over tokens 1.. of the batch predicted from tokens ..-1, so the megatron run reads
`batch[:, :-1]` and predicts `batch[:, 1:]`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

import megatron_ucp as ucp
from megatron_ucp.layout import Layout
from megatron_ucp.optimizer_state import torch_optimizers
from megatron_ucp.testing import tiny_gpt as tg  # installs the CPU shim first


def tiny_config(model: dict, dtype: str, batch: int) -> tg.TinyGPTConfig:
    """The megatron-core twin of the fixture's torch GPT (`model`: the name map's settings)."""
    return tg.TinyGPTConfig(
        num_layers=model["num_layers"], hidden_size=model["hidden_size"],
        num_attention_heads=model["num_attention_heads"], ffn_hidden_size=model["ffn_hidden_size"],
        vocab_size=model["vocab_size"], unpadded_vocab_size=model["vocab_size"],
        seq_length=model["max_position_embeddings"], normalization="LayerNorm",
        position_embedding_type="learned_absolute", add_bias_linear=True, untie_embeddings=True,
        dtype=dtype, micro_batch_size=batch, global_batch_size=batch,
        extra={"activation_func": F.relu, "layernorm_epsilon": model["layernorm_epsilon"]})


def _step(st: tg.TrainState, tokens: torch.Tensor, train: bool) -> float:
    """Forward (and with `train`, backward and optimizer step) on this DP rank's share of
    `tokens` [batch, seq + 1]; returns the global mean loss before the step."""
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = tokens.chunk(dp)[rank]
    seq = mine.shape[1] - 1
    batch = {"tokens": mine[:, :-1].contiguous(), "labels": mine[:, 1:].contiguous(),
             "position_ids": torch.arange(seq).expand(len(mine), -1),
             "attention_mask": torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]}

    def forward(data, model):
        b = next(data)
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
        return out, lambda o: (o.float().mean(), {"lm loss": o.float().mean().detach()})

    for m in st.model:
        m.zero_grad_buffer()
    st.optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward, data_iterator=iter([batch]), model=st.model, num_microbatches=1,
        seq_length=seq, micro_batch_size=len(mine), forward_only=not train)
    if train:
        ok, _, _ = st.optimizer.step()
        if not ok:
            raise RuntimeError("megatron-core skipped the optimizer step")
    loss = torch.tensor([float(losses[0]["lm loss"]) / dp], dtype=torch.float64)
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    return float(loss)


def step_from_import(runs: list[dict], model: dict, tokens: list) -> list[dict]:
    """For each run {layout, dtype, load_dir[, save_dir]}: build the tiny GPT at `layout`, load
    the imported checkpoint, and with `save_dir` take one training step on `tokens` (the fixed
    batch, [batch, seq + 1]) and save the result (megatron_ucp.save); without it, only the loss.
    Returns the loss before the step and the optimizer's hyper-parameters after the load."""
    out = []
    batch = torch.tensor(tokens)
    for run in runs:
        lay = Layout.parse(run["layout"])
        tg.init_distributed(lay)
        st = tg.build(tiny_config(model, run["dtype"], len(batch) // lay.dp), lay)
        # gradient clipping: megatron-core's clip_grad 1.0 (the tiny GPT's) is DeepSpeed's default
        # gradient_clipping (1.0), which the fixture's run kept
        r = ucp.load(st.model, st.optimizer, st.scheduler, run["load_dir"])
        groups = [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay", "wd_mult")}
                  for o in torch_optimizers(st.optimizer) for g in o.param_groups]
        loss = _step(st, batch, train=bool(run.get("save_dir")))
        if run.get("save_dir"):
            ucp.save(st.model, st.optimizer, st.scheduler, run["save_dir"], r.iteration + 1,
                     seed=st.config.seed, vocab_size=model["vocab_size"])
        out.append({"loss": loss, "iteration": r.iteration, "param_groups": groups})
        dist.barrier()
        ps.destroy_model_parallel()
    return out
