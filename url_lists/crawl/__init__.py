"""``python -m url_lists crawl``: the command line, the embedded local crawl and the input stage."""
