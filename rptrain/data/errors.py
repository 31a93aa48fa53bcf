"""The one exception type the data layer raises for bad input."""


class DataError(ValueError):
    """Bad data input: a missing or malformed dataset, a wrong path or a bad value.

    The message is one line that names the path or config key at fault and
    says how to fix it, so the CLI can print it instead of a traceback.
    """
