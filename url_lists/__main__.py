"""``python -m url_lists COMMAND``: ``crawl`` (a URL list to a dataset in one command); the list
producer and the exporter stay ``python -m url_lists.list_producer`` and ``url_lists.export``."""
from __future__ import annotations

import sys

USAGE = ("usage: python -m url_lists crawl --url_list LIST --output_folder DIR [img2dataset's options]\n"
         "       python -m url_lists crawl --help")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "crawl":
        print(USAGE, file=sys.stderr)
        return 2
    from url_lists.crawl.command import main as crawl
    return crawl(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
