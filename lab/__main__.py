"""`python -m lab`: run the lab (lab/main.py has the experiments' list and the command line)."""
import sys

from running import loading

loading.quiet_ctrl_c("python -m lab: interrupted while loading; nothing was written")
from lab import compare
from lab.main import main

loading.loaded()
try:
    main()
except KeyboardInterrupt:
    compare.stop_pools()              # no queued run starts; the workers go with this process
    print("python -m lab: interrupted; the experiments that finished are in SUMMARY.md", file=sys.stderr)
    sys.exit(130)                     # after the running runs' current step: each stops cleanly
