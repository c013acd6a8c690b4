"""Intake: reading ``urls`` (the feed, the group join) and committing what finished (offsets)."""
