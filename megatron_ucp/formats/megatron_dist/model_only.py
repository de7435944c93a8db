"""A torch_dist save without optimizer state (Megatron-LM `--no-save-optim`, Megatron-Bridge's
`save_optim=False` and `save_megatron_model`) as a weights-only source."""

from __future__ import annotations

import logging

from megatron_ucp.formats.manifest import RUN_HYPERPARAMETERS, Manifest, ParamEntry
from megatron_ucp.formats.megatron_common import layout
from megatron_ucp.formats.megatron_dist.layout import plan_model
from megatron_ucp.spec import ParamSpec
from megatron_ucp.storage import DTYPE_NAMES

log = logging.getLogger(__name__)
MODEL_ONLY = "model_only"  # (the source's `sharding`) a save without optimizer state


def model_only(source, common: dict, args, check_names) -> None:
    """Make the torch_dist `source` a weights-only one (`Manifest.weights_only`): each weight in
    its stored dtype, from which a load starts the optimizer fresh (as from import-hf).
    check_names: the reader's (every model tensor there, every one used)."""
    source.sharding, source._objects, source.chain = MODEL_ONLY, {}, {}
    source.plan, model_cfg = plan_model(args, source._objects)
    check_names(source.reader, source.plan, MODEL_ONLY)
    lay = layout(args)
    source.origin = {"kind": f"{source.saved_by} torch_dist (model only)", "path": str(source.dir)}
    source.manifest = Manifest(
        "universal", int(common.get("iteration", getattr(args, "iteration", 0))), lay,
        lay.world_size, model_cfg,
        {n: ParamEntry(ParamSpec.from_json(
            {**p.spec, "dtype": DTYPE_NAMES[source.reader.meta[p.key].properties.dtype]}), 0.0)
         for n, p in source.plan.items()},
        {"param_groups": [], "grad_scaler": None}, None,
        {"consumed_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
         RUN_HYPERPARAMETERS: True},
        int(getattr(args, "seed", 1234)), weights_only=True)
    source._last = None
    log.info("planned %d parameters of %s (model only: the optimizer starts fresh)", len(source.plan),
             source.dir)
