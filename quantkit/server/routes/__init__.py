"""The HTTP routes, one module per endpoint family; each reads the app's :class:`ServerState`."""
