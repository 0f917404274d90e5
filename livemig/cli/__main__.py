"""`python -m livemig.cli`: what the `livemig` command runs."""

import sys

from livemig.cli import main

sys.exit(main())
