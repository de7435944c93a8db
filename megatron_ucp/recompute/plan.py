"""A recompute plan as plain data: what the planner decides and the runtime executes.

Per layer (global index, 0-based): its pipeline stage, the recompute choice and the window its
recomputation runs in:
- recompute "none": every activation kept;
- "selective": the SELECTIVE groups in `modules` are recomputed in place, inside the layer's own
  backward (megatron-core's mechanism, per layer);
- "full": only the layer input is kept; the layer's forward is re-run before its backward, in
  `window` "p2p_wait" (while the stage waits for the output gradient of that micro-batch; in the
  cool-down this is also the pipeline bubble) or "inline" (right before the backward, as
  megatron-core's own full recompute does).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_ucp.recompute.profile import SELECTIVE, read_json, write_json

FORMAT_VERSION = 1
CHOICES = ("none", "selective", "full")
WINDOWS = ("p2p_wait", "inline", None)


class PlanError(ValueError):
    """A plan file that cannot be used; the message names the file, the layer and the field."""


@dataclass
class LayerPlan:
    index: int  # global layer number, 0-based
    stage: int  # pipeline stage (0-based)
    recompute: str  # one of CHOICES
    modules: list = field(default_factory=list)  # SELECTIVE keys, for "selective"
    window: str | None = None  # one of WINDOWS, for "full"


@dataclass
class Prediction:
    step_s: float
    peak_bytes: list  # per stage: static (weights, grads, optimizer) + activations
    activation_peak_bytes: list  # per stage: activations only
    idle_s: list = field(default_factory=list)  # per stage: time waiting (bubbles, p2p)


@dataclass
class Plan:
    model: dict  # as Profile.model (num_layers included)
    layout: dict  # tp, pp, dp, micro_batch_size, global_batch_size, vpp (None: not interleaved)
    memory_limit_bytes: int
    layers: list  # [LayerPlan], one per layer, by index
    layers_per_stage: list  # the recompute-aware partition
    predicted: Prediction
    # Megatron's best setting under the same limit: {"setting": {...}, "predicted": Prediction}
    baseline: dict
    profile_device: str = ""
    search_s: float = 0.0
    version: int = FORMAT_VERSION

    @property
    def megatron_args(self) -> list[str]:
        """Megatron-LM flags for the partition (uneven first/last stages)."""
        first, last = self.layers_per_stage[0], self.layers_per_stage[-1]
        if len(self.layers_per_stage) == 1 or len(set(self.layers_per_stage)) == 1:
            return []
        return ["--decoder-first-pipeline-num-layers", str(first),
                "--decoder-last-pipeline-num-layers", str(last)]

    def stage_layers(self, stage: int) -> list[LayerPlan]:
        return [lp for lp in self.layers if lp.stage == stage]

    def to_json(self) -> dict:
        return {**asdict(self), "megatron_args": self.megatron_args}

    @classmethod
    def from_json(cls, data: dict, where: str = "<plan>") -> Plan:
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            raise PlanError(f"{where}: not a megatron-ucp recompute plan of version {FORMAT_VERSION}"
                            f" (field 'version' is {data.get('version')!r}); write it again with "
                            "`megatron-ucp plan-recompute`")
        try:
            layers = [LayerPlan(**lp) for lp in data["layers"]]
            plan = cls(model=dict(data["model"]), layout=dict(data["layout"]),
                       memory_limit_bytes=int(data["memory_limit_bytes"]), layers=layers,
                       layers_per_stage=list(data["layers_per_stage"]),
                       predicted=Prediction(**data["predicted"]), baseline=dict(data["baseline"]),
                       profile_device=data.get("profile_device", ""),
                       search_s=float(data.get("search_s", 0.0)))
        except KeyError as e:
            raise PlanError(f"{where}: missing field {e.args[0]!r}") from None
        except TypeError as e:
            raise PlanError(f"{where}: malformed entry ({e})") from None
        plan.check(where)
        return plan

    def check(self, where: str = "<plan>") -> None:
        """Refuse a plan whose layers, stages, choices or windows do not add up."""
        pp = int(self.layout["pp"])
        if len(self.layers_per_stage) != pp or min(self.layers_per_stage, default=0) < 0:
            raise PlanError(f"{where}: 'layers_per_stage' {self.layers_per_stage} does not describe "
                            f"{pp} pipeline stages")
        if [lp.index for lp in self.layers] != list(range(sum(self.layers_per_stage))):
            raise PlanError(f"{where}: 'layers' must list layers 0..{sum(self.layers_per_stage) - 1}"
                            " in order, once each")
        vpp = int(self.layout.get("vpp") or 1)
        if vpp > 1:
            # interleaved (even split only): virtual stage v = chunk * pp + stage holds layers
            # [v * n, (v + 1) * n), n = layers per model chunk, as megatron-core numbers them
            n = self.layers_per_stage[0] // vpp
            if len(set(self.layers_per_stage)) != 1 or n * vpp != self.layers_per_stage[0] or n < 1:
                raise PlanError(f"{where}: an interleaved plan (vpp={vpp}) needs the same number of "
                                f"layers on every stage, a multiple of vpp; got {self.layers_per_stage}")
            expected = [(i // n) % pp for i in range(sum(self.layers_per_stage))]
        else:
            expected = [s for s, n in enumerate(self.layers_per_stage) for _ in range(n)]
        for lp, stage in zip(self.layers, expected):
            if lp.stage != stage:
                raise PlanError(f"{where}: layer {lp.index} is on stage {lp.stage}, but "
                                f"'layers_per_stage' puts it on stage {stage}")
            if lp.recompute not in CHOICES:
                raise PlanError(f"{where}: layer {lp.index}: recompute {lp.recompute!r} is not one "
                                f"of {CHOICES}")
            if lp.recompute == "selective" and (not lp.modules or
                                                not set(lp.modules) <= set(SELECTIVE)):
                raise PlanError(f"{where}: layer {lp.index}: selective modules {lp.modules} must be "
                                f"a non-empty subset of {sorted(SELECTIVE)}")
            if lp.recompute == "full" and lp.window not in ("p2p_wait", "inline"):
                raise PlanError(f"{where}: layer {lp.index}: a full recompute needs window "
                                f"'p2p_wait' or 'inline', not {lp.window!r}")


def save(plan: Plan, path: str | Path) -> None:
    write_json(plan.to_json(), path)


def load(path: str | Path) -> Plan:
    data = read_json(path, PlanError, "recompute plan")
    data.pop("megatron_args", None)
    return Plan.from_json(data, str(path))
