"""`python -m lookahead_jax.distill`: hands over to the command line (`cli.py`)."""

import sys

from .cli import main

sys.exit(main())
