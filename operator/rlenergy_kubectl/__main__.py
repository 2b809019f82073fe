"""``python -m rlenergy_kubectl`` = ``kubectl-rlenergy``."""

import sys

from rlenergy_kubectl import cli

sys.exit(cli.main())
