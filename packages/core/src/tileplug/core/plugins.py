"""The pluggy hook specification of tileplug backends and the plugin manager.

A backend distribution declares an entry point in the group ``tileplug.backends`` whose
value is a module (or object) implementing::

    from tileplug.core.plugins import hookimpl

    @hookimpl
    def tileplug_backends():
        return [Backend(...)]
"""

from __future__ import annotations

from collections.abc import Iterable

import pluggy

PROJECT_NAME = "tileplug"
ENTRY_POINT_GROUP = "tileplug.backends"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class BackendHookSpec:
    """Hooks a backend plugin implements."""

    @hookspec
    def tileplug_backends(self) -> Iterable[object]:
        """Return the :class:`tileplug.core.Backend` objects this plugin provides."""


def new_plugin_manager() -> pluggy.PluginManager:
    """A plugin manager that knows tileplug's hook specification."""
    manager = pluggy.PluginManager(PROJECT_NAME)
    manager.add_hookspecs(BackendHookSpec)
    return manager
