"""pagedjax."""
