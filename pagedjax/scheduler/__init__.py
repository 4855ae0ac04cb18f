"""Host side of pagedjax: plain Python and numpy, no JAX import."""
