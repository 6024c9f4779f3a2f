"""``python -m benchmarks`` runs :mod:`benchmarks.run`."""

import sys

from benchmarks.run import main

sys.exit(main())
