"""``python -m test.resolving_crawl crawl ...``: ``python -m url_lists crawl`` whose workers are
``test.resolving_worker`` (host names from the test's hosts file, never DNS); nothing else differs."""
from __future__ import annotations

import sys

from url_lists.crawl import local

if __name__ == "__main__":
    local.WORKER_MODULE = "test.resolving_worker"
    from url_lists.__main__ import main
    sys.exit(main())
