"""`python -m pdserve.bench ARGS`: the same as `pdserve bench ARGS`."""
import sys

from pdserve.bench.command import main

sys.exit(main())
