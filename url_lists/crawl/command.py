"""``python -m url_lists crawl``: a URL list to a dataset in one command, here or with a fleet.

Everything is checked first (options, the list's files and columns, the output
folder, the servers' settings, the run the folder holds): a problem is one line and
exit status 2 before anything starts. Then, with no server settings in the
environment, it starts the local stack, a monitor and ``--processes_count``
workers (``local.LocalCrawl``); with a fleet's (``KAFKA_HOSTS``, ``REDIS_URL``, S3)
it starts nothing. It reads the list into input shards and produces it
(``feed.Feed``) while the collector (``url_lists.dataset``) writes each outcome into
the dataset, shows a progress bar, and prints the summary once every accepted row
has its outcome (exit 0). Ctrl-C or SIGTERM stops everything it started (exit 130);
the same command run again resumes: only rows with no outcome in the folder are
crawled, and none is written twice.
"""
from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from types import FrameType

from common.settings import Settings, SettingsError
from url_lists.crawl import checks
from url_lists.crawl.checks import Listing
from url_lists.crawl.local import user_agent
from url_lists.crawl.options import CrawlOptions, OptionError, parse

EXIT_BAD_INPUT = 2


def check(argv: list[str], env: Mapping[str, str]) -> tuple[CrawlOptions, Listing, bool]:
    """Everything that can be known before starting; OptionError with one line otherwise."""
    options = parse(argv)
    listing = checks.listing(options)
    checks.writable_folder(options.output_folder)
    distributed = checks.fleet(env)
    try:
        Settings.from_env({**env, "TARGET_RESOLUTION": str(options.image_size),
                           "CRAWL_USER_AGENT": user_agent(env, options.user_agent_token)})
    except SettingsError as exc:
        raise OptionError(str(exc)) from None
    checks.existing_run(options, listing.files)
    return options, listing, distributed



def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    env = dict(os.environ)
    try:
        options, listing, distributed = check(argv, env)
    except OptionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for warning in options.warnings:
        print(warning, file=sys.stderr)
    if distributed:
        print("warning: with a fleet, its workers' TARGET_RESOLUTION and CRAWL_USER_AGENT apply: "
              "--image_size must match the first", file=sys.stderr)
    from url_lists.crawl.run import CrawlRun  # the crawl's machinery, once the input is known good

    crawl = CrawlRun(options, listing, distributed, env)

    def interrupt(_signum: int, _frame: FrameType | None) -> None:
        crawl.stop.set()

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return crawl.execute()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
