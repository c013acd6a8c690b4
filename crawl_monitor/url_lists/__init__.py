"""URL lists in, results out: the parts behind ``crawl_monitor.list_producer`` and ``crawl_monitor.export``."""
