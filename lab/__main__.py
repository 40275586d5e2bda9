"""`python -m lab`: run the lab (lab/main.py has the experiments' list and the command line)."""
import sys

from lab import compare
from lab.main import main

try:
    main()
except KeyboardInterrupt:
    compare.stop_pools()              # no queued run starts; the workers go with this process
    print("python -m lab: interrupted; the experiments that finished are in SUMMARY.md", file=sys.stderr)
    sys.exit(130)                     # after the running runs' current step: each stops cleanly
