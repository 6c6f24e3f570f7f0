"""`python -m lookahead_jax.generate`: hands over to the CLI (`lookahead_jax.cli`)."""

import sys

from ..cli import main
from ..core.compile import enable_compilation_cache
from ..interrupt import EXIT_INTERRUPTED, exit_now

enable_compilation_cache()  # the CLI's process only; main() called in-process leaves JAX alone
code = main()
if code == EXIT_INTERRUPTED:  # Ctrl-C: no interpreter teardown, which background compilations could crash
    exit_now(code, message="")
sys.exit(code)
