"""``python -m dsv41_triton.perf`` = ``dsv41-bench``."""
import sys

from .cli import main

sys.exit(main())
