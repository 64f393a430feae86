"""A module that raises while it is imported (a broken reward function module)."""

RATIO = 1 / 0
