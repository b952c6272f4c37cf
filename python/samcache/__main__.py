"""``python -m samcache`` is the ``samcache`` command (bench, report)."""

import sys

from samcache.cli import main

sys.exit(main())
