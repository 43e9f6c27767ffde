"""``python -m cachefleet_operator.kubectl_plugin``: the same as ``kubectl-cachefleet``."""

import sys

from cachefleet_operator.kubectl_plugin.cli import main

sys.exit(main())
