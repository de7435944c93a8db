#!/usr/bin/env python3
"""Offline reshard on a CPU box (no GPU, no process group); same as `megatron-ucp reshard`.

    python tools/reshard.py --load /ckpts/run7 --save /ckpts/run7_universal --target-tp 1 --target-pp 4

Detects the source format (megatron-ucp fragments or universal, Megatron-LM torch or torch_dist),
writes the layout-free universal form with the optimizer state, and checks that the target layout
can hold the model. Resume it at the target layout with megatron_ucp.load or Megatron-LM's
--universal-checkpoint.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_ucp.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["reshard", *sys.argv[1:]]))
