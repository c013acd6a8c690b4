"""URL lists in, results out: the parts behind ``url_lists.list_producer`` and ``url_lists.export``."""
