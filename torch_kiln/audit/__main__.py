"""``python -m torch_kiln.audit [options] script.py [args]``."""

import sys

from torch_kiln.audit.cli import main

sys.exit(main())
