# Lets `pytest` import the flat top-level modules (advantages.py, ...) from tests/.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
