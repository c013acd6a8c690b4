"""``make demo``: the whole crawl on the local stack."""
