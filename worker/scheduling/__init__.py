"""Scheduling: which URL starts next, on which slot, and how many a source may hold here."""
