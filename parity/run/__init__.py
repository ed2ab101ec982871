"""Side-by-side runs, their report, and the `parity` command line."""
