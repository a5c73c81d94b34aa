"""Example Cascade environment plug-in (see README.md)."""
