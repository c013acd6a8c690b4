"""The source of a URL whose list names none: its site, the registrable domain (eTLD+1).

Politeness is per source, so the source must be the unit a website owner
runs: ``img1.example.co.uk`` and ``img2.example.co.uk`` are one site
(``example.co.uk``), while ``alice.github.io`` and ``bob.github.io`` are
two. The Public Suffix List says where a registrable domain starts, private
section included (the definition browsers use for a "site"); it comes from
``publicsuffixlist``'s bundled snapshot, read from disk once, never fetched.
"""
from __future__ import annotations

import ipaddress
from functools import lru_cache

from publicsuffixlist import PublicSuffixList

from common.contracts import MAX_SOURCE_LENGTH

_PSL = PublicSuffixList()  # the snapshot shipped in the package: no network at run time


@lru_cache(maxsize=65536)  # lists repeat their hosts; the cache keeps the lookup off the row cost
def site_of_host(host: str) -> str:
    """The source name of a normalised host (``common.hosts.normalise_host``'s output).

    A registrable domain where there is one; an IP address stands for itself (IPv6 with
    ``-`` for ``:``, as a source is ``[a-z0-9_.-]+``); a host that is itself a public
    suffix or a single label (``localhost``, ``github.io``) is its own site.
    """
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        site = _PSL.privatesuffix(host) or host
    else:
        site = address.compressed.replace(":", "-")
    return site[-MAX_SOURCE_LENGTH:]
