"""``python -m memlab.cli.report ...``: the same as ``memlab report ...``."""

import sys

from memlab.cli.report import main

sys.exit(main())
