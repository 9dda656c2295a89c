"""The command-line tools behind `python -m toolkit`: doctor, verify, compare, sweep, catalog (ls), launch."""
