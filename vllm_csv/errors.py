"""Errors that reach users: one clear line, no traceback needed to act on them."""


class CSVError(Exception):
    """A user-facing vllm-csv error (bad input, mismatched or corrupt index, unsupported head)."""
