"""Imaging: the process pool that decodes and measures a body, and the thumbnail's storage."""
