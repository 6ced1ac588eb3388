"""HiPress's version: on the ground floor, so that every layer can name it (ranks compare it
at start-up, profiles are cached by it) without importing the facade above it."""

__version__ = "0.1.0"
