import sys
from pathlib import Path

# ranks.py (the launcher) lives one folder up
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
