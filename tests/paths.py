"""Where the tests find the project and their data, wherever a test module sits."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent  # the repository
DATA = TESTS / "data"
SAMPLE = ROOT / "sample-repo"
