"""The errors every layer raises or catches, in a module that imports nothing: a low module (a method's spec, the
canaries, an attack) can raise them without importing the module that defines what they are about."""


class ConfigError(ValueError):
    """Bad configuration; the message names the option and what it accepts."""


class FederationError(RuntimeError):
    """The federation could not run a round (no nodes, wrong nodes); the message says why."""


class Interrupted(RuntimeError):
    """The user asked to stop; completed rounds are kept."""
