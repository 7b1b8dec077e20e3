"""``python -m bench.peers``: the command line is in bench/peers/cli.py."""

import sys

from .cli import main

sys.exit(main())
