"""Alias kept for old command lines: ``python -m url_lists.export`` is current (SPEC.md §6)."""
from url_lists.export import main

if __name__ == "__main__":
    raise SystemExit(main())
