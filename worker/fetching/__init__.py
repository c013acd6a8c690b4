"""Fetching: a source's token, then the download into shared memory."""
