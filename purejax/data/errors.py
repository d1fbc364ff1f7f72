"""Errors of the data layer."""


class TokenizerError(ValueError):
  """A tokenizer cannot be built or used; the message says how to fix it."""
