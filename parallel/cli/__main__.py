"""`python -m wanmesh.parallel.cli`: the `wanmesh` command; runs in the CLI process."""

import sys

from . import main

sys.exit(main())
