"""Fault-injection scenarios run through `launch` (see tests/test_fault.py).

`save_then_die` trains, commits one checkpoint normally, trains on, and starts a second save in
which one rank stops half-way through writing its rank file, touches a marker file and waits to be
SIGKILLed by `launch(..., kill_rank_after=(victim, marker))`. Only that process's own reference to
`write_rank_file` (as imported by megatron_ucp.saver) is replaced; megatron-core is untouched.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from pathlib import Path

import torch.distributed as dist

from megatron_ucp.formats.fragments import rank_file as fragments
from megatron_ucp.testing import scenarios  # installs the CPU shim before megatron.core
from megatron_ucp.testing import tiny_gpt as tg


def _save_module():
    return importlib.import_module("megatron_ucp.saver")  # imported after the shim


def _dying_write_rank_file(marker: str):
    """write_rank_file that writes the header and half of the tensors, then stalls forever."""
    real = _save_module().write_rank_file

    class StallingWriter(fragments.SafetensorsWriter):
        def write(self, name, t):
            if self.next == len(self.order) // 2:
                self.file.flush()
                os.fsync(self.file.fileno())
                Path(marker).touch()  # the launcher SIGKILLs this process now
                time.sleep(300)
                raise RuntimeError("stalled rank was not killed")
            super().write(name, t)

    def dying(path, frags, rng_tensors, rng_meta, coords):
        fragments.SafetensorsWriter = StallingWriter  # this process only; it never returns
        return real(path, frags, rng_tensors, rng_meta, coords)

    return dying


def _save(save_module, st: tg.TrainState, save_dir: str, async_save: bool = False) -> None:
    save_module.save(st.model, st.optimizer, st.scheduler, save_dir, st.iteration, seed=st.config.seed,
                     extra={"consumed_samples": st.iteration * st.config.global_batch_size},
                     async_save=async_save)


def save_then_die(layout: str, cfg: dict, save_dir: str, marker: str, victim: int = 1,
                  steps: int = 2, dump_dir: str | None = None, record: str | None = None,
                  async_save: bool = False) -> dict:
    """Train `steps`, save iteration `steps`, train one more step, then save again while rank
    `victim` dies mid-write. dump_dir: raw local state at the first save (scenarios.dump_local_state).
    record: JSON file (rank 0) with the losses, including the step after the good checkpoint.
    async_save: the second save is asynchronous: the victim's background writer stalls while every
    rank goes on to train and then waits in `finalize` (the commit never happens)."""
    save_module = _save_module()
    st = scenarios._setup(layout, cfg)
    losses = [tg.train_step(st) for _ in range(steps)]
    if dump_dir:
        scenarios.dump_local_state(st, dump_dir)
    _save(save_module, st, save_dir)
    losses.append(tg.train_step(st))
    if record and dist.get_rank() == 0:
        Path(record).write_text(json.dumps({"losses": losses}))
    if dist.get_rank() == victim:
        save_module.write_rank_file = _dying_write_rank_file(marker)
    _save(save_module, st, save_dir, async_save)
    if async_save:
        tg.train_step(st)  # training goes on while the writer works
        save_module.finalize()
    raise RuntimeError("the second save completed although a rank was meant to die in it")
