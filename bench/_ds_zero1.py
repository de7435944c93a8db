"""Rank function writing a real DeepSpeed ZeRO-1 (bf16, torch Adam) checkpoint on CPU, for the scale
bench's `ds_to_universal` anchor. Run through `megatron_ucp.testing.launch` with DeepSpeed on
PYTHONPATH (DeepSpeed is not a dependency of megatron-ucp; bench/bench_scale.py says how).

The model is /work/shared/peers/deepspeed/make_zero1_checkpoint.py's torch GPT (the one
`ds_to_universal` was measured with there): token and position embeddings, `num_layers` torch
`TransformerEncoderLayer`s (pre-norm), a final LayerNorm and an untied output head. Its parameter
count equals the megatron-core GPT with untied embeddings of the same sizes:
L * (12 h^2 + 13 h) + 2 V h + S h + 2 h. Unlike the peer's script it skips the full-state
reference gather (memory the size of the model on every rank), which the bench does not need.
"""

from __future__ import annotations

import os
import resource
import time

import torch
import torch.nn as nn


class TorchGPT(nn.Module):
    def __init__(self, num_layers: int, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 vocab_size: int, seq_length: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, hidden_size)
        self.pos = nn.Embedding(seq_length, hidden_size)
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(hidden_size, num_attention_heads, ffn_hidden_size, dropout=0.0,
                                       batch_first=True, norm_first=True)
            for _ in range(num_layers)])
        self.ln_f = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos(torch.arange(tokens.shape[1]))
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1]).to(h.dtype)
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return self.head(self.ln_f(h))


def train_and_save(save_dir: str, num_layers: int, hidden_size: int, ffn_hidden_size: int,
                   num_attention_heads: int, vocab_size: int, seq_length: int, micro_batch_size: int = 1,
                   train_steps: int = 1) -> dict:
    """Build the model under a DeepSpeed ZeRO-1 bf16 engine (gloo), train `train_steps` so the Adam
    state exists, save to `save_dir` (`global_step<N>/` and `latest`). Returns params and timings."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # only on the bench's PYTHONPATH

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)
    model = TorchGPT(num_layers, hidden_size, ffn_hidden_size, num_attention_heads, vocab_size, seq_length)
    params = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": True}, "steps_per_print": 10**9}
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    rank = torch.distributed.get_rank()
    generator = torch.Generator().manual_seed(rank)
    t1 = time.perf_counter()
    for _ in range(train_steps):
        tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length), generator=generator)
        logits = engine(tokens)
        loss = nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, vocab_size),
                                           tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
    t2 = time.perf_counter()
    engine.save_checkpoint(save_dir)
    t3 = time.perf_counter()
    torch.distributed.barrier()
    return {"rank": rank, "params": params, "init_s": t1 - t0, "train_s": t2 - t1, "save_s": t3 - t2,
            "global_steps": engine.global_steps,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
