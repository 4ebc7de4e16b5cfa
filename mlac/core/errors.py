"""The exception types that the CLI turns into a one-line error, each with its exit code.

    exit 1  MlacError          bad input: a missing or invalid file, option or value, a refused plan
    exit 2                     a command-line usage error (click's own: unknown flag, bad flag value)
    exit 3  IntegrityError     bytes that do not match their digest, a tampered or incomplete artifact,
                               a signature that does not verify
    exit 4  TargetMismatch     the artifact or a kernel-cache unit was made for another GPU target
    exit 5  RegistryError      an OCI registry or the network failed: unreachable, refused, not found
    exit 130                   interrupted (Ctrl-C)

Pipelines branch on these codes (docs/ci.md): retry a registry error, alarm on an integrity error.
"""


class MlacError(Exception):
    """A user-facing error: bad input, a refused option, a corrupt file.

    The message is a single line that names the problem (file, tensor, field, value) and, where
    there is one, what to do about it. The CLI prints it as `error: <message>` with `exit_code`.
    """

    exit_code = 1


class IntegrityError(MlacError):
    """Bytes that are not what their digest or signature says they are."""

    exit_code = 3


class TargetMismatch(MlacError):
    """Compiled for another GPU target than the one here."""

    exit_code = 4


class RegistryError(MlacError):
    """An OCI registry or the network between: unreachable, an HTTP error, a missing tag or blob."""

    exit_code = 5
