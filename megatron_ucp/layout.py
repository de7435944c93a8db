"""Parallel layout of a run: how many ways each parallelism splits the model."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int | None = None  # virtual pipeline chunks per PP rank; None = not interleaved
    cp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def __str__(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.vpp:
            parts.append(f"VPP{self.vpp}")
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        parts.append(f"DP{self.dp}")
        return "x".join(parts)

    @classmethod
    def parse(cls, text: str) -> Layout:
        """'tp2pp2', 'TP2xPP2xDP1', 'dp2' -> Layout; unnamed sizes are 1."""
        sizes = {k.lower(): int(v) for k, v in re.findall(r"(vpp|tp|pp|dp|cp|ep)(\d+)", text, re.I)}
        if not sizes:
            raise ValueError(f"cannot parse layout {text!r}: expected e.g. 'tp2pp2dp1'")
        return cls(**sizes)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Layout:
        return cls(**d)

    @classmethod
    def current(cls) -> Layout:
        """The layout of the initialised megatron-core process groups."""
        from megatron.core import parallel_state as ps

        return cls(
            tp=ps.get_tensor_model_parallel_world_size(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            dp=ps.get_data_parallel_world_size(),
            vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
            cp=ps.get_context_parallel_world_size(),
            ep=ps.get_expert_model_parallel_world_size(),
        )
