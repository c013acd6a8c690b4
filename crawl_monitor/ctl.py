"""Operator commands for a running crawl: ``python -m crawl_monitor.ctl --help``.

SPEC.md §2's ``redis-cli`` procedure still works; this does the same in one
step and checks its input first, because Redis accepts anything: a typo in
``set override_rate:flikr 5`` or a rate of ``5/s`` silently does nothing
while the real source keeps crawling.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import asdict
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common.contracts import (HALTED, INBOUND_SOURCES, TEMP_HALTED, adaptive_off_key, last_50_key,
                              override_rate_key, tokens_key)
from common.redis_values import as_text
from common.settings import load_settings
from crawl_monitor.constants import BUCKET_TTL_MS
from crawl_monitor.source_state import SourceState, read_sources

EXIT_REDIS = 1
EXIT_BAD_INPUT = 2  # argparse's own code for usage errors
SOURCE_HELP = "a source the splitter has seen, such as flickr (case does not matter)"

EXAMPLES = """\
examples:
  python -m crawl_monitor.ctl status
  python -m crawl_monitor.ctl override flickr 5        # at most 5 requests/s to flickr
  python -m crawl_monitor.ctl override smithsonian 0.5 # one request every 2 s
  python -m crawl_monitor.ctl clear-override flickr    # back to the rate computed from its size
  python -m crawl_monitor.ctl halt flickr              # stop crawling flickr now
  python -m crawl_monitor.ctl resume flickr            # after a halt: read the monitor's crawl_halted
                                                       # log first, lower the rate if needed
  python -m crawl_monitor.ctl adaptive flickr off      # crawl flickr at its limit however slowly it answers
  python -m crawl_monitor.ctl adaptive flickr on       # let its response times set its rate again

Redis is REDIS_URL from the environment (default redis://localhost:6379/0).
Sources are the ones the splitter has seen (the inbound_sources set).
"""


class CtlError(Exception):
    """A mistake the operator can fix; its text is printed as one line."""

    def __init__(self, message: str, code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.code = code


def parse_rate(raw: str) -> float:
    try:
        rate = float(raw)
    except ValueError:
        raise CtlError(f"rate {raw!r} is not a number: give requests per second, such as 5 or 0.5") from None
    if not math.isfinite(rate) or rate <= 0:
        raise CtlError(f"rate {raw!r} must be a positive number of requests per second")
    return rate


async def known_source(redis: aioredis.Redis, raw: str) -> str:
    """The splitter lower-cases sources, so ``Flickr`` means ``flickr``."""
    source = raw.strip().lower()
    if await redis.sismember(INBOUND_SOURCES, source):
        return source
    known = sorted(as_text(s) for s in await redis.smembers(INBOUND_SOURCES))
    listed = ", ".join(known[:10]) + (f" and {len(known) - 10} more" if len(known) > 10 else "")
    raise CtlError(f"unknown source {raw!r}: not in {INBOUND_SOURCES} "
                   f"({'known: ' + listed if known else 'no source seen yet'})")


def _whole(value: float | None) -> float | None:
    return None if value is None else float(round(value))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:g}" if value == int(value) else f"{value:.2f}"


def format_status(sources: dict[str, SourceState]) -> str:
    if not sources:
        return f"no sources yet ({INBOUND_SOURCES} is empty)"
    lines = [f"{'SOURCE':<24} {'STATE':<7} {'LIMIT':>8} {'OVERRIDE':>8} {'CEILING':>8} {'ALLOWED':>8} {'RESP MS':>11} "
             f"{'TOKENS':>7} {'REQUESTS':>10} {'SUCCESSES':>10} {'BACKLOG':>9}  ERRORS"]
    for name, s in sources.items():
        state = HALTED if s.halted else "paused" if s.temp_halted else "ok"  # named after its set
        errors = ", ".join(f"{status}: {n}" for status, n in sorted(s.errors.items(), key=lambda e: -e[1]))
        # LIMIT: computed or overridden; CEILING: the most it may be granted (capacity discovery's
        # ceiling, else the limit); ALLOWED: what the adaptive back-off grants now.
        limit = next((rate for rate in (s.limit, s.ceiling, s.rate_limit) if rate is not None), None)
        ceiling = s.ceiling if s.ceiling is not None else limit
        allowed = _fmt(s.rate_limit) if s.adaptive else "off"
        response = f"{_fmt(_whole(s.baseline_ms))}/{_fmt(_whole(s.recent_ms))}"
        lines.append(f"{name:<24} {state:<7} {_fmt(limit):>8} {_fmt(s.override):>8} {_fmt(ceiling):>8} {allowed:>8} "
                     f"{response:>11} "
                     f"{_fmt(s.tokens):>7} {s.requests:>10} {s.successes:>10} {s.backlog:>9}  "
                     f"{s.error_total}{f' ({errors})' if errors else ''}")
    return "\n".join(lines)


async def run(args: argparse.Namespace, redis: aioredis.Redis) -> str:
    """Carry out one command; return the line(s) to print."""
    if args.command == "status":
        sources = await read_sources(redis)
        if args.json:
            return json.dumps({name: asdict(state) for name, state in sources.items()}, indent=2)
        return format_status(sources)
    rate = parse_rate(args.rate) if args.command == "override" else None
    source = await known_source(redis, args.source)
    if rate is not None:  # override
        await redis.set(override_rate_key(source), rate)
        return f"{source}: rate limit overridden to {rate:g} requests/s (the monitor applies it within a second)"
    if args.command == "clear-override":
        removed = await redis.delete(override_rate_key(source))
        return (f"{source}: override removed, the rate computed from its size applies again" if removed
                else f"{source}: had no override")
    if args.command == "adaptive":
        if args.switch == "off":
            await redis.set(adaptive_off_key(source), 1)
            return (f"{source}: adaptive back-off off; it is granted its whole limit however slowly "
                    f"its site answers (within a second)")
        removed = await redis.delete(adaptive_off_key(source))
        return (f"{source}: adaptive back-off on; its rate follows its site's response times again" if removed
                else f"{source}: adaptive back-off was already on")
    if args.command == "halt":
        # Empty the bucket too, so workers stop now rather than spend this second's tokens.
        pipe = redis.pipeline()
        pipe.sadd(HALTED, source)
        pipe.set(tokens_key(source), 0, px=BUCKET_TTL_MS)  # as the regulator sets it: no key outlives its source
        await pipe.execute()
        return f"{source}: halted; nothing is fetched until `python -m crawl_monitor.ctl resume {source}`"
    # resume: SPEC.md §2's procedure (del statuslast50req, srem halted) plus the temporary halt.
    pipe = redis.pipeline()
    pipe.delete(last_50_key(source))
    pipe.srem(HALTED, source)
    pipe.srem(TEMP_HALTED, source)
    _, was_halted, was_paused = await pipe.execute()
    if not (was_halted or was_paused):
        return f"{source}: was not halted; cleared its last-50 status window"
    return f"{source}: resumed; cleared its last-50 status window and removed it from the halted sets"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m crawl_monitor.ctl",
        description="Inspect and steer a running crawl through Redis: see every source's rate,\n"
                    "counters and halts; override a source's rate limit; halt or resume a source.",
        epilog=EXAMPLES,
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=30))
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    status = commands.add_parser("status", help="every source: state, rate limit, tokens, counters, backlog, errors",
                                 description="Print every source the splitter has seen with its state "
                                             "(ok, paused, halted), rate limit, override, tokens, counters and "
                                             "backlog (URLs split and not yet ended: waiting, in flight or "
                                             "to be retried).")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    override = commands.add_parser("override", help="set a source's rate limit (requests/s)",
                                   description="Set override_rate:SOURCE; it wins over the rate computed "
                                               "from the source's size until clear-override.")
    override.add_argument("source", metavar="SOURCE", help=SOURCE_HELP)
    override.add_argument("rate", metavar="RATE", help="requests per second, a positive number (0.5 = one every 2 s)")
    adaptive = commands.add_parser(
        "adaptive", help="switch the adaptive back-off off or on for a source",
        description="off sets adaptive_off:SOURCE: the source is granted its whole limit however slowly its "
                    "site answers. on deletes it: the rate follows the site's response times again.")
    adaptive.add_argument("source", metavar="SOURCE", help=SOURCE_HELP)
    adaptive.add_argument("switch", choices=("on", "off"))
    for name, help_text, description in (
        ("clear-override", "go back to the computed rate limit",
         "Delete override_rate:SOURCE: the rate computed from the source's size applies again."),
        ("halt", "stop crawling a source now",
         "Add SOURCE to the halted set and empty its token bucket; its URLs wait in their topic."),
        ("resume", "resume a halted or paused source",
         "The operator procedure in one step: del statuslast50req:SOURCE, srem halted SOURCE, "
         "srem temp_halted SOURCE. Read the monitor's crawl_halted log and lower the rate first if needed."),
    ):
        command = commands.add_parser(name, help=help_text, description=description)
        command.add_argument("source", metavar="SOURCE", help=SOURCE_HELP)
    return parser


def _redacted(url: str) -> str:
    """Never echo a Redis password to a terminal."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{parts.hostname}"
                                            f"{f':{parts.port}' if parts.port else ''}"))


async def _main(args: argparse.Namespace, redis_url: str) -> str:
    redis = aioredis.from_url(redis_url, decode_responses=True, socket_connect_timeout=5)
    try:
        return await run(args, redis)
    except RedisError as exc:
        raise CtlError(f"cannot use Redis at {_redacted(redis_url)}: {exc}", EXIT_REDIS) from None
    finally:
        await redis.aclose()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    redis_url = load_settings().redis_url
    try:
        print(asyncio.run(_main(args, redis_url)))
    except CtlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
