"""Read a DeepSpeed universal checkpoint folder (`ds_to_universal` output) as a source of universal
tensors, optimizer state included.

On disk (DeepSpeed 0.19): `<folder>/zero/<DeepSpeed parameter name>/{fp32,exp_avg,exp_avg_sq}.pt`,
each a `torch.save`d dict `{"param": full fp32 tensor, "cat_dim": int, ...}` (TP slices merged,
ZeRO partitions gathered, vocab padding stripped where the model declared it), and `step.pt`, the
Adam step (a tensor). `zero/optimizer_state.pt` (param groups, loss scaler: DeepSpeed classes) is
not read: hyper-parameters come from the name map or from the loading run. Of the
`mp_rank_00_model_states.pt` copy only Megatron-DeepSpeed's `args` are read, for the head counts
of a map whose sizes are `auto` (the other sizes come from the parameters' shapes). Every `.pt`
is unpickled with torch's restricted unpickler
(`megatron_common.torch_load`; `trust_pickle` lifts it).

The name map (`name_map.NameMap`) says which megatron-core model the run is and which megatron-core
parameter each DeepSpeed parameter becomes, in which element order (`layouts`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.base import Source
from megatron_ucp.formats.deepspeed import layouts
from megatron_ucp.formats.deepspeed.name_map import AUTO, DTYPES, NameMap, Rule
from megatron_ucp.formats.manifest import RUN_HYPERPARAMETERS, Manifest, ParamEntry
from megatron_ucp.formats.megatron_common import torch_load
from megatron_ucp.formats.megatron_rebuild import import_specs
from megatron_ucp.formats.tensor_transforms import Heads
from megatron_ucp.layout import Layout
from megatron_ucp.spec import ParamSpec
from megatron_ucp.storage import location, size_of

log = logging.getLogger(__name__)

ZERO = "zero"
LATEST = "latest_universal"  # DeepSpeed's pointer to the universal folder in a save directory
STATE_FILES = {"param": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
RECORD = "deepspeed_import"  # manifest `extra` key: where the state came from (folder, map, model)
HOLDS = ("a DeepSpeed universal checkpoint's zero/<param>/*.pt files hold (tensors, in dicts with "
         "ints and flags)")


def resolve(path: str | Path) -> Path:
    """The folder holding `zero/`: `path` itself, its `latest_universal` target, or the parent of
    a `zero` folder."""
    path = location(path)
    if (path / ZERO).is_dir():
        return path
    if (path / LATEST).is_file():
        name = (path / LATEST).read_text().strip()
        if name and "/" not in name and (path / name / ZERO).is_dir():
            return path / name
        raise UCPError(f"{path / LATEST} names {name!r}, which is not a DeepSpeed universal folder "
                       f"under {path} (no {ZERO}/ in it); run ds_to_universal or pass the folder")
    if path.name == ZERO and any(path.glob("*/fp32.pt")):
        return path.parent
    if not path.exists():
        raise UCPError(f"{path} does not exist; pass ds_to_universal's --output_folder")
    raise UCPError(f"{path} is not a DeepSpeed universal checkpoint (no {ZERO}/ folder of "
                   "<param>/fp32.pt files, no latest_universal); convert the DeepSpeed checkpoint "
                   "with `python -m deepspeed.checkpoint.ds_to_universal` first")


def is_ds_universal(path: str | Path) -> bool:
    try:
        resolve(path)
    except UCPError:
        return False
    return True


class DSUniversalDir:
    """The `zero/` folder: parameter names, and each state file unpickled on demand."""

    def __init__(self, path: str | Path, trust_pickle: bool = False):
        self.dir = resolve(path)
        self.zero = self.dir / ZERO
        self.trust_pickle = trust_pickle
        self.names = sorted(p.name for p in self.zero.iterdir() if p.is_dir())
        if not self.names:
            raise UCPError(f"{self.zero} holds no parameter folders; the conversion did not complete")
        self.bytes_read = 0
        self.files_opened = 0

    def file(self, name: str, stem: str) -> Path:
        return self.zero / name / f"{stem}.pt"

    def load(self, name: str, stem: str) -> Any:
        """The unpickled `<name>/<stem>.pt` (memory-mapped), counted as read."""
        path = self.file(name, stem)
        obj = torch_load(path, f"ds_to_universal writes {stem}.pt for every parameter with "
                         "optimizer state; the folder is incomplete: convert the DeepSpeed checkpoint "
                         "again (ds_to_universal --inject_missing_state)", self.trust_pickle, HOLDS)
        self.bytes_read += size_of(path)
        self.files_opened += 1
        return obj

    def tensor(self, name: str, state: str) -> torch.Tensor:
        """Full fp32 tensor of a state (`param`, `exp_avg`, `exp_avg_sq`) of DeepSpeed parameter `name`."""
        stem = STATE_FILES[state]
        obj = self.load(name, stem)
        t = obj.get("param") if isinstance(obj, dict) else obj
        if not torch.is_tensor(t):
            found = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise UCPError(f"{self.file(name, stem)}: expected a dict with a 'param' tensor (what "
                           f"ds_to_universal writes), found {found}; is this a DeepSpeed universal folder?")
        if not t.is_floating_point():
            raise UCPError(f"{self.file(name, stem)}: {t.dtype} tensor; expected floating point")
        return t

    def run_args(self) -> dict:
        """Megatron-DeepSpeed's saved args (`args` of the `mp_rank_00_model_states.pt` copy that
        ds_to_universal leaves beside `zero/`) as a dict; {} when the folder has none or they do
        not unpickle under the restricted unpickler (DeepSpeed trains other modules too)."""
        path = self.dir / "mp_rank_00_model_states.pt"
        if not path.is_file():
            return {}
        try:
            obj = torch_load(path, "", self.trust_pickle, HOLDS)
        except UCPError as e:
            log.info("%s: its args are not read (%s)", path, e)
            return {}
        args = obj.get("args") if isinstance(obj, dict) else None
        return dict(vars(args)) if args is not None and hasattr(args, "__dict__") else {}

    def step(self, name: str) -> float:
        obj = self.load(name, "step")
        if torch.is_tensor(obj) and obj.numel() == 1:
            return float(obj)
        if isinstance(obj, (int, float)) and not isinstance(obj, bool):
            return float(obj)
        raise UCPError(f"{self.file(name, 'step')}: expected the Adam step (a number), found "
                       f"{type(obj).__name__}")


class DeepSpeedSource(Source):
    """A DeepSpeed universal folder as universal tensors of megatron-core's model (module doc)."""

    format = "deepspeed"  # its name in the `formats` registry

    def __init__(self, path: str | Path, name_map: str | Path | None = None, *,
                 trust_pickle: bool = False, **_: object):
        if name_map is None:
            raise UCPError(f"{path}: a DeepSpeed universal folder names torch modules, not "
                           "megatron-core parameters; import it with `megatron-ucp import-deepspeed "
                           "DIR OUT --name-map MAP.yaml` (maps in configs/deepspeed/)")
        self.ds = DSUniversalDir(path, trust_pickle)
        self.dir = self.ds.dir
        where = str(self.dir)
        # each state file is unpickled (memory-mapped) once: checked here, its data read by `read`
        self._mapped = {(n, "param"): self.ds.tensor(n, "param") for n in self.ds.names}
        shapes = {n: tuple(self._mapped[(n, "param")].shape) for n in self.ds.names}
        loaded = NameMap.load(name_map)
        args = self.ds.run_args() if AUTO in loaded.model.values() else {}  # heads of an auto map
        self.map = loaded.with_sizes(shapes, args, where)
        args, run = self.map.megatron_args()
        specs, model = import_specs(args, run, self.map.model["vocab_size"])
        self.heads = Heads.of(self.map.model)
        self.rules = self.map.assign(self.ds.names, specs, where)
        dtype = DTYPES[self.map.model["params_dtype"]]
        steps = {n: self._check(n, ds_name, rule, specs[n]) for n, (ds_name, rule) in self.rules.items()}
        params = {n: ParamEntry(ParamSpec(**{**vars(s), "dtype": dtype}), steps[n])
                  for n, s in specs.items()}
        record = {"path": where, "name_map": str(self.map.path), "model": self.map.model,
                  "megatron": run}
        groups = self.map.param_groups()
        extra = {RECORD: record, **({} if groups else {RUN_HYPERPARAMETERS: True})}
        self.manifest = Manifest("universal", int(max(steps.values())), Layout(), 1, model, params,
                                 {"param_groups": groups, "grad_scaler": None}, None, extra,
                                 seed=1234)
        self.origin = {"kind": "deepspeed", "path": where, "name_map": str(self.map.path)}
        self._last: tuple[str, str, torch.Tensor] | None = None

    def _check(self, name: str, ds_name: str, rule: Rule, spec: ParamSpec) -> float:
        """Every state file of `ds_name` is there at a shape the rule's layout turns into the
        megatron-core parameter's; returns its Adam step. (The .pt files are memory-mapped: this
        reads their headers, not their data; `read` takes the mapped tensors.)"""
        for state in STATE_FILES:
            t = self._mapped.get((ds_name, state))
            if t is None:
                t = self._mapped[(ds_name, state)] = self.ds.tensor(ds_name, state)
            shape = tuple(t.shape)
            if not layouts.fits(rule.layout, shape, spec.shape):
                raise UCPError(f"{self.ds.file(ds_name, STATE_FILES[state])}: DeepSpeed parameter "
                               f"{ds_name!r} has shape {list(shape)}, but name map {self.map.path} "
                               f"{rule.describe()} makes it megatron-core's {name} of shape "
                               f"{list(spec.shape)} (layout {rule.layout} needs "
                               f"{layouts.expected_ds_shape(rule.layout, spec.shape)}); the map's "
                               "model settings are not the DeepSpeed run's")
        return self.ds.step(ds_name)

    @property
    def bytes_read(self) -> int:
        return self.ds.bytes_read

    @property
    def files_opened(self) -> int:
        return self.ds.files_opened

    def ds_name(self, name: str) -> str:
        """The DeepSpeed parameter that megatron-core parameter `name` comes from."""
        return self.rules[name][0]

    def step(self, name: str) -> float:
        return self.manifest.params[name].step

    def read(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        box = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        if self._last is None or self._last[:2] != (name, state):
            self._last = None  # drop the previous tensor before assembling the next
            ds_name, rule = self.rules[name]
            t = self._mapped.pop((ds_name, state), None)  # read once; later reads load again
            t = (self.ds.tensor(ds_name, state) if t is None else t).to(torch.float32)
            full = layouts.to_megatron(rule.layout, t, self.heads, self.manifest.params[name].shape[0],
                                       rule.qkv_blocks, f"{self.ds.file(ds_name, STATE_FILES[state])}")
            self._last = (name, state, full.contiguous())
        return self._last[2][box]

    def rng_ranks(self) -> list[int]:
        return []

    def rng(self, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
        return {}, {}
