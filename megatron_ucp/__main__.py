import sys

from megatron_ucp.cli import main

sys.exit(main())
