"""Errors of the federation runtime, importable without loading Flower or torch."""


class FederationError(RuntimeError):
    """The federation could not run a round (no nodes, wrong nodes); the message says why."""


class Interrupted(RuntimeError):
    """The user asked to stop; completed rounds are kept."""
