"""Every named status a request can end with (SPEC.md §2), and what each one means.

The names are the wire format: Redis windows and counters, and the ``reason`` of
``crawl_errors``, carry them as text, and a ``StrEnum`` member is that text. The policy
is data beside each name, so a new status states whether it is retried, whether it
says anything about the site's health, and whether the site ever saw a request.
HTTP codes are statuses too, written as their digits (``"404"``); ``is_expected``
judges both.
"""
from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    TIMEOUT = "Timeout"                          # connect, silence or total
    SERVER_DISCONNECTED = "ServerDisconnected"   # the connection ended before the response did
    CONNECTION_ERROR = "ConnectionError"         # no address of the host took the connection
    SSL_ERROR = "SSLError"
    BAD_RESPONSE = "BadResponse"                 # framing that HTTP/1.1 (llhttp) refuses
    TOO_LARGE = "TooLarge"                       # past MAX_IMAGE_BYTES
    TOO_MANY_REDIRECTS = "TooManyRedirects"
    BAD_REDIRECT = "BadRedirect"                 # a Location that is not a crawlable URL
    INVALID_URL = "InvalidURL"                   # a URL that cannot be sent as it is
    FORBIDDEN_ADDRESS = "ForbiddenAddress"       # the SSRF guard: not a globally routable address
    ROBOTS_DISALLOWED = "RobotsDisallowed"       # the site's robots.txt says no
    ROBOTS_UNAVAILABLE = "RobotsUnavailable"     # robots.txt unreachable for ROBOTS_UNAVAILABLE_GIVE_UP
    OPTED_OUT = "OptedOut"                       # another consent signal says no (opted_out topic)
    TDMREP_UNAVAILABLE = "TdmRepUnavailable"     # tdmrep.json unreachable for ROBOTS_UNAVAILABLE_GIVE_UP
    UNIDENTIFIED_IMAGE = "UnidentifiedImageError"  # the body is no image Pillow knows
    DECOMPRESSION_BOMB = "DecompressionBomb"     # more pixels than MAX_IMAGE_PIXELS
    IMAGE_WORKER_CRASHED = "ImageWorkerCrashed"  # the decoder died on it, twice
    IMAGE_TIMEOUT = "ImageTimeout"               # the decoder did not answer within IMAGE_TIMEOUT
    # A downstream of ours refused this one URL's output (not an outage, which is waited out):
    THUMBNAIL_REFUSED = "ThumbnailRefused"       # S3 answered the thumbnail's PUT with a 4xx about it
    MESSAGE_REFUSED = "MessageRefused"           # Kafka refused an outcome message (too large, invalid)
    REDIS_REFUSED = "RedisRefused"               # Redis refused a command on a value of this URL's


# The policy. A member is equal to (and hashes as) its text, so these answer for a
# status read back from Redis as well; an unknown name (an unexpected exception's
# class name) is neither retried nor expected.
RETRYABLE = frozenset({Status.TIMEOUT, Status.SERVER_DISCONNECTED, Status.CONNECTION_ERROR})
EXPECTED = frozenset({Status.UNIDENTIFIED_IMAGE, Status.ROBOTS_DISALLOWED, Status.OPTED_OUT})
# A site's consent refused: the URL ends in opted_out, counted per signal, never as an error.
OPT_OUTS = frozenset({Status.ROBOTS_DISALLOWED, Status.OPTED_OUT})
# The per-origin rules files whose outage makes a URL wait (worker.parking.wait_topics), not end.
RULES_UNAVAILABLE = frozenset({Status.ROBOTS_UNAVAILABLE, Status.TDMREP_UNAVAILABLE})
# Refused before the image was requested: the windows judge the site's answers to requests.
# So are S3's and Kafka's refusals of one URL's output: they say nothing of the site (nor may
# a hostile upstream message halt a source through them). Redis's are counted: no message's
# value reaches Redis unvalidated, so they come from a source's (or origin's) state gone
# wrong (an operator's SET of the wrong type), and the breaker then halts the source
# instead of letting every one of its URLs end in crawl_errors.
NOT_IN_WINDOWS = frozenset({Status.FORBIDDEN_ADDRESS, Status.ROBOTS_UNAVAILABLE, Status.TDMREP_UNAVAILABLE,
                            Status.THUMBNAIL_REFUSED,
                            Status.MESSAGE_REFUSED})
EXPECTED_HTTP = frozenset({200, 404, 410})  # and every 3xx
# Answers (or silences) that say the site is short of capacity rather than that a URL is
# bad: they slow a source down (crawl_monitor.adaptive) before the breaker would stop it.
# A 500 is left out: it is most often one page's bug, and some sites answer a share with it.
OVERLOAD = frozenset({Status.TIMEOUT, Status.SERVER_DISCONNECTED, Status.CONNECTION_ERROR,
                      "429", "502", "503", "504"})


def is_retryable(status: str) -> bool:
    """Transient: worth another attempt through ``inbound_images``."""
    return status in RETRYABLE


def is_expected(status: str) -> bool:
    """Says nothing bad about the site's health, so never trips a breaker: a name, or an
    HTTP code's digits."""
    if status.isdigit():
        code = int(status)
        return code in EXPECTED_HTTP or 300 <= code < 400
    return status in EXPECTED


def is_overload(status: str) -> bool:
    return status in OVERLOAD


def in_windows(status: str) -> bool:
    """Recorded in the breaker's status windows."""
    return status not in NOT_IN_WINDOWS
