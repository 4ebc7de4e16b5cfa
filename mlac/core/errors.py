"""The one exception type that the CLI turns into a one-line error."""


class MlacError(Exception):
    """A user-facing error: bad input, a refused option, a corrupt file.

    The message is a single line that names the problem (file, tensor, field, value) and, where
    there is one, what to do about it. The CLI prints it as `error: <message>` with exit code 1.
    """
