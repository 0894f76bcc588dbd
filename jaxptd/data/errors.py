"""The data package's one error type, `DataError`, imported by every module of it (and by
the entry points that print it)."""


class DataError(ValueError):
    """A data problem a user can cause (path, corpus contents, split too short).

    The message is one line naming the value and the rule; entry points print it as
    ``error: <message>`` and exit with status 2.
    """
