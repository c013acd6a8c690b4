"""Alias kept for old command lines: ``python -m url_lists.tsv_producer`` is current (SPEC.md §6)."""
from url_lists.tsv_producer import main

if __name__ == "__main__":
    raise SystemExit(main())
