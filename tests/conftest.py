import os
import sys

# Tests run on the CPU, with every Pallas kernel in interpret mode.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# LLM(...) compiles every bucket at construction by default; the suite builds hundreds of small
# engines, each compiling only the buckets it uses (tests/test_compile.py checks the default), and
# keeps no compiled programs between runs
os.environ.setdefault("PAGEDJAX_WARMUP", "0")
os.environ.setdefault("PAGEDJAX_COMPILATION_CACHE", "0")
sys.path.insert(0, os.path.dirname(__file__))
