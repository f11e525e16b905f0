"""tileplug.backend_template: the template of a third-party tileplug backend.

Nothing here is imported by users: tileplug finds the backend through the entry point
``template = "tileplug.backend_template.plugin"`` (group ``tileplug.backends``) and calls
the plugin's ``tileplug_backends()`` hook. Users keep calling ``core.ops.*``.
"""

__version__ = "0.1.0"
