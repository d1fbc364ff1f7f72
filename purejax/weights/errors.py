"""The error every weight format raises."""


class ConversionError(ValueError):
  """Weights or a config that cannot be converted; the message says why and what to do."""
