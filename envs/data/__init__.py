"""Small data files shipped with the environments (e.g. the built-in math sample)."""
