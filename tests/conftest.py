"""Test-wide settings: never reach a model hub, keep CPU threads modest on small CI machines."""

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# Shared test helpers (tests/vace_inputs.py, ...) import as top-level modules.
sys.path.insert(0, str(Path(__file__).resolve().parent))
