"""`python -m solo ...`: the same command line as the `solo` script."""

import sys

from solo.cli import main

sys.exit(main())
