"""Collectives between the processes of a plan: the shared-memory all-reduce (``shm``)."""

from .shm import CollectiveError, ShmGroup

__all__ = ["CollectiveError", "ShmGroup"]
