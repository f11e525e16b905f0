"""Adapters that let ``tileplug bench --peer`` time other kernel libraries on tileplug's cases.

Each module holds functions named like tileplug's ops, with the same signatures, that make
the same call through a peer library (or raise ``TypeError`` naming what the peer cannot do,
which the bench reports as "not comparable"). A module imports its library when it is
imported, which happens only when a bench asks for that peer: core never depends on them.
"""
