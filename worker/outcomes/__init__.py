"""Outcomes: one URL's task to its single terminal outcome, and the statistics it counts."""
