"""The one exception the data pipeline raises for a user's mistake.

A `DataError` is a `ValueError` so the CLI can treat it like any other config error (exit 2, one
line, before any process starts). Every message names the config field at fault and the fix, so
the user never has to read a traceback from deep inside `datasets`.
"""


class DataError(ValueError):
    """A data config that cannot work: missing path, empty data, wrong column, too little data."""
