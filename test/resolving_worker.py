"""``python -m test.resolving_worker``: ``python -m worker`` whose host names come from a file.

URL lists name sites by domain (``img1.site7.co.uk``), and sites per registrable
domain are what the list producer is tested for; but nothing here may ask a
DNS server. This worker reads the test's hosts file (``TEST_HOSTS_FILE``, JSON
``{"name": "127.0.x.y"}``) and answers every lookup from it, as /etc/hosts
would: a name not in it does not resolve, and no query leaves the machine.
"""
from __future__ import annotations

import ipaddress
import json
import os
import socket
from typing import Any

HOSTS_FILE_ENV = "TEST_HOSTS_FILE"


def answer_from(hosts: dict[str, str]) -> None:
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name in hosts:
            return real(hosts[name], port, *args, **kwargs)
        try:
            ipaddress.ip_address(name)
        except (TypeError, ValueError):
            raise socket.gaierror(socket.EAI_NONAME, f"{name} is not in the test's hosts file") from None
        return real(host, port, *args, **kwargs)

    socket.getaddrinfo = getaddrinfo


if __name__ == "__main__":
    with open(os.environ[HOSTS_FILE_ENV]) as listing:
        answer_from(json.load(listing))
    from worker.__main__ import main
    main()
