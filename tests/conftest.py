import sys
from pathlib import Path

# tests/helpers.py is imported by name from the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent))
