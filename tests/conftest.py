import os
import sys

# Tests run on the CPU, with every Pallas kernel in interpret mode.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))
