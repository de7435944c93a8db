"""Launched scenarios for the Hugging Face export/import tests: megatron-core logits of tiny models.

Each function runs inside one rank (`launch.launch`) and handles several model configs in one
launch (a launch costs tens of seconds of imports): the process group stays up, megatron-core's
model-parallel groups are rebuilt per config. Logits are gathered over TP and written by rank 0.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.utils import unwrap_model

import megatron_ucp as ucp
from megatron_ucp.optimizer_state import OptimizerIndex
from megatron_ucp.testing import tiny_gpt as tg  # installs the CPU shim first
from megatron_ucp.testing.scenarios import setup


def _teardown() -> None:
    dist.barrier()
    ps.destroy_model_parallel()


@torch.no_grad()
def logits(st: tg.TrainState, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [batch, seq, padded vocab] of the model for `tokens` (PP1)."""
    if st.layout.pp != 1:
        raise ValueError("logits() runs the model in one stage (PP1)")
    model = st.model[0]
    model.eval()
    seq = tokens.shape[1]
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
    positions = torch.arange(seq).expand(tokens.shape[0], -1)
    # MTP layers do not change the main logits, but megatron-core 0.16.1's GPTModel.forward runs
    # them and then needs labels (upstream: `labels.clone()` on None): off for this forward
    gpt = unwrap_model(model)
    mtp = getattr(gpt, "mtp_process", False), gpt.config.mtp_num_layers
    gpt.mtp_process, gpt.config.mtp_num_layers = False, None
    try:
        out = model(tokens.cuda(), positions.cuda(), mask.cuda()).float().cpu()
    finally:
        gpt.mtp_process, gpt.config.mtp_num_layers = mtp
    model.train()
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:  # the output layer is vocab-parallel: each TP rank holds a block of the vocabulary
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
        out = torch.cat(parts, dim=-1)
    return out


def _write(t: torch.Tensor | dict, path: str) -> None:
    if dist.get_rank() == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(t, path)


def train_save_logits(layout: str, runs: list[dict], steps: int, tokens: list) -> list[dict]:
    """For each run {cfg, save_dir, logits[, steps]}: train `steps` (the run's own if given), save
    with megatron_ucp.save (the true vocabulary recorded), write the trained model's logits for
    `tokens`."""
    out = []
    for run in runs:
        st = setup(layout, run["cfg"])
        losses = [tg.train_step(st) for _ in range(run.get("steps", steps))]
        ucp.save(st.model, st.optimizer, st.scheduler, run["save_dir"], st.iteration,
                 seed=st.config.seed, vocab_size=st.config.unpadded_vocab_size)
        _write(logits(st, torch.tensor(tokens)), run["logits"])
        out.append({"losses": losses})
        _teardown()
    return out


def _fresh_optimizer(st: tg.TrainState) -> bool:
    """This rank's optimizer state is new: every state of its family (Adam's moments, SGD's
    momentum, ...) zero and step 0 for every shard it holds."""
    index = OptimizerIndex(st.optimizer)
    for p in index.owner:
        if index.shard_range(p) is None:
            continue
        states, step = index.get(p)
        if float(step) != 0.0 or any(t.any() for k, t in states.items() if k != "param"):
            return False
    return True


def load_logits(layout: str, runs: list[dict], tokens: list, train_steps: int = 1) -> list[dict]:
    """For each run {cfg, load_dir[, logits][, tokens][, weights][, resave_dir][, train_steps]}: build
    at `layout`, megatron_ucp.load, write the logits for the run's tokens (default `tokens`; PP1) and
    rank 0's model weights (`weights`), save
    the loaded state again (resave_dir), then train `train_steps` (the run's own if given) from it
    (a fresh optimizer for imports)."""
    out = []
    for run in runs:
        st = setup(layout, run["cfg"])
        r = ucp.load(st.model, st.optimizer, st.scheduler, run["load_dir"])
        st.iteration = r.iteration
        if run.get("logits"):
            _write(logits(st, torch.tensor(run.get("tokens", tokens))), run["logits"])
        if run.get("weights"):  # rank 0's model weights (the training dtype), by local name
            _write({n: p.detach().clone() for c in st.model for n, p in c.named_parameters()},
                   run["weights"])
        fresh = _fresh_optimizer(st)
        if run.get("resave_dir"):
            ucp.save(st.model, st.optimizer, st.scheduler, run["resave_dir"], st.iteration,
                     extra=r.extra, seed=st.config.seed, vocab_size=st.config.unpadded_vocab_size)
        losses = [tg.train_step(st) for _ in range(run.get("train_steps", train_steps))]
        out.append({"iteration": r.iteration, "losses": losses, "fresh_optimizer": fresh,
                    "weights_only": r.fresh_optimizer,
                    "finite": all(math.isfinite(x) for x in losses)})
        _teardown()
    return out


def stream_and_save(layout: str, runs: list[dict], steps: int) -> list[dict]:
    """For each run {cfg, arch, save_dir, stream}: train `steps`, save with megatron_ucp.save, then
    stream the live model's HF weights (`megatron_ucp.export_hf_weights`, bf16); rank 0 writes what it
    received to `stream` (safetensors). Returns the seconds of the save and of the stream, the
    tensor bytes streamed and how much the stream raised this process's peak RSS."""
    import resource
    import time

    from safetensors.torch import save_file

    out = []
    for run in runs:
        st = setup(layout, run["cfg"])
        for _ in range(steps):
            tg.train_step(st)
        t0 = time.perf_counter()
        ucp.save(st.model, st.optimizer, st.scheduler, run["save_dir"], st.iteration,
                 seed=st.config.seed, vocab_size=st.config.unpadded_vocab_size)
        saved = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        total, got = 0, {}
        for name, tensor in ucp.export_hf_weights(st.model, run["arch"], dtype="bf16",
                                                  vocab_size=st.config.unpadded_vocab_size):
            total += tensor.numel() * tensor.element_size()
            if run.get("stream"):  # (a benchmark keeps nothing: an engine would copy and drop it)
                got[name] = tensor
        seconds = time.perf_counter() - t0
        rss_growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) * 1024
        if dist.get_rank() == 0 and run.get("stream"):
            save_file(got, run["stream"])
        out.append({"seconds": seconds, "save_seconds": saved, "bytes": total,
                    "peak_rss_growth": rss_growth})
        _teardown()
    return out
