"""`python -m lookahead_jax.generate`: hands over to the CLI (`lookahead_jax.cli`)."""

import sys

from ..cli import main
from ..core.compile import enable_compilation_cache

enable_compilation_cache()  # the CLI's process only; main() called in-process leaves JAX alone
sys.exit(main())
