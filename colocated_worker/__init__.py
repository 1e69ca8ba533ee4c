"""Colocated worker: one engine doing both prefill and decode (the usual single-instance serving)."""
