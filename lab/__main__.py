"""`python -m lab`: run the lab (lab/main.py has the experiments' list and the command line)."""
import sys

from lab.main import main

try:
    main()
except KeyboardInterrupt:
    print("python -m lab: interrupted; the experiments that finished are in SUMMARY.md", file=sys.stderr)
    sys.exit(130)
