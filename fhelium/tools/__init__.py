"""Command-line tools for fhelium IR (`python -m fhelium.tools.opt`)."""
