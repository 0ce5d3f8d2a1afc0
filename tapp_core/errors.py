"""The base of every error a user can cause (bad model, cluster, plan, data, library).

Front ends catch ``TappError`` to print its message and exit non-zero; anything else is a bug.
"""


class TappError(ValueError):
    """An input TAPP cannot use; the message names what is wrong."""
